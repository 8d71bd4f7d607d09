"""Every ordinary mistake with ``vit.train``, ``vit.predict`` and ``vit.plots`` ends with exit code 2
and one line on stderr naming what was wrong: never a traceback, never work started first."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.test_data import write_cifar
from vit import checkpoint, plots, predict, train

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A finished one-epoch run, a damaged copy of it, an empty folder, a text file, a CIFAR folder."""
    root = tmp_path_factory.mktemp("bad-inputs")
    train.main([*FAST, "--epochs", "1", "--out", str(root / "run")])
    damaged = root / "damaged"
    train.main([*FAST, "--epochs", "1", "--out", str(damaged)])
    model_file = checkpoint.resolve(damaged) / checkpoint.MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:-100])
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not an image")
    Image.fromarray((np.eye(8) * 255).astype(np.uint8)).save(root / "digit.png")
    write_cifar(root / "cifar")
    return root


# (command, arguments with {root} for the fixture's folder, what the one line must say)
BAD_INPUTS = [
    ("train", ["--model", "vit_nope"], "invalid choice: 'vit_nope'"),
    ("train", ["--epochs", "0"], "--epochs: must be in [1"),
    ("train", ["--epochs", "ten"], "--epochs: expected an integer"),
    ("train", ["--lr", "nan"], "--lr: must be finite"),
    ("train", ["--lr", "0"], "--lr: must be in (0"),
    ("train", ["--batch-size", "-1"], "--batch-size: must be in [1"),
    ("train", ["--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 must not exceed --lr 0.01"),
    ("train", ["--dataset", "cifar10", "--out", "{root}/new"], "--dataset cifar10 needs --data-path"),
    (
        "train",
        ["--dataset", "mnist", "--data-path", "{root}/nowhere"],
        "--data-path: '{root}/nowhere' does not exist",
    ),
    ("train", ["--dataset", "mnist", "--data-path", "{root}/empty", "--out", "{root}/new"], "not found in"),
    (
        "train",
        ["--dataset", "cifar10", "--data-path", "{root}/cifar", "--out", "{root}/new"],
        "gives images (3, 32, 32), but model 'vit_digits' expects (1, 8, 8)",
    ),
    ("train", ["--device", "cuda:7"], "--device"),
    ("train", ["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N"),
    ("train", ["--out", "{root}/notes.txt"], "exists and is not a folder"),
    ("train", ["--resume", "{root}/empty"], "is not a checkpoint"),
    ("train", ["--resume", "{root}/damaged"], "is damaged"),
    ("train", ["--backend", "nope"], "--backend: invalid choice"),
    ("train", ["--threads", "0"], "--threads: must be 1 or more"),
    ("train", ["--checkpoint-every", "0"], "--checkpoint-every: expected a positive count"),
    ("train", ["--resume-fallback"], "--resume-fallback goes with --resume"),
    ("train", ["--resume", "{root}/run", "--overwrite"], "give one of them"),
    ("train", ["--out", "{root}/run"], "already holds a run; continue it with --resume"),
    ("train", ["--shift", "8", "--out", "{root}/new"], "--shift 8 must be below the image size 8"),
    ("train", ["--img-size", "0"], "--img-size: must be in [1"),
    ("train", ["--resume", "{root}/run", "--model", "vit_mnist_sincos"], "a resumed run keeps its course"),
    ("train", ["--resume", "{root}/run", "--epochs", "1", "--lr", "0.5"], "a resumed run keeps its course"),
    ("train", ["--keep", "0"], "--keep: must be in [1"),
    ("train", ["--amp", "fp8"], "--amp: invalid choice"),
    ("train", ["--resume", "{root}/run", "--out", "{root}/damaged"], "already holds another run"),
    ("predict", ["{root}/empty"], "is not a checkpoint"),
    ("predict", ["{root}/nowhere"], "is not a checkpoint"),
    (
        "predict",
        ["{root}/run", "--image", "{root}/missing.png"],
        "--image: '{root}/missing.png' does not exist",
    ),
    ("predict", ["{root}/run", "--image", "{root}/notes.txt"], "cannot read image"),
    ("predict", ["{root}/run", "--dataset", "mnist"], "--dataset mnist needs --data-path"),
    ("predict", ["{root}/damaged"], "is damaged"),
    ("predict", ["{root}/run", "--device", "cuda:7"], "--device"),
    ("predict", ["{root}/run", "--threads", "many"], "--threads: expected a positive integer"),
    (
        "predict",
        ["{root}/run", "--dataset", "cifar10", "--data-path", "{root}/cifar"],
        "but the model expects",
    ),
    ("plots", ["{root}/empty"], "is not a checkpoint"),
    ("plots", ["{root}/run", "--index", "100000", "--out", "{root}/maps.png"], "--index must be in [0, "),
    ("plots", ["{root}/run", "--image", "{root}/notes.txt", "--out", "{root}/maps.png"], "cannot read image"),
    ("plots", ["{root}/run", "--out", "{root}/maps.jpg"], "--out: expected a .png file name"),
    ("plots", ["{root}/run", "--out", "{root}/no/such/folder/maps.png"], "does not exist"),
    ("plots", ["{root}/damaged", "--out", "{root}/maps.png"], "is damaged"),
]
MAINS = {"train": train.main, "predict": predict.main, "plots": plots.main}


def test_the_table_is_large():
    assert len(BAD_INPUTS) >= 25 and {cmd for cmd, _, _ in BAD_INPUTS} == set(MAINS)


@pytest.mark.parametrize(
    "command, arguments, expected", BAD_INPUTS, ids=[f"{c}-{'_'.join(a)[:40]}" for c, a, _ in BAD_INPUTS]
)
def test_a_bad_input_gets_one_line_and_exit_2(files, capsys, command, arguments, expected):
    args = [a.replace("{root}", str(files)) for a in arguments]
    if command == "train" and "--out" not in args and "--resume" not in args:
        args += ["--out", str(files / "new")]
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command]([*args, *FAST] if command == "train" else [*args, "--threads", "1"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_info.value.code == 2, captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"python -m vit.{command}: error: ")
    assert expected.replace("{root}", str(files)) in lines[0], lines[0]
    assert not (files / "new").exists(), "work started before the mistake was found"


@pytest.mark.parametrize(
    "command, arguments",
    [
        ("vit.train", ["--backend", "triton", "--device", "cpu"]),
        ("vit.predict", ["{root}/empty"]),
        ("vit.plots", ["{root}/run", "--index", "-1", "--out", "{root}/maps.png"]),
    ],
)
def test_the_module_entry_points_print_one_line(files, command, arguments):
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
    }  # no TRITON_INTERPRET: Triton cannot run on the CPU
    args = [a.replace("{root}", str(files)) for a in arguments]
    done = subprocess.run(
        [sys.executable, "-m", command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
