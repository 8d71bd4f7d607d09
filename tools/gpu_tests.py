"""The CUDA tests of a source checkout (``pytest -m gpu``), run or only collected in a subprocess,
with pytest's summary read into counts.

pytest's exit code 5 means "no tests collected": for a run that was meant to exercise the GPU, that
is a failure (a marker typo or a deselecting ``-m`` would otherwise pass silently), so ``passed``
is true only for exit code 0. The subprocess runs without ``TRITON_INTERPRET``: on a GPU the Triton
kernels must be compiled for the device, not interpreted.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

TESTS = Path(__file__).resolve().parent.parent / "tests"
NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
_COLLECTED = re.compile(r"(\d+)(?:/\d+)? tests? collected")


def passed(exit_code: Optional[int]) -> bool:
    """Whether a ``pytest -m gpu`` run passed: exit code 0 only (5, no tests collected, fails)."""
    return exit_code == 0


def counts(summary: str) -> dict[str, int]:
    """{"passed": n, "failed": n, "skipped": n, "errors": n, "deselected": n, ...} from pytest's
    final summary line (missing kinds are 0)."""
    found = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0}
    for number, kind in _COUNT.findall(summary):
        found["errors" if kind.startswith("error") else kind] = int(number)
    return found


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


# Run first (here and by `make test-gpu`), so that a run stopped by its time budget
# has covered them: the tiles that run by default, every tile of every table, then the ops whose
# kernels the GPU runs found wrong.
FIRST = (
    "test_table_defaults.py",  # the bfloat16 attention backward at ViT-B/16's shape first
    "test_tiles.py",
    "test_attention.py",
    "test_extension.py",
    "test_layer_norm.py",
    "test_compile.py",
    "test_capture_rules.py",
)


# `make test-gpu` runs these on their own before the rest: a GPU window's first question (the tiles
# that run by default), tests that pytest-xdist would otherwise hand out in chunks with the tile
# tests behind them, so that a window stopped after a few minutes had them still running.
HEADLINE = FIRST[:1]


def ordered_test_files(part: str = "all") -> list[str]:
    """tests/'s test files, the FIRST ones first, each named once: pytest collects a folder named
    beside its own files in the folder's order, so the folder itself is never passed. ``part``:
    "all", "headline" (the HEADLINE files) or "rest" (the others, in the same order)."""
    if part not in ("all", "headline", "rest"):
        raise ValueError(f"part must be 'all', 'headline' or 'rest', got {part!r}")
    rest = sorted(path.name for path in TESTS.glob("test_*.py") if path.name not in FIRST)
    names = [name for name in (*FIRST, *rest) if (TESTS / name).is_file()]
    if part != "all":
        names = [name for name in names if (name in HEADLINE) == (part == "headline")]
    return [str(TESTS / name) for name in names]


_PROGRESS = re.compile(r"^([.FEsxX]+)\s*\[\s*\d+%\]$")


def progress(output: str) -> dict[str, int]:
    """Counts from pytest -q's progress lines (``..F.s [ 12%]``), for a run stopped before its summary."""
    marks = "".join(m.group(1) for m in map(_PROGRESS.match, output.splitlines()) if m)
    return {
        "passed": marks.count("."),
        "failed": marks.count("F"),
        "errors": marks.count("E"),
        "skipped": marks.count("s"),
    }


def _pytest(args: list[str], timeout_s: Optional[float]) -> dict:
    """Run pytest on the checkout's tests/ (the FIRST files first) with ``args``; the exit code, the
    summary line and the output's tail, or ``timed_out`` after ``timeout_s`` seconds with the counts
    of what ran by then."""
    if not TESTS.is_dir():
        return {"ran": False, "why": "no tests/ folder beside the package (not a source checkout)"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, *ordered_test_files()]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=TESTS.parent, env=_environment(), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as expired:
        out = (
            expired.stdout.decode(errors="replace")
            if isinstance(expired.stdout, bytes)
            else (expired.stdout or "")
        )
        return {
            "ran": True,
            "exit_code": None,
            "timed_out": True,
            "seconds": round(time.perf_counter() - started, 1),
            "why": f"stopped after its budget of {timeout_s:.0f} s",
            "counts_so_far": progress(out),
            "tail": out.strip().splitlines()[-20:],
        }
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    return {
        "ran": True,
        "command": " ".join(["python", *command[1:]]),
        "exit_code": done.returncode,
        "summary": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "tail": (lines[-20:] if done.returncode else []) + done.stderr.strip().splitlines()[-5:],
    }


# pytest-xdist's worker processes, where it is installed (GPU_TEST_WORKERS, default one per core, 8
# to 16): compiling the kernels for the device is most of a GPU run's time (a tile-table test, 5 to 20
# s of compiles, on an H100 machine's 16 cores: about one test a second on 16 workers), and a CUDA
# fault then costs one worker (tests/conftest.py), not the run. make test-gpu and the GPU report both
# take them from here.
WORKERS = int(os.environ.get("GPU_TEST_WORKERS", str(min(16, max(8, os.cpu_count() or 1)))))


def xdist_args() -> list[str]:
    """pytest's arguments for WORKERS worker processes, none without pytest-xdist."""
    return ["-n", str(WORKERS)] if importlib.util.find_spec("xdist") is not None else []


def run_gpu_tests(timeout_s: Optional[float] = None) -> dict:
    """``pytest -q -m gpu tests/`` (on WORKERS processes with pytest-xdist): exit code, ``counts``
    (passed, failed, skipped, errors, deselected), ``passed`` (exit 0 only) and the output's tail
    when it failed."""
    result = _pytest(["-q", "-m", "gpu", *xdist_args()], timeout_s)
    if result["ran"]:
        result.update(counts=counts(result.get("summary", "")), passed=passed(result["exit_code"]))
        if result["exit_code"] == NO_TESTS_COLLECTED:
            result["why"] = "no test carries the gpu marker (pytest exit 5): counted as a failure"
    return result


def collect_gpu_tests(timeout_s: Optional[float] = None) -> dict:
    """``pytest --collect-only -q -m gpu tests/``: how many tests a GPU run would select."""
    result = _pytest(["--collect-only", "-q", "-m", "gpu"], timeout_s)
    if result["ran"] and not result.get("timed_out"):
        match = _COLLECTED.search(result["summary"])
        result["collected"] = int(match.group(1)) if match else 0
        result["deselected"] = counts(result["summary"])["deselected"]
    return result
