"""``python -m benchmarks`` and ``python -m vit_kernels.selftest`` run torch on as many intra-op
threads as this process has cores (its affinity mask), or ``--threads N``, and record the count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import environment, noise
from benchmarks.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_usable_cores_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert environment.usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert environment.usable_cores() == 7


@pytest.mark.parametrize("option,expected", [([], None), (["--threads", "1"], 1)])
def test_the_suite_sets_and_records_its_threads(tmp_path, monkeypatch, restore_threads, option, expected):
    seen = []

    def probe(device, seconds=1.0, own_load=0.0):  # the threads in force while the suite measures
        seen.append(torch.get_num_threads())
        return {
            "workload": "w",
            "samples": 3,
            "median_ms": 1.0,
            "q20_ms": 1.0,
            "q80_ms": 1.0,
            "spread": 0.0,
            "load_1min": 0.0,
            "cpu_count": 1,
            "usable_cores": 1,
            "threads": seen[-1],
        }

    monkeypatch.setattr(noise, "probe", probe)
    torch.set_num_threads(1 if expected is None else 2)  # something other than what the run must set
    out = tmp_path / "r.json"
    assert main(["--quick", "--device", "cpu", "--ops", "", "--out", str(out), *option]) == 0
    want = environment.usable_cores() if expected is None else expected
    assert json.loads(out.read_text())["meta"]["threads"] == want
    assert seen == [want, want]


def test_the_selftest_sets_and_records_its_threads(tmp_path):
    out = tmp_path / "selftest.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vit_kernels.selftest",
            "--ops",
            "layer_norm",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and {row["op"] for row in report["checks"]} == {"layer_norm"}


def test_the_default_threads_honour_omp_num_threads_and_torchrun(monkeypatch):
    from vit import cli as _cli

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _cli.default_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node 4
    assert _cli.default_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _cli.default_threads() == 3
