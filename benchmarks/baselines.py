"""Implementations the GPU report times beside ``ops_bench.implementations``: the op's eager reference
called directly (``pytorch``: plain PyTorch, no vit_kernels dispatch), the ``auto`` backend, and for
attention each SDPA backend forced with ``torch.nn.attention.sdpa_kernel`` (``sdpa_flash``,
``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``), called as the reference calls SDPA: from the
packed qkv, with the layout copies a model makes. A backend that cannot take the shapes raises, and
the row says so instead of a time.
"""

from __future__ import annotations

from typing import Callable

from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.cases import OpCase
from benchmarks.ops_bench import on_backend

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}


def _with_sdpa(kind: SDPBackend, fn: Callable[..., object]) -> Callable[..., object]:
    def run(**inputs):
        with sdpa_kernel(kind):
            return fn(**inputs)

    return run


def extra_implementations(case: OpCase) -> dict[str, Callable[..., object]]:
    """name -> callable taking the case's inputs by name."""
    found = {"pytorch": case.reference, "auto": on_backend("auto", case.run)}
    if case.op == "attention":
        found.update({name: _with_sdpa(kind, case.reference) for name, kind in SDPA_BACKENDS.items()})
    return found
