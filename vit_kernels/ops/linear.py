"""Linear layers with fused epilogues.

    linear:      Y = X @ W^T + b (+ R)
    linear_gelu: Y = gelu(X @ W^T + b)
        gelu(z)      = z * Phi(z)                                   ("none", exact erf)
        gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   ("tanh")
    mlp:         Y = linear(linear_gelu(X, W1, b1), W2, b2, R)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import _ext, backend
from vit_kernels._triton import HAS_TRITON, dot_precision, tl, triton

# Epilogues of the GEMM kernel.
EPILOGUE_NONE, EPILOGUE_GELU, EPILOGUE_GELU_GRAD = 0, 1, 2
ACTIVATIONS = ("none", "gelu", "gelu_tanh")  # the op-level names; "gelu" = exact erf GELU
SQRT_2_OVER_PI = 0.7978845608028654
INV_SQRT_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
GELU_TANH_C = 0.044715


@triton.jit
def _tanh(u):
    # tanh(u) = 1 - 2 / (exp(2u) + 1), with |u| clamped at 20 where tanh is +-1 in fp32 (no overflow)
    u = tl.minimum(tl.maximum(u, -20.0), 20.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _gelu(z, TANH: tl.constexpr):
    if TANH:
        return 0.5 * z * (1.0 + _tanh(SQRT_2_OVER_PI * (z + GELU_TANH_C * z * z * z)))
    return 0.5 * z * (1.0 + tl.math.erf(z * INV_SQRT_2))


@triton.jit
def _gelu_grad(z, TANH: tl.constexpr):
    # exact: Phi(z) + z phi(z);  tanh: 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 c z^2)
    if TANH:
        t = _tanh(SQRT_2_OVER_PI * (z + GELU_TANH_C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_C * z * z)
    return 0.5 * (1.0 + tl.math.erf(z * INV_SQRT_2)) + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column) of an M x N output, in groups of GROUP_M tile rows
    so that neighbouring programs share B tiles in L2."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    group_rows = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


# C = A @ B with a fused epilogue, one program per (BLOCK_M x BLOCK_N) tile (grouped_tile order):
#   acc = sum_k A[m, k] B[k, n]                 (fp32)
#   acc += bias[n]
#   GELU:      Z = acc (stored when SAVE_PREACT), acc = gelu(Z)
#   GELU_GRAD: acc = acc * gelu'(Aux[m, n])      (dZ = dH * gelu'(Z), the MLP backward)
#   acc += residual[m, n];  C = acc cast once
# A and B are read by strides, so W^T, dY^T and strided activations need no copies.
@triton.jit
def _linear_kernel(
    A, B, C, Bias, Aux, Residual,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_aux_m, stride_res_m,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, TANH: tl.constexpr, SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m[:, None].to(tl.int64)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        if SAVE_PREACT:
            tl.store(Aux + rows * stride_aux_m + offs_n[None, :], acc.to(Aux.dtype.element_ty), mask=mask)
        acc = _gelu(acc, TANH)
    if EPILOGUE == 2:
        z = tl.load(Aux + rows * stride_aux_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * _gelu_grad(z, TANH)
    if HAS_RESIDUAL:
        acc += tl.load(Residual + rows * stride_res_m + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(C + rows * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=mask)


# dZ = dY * gelu'(Z), elementwise over BLOCK elements (the linear_gelu backward, whose dY comes from
# outside and so cannot ride in a GEMM epilogue of ours).
@triton.jit
def _gelu_bwd_kernel(DY, Z, DZ, numel, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DZ + offs, (dy * _gelu_grad(z, TANH)).to(DZ.dtype.element_ty), mask=mask)


def gemm_config(m: int, n: int, k: int) -> dict:
    """Tile sizes: small fixed tiles under the interpreter; on a GPU 128x128 tiles for ViT-sized
    GEMMs (M = batch x tokens is large), narrower where N or M is small."""
    if backend.TRITON_INTERPRET:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
    block_m = 128 if m >= 128 else max(16, triton.next_power_of_2(m))
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64 if k >= 64 else 32, "GROUP_M": 8,
            "num_warps": warps, "num_stages": 3}


def _matmul(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *, bias: Optional[torch.Tensor] = None,
    epilogue: int = EPILOGUE_NONE, tanh: bool = False, aux: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias, epilogue, residual) -> (M, N) contiguous, both read by strides.
    ``aux`` (M, N): written with the pre-activation under EPILOGUE_GELU, read under EPILOGUE_GELU_GRAD."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    cfg = gemm_config(m, n, k)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    torch.library.wrap_triton(_linear_kernel)[grid](
        a, b, c, bias if bias is not None else c, aux if aux is not None else c, residual if residual is not None else c,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        aux.stride(0) if aux is not None else 0, residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None, EPILOGUE=epilogue, TANH=tanh, SAVE_PREACT=aux is not None,
        HAS_RESIDUAL=residual is not None, PRECISION=dot_precision(a.dtype), **cfg,
    )
    return c


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K) by a view where strides allow (the kernel takes any 2-D strides)."""
    return t.reshape(-1, t.shape[-1])


def _gelu_backward(grad: torch.Tensor, preact: torch.Tensor, tanh: bool) -> torch.Tensor:
    grad, preact = grad.contiguous(), preact.contiguous()
    dz = torch.empty_like(preact)
    block = 1024
    torch.library.wrap_triton(_gelu_bwd_kernel)[(triton.cdiv(preact.numel(), block),)](
        grad, preact, dz, preact.numel(), TANH=tanh, BLOCK=block
    )
    return dz


def _linear_grads(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, needs_bias: bool):
    """For Y = X W^T + b: dX = dY W, dW = dY^T X, db = sum_rows dY."""
    dx = _matmul(dy2, weight, x2.dtype)
    dw = _matmul(dy2.t(), x2, weight.dtype)
    db = dy2.sum(0, dtype=torch.float32).to(weight.dtype) if needs_bias else dy2.new_empty(0)
    return dx, dw, db


if HAS_TRITON:

    @torch.library.triton_op("vit_kernels::linear_fwd", mutates_args=())
    def linear_fwd(
        x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
        activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """act(x @ W^T + b) (+ residual) (..., N), and the pre-activation (..., N) for GELU (else empty)."""
        x2 = _rows(x)
        n = weight.shape[0]
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
        gelu = activation != "none"
        preact = torch.empty((x2.shape[0], n) if gelu else (0,), dtype=x.dtype, device=x.device)
        out = _matmul(
            x2, weight.t(), out_dtype, bias=bias, epilogue=EPILOGUE_GELU if gelu else EPILOGUE_NONE,
            tanh=activation == "gelu_tanh", aux=preact if gelu else None,
            residual=_rows(residual) if residual is not None else None,
        )
        shape = (*x.shape[:-1], n)
        return out.view(shape), preact.view(shape) if gelu else preact

    @torch.library.triton_op("vit_kernels::linear_bwd", mutates_args=())
    def linear_bwd(
        grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, activation: str,
        needs_bias: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> dx (..., K), dW (N, K), db (N,) (empty when there is no bias)."""
        dy2 = _rows(grad_out).to(x.dtype)
        if activation != "none":
            dy2 = _gelu_backward(dy2, _rows(preact), activation == "gelu_tanh")
        dx, dw, db = _linear_grads(dy2, _rows(x), weight, needs_bias)
        return dx.view(x.shape), dw, db

    def _linear_setup_context(ctx, inputs, output):
        x, weight, bias, residual, activation = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None

    def _linear_backward(ctx, grad_out, grad_preact):
        x, weight, preact = ctx.saved_tensors
        dx, dw, db = linear_bwd(grad_out, x, weight, preact, ctx.activation, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None, grad_out if ctx.has_residual else None, None

    torch.library.register_autograd("vit_kernels::linear_fwd", _linear_backward, setup_context=_linear_setup_context)

    @torch.library.triton_op("vit_kernels::mlp_fwd", mutates_args=())
    def mlp_fwd(
        x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor], fc2_weight: torch.Tensor,
        fc2_bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fc2(gelu(fc1(x))) (+ residual) (..., D_out), with the hidden H and pre-activation Z (M, Hd)."""
        x2 = _rows(x)
        tanh = activation == "gelu_tanh"
        preact = torch.empty((x2.shape[0], fc1_weight.shape[0]), dtype=x.dtype, device=x.device)
        hidden = _matmul(x2, fc1_weight.t(), x.dtype, bias=fc1_bias, epilogue=EPILOGUE_GELU, tanh=tanh, aux=preact)
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
        out = _matmul(hidden, fc2_weight.t(), out_dtype, bias=fc2_bias,
                      residual=_rows(residual) if residual is not None else None)
        return out.view(*x.shape[:-1], fc2_weight.shape[0]), hidden, preact

    @torch.library.triton_op("vit_kernels::mlp_bwd", mutates_args=())
    def mlp_bwd(
        grad_out: torch.Tensor, x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
        hidden: torch.Tensor, preact: torch.Tensor, activation: str, needs_bias1: bool, needs_bias2: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> dx, d(fc1_weight), d(fc1_bias), d(fc2_weight), d(fc2_bias) (biases' empty when absent). GELU' rides in the epilogue
        of the dH = dY W2 GEMM, which therefore yields dZ directly."""
        dy2 = _rows(grad_out).to(x.dtype)
        dw2 = _matmul(dy2.t(), hidden, fc2_weight.dtype)
        db2 = dy2.sum(0, dtype=torch.float32).to(fc2_weight.dtype) if needs_bias2 else dy2.new_empty(0)
        dz = _matmul(dy2, fc2_weight, x.dtype, epilogue=EPILOGUE_GELU_GRAD, tanh=activation == "gelu_tanh", aux=preact)
        dx, dw1, db1 = _linear_grads(dz, _rows(x), fc1_weight, needs_bias1)
        return dx.view(x.shape), dw1, db1, dw2, db2

    def _mlp_setup_context(ctx, inputs, output):
        x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation = inputs
        ctx.save_for_backward(x, fc1_weight, fc2_weight, output[1], output[2])
        ctx.activation = activation
        ctx.has = (fc1_bias is not None, fc2_bias is not None, residual is not None)

    def _mlp_backward(ctx, grad_out, grad_hidden, grad_preact):
        x, fc1_weight, fc2_weight, hidden, preact = ctx.saved_tensors
        has_b1, has_b2, has_residual = ctx.has
        dx, dw1, db1, dw2, db2 = mlp_bwd(grad_out, x, fc1_weight, fc2_weight, hidden, preact, ctx.activation, has_b1, has_b2)
        return (dx, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None,
                grad_out if has_residual else None, None)

    torch.library.register_autograd("vit_kernels::mlp_fwd", _mlp_backward, setup_context=_mlp_setup_context)


def _activation(approximate: str) -> str:
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def linear_triton(x, weight, bias=None, residual=None):
    """The Triton implementation of ``vk.linear`` (arguments already validated)."""
    return torch.ops.vit_kernels.linear_fwd(x, weight, bias, residual, "none")[0]


def linear_gelu_triton(x, weight, bias=None, approximate="none"):
    """The Triton implementation of ``vk.linear_gelu``."""
    return torch.ops.vit_kernels.linear_fwd(x, weight, bias, None, _activation(approximate))[0]


def mlp_triton(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """The Triton implementation of ``vk.mlp``."""
    return torch.ops.vit_kernels.mlp_fwd(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, _activation(approximate))[0]


def linear_extension(x, weight, bias=None, residual=None):
    """``vk.linear`` for the extension backend: one GEMM (cuBLAS / oneDNN) accumulating onto the
    residual (plus bias) instead of adding it in a separate pass."""
    if residual is None or residual.dtype != x.dtype:
        return linear_ref(x, weight, bias, residual)
    out_features = weight.shape[0]
    accumulator = residual.reshape(-1, out_features)
    if bias is not None:
        accumulator = accumulator + bias
    out = torch.addmm(accumulator, x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], out_features)


def linear_gelu_extension(x, weight, bias=None, approximate="none"):
    """``vk.linear_gelu`` for the extension backend: a GEMM without bias, then the fused
    ``vit_kernels::bias_gelu`` epilogue (one read and one write of the activation)."""
    preactivation = F.linear(x, weight)
    return torch.ops.vit_kernels.bias_gelu(
        preactivation.contiguous(), bias.contiguous() if bias is not None else None, approximate
    )


def mlp_extension(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """``vk.mlp`` for the extension backend: ``linear_gelu_extension`` then ``linear_extension``."""
    hidden = linear_gelu_extension(x, fc1_weight, fc1_bias, approximate)
    return linear_extension(hidden, fc2_weight, fc2_bias, residual)


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
    """x (..., K), weight (N, K), bias (N,) -> gelu(x @ W^T + b) (..., N)."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


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


backend.register("linear", "torch", linear_ref)
backend.register("linear_gelu", "torch", linear_gelu_ref)
backend.register("mlp", "torch", mlp_ref)
for _op, _fn in (("linear", linear_triton), ("linear_gelu", linear_gelu_triton), ("mlp", mlp_triton)):
    backend.register(_op, "triton", _fn, supports=backend.triton_supports_dot, preferred=backend.on_cuda)
for _op, _fn in (("linear", linear_extension), ("linear_gelu", linear_gelu_extension), ("mlp", mlp_extension)):
    backend.register(_op, "extension", _fn, supports=_ext.supports, preferred=_ext.preferred(_op))
