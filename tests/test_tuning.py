"""Searching when asked, and its file: ``vk.tune`` then ``save_tuning`` / ``load_tuning`` in a fresh
process runs the tuned choices and searches nothing; under ``torch.distributed`` every rank runs
rank 0's choices; bad files and arguments are refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vit
from tests.test_distributed import TORCHRUN
import vit_kernels as vk
from vit_kernels import _measure, backend
from vit_kernels._tune_cache import store

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

FRESH_PROCESS = """
import json, sys, torch, vit, vit_kernels as vk
from vit_kernels import _measure
_measure.measure = lambda *a, **k: sys.exit("searched after loading the tuning")
vk.load_tuning(sys.argv[1])
model = vit.create_model("vit_digits")
model(torch.randn(8, 1, 8, 8)).sum().backward()
print(json.dumps([[r.op, r.shapes, r.grad, r.backend, r.source] for r in vk.explain()]))
"""


def test_a_fresh_process_runs_the_tuned_choices_and_searches_nothing(tmp_path):
    model = vit.create_model("vit_digits")
    tuned = {(r.op, r.shapes, r.grad): r.backend for r in vk.tune(model, (torch.randn(8, 1, 8, 8),))}
    assert tuned
    vk.save_tuning(tmp_path / "tuning.json")
    env = {**ENV, "VIT_KERNELS_CACHE_DIR": str(tmp_path / "empty cache")}
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "tuning.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    measured = [
        (op, shapes, grad, ran) for op, shapes, grad, ran, source in rows if source != "only candidate"
    ]
    assert measured and all(source in ("tuned", "only candidate") for *_, source in rows), rows
    assert all(tuned[(op, shapes, grad)] == ran for op, shapes, grad, ran in measured), (rows, tuned)


def test_every_rank_runs_rank_zeros_choices(tmp_path):
    command = [*TORCHRUN[:-1], "tests.tune_ranks", str(tmp_path)]  # torchrun, 2 CPU ranks, -m ...
    env = {**ENV, "VIT_KERNELS_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["runs"] and zero["runs"] == one["runs"]
    assert zero["searched"] > 0 and one["searched"] == 0
    assert set(one["sources"]) <= {"tuned", "only candidate"}, one  # rank 0's, not its own table's


def test_load_tuning_refuses_what_is_not_a_tuning_file(tmp_path):
    for text in ("{ not json", json.dumps({"format": 99}), json.dumps([1])):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="is not a vit_kernels tuning file"):
            vk.load_tuning(tmp_path / "bad.json")


def test_tune_refuses_a_bad_autocast_dtype():
    with pytest.raises(ValueError, match="autocast must be torch.float16, torch.bfloat16 or None"):
        vk.tune(vit.create_model("vit_digits"), (torch.randn(2, 1, 8, 8),), autocast=torch.float64)


def test_save_tuning_writes_every_tuned_decision(tmp_path):
    vk.tune(vit.create_model("vit_digits"), (torch.randn(8, 1, 8, 8),))
    vk.save_tuning(tmp_path / "tuning.json")
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert data["format"] == 1 and data["environment"]["torch"] == torch.__version__
    assert data["dispatch"] and data["dispatch"].items() <= dict(store().items("dispatch")).items()


def test_tune_searches_what_earlier_calls_took_from_the_table(monkeypatch):
    backend.clear_decisions()  # nothing tuned before (conftest: the cache is the test's own)
    searched = []
    measure = _measure.measure
    monkeypatch.setattr(_measure, "measure", lambda *a, **k: searched.append(1) or measure(*a, **k))
    model, images = vit.create_model("vit_digits"), torch.randn(8, 1, 8, 8)
    model(images).sum().backward()  # the tables decide; the fast path keeps each signature's choice
    assert not searched
    rows = vk.tune(model, (images,))
    assert searched and {r.source for r in rows} <= {"measured", "tuned", "only candidate"}, rows
