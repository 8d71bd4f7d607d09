"""python -m vit.train / vit.predict: a tiny run end to end, its files, --resume, prediction."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.test_data import write_cifar
from vit import checkpoint, predict, train


def run_train(capsys, *args):
    train.main(list(args))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_train_writes_metrics_checkpoint_and_json(tmp_path, capsys):
    out = tmp_path / "run"
    summary = run_train(capsys, "--model", "vit_digits", "--epochs", "2", "--out", str(out), "--no-progress")
    for key in ("test_accuracy", "train_seconds", "images_per_second"):
        assert key in summary
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["train_seconds"] > 0
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2]
    assert (out / "metrics.csv").read_text().splitlines()[0].startswith("epoch,lr,train_loss")
    for name in (checkpoint.MODEL_FILE, checkpoint.OPTIMIZER_FILE, checkpoint.META_FILE):
        assert (out / "checkpoint" / name).is_file()

    # the checkpoint reproduces the reported accuracy
    predict.main([str(out / "checkpoint")])
    result = json.loads(capsys.readouterr().out.strip())
    assert result["accuracy"] == pytest.approx(summary["test_accuracy"])

    # and classifies a single image file
    image = tmp_path / "digit.png"
    Image.fromarray((np.eye(8) * 255).astype(np.uint8)).save(image)
    predict.main([str(out / "checkpoint"), "--image", str(image)])
    single = json.loads(capsys.readouterr().out.strip())
    assert 0 <= single["class"] < 10 and sum(single["probabilities"]) == pytest.approx(1.0, abs=1e-4)


def test_resume_continues_from_the_saved_epoch(tmp_path, capsys):
    first = tmp_path / "first"
    run_train(capsys, "--epochs", "2", "--out", str(first), "--no-progress", "--seed", "5")
    saved, _ = checkpoint.load_model(first / "checkpoint")
    # the README's form: only --resume, a longer --epochs and an --out
    resumed = run_train(
        capsys, "--resume", str(first / "checkpoint"), "--epochs", "3", "--out", str(tmp_path / "second")
    )
    assert resumed["epochs"] == 3
    rows = json.loads((tmp_path / "second" / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2, 3], "history carries over and training continues at epoch 3"
    model, meta = checkpoint.load_model(tmp_path / "second" / "checkpoint")
    assert meta["progress"]["epoch"] == 3
    assert any(
        not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values())
    )
    steps_per_epoch = -(-1347 // 64)
    optimizer_state = load_file(str(tmp_path / "second" / "checkpoint" / checkpoint.OPTIMIZER_FILE))
    assert optimizer_state["head.weight.step"].item() == 3 * steps_per_epoch, (
        "the optimizer state was restored, not restarted"
    )


def test_bad_arguments_fail_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "vit_nope"])
    assert "invalid choice: 'vit_nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--epochs", "0"])
    assert "argument --epochs: must be in [1, 1e+06], got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        predict.main([str(tmp_path)])
    assert exit_info.value.code == 2 and "checkpoint.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--dataset", "cifar10", "--epochs", "1", "--no-progress", "--out", str(tmp_path / "x")])
    assert "--dataset cifar10 needs --data-path" in capsys.readouterr().err
    write_cifar(tmp_path / "cifar")
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                "--dataset",
                "cifar10",
                "--data-path",
                str(tmp_path / "cifar"),
                "--model",
                "vit_digits",
                "--epochs",
                "1",
                "--no-progress",
                "--out",
                str(tmp_path / "x"),
            ]
        )
    assert exit_info.value.code == 2
    assert "gives images (3, 32, 32), but model 'vit_digits' expects (1, 8, 8)" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vit.train",
            "--epochs",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--dataset",
            "synthetic",
            "--model",
            "vit_mnist_sincos",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["model"] == "vit_mnist_sincos" and summary["dataset"] == "synthetic"


def test_attention_plot(tmp_path, capsys):
    from vit import plots

    run_train(capsys, "--epochs", "1", "--out", str(tmp_path / "run"), "--no-progress")
    out = tmp_path / "maps.png"
    plots.main([str(tmp_path / "run" / "checkpoint"), "--index", "2", "--out", str(out)])
    result = json.loads(capsys.readouterr().out.strip())
    assert result["blocks"] == 3 and result["grid"] == [2, 2]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, _ = checkpoint.load_model(tmp_path / "run" / "checkpoint")
    maps = plots.class_token_maps(model.eval(), torch.randn(2, 1, 8, 8))
    assert maps.shape == (2, 3, 2, 2) and (maps >= 0).all()
    assert (maps.sum(dim=(-2, -1)) <= 1.0 + 1e-6).all(), "attention to patches is part of a softmax row"
