"""Linear layers with fused epilogues.

linear:      Y = X @ W^T + b (+ R)
linear_gelu: Y = gelu(X @ W^T + b)
    gelu(z)       = z * Phi(z)                                   ("none", exact erf)
    gelu_tanh(z)  = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   ("tanh")
    quick_gelu(z) = z * sigmoid(1.702 z)                         ("quick")
mlp:         Y = linear(linear_gelu(X, W1, b1), W2, b2, R)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import _ext, backend
from vit_kernels._autograd import differentiable, direct
from vit_kernels._ext import ExtensionOps
from vit_kernels._signature import needs_grad
from vit_kernels.activations import GELU_FORMS, NONE, gelu, gelu_act
from vit_kernels.ops.gemm import (
    EPILOGUE_GELU,
    EPILOGUE_GELU_GRAD,
    EPILOGUE_NONE,
    SUMS_NONE,
    SUMS_OF_C_COLUMNS,
    _gelu_backward,
    _input_and_weight_grads,
    _matmul,
    _matmul_and_sums,
    _rows,
    _weight_and_bias_grads,
)


def _linear_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """act(x @ W^T + b) (+ residual) (..., N), and GELU's pre-activation (..., N) that backward
    reads when ``save_preact`` (else empty: where no gradient will be asked for, not written)."""
    x2 = _rows(x)
    n = weight.shape[0]
    dtype = x.dtype
    out_dtype = torch.result_type(x, residual) if residual is not None else dtype
    has_gelu = activation != NONE
    save = has_gelu and save_preact
    preact = torch.empty((x2.shape[0], n) if save else (0,), dtype=dtype, device=x.device)
    out = _matmul(
        x2,
        weight.t(),
        out_dtype,
        bias=bias,
        epilogue=EPILOGUE_GELU if has_gelu else EPILOGUE_NONE,
        gelu_form=GELU_FORMS.get(activation, 0),
        aux=preact if save else None,
        residual=_rows(residual) if residual is not None else None,
    )
    shape = (*x.shape[:-1], n)
    return out.view(shape), preact.view(shape) if save else preact


def _linear_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    preact: torch.Tensor,
    activation: str,
    needs_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx (..., K), dW (N, K), db (N,) (empty when there is no bias)."""
    dy2 = _rows(grad_out).to(x.dtype)
    if activation != NONE:  # dZ and its column sums (the bias gradient) from one pass
        dy2, db = _gelu_backward(dy2, _rows(preact), GELU_FORMS[activation], needs_bias)
        dx, dw, _ = _input_and_weight_grads(dy2, _rows(x), weight, False)
    else:  # the bias gradient from the dW GEMM
        dx, dw, db = _input_and_weight_grads(dy2, _rows(x), weight, needs_bias)
    return dx.view(x.shape), dw, db.to(weight.dtype) if needs_bias else dy2.new_empty(0)


linear_bwd = direct(_linear_bwd)


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, residual, activation, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None


def _linear_backward(ctx, grad_out, grad_preact):
    if grad_out is None:
        return (None,) * 6
    x, weight, preact = ctx.saved_tensors
    dx, dw, db = linear_bwd(grad_out, x, weight, preact, ctx.activation, ctx.has_bias)
    return dx, dw, db if ctx.has_bias else None, grad_out if ctx.has_residual else None, None, None


linear_fwd = differentiable(_linear_fwd, _linear_backward, _linear_setup_context)


def _mlp_fwd(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    fc2_bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: str,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc2(gelu(fc1(x))) (+ residual) (..., D_out), with the hidden H (M, Hd) and, when
    ``save_preact``, the pre-activation Z (M, Hd) (else empty): fc1 with its bias + GELU epilogue,
    then fc2 (+ residual) with its bias."""
    x2 = _rows(x)
    m, n = x2.shape[0], fc1_weight.shape[0]
    dtype = x.dtype
    preact = torch.empty((m, n) if save_preact else (0,), dtype=dtype, device=x.device)
    hidden = _matmul(
        x2,
        fc1_weight.t(),
        dtype,
        bias=fc1_bias,
        epilogue=EPILOGUE_GELU,
        gelu_form=GELU_FORMS[activation],
        aux=preact if save_preact else None,
    )
    out = _matmul(
        hidden,
        fc2_weight.t(),
        torch.result_type(x, residual) if residual is not None else dtype,
        bias=fc2_bias,
        residual=_rows(residual) if residual is not None else None,
    )
    return out.view(*x.shape[:-1], fc2_weight.shape[0]), hidden, preact


def _mlp_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    hidden: torch.Tensor,
    preact: torch.Tensor,
    activation: str,
    needs_bias1: bool,
    needs_bias2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx, d(fc1_weight), d(fc1_bias), d(fc2_weight), d(fc2_bias) (biases' empty when absent).
    GELU' rides in the epilogue of the dH = dY W2 GEMM, which therefore yields dZ directly, and
    with it dZ's column sums (fc1's bias gradient) when asked; fc2's bias gradient comes from its
    dW GEMM or a sum of dY (``_weight_and_bias_grads``)."""
    dy2 = _rows(grad_out).to(x.dtype)
    dw2, db2 = _weight_and_bias_grads(dy2, hidden, fc2_weight.dtype, needs_bias2)
    dz, db1 = _matmul_and_sums(
        dy2,
        fc2_weight,
        x.dtype,
        epilogue=EPILOGUE_GELU_GRAD,
        gelu_form=GELU_FORMS[activation],
        aux=preact,
        sums=SUMS_OF_C_COLUMNS if needs_bias1 else SUMS_NONE,
    )
    dx, dw1, _ = _input_and_weight_grads(dz, _rows(x), fc1_weight, False)
    empty = dy2.new_empty(0)
    return (
        dx.view(x.shape),
        dw1,
        db1.to(fc1_weight.dtype) if needs_bias1 else empty,
        dw2,
        db2.to(fc2_weight.dtype) if needs_bias2 else empty,
    )


mlp_bwd = direct(_mlp_bwd)


def _mlp_setup_context(ctx, inputs, output):
    x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation, _ = inputs
    ctx.save_for_backward(x, fc1_weight, fc2_weight, output[1], output[2])
    ctx.activation = activation
    ctx.has = (fc1_bias is not None, fc2_bias is not None, residual is not None)


def _mlp_backward(ctx, grad_out, grad_hidden, grad_preact):
    if grad_out is None:
        return (None,) * 8
    x, fc1_weight, fc2_weight, hidden, preact = ctx.saved_tensors
    has_b1, has_b2, has_residual = ctx.has
    dx, dw1, db1, dw2, db2 = mlp_bwd(
        grad_out, x, fc1_weight, fc2_weight, hidden, preact, ctx.activation, has_b1, has_b2
    )
    residual_grad = grad_out if has_residual else None
    return dx, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None, residual_grad, None, None


mlp_fwd = differentiable(_mlp_fwd, _mlp_backward, _mlp_setup_context)


def linear_triton(x, weight, bias=None, residual=None):
    """The Triton implementation of ``vk.linear`` (arguments already validated)."""
    return linear_fwd(x, weight, bias, residual, NONE, False)[0]


def linear_gelu_triton(x, weight, bias=None, approximate="none"):
    """The Triton implementation of ``vk.linear_gelu`` (inference skips writing the pre-activation)."""
    return linear_fwd(x, weight, bias, None, gelu_act(approximate), needs_grad((x, weight, bias)))[0]


def mlp_triton(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """The Triton implementation of ``vk.mlp`` (inference skips writing the pre-activation)."""
    args = (x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, gelu_act(approximate))
    return mlp_fwd(*args, needs_grad(args))[0]


def linear_extension(x, weight, bias=None, residual=None):
    """``vk.linear`` for the extension backend: one GEMM (cuBLAS / oneDNN) accumulating onto the
    residual (plus bias) instead of adding it in a separate pass (``vit_kernels::linear_residual``).
    Takes only calls with a residual of x's dtype (``_extension_linear_limits``): without one it
    would just be ``F.linear``."""
    return _ops.linear_residual(x, weight, bias, residual)


def linear_gelu_extension(x, weight, bias=None, approximate="none"):
    """``vk.linear_gelu`` for the extension backend: a GEMM without bias, then the fused
    ``vit_kernels::bias_gelu`` epilogue (one read and one write of the activation), in one C++ call
    (``vit_kernels::linear_gelu``)."""
    return _ops.linear_gelu(x, weight, bias, approximate)


def mlp_extension(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """``vk.mlp`` for the extension backend (``vit_kernels::mlp``): ``linear_gelu_extension``, then fc2
    as one GEMM that accumulates onto the residual when there is one of the hidden dtype, else a
    plain GEMM (+ the residual): the fused part of this composition is the bias + GELU epilogue."""
    return _ops.mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate, residual)


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,), residual (..., N) -> (..., N)."""
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def linear_gelu_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    approximate: str = "none",
) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> gelu(x @ W^T + b) (..., N), the GELU of ``approximate``."""
    return gelu(F.linear(x, weight, bias), approximate)


def mlp_ref(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    fc2_bias: Optional[torch.Tensor],
    approximate: str = "none",
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (..., D), fc1_weight (Hd, D), fc2_weight (D_out, Hd) -> (..., D_out)."""
    hidden = linear_gelu_ref(x, fc1_weight, fc1_bias, approximate)
    return linear_ref(hidden, fc2_weight, fc2_bias, residual)


if _ext.LOADED:
    _ops = ExtensionOps("linear_residual", "linear_gelu", "mlp")


def _extension_linear_limits(x, weight, bias=None, residual=None) -> Optional[str]:
    """The extension's linear is a GEMM accumulating onto a residual of x's dtype."""
    if residual is None:
        return "no residual to fuse (without one the extension's linear would be F.linear)"
    if residual.dtype != x.dtype:
        return f"the residual's dtype {residual.dtype} differs from x's {x.dtype} (autocast)"
    return None


# The implementations of vk.linear, vk.linear_gelu and vk.mlp: backend -> function, support by
# device / dtype, shape limits.
backend.implementations(
    "linear",
    torch=backend.Impl(linear_ref),
    triton=backend.Impl(linear_triton, supports=backend.triton_supports_dot),
    extension=backend.Impl(linear_extension, supports=_ext.supports, limits=_extension_linear_limits),
)
backend.implementations(
    "linear_gelu",
    torch=backend.Impl(linear_gelu_ref),
    triton=backend.Impl(linear_gelu_triton, supports=backend.triton_supports_dot),
    extension=backend.Impl(linear_gelu_extension, supports=_ext.supports),
)
backend.implementations(
    "mlp",
    torch=backend.Impl(mlp_ref),
    triton=backend.Impl(mlp_triton, supports=backend.triton_supports_dot),
    extension=backend.Impl(mlp_extension, supports=_ext.supports),
)
