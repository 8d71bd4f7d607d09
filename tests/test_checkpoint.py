"""Checkpoint files: atomic writes, the latest/best links, --keep, leftovers of killed saves."""

import json
import os

import pytest
import torch

from vit import checkpoint
from vit.model import create_model


def contents(step: int, accuracy: float = 0.5, split: str = "split-a") -> dict:
    model = create_model("vit_digits")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model_state": model.state_dict(),
        "optimizer_state": get_optimizer_state_dict(model, optimizer),
        "state_tensors": {"rng.cpu": torch.get_rng_state()},
        "meta": {
            "model": "vit_digits",
            "config": {},
            "progress": {"step": step},
            "evaluation": {"test_accuracy": accuracy, "test_loss": 1.0, "split": split},
        },
    }


def test_write_then_read_round_trip(tmp_path):
    written = contents(3)
    folder = checkpoint.write_checkpoint(tmp_path / "ckpt", **written)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [checkpoint.MODEL_FILE, checkpoint.OPTIMIZER_FILE, checkpoint.STATE_FILE, checkpoint.META_FILE]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary folder is left"
    meta = checkpoint.read_meta(folder)
    weights = checkpoint.load_tensors(folder, checkpoint.MODEL_FILE)
    assert all(torch.equal(weights[k], v) for k, v in written["model_state"].items())
    optimizer = checkpoint.load_optimizer_state(folder, meta)
    for name, state in written["optimizer_state"]["state"].items():
        assert torch.equal(optimizer["state"][name]["exp_avg"], state["exp_avg"])
        assert optimizer["state"][name]["step"] == state["step"]
    with pytest.raises(FileExistsError):
        checkpoint.write_checkpoint(folder, **written)


def test_a_truncated_file_is_detected(tmp_path):
    folder = checkpoint.write_checkpoint(tmp_path / "ckpt", **contents(1))
    path = folder / checkpoint.MODEL_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        checkpoint.CheckpointError, match=r"model.safetensors' is damaged: \d+ bytes, \d+ were written"
    ):
        checkpoint.read_meta(folder)
    (folder / checkpoint.META_FILE).write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.read_meta(folder)


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    store = checkpoint.RunFolder(tmp_path, keep=2)
    first = store.save(epoch=1, step=10, best=True, **contents(10))
    calls = []

    def dies_on_second_file(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real_save(tensors, path)

    real_save = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", dies_on_second_file)
    with pytest.raises(KeyboardInterrupt):
        store.save(epoch=2, step=20, best=False, **contents(20))
    monkeypatch.undo()
    assert store.linked(checkpoint.LATEST_LINK) == first.resolve()
    assert checkpoint.read_meta(tmp_path / checkpoint.LATEST_LINK)["progress"]["step"] == 10
    leftovers = [p for p in (tmp_path / checkpoint.FOLDERS).iterdir() if p.name.startswith(".")]
    assert leftovers, "the half-written checkpoint stays hidden in a temporary folder"
    store.clean_leftovers()
    assert [p.name for p in (tmp_path / checkpoint.FOLDERS).iterdir()] == [first.name]


def test_keep_and_best(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=2)
    saved = [
        store.save(epoch=i, step=10 * i, best=i == 2, **contents(i, accuracy=0.1 * i)) for i in range(1, 6)
    ]
    names = sorted(p.name for p in (tmp_path / checkpoint.FOLDERS).iterdir())
    assert names == sorted([saved[1].name, saved[3].name, saved[4].name]), "the 2 latest and the best"
    assert store.linked(checkpoint.BEST_LINK) == saved[1].resolve()
    assert store.linked(checkpoint.LATEST_LINK) == saved[4].resolve()
    assert os.readlink(tmp_path / checkpoint.LATEST_LINK) == os.path.join(
        checkpoint.FOLDERS, saved[4].name
    ), "relative link"
    # a run folder resolves to its latest checkpoint
    assert checkpoint.resolve(tmp_path) == saved[4].resolve()
    assert json.loads((saved[4] / checkpoint.META_FILE).read_text())["progress"]["step"] == 5


def test_resolve_rejects_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(
        checkpoint.CheckpointError, match="is not a checkpoint: expected a folder holding checkpoint.json"
    ):
        checkpoint.resolve(tmp_path)


def test_a_damaged_file_is_refused_with_its_name(tmp_path):
    folder = checkpoint.write_checkpoint(tmp_path / "ckpt", **contents(1))
    recorded = json.loads((folder / checkpoint.META_FILE).read_text())["files"][checkpoint.MODEL_FILE]
    assert (
        recorded["bytes"] == (folder / checkpoint.MODEL_FILE).stat().st_size and len(recorded["sha256"]) == 64
    )
    model_file = folder / checkpoint.MODEL_FILE
    data = bytearray(model_file.read_bytes())
    data[-2000:] = os.urandom(2000)  # the header intact, the size unchanged: only the checksum can tell
    model_file.write_bytes(bytes(data))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"model.safetensors' is damaged: its sha256 differs"
    ):
        checkpoint.read_meta(folder)
    with pytest.raises(checkpoint.CheckpointError, match="is damaged"):
        checkpoint.load_model(folder)


def test_checkpoints_of_older_versions_record_sizes_only(tmp_path):
    folder = checkpoint.write_checkpoint(tmp_path / "ckpt", **contents(1))
    meta = json.loads((folder / checkpoint.META_FILE).read_text())
    meta["files"] = {name: entry["bytes"] for name, entry in meta["files"].items()}
    (folder / checkpoint.META_FILE).write_text(json.dumps(meta))
    assert checkpoint.read_meta(folder)["progress"]["step"] == 1
    with open(folder / checkpoint.MODEL_FILE, "ab") as handle:
        handle.write(b"x")
    with pytest.raises(checkpoint.CheckpointError, match="is damaged: .* bytes"):
        checkpoint.read_meta(folder)


def test_newest_intact_skips_damaged_checkpoints(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=3)
    saved = [store.save(epoch=i, step=i, best=False, **contents(i)) for i in range(1, 4)]
    assert store.newest_intact() == saved[2].resolve()
    with open(saved[2] / checkpoint.OPTIMIZER_FILE, "r+b") as handle:
        handle.seek(-10, os.SEEK_END)
        handle.write(b"0123456789")
    checkpoint._verified.clear()
    assert store.newest_intact() == saved[1].resolve()


def test_best_moves_only_to_a_higher_score_on_the_same_split(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=1)
    first = store.save(epoch=1, step=1, best=True, **contents(1, accuracy=0.9))
    store.save(epoch=2, step=2, best=True, **contents(2, accuracy=0.8))
    assert store.linked(checkpoint.BEST_LINK) == first.resolve(), "a lower score"
    store.save(epoch=3, step=3, best=True, **contents(3, accuracy=0.95, split="split-b"))
    assert store.linked(checkpoint.BEST_LINK) == first.resolve(), "a higher score on another split"
    third = store.save(epoch=4, step=4, best=True, **contents(4, accuracy=0.95))
    assert store.linked(checkpoint.BEST_LINK) == third.resolve()
    assert not first.exists(), "the former best is rotated away once nothing points at it"


def test_non_finite_metrics_are_never_saved_or_linked(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=2)
    good = store.save(epoch=1, step=1, best=True, **contents(1))
    bad = contents(2)
    bad["meta"]["evaluation"]["test_loss"] = float("nan")
    with pytest.raises(ValueError, match="non-finite metrics"):
        store.save(epoch=2, step=2, best=True, **bad)
    assert store.linked(checkpoint.LATEST_LINK) == store.linked(checkpoint.BEST_LINK) == good.resolve()


def test_rotation_keeps_a_finished_runs_last_checkpoint(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=1)
    final = store.save(epoch=2, step=2, best=False, final=True, **contents(2))
    assert final.name.endswith(checkpoint.FINAL_SUFFIX)
    later = [store.save(epoch=e, step=e, best=False, **contents(e)) for e in (3, 4, 5)]
    names = sorted(p.name for p in (tmp_path / checkpoint.FOLDERS).iterdir())
    assert names == sorted([final.name, later[-1].name]), "the finished run's last and the latest"


def test_holds_run_and_erase(tmp_path):
    store = checkpoint.RunFolder(tmp_path / "run")
    assert not store.holds_run()
    store.save(epoch=1, step=1, best=True, **contents(1))
    (tmp_path / "run" / "metrics.json").write_text("[]")
    assert store.holds_run()
    (tmp_path / "run" / "notes.txt").write_text("the user's")
    store.erase()
    assert not store.holds_run() and not any((tmp_path / "run" / checkpoint.FOLDERS).iterdir())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [checkpoint.FOLDERS, "notes.txt"]
    unrelated = tmp_path / "other"
    (unrelated / checkpoint.FOLDERS / "mine").mkdir(parents=True)
    checkpoint.RunFolder(unrelated).erase()
    assert (unrelated / checkpoint.FOLDERS / "mine").is_dir(), "a folder that holds no run is left as it is"


def test_resume_fallback_never_goes_past_the_checkpoint_named(tmp_path):
    store = checkpoint.RunFolder(tmp_path, keep=3)
    saved = [store.save(epoch=i, step=i, best=False, **contents(i)) for i in range(1, 4)]
    assert store.newest_intact(at_most=saved[1]) == saved[1].resolve()
    assert store.newest_intact(at_most=saved[0]) == saved[0].resolve()
