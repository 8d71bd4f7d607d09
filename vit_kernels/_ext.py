"""Loads the compiled extension ``vit_kernels._C`` when it was built, and says why when it was not.
The fake (meta) implementation and autograd of each of its ops live with the op they serve, in
``vit_kernels/ops/<op>.py``.

The ops (schemas in csrc/ops.cpp; rows are the leading dimensions of a contiguous (..., C) tensor):

* ``fused_layer_norm(x, residual?, weight?, bias?, eps) -> (y, s, mean, rstd)``
* ``bias_gelu(x, bias?, approximate) -> gelu(x + bias)``
* ``softmax(x) -> softmax over the last dimension``
* ``patchify(images (N, C, H, W), P) -> (N, (H/P)(W/P), C*P*P)`` and its adjoint ``unpatchify``
* and the backward of each: ``fused_layer_norm_backward``, ``bias_gelu_backward``, ``softmax_backward``.

The package works without the extension: the ``extension`` backend then reports itself unavailable
and ``auto`` never picks it.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from vit_kernels import backend

_C = None
_load_error: Optional[str] = None

try:
    _C = importlib.import_module("vit_kernels._C")
except ImportError as error:  # not built (VIT_KERNELS_SKIP_EXT=1, no compiler) or built for another torch
    _load_error = f"the compiled extension vit_kernels._C is not built or failed to load ({error})"

LOADED = _C is not None

# The CUDA kernels exist only when the extension was compiled with nvcc.
HAS_CUDA_KERNELS = _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
    "vit_kernels::fused_layer_norm", "CUDA"
)
CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ExtensionOps:
    """The default overloads of the named ``torch.ops.vit_kernels`` ops, as attributes, looked up
    once (resolving ``torch.ops.<namespace>.<name>`` costs a few microseconds per call)."""

    def __init__(self, *names: str):
        for name in names:
            setattr(self, name, getattr(torch.ops.vit_kernels, name).default)


def extension_unavailable_reason() -> Optional[str]:
    """None when ``vit_kernels._C`` is loaded, else why it is not."""
    return _load_error


def supports(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for the extension's implementations: None when they run on ``device``/``dtype``."""
    if _load_error is not None:
        return _load_error
    if device.type == "cpu":
        return None if dtype in CPU_DTYPES else f"the C++ CPU kernels take {CPU_DTYPES}, not {dtype}"
    if device.type == "cuda":
        if not HAS_CUDA_KERNELS:
            return "vit_kernels._C was built without CUDA kernels (torch without CUDA, or no nvcc at build time)"
        return None if dtype in CUDA_DTYPES else f"the CUDA kernels take {CUDA_DTYPES}, not {dtype}"
    return f"the extension has no kernels for {device.type} tensors"


backend.register_backend_check("extension", extension_unavailable_reason)
