"""The A/B regression gate on real code and a real loaded machine.

A throwaway git repository holds this checkout's library twice: a baseline commit, and a candidate
commit whose ``vit_kernels.layer_norm`` burns 25% more time than the call it wraps. ``python -m
benchmarks ab`` then runs each side in its own process from its own exported tree:

* the baseline against itself, with busy-loop processes hogging the cores the sides run on, is
  never reported as a regression;
* the slowed candidate is reported as a regression in layer_norm, and in no other op.

Small shapes: a round of every case takes a fraction of a second.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import ab, gate, stats
from benchmarks.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
SLOWDOWN = """

import time as _time

_layer_norm_at_full_speed = layer_norm


def layer_norm(*args, **kwargs):  # 25% slower: spin for a quarter of the call's own time
    started = _time.perf_counter()
    out = _layer_norm_at_full_speed(*args, **kwargs)
    elapsed = _time.perf_counter() - started
    while _time.perf_counter() - started < 1.25 * elapsed:
        pass
    return out
"""
GATE_ARGS = [
    "--ops",
    "layer_norm,linear,bias_gelu",
    "--shapes",
    "vit_digits:8",
    "--modes",
    "forward",
    "--models",
    "none",
    "--min-rounds",
    "10",
    "--budget",
    "40",
    "--slice-ms",
    "15",
]


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """baseline = HEAD~1 (this checkout's library), candidate = HEAD (layer_norm 25% slower)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path_factory.mktemp("repo")
    for folder in ("vit_kernels", "vit", "csrc"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")  # the compiled extension stays untracked
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "baseline")
    with open(repo / "vit_kernels" / "__init__.py", "a") as init:
        init.write(SLOWDOWN)
    _git(repo, "commit", "-qam", "slower layer_norm")
    return repo


def _gate(repo: Path, capsys, *args: str) -> tuple[int, dict[str, str]]:
    code = main(["ab", "--repo", str(repo), *args, *GATE_ARGS])
    printed = capsys.readouterr().out
    print(printed)
    verdicts = {}
    for line in printed.splitlines():
        if " vit_digits B=8 " in line:
            parts = line.split()
            verdict = re.search(r"\]\s+\d+\s+(.+)$", line).group(1)  # after "[low, high]  rounds"
            verdicts[f"{parts[0]} {parts[4]}"] = verdict  # "op backend": "verdict" or "verdict (note)"
    assert verdicts, printed
    return code, verdicts


@pytest.fixture
def cpu_hogs():
    """A busy loop on the core the sides are pinned to, and one free to run anywhere."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(hogs[0].pid, {max(os.sched_getaffinity(0))})
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def test_same_code_under_load_is_not_a_regression(repo, capsys, cpu_hogs):
    code, verdicts = _gate(repo, capsys, "--baseline", "HEAD~1", "--candidate", "HEAD~1")
    assert code in (gate.EXIT_OK, gate.EXIT_INCONCLUSIVE)
    assert not any(v.startswith(stats.REGRESSION) for v in verdicts.values()), verdicts
    assert len(verdicts) == 5  # layer_norm, linear x torch, extension; bias_gelu on the extension only


def test_injected_slowdown_is_reported_in_that_op_only(repo, capsys):
    code, verdicts = _gate(repo, capsys, "--baseline", "HEAD~1", "--candidate", "HEAD")
    assert code == gate.EXIT_REGRESSION
    regressed = {case for case, verdict in verdicts.items() if verdict.startswith(stats.REGRESSION)}
    assert regressed == {"layer_norm torch", "layer_norm extension"}, verdicts
    assert all(verdicts[case] == f"{stats.REGRESSION} (confirmed by 4 fresh pairs)" for case in regressed), (
        verdicts
    )


def ab_args(*argv: str):
    """``python -m benchmarks ab``'s options parsed from ``argv``."""
    parser = ab.argparse.ArgumentParser()
    ab.add_arguments(parser)
    return parser.parse_args(list(argv))


def linear_forward_spec() -> dict:
    """One op case: linear's forward at vit_digits' shape, batch 1, float32, on the torch backend."""
    return {
        "kind": "op",
        "op": "linear",
        "model": "vit_digits",
        "batch": 1,
        "dtype": "float32",
        "backend": "torch",
        "mode": "forward",
    }


class _NoisyWorker:
    """Stands in for a worker process: 5 ms per request, times with 30% noise around the same value."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def time(self, case, slice_ms):
        time.sleep(0.005)
        return float(self.rng.lognormal(0.0, 0.3))


def test_noise_adds_rounds_up_to_the_budget_then_is_inconclusive():
    args = ab_args("--baseline", "HEAD", "--budget", "0.5", "--min-rounds", "5", "--threshold", "0.02")
    specs = [linear_forward_spec()]
    samples, verdicts, rounds, seconds = ab.run_rounds([_NoisyWorker(1), _NoisyWorker(2)], specs, [0], args)
    assert args.min_rounds < rounds < args.max_rounds and rounds == len(samples[0][0]) == len(samples[0][1])
    assert seconds <= args.budget + 0.1
    assert verdicts[0].verdict == stats.INCONCLUSIVE
    assert gate.exit_code(list(verdicts.values())) == gate.EXIT_INCONCLUSIVE


class _SteadyWorker:
    """Stands in for a worker process: every case takes ``ms``."""

    def __init__(self, name, tree, harness, folder, ms):
        self.ms = ms

    def time(self, case, slice_ms):
        return self.ms * (1 + 0.001 * np.sin(time.perf_counter_ns()))

    def close(self):
        pass


@pytest.mark.parametrize(
    "candidate_ms, expected, pairs",
    [
        ((1.0, 1.3, 1.3, 1.3), f"{stats.WITHIN}: regression not confirmed by fresh pair 1", 1),
        ((1.3, 1.0, 1.3, 1.3), f"{stats.WITHIN}: regression not confirmed by fresh pair 2", 2),
        ((1.3, 1.3, 1.3, 1.0), f"{stats.WITHIN}: regression not confirmed by fresh pair 4", 4),
        ((1.3, 1.3, 1.3, 1.3), f"{stats.REGRESSION}: confirmed by 4 fresh pairs", 4),
    ],
)
def test_a_regression_counts_only_when_every_fresh_pair_of_processes_confirms_it(
    monkeypatch, candidate_ms, expected, pairs
):
    """The first run flagged case 0; each confirming pair's fresh processes (stand-ins here) time the
    candidate at 1.0 ms (as fast as the baseline: the flag was a chance one) or at 1.3 ms (slower).
    A process that lands in a slow state can fool one pair; a regression must survive them all, and
    the pairs after the first that clears it are not started."""
    spawned = []

    def worker(name, tree, harness, folder):
        spawned.append(name)
        pair = int(name[-1]) - 1
        return _SteadyWorker(
            name, tree, harness, folder, 1.0 if name.startswith("baseline") else candidate_ms[pair]
        )

    monkeypatch.setattr(ab, "Worker", worker)
    monkeypatch.setattr(ab, "set_up", lambda workers, specs, device, threads: None)
    args = ab_args("--baseline", "HEAD", "--budget", "5", "--min-rounds", "5")
    specs = [linear_forward_spec()] * 3
    verdicts, samples = ab.confirm([0], specs, ["base", "cand"], None, None, "cpu", 1, args)
    assert spawned == [
        f"{side}-confirm{k}" for k in range(1, pairs + 1) for side in ("baseline", "candidate")
    ]
    assert list(verdicts) == list(samples) == [0] and len(samples[0][0]) == verdicts[0].rounds >= 5
    assert f"{verdicts[0].verdict}: {verdicts[0].note}" == expected


def test_unknown_revision_is_refused(repo):
    with pytest.raises(SystemExit, match="not a commit"):
        main(
            ["ab", "--repo", str(repo), "--baseline", "no-such-branch", "--ops", "linear", "--models", "none"]
        )


def test_bad_options_are_refused(repo):
    with pytest.raises(SystemExit, match="--shapes"):
        main(["ab", "--repo", str(repo), "--baseline", "HEAD", "--shapes", "vit_digits"])
    with pytest.raises(SystemExit, match="--ops"):
        main(["ab", "--repo", str(repo), "--baseline", "HEAD", "--ops", "convolution"])
