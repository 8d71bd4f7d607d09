"""Checkpoints as a folder: ``model.safetensors`` (weights), ``optimizer.safetensors`` (AdamW
moments) and ``checkpoint.json`` (model config, dataset statistics, training progress, the optimizer's
non-tensor state). safetensors holds tensors only, so nothing executable is ever unpickled."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from vit.model import ViT, ViTConfig

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "checkpoint.json"


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, key = flat.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    folder: str | Path,
    model: ViT,
    *,
    model_name: str,
    dataset: dict,
    progress: dict,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> Path:
    """Write the checkpoint folder; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / MODEL_FILE))
    meta = {"model": model_name, "config": dataclasses.asdict(model.config), "dataset": dataset, "progress": progress}
    if optimizer is not None:
        tensors, optimizer_meta = _flatten_optimizer(optimizer.state_dict())
        save_file(tensors, str(folder / OPTIMIZER_FILE))
        meta["optimizer"] = optimizer_meta
    (folder / META_FILE).write_text(json.dumps(meta, indent=2))
    return folder


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: a checkpoint folder holds {META_FILE} and {MODEL_FILE}")
    return json.loads(path.read_text())


def load_model(folder: str | Path, device: str | torch.device = "cpu") -> tuple[ViT, dict]:
    """The model stored in ``folder`` (weights loaded strictly) and the checkpoint's metadata."""
    meta = read_meta(folder)
    weights_path = Path(folder) / MODEL_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{str(weights_path)!r} not found beside {META_FILE}")
    model = ViT(ViTConfig(**meta["config"]))
    model.load_state_dict(load_file(str(weights_path)), strict=True)
    return model.to(device), meta


def load_optimizer_state(folder: str | Path, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Restore the optimizer saved beside the model (moments move to the parameters' device)."""
    path = Path(folder) / OPTIMIZER_FILE
    if "optimizer" not in meta or not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: the checkpoint holds no optimizer state to resume from")
    optimizer.load_state_dict(_unflatten_optimizer(load_file(str(path)), meta["optimizer"]))
