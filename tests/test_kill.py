"""Real kills: `python -m vit.train` SIGKILLed at random moments (during training steps and during
checkpoint saves, every 2 steps) and SIGTERMed once. After each kill `--resume` must succeed and lose
at most the work since the last checkpoint the run announced; the run, finished through all the
kills, must end with exactly the weights of an uninterrupted run."""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from vit import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SAVED = re.compile(r"checkpoint saved: .* step (\d+)\)")
# one thread per process: under CPU contention OpenMP's spinning threads slow these runs tenfold
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_args(out: Path, epochs: int) -> list[str]:
    return [
        "--model",
        "vit_digits",
        "--dataset",
        "synthetic",
        "--epochs",
        str(epochs),
        "--batch-size",
        "64",
        "--backend",
        "torch",
        "--seed",
        "7",
        "--checkpoint-every",
        "2steps",
        "--keep",
        "2",
        "--no-progress",
        "--out",
        str(out),
    ]


class Run:
    """A training process whose stderr lines are collected (with their arrival time) as they come."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vit.train", *args],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, pattern: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pattern in line for _, line in self.lines):
                return True
            if self.process.poll() is not None:
                self.reader.join(5)
                return any(pattern in line for _, line in self.lines)
            time.sleep(0.01)
        return False

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self.reader.join(5)
        return code

    def announced_step(self) -> int:
        steps = [int(m.group(1)) for _, line in self.lines if (m := SAVED.search(line))]
        return max(steps, default=-1)


def wait_for_a_save_in_progress(out: Path, timeout: float) -> bool:
    """Poll until a checkpoint is being written (its temporary folder exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(entry.name.startswith(".tmp-") for entry in os.scandir(out / checkpoint.FOLDERS)):
            return True
        time.sleep(0.0005)
    return False


def checkpoint_step(out: Path) -> int:
    """The latest checkpoint's step, after loading everything a resume loads."""
    if not (out / checkpoint.LATEST_LINK).exists():
        return -1
    model, meta = checkpoint.load_model(out)
    checkpoint.load_optimizer_state(meta["folder"], meta)
    checkpoint.load_tensors(meta["folder"], checkpoint.STATE_FILE)
    return meta["progress"]["step"]


@pytest.mark.parametrize(
    "kills, epochs, budget_seconds",
    [pytest.param(3, 8, 60, id="3-kills"), pytest.param(15, 30, 300, id="15-kills", marks=pytest.mark.slow)],
)
def test_killed_runs_resume_and_end_like_an_uninterrupted_run(tmp_path, kills, epochs, budget_seconds):
    reference = Run(train_args(tmp_path / "reference", epochs))
    assert reference.finish(300) == 0, reference.lines[-5:]

    out, rng = tmp_path / "killed", random.Random(kills)
    started, rounds, during_save = time.monotonic(), 0, 0

    # SIGTERM: the run saves a checkpoint at the next step boundary and exits 128 + 15
    run = Run(train_args(out, epochs))
    assert run.wait_for("checkpoint saved", 120), run.lines[-5:]
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(60) == 128 + signal.SIGTERM, run.lines[-5:]
    assert any("stopped by SIGTERM" in line for _, line in run.lines)
    assert checkpoint_step(out) == run.announced_step() > 0

    while rounds < kills and time.monotonic() - started < budget_seconds:
        run = Run(["--resume", str(out / checkpoint.LATEST_LINK), "--out", str(out)])
        assert run.wait_for("resuming", 120), run.lines[-5:]
        if rounds % 2:  # every other kill aims at a checkpoint being written
            wait_for_a_save_in_progress(out, 5.0)
        else:
            time.sleep(rng.uniform(0.0, 0.6))
        if run.process.poll() is not None:
            break  # finished before the kill came
        before = checkpoint_step(out)
        run.process.kill()
        run.finish(60)
        rounds += 1
        during_save += any(p.name.startswith(".tmp-") for p in (out / checkpoint.FOLDERS).iterdir())
        after = checkpoint_step(out)
        assert after >= max(run.announced_step(), before), "a completed checkpoint was lost"

    final = Run(["--resume", str(out / checkpoint.LATEST_LINK), "--out", str(out)])
    assert final.finish(300) == 0, final.lines[-5:]
    print(
        f"\nkill test: {rounds} SIGKILLs ({during_save} during a checkpoint save) and 1 SIGTERM in "
        f"{time.monotonic() - started:.0f} s; {rounds + 1} resumes succeeded; checkpoint every 2 steps, so at most "
        "2 steps of work lost a kill; final weights equal the uninterrupted run's"
    )
    assert rounds >= min(kills, 3), "the kills came too late: the run finished first"
    reference_weights = checkpoint.load_tensors(
        checkpoint.resolve(tmp_path / "reference"), checkpoint.MODEL_FILE
    )
    final_weights = checkpoint.load_tensors(checkpoint.resolve(out), checkpoint.MODEL_FILE)
    for name, tensor in reference_weights.items():
        assert torch.equal(final_weights[name], tensor), name
