"""Every ordinary mistake with ``python -m benchmarks`` (the suite, ``--compare``, ``ab``) and
``python -m vit_kernels.selftest`` ends with exit code 2 and exactly one line on stderr naming what
was wrong and what was expected: never a traceback, never a run started first. And every ``--help``
names the defaults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import cli
from benchmarks.__main__ import main as bench_main
from vit_kernels import selftest

ROOT = Path(__file__).resolve().parents[1]
BENCH = "benchmarks"
SELFTEST = "vit_kernels.selftest"
TIMEOUT = 120  # a mistake is found before any work: seconds, however loaded the machine


def _row(**fields) -> dict:
    row = {
        "kind": "op",
        "op": "layer_norm",
        "shape": "B=8",
        "dtype": "float32",
        "backend": "torch",
        "mode": "forward",
        "median_ms": 1.0,
        "q20_ms": 0.9,
        "q80_ms": 1.1,
        "samples_ms": [0.9, 1.0, 1.1],
    }
    return {k: v for k, v in {**row, **fields}.items() if v is not None}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A valid results file, damaged ones of each kind, a text file and a folder."""
    folder = tmp_path_factory.mktemp("bad-bench-inputs")
    (folder / "good.json").write_text(json.dumps({"meta": {}, "rows": [_row()]}))
    (folder / "notes.txt").write_text("not JSON at all")
    (folder / "list.json").write_text("[1, 2]")
    (folder / "bad-row.json").write_text(json.dumps({"rows": [_row(kind=None)]}))
    (folder / "bad-median.json").write_text(json.dumps({"rows": [_row(median_ms=-3)]}))
    return folder


GOOD = "{root}/good.json"
COMPARE = ["--compare", GOOD, "--results", GOOD]  # a valid regression gate, to add one mistake to
AB = ["ab", "--baseline", "HEAD"]  # a valid A/B run, likewise
# (command, arguments with {root} for the fixture's folder, what the one line must say)
BAD_INPUTS = [
    (BENCH, ["--quick", "--ops", "convolution"], "--ops: unknown op 'convolution'; choose from"),
    (BENCH, ["--quick", "--dtypes", "float8"], "--dtypes: unknown dtype 'float8'; choose from float32"),
    (BENCH, ["--quick", "--modes", "sideways"], "--modes: unknown mode 'sideways'; choose from forward"),
    (BENCH, ["--quick", "--threads", "0"], "argument --threads: must be 1 or more, got '0'"),
    (BENCH, ["--quick", "--threads", "many"], "argument --threads: expected a positive integer, got 'many'"),
    (BENCH, ["--quick", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (BENCH, ["--quick", "--device", "cuda:99"], "--device cuda:99: "),
    (BENCH, ["--quick", "--bogus"], "unrecognized arguments: --bogus"),
    (BENCH, ["--quick", "--out", "{root}"], "--out {root}: is a folder, expected a file name"),
    (BENCH, ["--quick", "--markdown", "{root}/notes.txt/r.md"], "{root}/notes.txt is a file, not a folder"),
    (
        BENCH,
        ["--quick", "--plots", "{root}/notes.txt"],
        "--plots {root}/notes.txt: exists and is not a folder",
    ),
    (BENCH, ["--compare", GOOD], "--compare BASELINE and --results CURRENT go together"),
    (
        BENCH,
        ["--compare", "{root}/missing.json", "--results", GOOD],
        "cannot read benchmark results from {root}/missing.json: No such file or directory",
    ),
    (
        BENCH,
        ["--compare", "{root}", "--results", GOOD],
        "cannot read benchmark results from {root}: Is a directory",
    ),
    (
        BENCH,
        ["--compare", GOOD, "--results", "{root}/notes.txt"],
        "{root}/notes.txt is not a benchmark results file: not JSON",
    ),
    (
        BENCH,
        ["--compare", "{root}/list.json", "--results", GOOD],
        "expected a JSON object with a 'rows' list",
    ),
    (BENCH, ["--compare", "{root}/bad-row.json", "--results", GOOD], "{root}/bad-row.json: row 0 lacks kind"),
    (
        BENCH,
        ["--compare", GOOD, "--results", "{root}/bad-median.json"],
        "row 0 has median_ms -3, expected a positive",
    ),
    (BENCH, [*COMPARE, "--threshold", "-1"], "--threshold must be a fraction such as 0.05"),
    (BENCH, [*COMPARE, "--confidence", "2"], "--confidence must be in [0.5, 1), got 2.0"),
    (BENCH, ["ab"], "the following arguments are required: --baseline"),
    (BENCH, [*AB, "--ops", "nope"], "--ops: unknown ['nope']; choose from"),
    (BENCH, [*AB, "--shapes", "vit_digits:x"], "--shapes: expected MODEL:BATCH such as vit_digits:8"),
    (BENCH, [*AB, "--confirmations", "0"], "--confirmations must be at least 1, got 0"),
    (BENCH, [*AB, "--budget", "-1"], "--budget must be a positive number, got -1.0"),
    (
        BENCH,
        ["ab", "--baseline", "no-such-revision", "--models", "none"],
        "'no-such-revision' is not a commit in",
    ),
    (BENCH, [*AB, "--repo", "{root}/missing"], "--repo {root}/missing: expected the folder of a"),
    (SELFTEST, ["--ops", "convolution"], "argument --ops: expected a comma-separated subset of patch_embed"),
    (SELFTEST, ["--threads", "0"], "argument --threads: must be 1 or more, got '0'"),
    (SELFTEST, ["--out", "{root}"], "cannot write {root}: Is a directory"),
    (
        SELFTEST,
        ["--out", "{root}/notes.txt/r.json"],
        "cannot write {root}/notes.txt/r.json: {root}/notes.txt: File exists",
    ),
    (SELFTEST, ["--bogus"], "unrecognized arguments: --bogus"),
]


def _run(command: str, args: list[str], capsys) -> SimpleNamespace:
    """``python -m <command> <args>`` in this process, as its ``__main__`` runs it: (returncode,
    stdout, stderr). ``test_the_module_entry_points_print_one_line`` checks the entry points
    themselves in child processes."""
    if command == BENCH:
        prog = "python -m benchmarks" + (" ab" if args[:1] == ["ab"] else "")
        work = lambda: cli.run(prog, lambda: bench_main(args))  # noqa: E731 - as benchmarks/__main__.py
    else:
        work = lambda: selftest.main(args)  # noqa: E731
    capsys.readouterr()
    try:
        code = work()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code or 0, stdout=captured.out, stderr=captured.err)


def _id(case) -> str:
    command, args, _ = case
    return ("selftest " if command == SELFTEST else "benchmarks ") + " ".join(args)


@pytest.mark.parametrize("index", range(len(BAD_INPUTS)), ids=[_id(c) for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(root, capsys, index):
    command, args, expected = BAD_INPUTS[index]
    done = _run(command, [a.replace("{root}", str(root)) for a in args], capsys)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    prog = "python -m vit_kernels.selftest" if command == SELFTEST else "python -m benchmarks"
    assert lines[0].startswith(prog) and ": error: " in lines[0], lines[0]
    assert expected.replace("{root}", str(root)) in lines[0], lines[0]
    assert done.stdout.strip() == "", done.stdout  # refused before any work or output


def _options_with_values(help_text: str) -> list[str]:
    """The help entries of options that take a value (``--name VALUE``), each with its text."""
    entries, current = [], None
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            current = [line]
            entries.append(current)
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    joined = [" ".join(part.strip() for part in entry) for entry in entries]
    return [entry for entry in joined if re.match(r"^--[\w-]+ [A-Z_.:,]+", entry)]


@pytest.mark.parametrize(
    "command,args,expected",
    [
        (
            BENCH,
            ["--help"],
            [
                "(default: 0.05)",
                "(default: 0.95)",
                "(default: forward,backward,full)",
                "the cores this process may use",
            ],
        ),
        (BENCH, ["ab", "--help"], ["(default: 4)", "(default: 300.0)", "(default: 10)", "(default: 400)"]),
        (SELFTEST, ["--help"], ["(default: build/selftest.json)", "(default: all)", "(default: torch's)"]),
    ],
    ids=["benchmarks", "benchmarks ab", "selftest"],
)
def test_help_names_every_default(command, args, expected, capsys):
    done = _run(command, args, capsys)
    assert done.returncode == 0, done.stderr
    for text in expected:
        assert text in " ".join(done.stdout.split()), (text, done.stdout)
    entries = _options_with_values(done.stdout)
    assert len(entries) >= 3, done.stdout
    for entry in entries:
        assert "default" in entry or "(required)" in entry, entry


@pytest.mark.parametrize("module", ["benchmarks", "vit_kernels.selftest"])
def test_the_module_entry_points_print_one_line(module):
    """``python -m`` itself, in a child process: a bad input is one line on stderr and exit code 2."""
    # Warnings off: one that importing torch or the package may print on some machine (an extension
    # built for another torch) is not the CLI's error line, whose count is what is tested here.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"python -m {module}: error: "), done.stderr
    assert "unrecognized arguments: --bogus" in lines[0] and done.stdout.strip() == "", done.stdout
