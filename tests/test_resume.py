"""Exact resume: a run stopped at a checkpoint and continued with --resume alone ends with the very
weights (torch.equal) of an uninterrupted run; what may and may not change on resume."""

import json

import pytest
import torch

from vit import checkpoint, train

TIMING = ("epoch_seconds", "images_per_second")


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: under CPU contention OpenMP's spinning threads slow these runs tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys, *args) -> dict:
    train.main([*args, "--no-progress"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def assert_same_run(first, second):
    """Same weights, optimizer state, RNG state and metrics (but timings) in two checkpoints."""
    for name in (checkpoint.MODEL_FILE, checkpoint.OPTIMIZER_FILE, checkpoint.STATE_FILE):
        a, b = checkpoint.load_tensors(first, name), checkpoint.load_tensors(second, name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key} differs"
    rows_a, rows_b = (checkpoint.read_meta(f)["progress"]["history"] for f in (first, second))
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]
    assert strip(rows_a) == strip(rows_b)


@pytest.mark.parametrize(
    "model_args, stop_at",
    [
        # mid-epoch (11 steps an epoch): sampler position, schedule, partial epoch metrics
        (["--model", "vit_digits", "--batch-size", "128"], 7),
        # a dropout model at an epoch boundary: the RNG state is restored
        (
            [
                "--model",
                "vit_mnist_postnorm",
                "--dataset",
                "synthetic",
                "--img-size",
                "14",
                "--batch-size",
                "128",
            ],
            4,
        ),
    ],
    ids=["digits-mid-epoch", "dropout-epoch-boundary"],
)
def test_resumed_run_equals_uninterrupted_run(tmp_path, capsys, model_args, stop_at):
    common = [*model_args, "--epochs", "2", "--seed", "3", "--backend", "torch", "--warmup-epochs", "1"]
    whole = run(capsys, *common, "--out", str(tmp_path / "whole"))
    stopped = run(capsys, *common, "--out", str(tmp_path / "parts"), "--stop-at-step", str(stop_at))
    assert stopped["stopped_at_step"] == stop_at
    assert checkpoint.read_meta(tmp_path / "parts" / "checkpoint")["progress"]["step"] == stop_at
    resumed = run(capsys, "--resume", str(tmp_path / "parts" / "checkpoint"))
    assert resumed["test_accuracy"] == whole["test_accuracy"] and resumed["test_loss"] == whole["test_loss"]
    assert_same_run(tmp_path / "whole" / "checkpoint", tmp_path / "parts" / "checkpoint")
    rows = json.loads((tmp_path / "parts" / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2], "metrics continue in the same run folder"


def test_resume_refuses_fewer_epochs_and_a_changed_course(tmp_path, capsys):
    run(capsys, "--epochs", "2", "--backend", "torch", "--batch-size", "256", "--out", str(tmp_path / "run"))
    resume = ["--resume", str(tmp_path / "run" / "checkpoint")]
    with pytest.raises(SystemExit) as exit_info:
        train.main([*resume, "--epochs", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--epochs 1 is fewer than the 2 epochs the checkpoint" in err[0]
    for option, value in (
        ("--lr", "0.1"),
        ("--model", "vit_cifar10_small"),
        ("--seed", "9"),
        ("--batch-size", "64"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            train.main([*resume, option, value])
        assert exit_info.value.code == 2
        assert f"{option} " in capsys.readouterr().err
    # the same value again is fine, and a finished run resumed with its own --epochs has nothing left to do
    done = run(capsys, *resume, "--lr", "0.002")
    assert done["epochs"] == 2 and done["train_seconds"] == 0
