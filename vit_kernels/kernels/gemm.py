"""The GEMM kernels (pointer and persistent TMA) with their fused epilogues (bias, GELU and its
gradient, residual, row and column sums), the GELU forms and the GELU backward kernel; served
by ``vit_kernels.ops.gemm`` to linear, linear_gelu, mlp, SwiGLU and patch_embed.
"""

from __future__ import annotations

from vit_kernels._triton import tl, triton

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
#             with one e = exp(-1.702 |z|) in [0, 1]: s = 1 / (1 + e) for z >= 0 and e / (1 + e)
#             below, s (1 - s) = e / (1 + e)^2, without cancellation or overflow
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
        e = tl.exp(tl.abs(z) * -QUICK_GELU_SLOPE)
        inv = 1.0 / (1.0 + e)
        return tl.where(z >= 0, inv, e * inv) + z * QUICK_GELU_SLOPE * e * inv * inv
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
# grow like sqrt(BLOCK_K) + sqrt(K / BLOCK_K) rather than sqrt(K), the error of one FMA chain through
# the whole reduction (benchmarks/results/h200-2026-11-26.md: 5 to 10.6 units at K = 1023).
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
    A, B, C, Bias, Aux, Residual, Sums, M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn,
    stride_c_split, stride_cm, stride_bias, stride_aux_m, stride_res_m, stride_res_n,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, GELU_FORM: tl.constexpr, SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SUMS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
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
        acc=acc, offs_m=offs_m, offs_n=offs_n, pid_m=pid_m, pid_k=pid_k, M=M, N=N, C=C, Bias=Bias, Aux=Aux,
        Residual=Residual, Sums=Sums, stride_c_split=stride_c_split, stride_cm=stride_cm,
        stride_bias=stride_bias, stride_aux_m=stride_aux_m, stride_res_m=stride_res_m,
        stride_res_n=stride_res_n, HAS_BIAS=HAS_BIAS, EPILOGUE=EPILOGUE, GELU_FORM=GELU_FORM,
        SAVE_PREACT=SAVE_PREACT, HAS_RESIDUAL=HAS_RESIDUAL, SUMS=SUMS,
    )  # fmt: skip


@triton.jit
def _gemm_epilogue(
    acc, offs_m, offs_n, pid_m, pid_k, M, N, C, Bias, Aux, Residual, Sums, stride_c_split, stride_cm,
    stride_bias, stride_aux_m, stride_res_m, stride_res_n,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, GELU_FORM: tl.constexpr, SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SUMS: tl.constexpr,
):  # fmt: skip
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
    A_desc, B_desc, C, Bias, Aux, Residual, Sums, M, N, K, k_per_split, slices, stride_c_split, stride_cm,
    stride_bias, stride_aux_m, stride_res_m, stride_res_n,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, GELU_FORM: tl.constexpr, SAVE_PREACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SUMS: tl.constexpr, PRECISION: tl.constexpr, A_T: tl.constexpr,
    B_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
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
            acc=acc, offs_m=offs_m, offs_n=offs_n, pid_m=pid_m, pid_k=pid_k, M=M, N=N, C=C, Bias=Bias,
            Aux=Aux, Residual=Residual, Sums=Sums, stride_c_split=stride_c_split, stride_cm=stride_cm,
            stride_bias=stride_bias, stride_aux_m=stride_aux_m, stride_res_m=stride_res_m,
            stride_res_n=stride_res_n, HAS_BIAS=HAS_BIAS, EPILOGUE=EPILOGUE, GELU_FORM=GELU_FORM,
            SAVE_PREACT=SAVE_PREACT, HAS_RESIDUAL=HAS_RESIDUAL, SUMS=SUMS,
        )  # fmt: skip


_linear_tma_kernel.min_capability = (
    90  # offered on sm_90+ only (ops.gemm.tma_layout): the compile gate skips sm_80
)


# The linear_gelu backward's epilogue pass (its dY comes from outside, so it cannot ride in a GEMM
# epilogue of ours), over a BLOCK_N-column strip (grid axis 0) of one slice of rows (axis 1):
#   dZ = dY * gelu'(Z)                                  (M, N), in Z's dtype
#   BIAS_GRAD: Partial[slice, n] = sum_{m in slice} dZ[m, n]   (float32 before dZ's rounding; the
#              host sums the slices): the bias gradient without a second read of dZ
@triton.jit
def _gelu_bwd_kernel(
    DY, Z, DZ, Partial, rows, cols, rows_per_slice,
    GELU_FORM: tl.constexpr, BIAS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
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
