"""SwiGLU's Triton kernels: the dual-accumulator gate/up GEMM and the backward pass through the
gate (launched by ``vit_kernels.ops.swiglu``).
"""

from __future__ import annotations

from vit_kernels._triton import tl, triton
from vit_kernels.kernels.gemm import accumulate_dot, block_zero, grouped_tile


# H = silu(G) * U with G = A @ Bg + bg, U = A @ Bu + bu (A = X (M, K); Bg = W_g^T, Bu = W_u^T (K, N),
# read by strides), one program per (BLOCK_M x BLOCK_N) tile of H in grouped_tile order:
#   acc_g = sum_k A[m, k] Bg[k, n],  acc_u = sum_k A[m, k] Bu[k, n]     (two fp32 accumulators, A loaded once)
#   G = acc_g + bg[n];  U = acc_u + bu[n]   (both stored when SAVE_PREACT: backward reads them)
#   H = G / (1 + exp(-G)) * U               (cast once on store)
@triton.jit
def _swiglu_fwd_kernel(
    A, BG, BU, BiasG, BiasU, H, G, U, M, N, K, stride_am, stride_ak, stride_bg_k, stride_bg_n, stride_bu_k,
    stride_bu_n, stride_bias_g, stride_bias_u,
    HAS_BIAS_G: tl.constexpr, HAS_BIAS_U: tl.constexpr, SAVE_PREACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    bg_ptrs = BG + offs_k[:, None].to(tl.int64) * stride_bg_k + offs_n[None, :].to(tl.int64) * stride_bg_n
    bu_ptrs = BU + offs_k[:, None].to(tl.int64) * stride_bu_k + offs_n[None, :].to(tl.int64) * stride_bu_n
    step_a = BLOCK_K * tl.cast(stride_ak, tl.int64)  # a unit stride arrives as a constexpr int
    step_bg = BLOCK_K * tl.cast(stride_bg_k, tl.int64)
    step_bu = BLOCK_K * tl.cast(stride_bu_k, tl.int64)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    zero = block_zero(BLOCK_M, BLOCK_N)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        bg = tl.load(bg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        bu = tl.load(bu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc_g = accumulate_dot(acc_g, a, bg, zero, PRECISION)
        acc_u = accumulate_dot(acc_u, a, bu, zero, PRECISION)
        a_ptrs += step_a
        bg_ptrs += step_bg
        bu_ptrs += step_bu
    if HAS_BIAS_G:
        acc_g += tl.load(BiasG + offs_n.to(tl.int64) * stride_bias_g, mask=mask_n, other=0.0).to(tl.float32)[
            None, :
        ]
    if HAS_BIAS_U:
        acc_u += tl.load(BiasU + offs_n.to(tl.int64) * stride_bias_u, mask=mask_n, other=0.0).to(tl.float32)[
            None, :
        ]
    mask = mask_m[:, None] & mask_n[None, :]
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :].to(tl.int64)
    if SAVE_PREACT:
        tl.store(G + offs, acc_g.to(G.dtype.element_ty), mask=mask)
        tl.store(U + offs, acc_u.to(U.dtype.element_ty), mask=mask)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=mask)


# The gating's backward over a BLOCK_N-column strip (grid axis 0) of one slice of rows (axis 1), all
# (M, N) contiguous, with s = sigmoid(G):
#   dG = dH U s (1 + G (1 - s));  dU = dH silu(G) = dH G s        (in G's dtype)
#   BIAS_GRAD: PartialG[slice, n] = sum_{m in slice} dG[m, n], PartialU likewise for dU (float32
#              before the rounding; the host sums the slices): both bias gradients with no second read
@triton.jit
def _swiglu_bwd_kernel(
    DH, G, U, DG, DU, PartialG, PartialU, rows, cols, rows_per_slice,
    BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < cols
    row_begin = tl.program_id(1) * rows_per_slice
    row_end = tl.minimum(row_begin + rows_per_slice, rows)
    sums_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    sums_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(row_begin, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < row_end)[:, None] & mask_n[None, :]
        offs = offs_m.to(tl.int64)[:, None] * cols + offs_n[None, :]
        dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        dg = dh * u * s * (1.0 + g * (1.0 - s))
        du = dh * g * s
        tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
        if BIAS_GRAD:  # masked elements are 0 (dh = 0 there)
            sums_g += tl.sum(dg, 0)
            sums_u += tl.sum(du, 0)
    if BIAS_GRAD:
        tl.store(PartialG + tl.program_id(1).to(tl.int64) * cols + offs_n, sums_g, mask=mask_n)
        tl.store(PartialU + tl.program_id(1).to(tl.int64) * cols + offs_n, sums_u, mask=mask_n)
