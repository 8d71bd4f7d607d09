"""Test-only implementations of ``vk.linear`` for the dispatch tests: a reference slowed to a known
time, and candidates that are slow, fast, or wrong. ``install()`` registers them; ``python -m
tests.dispatch_impls`` runs one call with them and prints what explain() says (for the
second-process cache test)."""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from vit_kernels import backend

REFERENCE_S = 0.02


def _linear(x, weight, bias=None, residual=None):
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def _sleeping(seconds: float, offset: float = 0.0):
    def fn(x, weight, bias=None, residual=None):
        if not torch.compiler.is_compiling():  # compiled graphs run the same maths, untimed
            time.sleep(seconds)
        return _linear(x, weight, bias, residual) + offset

    return fn


def install(fast_s: float = 0.0) -> dict:
    """Register the test implementations of linear; returns what to pass to ``uninstall``."""
    saved = dict(backend._registry["linear"])
    backend.register("linear", "torch", _sleeping(REFERENCE_S))
    backend.register("linear", "slow", _sleeping(2 * REFERENCE_S))
    backend.register("linear", "fast", _sleeping(fast_s))
    backend.register("linear", "wrong", _sleeping(0.0, offset=1.0))
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


if __name__ == "__main__":
    import warnings

    import vit_kernels as vk

    install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vk.linear(torch.randn(4, 8), torch.randn(3, 8))
    row = vk.explain().as_dicts()[0]
    print(
        json.dumps(
            {"backend": row["backend"], "source": row["source"], "warnings": [str(w.message) for w in caught]}
        )
    )
