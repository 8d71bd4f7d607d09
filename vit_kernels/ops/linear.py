"""Linear layers with fused epilogues.

    linear:      Y = X @ W^T + b (+ R)
    linear_gelu: Y = gelu(X @ W^T + b)
        gelu(z)      = z * Phi(z)                                   ("none", exact erf)
        gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   ("tanh")
    mlp:         Y = linear(linear_gelu(X, W1, b1), W2, b2, R)
"""

from __future__ import annotations

import functools

import math
from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import _ext, backend
from vit_kernels._ext import ExtensionOps
from vit_kernels.activations import GELU_TANH, NONE, gelu_act
from vit_kernels._autograd import differentiable, direct
from vit_kernels._triton import HAS_TRITON, dot_precision, interpreted, launch, tl, triton

# Epilogues of the GEMM kernel.
EPILOGUE_NONE, EPILOGUE_GELU, EPILOGUE_GELU_GRAD = 0, 1, 2
# GELU constants, as constexprs: a @triton.jit function may not read plain Python globals (the
# interpreter allows it, the GPU compiler does not).
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GELU_TANH_C = tl.constexpr(0.044715)


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


# C = A @ B with a fused epilogue, one program per (BLOCK_M x BLOCK_N) tile (grouped_tile order)
# and per slice of K (split-K, grid axis 1):
#   acc = sum_{k in slice} A[m, k] B[k, n]      (fp32)
#   acc += bias[n]
#   GELU:      Z = acc (stored when SAVE_PREACT), acc = gelu(Z)
#   GELU_GRAD: acc = acc * gelu'(Aux[m, n])      (dZ = dH * gelu'(Z), the MLP backward)
#   acc += residual[m, n];  C[slice, m, n] = acc cast once
# With several K slices C is a float32 workspace (slices, M, N) that the host sums (only without
# epilogue). Every operand is read by strides, so W^T, dY^T, strided biases and broadcast residuals
# need no copies.
@triton.jit
def _linear_kernel(
    A, B, C, Bias, Aux, Residual,
    M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn, stride_c_split, stride_cm, stride_bias,
    stride_aux_m, stride_res_m, stride_res_n,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, TANH: tl.constexpr, SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    step_a = BLOCK_K * tl.cast(stride_ak, tl.int64)  # a unit stride arrives as a constexpr int
    step_b = BLOCK_K * tl.cast(stride_bk, tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start_k in range(k_start, k_end, BLOCK_K):
        mask_k = start_k - k_start + tl.arange(0, BLOCK_K) < k_end - k_start
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += step_a
        b_ptrs += step_b

    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m[:, None].to(tl.int64)
    cols = offs_n[None, :].to(tl.int64)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n.to(tl.int64) * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        if SAVE_PREACT:
            tl.store(Aux + rows * stride_aux_m + cols, acc.to(Aux.dtype.element_ty), mask=mask)
        acc = _gelu(acc, TANH)
    if EPILOGUE == 2:
        z = tl.load(Aux + rows * stride_aux_m + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc * _gelu_grad(z, TANH)
    if HAS_RESIDUAL:
        acc += tl.load(Residual + rows * stride_res_m + cols * stride_res_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + pid_k.to(tl.int64) * stride_c_split + rows * stride_cm + cols, acc.to(C.dtype.element_ty), mask=mask)


# dZ = dY * gelu'(Z), elementwise over BLOCK elements (the linear_gelu backward, whose dY comes from
# outside and so cannot ride in a GEMM epilogue of ours).
@triton.jit
def _gelu_bwd_kernel(DY, Z, DZ, numel, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DZ + offs, (dy * _gelu_grad(z, TANH)).to(DZ.dtype.element_ty), mask=mask)


# GEMM tile configurations the autotuner chooses from on a GPU. 16-bit inputs use tensor cores
# (mma / wgmma) with 128-wide tiles; float32 stays exact (ieee FMA, no tf32), where a 128 x 128
# fp32 accumulator per CTA would spill, so its tiles are 64 wide at most. Every entry is compiled
# for sm_80 and sm_90 by `make check-gpu`, which fails on spills.
GEMM_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
GEMM_TILES_16BIT = ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4))
GEMM_TILES_FP32 = ((64, 64, 32, 4, 3), (32, 64, 32, 4, 3), (64, 32, 32, 4, 3))
MAX_BLOCK_K = 64  # split-K slices are multiples of every BLOCK_K above


def gemm_configs(dtype: torch.dtype) -> list:
    """The autotuner's candidates for A/B of ``dtype``, as triton.Config."""
    tiles = GEMM_TILES_FP32 if dtype == torch.float32 else GEMM_TILES_16BIT
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in tiles
    ]


def gemm_config_pruner(a: str, m: str, n: str):
    """The autotuner's ``early_config_prune`` for a GEMM kernel whose left operand, row count and
    column count are the arguments named ``a``, ``m`` and ``n``: keep the configs of the operand's
    dtype (float32 configs are the ones with BLOCK_K = 32) whose tiles are not much larger than
    the problem."""

    def prune(configs, named_args, **kwargs):
        fp32 = named_args[a].dtype == torch.float32
        wanted = [c for c in configs if (c.kwargs["BLOCK_K"] == 32) == fp32]
        rows, cols = named_args[m], named_args[n]
        fitting = [c for c in wanted if c.kwargs["BLOCK_M"] <= max(64, rows) and c.kwargs["BLOCK_N"] <= max(64, cols)]
        return fitting or wanted[-1:]

    return prune


def autotuned_gemm(kernel, a: str, m: str, n: str, k: str):
    """``kernel`` autotuned over every gemm_configs entry, keyed on the problem size (the autotuner
    adds the operands' dtypes to the key)."""
    return triton.autotune(
        configs=gemm_configs(torch.float16) + gemm_configs(torch.float32), key=[m, n, k],
        prune_configs_by={"early_config_prune": gemm_config_pruner(a, m, n)},
    )(kernel)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The SM count of CUDA device ``index``, asked once (not on every launch)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k_slices(m: int, n: int, k: int, device: torch.device) -> int:
    """How many K slices a GEMM without epilogue is split into so that it fills the GPU: the
    weight-gradient GEMMs (M, N = layer widths, K = batch x tokens) have few output tiles and a
    very deep K. Slices are at least 1024 deep on a GPU (64 under the interpreter, which is how the
    tests exercise the split path on small shapes)."""
    if interpreted(device):
        machine, min_depth, tile = 4, 64, GEMM_INTERPRETER_CONFIG["BLOCK_M"]
    else:
        machine = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 132
        min_depth, tile = 1024, 128
    tiles = triton.cdiv(m, tile) * triton.cdiv(n, tile)
    slices = min(triton.cdiv(2 * machine, tiles), k // min_depth, 32)
    return max(1, slices)


def _matmul(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *, bias: Optional[torch.Tensor] = None,
    epilogue: int = EPILOGUE_NONE, tanh: bool = False, aux: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias, epilogue, residual) -> (M, N) contiguous, all read by strides.
    ``aux`` (M, N), contiguous: written with the pre-activation under EPILOGUE_GELU, read under
    EPILOGUE_GELU_GRAD. Without bias, epilogue or residual, a deep K is split into slices summed
    in float32."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:  # nothing to compute (an empty K still runs: its result is the epilogue of 0)
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    plain = bias is None and epilogue == EPILOGUE_NONE and residual is None
    slices = split_k_slices(m, n, k, a.device) if plain else 1
    k_per_split = triton.cdiv(triton.cdiv(k, slices), MAX_BLOCK_K) * MAX_BLOCK_K
    slices = triton.cdiv(k, k_per_split) if k > 0 else 1
    if slices > 1:
        c = torch.empty((slices, m, n), dtype=torch.float32, device=a.device)
    else:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    res_strides = (residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)
    args = (
        a, b, c, bias if bias is not None else c, aux if aux is not None else c, residual if residual is not None else c,
        m, n, k, k_per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), m * n if slices > 1 else 0, n,
        bias.stride(0) if bias is not None else 0, aux.stride(0) if aux is not None else 0, *res_strides,
    )
    flags = dict(HAS_BIAS=bias is not None, EPILOGUE=epilogue, TANH=tanh, SAVE_PREACT=aux is not None,
                 HAS_RESIDUAL=residual is not None, PRECISION=dot_precision(a.dtype))
    if interpreted(a.device):
        cfg = GEMM_INTERPRETER_CONFIG
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), slices)
        launch(_linear_kernel, grid, *args, **flags, **cfg)
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), slices)

        launch(_linear_kernel_tuned, grid, *args, **flags)
    return c.sum(0).to(out_dtype) if slices > 1 else c


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K) by a view where strides allow (the kernel takes any 2-D strides); M or K
    may be 0."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _gelu_backward(grad: torch.Tensor, preact: torch.Tensor, tanh: bool) -> torch.Tensor:
    grad, preact = grad.contiguous(), preact.contiguous()
    dz = torch.empty_like(preact)
    if dz.numel() == 0:
        return dz
    block = 1024
    launch(_gelu_bwd_kernel, (triton.cdiv(preact.numel(), block),), grad, preact, dz, preact.numel(), TANH=tanh, BLOCK=block)
    return dz


def _linear_grads(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, needs_bias: bool):
    """For Y = X W^T + b: dX = dY W, dW = dY^T X, db = sum_rows dY."""
    dx = _matmul(dy2, weight, x2.dtype)
    dw = _matmul(dy2.t(), x2, weight.dtype)
    db = dy2.sum(0, dtype=torch.float32).to(weight.dtype) if needs_bias else dy2.new_empty(0)
    return dx, dw, db


if HAS_TRITON:
    # On a GPU the GEMM autotunes over gemm_configs, keyed on the problem size (and, by the
    # autotuner, on the operands' dtypes); the interpreter runs GEMM_INTERPRETER_CONFIG.
    _linear_kernel_tuned = autotuned_gemm(_linear_kernel, "A", "M", "N", "K")

    def _linear_fwd(
        x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
        activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """act(x @ W^T + b) (+ residual) (..., N), and the pre-activation (..., N) for GELU (else empty)."""
        x2 = _rows(x)
        n = weight.shape[0]
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
        gelu = activation != NONE
        preact = torch.empty((x2.shape[0], n) if gelu else (0,), dtype=x.dtype, device=x.device)
        out = _matmul(
            x2, weight.t(), out_dtype, bias=bias, epilogue=EPILOGUE_GELU if gelu else EPILOGUE_NONE,
            tanh=activation == GELU_TANH, aux=preact if gelu else None,
            residual=_rows(residual) if residual is not None else None,
        )
        shape = (*x.shape[:-1], n)
        return out.view(shape), preact.view(shape) if gelu else preact

    torch.library.triton_op("vit_kernels::linear_fwd", mutates_args=())(_linear_fwd)

    def _linear_bwd(
        grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, activation: str,
        needs_bias: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> dx (..., K), dW (N, K), db (N,) (empty when there is no bias)."""
        dy2 = _rows(grad_out).to(x.dtype)
        if activation != NONE:
            dy2 = _gelu_backward(dy2, _rows(preact), activation == GELU_TANH)
        dx, dw, db = _linear_grads(dy2, _rows(x), weight, needs_bias)
        return dx.view(x.shape), dw, db

    linear_bwd = direct(torch.library.triton_op("vit_kernels::linear_bwd", mutates_args=())(_linear_bwd), _linear_bwd)

    def _linear_setup_context(ctx, inputs, output):
        x, weight, bias, residual, activation = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None

    def _linear_backward(ctx, grad_out, grad_preact):
        x, weight, preact = ctx.saved_tensors
        dx, dw, db = linear_bwd(grad_out, x, weight, preact, ctx.activation, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None, grad_out if ctx.has_residual else None, None

    linear_fwd = differentiable("vit_kernels::linear_fwd", _linear_backward, _linear_setup_context, _linear_fwd)

    def _mlp_fwd(
        x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor], fc2_weight: torch.Tensor,
        fc2_bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fc2(gelu(fc1(x))) (+ residual) (..., D_out), with the hidden H and pre-activation Z (M, Hd)."""
        x2 = _rows(x)
        tanh = activation == GELU_TANH
        preact = torch.empty((x2.shape[0], fc1_weight.shape[0]), dtype=x.dtype, device=x.device)
        hidden = _matmul(x2, fc1_weight.t(), x.dtype, bias=fc1_bias, epilogue=EPILOGUE_GELU, tanh=tanh, aux=preact)
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
        out = _matmul(hidden, fc2_weight.t(), out_dtype, bias=fc2_bias,
                      residual=_rows(residual) if residual is not None else None)
        return out.view(*x.shape[:-1], fc2_weight.shape[0]), hidden, preact

    torch.library.triton_op("vit_kernels::mlp_fwd", mutates_args=())(_mlp_fwd)

    def _mlp_bwd(
        grad_out: torch.Tensor, x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
        hidden: torch.Tensor, preact: torch.Tensor, activation: str, needs_bias1: bool, needs_bias2: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> dx, d(fc1_weight), d(fc1_bias), d(fc2_weight), d(fc2_bias) (biases' empty when absent). GELU' rides in the epilogue
        of the dH = dY W2 GEMM, which therefore yields dZ directly."""
        dy2 = _rows(grad_out).to(x.dtype)
        dw2 = _matmul(dy2.t(), hidden, fc2_weight.dtype)
        db2 = dy2.sum(0, dtype=torch.float32).to(fc2_weight.dtype) if needs_bias2 else dy2.new_empty(0)
        dz = _matmul(dy2, fc2_weight, x.dtype, epilogue=EPILOGUE_GELU_GRAD, tanh=activation == GELU_TANH, aux=preact)
        dx, dw1, db1 = _linear_grads(dz, _rows(x), fc1_weight, needs_bias1)
        return dx.view(x.shape), dw1, db1, dw2, db2

    mlp_bwd = direct(torch.library.triton_op("vit_kernels::mlp_bwd", mutates_args=())(_mlp_bwd), _mlp_bwd)

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

    mlp_fwd = differentiable("vit_kernels::mlp_fwd", _mlp_backward, _mlp_setup_context, _mlp_fwd)


def linear_triton(x, weight, bias=None, residual=None):
    """The Triton implementation of ``vk.linear`` (arguments already validated)."""
    return linear_fwd(x, weight, bias, residual, NONE)[0]


def linear_gelu_triton(x, weight, bias=None, approximate="none"):
    """The Triton implementation of ``vk.linear_gelu``."""
    return linear_fwd(x, weight, bias, None, gelu_act(approximate))[0]


def mlp_triton(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """The Triton implementation of ``vk.mlp``."""
    return mlp_fwd(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, gelu_act(approximate))[0]


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


# ---- the extension's glue: fake implementations of vit_kernels::bias_gelu ----------------


def _register_extension_ops():
    """Fake (meta) implementations of the C++/CUDA ops (schemas in csrc/ops.cpp; their autograd is
    C++, csrc/autograd.cpp), so that they trace under torch.compile."""

    # --- bias_gelu ----------------------------------------------------------------------------
    @torch.library.register_fake("vit_kernels::bias_gelu")
    def _(x, bias, approximate):
        return torch.empty_like(x)

    @torch.library.register_fake("vit_kernels::bias_gelu_backward")
    def _(grad_out, x, bias, approximate):
        return torch.empty_like(x)


if _ext.LOADED:
    _register_extension_ops()
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
