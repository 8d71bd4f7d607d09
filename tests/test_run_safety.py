"""A user's runs survive ordinary mistakes: training again into a finished run, a damaged
checkpoint, a diverging loss, resuming a finished run for more epochs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vit import checkpoint, predict, train

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
FAST = ["--model", "vit_digits", "--dataset", "digits", "--no-progress", "--threads", "1"]


def run_train(capsys, *args) -> dict:
    train.main([*FAST, *args])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def failing(capsys, main, *args) -> str:
    """Run a CLI's main expecting one error line and exit code 2; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


def accuracy_of(capsys, folder: Path) -> float:
    predict.main([str(folder), "--threads", "1"])
    return json.loads(capsys.readouterr().out.strip())["accuracy"]


@pytest.fixture
def finished(tmp_path, capsys):
    """A finished 3-epoch run: (its folder, the summary, its best checkpoint's accuracy)."""
    out = tmp_path / "run"
    summary = run_train(capsys, "--epochs", "3", "--out", str(out), "--keep", "1")
    return out, summary, accuracy_of(capsys, out / checkpoint.BEST_LINK)


def test_training_again_into_a_finished_run_is_refused(finished, capsys):
    out, summary, best_accuracy = finished
    before = sorted(p.name for p in (out / checkpoint.FOLDERS).iterdir())
    line = failing(capsys, train.main, *FAST, "--epochs", "3", "--out", str(out), "--keep", "1")
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert sorted(p.name for p in (out / checkpoint.FOLDERS).iterdir()) == before
    assert accuracy_of(capsys, out / checkpoint.BEST_LINK) == best_accuracy

    # the same command as a process: refused; and killed a couple of seconds in: nothing changes either
    command = [sys.executable, "-m", "vit.train", *FAST, "--epochs", "3", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already holds a run" in done.stderr and "Traceback" not in done.stderr, (
        done.stderr
    )
    process = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(2.0)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert sorted(p.name for p in (out / checkpoint.FOLDERS).iterdir()) == before
    assert accuracy_of(capsys, out / checkpoint.BEST_LINK) == best_accuracy


def test_overwrite_replaces_the_run_on_purpose(finished, capsys):
    out, _, _ = finished
    old = set((out / checkpoint.FOLDERS).iterdir())
    summary = run_train(capsys, "--epochs", "1", "--out", str(out), "--overwrite", "--seed", "3")
    assert summary["epochs"] == 1
    assert not old & set((out / checkpoint.FOLDERS).iterdir()), "the old run's checkpoints are gone"
    assert [row["epoch"] for row in json.loads((out / "metrics.json").read_text())] == [1]


def test_resuming_a_finished_run_keeps_its_last_checkpoint(finished, capsys):
    out, _, _ = finished
    final = [p for p in (out / checkpoint.FOLDERS).iterdir() if p.name.endswith(checkpoint.FINAL_SUFFIX)]
    assert len(final) == 1
    run_train(capsys, "--resume", str(out), "--epochs", "6", "--keep", "1")
    names = [p.name for p in (out / checkpoint.FOLDERS).iterdir()]
    assert final[0].name in names, "rotation deleted the finished run's last checkpoint"


def damage(path: Path) -> None:
    """Overwrite the last 2,000 bytes, leaving the header (and the size) intact."""
    data = bytearray(path.read_bytes())
    data[-2000:] = bytes(range(256)) * 7 + bytes(208)
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_and_resume_can_fall_back(tmp_path, capsys):
    out = tmp_path / "run"
    run_train(capsys, "--epochs", "2", "--out", str(out), "--keep", "2")
    latest = (out / checkpoint.LATEST_LINK).resolve()
    older = sorted(p for p in (out / checkpoint.FOLDERS).iterdir() if p != latest)[-1]
    damage(latest / checkpoint.MODEL_FILE)
    checkpoint._verified.clear()

    for main, args in ((predict.main, [str(out)]), (train.main, ["--resume", str(out), "--epochs", "3"])):
        line = failing(capsys, main, *args)
        assert "model.safetensors' is damaged" in line, line
    from vit import plots

    assert "is damaged" in failing(capsys, plots.main, str(out), "--out", str(tmp_path / "maps.png"))

    train.main([*FAST, "--resume", str(out), "--resume-fallback", "--epochs", "3"])
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["epochs"] == 3
    assert f"falling back to {older}" in captured.err
    meta = checkpoint.read_meta(out)
    assert meta["progress"]["epoch"] == 3
    assert (latest / checkpoint.MODEL_FILE).exists(), "the damaged checkpoint is left for the user to inspect"


def test_a_non_finite_loss_stops_training_and_moves_no_link(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    run_train(capsys, "--epochs", "1", "--out", str(out))
    links = {name: (out / name).resolve() for name in (checkpoint.LATEST_LINK, checkpoint.BEST_LINK)}
    real_augment = train.augment
    calls = []

    def poisoned(images, generator, shift, flip):
        calls.append(1)
        images = real_augment(images, generator, shift, flip)
        return images * float("nan") if len(calls) == 4 else images

    monkeypatch.setattr(train, "augment", poisoned)
    with pytest.raises(SystemExit) as exit_info:
        train.main([*FAST, "--resume", str(out), "--epochs", "3", "--checkpoint-every", "1steps"])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    steps_per_epoch = -(-1347 // 64)
    assert exit_info.value.code == 2
    assert f"error: the training loss is not finite at step {steps_per_epoch + 4};" in last_line, last_line
    assert (out / checkpoint.BEST_LINK).resolve() == links[checkpoint.BEST_LINK]
    assert checkpoint.read_meta(out)["progress"]["step"] == steps_per_epoch + 3, (
        "the last finite step is saved"
    )


def refused_without_the_interpreter(*args: str) -> str:
    """``python -m vit.train *args`` without TRITON_INTERPRET: exit code 2 and one line on stderr,
    saying the triton backend cannot run here. Returns stderr."""
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "vit.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--backend triton cannot run here" in done.stderr
    return done.stderr


def test_the_backend_is_checked_before_any_work(tmp_path):
    started = time.monotonic()
    stderr = refused_without_the_interpreter(
        *FAST, "--backend", "triton", "--device", "cpu", "--out", str(tmp_path / "run")
    )
    assert "TRITON_INTERPRET" in stderr
    assert not (tmp_path / "run").exists(), "nothing was started"
    assert time.monotonic() - started < 60


def test_a_resumed_runs_own_backend_is_checked_before_any_work(tmp_path, capsys):
    """The backend a run was trained with comes back with --resume: checked with the options."""
    out = tmp_path / "run"
    run_train(capsys, "--epochs", "1", "--out", str(out))
    meta_file = checkpoint.resolve(out) / checkpoint.META_FILE
    meta = json.loads(meta_file.read_text())
    meta["progress"]["args"]["backend"] = "triton"  # as if trained on a GPU
    meta_file.write_text(json.dumps(meta))
    refused_without_the_interpreter("--resume", str(out), "--epochs", "2", "--device", "cpu")
