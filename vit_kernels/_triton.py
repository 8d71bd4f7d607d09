"""Triton, imported softly: the package imports (and its kernels' modules define themselves) without
triton installed; the Triton backend then reports itself unavailable and nothing launches.

Kernel modules write ``from vit_kernels._triton import triton, tl`` and decorate with
``@triton.jit`` as usual.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    def _jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    tl = types.SimpleNamespace(constexpr=object)



def dot_precision(dtype) -> str:
    """tl.dot input precision: exact products for float32 inputs (tf32 would lose accuracy that
    PyTorch's float32 reference keeps); 16-bit inputs multiply exactly either way."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


__all__ = ["HAS_TRITON", "dot_precision", "triton", "tl"]
