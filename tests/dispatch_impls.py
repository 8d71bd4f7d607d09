"""Test-only implementations of ``vk.linear`` for the dispatch tests: two extra candidates ("slow"
and "fast", the reference's maths under other names) and one with a shape limit ("limited", K <= 4).
``install()`` registers them; ``uninstall(saved)`` puts the table back."""

from __future__ import annotations

import torch.nn.functional as F

from vit_kernels import backend


def _linear(x, weight, bias=None, residual=None):
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def install() -> dict:
    """Register the test implementations of linear; returns what to pass to ``uninstall``."""
    saved = dict(backend._registry["linear"])
    backend.register("linear", "slow", _linear)
    backend.register("linear", "fast", _linear)
    backend.register(
        "linear",
        "limited",
        _linear,
        limits=lambda x, *rest: f"K = {x.shape[-1]} > 4" if x.shape[-1] > 4 else None,
    )
    return saved


def uninstall(saved: dict) -> None:
    for name in list(backend._registry["linear"]):
        backend.unregister("linear", name)
    for name, impl in saved.items():
        backend._registry["linear"][name] = impl
    backend.clear_decisions()
