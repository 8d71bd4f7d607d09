"""Checkpoints as a folder: ``model.safetensors`` (weights), ``optimizer.safetensors`` (AdamW
moments, keyed by parameter name), ``state.safetensors`` (RNG states) and ``checkpoint.json`` (model
config, dataset, training options and progress, the optimizer's non-tensor state, and each file's
size and sha256). safetensors holds tensors only, so nothing executable is ever unpickled, and a
file whose bytes differ from those written (truncated, overwritten, another run's) is refused with
the file's name before anything reads it.

Writes are atomic: a checkpoint is written to a hidden temporary folder beside its final place,
every file and the folder are fsynced, and only then is it renamed into place. A run folder holds

    checkpoints/ckpt-000007-epoch0003-step00000063/   complete checkpoints, never modified in place
    checkpoint -> checkpoints/ckpt-...                the latest (a symlink, replaced atomically)
    best       -> checkpoints/ckpt-...                the one with the best test accuracy

so a kill at any moment leaves ``checkpoint`` pointing at a complete checkpoint (or absent, before
the first one): the previous link stays valid until the new folder is complete, and old folders are
deleted only once no link points at them. Rotation never deletes the best checkpoint nor the last
checkpoint of a finished run (its folder name ends in ``-final``); ``best`` moves only to a checkpoint
that scores a higher test accuracy on the same test split, and no link moves to a checkpoint whose
metrics are not finite.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from vit.model import ViT, ViTConfig

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.safetensors"
META_FILE = "checkpoint.json"
LATEST_LINK = "checkpoint"
BEST_LINK = "best"
FOLDERS = "checkpoints"
_FOLDER_NAME = re.compile(r"^ckpt-(\d+)-")
FINAL_SUFFIX = "-final"
# (path, size, mtime) of files whose sha256 matched in this process: a file is hashed once.
_verified: set[tuple[str, int, int]] = set()


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete or not a checkpoint."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict keyed by parameter name (``{"state": {name: {key: value}},
    "param_groups": [...]}``) -> tensors named ``"<name>.<key>"`` and the JSON-able rest."""
    tensors, scalars = {}, {}
    for name, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, key = flat.rsplit(".", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def write_checkpoint(
    folder: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    meta: dict,
    optimizer_state: Optional[dict] = None,
    state_tensors: Optional[dict[str, torch.Tensor]] = None,
) -> Path:
    """Write a checkpoint to ``folder`` atomically (``folder`` must not exist yet); returns it.

    ``model_state``: parameter name -> tensor; ``optimizer_state``: keyed by parameter name (see
    :func:`flatten_optimizer`); ``state_tensors``: other tensors (RNG states)."""
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"checkpoint folder {str(folder)!r} already exists")
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    meta = dict(meta)
    files = {MODEL_FILE: {k: v.detach().contiguous().cpu() for k, v in model_state.items()}}
    if optimizer_state is not None:
        files[OPTIMIZER_FILE], meta["optimizer"] = flatten_optimizer(optimizer_state)
    if state_tensors:
        files[STATE_FILE] = {k: v.detach().contiguous().cpu() for k, v in state_tensors.items()}
    for name, tensors in files.items():
        save_file(tensors, str(temporary / name))
        _fsync_path(temporary / name)
    meta["files"] = {
        name: {"bytes": (temporary / name).stat().st_size, "sha256": sha256_of(temporary / name)}
        for name in files
    }
    with open(temporary / META_FILE, "w") as handle:
        json.dump(meta, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_path(temporary)
    os.rename(temporary, folder)
    _fsync_path(folder.parent)
    return folder


def save_checkpoint(
    folder: str | Path,
    model: ViT,
    *,
    model_name: str,
    dataset: dict,
    progress: dict,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> Path:
    """Write a single model (and optionally its optimizer) to a new checkpoint ``folder``."""
    optimizer_state = None
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer_state = get_optimizer_state_dict(model, optimizer)
    meta = {
        "model": model_name,
        "config": dataclasses.asdict(model.config),
        "dataset": dataset,
        "progress": progress,
    }
    return write_checkpoint(
        folder, model_state=model.state_dict(), meta=meta, optimizer_state=optimizer_state
    )


def run_folder_of(checkpoint_folder: str | Path) -> Path:
    """The run folder a checkpoint folder belongs to (``<run>/checkpoints/ckpt-...``, or a checkpoint
    of the older layout directly inside the run folder)."""
    folder = Path(checkpoint_folder)
    return folder.parent.parent if folder.parent.name == FOLDERS else folder.parent


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, given it or a run folder holding a ``checkpoint`` link to one."""
    path = Path(path)
    if not (path / META_FILE).is_file() and (path / LATEST_LINK / META_FILE).is_file():
        path = path / LATEST_LINK
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: expected a folder holding {META_FILE} and {MODEL_FILE} "
            f"(or a run folder with a {LATEST_LINK!r} link to one)"
        )
    return path.resolve()


def read_meta(folder: str | Path) -> dict:
    """The checkpoint's metadata, after checking that every file it lists is there with the size and
    the sha256 recorded when it was written (checkpoints of older versions record sizes only)."""
    folder = resolve(folder)
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
            raise ValueError("not a checkpoint's metadata")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{str(folder / META_FILE)!r} is unreadable ({error})") from error
    for name, recorded in meta.get("files", {MODEL_FILE: None}).items():
        _verify(folder, name, recorded)
    meta["folder"] = str(folder)
    return meta


def _verify(folder: Path, name: str, recorded) -> None:
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(folder)!r} is incomplete: {name} is missing")
    size, digest = (
        (recorded.get("bytes"), recorded.get("sha256")) if isinstance(recorded, dict) else (recorded, None)
    )
    stat = path.stat()
    if size is not None and stat.st_size != size:
        raise CheckpointError(f"{str(path)!r} is damaged: {stat.st_size} bytes, {size} were written")
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if digest is None or key in _verified:
        return
    if sha256_of(path) != digest:
        raise CheckpointError(
            f"{str(path)!r} is damaged: its sha256 differs from the one recorded when it was written"
        )
    _verified.add(key)


def finite_evaluation(meta: dict) -> bool:
    """Whether the checkpoint's recorded test metrics (if any) are finite numbers."""
    evaluation = meta.get("evaluation") or {}
    return all(
        isinstance(v, (int, float)) and math.isfinite(v) for k, v in evaluation.items() if k != "split"
    )


def load_tensors(folder: str | Path, name: str) -> dict[str, torch.Tensor]:
    path = Path(folder) / name
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} not found: the checkpoint holds no {name}")
    return load_file(str(path))


def load_model(folder: str | Path, device: str | torch.device = "cpu") -> tuple[ViT, dict]:
    """The model stored in ``folder`` (a checkpoint or a run folder; weights loaded strictly) and
    the checkpoint's metadata."""
    meta = read_meta(folder)
    model = ViT(ViTConfig(**meta["config"]))
    model.load_state_dict(load_tensors(meta["folder"], MODEL_FILE), strict=True)
    return model.to(device), meta


def load_optimizer_state(folder: str | Path, meta: dict) -> dict:
    """The optimizer state saved beside the model, keyed by parameter name."""
    if "optimizer" not in meta:
        raise CheckpointError(f"checkpoint {str(folder)!r} holds no optimizer state to resume from")
    return unflatten_optimizer(load_tensors(folder, OPTIMIZER_FILE), meta["optimizer"])


class RunFolder:
    """The checkpoints of one run folder: numbered, atomically written, linked as ``checkpoint``
    (latest) and ``best``; all but the ``keep`` latest, the best and a finished run's last are deleted."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root, self.keep = Path(root), keep
        self.folders = self.root / FOLDERS

    def clean_leftovers(self) -> None:
        """Remove what a killed save or deletion left behind (never a complete checkpoint)."""
        if self.folders.is_dir():
            for leftover in self.folders.glob(".*"):
                shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(".*.tmp-*"):
            leftover.unlink(missing_ok=True)
        for leftover in self.root.glob(".trash-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _numbered(self) -> list[tuple[int, Path]]:
        if not self.folders.is_dir():
            return []
        found = ((_FOLDER_NAME.match(p.name), p) for p in self.folders.iterdir())
        return sorted((int(m.group(1)), p) for m, p in found if m)

    def linked(self, link: str) -> Optional[Path]:
        path = self.root / link
        return path.resolve() if path.is_symlink() and path.exists() else None

    def holds_run(self) -> bool:
        """Whether a run has saved a checkpoint here (a folder a new run must not write into)."""
        return (
            bool(self._numbered())
            or (self.root / LATEST_LINK).exists()
            or (self.root / LATEST_LINK).is_symlink()
        )

    def newest_intact(self, at_most: Optional[str | Path] = None) -> Optional[Path]:
        """The newest checkpoint whose files all match their recorded sizes and sha256, or None;
        with ``at_most`` (a checkpoint folder of this run), none newer than that one."""
        limit = _FOLDER_NAME.match(Path(at_most).name) if at_most is not None else None
        for number, folder in reversed(self._numbered()):
            if limit is not None and number > int(limit.group(1)):
                continue
            try:
                read_meta(folder)
                return folder.resolve()
            except CheckpointError:
                continue
        return None

    def erase(self) -> None:
        """Delete the run kept here: its numbered checkpoints, its links and its metrics, and nothing
        else of the folder (what ``--overwrite`` asks for). A folder that holds no run is left as it is."""
        if not self.holds_run():
            return
        for link in (LATEST_LINK, BEST_LINK):
            path = self.root / link
            if path.is_symlink():
                path.unlink()
            elif path.is_dir():  # a checkpoint folder of the older layout
                self._discard(path)
        for name in ("metrics.json", "metrics.csv"):
            (self.root / name).unlink(missing_ok=True)
        for _, folder in self._numbered():
            self._discard(folder)

    def _discard(self, folder: Path) -> None:
        trash = folder.parent / f".trash-{folder.name}"
        os.rename(folder, trash)  # one atomic step out of sight, then the slow delete
        shutil.rmtree(trash, ignore_errors=True)

    def save(self, *, epoch: int, step: int, best: bool, final: bool = False, **contents: Any) -> Path:
        """Write a checkpoint (``contents`` as for :func:`write_checkpoint`), point ``checkpoint``
        at it (and ``best``, if ``best`` and its ``meta["evaluation"]`` beats the current best's on
        the same split), then delete the ones no longer kept. ``final``: the last checkpoint of a
        finished run, never rotated away. A checkpoint with non-finite metrics is refused."""
        meta = contents.get("meta", {})
        if not finite_evaluation(meta):
            raise ValueError(f"refusing to save a checkpoint with non-finite metrics {meta['evaluation']}")
        numbered = self._numbered()
        number = numbered[-1][0] + 1 if numbered else 1
        name = f"ckpt-{number:06d}-epoch{epoch:04d}-step{step:08d}" + (FINAL_SUFFIX if final else "")
        folder = write_checkpoint(self.folders / name, **contents)
        self._point(LATEST_LINK, folder)
        if best and self._beats_best(meta.get("evaluation")):
            self._point(BEST_LINK, folder)
        self._prune()
        return folder

    def _beats_best(self, evaluation: Optional[dict]) -> bool:
        if not evaluation or "test_accuracy" not in evaluation:
            return False
        current = self.linked(BEST_LINK)
        try:
            previous = json.loads((current / META_FILE).read_text()).get("evaluation") if current else None
        except (OSError, ValueError):
            previous = None  # an unreadable best is no best
        if not previous or "test_accuracy" not in previous:
            return True
        return (
            previous.get("split") == evaluation.get("split")
            and evaluation["test_accuracy"] > previous["test_accuracy"]
        )

    def _point(self, link: str, target: Path) -> None:
        path = self.root / link
        if path.is_dir() and not path.is_symlink():  # a checkpoint folder of the older layout
            os.rename(path, self.folders / f"ckpt-000000-{link}-legacy")
        temporary = self.root / f".{link}.tmp-{os.getpid()}"
        temporary.unlink(missing_ok=True)
        os.symlink(os.path.relpath(target, self.root), temporary)
        os.replace(temporary, path)
        _fsync_path(self.root)

    def _prune(self) -> None:
        kept = {p.resolve() for _, p in self._numbered()[-self.keep :]}
        kept |= {p for p in (self.linked(LATEST_LINK), self.linked(BEST_LINK)) if p is not None}
        for _, folder in self._numbered():
            if folder.resolve() not in kept and not folder.name.endswith(FINAL_SUFFIX):
                self._discard(folder)
