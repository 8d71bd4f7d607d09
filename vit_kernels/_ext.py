"""Loads the compiled extension ``vit_kernels._C`` when it was built, and says why when it was not;
registers a fake (meta) implementation and autograd for each of its ops, so that they trace under
``torch.compile`` and differentiate like any torch op.

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

# The CUDA kernels exist only when the extension was compiled with nvcc.
HAS_CUDA_KERNELS = _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
    "vit_kernels::fused_layer_norm", "CUDA"
)
CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The CUDA layer_norm keeps a row in shared memory; wider rows use the reference.
MAX_CUDA_COLUMNS = 6144


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


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() else 1


def _register() -> None:
    ops = torch.ops.vit_kernels

    # --- fused_layer_norm ---------------------------------------------------------------------
    @torch.library.register_fake("vit_kernels::fused_layer_norm")
    def _(x, residual, weight, bias, eps):
        summed = torch.empty_like(x) if residual is not None else x.new_empty((0,))
        stats = x.new_empty((_rows(x),), dtype=_stat_dtype(x))
        return torch.empty_like(x), summed, stats, torch.empty_like(stats)

    @torch.library.register_fake("vit_kernels::fused_layer_norm_backward")
    def _(grad_out, grad_summed, summed, weight, mean, rstd, weight_bias_grad):
        reduced = summed.new_empty((summed.shape[-1] if weight_bias_grad else 0,), dtype=_stat_dtype(summed))
        return torch.empty_like(summed), reduced, torch.empty_like(reduced)

    def layer_norm_setup(ctx, inputs, output):
        x, residual, weight, bias, _ = inputs
        _, summed, mean, rstd = output
        ctx.save_for_backward(summed if residual is not None else x, weight, mean, rstd)
        ctx.has_residual, ctx.has_bias = residual is not None, bias is not None

    def layer_norm_backward(ctx, grad_y, grad_summed, _grad_mean, _grad_rstd):
        summed, weight, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_summed = grad_summed.contiguous() if ctx.has_residual else None
        ds, dw, db = ops.fused_layer_norm_backward(
            grad_y.contiguous(), grad_summed, summed, weight, mean, rstd, needs[2] or needs[3]
        )
        dw = dw.to(weight.dtype) if needs[2] else None
        db = db.to(summed.dtype) if needs[3] else None
        return ds if needs[0] else None, ds if needs[1] else None, dw, db, None

    torch.library.register_autograd("vit_kernels::fused_layer_norm", layer_norm_backward, setup_context=layer_norm_setup)

    # --- bias_gelu ----------------------------------------------------------------------------
    @torch.library.register_fake("vit_kernels::bias_gelu")
    def _(x, bias, approximate):
        return torch.empty_like(x)

    @torch.library.register_fake("vit_kernels::bias_gelu_backward")
    def _(grad_out, x, bias, approximate):
        return torch.empty_like(x)

    def bias_gelu_setup(ctx, inputs, output):
        x, bias, ctx.approximate = inputs
        ctx.save_for_backward(x, bias)

    def bias_gelu_backward(ctx, grad):
        x, bias = ctx.saved_tensors
        dz = ops.bias_gelu_backward(grad.contiguous(), x, bias, ctx.approximate)
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dz if ctx.needs_input_grad[0] else None, dbias, None

    torch.library.register_autograd("vit_kernels::bias_gelu", bias_gelu_backward, setup_context=bias_gelu_setup)

    # --- softmax ------------------------------------------------------------------------------
    @torch.library.register_fake("vit_kernels::softmax")
    def _(x):
        return torch.empty_like(x)

    @torch.library.register_fake("vit_kernels::softmax_backward")
    def _(grad_out, out):
        return torch.empty_like(out)

    def softmax_setup(ctx, inputs, output):
        ctx.save_for_backward(output)

    def softmax_backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return ops.softmax_backward(grad.contiguous(), out)

    torch.library.register_autograd("vit_kernels::softmax", softmax_backward, setup_context=softmax_setup)

    # --- patchify / unpatchify (each the other's adjoint) -------------------------------------
    @torch.library.register_fake("vit_kernels::patchify")
    def _(images, patch_size):
        n, c, h, w = images.shape
        return images.new_empty((n, (h // patch_size) * (w // patch_size), c * patch_size * patch_size))

    @torch.library.register_fake("vit_kernels::unpatchify")
    def _(patches, channels, height, width, patch_size):
        return patches.new_empty((patches.shape[0], channels, height, width))

    def patchify_setup(ctx, inputs, output):
        images, ctx.patch_size = inputs
        ctx.image_shape = images.shape[1:]

    def patchify_backward(ctx, grad):
        channels, height, width = ctx.image_shape
        return ops.unpatchify(grad.contiguous(), channels, height, width, ctx.patch_size), None

    def unpatchify_setup(ctx, inputs, output):
        ctx.patch_size = inputs[4]

    def unpatchify_backward(ctx, grad):
        return ops.patchify(grad.contiguous(), ctx.patch_size), None, None, None, None

    torch.library.register_autograd("vit_kernels::patchify", patchify_backward, setup_context=patchify_setup)
    torch.library.register_autograd("vit_kernels::unpatchify", unpatchify_backward, setup_context=unpatchify_setup)


if _C is not None:
    _register()


# Where ``auto`` picks the extension, per (op, device type): the dtypes in which the benchmarks
# measured the extension's implementation faster than the reference, side by side in one run
# (evidence: benchmarks/results/cpu-*.md, summarised in csrc/README.md). On the CPU only patch_embed
# qualifies (patchify + GEMM: forward within 10% of the convolution, backward 3.5-3.7x faster); the
# C++ layer_norm and bias + GELU kernels measured slower than eager PyTorch, so auto leaves them
# out. Nothing on CUDA until measured there.
PREFERRED: dict[tuple[str, str], tuple[torch.dtype, ...]] = {("patch_embed", "cpu"): (torch.float32,)}


def preferred(op: str):
    """``auto`` preference for the extension's implementation of ``op`` (see PREFERRED)."""

    def check(device: torch.device, dtype: torch.dtype) -> bool:
        return dtype in PREFERRED.get((op, device.type), ())

    return check
