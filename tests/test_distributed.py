"""torchrun with 2 CPU processes (gloo): a DDP step on 2 x B equals one process's step on 2B; FSDP2
trains, stops, resumes; a killed rank stops the job with a clear message instead of a hang."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vit import checkpoint
from vit.model import create_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "vit.train",
]
SINGLE = [sys.executable, "-m", "vit.train"]
COMMON = [
    "--model",
    "vit_digits",
    "--dataset",
    "synthetic",
    "--backend",
    "torch",
    "--seed",
    "4",
    "--no-progress",
]
BETA1 = 0.9  # AdamW's default: after one step, exp_avg = (1 - beta1) * gradient


def launch(command: list[str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*command, *COMMON, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def gradients(run_folder: Path) -> dict[str, torch.Tensor]:
    """The first step's gradients, recovered from AdamW's first moment."""
    folder = checkpoint.resolve(run_folder)
    state = checkpoint.load_optimizer_state(folder, checkpoint.read_meta(folder))["state"]
    return {name: per_param["exp_avg"].double() / (1 - BETA1) for name, per_param in state.items()}


def test_one_ddp_step_on_2xB_equals_one_step_on_2B(tmp_path):
    one_step = ["--epochs", "1", "--batch-size", "64", "--stop-at-step", "1"]
    launch(SINGLE, *one_step, "--out", str(tmp_path / "single"))
    launch(TORCHRUN, *one_step, "--distributed", "ddp", "--out", str(tmp_path / "ddp"))
    single, ddp = gradients(tmp_path / "single"), gradients(tmp_path / "ddp")
    parameters = {name for name, _ in create_model("vit_digits").named_parameters()}
    assert single.keys() == ddp.keys() == parameters, "every parameter has its gradient"
    difference = max((single[name] - ddp[name]).abs().max().item() for name in single)
    scale = max(g.abs().max().item() for g in single.values())
    print(
        f"\nDDP 2 x 32 vs one process 64: max |grad difference| {difference:.3g} (largest gradient {scale:.3g})"
    )
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-4, atol=1e-6, msg=name)
    weights = [
        checkpoint.load_tensors(checkpoint.resolve(tmp_path / f), checkpoint.MODEL_FILE)
        for f in ("single", "ddp")
    ]
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_trains_stops_and_resumes(tmp_path):
    run = ["--epochs", "2", "--batch-size", "64", "--out", str(tmp_path / "fsdp")]
    stopped = launch(TORCHRUN, *run, "--distributed", "fsdp", "--stop-at-step", "5")
    assert json.loads(stopped.stdout.strip().splitlines()[-1])["stopped_at_step"] == 5
    assert checkpoint.read_meta(tmp_path / "fsdp")["progress"]["step"] == 5
    done = launch(TORCHRUN, "--resume", str(tmp_path / "fsdp" / "checkpoint"), "--distributed", "fsdp")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["distributed"] == "fsdp" and summary["processes"] == 2 and summary["epochs"] == 2
    assert "resuming" in done.stderr and checkpoint.read_meta(tmp_path / "fsdp")["progress"]["step"] == 16
    # the gathered checkpoint is an ordinary one: the same run on one process ends within float noise
    single = json.loads(
        launch(
            SINGLE, "--epochs", "2", "--batch-size", "64", "--out", str(tmp_path / "one")
        ).stdout.splitlines()[-1]
    )
    assert summary["test_loss"] == pytest.approx(single["test_loss"], rel=1e-3)
    a, b = (
        checkpoint.load_tensors(checkpoint.resolve(tmp_path / f), checkpoint.MODEL_FILE)
        for f in ("fsdp", "one")
    )
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-3


def test_a_killed_rank_stops_the_job_with_a_clear_message(tmp_path):
    job = subprocess.Popen(
        [
            *TORCHRUN,
            *COMMON,
            "--distributed",
            "ddp",
            "--epochs",
            "500",
            "--out",
            str(tmp_path),
            "--dist-timeout",
            "30",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, output = time.monotonic() + 180, []
        while not any("checkpoint saved" in line for line in output):
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(output[-20:])
            output.append(line)
        workers = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
        assert len(workers) == 2
        os.kill(int(workers[1]), signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = job.communicate(timeout=90)
        stopped_after = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(output) + rest
    print(f"\nkilled rank 1: the job stopped {stopped_after:.1f} s later with exit code {job.returncode}")
    assert job.returncode != 0 and stopped_after < 90
    assert (
        "rank 0 lost contact with the other processes" in text
        and "Continue from the last checkpoint with --resume" in text
    )
    assert checkpoint.read_meta(tmp_path)["progress"]["step"] > 0, "the last checkpoint is intact"
