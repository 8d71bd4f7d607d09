"""``vk.tune(model, example_inputs)``: let ``auto`` measure every op signature of a model now.

Run it before ``torch.compile`` (under tracing nothing is timed, so a compiled model uses the
decisions measured here, or the static defaults) or before serving, with inputs of the shapes the
model will see. The decisions go to the in-memory and on-disk caches like any other.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from vit_kernels import backend
from vit_kernels._explain import Explanation


def tune(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    grad: Optional[bool] = None,
) -> Explanation:
    """Run ``model(*example_inputs)`` once with ``auto`` measuring every signature it has not met.

    model: a module built from vit_kernels ops (vit models, vit_kernels.nn layers, patched models).
    example_inputs: a tuple of the model's positional inputs, e.g. ``(images,)`` with images
    (N, C, H, W). grad: tune the training signatures (forward + backward), default: when the model
    is in training mode and has parameters that require grad. Measuring happens even where
    ``set_autotune(False)`` turned it off for ordinary calls. Returns ``explain()`` restricted to
    the signatures this run met.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, e.g. (images,)")
    if grad is None:
        grad = model.training and any(p.requires_grad for p in model.parameters())
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool or None, got {type(grad).__name__}")

    def identity(r):
        return (r.op, r.device, r.dtype, r.shapes, r.grad, r.requested, r.source)

    calls_before = {identity(r): r.calls for r in backend.explain()}
    enabled = backend.autotune_settings()["enabled"]
    backend.set_autotune(True)
    try:
        with backend.use_backend("auto"), torch.set_grad_enabled(grad):
            model(*example_inputs)
    finally:
        backend.set_autotune(enabled)
    return Explanation([r for r in backend.explain() if r.calls > calls_before.get(identity(r), 0)])
