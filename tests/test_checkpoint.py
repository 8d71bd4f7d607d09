"""Checkpoint files: atomic writes, the latest/best links, --keep, leftovers of killed saves."""

import json
import os

import pytest
import torch

from vit import checkpoint
from vit.model import create_model


def contents(step: int) -> dict:
    model = create_model("vit_digits")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model_state": model.state_dict(), "optimizer_state": get_optimizer_state_dict(model, optimizer),
        "state_tensors": {"rng.cpu": torch.get_rng_state()},
        "meta": {"model": "vit_digits", "config": {}, "progress": {"step": step}},
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
    with pytest.raises(checkpoint.CheckpointError, match="incomplete: model.safetensors"):
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
    saved = [store.save(epoch=i, step=10 * i, best=i == 2, **contents(i)) for i in range(1, 6)]
    names = sorted(p.name for p in (tmp_path / checkpoint.FOLDERS).iterdir())
    assert names == sorted([saved[1].name, saved[3].name, saved[4].name]), "the 2 latest and the best"
    assert store.linked(checkpoint.BEST_LINK) == saved[1].resolve()
    assert store.linked(checkpoint.LATEST_LINK) == saved[4].resolve()
    assert os.readlink(tmp_path / checkpoint.LATEST_LINK) == os.path.join(checkpoint.FOLDERS, saved[4].name), "relative link"
    # a run folder resolves to its latest checkpoint
    assert checkpoint.resolve(tmp_path) == saved[4].resolve()
    assert json.loads((saved[4] / checkpoint.META_FILE).read_text())["progress"]["step"] == 5


def test_resolve_rejects_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint: expected a folder holding checkpoint.json"):
        checkpoint.resolve(tmp_path)
