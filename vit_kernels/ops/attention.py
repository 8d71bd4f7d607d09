"""Multi-head softmax attention from a packed ``qkv`` tensor.

    q, k, v = split(qkv)                      each (B, H, L, Dh), D = H * Dh
    S = scale * q @ k^T                       (B, H, L, L), scale = Dh ** -0.5 by default
    P = softmax(S, dim=-1)
    O = dropout(P) @ v  -> (B, L, D)          heads concatenated, ready for the output projection

The Triton kernels read q, k and v straight out of ``qkv`` by strides and write O in (B, L, D):
no permute, no copy. Forward is flash-style (online softmax, fp32 accumulation) and saves the
log-sum-exp per row; backward recomputes P from it (FlashAttention-2).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from vit_kernels import _ext, _signature, backend
from vit_kernels._ext import ExtensionOps
from vit_kernels._autograd import differentiable, direct
from vit_kernels.ops.rope import apply_rope, tables_4d
from vit_kernels._tiles import (
    FLOORS,
    TileChooser,
    first_problem,
    plain_repr,
    reference_dtype,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import (
    HAS_TRITON,
    as_float32,
    cdiv,
    dot_precision,
    interpreted,
    launch,
    next_power_of_2,
    tl,
    triton,
)

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# Every attention kernel runs one program per (block of rows, batch * head), flattened onto grid
# axis 0 (axes 1 and 2 stop at 65,535, which B * H passes at large batches) with the row blocks of
# one (batch, head) adjacent, so that they share its K and V in L2.
@triton.jit
def _block_and_head(seq_len, num_heads, BLOCK: tl.constexpr):
    """-> (row block, batch * head, batch, head) of this program."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(seq_len, BLOCK)
    pid_bh = pid // blocks
    return pid % blocks, pid_bh, pid_bh // num_heads, pid_bh % num_heads


# The dropout keep mask z_ij of (batch * head, query i, key j): Philox on the int64 counter
# (bh * L + i) * L + j, unique for every element of every head and image (no int32 wrap-around).
# ``query`` and ``key`` are index tensors broadcasting to the tile: (rows_m[:, None], rows_n[None, :])
# for a (query, key) tile; (rows_m[None, :], rows_n[:, None]) for the dK/dV kernel's (key, query)
# tile, whose element (j, i) must draw the forward's z_ij.
@triton.jit
def _dropout_keep(seed, pid_bh, query, key, seq_len, dropout_p):
    counter = (pid_bh.to(tl.int64) * seq_len + query) * seq_len + key
    return tl.rand(seed, counter) >= dropout_p


# Tiles are addressed as a 64-bit base pointer per (batch, head, block) plus the tile's own int32
# offsets (row * row stride + column * column stride, computed once per program), so the inner loops
# do no 64-bit multiplies. A (rows, BLOCK_D) tile of rows ``rows`` is loaded with masks only where
# they can be false: on rows (``MASK_ROWS``: the last, partial block of a sequence) and on the head
# dim's padding (unless ``EVEN_D``, head dim == BLOCK_D); masked elements read 0.
@triton.jit
def _load_tile(ptrs, rows, seq_len, mask_d, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=(rows < seq_len)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows < seq_len)[:, None] & mask_d[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return tile


# Rotary position embedding (ROPE = 1: layout "interleaved", 2: "half"; 0: none, the kernels as
# without it), applied to q and k as their tiles are loaded (vit_kernels/ops/rope.py):
#   x' = x cos + rot(x) sin,  rot(x) = (-x1, x0, -x3, x2, ...) on the pairs of the layout,
#   computed in float32; rows before rope_start = L - L_r (class, register tokens) are not rotated
#   (cos = 1, sin = 0), row i >= rope_start takes table row i - rope_start.
# Scores are invariant to one permutation of the head-dim columns of both q and k, so a rotated
# tile's column c holds the qkv column _rope_cols(c): c for "interleaved", and for "half" the
# pairs (i, i + Dh/2) made adjacent (columns 0, Dh/2, 1, Dh/2 + 1, ...): both layouts are then the
# pairs (2i, 2i + 1) of the tile. The tables are read in that same column order, dq and dk are
# stored back through it; v, dO, out and dv keep their plain order.
# The partner of tile column c is c ^ 1, read by a second load (the same cache lines), so that a
# rotated tile is computed from loads alone, in either orientation: k' enters q' k'^T loaded as a
# (Dh, keys) tile (q' in the dK/dV kernel's k' q'^T as (Dh, queries)), and no computed tile is
# transposed into a dot (triton-lang/triton#6124, see the dK/dV kernel's query block).
# Derivative: rot is a signed swap, rot^T = -rot, so the gradient g of x' gives
# dx = g cos - rot(g sin), the swap of a register tile done by reshape / split / join (into a
# store, never into a dot).
@triton.jit
def _rope_cols(tcols, head_dim, ROPE: tl.constexpr):
    """The qkv column (within a head) that tile column ``tcols`` holds (see above)."""
    if ROPE == 2:
        return tl.where(tcols < head_dim, tcols // 2 + (tcols % 2) * (head_dim // 2), tcols)
    else:
        return tcols


@triton.jit
def _rope_tables(
    cos_base,
    sin_base,
    rows,
    tcols,
    seq_len,
    head_dim,
    rope_start,
    stride_cos_l,
    stride_cos_d,
    stride_sin_l,
    stride_sin_d,
    ROPE: tl.constexpr,
):
    """float32 cos and sin of sequence rows ``rows`` and tile columns ``tcols``, index tensors that
    broadcast to the tile ((R, 1) and (1, D) for a row-major tile, (1, R) and (D, 1) for a
    transposed one); 1 and 0 (no rotation) for prefix rows and outside the sequence or head dim."""
    cols = _rope_cols(tcols, head_dim, ROPE)
    on = (rows >= rope_start) & (rows < seq_len) & (tcols < head_dim)
    table_rows = rows - rope_start
    cos = tl.load(cos_base + table_rows * stride_cos_l + cols * stride_cos_d, mask=on, other=1.0)
    sin = tl.load(sin_base + table_rows * stride_sin_l + cols * stride_sin_d, mask=on, other=0.0)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _load_rotated(
    base,
    rows,
    tcols,
    seq_len,
    head_dim,
    stride_l,
    stride_c,
    cos_base,
    sin_base,
    rope_start,
    stride_cos_l,
    stride_cos_d,
    stride_sin_l,
    stride_sin_d,
    ROPE: tl.constexpr,
    VOLATILE: tl.constexpr,
):
    """x' = x cos + rot(x) sin of the q or k tile at ``base`` (one head of one image), in tile column
    order, for index tensors ``rows``, ``tcols`` as in ``_rope_tables``; 0 outside the sequence and
    head dim. Returned in the dtype of qkv (a dot operand)."""
    mask = (rows < seq_len) & (tcols < head_dim)
    row_offsets = rows * stride_l
    x = tl.load(
        base + row_offsets + _rope_cols(tcols, head_dim, ROPE) * stride_c,
        mask=mask,
        other=0.0,
        volatile=VOLATILE,
    )
    partner = tl.load(
        base + row_offsets + _rope_cols(tcols ^ 1, head_dim, ROPE) * stride_c,
        mask=mask,
        other=0.0,
        volatile=VOLATILE,
    )
    cos, sin = _rope_tables(
        cos_base,
        sin_base,
        rows,
        tcols,
        seq_len,
        head_dim,
        rope_start,
        stride_cos_l,
        stride_cos_d,
        stride_sin_l,
        stride_sin_d,
        ROPE,
    )
    sign = tl.where(tcols % 2 == 0, -1.0, 1.0)
    return (x.to(tl.float32) * cos + partner.to(tl.float32) * sign * sin).to(x.dtype)


@triton.jit
def _rotated_pair(
    base,
    rows,
    offs_d,
    seq_len,
    head_dim,
    stride_l,
    stride_c,
    cos_base,
    sin_base,
    rope_start,
    stride_cos_l,
    stride_cos_d,
    stride_sin_l,
    stride_sin_d,
    ROPE: tl.constexpr,
):
    """The rotated tile of sequence rows ``rows`` as (rows, Dh) and as (Dh, rows), both from loads."""
    x = _load_rotated(
        base,
        rows[:, None],
        offs_d[None, :],
        seq_len,
        head_dim,
        stride_l,
        stride_c,
        cos_base,
        sin_base,
        rope_start,
        stride_cos_l,
        stride_cos_d,
        stride_sin_l,
        stride_sin_d,
        ROPE,
        False,
    )
    xt = _load_rotated(
        base,
        rows[None, :],
        offs_d[:, None],
        seq_len,
        head_dim,
        stride_l,
        stride_c,
        cos_base,
        sin_base,
        rope_start,
        stride_cos_l,
        stride_cos_d,
        stride_sin_l,
        stride_sin_d,
        ROPE,
        False,
    )
    return x, xt


@triton.jit
def _rope_grad(g, cos, sin, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx = g cos - rot(g sin) of a float32 (ROWS, BLOCK_D) gradient tile in tile column order."""
    even, odd = tl.split(tl.reshape(g * sin, (ROWS, BLOCK_D // 2, 2)))
    return g * cos - tl.reshape(tl.join(-odd, even), (ROWS, BLOCK_D))


# An attention mask (MASK = 1: additive, any float dtype; 2: boolean, True = attend; 0: none, the
# kernels as without it), broadcast to (B, H, L, L) by its strides (0 along broadcast dims), enters
# the kernels' unscaled scores s_ij = q_i . k_j as
#   s_ij + b_ij / scale,   b_ij = mask_ij (additive) or 0 / -inf (boolean),
# so that scale (s_ij + b_ij / scale) = scale q_i . k_j + b_ij, SDPA's scores. Finite b_ij are
# clamped to +-limit = +-FLT_MAX * min(scale, 1) first, so that b / scale stays finite: a mask of
# finfo(float32).min (timm's, transformers') then keeps a row whose every key it masks finite and
# uniform, as SDPA computes it, where b / scale would overflow to -inf. -inf (and boolean False)
# removes the key; a row with every key at -inf gets P = 0 (out = 0, no gradient), as SDPA's.
# The tile is addressed by its (query, key) index tensors rows_m, rows_n broadcasting to it, so the
# dK/dV kernel's (key, query) tiles load it transposed; outside the sequence it reads b = 0.
# The mask has no gradient (the kernels decline a mask that requires one).
@triton.jit
def _mask_term(
    mask_base, rows_m, rows_n, seq_len, stride_mask_m, stride_mask_n, inv_scale, limit, MASK: tl.constexpr
):
    """b / scale (float32) of the (query rows_m, key rows_n) tile of one head of one image."""
    inside = (rows_m < seq_len) & (rows_n < seq_len)
    ptrs = mask_base + rows_m.to(tl.int64) * stride_mask_m + rows_n.to(tl.int64) * stride_mask_n
    if MASK == 2:
        keep = tl.load(ptrs, mask=inside, other=1)
        term = tl.where(keep != 0, 0.0, float("-inf"))
    else:
        b = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        b = tl.where((b < -limit) & (b > float("-inf")), -limit, b)
        b = tl.where((b > limit) & (b < float("inf")), limit, b)
        term = b * inv_scale
    return term


# One key block of the forward (keys start_n + offs_n) for the query tile q, with c = scale * log2(e):
#   s_ij = q_i . k_j   (-inf for keys past the sequence: only in the masked tail block, MASK_N)
#   (with ROPE, q and k rotated: q' . k'_j, k' given as the loaded and rotated (Dh, keys) tile kt)
#   m_new = max(m_i, max_j s_ij),  alpha = 2^((m_i - m_new) c),  p_ij = 2^((s_ij - m_new) c)
#   l_i <- alpha l_i + sum_j p_ij,  acc_i <- alpha acc_i + sum_j z_ij / (1 - p) p_ij v_j    -> (acc, l, m_new)
@triton.jit
def _attention_fwd_key_block(
    acc,
    l_i,
    m_i,
    q,
    kt,
    k_ptrs,
    v_ptrs,
    start_n,
    offs_n,
    offs_m,
    mask_d,
    seq_len,
    pid_bh,
    seed,
    scale_log2,
    dropout_p,
    keep_scale,
    mask_base,
    stride_mask_m,
    stride_mask_n,
    inv_scale,
    mask_limit,
    MASK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    rows_n = start_n + offs_n
    if ROPE == 0:
        k = _load_tile(k_ptrs, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
    v = _load_tile(v_ptrs, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
    if ROPE == 0:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        s = tl.dot(q, kt, input_precision=PRECISION)
    if MASK_N:
        s = tl.where((rows_n < seq_len)[None, :], s, float("-inf"))
    if MASK != 0:
        s = s + _mask_term(
            mask_base,
            offs_m[:, None],
            rows_n[None, :],
            seq_len,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            MASK,
        )
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK == 0:
        alpha = tl.exp2((m_i - m_new) * scale_log2)
        p = tl.exp2((s - m_new[:, None]) * scale_log2)
    else:  # a row masked so far has m = -inf: its exponents are taken against 0 (all 2^-inf = 0)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_safe) * scale_log2)
        p = tl.exp2((s - m_safe[:, None]) * scale_log2)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(
            _dropout_keep(seed, pid_bh, offs_m[:, None], rows_n[None, :], seq_len, dropout_p),
            p * keep_scale,
            0.0,
        )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


# Forward, one program per (block of BLOCK_M query rows, batch * head), with c = scale * log2(e):
#   s_ij = q_i . k_j                                          (unscaled dot products)
#   m_i = max_j s_ij,  l_i = sum_j 2^((s_ij - m_i) c)         (online over key blocks, rescaled by 2^((m_old - m_new) c))
#   o_i = (1 / l_i) sum_j z_ij / (1 - p) 2^((s_ij - m_i) c) v_j   (z_ij the dropout keep mask, 1 without dropout)
#   saved per row: m_i and 1 / l_i, so that P_ij = 2^((s_ij - m_i) c) / l_i
# The scale enters as the one multiply by c of each exponent (log2(e) folded in on the host; exp2 is
# the hardware's exponential), applied after subtracting the row max: for the largest terms
# s_ij - m_i is exact (Sterbenz), so the row max's own term is exactly 2^0 = 1 (one token: P = 1,
# out = v and dq = dk = 0 exactly), where a fused s_ij c - m_i c would keep the rounding of m_i c in
# every exponent, and s_ij c, or a log-sum-exp m_i + log2(l_i) / c, would round at the magnitude of
# s_ij and scale every probability of the row by that rounding.
# The key blocks run in two parts: the BLOCK_N blocks that lie inside the sequence, with no mask,
# then (when BLOCK_N does not divide L) one tail block of BLOCK_TAIL keys (L mod BLOCK_N padded to a
# power of two, at least 16: 16 keys rather than 64 at L = 197), the only one masked on the key
# length. q is loaded once; rows past the sequence are masked on their loads and stores only
# (their q reads 0). With ROPE, q and each k block are rotated as loaded (see _rope_cols), k as a
# (Dh, keys) tile. Shapes: qkv (B, L, 3D), out (B, L, D), row statistics (B*H, L); with ROPE the
# tables Cos, Sin (B, H, L_r, Dh) by strides (0 where broadcast), rope_start = L - L_r.
@triton.jit
def _attention_fwd_kernel(
    QKV,
    Out,
    RowMax,
    RowInvSum,
    Seed,
    Cos,
    Sin,
    Mask,
    seq_len,
    num_heads,
    head_dim,
    model_dim,
    rope_start,
    stride_qkv_b,
    stride_qkv_l,
    stride_qkv_c,
    stride_out_b,
    stride_out_l,
    stride_cos_b,
    stride_cos_h,
    stride_cos_l,
    stride_cos_d,
    stride_sin_b,
    stride_sin_h,
    stride_sin_l,
    stride_sin_d,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    scale_log2,
    dropout_p,
    inv_scale,
    mask_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    scale_log2, dropout_p = as_float32(scale_log2), as_float32(dropout_p)
    inv_scale, mask_limit = as_float32(inv_scale), as_float32(mask_limit)
    pid_m, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK_M)
    mask_base = Mask + batch.to(tl.int64) * stride_mask_b + head.to(tl.int64) * stride_mask_h
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    q_base = QKV + batch.to(tl.int64) * stride_qkv_b + (head * head_dim).to(tl.int64) * stride_qkv_c
    k_base = q_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    v_base = k_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qkv_l + cols
    if ROPE == 0:
        q = _load_tile(
            q_base + tl.cast(start_m, tl.int64) * stride_qkv_l + q_tile, offs_m, seq_len, mask_d, True, EVEN_D
        )
    else:
        cos_base = Cos + batch.to(tl.int64) * stride_cos_b + head.to(tl.int64) * stride_cos_h
        sin_base = Sin + batch.to(tl.int64) * stride_sin_b + head.to(tl.int64) * stride_sin_h
        q = _load_rotated(
            q_base,
            offs_m[:, None],
            offs_d[None, :],
            seq_len,
            head_dim,
            stride_qkv_l,
            stride_qkv_c,
            cos_base,
            sin_base,
            rope_start,
            stride_cos_l,
            stride_cos_d,
            stride_sin_l,
            stride_sin_d,
            ROPE,
            False,
        )
    seed = 0
    keep_scale = 1.0
    if DROPOUT:
        seed = tl.load(Seed)
        keep_scale = 1.0 / (1.0 - dropout_p)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_tile = offs_n[:, None] * stride_qkv_l + cols
    full_end = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        row_offset = tl.cast(start_n, tl.int64) * stride_qkv_l
        kt = 0
        if ROPE != 0:
            kt = _load_rotated(
                k_base,
                (start_n + offs_n)[None, :],
                offs_d[:, None],
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
                False,
            )
        acc, l_i, m_i = _attention_fwd_key_block(
            acc,
            l_i,
            m_i,
            q,
            kt,
            k_base + row_offset + kv_tile,
            v_base + row_offset + kv_tile,
            start_n,
            offs_n,
            offs_m,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            keep_scale,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            False,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
    if BLOCK_TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        tail_tile = offs_t[:, None] * stride_qkv_l + cols
        row_offset = tl.cast(full_end, tl.int64) * stride_qkv_l
        kt_tail = 0
        if ROPE != 0:
            kt_tail = _load_rotated(
                k_base,
                (full_end + offs_t)[None, :],
                offs_d[:, None],
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
                False,
            )
        acc, l_i, m_i = _attention_fwd_key_block(
            acc,
            l_i,
            m_i,
            q,
            kt_tail,
            k_base + row_offset + tail_tile,
            v_base + row_offset + tail_tile,
            full_end,
            offs_t,
            offs_m,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            keep_scale,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            True,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )

    if MASK == 0:
        inv_sum = 1.0 / l_i
    else:  # a row with every key masked: P = 0 (l = 0, m = -inf saved as 0)
        inv_sum = tl.where(l_i == 0.0, 0.0, 1.0 / l_i)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    acc = acc * inv_sum[:, None]
    mask_m = offs_m < seq_len
    out_ptrs = (
        Out
        + batch.to(tl.int64) * stride_out_b
        + tl.cast(start_m, tl.int64) * stride_out_l
        + head * head_dim
        + (tl.arange(0, BLOCK_M)[:, None] * stride_out_l + offs_d[None, :])
    )
    if EVEN_D:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    tl.store(RowMax + pid_bh.to(tl.int64) * seq_len + offs_m, m_i, mask=mask_m)
    tl.store(RowInvSum + pid_bh.to(tl.int64) * seq_len + offs_m, inv_sum, mask=mask_m)


# The dQ kernel's per-tile recomputation, for query rows rows_m and key rows rows_n of one
# (batch, head) (the dK/dV kernel computes the same tiles transposed, in its query block):
#   P = 2^((s - m) c) / l (0 outside the sequence),  P~ = z * P / (1 - p),  dP~ = dO V^T,
#   dP = z * dP~ / (1 - p)                                      -> (P, P~, dP)
# Rows past the sequence load q, dO, m and 1 / l as 0: the dQ kernel discards their rows at its
# store. Keys past the sequence are masked where MASK_N (the dQ kernel's tail block).
# The row term of the softmax gradient, delta_i = sum_j P_ij dP_ij (= dO_i . O_i), is summed from
# these same P and dP rather than from the stored output, so that dS_ij = P_ij (dP_ij - delta_i)
# cancels exactly where the math does (one token; a saturated, one-hot softmax) instead of keeping
# the rounding difference between two ways of computing dO . v_j.
@triton.jit
def _attention_bwd_p_dp(
    q,
    k,
    kt,
    v,
    do,
    row_max,
    inv_sum,
    rows_m,
    rows_n,
    seq_len,
    pid_bh,
    seed,
    scale_log2,
    dropout_p,
    mask_base,
    stride_mask_m,
    stride_mask_n,
    inv_scale,
    mask_limit,
    MASK_N: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    if ROPE == 0:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:  # q and k rotated, k' as the (Dh, keys) tile kt (see _rope_cols)
        s = tl.dot(q, kt, input_precision=PRECISION)
    if MASK != 0:
        s = s + _mask_term(
            mask_base,
            rows_m[:, None],
            rows_n[None, :],
            seq_len,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            MASK,
        )
    p = tl.exp2((s - row_max[:, None]) * scale_log2) * inv_sum[:, None]
    if MASK_N:
        p = tl.where((rows_n < seq_len)[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
        keep = _dropout_keep(seed, pid_bh, rows_m[:, None], rows_n[None, :], seq_len, dropout_p)
        p_dropped = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    else:
        p_dropped = p
    return p, p_dropped, dp


# One query block of the dK/dV kernel: query rows i = start_m + offs_m against the program's key
# rows j (its k and v tiles), in (key, query) tiles of BLOCK_N x BLOCK_M (the kernel's formulas):
#   S^T = k q^T,  P^T = 2^((S^T - m) c) / l,  dP~^T = v dO^T,  dV += P~^T dO,  dK += dS^T q   -> (dK, dV)
# P~^T and dS^T enter their products as computed, as left operands; the only transposes are of the
# q and dO tiles as loaded (as the forward's of k). A transposed computed tile feeding tl.dot
# (tl.trans(P~), out of the accumulator's MMA layout) is what Triton miscompiles on Hopper
# (triton-lang/triton#6124: a wrong dK on an H100); the compile gate (`make check-gpu`) fails any
# variant whose TTGIR has one.
# Loads are masked on the rows only in the tail block (MASK_M), where query rows past the sequence
# (columns here) get P~ = dS = 0: they load q, dO, m and 1 / l as 0, but a non-finite key gives them
# S = 0 * inf = NaN, which would reach every dK and dV row. Keys past the sequence are not masked:
# the kernel discards their rows of dK and dV at its store, which are all they reach.
@triton.jit
def _attention_bwd_dkdv_query_block(
    dk,
    dv,
    k,
    v,
    q_rot,
    qt_rot,
    q_ptrs,
    do_ptrs,
    stats_ptrs,
    Delta,
    RowMax,
    RowInvSum,
    start_m,
    offs_m,
    offs_n,
    mask_d,
    seq_len,
    pid_bh,
    seed,
    scale_log2,
    dropout_p,
    mask_base,
    stride_mask_m,
    stride_mask_n,
    inv_scale,
    mask_limit,
    MASK_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    rows_m = start_m + offs_m
    if ROPE == 0:
        q = _load_tile(q_ptrs, rows_m, seq_len, mask_d, MASK_M, EVEN_D)
    else:  # the rotated q' as (queries, Dh) and as (Dh, queries): no computed tile is transposed
        q = q_rot
    do = _load_tile(do_ptrs, rows_m, seq_len, mask_d, MASK_M, EVEN_D)
    if MASK_M:
        mask_m = rows_m < seq_len
        row_max = tl.load(RowMax + stats_ptrs, mask=mask_m, other=0.0)
        inv_sum = tl.load(RowInvSum + stats_ptrs, mask=mask_m, other=0.0)
        delta = tl.load(Delta + stats_ptrs, mask=mask_m, other=0.0)
    else:
        row_max = tl.load(RowMax + stats_ptrs)
        inv_sum = tl.load(RowInvSum + stats_ptrs)
        delta = tl.load(Delta + stats_ptrs)
    if ROPE == 0:
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    else:
        s_t = tl.dot(k, qt_rot, input_precision=PRECISION)
    if MASK != 0:  # the (key, query) tile of the mask, loaded transposed
        s_t = s_t + _mask_term(
            mask_base,
            rows_m[None, :],
            offs_n[:, None],
            seq_len,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            MASK,
        )
    p_t = tl.exp2((s_t - row_max[None, :]) * scale_log2) * inv_sum[None, :]
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    if DROPOUT:
        keep_scale = 1.0 / (1.0 - dropout_p)
        keep_t = _dropout_keep(seed, pid_bh, rows_m[None, :], offs_n[:, None], seq_len, dropout_p)
        p_dropped_t = tl.where(keep_t, p_t * keep_scale, 0.0)
        dp_t = tl.where(keep_t, dp_t * keep_scale, 0.0)
    else:
        p_dropped_t = p_t
    ds_t = p_t * (dp_t - delta[None, :])
    if MASK_M:
        p_dropped_t = tl.where(mask_m[None, :], p_dropped_t, 0.0)
        ds_t = tl.where(mask_m[None, :], ds_t, 0.0)
    dv += tl.dot(p_dropped_t.to(do.dtype), do, input_precision=PRECISION)
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


# dK and dV, one program per (block of BLOCK_N key rows, batch * head), looping over query blocks
# with every tile key-major, (key j, query i): the transposes of the forward's tiles.
#   S^T = K Q^T,  P^T_ji = 2^((S^T_ji - m_i) c) / l_i,  P~^T = z^T * P^T / (1 - p)
#   dV = sum_i P~^T_i dO_i                                (O = P~ V)
#   dP~^T = V dO^T,  dP^T = z^T * dP~^T / (1 - p),  dS^T_ji = P^T_ji (dP^T_ji - delta_i)
#   dK = scale * sum_i dS^T_i Q_i
# (the derivative of O = P~ V with respect to V, and of S = scale Q K^T through the softmax,
# dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik), with respect to K: dK = scale dS^T Q). Key-major, no
# computed tile is transposed (see the query block). The BLOCK_M query blocks inside the sequence
# load without masks; the tail (BLOCK_TAIL rows, L mod BLOCK_M padded to a power of two, when
# BLOCK_M does not divide L) is the only block masked. K and V are loaded once (and again for the
# tail); the key rows past the sequence are masked on those loads and the stores only. With ROPE
# (see _rope_cols) K is rotated as loaded, each query block's Q twice (as (queries, Dh) for dK and
# (Dh, queries) for S^T), and dK, the gradient of the rotated k', is taken back through the rotation:
# dk = dK' cos - rot(dK' sin). Shapes: qkv and dqkv (B, L, 3D), dO (B, L, D), row statistics and
# delta (B*H, L), rope tables as in the forward.
@triton.jit
def _attention_bwd_dkdv_kernel(
    QKV,
    DOut,
    RowMax,
    RowInvSum,
    Delta,
    Seed,
    DQKV,
    Cos,
    Sin,
    Mask,
    seq_len,
    num_heads,
    head_dim,
    model_dim,
    rope_start,
    stride_qkv_b,
    stride_qkv_l,
    stride_qkv_c,
    stride_do_b,
    stride_do_l,
    stride_do_c,
    stride_dqkv_b,
    stride_dqkv_l,
    stride_cos_b,
    stride_cos_h,
    stride_cos_l,
    stride_cos_d,
    stride_sin_b,
    stride_sin_h,
    stride_sin_l,
    stride_sin_d,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    scale,
    scale_log2,
    dropout_p,
    inv_scale,
    mask_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    scale, scale_log2, dropout_p = as_float32(scale), as_float32(scale_log2), as_float32(dropout_p)
    inv_scale, mask_limit = as_float32(inv_scale), as_float32(mask_limit)
    pid_n, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK_N)
    mask_base = Mask + batch.to(tl.int64) * stride_mask_b + head.to(tl.int64) * stride_mask_h
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    q_base = QKV + batch.to(tl.int64) * stride_qkv_b + (head * head_dim).to(tl.int64) * stride_qkv_c
    k_base = q_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    kv_ptrs = (
        k_base
        + tl.cast(start_n, tl.int64) * stride_qkv_l
        + (tl.arange(0, BLOCK_N)[:, None] * stride_qkv_l + cols)
    )
    if ROPE == 0:
        k = _load_tile(kv_ptrs, offs_n, seq_len, mask_d, True, EVEN_D)
    else:
        cos_base = Cos + batch.to(tl.int64) * stride_cos_b + head.to(tl.int64) * stride_cos_h
        sin_base = Sin + batch.to(tl.int64) * stride_sin_b + head.to(tl.int64) * stride_sin_h
        k = _load_rotated(
            k_base,
            offs_n[:, None],
            offs_d[None, :],
            seq_len,
            head_dim,
            stride_qkv_l,
            stride_qkv_c,
            cos_base,
            sin_base,
            rope_start,
            stride_cos_l,
            stride_cos_d,
            stride_sin_l,
            stride_sin_d,
            ROPE,
            False,
        )
    v = _load_tile(
        kv_ptrs + tl.cast(model_dim, tl.int64) * stride_qkv_c, offs_n, seq_len, mask_d, True, EVEN_D
    )
    do_base = DOut + batch.to(tl.int64) * stride_do_b + (head * head_dim).to(tl.int64) * stride_do_c
    do_cols = offs_d[None, :] * stride_do_c
    row_stats = pid_bh.to(tl.int64) * seq_len
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    q_tile = offs_m[:, None] * stride_qkv_l + cols
    do_tile = offs_m[:, None] * stride_do_l + do_cols
    full_end = (seq_len // BLOCK_M) * BLOCK_M
    for start_m in range(0, full_end, BLOCK_M):
        q_rot, qt_rot = (
            _rotated_pair(
                q_base,
                start_m + offs_m,
                offs_d,
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
            )
            if ROPE != 0
            else (0, 0)
        )
        dk, dv = _attention_bwd_dkdv_query_block(
            dk,
            dv,
            k,
            v,
            q_rot,
            qt_rot,
            q_base + tl.cast(start_m, tl.int64) * stride_qkv_l + q_tile,
            do_base + tl.cast(start_m, tl.int64) * stride_do_l + do_tile,
            row_stats + start_m + offs_m,
            Delta,
            RowMax,
            RowInvSum,
            start_m,
            offs_m,
            offs_n,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            False,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
    if BLOCK_TAIL > 0:
        # K and V loaded again for the tail, volatile so that the compiler cannot merge the loads
        # with the first: given the same k and v, Triton makes the tail's dot-operand copies of them
        # at that first load and keeps them live across the loop beside the loop's own (spilling up
        # to 3.3 KB per thread: float32 at head dim 128).
        if EVEN_D:
            kv_mask = (offs_n < seq_len)[:, None]
        else:
            kv_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
        if ROPE == 0:
            k = tl.load(kv_ptrs, mask=kv_mask, other=0.0, volatile=True)
        else:
            k = _load_rotated(
                k_base,
                offs_n[:, None],
                offs_d[None, :],
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
                True,
            )
        v = tl.load(
            kv_ptrs + tl.cast(model_dim, tl.int64) * stride_qkv_c, mask=kv_mask, other=0.0, volatile=True
        )
        offs_t = tl.arange(0, BLOCK_TAIL)
        q_rot_tail, qt_rot_tail = (
            _rotated_pair(
                q_base,
                full_end + offs_t,
                offs_d,
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
            )
            if ROPE != 0
            else (0, 0)
        )
        dk, dv = _attention_bwd_dkdv_query_block(
            dk,
            dv,
            k,
            v,
            q_rot_tail,
            qt_rot_tail,
            q_base + tl.cast(full_end, tl.int64) * stride_qkv_l + (offs_t[:, None] * stride_qkv_l + cols),
            do_base + tl.cast(full_end, tl.int64) * stride_do_l + (offs_t[:, None] * stride_do_l + do_cols),
            row_stats + full_end + offs_t,
            Delta,
            RowMax,
            RowInvSum,
            full_end,
            offs_t,
            offs_n,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            True,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )

    out_ptrs = (
        DQKV
        + batch.to(tl.int64) * stride_dqkv_b
        + tl.cast(start_n, tl.int64) * stride_dqkv_l
        + head * head_dim
        + (tl.arange(0, BLOCK_N)[:, None] * stride_dqkv_l + offs_d[None, :])
    )
    if EVEN_D:
        out_mask = (offs_n < seq_len)[:, None]
    else:
        out_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
    if ROPE == 0:
        tl.store(out_ptrs + model_dim, (dk * scale).to(DQKV.dtype.element_ty), mask=out_mask)
    else:
        cos, sin = _rope_tables(
            cos_base,
            sin_base,
            offs_n[:, None],
            offs_d[None, :],
            seq_len,
            head_dim,
            rope_start,
            stride_cos_l,
            stride_cos_d,
            stride_sin_l,
            stride_sin_d,
            ROPE,
        )
        dk = _rope_grad(dk * scale, cos, sin, BLOCK_N, BLOCK_D)
        dk_ptrs = (
            DQKV
            + batch.to(tl.int64) * stride_dqkv_b
            + tl.cast(start_n, tl.int64) * stride_dqkv_l
            + head * head_dim
            + model_dim
            + (tl.arange(0, BLOCK_N)[:, None] * stride_dqkv_l + _rope_cols(offs_d, head_dim, ROPE)[None, :])
        )
        tl.store(dk_ptrs, dk.to(DQKV.dtype.element_ty), mask=out_mask)
    tl.store(out_ptrs + 2 * model_dim, dv.to(DQKV.dtype.element_ty), mask=out_mask)


# One key block of the dQ kernel's two passes: k and the recomputed (P, dP) of its query rows,
# masked on the key length only in the tail block (MASK_N). With ROPE, k is the rotated k' given as
# k_rot (keys, Dh) and kt_rot (Dh, keys), loaded by the caller.
@triton.jit
def _attention_bwd_dq_key_block(
    q,
    do,
    row_max,
    inv_sum,
    k_rot,
    kt_rot,
    k_ptrs,
    v_ptrs,
    start_n,
    offs_m,
    offs_n,
    mask_d,
    seq_len,
    pid_bh,
    seed,
    scale_log2,
    dropout_p,
    mask_base,
    stride_mask_m,
    stride_mask_n,
    inv_scale,
    mask_limit,
    MASK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    rows_n = start_n + offs_n
    if ROPE == 0:
        k = _load_tile(k_ptrs, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
    else:
        k = k_rot
    v = _load_tile(v_ptrs, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
    p, _, dp = _attention_bwd_p_dp(
        q,
        k,
        kt_rot,
        v,
        do,
        row_max,
        inv_sum,
        offs_m,
        rows_n,
        seq_len,
        pid_bh,
        seed,
        scale_log2,
        dropout_p,
        mask_base,
        stride_mask_m,
        stride_mask_n,
        inv_scale,
        mask_limit,
        MASK_N,
        DROPOUT,
        PRECISION,
        ROPE,
        MASK,
    )
    return k, p, dp


# dQ and delta, one program per (block of BLOCK_M query rows, batch * head), in two passes over the
# key blocks (it runs before the dK/dV kernel, which reads delta):
#   delta_i = sum_j P_ij dP_ij / sum_j P_ij           (stored; dividing by the recomputed row sum, 1 up
#                                                      to the rounding of 1 / l, keeps that rounding a
#                                                      relative error of dS instead of an absolute one)
#   dQ = scale * sum_j dS_ij k_j,  dS = P (dP - delta)
# (the derivative of S = scale Q K^T through the softmax with respect to Q). dS is recomputed in both
# kernels rather than shared through atomics: a deterministic result. Each pass runs the BLOCK_N
# key blocks inside the sequence without masks, then the one tail block of BLOCK_TAIL keys (when
# BLOCK_N does not divide L), the only one masked on the key length. With ROPE (see _rope_cols), q
# is rotated as loaded, each key block's K as (Dh, keys) for S (both passes) and as (keys, Dh) for dQ
# (the second), and dQ, the gradient of the rotated q', is taken back through the rotation:
# dq = dQ' cos - rot(dQ' sin). Shapes: qkv and dqkv (B, L, 3D), dO (B, L, D), row statistics and
# delta (B*H, L), rope tables as in the forward.
@triton.jit
def _attention_bwd_dq_kernel(
    QKV,
    DOut,
    RowMax,
    RowInvSum,
    Delta,
    Seed,
    DQKV,
    Cos,
    Sin,
    Mask,
    seq_len,
    num_heads,
    head_dim,
    model_dim,
    rope_start,
    stride_qkv_b,
    stride_qkv_l,
    stride_qkv_c,
    stride_do_b,
    stride_do_l,
    stride_do_c,
    stride_dqkv_b,
    stride_dqkv_l,
    stride_cos_b,
    stride_cos_h,
    stride_cos_l,
    stride_cos_d,
    stride_sin_b,
    stride_sin_h,
    stride_sin_l,
    stride_sin_d,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    scale,
    scale_log2,
    dropout_p,
    inv_scale,
    mask_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    MASK: tl.constexpr,
):
    scale, scale_log2, dropout_p = as_float32(scale), as_float32(scale_log2), as_float32(dropout_p)
    inv_scale, mask_limit = as_float32(inv_scale), as_float32(mask_limit)
    pid_m, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK_M)
    mask_base = Mask + batch.to(tl.int64) * stride_mask_b + head.to(tl.int64) * stride_mask_h
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_len
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    q_base = QKV + batch.to(tl.int64) * stride_qkv_b + (head * head_dim).to(tl.int64) * stride_qkv_c
    k_base = q_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    v_base = k_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    if ROPE == 0:
        q = _load_tile(
            q_base
            + tl.cast(start_m, tl.int64) * stride_qkv_l
            + (tl.arange(0, BLOCK_M)[:, None] * stride_qkv_l + cols),
            offs_m,
            seq_len,
            mask_d,
            True,
            EVEN_D,
        )
    else:
        cos_base = Cos + batch.to(tl.int64) * stride_cos_b + head.to(tl.int64) * stride_cos_h
        sin_base = Sin + batch.to(tl.int64) * stride_sin_b + head.to(tl.int64) * stride_sin_h
        q = _load_rotated(
            q_base,
            offs_m[:, None],
            offs_d[None, :],
            seq_len,
            head_dim,
            stride_qkv_l,
            stride_qkv_c,
            cos_base,
            sin_base,
            rope_start,
            stride_cos_l,
            stride_cos_d,
            stride_sin_l,
            stride_sin_d,
            ROPE,
            False,
        )
    do = _load_tile(
        DOut
        + batch.to(tl.int64) * stride_do_b
        + (head * head_dim).to(tl.int64) * stride_do_c
        + tl.cast(start_m, tl.int64) * stride_do_l
        + (tl.arange(0, BLOCK_M)[:, None] * stride_do_l + offs_d[None, :] * stride_do_c),
        offs_m,
        seq_len,
        mask_d,
        True,
        EVEN_D,
    )
    row_stats = pid_bh.to(tl.int64) * seq_len
    row_max = tl.load(RowMax + row_stats + offs_m, mask=mask_m, other=0.0)
    inv_sum = tl.load(RowInvSum + row_stats + offs_m, mask=mask_m, other=0.0)
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    offs_n = tl.arange(0, BLOCK_N)
    kv_tile = offs_n[:, None] * stride_qkv_l + cols
    full_end = (seq_len // BLOCK_N) * BLOCK_N

    weighted = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        row_offset = tl.cast(start_n, tl.int64) * stride_qkv_l
        kt_first = (
            _load_rotated(
                k_base,
                (start_n + offs_n)[None, :],
                offs_d[:, None],
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
                False,
            )
            if ROPE != 0
            else 0
        )
        _, p, dp = _attention_bwd_dq_key_block(
            q,
            do,
            row_max,
            inv_sum,
            0,
            kt_first,
            k_base + row_offset + kv_tile,
            v_base + row_offset + kv_tile,
            start_n,
            offs_m,
            offs_n,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            False,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
        weighted += tl.sum(p * dp, 1)
        row_sum += tl.sum(p, 1)
    if BLOCK_TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        tail_ptrs = tl.cast(full_end, tl.int64) * stride_qkv_l + (offs_t[:, None] * stride_qkv_l + cols)
        kt_first_tail = (
            _load_rotated(
                k_base,
                (full_end + offs_t)[None, :],
                offs_d[:, None],
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
                False,
            )
            if ROPE != 0
            else 0
        )
        _, p_tail, dp_tail = _attention_bwd_dq_key_block(
            q,
            do,
            row_max,
            inv_sum,
            0,
            kt_first_tail,
            k_base + tail_ptrs,
            v_base + tail_ptrs,
            full_end,
            offs_m,
            offs_t,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            True,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
        weighted += tl.sum(p_tail * dp_tail, 1)
        row_sum += tl.sum(p_tail, 1)
    delta = weighted / tl.where(mask_m & (row_sum != 0.0), row_sum, 1.0)  # 0 / 1 where every key is masked
    tl.store(Delta + row_stats + offs_m, delta, mask=mask_m)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        row_offset = tl.cast(start_n, tl.int64) * stride_qkv_l
        k_rot, kt_rot = (
            _rotated_pair(
                k_base,
                start_n + offs_n,
                offs_d,
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
            )
            if ROPE != 0
            else (0, 0)
        )
        k, p, dp = _attention_bwd_dq_key_block(
            q,
            do,
            row_max,
            inv_sum,
            k_rot,
            kt_rot,
            k_base + row_offset + kv_tile,
            v_base + row_offset + kv_tile,
            start_n,
            offs_m,
            offs_n,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            False,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
        dq += tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, input_precision=PRECISION)
    if BLOCK_TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        tail_ptrs = tl.cast(full_end, tl.int64) * stride_qkv_l + (offs_t[:, None] * stride_qkv_l + cols)
        k_rot_tail, kt_rot_tail = (
            _rotated_pair(
                k_base,
                full_end + offs_t,
                offs_d,
                seq_len,
                head_dim,
                stride_qkv_l,
                stride_qkv_c,
                cos_base,
                sin_base,
                rope_start,
                stride_cos_l,
                stride_cos_d,
                stride_sin_l,
                stride_sin_d,
                ROPE,
            )
            if ROPE != 0
            else (0, 0)
        )
        k_tail, p_tail, dp_tail = _attention_bwd_dq_key_block(
            q,
            do,
            row_max,
            inv_sum,
            k_rot_tail,
            kt_rot_tail,
            k_base + tail_ptrs,
            v_base + tail_ptrs,
            full_end,
            offs_m,
            offs_t,
            mask_d,
            seq_len,
            pid_bh,
            seed,
            scale_log2,
            dropout_p,
            mask_base,
            stride_mask_m,
            stride_mask_n,
            inv_scale,
            mask_limit,
            True,
            EVEN_D,
            DROPOUT,
            PRECISION,
            ROPE,
            MASK,
        )
        dq += tl.dot(
            (p_tail * (dp_tail - delta[:, None])).to(k_tail.dtype), k_tail, input_precision=PRECISION
        )

    if ROPE == 0:
        out_ptrs = (
            DQKV
            + batch.to(tl.int64) * stride_dqkv_b
            + tl.cast(start_m, tl.int64) * stride_dqkv_l
            + head * head_dim
            + (tl.arange(0, BLOCK_M)[:, None] * stride_dqkv_l + offs_d[None, :])
        )
        dq = dq * scale
    else:
        out_ptrs = (
            DQKV
            + batch.to(tl.int64) * stride_dqkv_b
            + tl.cast(start_m, tl.int64) * stride_dqkv_l
            + head * head_dim
            + (tl.arange(0, BLOCK_M)[:, None] * stride_dqkv_l + _rope_cols(offs_d, head_dim, ROPE)[None, :])
        )
        cos, sin = _rope_tables(
            cos_base,
            sin_base,
            offs_m[:, None],
            offs_d[None, :],
            seq_len,
            head_dim,
            rope_start,
            stride_cos_l,
            stride_cos_d,
            stride_sin_l,
            stride_sin_d,
            ROPE,
        )
        dq = _rope_grad(dq * scale, cos, sin, BLOCK_M, BLOCK_D)
    if EVEN_D:
        tl.store(out_ptrs, dq.to(DQKV.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(out_ptrs, dq.to(DQKV.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# Probabilities for return_probs: P_ij = 2^((s_ij - m_i) c) / l_i, recomputed from the saved row statistics,
# one program per (block of query rows, batch * head), written to (B, H, L, L).
@triton.jit
def _attention_probs_kernel(
    QKV,
    RowMax,
    RowInvSum,
    Probs,
    seq_len,
    num_heads,
    head_dim,
    model_dim,
    stride_qkv_b,
    stride_qkv_l,
    stride_qkv_c,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    scale_log2 = as_float32(scale_log2)
    pid_m, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_len
    mask_d = offs_d < head_dim
    base = QKV + batch.to(tl.int64) * stride_qkv_b
    cols = (head * head_dim + offs_d).to(tl.int64) * stride_qkv_c
    q = tl.load(
        base + offs_m[:, None].to(tl.int64) * stride_qkv_l + cols[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    row_max = tl.load(RowMax + pid_bh.to(tl.int64) * seq_len + offs_m, mask=mask_m, other=0.0)
    inv_sum = tl.load(RowInvSum + pid_bh.to(tl.int64) * seq_len + offs_m, mask=mask_m, other=0.0)
    probs_base = Probs + pid_bh.to(tl.int64) * seq_len * seq_len + offs_m[:, None].to(tl.int64) * seq_len
    for start_n in range(0, seq_len, BLOCK_N):
        rows_n = start_n + offs_n
        mask_n = rows_n < seq_len
        k = tl.load(
            base + rows_n[:, None].to(tl.int64) * stride_qkv_l + (cols + model_dim * stride_qkv_c)[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.exp2((s - row_max[:, None]) * scale_log2) * inv_sum[:, None]
        tl.store(
            probs_base + rows_n[None, :], p.to(Probs.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :]
        )


class AttentionTile(NamedTuple):
    """One launch configuration of an attention kernel: (query, key) blocks, warps, pipeline
    stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    __repr__ = plain_repr


def _tiles(*tiles: tuple) -> tuple[AttentionTile, ...]:
    return tuple(AttentionTile(*tile) for tile in tiles)


def _pairs(*pairs: tuple) -> tuple[tuple[AttentionTile, AttentionTile], ...]:
    return tuple((AttentionTile(*dq), AttentionTile(*dkdv)) for dq, dkdv in pairs)


# Launch configurations on a GPU, per (float32 or 16-bit, padded head dim): candidates that the
# user's GPU validates and times (``vit_kernels._tiles``), the first one being the default where
# nothing may be run (tracing, graph capture). Forward: tiles. Backward: (dQ tile, dK/dV tile) pairs,
# the dK/dV kernel (which keeps dK, dV, K and V tiles live across its loop) with narrower query
# blocks. float32 stays exact (ieee FMA, no tf32) and holds its tiles in registers without tensor
# cores: smaller tiles. The 16-bit lists hold 128-row, 8-warp forward tiles (two warpgroups of 64
# rows on sm_90) and backward pairs with 128-row dQ or 128-key dK/dV tiles. Every entry is compiled
# for sm_80 and sm_90 by `make check-gpu` (no spills) and run against float64 by the GPU tests
# (tests/test_tiles.py). The defaults are the fastest right ones an H100 measured, and the 16-bit
# head-dim-128 dK/dV tiles (32, 64, 8, 2) and (32, 64, 4, 2), which computed a wrong dK there, are
# left out (benchmarks/results/h100-2026-11-22.md).
ATTENTION_FWD_TILES = {
    (False, 64): _tiles(
        (64, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 4),
        (64, 64, 4, 2),
        (64, 64, 4, 4),
    ),
    (False, 128): _tiles(
        (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)
    ),
    (False, 256): _tiles((64, 32, 8, 1), (32, 32, 4, 1)),
    (True, 64): _tiles((32, 32, 4, 2), (64, 32, 8, 2)),
    (True, 128): _tiles((32, 32, 8, 1), (16, 32, 8, 1)),
    (True, 256): _tiles((16, 32, 4, 1)),
}
ATTENTION_BWD_TILES = {
    (False, 64): _pairs(
        ((64, 64, 4, 3), (64, 64, 4, 2)),
        ((64, 64, 4, 2), (32, 64, 4, 2)),
        ((64, 64, 4, 3), (32, 64, 4, 2)),
        ((32, 64, 4, 2), (64, 64, 4, 2)),
        ((64, 64, 4, 3), (64, 64, 4, 3)),
        ((128, 64, 8, 2), (64, 64, 4, 2)),
        ((64, 64, 4, 3), (64, 128, 8, 2)),
    ),
    (False, 128): _pairs(
        ((64, 32, 4, 2), (32, 32, 4, 1)), ((64, 32, 4, 2), (16, 32, 8, 1)), ((32, 32, 4, 2), (16, 32, 4, 1))
    ),
    (False, 256): _pairs(((32, 32, 8, 1), (16, 32, 8, 1))),
    (True, 64): _pairs(((32, 32, 4, 1), (16, 32, 4, 1))),
    (True, 128): _pairs(((16, 32, 4, 1), (16, 32, 8, 1))),
    (True, 256): _pairs(((16, 16, 4, 1), (16, 16, 8, 1))),
}
# A rotating call's kernels load per block two more q or k tiles (the partner columns) and the
# cos and sin tiles, each buffered once per pipeline stage: at 3 stages the 16-bit head-dim-64
# tiles pass sm_80's 163 KB of shared memory per block (`make check-gpu`), so they run at most 2;
# so does a masked call, whose kernels load a (BLOCK_M, BLOCK_N) mask tile per block beside them,
# and which takes only tiles of at most MASK_MAX_TILE elements: a float32 128 x 128 mask tile (64 KB
# per stage) takes the forward to 180 KB of shared memory at 2 stages, over sm_80's 163 KB.
EXTRA_LOADS_MAX_STAGES = 2
MASK_MAX_TILE = 64 * 128
INTERPRETER_TILE = 32  # fixed and small: the interpreter's cost is per tile op, not per flop
VALIDATION_BATCH = 4  # images of the call that candidate tiles are checked on (all are timed)
VALIDATION_BYTES = 1 << 30  # what the references' scores may take (long sequences check fewer images)
FWD_CHOOSER = TileChooser("attention forward")
BWD_CHOOSER = TileChooser("attention backward")


def tile_report() -> list[dict]:
    """Every attention tile choice made in this process: kernel, key (dtype, head dim, length,
    batch x heads bucket), the tile chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("forward", FWD_CHOOSER) + report_rows("backward", BWD_CHOOSER)


def _block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, next_power_of_2(head_dim))


def _tile_key(dtype: torch.dtype, head_dim: int) -> tuple[bool, int]:
    return dtype == torch.float32, max(64, _block_d(head_dim))


def _fit(tile: int, seq_len: int) -> int:
    """Tiles no longer than the sequence (at least 16 rows, the smallest tl.dot operand). A tile is
    a compile-time constant: under torch.compile with dynamic shapes ``seq_len`` is a SymInt, made
    concrete here (a guard on the length, which the kernel is specialised for anyway)."""
    return max(16, min(tile, next_power_of_2(int(seq_len))))


def _fitted(tile: AttentionTile, seq_len: int, extra_loads: bool = False) -> AttentionTile:
    """``tile`` with both blocks fitted to the sequence; for a rotating or masked call
    (``extra_loads``) at most EXTRA_LOADS_MAX_STAGES stages."""
    return AttentionTile(
        _fit(tile.block_m, seq_len),
        _fit(tile.block_n, seq_len),
        tile.warps,
        min(tile.stages, EXTRA_LOADS_MAX_STAGES) if extra_loads else tile.stages,
    )


def _unique(tiles) -> tuple:
    return tuple(dict.fromkeys(tiles))


def _mask_fits(tile: AttentionTile) -> bool:
    return tile.block_m * tile.block_n <= MASK_MAX_TILE


def fwd_candidates(
    dtype: torch.dtype, head_dim: int, seq_len: int, rope: bool = False, masked: bool = False
) -> tuple:
    """The forward tiles for this call on a GPU, fitted to the sequence (duplicates dropped); for a
    rotating or masked call at most EXTRA_LOADS_MAX_STAGES stages, for a masked one only tiles of at
    most MASK_MAX_TILE elements."""
    return _unique(
        _fitted(t, seq_len, rope or masked)
        for t in ATTENTION_FWD_TILES[_tile_key(dtype, head_dim)]
        if not masked or _mask_fits(t)
    )


def bwd_candidates(
    dtype: torch.dtype, head_dim: int, seq_len: int, rope: bool = False, masked: bool = False
) -> tuple:
    """The backward (dQ tile, dK/dV tile) pairs for this call on a GPU, fitted to the sequence (as
    ``fwd_candidates``)."""
    return _unique(
        (_fitted(dq, seq_len, rope or masked), _fitted(dkdv, seq_len, rope or masked))
        for dq, dkdv in ATTENTION_BWD_TILES[_tile_key(dtype, head_dim)]
        if not masked or (_mask_fits(dq) and _mask_fits(dkdv))
    )


def _tail_block(block: int, seq_len: int) -> int:
    """The kernels' BLOCK_TAIL: rows of the one masked block after the ``seq_len // block`` full
    blocks of a loop over the sequence, L mod ``block`` padded to a power of two (at least 16, the
    smallest tl.dot operand, and at most ``block``), or 0 where ``block`` divides L (no tail)."""
    rest = int(seq_len) % block
    return 0 if rest == 0 else max(16, next_power_of_2(rest))


def _interpreter_tile(seq_len: int) -> AttentionTile:
    block = _fit(INTERPRETER_TILE, seq_len)
    return AttentionTile(block, block, 1, 1)


def _row_blocks(block: int, seq_len: int, batch_heads: int) -> tuple[int]:
    """The flattened grid of ``_block_and_head``: (row blocks x batch * heads,)."""
    return (cdiv(seq_len, block) * batch_heads,)


def _shape(qkv: torch.Tensor, num_heads: int) -> tuple[int, int, int, int]:
    batch, seq_len, three_d = qkv.shape
    model_dim = three_d // 3
    return batch, seq_len, model_dim, model_dim // num_heads


def _chooser_key(
    qkv: torch.Tensor, num_heads: int, rope: Optional[tuple] = None, mask: Optional[torch.Tensor] = None
) -> tuple:
    """What a tile choice is kept for: device, dtype, head dim, length and the batch x heads bucket (the grid),
    as Python ints (under torch.compile with dynamic shapes the sizes are SymInts: made concrete), the
    rope layout of a rotating call and the kind of a masked call's mask (each its own kernel variant)."""
    batch, seq_len, _, head_dim = (int(size) for size in _shape(qkv, num_heads))
    key = (str(qkv.device), str(qkv.dtype), head_dim, seq_len, _signature.bucket(batch * num_heads))
    if rope is not None:
        key += (f"rope={rope[2]}",)
    return key if mask is None else key + (f"mask={MASK_KINDS[_mask_code(mask)]}",)


ROPE_CODES = {"interleaved": 1, "half": 2}  # the kernels' ROPE (0: no rotation)


def _rope(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], rope_layout: str) -> Optional[tuple]:
    """The launchers' rope argument: None, or (cos, sin, layout)."""
    return None if cos is None else (cos, sin, rope_layout)


def _rope_launch_args(qkv: torch.Tensor, num_heads: int, rope: Optional[tuple]) -> tuple[tuple, int]:
    """((Cos, Sin, rope_start, the 8 table strides), ROPE) for the kernels: the tables as (B, H, L_r, Dh)
    views (stride 0 where broadcast) and rope_start = L - L_r; without rope, qkv as placeholder
    pointers (never read) and ROPE = 0."""
    if rope is None:
        return (qkv, qkv, 0, (0,) * 8), 0
    cos, sin, layout = rope
    cos, sin = tables_4d(qkv, num_heads, cos, sin)
    return (cos, sin, int(qkv.shape[1]) - int(cos.shape[2]), (*cos.stride(), *sin.stride())), ROPE_CODES[
        layout
    ]


MASK_KINDS = {1: "additive", 2: "boolean"}  # the kernels' MASK (0: no mask)
FLOAT32_MAX = torch.finfo(torch.float32).max


def _mask_code(mask: torch.Tensor) -> int:
    return 2 if mask.dtype == torch.bool else 1


def _mask_launch_args(
    qkv: torch.Tensor, num_heads: int, mask: Optional[torch.Tensor], scale: float
) -> tuple[tuple, int]:
    """((Mask, its 4 strides, 1 / scale, limit), MASK) for the kernels: the mask as a (B, H, L, L)
    view (stride 0 where broadcast) and the clamp limit of its finite values (see ``_mask_term``);
    without a mask, qkv as a placeholder pointer (never read) and MASK = 0."""
    if mask is None:
        return (qkv, (0,) * 4, 1.0, FLOAT32_MAX), 0
    batch, seq_len = qkv.shape[0], qkv.shape[1]
    if mask.dtype == torch.float64:
        mask = finite_cast(mask, torch.float32)
    full = mask.expand(batch, num_heads, seq_len, seq_len)
    # FLT_MAX * scale, a little below it so that limit / scale rounds to at most FLT_MAX
    limit = FLOAT32_MAX * min(scale, 1.0) * (1 - 2**-20)
    return (full, full.stride(), 1.0 / scale, limit), _mask_code(mask)


def mask_for_sdpa(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An attention mask as SDPA takes it for queries of ``dtype``: boolean, or float32 or ``dtype``;
    another float dtype is cast to ``dtype`` by ``finite_cast``."""
    if mask is None or mask.dtype in (torch.bool, torch.float32, dtype):
        return mask
    return finite_cast(mask, dtype)


def finite_cast(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask in ``dtype``, its finite values clamped to that dtype's range first, so that
    finfo(float64).min stays a finite, uniform row (as in its own dtype) instead of -inf; infinities
    and NaN are kept."""
    largest = torch.finfo(dtype).max
    if largest >= torch.finfo(mask.dtype).max:  # a wider dtype holds every value
        return mask.to(dtype)
    return torch.where(mask.isinf(), mask, mask.clamp(-largest, largest)).to(dtype)


def mask_broadcasts(mask: torch.Tensor, batch: int, num_heads: int, length: int) -> bool:
    """Whether ``mask`` broadcasts to (B, H, L, L) = (batch, num_heads, length, length), SDPA's rule
    (1 to 4 dimensions, each 1 or the full size)."""
    target = (batch, num_heads, length, length)
    return 1 <= mask.dim() <= 4 and all(
        size in (1, want) for size, want in zip(reversed(mask.shape), reversed(target))
    )


def check_attention_mask(mask: object, qkv: torch.Tensor, num_heads: int) -> None:
    """Raises unless ``mask`` is None or a boolean or floating-point tensor on qkv's device that
    broadcasts to (B, H, L, L) (SDPA's rule)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be boolean (True = attend) or floating-point (added), got {mask.dtype}"
        )
    batch, length = qkv.shape[0], qkv.shape[1]
    if not mask_broadcasts(mask, batch, num_heads, length):
        raise ValueError(
            f"attn_mask must broadcast to (B, H, L, L) = {(batch, num_heads, length, length)}, got shape "
            f"{tuple(mask.shape)}"
        )
    if mask.device != qkv.device:
        raise ValueError(f"attn_mask is on {mask.device} but qkv is on {qkv.device}: move them to one device")


def _validation_images(qkv: torch.Tensor, num_heads: int) -> int:
    """How many images of the call candidates are checked on: up to VALIDATION_BATCH, fewer where the
    reference's materialised (H, L, L) scores would pass VALIDATION_BYTES (at least one)."""
    batch, seq_len = int(qkv.shape[0]), int(qkv.shape[1])
    per_image = 3 * num_heads * seq_len * seq_len * 8  # scores, probabilities and a gradient, float64
    return max(1, min(VALIDATION_BATCH, batch, VALIDATION_BYTES // per_image))


def _reference_attention(
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    grad_out: Optional[torch.Tensor],
    dtype: torch.dtype,
    rope: Optional[tuple] = None,
    mask: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """SDPA on the first ``_validation_images`` images of qkv computed in ``dtype``: [out] or, given
    grad_out, [dq, dk, dv] each (n, L, D); with rope (cos, sin, layout), of the rotated q and k. With
    an attention mask, the masked softmax written out (``masked_softmax``): rows whose every key is
    masked are 0 by that rule on every device, whatever SDPA's kernel for the device does with them."""
    n = _validation_images(qkv, num_heads)
    leaf = qkv[:n].detach().to(dtype).requires_grad_(grad_out is not None)
    q, k, v = split_qkv(leaf, num_heads)
    if rope is not None:
        cos, sin = (t[:n].detach() for t in tables_4d(qkv, num_heads, rope[0], rope[1]))
        q, k = apply_rope(q, cos, sin, rope[2]), apply_rope(k, cos, sin, rope[2])
    if mask is not None:
        batch, seq_len = qkv.shape[0], qkv.shape[1]
        mask = mask.expand(batch, num_heads, seq_len, seq_len)[:n].detach()
        out = explicit_attention(q, k, v, scale, 0.0, lambda scores: masked_softmax(scores, mask))[0]
    else:
        q, k, v = (sdpa_aligned(t) for t in (q, k, v))
        out = merge_heads(F.scaled_dot_product_attention(q, k, v, scale=scale))
    if grad_out is None:
        return [out.detach()]
    (grad,) = torch.autograd.grad(out, leaf, grad_out[:n].to(dtype))
    return list(grad.chunk(3, dim=-1))


def _check_against_pytorch(
    names: Sequence[str],
    parts_of: Callable[[Sequence[torch.Tensor]], list],
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    grad_out: Optional[torch.Tensor] = None,
    rope: Optional[tuple] = None,
    mask: Optional[torch.Tensor] = None,
) -> Callable:
    """A check for the TileChooser: each part of a candidate's outputs (on the validation images)
    within twice the error of PyTorch's own SDPA in the same dtype, against SDPA in float64 (float32
    inputs) or float32 (16-bit inputs), on q and k rotated by ``rope`` and with ``mask`` where given.
    The references are computed once, on first use."""
    wide = reference_dtype(qkv.dtype)
    references: list = []

    def check(outputs: Sequence[torch.Tensor]) -> Optional[str]:
        if not references:
            with torch.enable_grad():
                references.append(_reference_attention(qkv, num_heads, scale, grad_out, wide, rope, mask))
                references.append(
                    _reference_attention(qkv, num_heads, scale, grad_out, qkv.dtype, rope, mask)
                )
        return first_problem(
            [
                (name, actual, own, exact)
                for name, actual, exact, own in zip(names, parts_of(outputs), *references)
            ],
            FLOORS[qkv.dtype],
        )

    return check


if HAS_TRITON:

    def _launch_fwd(qkv, out, stats, seed, num_heads, scale, dropout_p, tile, rope=None, mask=None) -> None:
        batch, seq_len, model_dim, head_dim = _shape(qkv, num_heads)
        bm, bn, warps, stages = tile
        (cos, sin, rope_start, table_strides), code = _rope_launch_args(qkv, num_heads, rope)
        (mask, mask_strides, inv_scale, limit), mask_code = _mask_launch_args(qkv, num_heads, mask, scale)
        launch(
            _attention_fwd_kernel,
            _row_blocks(bm, seq_len, batch * num_heads),
            qkv,
            out,
            stats[0],
            stats[1],
            seed,
            cos,
            sin,
            mask,
            seq_len,
            num_heads,
            head_dim,
            model_dim,
            rope_start,
            qkv.stride(0),
            qkv.stride(1),
            qkv.stride(2),
            out.stride(0),
            out.stride(1),
            *table_strides,
            *mask_strides,
            scale * LOG2E,
            dropout_p,
            inv_scale,
            limit,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_TAIL=_tail_block(bn, seq_len),
            BLOCK_D=_block_d(head_dim),
            EVEN_D=head_dim == _block_d(head_dim),
            DROPOUT=dropout_p > 0,
            PRECISION=dot_precision(qkv.dtype),
            ROPE=code,
            MASK=mask_code,
            num_warps=warps,
            num_stages=stages,
        )

    def _fwd_outputs(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq_len, model_dim, _ = _shape(qkv, num_heads)
        out = torch.empty((batch, seq_len, model_dim), dtype=qkv.dtype, device=qkv.device)
        stats = torch.empty((2, batch * num_heads, seq_len), dtype=torch.float32, device=qkv.device)
        return out, stats

    def fwd_tile(qkv, num_heads, scale, seed, rope=None, mask=None) -> tuple:
        """The forward tile to launch: see ``_tiles.tile_to_launch`` (validated without dropout)."""
        _, seq_len, _, head_dim = _shape(qkv, num_heads)

        def trial():
            def run(tile):
                out, stats = _fwd_outputs(qkv, num_heads)
                _launch_fwd(qkv, out, stats, seed, num_heads, scale, 0.0, tile, rope, mask)
                return [out]

            n = _validation_images(qkv, num_heads)
            return run, _check_against_pytorch(
                ["out"], lambda outputs: [outputs[0][:n]], qkv, num_heads, scale, rope=rope, mask=mask
            )

        return tile_to_launch(
            FWD_CHOOSER,
            qkv.device,
            lambda: _chooser_key(qkv, num_heads, rope, mask),
            lambda: _interpreter_tile(seq_len),
            lambda: fwd_candidates(qkv.dtype, head_dim, seq_len, rope is not None, mask is not None),
            trial,
        )

    def _attention_fwd(
        qkv: torch.Tensor,
        num_heads: int,
        scale: float,
        dropout_p: float,
        seed: torch.Tensor,
        cos: Optional[torch.Tensor] = None,
        sin: Optional[torch.Tensor] = None,
        rope_layout: str = "interleaved",
        mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv (B, L, 3D) -> out (B, L, D), row statistics (2, B*H, L) float32: the row max of q . k
        and 1 / the row sum of the exponentials. With tables cos, sin (broadcastable to (B, H, L_r, Dh)),
        q and k rotated (``rope_layout``) inside the kernel; with a mask (boolean or additive,
        broadcastable to (B, H, L, L)), the scores masked as SDPA's."""
        rope = _rope(cos, sin, rope_layout)
        out, stats = _fwd_outputs(qkv, num_heads)
        _launch_fwd(
            qkv,
            out,
            stats,
            seed,
            num_heads,
            scale,
            dropout_p,
            fwd_tile(qkv, num_heads, scale, seed, rope, mask),
            rope,
            mask,
        )
        return out, stats

    torch.library.triton_op("vit_kernels::attention_fwd", mutates_args=())(_attention_fwd)

    def _launch_bwd(
        grad_out, qkv, stats, seed, num_heads, scale, dropout_p, tiles, rope=None, mask=None
    ) -> torch.Tensor:
        """The dQ kernel (first: it writes delta), then the dK/dV kernel -> dqkv (B, L, 3D)."""
        batch, seq_len, model_dim, head_dim = _shape(qkv, num_heads)
        delta = torch.empty_like(stats[0])
        dqkv = torch.empty((batch, seq_len, 3 * model_dim), dtype=qkv.dtype, device=qkv.device)
        (cos, sin, rope_start, table_strides), code = _rope_launch_args(qkv, num_heads, rope)
        (mask, mask_strides, inv_scale, limit), mask_code = _mask_launch_args(qkv, num_heads, mask, scale)
        args = (
            qkv,
            grad_out,
            stats[0],
            stats[1],
            delta,
            seed,
            dqkv,
            cos,
            sin,
            mask,
            seq_len,
            num_heads,
            head_dim,
            model_dim,
            rope_start,
            qkv.stride(0),
            qkv.stride(1),
            qkv.stride(2),
            grad_out.stride(0),
            grad_out.stride(1),
            grad_out.stride(2),
            dqkv.stride(0),
            dqkv.stride(1),
            *table_strides,
            *mask_strides,
            scale,
            scale * LOG2E,
            dropout_p,
            inv_scale,
            limit,
        )
        flags = dict(
            BLOCK_D=_block_d(head_dim),
            EVEN_D=head_dim == _block_d(head_dim),
            DROPOUT=dropout_p > 0,
            PRECISION=dot_precision(qkv.dtype),
            ROPE=code,
            MASK=mask_code,
        )
        (dq_m, dq_n, dq_warps, dq_stages), (kv_m, kv_n, kv_warps, kv_stages) = tiles
        # the tails: of the dQ kernel's loop over key blocks, of the dK/dV kernel's over query blocks
        launch(
            _attention_bwd_dq_kernel,
            _row_blocks(dq_m, seq_len, batch * num_heads),
            *args,
            **flags,
            BLOCK_M=dq_m,
            BLOCK_N=dq_n,
            BLOCK_TAIL=_tail_block(dq_n, seq_len),
            num_warps=dq_warps,
            num_stages=dq_stages,
        )
        launch(
            _attention_bwd_dkdv_kernel,
            _row_blocks(kv_n, seq_len, batch * num_heads),
            *args,
            **flags,
            BLOCK_M=kv_m,
            BLOCK_N=kv_n,
            BLOCK_TAIL=_tail_block(kv_m, seq_len),
            num_warps=kv_warps,
            num_stages=kv_stages,
        )
        return dqkv

    def bwd_tiles(grad_out, qkv, stats, seed, num_heads, scale, rope=None, mask=None) -> tuple:
        """The backward tile pair (dQ tile, dK/dV tile) to launch: see ``_tiles.tile_to_launch``."""
        _, seq_len, _, head_dim = _shape(qkv, num_heads)

        def trial():
            def run(tiles):
                return [_launch_bwd(grad_out, qkv, stats, seed, num_heads, scale, 0.0, tiles, rope, mask)]

            n = _validation_images(qkv, num_heads)
            return run, _check_against_pytorch(
                ["dq", "dk", "dv"],
                lambda outputs: list(outputs[0][:n].chunk(3, dim=-1)),
                qkv,
                num_heads,
                scale,
                grad_out,
                rope,
                mask,
            )

        return tile_to_launch(
            BWD_CHOOSER,
            qkv.device,
            lambda: _chooser_key(qkv, num_heads, rope, mask),
            lambda: (_interpreter_tile(seq_len),) * 2,
            lambda: bwd_candidates(qkv.dtype, head_dim, seq_len, rope is not None, mask is not None),
            trial,
        )

    def _attention_bwd(
        grad_out: torch.Tensor,
        qkv: torch.Tensor,
        stats: torch.Tensor,
        seed: torch.Tensor,
        num_heads: int,
        scale: float,
        dropout_p: float,
        cos: Optional[torch.Tensor] = None,
        sin: Optional[torch.Tensor] = None,
        rope_layout: str = "interleaved",
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """dO (B, L, D) -> dqkv (B, L, 3D), packed like qkv (with rope: the gradient of the unrotated
        q and k; the tables and the mask get none)."""
        rope = _rope(cos, sin, rope_layout)
        return _launch_bwd(
            grad_out,
            qkv,
            stats,
            seed,
            num_heads,
            scale,
            dropout_p,
            bwd_tiles(grad_out, qkv, stats, seed, num_heads, scale, rope, mask),
            rope,
            mask,
        )

    attention_bwd = direct(
        torch.library.triton_op("vit_kernels::attention_bwd", mutates_args=())(_attention_bwd), _attention_bwd
    )

    def _attention_probs(
        qkv: torch.Tensor, stats: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        """The softmax probabilities (B, H, L, L) from qkv and the forward's row statistics."""
        batch, seq_len, model_dim, head_dim = _shape(qkv, num_heads)
        if interpreted(qkv.device):
            bm, bn, warps, stages = _interpreter_tile(seq_len)
        else:  # one q tile against k tiles, as in dQ: the default pair's dQ tile
            bm, bn, warps, stages = bwd_candidates(qkv.dtype, head_dim, seq_len)[0][0]
        probs = torch.empty((batch, num_heads, seq_len, seq_len), dtype=qkv.dtype, device=qkv.device)
        launch(
            _attention_probs_kernel,
            _row_blocks(bm, seq_len, batch * num_heads),
            qkv,
            stats[0],
            stats[1],
            probs,
            seq_len,
            num_heads,
            head_dim,
            model_dim,
            qkv.stride(0),
            qkv.stride(1),
            qkv.stride(2),
            scale * LOG2E,
            BLOCK_D=_block_d(head_dim),
            PRECISION=dot_precision(qkv.dtype),
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=warps,
            num_stages=stages,
        )
        return probs

    torch.library.triton_op("vit_kernels::attention_probs", mutates_args=())(_attention_probs)

    def _fwd_setup_context(ctx, inputs, output):
        qkv, num_heads, scale, dropout_p, seed, *extra = inputs
        cos, sin, rope_layout, mask = (*extra, *(None, None, "interleaved", None)[len(extra) :])
        out, stats = output
        ctx.save_for_backward(qkv, stats, seed, cos, sin, mask)
        ctx.num_heads, ctx.scale, ctx.dropout_p = num_heads, scale, dropout_p
        ctx.num_inputs, ctx.rope_layout = len(inputs), rope_layout

    def _fwd_backward(ctx, grad_out, grad_stats):
        nones = (None,) * (ctx.num_inputs - 1)
        if grad_out is None:  # only the probabilities were used: their own backward gives d qkv
            return (None, *nones)
        qkv, stats, seed, cos, sin, mask = ctx.saved_tensors
        dqkv = attention_bwd(
            grad_out,
            qkv,
            stats,
            seed,
            ctx.num_heads,
            ctx.scale,
            ctx.dropout_p,
            cos,
            sin,
            ctx.rope_layout,
            mask,
        )
        return (dqkv, *nones)

    attention_fwd = differentiable(
        "vit_kernels::attention_fwd", _fwd_backward, _fwd_setup_context, _attention_fwd
    )

    def _probs_setup_context(ctx, inputs, output):
        qkv, stats, num_heads, scale = inputs
        ctx.save_for_backward(qkv, output)
        ctx.num_heads, ctx.scale = num_heads, scale

    def _probs_backward(ctx, grad_probs):
        # d(softmax): dS = P * (dP - rowsum(dP * P)); dq = scale dS k, dk = scale dS^T q. The
        # probabilities are materialised anyway, so this runs as plain tensor ops. stats get no
        # gradient: the formula above is the full derivative of softmax with respect to S.
        qkv, probs = ctx.saved_tensors
        q, k, _ = split_qkv(qkv, ctx.num_heads)
        p = probs.float()
        g = grad_probs.float()
        ds = p * (g - (g * p).sum(-1, keepdim=True)) * ctx.scale
        dq = merge_heads((ds @ k.float()).to(qkv.dtype))
        dk = merge_heads((ds.transpose(-2, -1) @ q.float()).to(qkv.dtype))
        return torch.cat([dq, dk, torch.zeros_like(dq)], dim=-1), None, None, None

    attention_probs = differentiable(
        "vit_kernels::attention_probs",
        _probs_backward,
        _probs_setup_context,
        _attention_probs,
        double_backward=True,
    )


def attention_triton(
    qkv: torch.Tensor,
    num_heads: int,
    scale: Optional[float],
    dropout_p: float,
    return_probs: bool,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    rope_layout: str = "interleaved",
    attn_mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The Triton implementation of ``vk.attention`` (arguments already validated). With rope or a
    mask, the probabilities asked for are computed by PyTorch's ops (``probs_by_torch``)."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    scale = head_dim**-0.5 if scale is None else scale
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=qkv.device)
    else:
        seed = torch.empty(1, dtype=torch.int64, device=qkv.device)
    if cos is None and attn_mask is None:
        out, stats = attention_fwd(qkv, num_heads, scale, dropout_p, seed)
    else:
        out, stats = attention_fwd(qkv, num_heads, scale, dropout_p, seed, cos, sin, rope_layout, attn_mask)
    if not return_probs:
        return out
    if cos is not None or attn_mask is not None:
        return out, probs_by_torch(qkv, num_heads, scale, cos, sin, rope_layout, attn_mask)
    return out, attention_probs(qkv, stats, num_heads, scale)


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, 3*D) -> q, k, v, each a (B, H, L, Dh) view (no copy)."""
    batch, length, three_d = qkv.shape
    head_dim = three_d // (3 * num_heads)
    q, k, v = qkv.unflatten(-1, (3, num_heads, head_dim)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


SDPA_ALIGNMENT_BYTES = 16
SDPA_ALIGNMENT_ELEMENTS = 16  # of an attention bias's rows: PyTorch pads a mask's key dimension to 16 too


def sdpa_misaligned(t: torch.Tensor) -> bool:
    """Whether SDPA's fused CUDA kernels would refuse the layout of ``t`` (B, H, L, Dh): they need
    the data pointer and the batch, head and row strides to be multiples of 16 bytes and unit
    stride along Dh, and raise ("query is not correctly aligned (strideM)") instead of falling back,
    e.g. for a qkv sliced out of a wider tensor."""
    size = t.element_size()
    return bool(
        t.stride(-1) != 1
        or t.data_ptr() % SDPA_ALIGNMENT_BYTES
        or any(
            (stride * size) % SDPA_ALIGNMENT_BYTES
            for dim, stride in enumerate(t.stride()[:-1])
            if t.shape[dim] > 1
        )
    )


def sdpa_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, L, Dh), or a fresh contiguous copy of it on CUDA where ``sdpa_misaligned``.
    CPU tensors, and tensors being traced (Inductor places SDPA's inputs itself), pass unchanged."""
    if t.device.type != "cuda" or torch.compiler.is_compiling() or not sdpa_misaligned(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def sdpa_aligned_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``mask`` (SDPA's: boolean, or additive, broadcastable to (B, H, L, L)) as SDPA's memory-efficient
    CUDA kernel reads it safely: a fresh additive bias (a boolean mask becomes 0 / -inf in ``dtype``,
    a float one keeps its dtype) whose rows start on 16-element boundaries, the key dimension padded
    and sliced back. That kernel reads the bias with vector loads, and masks of other layouts (a key
    length that is no multiple of 16, a bias cut from a wider one) are a known source of its
    misaligned-address faults, which kill the process's CUDA context. CPU tensors, and tensors being
    traced, pass unchanged."""
    if mask is None or mask.device.type != "cuda" or torch.compiler.is_compiling():
        return mask
    return padded_bias(mask, dtype)


def padded_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as a fresh additive bias with 16-element-aligned rows (see ``sdpa_aligned_mask``);
    differentiable in a float mask."""
    keys = mask.shape[-1]
    padded = -(-keys // SDPA_ALIGNMENT_ELEMENTS) * SDPA_ALIGNMENT_ELEMENTS
    bias_dtype = dtype if mask.dtype == torch.bool else mask.dtype
    bias = torch.zeros((*mask.shape[:-1], padded), dtype=bias_dtype, device=mask.device).narrow(-1, 0, keys)
    if mask.dtype == torch.bool:
        return bias.masked_fill_(~mask, float("-inf"))
    return bias.copy_(mask)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """(B, H, L, Dh) -> (B, L, H * Dh)."""
    batch, heads, length, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


def attention_ref(
    qkv: torch.Tensor,
    num_heads: int,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_probs: bool = False,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    rope_layout: str = "interleaved",
    attn_mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Reference attention: ``F.scaled_dot_product_attention``, or explicit softmax when the
    probabilities are asked for. ``probs`` (B, H, L, L) are the softmax before dropout. With tables
    cos, sin (broadcastable to (B, H, L_r, Dh)), q and k are rotated first (``rope.apply_rope``):
    differentiable in the tables too. ``attn_mask`` as SDPA's (a row with every key masked: P = 0)."""
    q, k, v = split_qkv(qkv, num_heads)
    if cos is not None:
        q, k = apply_rope(q, cos, sin, rope_layout), apply_rope(k, cos, sin, rope_layout)
    if not return_probs:
        q, k, v = (sdpa_aligned(t) for t in (q, k, v))
        mask = sdpa_aligned_mask(mask_for_sdpa(attn_mask, q.dtype), q.dtype)
        return merge_heads(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        )
    return explicit_attention(q, k, v, scale, dropout_p, lambda scores: masked_softmax(scores, attn_mask))


def masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(scores + mask) over the last dimension with SDPA's conventions: a boolean mask keeps
    the True keys, a float one is added (in the wider of the two dtypes: a float32 finfo.min stays
    finite beside 16-bit scores); a row whose every score is -inf gets P = 0 (no gradient).
    Returned in the dtype of ``scores``."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    if mask.dtype == torch.bool:
        masked = scores.masked_fill(~mask, float("-inf"))
    else:
        masked = scores + mask
    dead = (masked == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(masked.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0).to(scores.dtype)


def probs_by_torch(
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    rope_layout: str,
    mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """softmax(scale q' k'^T + mask) (B, H, L, L), q' and k' rotated where tables are given, by
    PyTorch's ops (differentiable)."""
    q, k, _ = split_qkv(qkv, num_heads)
    if cos is not None:
        q, k = apply_rope(q, cos, sin, rope_layout), apply_rope(k, cos, sin, rope_layout)
    return masked_softmax((q @ k.transpose(-2, -1)) * scale, mask)


def explicit_attention(q, k, v, scale, dropout_p, softmax):
    """q, k, v (B, H, L, Dh) -> (out (B, L, H*Dh), probs (B, H, L, L)) with the scores materialised:
    probs = softmax(q k^T * scale), out = dropout(probs) v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs = softmax((q @ k.transpose(-2, -1)) * scale)
    dropped = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    return merge_heads(dropped @ v), probs


def attention_extension(
    qkv,
    num_heads,
    scale=None,
    dropout_p=0.0,
    return_probs=False,
    cos=None,
    sin=None,
    rope_layout="interleaved",
    attn_mask=None,
):
    """``vk.attention`` for the extension backend, one C++ call (``vit_kernels::attention_explicit``):
    scores by GEMM, the ``vit_kernels::softmax`` kernel, then a GEMM with v. Materialises the
    (B, H, L, L) scores: meant for ``return_probs`` (attention maps), not for speed. 16-bit inputs
    are computed in float32, as fused attention kernels do: scores rounded to 16 bits lose whole
    units at large logits."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    out, probs = _ops.attention_explicit(
        qkv, num_heads, head_dim**-0.5 if scale is None else scale, dropout_p
    )
    return (out, probs) if return_probs else out


if _ext.LOADED:
    _ops = ExtensionOps("attention_explicit")


def _triton_limits(
    qkv,
    num_heads,
    scale=None,
    dropout_p=0.0,
    return_probs=False,
    cos=None,
    sin=None,
    rope_layout="interleaved",
    attn_mask=None,
) -> Optional[str]:
    """Head dim <= MAX_HEAD_DIM: a tile of q, k and v must fit in registers / shared memory. The
    kernels rotate q and k and add the mask but compute no gradient of the rope tables or the mask."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM} (a q/k/v tile would not fit on chip)"
    if cos is not None and torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "rope tables that require grad (the kernels compute no gradient of cos and sin; torch does)"
    if attn_mask is not None and torch.is_grad_enabled() and attn_mask.requires_grad:
        return "an attn_mask that requires grad (the kernels compute no gradient of the mask; torch does)"
    return None


def _extension_limits(
    qkv,
    num_heads,
    scale=None,
    dropout_p=0.0,
    return_probs=False,
    cos=None,
    sin=None,
    rope_layout="interleaved",
    attn_mask=None,
) -> Optional[str]:
    """The C++ attention has no rotary position embedding and no mask."""
    if cos is not None:
        return "rope (the C++ attention does not rotate q and k)"
    return None if attn_mask is None else "attn_mask (the C++ attention takes no mask)"


def _without_dropout(args: tuple) -> tuple:
    """The call made deterministic for validation: dropout off."""
    qkv, num_heads, scale, _, return_probs, *rope_and_mask = args
    return (qkv, num_heads, scale, 0.0, return_probs, *rope_and_mask)


# The implementations of vk.attention: backend -> function, support by device / dtype, shape limits.
EXTENSION_CUDA_REASON = (
    "the extension's attention materialises the (B, H, L, L) scores: 4-15x slower than SDPA on an H100 "
    "(benchmarks/results/h100-2026-11-22.md); use triton or torch on CUDA"
)


def _extension_supports(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """The extension's attention runs on the CPU only: on CUDA its unfused scores-softmax-GEMM path
    loses to SDPA by 4-15x (1.34 vs 0.09 ms forward, 3.20 vs 0.83 ms forward+backward at ViT-B/16,
    B=128, bf16, H100), so it is not offered there at all."""
    if device.type == "cuda":
        return EXTENSION_CUDA_REASON
    return _ext.supports(device, dtype)


backend.implementations(
    "attention",
    validation_args=_without_dropout,
    torch=backend.Impl(attention_ref),
    triton=backend.Impl(attention_triton, supports=backend.triton_supports_dot, limits=_triton_limits),
    extension=backend.Impl(attention_extension, supports=_extension_supports, limits=_extension_limits),
)
