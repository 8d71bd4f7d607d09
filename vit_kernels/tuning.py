"""Searching, when a user asks for it: ``vk.tune(model, example_inputs)``, and the file it leaves.

By default the tables decide (``vit_kernels.backend``, ``vit_kernels._tiles``). ``tune`` runs the
model once with searching on: ``auto`` times every capable implementation of each signature it has
not met, and each Triton launcher proves, checks and times its tiles. The decisions go to the
on-disk cache, where later processes find them (searching or not), and ``save_tuning(path)`` writes
them to one file to ship beside a model; ``load_tuning(path)`` makes them run in another process.
Under ``torch.distributed`` rank 0 searches and every rank runs its decisions.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence, Union

import torch

from vit_kernels import _tiles, backend
from vit_kernels._explain import Explanation
from vit_kernels._files import write_atomically
from vit_kernels._tune_cache import environment, store

FORMAT = 1


def tune(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    grad: Optional[bool] = None,
    autocast: Optional[torch.dtype] = None,
) -> Explanation:
    """Run ``model(*example_inputs)`` once, searching every signature and tile it has not met.

    model: a module built from vit_kernels ops (vit models, vit_kernels.nn layers, patched models).
    example_inputs: a tuple of the model's positional inputs, e.g. ``(images,)`` with images
    (N, C, H, W), of the shapes training or serving will see. grad: tune the training signatures
    (forward + backward), default: when the model is in training mode and has parameters that
    require grad. autocast: the dtype training runs autocast in (e.g. ``torch.bfloat16``), so that
    the signatures searched are the ones the step meets (an autocast already in force counts too).
    Under ``torch.distributed`` every rank calls it: rank 0 searches, the others run its decisions.
    Returns ``explain()`` restricted to the signatures this run met.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, e.g. (images,)")
    if grad is None:
        grad = model.training and any(p.requires_grad for p in model.parameters())
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool or None, got {type(grad).__name__}")
    if autocast is not None and autocast not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast must be torch.float16, torch.bfloat16 or None, got {autocast!r}")
    device_type = next((a.device.type for a in example_inputs if isinstance(a, torch.Tensor)), "cpu")
    rank, shared = _rank()

    def identity(r):
        return (r.op, r.device, r.dtype, r.shapes, r.grad, r.requested, r.source)

    calls_before = {identity(r): r.calls for r in backend.explain()}
    _forget_decided()  # what earlier calls took from the tables is decided again, by a search
    with (
        _tiles.search(rank == 0),
        backend.use_backend("auto"),
        torch.set_grad_enabled(grad),
        torch.autocast(device_type, dtype=autocast, enabled=autocast is not None),
    ):
        model(*example_inputs)
    if shared:
        decisions = [tuning() if rank == 0 else None]
        torch.distributed.broadcast_object_list(decisions, src=0)
        if rank != 0:
            _hold(decisions[0])  # its calls from now on run them (the explanation shows its own run)
    return Explanation([r for r in backend.explain() if r.calls > calls_before.get(identity(r), 0)])


def _rank() -> tuple[int, bool]:
    """(this process's rank, whether decisions are shared among several ranks)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return 0, False
    return torch.distributed.get_rank(), True


def tuning() -> dict:
    """Every tuned decision and tile this process knows (searched here, read from the cache or
    loaded), as the JSON-able dict ``save_tuning`` writes."""
    return {
        "format": FORMAT,
        "environment": environment(),
        "dispatch": dict(store().items("dispatch")),
        "tiles": dict(store().items("tiles")),
    }


def save_tuning(path: Union[str, os.PathLike]) -> None:
    """Write ``tuning()`` to ``path`` (JSON, atomically): ``load_tuning(path)`` in another process
    runs these decisions without searching. Each entry names the device it was measured on."""
    write_atomically(os.fspath(path), json.dumps(tuning(), indent=1, sort_keys=True))


def load_tuning(path: Union[str, os.PathLike]) -> None:
    """Run the decisions of a ``save_tuning`` file from now on in this process (ahead of the cache's;
    searching nothing). Raises ValueError for a file that is not one."""
    with open(path, encoding="utf-8") as source:
        try:
            data = json.load(source)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a vit_kernels tuning file: {error}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not all(isinstance(data.get(kind), dict) for kind in ("dispatch", "tiles"))
    ):
        raise ValueError(f"{path} is not a vit_kernels tuning file of format {FORMAT}")
    _hold(data)


def _hold(data: dict) -> None:
    store().hold("dispatch", data["dispatch"])
    store().hold("tiles", data["tiles"])
    _forget_decided()


def _forget_decided() -> None:
    """Forget the choices kept per call signature and per tile key in memory: the next calls decide
    again, tuned decisions coming back from the caches."""
    backend._forget_choices()
    _tiles.TileChooser.forget_all()
