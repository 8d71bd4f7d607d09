"""Linear layers with fused epilogues.

linear:      Y = X @ W^T + b (+ R)
linear_gelu: Y = gelu(X @ W^T + b)
    gelu(z)       = z * Phi(z)                                   ("none", exact erf)
    gelu_tanh(z)  = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   ("tanh")
    quick_gelu(z) = z * sigmoid(1.702 z)                         ("quick")
mlp:         Y = linear(linear_gelu(X, W1, b1), W2, b2, R)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from vit_kernels import _ext, backend
from vit_kernels._ext import ExtensionOps
from vit_kernels.activations import GELU_APPROXIMATIONS, GELU_FORMS, NONE, gelu, gelu_act, gelu_backward
from vit_kernels._autograd import differentiable, direct, tracing
from vit_kernels._signature import bucket
from vit_kernels._tiles import (
    FLOORS,
    TileChooser,
    reference_dtype,
    report_rows,
    tile_to_launch,
    first_problem,
)
from vit_kernels._triton import (
    HAS_TRITON,
    TensorDescriptor,
    cdiv,
    dot_precision,
    interpreted,
    launch,
    multiprocessors,
    tl,
    triton,
)

# Epilogues of the GEMM kernel.
EPILOGUE_NONE, EPILOGUE_GELU, EPILOGUE_GELU_GRAD = 0, 1, 2
# Sums the GEMM kernel can reduce on the way (a bias gradient without a second read of its input).
SUMS_NONE, SUMS_OF_C_COLUMNS, SUMS_OF_A_ROWS = 0, 1, 2
# GELU constants, as constexprs: a @triton.jit function may not read plain Python globals (the
# interpreter allows it, the GPU compiler does not).
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GELU_TANH_C = tl.constexpr(0.044715)
QUICK_GELU_SLOPE = tl.constexpr(1.702)


@triton.jit
def _tanh_terms(u):
    """(1 + tanh u, 1 - tanh^2 u), both without cancellation where tanh u nears -1 or 1: with
    e = exp(-2|u|) in [0, 1], 1 + tanh u = 2 / (1 + e) for u >= 0 and 2e / (1 + e) below, and
    1 - tanh^2 u = 4e / (1 + e)^2 (where |t| nears 1, 1 + t or 1 - t*t keep only the bits in which t
    differs from -1 or 1)."""
    e = tl.exp(-2.0 * tl.abs(u))
    inv = 1.0 / (1.0 + e)
    return tl.where(u >= 0, 2.0 * inv, 2.0 * e * inv), 4.0 * e * inv * inv


# The GELU of form GELU_FORM (vit_kernels.activations.GELU_FORMS) and its derivative:
#   0 exact:  gelu(z) = z Phi(z);                     gelu'(z) = Phi(z) + z phi(z)
#   1 tanh:   gelu(z) = 0.5 z (1 + t), t = tanh(sqrt(2/pi) (z + c z^3));
#             gelu'(z) = 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 c z^2)
#   2 quick:  gelu(z) = z s, s = sigmoid(1.702 z);   gelu'(z) = s + 1.702 z s (1 - s),
#             1 - s = sigmoid(-1.702 z) computed as such, not by cancellation
# (tanh's argument is written tensor * constexpr: the interpreter makes constexpr * tensor a constexpr)
@triton.jit
def _gelu(z, GELU_FORM: tl.constexpr):
    if GELU_FORM == 1:
        one_plus_t, _ = _tanh_terms((z + GELU_TANH_C * z * z * z) * SQRT_2_OVER_PI)
        return 0.5 * z * one_plus_t
    if GELU_FORM == 2:
        return z / (1.0 + tl.exp(z * -QUICK_GELU_SLOPE))
    return 0.5 * z * (1.0 + tl.math.erf(z * INV_SQRT_2))


@triton.jit
def _gelu_grad(z, GELU_FORM: tl.constexpr):
    if GELU_FORM == 1:
        one_plus_t, sech2 = _tanh_terms((z + GELU_TANH_C * z * z * z) * SQRT_2_OVER_PI)
        return 0.5 * one_plus_t + 0.5 * z * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_C * z * z)
    if GELU_FORM == 2:
        s = 1.0 / (1.0 + tl.exp(z * -QUICK_GELU_SLOPE))
        return s + z * QUICK_GELU_SLOPE * s / (1.0 + tl.exp(z * QUICK_GELU_SLOPE))
    return 0.5 * (1.0 + tl.math.erf(z * INV_SQRT_2)) + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile row, tile column) of an M x N output, in groups of GROUP_M tile rows
    so that neighbouring programs share B tiles in L2."""
    return grouped_tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def grouped_tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile number ``pid``'s (tile row, tile column) in the grouped order of ``grouped_tile``."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    group_rows = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


# acc + a @ b for the K loops of the GEMMs. Float32 inputs (PRECISION "ieee", exact products on FMA
# units): each BLOCK_K block is summed from zero and then added to acc, so an output's rounding errors
# grow like sqrt(BLOCK_K) + sqrt(K / BLOCK_K) rather than sqrt(K). One FMA chain through a 1,023-long
# reduction erred 12x cuBLAS's float32 on an H100; blocks of 32 err about 2x (the same data, emulated).
# ``zero`` must not be a compile-time constant: Triton folds acc + dot(a, b, 0) back into
# dot(a, b, acc). 16-bit inputs accumulate in place, as the tensor cores do.
@triton.jit
def block_zero(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) float32 zero the compiler cannot fold: +0 times a program id."""
    return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + tl.program_id(0).to(tl.float32) * 0.0


@triton.jit
def accumulate_dot(acc, a, b, zero, PRECISION: tl.constexpr):
    """acc + a @ b, float32; a (BLOCK_M, BLOCK_K), b (BLOCK_K, BLOCK_N), acc and zero (BLOCK_M, BLOCK_N)."""
    if PRECISION == "ieee":
        return acc + tl.dot(a, b, zero, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# C = A @ B with a fused epilogue, one program per (BLOCK_M x BLOCK_N) tile (grouped_tile order)
# and per slice of K (split-K, grid axis 1):
#   acc = sum_{k in slice} A[m, k] B[k, n]      (fp32)
#   acc += bias[n]
#   GELU:      Z = acc (stored when SAVE_PREACT), acc = gelu(Z)
#   GELU_GRAD: acc = acc * gelu'(Aux[m, n])      (dZ = dH * gelu'(Z), the MLP backward)
#   acc += residual[m, n];  C[slice, m, n] = acc cast once
#   SUMS_OF_C_COLUMNS: Sums[tile row, n] = sum_{m in tile} acc[m, n]   (float32, before the cast:
#       the bias gradient of the dZ this GEMM writes, summed over the tile rows by the host)
#   SUMS_OF_A_ROWS: Sums[slice, m] = sum_{k in slice} A[m, k], by the programs of the first tile
#       column (float32: the bias gradient sum_rows dY of the weight-gradient GEMM dW = dY^T X, whose
#       A = dY^T it reads anyway; summed over the K slices by the host)
# With several K slices C is a float32 workspace (slices, M, N) that the host sums (only without
# epilogue). Every operand is read by strides, so W^T, dY^T, strided biases and broadcast residuals
# need no copies.
@triton.jit
def _linear_kernel(
    A,
    B,
    C,
    Bias,
    Aux,
    Residual,
    Sums,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_c_split,
    stride_cm,
    stride_bias,
    stride_aux_m,
    stride_res_m,
    stride_res_n,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    GELU_FORM: tl.constexpr,
    SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SUMS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
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
    zero = block_zero(BLOCK_M, BLOCK_N)
    a_sums = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_k in range(k_start, k_end, BLOCK_K):
        mask_k = start_k - k_start + tl.arange(0, BLOCK_K) < k_end - k_start
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if SUMS == 2:
            if pid_n == 0:
                a_sums += tl.sum(a.to(tl.float32), 1)
        acc = accumulate_dot(acc, a, b, zero, PRECISION)
        a_ptrs += step_a
        b_ptrs += step_b
    if SUMS == 2:
        if pid_n == 0:
            tl.store(Sums + pid_k.to(tl.int64) * M + offs_m, a_sums, mask=mask_m)
    _gemm_epilogue(
        acc,
        offs_m,
        offs_n,
        pid_m,
        pid_k,
        M,
        N,
        C,
        Bias,
        Aux,
        Residual,
        Sums,
        stride_c_split,
        stride_cm,
        stride_bias,
        stride_aux_m,
        stride_res_m,
        stride_res_n,
        HAS_BIAS,
        EPILOGUE,
        GELU_FORM,
        SAVE_PREACT,
        HAS_RESIDUAL,
        SUMS,
    )


@triton.jit
def _gemm_epilogue(
    acc,
    offs_m,
    offs_n,
    pid_m,
    pid_k,
    M,
    N,
    C,
    Bias,
    Aux,
    Residual,
    Sums,
    stride_c_split,
    stride_cm,
    stride_bias,
    stride_aux_m,
    stride_res_m,
    stride_res_n,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    GELU_FORM: tl.constexpr,
    SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SUMS: tl.constexpr,
):
    """The GEMM kernels' epilogue on one (BLOCK_M x BLOCK_N) fp32 tile ``acc`` of C (see
    ``_linear_kernel``): bias, GELU or GELU', residual, the column sums, the one store of C."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m[:, None].to(tl.int64)
    cols = offs_n[None, :].to(tl.int64)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n.to(tl.int64) * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[
            None, :
        ]
    if EPILOGUE == 1:
        if SAVE_PREACT:
            tl.store(Aux + rows * stride_aux_m + cols, acc.to(Aux.dtype.element_ty), mask=mask)
        acc = _gelu(acc, GELU_FORM)
    if EPILOGUE == 2:
        z = tl.load(Aux + rows * stride_aux_m + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc * _gelu_grad(z, GELU_FORM)
    if HAS_RESIDUAL:
        acc += tl.load(Residual + rows * stride_res_m + cols * stride_res_n, mask=mask, other=0.0).to(
            tl.float32
        )
    if SUMS == 1:
        tl.store(Sums + pid_m.to(tl.int64) * N + offs_n, tl.sum(tl.where(mask, acc, 0.0), 0), mask=mask_n)
    tl.store(
        C + pid_k.to(tl.int64) * stride_c_split + rows * stride_cm + cols,
        acc.to(C.dtype.element_ty),
        mask=mask,
    )


# The same GEMM and epilogue for Hopper (sm_90+) and 16-bit operands: persistent (one program per
# multiprocessor walks the (K slice, tile) work items, tiles in grouped_tile order) and A, B tiles
# loaded by the Tensor Memory Accelerator from tensor descriptors (TMA: one asynchronous bulk copy
# per tile into shared memory, zero-filled past M, N and K, so the K loop has no masks and no
# address arithmetic). A descriptor is over the operand's row-major view: A (M, K) itself, or the
# (K, M) matrix whose transpose A is (A_T: dY^T of a weight gradient); B (K, N), or the (N, K)
# matrix whose transpose B is (B_T: W^T of a forward). K slices start at multiples of BLOCK_K.
@triton.jit
def _linear_tma_kernel(
    A_desc,
    B_desc,
    C,
    Bias,
    Aux,
    Residual,
    Sums,
    M,
    N,
    K,
    k_per_split,
    slices,
    stride_c_split,
    stride_cm,
    stride_bias,
    stride_aux_m,
    stride_res_m,
    stride_res_n,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    GELU_FORM: tl.constexpr,
    SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SUMS: tl.constexpr,
    PRECISION: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    zero = block_zero(BLOCK_M, BLOCK_N)
    for item in range(tl.program_id(0), tiles * slices, tl.num_programs(0)):
        pid_k = item // tiles
        pid_m, pid_n = grouped_tile_of(item % tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        first_m = pid_m * BLOCK_M
        first_n = pid_n * BLOCK_N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        a_sums = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start_k in range(k_start, k_end, BLOCK_K):
            if A_T:
                a = A_desc.load([start_k, first_m]).T
            else:
                a = A_desc.load([first_m, start_k])
            if B_T:
                b = B_desc.load([first_n, start_k]).T
            else:
                b = B_desc.load([start_k, first_n])
            if SUMS == 2:
                if pid_n == 0:
                    a_sums += tl.sum(a.to(tl.float32), 1)
            acc = accumulate_dot(acc, a, b, zero, PRECISION)
        offs_m = first_m + tl.arange(0, BLOCK_M)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        if SUMS == 2:
            if pid_n == 0:
                tl.store(Sums + pid_k.to(tl.int64) * M + offs_m, a_sums, mask=offs_m < M)
        _gemm_epilogue(
            acc,
            offs_m,
            offs_n,
            pid_m,
            pid_k,
            M,
            N,
            C,
            Bias,
            Aux,
            Residual,
            Sums,
            stride_c_split,
            stride_cm,
            stride_bias,
            stride_aux_m,
            stride_res_m,
            stride_res_n,
            HAS_BIAS,
            EPILOGUE,
            GELU_FORM,
            SAVE_PREACT,
            HAS_RESIDUAL,
            SUMS,
        )


_linear_tma_kernel.min_capability = 90  # offered on sm_90+ only (tma_possible): the compile gate skips sm_80


# The linear_gelu backward's epilogue pass (its dY comes from outside, so it cannot ride in a GEMM
# epilogue of ours), over a BLOCK_N-column strip (grid axis 0) of one slice of rows (axis 1):
#   dZ = dY * gelu'(Z)                                  (M, N), in Z's dtype
#   BIAS_GRAD: Partial[slice, n] = sum_{m in slice} dZ[m, n]   (float32 before dZ's rounding; the
#              host sums the slices): the bias gradient without a second read of dZ
@triton.jit
def _gelu_bwd_kernel(
    DY,
    Z,
    DZ,
    Partial,
    rows,
    cols,
    rows_per_slice,
    GELU_FORM: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < cols
    row_begin = tl.program_id(1) * rows_per_slice
    row_end = tl.minimum(row_begin + rows_per_slice, rows)
    sums = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(row_begin, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < row_end)[:, None] & mask_n[None, :]
        offs = offs_m.to(tl.int64)[:, None] * cols + offs_n[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
        dz = dy * _gelu_grad(z, GELU_FORM)
        tl.store(DZ + offs, dz.to(DZ.dtype.element_ty), mask=mask)
        if BIAS_GRAD:
            sums += tl.sum(dz, 0)  # masked elements are 0 * gelu'(0) = 0
    if BIAS_GRAD:
        tl.store(Partial + tl.program_id(1).to(tl.int64) * cols + offs_n, sums, mask=mask_n)


# GEMM launch configurations on a GPU, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): candidates that
# the user's GPU validates and times per key (``vit_kernels._tiles``: dtype, epilogue, size bucket,
# operand layout), the first one being the default where nothing may be run (tracing, graph capture),
# for 16 bits 128 x 128 x 64, the one tile a GPU has timed. 16-bit inputs use tensor cores (mma on
# sm_80, wgmma on sm_90). The 128 x 256, 256 x 128 and
# 128 x 128 x 128 tiles are the Hopper ones (8 warps as two warpgroups, 3 stages: 144-192 KB of
# shared memory on sm_90, within its 227 KB, and 96-128 KB on sm_80, whose pipeline keeps one stage
# fewer); the 64-wide ones serve small problems and sm_80. float32 stays exact (ieee FMA, no tf32),
# where a 128 x 128 fp32 accumulator per CTA would spill, so its tiles are 64 wide at most. Every
# entry is compiled for sm_80 and sm_90 by `make check-gpu`, which fails on spills and on shared
# memory over the limit, and run against float64 by the GPU tests (tests/test_tiles.py).
TMA = "tma"


class GemmTile(NamedTuple):
    """One launch configuration of a GEMM kernel: its blocks, warps and pipeline stages, and which
    kernel runs it (``"pointer"``, or ``TMA`` for the persistent TMA kernel). Shown as the plain
    tuple, without the kernel where it is the pointer one."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    kernel: str = "pointer"

    def __repr__(self) -> str:
        return repr(tuple(self) if self.kernel != "pointer" else tuple(self)[:5])


GEMM_TILES_16BIT = tuple(
    GemmTile(*tile)
    for tile in (
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
    )
)
GEMM_TILES_FP32 = tuple(
    GemmTile(*tile) for tile in ((64, 64, 32, 4, 3), (32, 64, 32, 4, 3), (64, 32, 32, 4, 3))
)
# The persistent TMA kernel's tiles (``_linear_tma_kernel``), offered beside the table above on
# sm_90+ for 16-bit operands that TMA can read (one unit stride, the other 16-byte aligned, 16-byte
# aligned data): the shapes of Triton's persistent Hopper matmul (128 x 256 and 128 x 128 with 8
# warps as two warpgroups, 3-4 stages of 32-48 KB). Never the default: the user's GPU validates and
# times them against the pointer kernel's tiles.
GEMM_TILES_TMA = tuple(
    GemmTile(*tile, TMA)
    for tile in (
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 128, 8, 3),
    )
)
GEMM_INTERPRETER_TILE = GemmTile(32, 32, 32, 1, 1)  # fixed and small: the interpreter's cost is per tile op
GEMM_GROUP_M = 8  # tile rows per group of the grouped launch order (B tiles shared in L2)
MAX_BLOCK_K = max(
    tile.block_k for tile in GEMM_TILES_16BIT + GEMM_TILES_FP32
)  # split-K slices are multiples of it
VALIDATION_ROWS = 4096  # output rows a candidate is checked on (the first and last halves of them)
GEMM_CHOOSER = TileChooser("GEMM")


def gemm_config(tile: GemmTile) -> dict:
    """A tile as the GEMM kernels' launch keywords."""
    return {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "GROUP_M": GEMM_GROUP_M,
        "num_warps": tile.warps,
        "num_stages": tile.stages,
    }


GEMM_INTERPRETER_CONFIG = gemm_config(GEMM_INTERPRETER_TILE)


def gemm_candidates(dtype: torch.dtype, m: int, n: int, tma: bool = False) -> tuple:
    """The tiles a GPU tries for an (m x n) output with operands of ``dtype``: the dtype's table
    (with the TMA kernel's where ``tma``), without tiles much larger than the problem (at most
    max(64, m) rows and max(64, n) columns; the table's smallest tile where none is left)."""
    tiles = GEMM_TILES_FP32 if dtype == torch.float32 else GEMM_TILES_16BIT
    tiles += GEMM_TILES_TMA if tma else ()
    fitting = tuple(t for t in tiles if t.block_m <= max(64, m) and t.block_n <= max(64, n))
    return fitting or tiles[-1:]


def tma_transposed(t: torch.Tensor) -> Optional[bool]:
    """How the TMA kernel reads a 2-D 16-bit operand: False by a descriptor over ``t`` (unit column
    stride), True by one over ``t.t()`` (unit row stride), None where a descriptor cannot (no unit
    stride, the other stride or the data not 16-byte aligned, a dimension of size 0)."""
    if t.dtype not in (torch.float16, torch.bfloat16) or t.numel() == 0 or t.data_ptr() % 16:
        return None
    rows, cols = t.stride()
    aligned = 16 // t.element_size()
    if cols == 1 and rows % aligned == 0:
        return False
    if rows == 1 and cols % aligned == 0:
        return True
    return None


def tma_possible(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the TMA kernel can run a @ b: on Hopper or newer (the interpreter counts as such),
    both operands readable by descriptors, not while tracing (torch.compile). Where it cannot, a
    TMA tile runs the pointer kernel with its dimensions."""
    if TensorDescriptor is None or tracing() or tma_transposed(a) is None or tma_transposed(b) is None:
        return False
    if interpreted(a.device):  # the tests run it under the interpreter where they pin its tiles
        return True
    return a.device.type == "cuda" and _hopper_or_newer(a.device)


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device: torch.device) -> bool:
    """Whether a CUDA device has TMA (compute capability 9.0+); asked once per device."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tile_report() -> list[dict]:
    """Every GEMM tile choice made in this process: key (device, operand and output dtypes, HAS_BIAS,
    EPILOGUE, GELU_FORM, SAVE_PREACT, HAS_RESIDUAL, M bucket, N, K bucket, K slices, unit strides of A's
    and B's two dimensions), the tile chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("gemm", GEMM_CHOOSER)


def validation_rows(m: int, device: torch.device) -> Optional[torch.Tensor]:
    """The rows of an m-row output a candidate is checked on: all (None) up to VALIDATION_ROWS, else
    the first and the last VALIDATION_ROWS / 2 (the first tiles and the masked last ones)."""
    if m <= VALIDATION_ROWS:
        return None
    half = VALIDATION_ROWS // 2
    return torch.cat([torch.arange(half, device=device), torch.arange(m - half, m, device=device)])


def split_k_slices(m: int, n: int, k: int, device: torch.device) -> int:
    """How many K slices a GEMM without epilogue is split into so that it fills the GPU: the
    weight-gradient GEMMs (M, N = layer widths, K = batch x tokens) have few output tiles and a
    very deep K. Slices are at least 1024 deep on a GPU (64 under the interpreter, which is how the
    tests exercise the split path on small shapes)."""
    if interpreted(device):
        machine, min_depth, tile = 4, 64, GEMM_INTERPRETER_CONFIG["BLOCK_M"]
    else:
        machine = multiprocessors(device)
        min_depth, tile = 1024, 128
    tiles = cdiv(m, tile) * cdiv(n, tile)
    slices = min(cdiv(2 * machine, tiles), k // min_depth, 32)
    return max(1, slices)


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, **epilogue) -> torch.Tensor:
    """C of ``_matmul_and_sums`` (no sums)."""
    return _matmul_and_sums(a, b, out_dtype, **epilogue)[0]


def _matmul_and_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Optional[torch.Tensor] = None,
    epilogue: int = EPILOGUE_NONE,
    gelu_form: int = 0,
    aux: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    sums: int = SUMS_NONE,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """a (M, K) @ b (K, N) (+ bias, epilogue, residual) -> (C (M, N) contiguous, all read by strides;
    the sums in float32, or None for SUMS_NONE): SUMS_OF_C_COLUMNS, sum_rows C (N,) before C's
    rounding; SUMS_OF_A_ROWS, sum_k A (M,).
    ``aux`` (M, N), contiguous: written with the pre-activation under EPILOGUE_GELU, read under
    EPILOGUE_GELU_GRAD. Without bias, epilogue, residual or sums of C, a deep K is split into
    slices summed in float32. The tile is the one ``_matmul_tile`` gives (chosen on the GPU per key)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:  # nothing to compute (an empty K still runs: its result is the epilogue of 0)
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        if sums == SUMS_NONE:
            return c, None
        if sums == SUMS_OF_A_ROWS:  # A's rows still have their sums where B has no columns
            return c, a.sum(1, dtype=torch.float32)
        return c, torch.zeros(n, dtype=torch.float32, device=a.device)
    plain = bias is None and epilogue == EPILOGUE_NONE and residual is None and sums != SUMS_OF_C_COLUMNS
    slices = split_k_slices(m, n, k, a.device) if plain else 1
    k_per_split = cdiv(cdiv(k, slices), MAX_BLOCK_K) * MAX_BLOCK_K
    slices = cdiv(k, k_per_split) if k > 0 else 1
    gemm = _Gemm(a, b, out_dtype, bias, epilogue, gelu_form, aux, residual, sums, slices, k_per_split)
    c = gemm.output()
    partial = gemm.launch(_matmul_tile(gemm), c, aux)
    return gemm.result(c), None if partial is None else partial.sum(0)


class _Gemm:
    """One call of the GEMM kernel: its operands and split, launched with a given tile into given
    outputs (the call's own, or a candidate's fresh ones while tiles are tried)."""

    __slots__ = (
        "a",
        "b",
        "out_dtype",
        "bias",
        "epilogue",
        "gelu_form",
        "aux",
        "residual",
        "sums",
        "slices",
        "k_per_split",
    )

    def __init__(self, a, b, out_dtype, bias, epilogue, gelu_form, aux, residual, sums, slices, k_per_split):
        self.a, self.b, self.out_dtype, self.bias, self.epilogue = a, b, out_dtype, bias, epilogue
        self.gelu_form = gelu_form
        self.aux, self.residual, self.sums = aux, residual, int(sums)
        self.slices, self.k_per_split = slices, k_per_split

    def output(self) -> torch.Tensor:
        """The kernel's C: (M, N) of the output dtype, or a float32 workspace (slices, M, N)."""
        m, n = self.a.shape[0], self.b.shape[1]
        if self.slices > 1:
            return torch.empty((self.slices, m, n), dtype=torch.float32, device=self.a.device)
        return torch.empty((m, n), dtype=self.out_dtype, device=self.a.device)

    def result(self, c: torch.Tensor) -> torch.Tensor:
        return c.sum(0).to(self.out_dtype) if self.slices > 1 else c

    def launch(self, tile: GemmTile, c: torch.Tensor, aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Launch with ``tile`` writing C into ``c`` (and the pre-activation into ``aux`` under
        SAVE_PREACT) -> the partial sums asked for (float32: per tile row (cdiv(M, BLOCK_M), N) of C's
        columns, per K slice (slices, M) of A's rows), else None. A tile naming the TMA variant runs
        ``_linear_tma_kernel``, else ``_linear_kernel``."""
        a, b, bias, residual = self.a, self.b, self.bias, self.residual
        m, k = a.shape
        n = b.shape[1]
        config = gemm_config(tile)
        tile_rows = cdiv(m, config["BLOCK_M"])
        tiles = tile_rows * cdiv(n, config["BLOCK_N"])
        partial = None
        if self.sums != SUMS_NONE:
            shape = (tile_rows, n) if self.sums == SUMS_OF_C_COLUMNS else (self.slices, m)
            partial = torch.empty(shape, dtype=torch.float32, device=a.device)
        epilogue_args = (
            c,
            bias if bias is not None else c,
            aux if aux is not None else c,
            residual if residual is not None else c,
            partial if partial is not None else c,
        )
        strides = (
            m * n if self.slices > 1 else 0,
            n,
            bias.stride(0) if bias is not None else 0,
            aux.stride(0) if aux is not None else 0,
            *((residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)),
        )
        flags = dict(
            HAS_BIAS=bias is not None,
            EPILOGUE=self.epilogue,
            GELU_FORM=self.gelu_form,
            SAVE_PREACT=aux is not None,
            HAS_RESIDUAL=residual is not None,
            SUMS=self.sums,
            PRECISION=dot_precision(a.dtype),
        )
        if tile.kernel == TMA and tma_possible(a, b):
            a_t, b_t = tma_transposed(a), tma_transposed(b)
            bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
            a_desc = (
                TensorDescriptor.from_tensor(a.t(), [bk, bm])
                if a_t
                else TensorDescriptor.from_tensor(a, [bm, bk])
            )
            b_desc = (
                TensorDescriptor.from_tensor(b.t(), [bn, bk])
                if b_t
                else TensorDescriptor.from_tensor(b, [bk, bn])
            )
            grid = (min(tiles * self.slices, multiprocessors(a.device)),)
            launch(
                _linear_tma_kernel,
                grid,
                a_desc,
                b_desc,
                *epilogue_args,
                m,
                n,
                k,
                self.k_per_split,
                self.slices,
                *strides,
                **flags,
                A_T=a_t,
                B_T=b_t,
                **config,
            )
            return partial
        launch(
            _linear_kernel,
            (tiles, self.slices),
            a,
            b,
            *epilogue_args,
            m,
            n,
            k,
            self.k_per_split,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            *strides,
            **flags,
            **config,
        )
        return partial

    def key(self) -> tuple:
        """What a tile choice is kept for: device, operand and output dtypes, the epilogue flags, M
        and K bucketed to powers of two (the batch lives there: rows of the forward and of dX, the
        reduction of dW), N exact (a layer width), the K slices, and which of A's and B's dimensions
        have unit stride (W^T and dY^T are read transposed). Plain ints (SymInts made concrete)."""
        a, b = self.a, self.b
        (m, k), (_, n), (a_m, a_k), (b_k, b_n) = a.shape, b.shape, a.stride(), b.stride()
        return (
            a.device,
            a.dtype,
            self.out_dtype,
            self.bias is not None,
            self.epilogue,
            self.gelu_form,
            self.aux is not None,
            self.residual is not None,
            self.sums,
            bucket(int(m)),
            int(n),
            bucket(int(k)),
            self.slices,
            bool(a_m == 1),
            bool(a_k == 1),
            bool(b_k == 1),
            bool(b_n == 1),
        )

    def reference(self, rows: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
        """The output rows ``rows`` (all when None) computed by PyTorch: [out] (+ [pre-activation]
        under SAVE_PREACT). In ``dtype`` when given (the reference), else as PyTorch computes it
        in the operands' own dtypes (its matmul in the operands' dtype, the residual added in its
        dtype, as ``linear_ref`` does)."""

        def pick(t):
            t = t if rows is None else t.index_select(0, rows)
            return t if dtype is None else t.to(dtype)

        approximate = GELU_APPROXIMATIONS[self.gelu_form]
        z = torch.matmul(pick(self.a), self.b if dtype is None else self.b.to(dtype))
        if self.bias is not None:
            z = z + (self.bias if dtype is None else self.bias.to(dtype))
        outputs = []
        y = z
        if self.epilogue == EPILOGUE_GELU:
            y = gelu(z, approximate)
            if self.aux is not None:
                outputs.append(z)
        elif self.epilogue == EPILOGUE_GELU_GRAD:
            y = gelu_backward(z, pick(self.aux), approximate)
        if self.residual is not None:
            y = y + pick(self.residual)
        return [y.to(self.out_dtype) if dtype is None else y] + outputs

    def trial(self) -> tuple[Callable, Callable]:
        """(run, check) for the TileChooser: ``run(tile)`` launches into fresh outputs and returns
        every output the launch writes: [out] (+ [pre-activation] under SAVE_PREACT) (+ [the sums]:
        C's column sums (N,) or A's row sums (M,), float32, reduced over tile rows or K slices);
        ``check`` compares out and the pre-activation on ``validation_rows`` and the sums whole, with
        PyTorch's own result against float64 (float32 operands) or float32 (16-bit ones)."""
        save_preact = self.aux is not None and self.epilogue == EPILOGUE_GELU
        per_row = ["out"] + (["preact"] if save_preact else [])  # checked on validation_rows; the sums whole
        names = (
            per_row
            + {SUMS_NONE: [], SUMS_OF_C_COLUMNS: ["column sums of C"], SUMS_OF_A_ROWS: ["row sums of A"]}[
                self.sums
            ]
        )

        def run(tile):
            aux = torch.empty_like(self.aux) if save_preact else self.aux
            c = self.output()
            partial = self.launch(tile, c, aux)
            outputs = [self.result(c)] + ([aux] if save_preact else [])
            return outputs + ([partial.sum(0)] if partial is not None else [])

        wide = reference_dtype(self.a.dtype)
        references: list = []  # rows, the reference's outputs, PyTorch's own: made on the first check

        @torch.no_grad()
        def check(outputs):
            if not references:
                rows = validation_rows(int(self.a.shape[0]), self.a.device)
                references.extend((rows, self.reference(rows, wide), self.reference(rows, None)))
                if self.sums == SUMS_OF_C_COLUMNS:  # every row of C counts: the whole GEMM, once per key
                    references[1].append(self.reference(None, wide)[0].sum(0))
                    references[2].append(self.reference(None, None)[0].float().sum(0))
                elif self.sums == SUMS_OF_A_ROWS:
                    references[1].append(self.a.to(wide).sum(1))
                    references[2].append(self.a.sum(1))
            rows, exacts, owns = references
            return first_problem(
                [
                    (
                        name,
                        actual if rows is None or index >= len(per_row) else actual.index_select(0, rows),
                        own,
                        exact,
                    )
                    for index, (name, actual, exact, own) in enumerate(
                        zip(names, outputs, exacts, owns, strict=True)
                    )
                ],
                FLOORS[self.a.dtype],
            )

        return run, check


def _matmul_tile(gemm: _Gemm) -> tuple:
    """The tile ``_matmul`` launches: see ``vit_kernels._tiles.tile_to_launch``."""
    return tile_to_launch(
        GEMM_CHOOSER,
        gemm.a.device,
        gemm.key,
        lambda: GEMM_INTERPRETER_TILE,
        lambda: gemm_candidates(
            gemm.a.dtype, int(gemm.a.shape[0]), int(gemm.b.shape[1]), tma_possible(gemm.a, gemm.b)
        ),
        gemm.trial,
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K) by a view where strides allow (the kernel takes any 2-D strides); M or K
    may be 0."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


GELU_BWD_BLOCK = (32, 128, 4)  # (rows per step, columns per program, warps): 16 elements per thread


def _gelu_backward(grad: torch.Tensor, preact: torch.Tensor, gelu_form: int, bias_grad: bool):
    """dZ = grad * gelu'(preact) (M, N) and, when ``bias_grad``, its column sums (N,) in float32
    (else None), from one pass. Row slices: about four programs per multiprocessor in all, each
    slice a whole number of steps."""
    grad, preact = grad.contiguous(), preact.contiguous()
    dz = torch.empty_like(preact)
    rows, cols = preact.shape
    if dz.numel() == 0:
        return dz, preact.new_zeros(cols, dtype=torch.float32) if bias_grad else None
    block_m, block_n, warps = (16, 16, 1) if interpreted(preact.device) else GELU_BWD_BLOCK
    strips = cdiv(cols, block_n)
    machine = multiprocessors(preact.device)
    slices = max(1, min(cdiv(4 * machine, strips), cdiv(rows, block_m), 65535))
    rows_per_slice = cdiv(cdiv(rows, slices), block_m) * block_m
    slices = cdiv(rows, rows_per_slice)
    partial = torch.empty((slices, cols), dtype=torch.float32, device=preact.device) if bias_grad else dz
    launch(
        _gelu_bwd_kernel,
        (strips, slices),
        grad,
        preact,
        dz,
        partial,
        rows,
        cols,
        rows_per_slice,
        GELU_FORM=gelu_form,
        BIAS_GRAD=bias_grad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return dz, partial.sum(0) if bias_grad else None


# The bias gradient db = sum_rows dY beside dW = dY^T X: "separate" (the dW GEMM, then PyTorch's sum
# of dY, one more read of dY) or "fused" (the dW GEMM reduces the rows of the dY^T it reads,
# SUMS_OF_A_ROWS). Both are candidates the user's GPU validates and times per key. The static default
# is "separate", by occupancy in the compile report: the row sums raise the default 16-bit tile
# (128 x 128 x 64, 8 warps) from 114 to 152 registers per thread on sm_90, 2 -> 1 CTA per SM, and
# the compiler hoists the A-tile read out of the first tile column's branch, so every program pays
# it; the extra read it saves is 2 bytes per element of dY, about 13 us of a ViT-B/16 batch-128
# fc2 dW GEMM of about 200 us.
BIAS_GRAD_WAYS = ("separate", "fused")
BIAS_GRAD_CHOOSER = TileChooser("bias gradient")


def _weight_and_bias_grads_by(way: str, dy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype):
    """(dW = dY^T X in ``dtype``, db = sum_rows dY in float32) the ``way`` named."""
    if way == "fused":
        return _matmul_and_sums(dy2.t(), x2, dtype, sums=SUMS_OF_A_ROWS)
    return _matmul(dy2.t(), x2, dtype), dy2.sum(0, dtype=torch.float32)


def _bias_grad_trial(dy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype):
    """(run, check) for BIAS_GRAD_CHOOSER: dW and db against PyTorch's own, float64 / float32 exact."""

    def run(way):
        return list(_weight_and_bias_grads_by(way, dy2, x2, dtype))

    wide = reference_dtype(dy2.dtype)
    references: list = []  # the exact (dW, db) and PyTorch's own: made on the first check

    @torch.no_grad()
    def check(outputs):
        if not references:
            references.append((dy2.t().to(wide) @ x2.to(wide), dy2.to(wide).sum(0)))
            references.append((dy2.t() @ x2, dy2.sum(0)))
        exact, own = references
        return first_problem(list(zip(("dW", "db"), outputs, own, exact, strict=True)), FLOORS[dy2.dtype])

    return run, check


def _input_and_weight_grads(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias_grad: bool):
    """For Y = X W^T + b: dX = dY W, dW = dY^T X and, when ``bias_grad``, db = sum_rows dY (float32;
    else None), db by the way BIAS_GRAD_CHOOSER keeps for the key."""
    return _matmul(dy2, weight, x2.dtype), *_weight_and_bias_grads(dy2, x2, weight.dtype, bias_grad)


def _weight_and_bias_grads(dy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype, bias_grad: bool):
    """dW = dY^T X (N, K) in ``dtype`` and, when ``bias_grad``, db = sum_rows dY (N,) float32, else None."""
    if not bias_grad:
        return _matmul(dy2.t(), x2, dtype), None
    m, n = dy2.shape
    way = tile_to_launch(
        BIAS_GRAD_CHOOSER,
        dy2.device,
        lambda: (dy2.device, dy2.dtype, bucket(int(m)), int(n), int(x2.shape[1])),
        lambda: BIAS_GRAD_WAYS[0],
        lambda: BIAS_GRAD_WAYS,
        lambda: _bias_grad_trial(dy2, x2, dtype),
    )
    return _weight_and_bias_grads_by(way, dy2, x2, dtype)


if HAS_TRITON:

    def _linear_fwd(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        residual: Optional[torch.Tensor],
        activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """act(x @ W^T + b) (+ residual) (..., N), and the pre-activation (..., N) for GELU (else empty)."""
        x2 = _rows(x)
        n = weight.shape[0]
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
        has_gelu = activation != NONE
        preact = torch.empty((x2.shape[0], n) if has_gelu else (0,), dtype=x.dtype, device=x.device)
        out = _matmul(
            x2,
            weight.t(),
            out_dtype,
            bias=bias,
            epilogue=EPILOGUE_GELU if has_gelu else EPILOGUE_NONE,
            gelu_form=GELU_FORMS.get(activation, 0),
            aux=preact if has_gelu else None,
            residual=_rows(residual) if residual is not None else None,
        )
        shape = (*x.shape[:-1], n)
        return out.view(shape), preact.view(shape) if has_gelu else preact

    torch.library.triton_op("vit_kernels::linear_fwd", mutates_args=())(_linear_fwd)

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

    linear_bwd = direct(
        torch.library.triton_op("vit_kernels::linear_bwd", mutates_args=())(_linear_bwd), _linear_bwd
    )

    def _linear_setup_context(ctx, inputs, output):
        x, weight, bias, residual, activation = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None

    def _linear_backward(ctx, grad_out, grad_preact):
        if grad_out is None:
            return None, None, None, None, None
        x, weight, preact = ctx.saved_tensors
        dx, dw, db = linear_bwd(grad_out, x, weight, preact, ctx.activation, ctx.has_bias)
        return dx, dw, db if ctx.has_bias else None, grad_out if ctx.has_residual else None, None

    linear_fwd = differentiable(
        "vit_kernels::linear_fwd", _linear_backward, _linear_setup_context, _linear_fwd
    )

    def _linear_gelu_infer(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        activation: str,
    ) -> torch.Tensor:
        """gelu(x @ W^T + b) (..., N) where no gradient will be asked for: the GEMM with its bias +
        GELU epilogue, without writing the pre-activation (M x N) that only backward reads."""
        out = _matmul(
            _rows(x), weight.t(), x.dtype, bias=bias, epilogue=EPILOGUE_GELU, gelu_form=GELU_FORMS[activation]
        )
        return out.view(*x.shape[:-1], weight.shape[0])

    linear_gelu_infer = direct(
        torch.library.triton_op("vit_kernels::linear_gelu_infer", mutates_args=())(_linear_gelu_infer),
        _linear_gelu_infer,
    )

    def _mlp_fwd(
        x: torch.Tensor,
        fc1_weight: torch.Tensor,
        fc1_bias: Optional[torch.Tensor],
        fc2_weight: torch.Tensor,
        fc2_bias: Optional[torch.Tensor],
        residual: Optional[torch.Tensor],
        activation: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fc2(gelu(fc1(x))) (+ residual) (..., D_out), with the hidden H and pre-activation Z (M, Hd)."""
        x2 = _rows(x)
        preact = torch.empty((x2.shape[0], fc1_weight.shape[0]), dtype=x.dtype, device=x.device)
        out, hidden = _mlp_gemms(x2, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation, preact)
        return out.view(*x.shape[:-1], fc2_weight.shape[0]), hidden, preact

    def _mlp_gemms(x2, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation, preact):
        """(out (M, D_out), hidden (M, Hd)) of rows x2 (M, D): fc1 with its bias + GELU epilogue (also
        writing the pre-activation into ``preact`` unless it is None), then fc2 (+ residual)."""
        hidden = _matmul(
            x2,
            fc1_weight.t(),
            x2.dtype,
            bias=fc1_bias,
            epilogue=EPILOGUE_GELU,
            gelu_form=GELU_FORMS[activation],
            aux=preact,
        )
        out_dtype = torch.result_type(x2, residual) if residual is not None else x2.dtype
        out = _matmul(
            hidden,
            fc2_weight.t(),
            out_dtype,
            bias=fc2_bias,
            residual=_rows(residual) if residual is not None else None,
        )
        return out, hidden

    torch.library.triton_op("vit_kernels::mlp_fwd", mutates_args=())(_mlp_fwd)

    def _mlp_infer(
        x: torch.Tensor,
        fc1_weight: torch.Tensor,
        fc1_bias: Optional[torch.Tensor],
        fc2_weight: torch.Tensor,
        fc2_bias: Optional[torch.Tensor],
        residual: Optional[torch.Tensor],
        activation: str,
    ) -> torch.Tensor:
        """fc2(gelu(fc1(x))) (+ residual) (..., D_out) where no gradient will be asked for: the
        pre-activation (M x Hd), which only backward reads, is not written."""
        out, _ = _mlp_gemms(_rows(x), fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation, None)
        return out.view(*x.shape[:-1], fc2_weight.shape[0])

    mlp_infer = direct(
        torch.library.triton_op("vit_kernels::mlp_infer", mutates_args=())(_mlp_infer), _mlp_infer
    )

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

    mlp_bwd = direct(torch.library.triton_op("vit_kernels::mlp_bwd", mutates_args=())(_mlp_bwd), _mlp_bwd)

    def _mlp_setup_context(ctx, inputs, output):
        x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, activation = inputs
        ctx.save_for_backward(x, fc1_weight, fc2_weight, output[1], output[2])
        ctx.activation = activation
        ctx.has = (fc1_bias is not None, fc2_bias is not None, residual is not None)

    def _mlp_backward(ctx, grad_out, grad_hidden, grad_preact):
        if grad_out is None:
            return (None,) * 7
        x, fc1_weight, fc2_weight, hidden, preact = ctx.saved_tensors
        has_b1, has_b2, has_residual = ctx.has
        dx, dw1, db1, dw2, db2 = mlp_bwd(
            grad_out, x, fc1_weight, fc2_weight, hidden, preact, ctx.activation, has_b1, has_b2
        )
        return (
            dx,
            dw1,
            db1 if has_b1 else None,
            dw2,
            db2 if has_b2 else None,
            grad_out if has_residual else None,
            None,
        )

    mlp_fwd = differentiable("vit_kernels::mlp_fwd", _mlp_backward, _mlp_setup_context, _mlp_fwd)


def linear_triton(x, weight, bias=None, residual=None):
    """The Triton implementation of ``vk.linear`` (arguments already validated)."""
    return linear_fwd(x, weight, bias, residual, NONE)[0]


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will record a call on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear_gelu_triton(x, weight, bias=None, approximate="none"):
    """The Triton implementation of ``vk.linear_gelu`` (inference skips writing the pre-activation)."""
    if not _needs_grad(x, weight, bias):
        return linear_gelu_infer(x, weight, bias, gelu_act(approximate))
    return linear_fwd(x, weight, bias, None, gelu_act(approximate))[0]


def mlp_triton(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate="none", residual=None):
    """The Triton implementation of ``vk.mlp`` (inference skips writing the pre-activation)."""
    if not _needs_grad(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual):
        return mlp_infer(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, gelu_act(approximate))
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
