"""Attention's Triton kernels: the flash forward, the dK/dV and dQ backward kernels and their
per-block helpers (masks, dropout; RoPE's are ``vit_kernels.kernels.rope``'s) (launched by
``vit_kernels.ops.attention``; the probabilities kernel is ``vit_kernels.kernels.attention_probs``).

Each kernel takes its arguments flat (the launchers' order), grouped by line in its signature, and
gathers those that travel together into Triton tuples, built once per program:

- ``layout = (seq_len, head_dim, stride_l, stride_c)``: one head's (L, Dh) slab of a (B, L, 3D) qkv,
  whose q, k and v of head h start at columns h Dh, D + h Dh and 2D + h Dh;
- ``rope = (cos, sin, start, stride_cos_l, stride_cos_d, stride_sin_l, stride_sin_d)``: this head's
  rotary tables, table row 0 at sequence row ``start`` (0 when ROPE == 0);
- ``mask = (base, stride_m, stride_n, inv_scale, limit)``: this head's (L, L) attention mask;
- ``dropout = (seed, pid_bh, p, keep_scale)``, keep_scale = 1 / (1 - p).

Every block loop runs in two parts: the blocks inside the sequence, with no mask on their rows,
then (when the block does not divide L) one tail block of BLOCK_TAIL rows (L mod block padded to a
power of two, at least 16: 16 keys rather than 64 at L = 197), the only one masked on its rows.
"""

from __future__ import annotations

from vit_kernels._triton import as_float32, tl, triton
from vit_kernels.kernels.rope import load_rotated, rope_cols, rope_grad, rope_of, rope_tables, rotated_pair

LOG2E = 1.4426950408889634  # the kernels take the softmax scale as scale * log2(e): exp(x) = exp2(x log2 e)


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
def _dropout_keep(dropout, query, key, seq_len):
    seed, pid_bh, dropout_p, _ = dropout
    counter = (pid_bh.to(tl.int64) * seq_len + query) * seq_len + key
    return tl.rand(seed, counter) >= dropout_p


@triton.jit
def _dropout_of(Seed, pid_bh, dropout_p, DROPOUT: tl.constexpr):
    """The ``dropout`` tuple of this program (seed 0 and keep_scale 1 without dropout)."""
    seed = 0
    keep_scale = 1.0
    if DROPOUT:
        seed = tl.load(Seed)
        keep_scale = 1.0 / (1.0 - dropout_p)
    return seed, pid_bh, dropout_p, keep_scale


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


@triton.jit
def _store_tile(ptrs, tile, rows, seq_len, mask_d, EVEN_D: tl.constexpr):
    """Stores the float32 ``tile`` of rows ``rows`` in the dtype of ``ptrs``, inside the sequence and
    head dim only."""
    if EVEN_D:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=(rows < seq_len)[:, None])
    else:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=(rows < seq_len)[:, None] & mask_d[None, :])


@triton.jit
def _store_qk_grad(
    base, row_tile, g, rows, offs_d, mask_d, seq_len, head_dim, rope,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Stores the float32 gradient ``g`` (ROWS, BLOCK_D) of q or k (of the rotated q' or k' with
    ROPE, in tile column order: taken back through the rotation, ``rope_grad``) at
    ``base + row_tile`` + its qkv columns."""
    if ROPE == 0:
        ptrs = base + (row_tile + offs_d[None, :])
    else:
        cos, sin = rope_tables(rope, rows[:, None], offs_d[None, :], seq_len, head_dim, ROPE)
        g = rope_grad(g, cos, sin, ROWS, BLOCK_D)
        ptrs = base + (row_tile + rope_cols(offs_d, head_dim, ROPE)[None, :])
    _store_tile(ptrs, g, rows, seq_len, mask_d, EVEN_D)


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
def _mask_of(Mask, batch, head, strides, inv_scale, limit):
    """The ``mask`` tuple of (batch, head), from the mask's (b, h, m, n) strides."""
    stride_b, stride_h, stride_m, stride_n = strides
    return (
        Mask + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h,
        stride_m,
        stride_n,
        inv_scale,
        limit,
    )


@triton.jit
def _mask_term(mask, rows_m, rows_n, seq_len, MASK: tl.constexpr):
    """b / scale (float32) of the (query rows_m, key rows_n) tile of one head of one image."""
    mask_base, stride_mask_m, stride_mask_n, inv_scale, limit = mask
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
#   (with ROPE, q and k rotated: q' . k'_j, k' loaded and rotated as a (Dh, keys) tile)
#   m_new = max(m_i, max_j s_ij),  alpha = 2^((m_i - m_new) c),  p_ij = 2^((s_ij - m_new) c)
#   l_i <- alpha l_i + sum_j p_ij,  acc_i <- alpha acc_i + sum_j z_ij / (1 - p) p_ij v_j    -> (acc, l, m_new)
# ``kv_tile``: the int32 offsets of the block's (keys, Dh) tile from its first key's row.
@triton.jit
def _attention_fwd_key_block(
    acc, l_i, m_i, q, k_base, v_base, kv_tile, start_n, offs_n, offs_m, offs_d, mask_d, layout, scale_log2,
    dropout, mask, rope,
    MASK_N: tl.constexpr, EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    ROPE: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, _ = layout
    rows_n = start_n + offs_n
    row_offset = tl.cast(start_n, tl.int64) * stride_l
    if ROPE == 0:
        k = _load_tile(k_base + row_offset + kv_tile, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
        v = _load_tile(v_base + row_offset + kv_tile, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:
        kt = load_rotated(k_base, rows_n[None, :], offs_d[:, None], layout, rope, ROPE, False)
        v = _load_tile(v_base + row_offset + kv_tile, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
        s = tl.dot(q, kt, input_precision=PRECISION)
    if MASK_N:
        s = tl.where((rows_n < seq_len)[None, :], s, float("-inf"))
    if MASK != 0:
        s = s + _mask_term(mask, offs_m[:, None], rows_n[None, :], seq_len, MASK)
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
        _, _, _, keep_scale = dropout
        keep = _dropout_keep(dropout, offs_m[:, None], rows_n[None, :], seq_len)
        p = tl.where(keep, p * keep_scale, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


# The forward's pass over the key blocks of one query tile q (rows offs_m): the blocks inside the
# sequence, then the tail block, each by _attention_fwd_key_block -> (acc, l, m) of the online softmax.
@triton.jit
def _attention_fwd_keys(
    q, k_base, v_base, cols, offs_m, offs_d, mask_d, layout, scale_log2, dropout, mask, rope,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, _ = layout
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_tile = offs_n[:, None] * stride_l + cols
    full_end = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attention_fwd_key_block(
            acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base, kv_tile=kv_tile, start_n=start_n,
            offs_n=offs_n, offs_m=offs_m, offs_d=offs_d, mask_d=mask_d, layout=layout, scale_log2=scale_log2,
            dropout=dropout, mask=mask, rope=rope, MASK_N=False, EVEN_D=EVEN_D, DROPOUT=DROPOUT,
            PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
        )  # fmt: skip
    if BLOCK_TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        acc, l_i, m_i = _attention_fwd_key_block(
            acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
            kv_tile=offs_t[:, None] * stride_l + cols, start_n=full_end, offs_n=offs_t, offs_m=offs_m,
            offs_d=offs_d, mask_d=mask_d, layout=layout, scale_log2=scale_log2, dropout=dropout, mask=mask,
            rope=rope, MASK_N=True, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE,
            MASK=MASK,
        )  # fmt: skip
    return acc, l_i, m_i


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
# q is loaded once; rows past the sequence are masked on their loads and stores only (their q reads
# 0). With ROPE, q and each k block are rotated as loaded (see rope_cols), k as a (Dh, keys) tile.
# Shapes: qkv (B, L, 3D), out (B, L, D), row statistics (B*H, L); with ROPE the tables Cos, Sin
# (B, H, L_r, Dh) by strides (0 where broadcast), rope_start = L - L_r.
@triton.jit
def _attention_fwd_kernel(
    QKV, Out, RowMax, RowInvSum, Seed, Cos, Sin, Mask,
    seq_len, num_heads, head_dim, model_dim, rope_start,
    stride_qkv_b, stride_qkv_l, stride_qkv_c,
    stride_out_b, stride_out_l,
    stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d,
    stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    scale_log2, dropout_p, inv_scale, mask_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    scale_log2, dropout_p = as_float32(scale_log2), as_float32(dropout_p)
    inv_scale, mask_limit = as_float32(inv_scale), as_float32(mask_limit)
    pid_m, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK_M)
    layout = (seq_len, head_dim, stride_qkv_l, stride_qkv_c)
    mask = _mask_of(
        Mask, batch, head, (stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n), inv_scale, mask_limit
    )
    cos_strides = (stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d)
    sin_strides = (stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d)
    rope = rope_of(Cos, Sin, batch, head, rope_start, cos_strides, sin_strides, ROPE)
    dropout = _dropout_of(Seed, pid_bh, dropout_p, DROPOUT)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    q_base = QKV + batch.to(tl.int64) * stride_qkv_b + (head * head_dim).to(tl.int64) * stride_qkv_c
    k_base = q_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    v_base = k_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    if ROPE == 0:
        q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qkv_l + cols
        q = _load_tile(
            q_base + tl.cast(start_m, tl.int64) * stride_qkv_l + q_tile, offs_m, seq_len, mask_d, True, EVEN_D
        )
    else:
        q = load_rotated(q_base, offs_m[:, None], offs_d[None, :], layout, rope, ROPE, False)
    acc, l_i, m_i = _attention_fwd_keys(
        q=q, k_base=k_base, v_base=v_base, cols=cols, offs_m=offs_m, offs_d=offs_d, mask_d=mask_d,
        layout=layout, scale_log2=scale_log2, dropout=dropout, mask=mask, rope=rope, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_TAIL=BLOCK_TAIL, BLOCK_D=BLOCK_D, EVEN_D=EVEN_D, DROPOUT=DROPOUT,
        PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
    )  # fmt: skip
    if MASK == 0:
        inv_sum = 1.0 / l_i
    else:  # a row with every key masked: P = 0 (l = 0, m = -inf saved as 0)
        inv_sum = tl.where(l_i == 0.0, 0.0, 1.0 / l_i)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    out_ptrs = (
        Out
        + batch.to(tl.int64) * stride_out_b
        + tl.cast(start_m, tl.int64) * stride_out_l
        + head * head_dim
        + (tl.arange(0, BLOCK_M)[:, None] * stride_out_l + offs_d[None, :])
    )
    _store_tile(out_ptrs, acc * inv_sum[:, None], offs_m, seq_len, mask_d, EVEN_D)
    mask_m = offs_m < seq_len
    tl.store(RowMax + pid_bh.to(tl.int64) * seq_len + offs_m, m_i, mask=mask_m)
    tl.store(RowInvSum + pid_bh.to(tl.int64) * seq_len + offs_m, inv_sum, mask=mask_m)


# The dQ kernel's per-tile recomputation, for query rows rows_m and key rows rows_n of one
# (batch, head) (the dK/dV kernel computes the same tiles transposed, in its query block):
#   P = 2^((s - m) c) / l (0 outside the sequence),  P~ = z * P / (1 - p),  dP~ = dO V^T,
#   dP = z * dP~ / (1 - p)                                      -> (P, dP)
# Rows past the sequence load q, dO, m and 1 / l as 0: the dQ kernel discards their rows at its
# store. Keys past the sequence are masked where MASK_N (the dQ kernel's tail block).
# The row term of the softmax gradient, delta_i = sum_j P_ij dP_ij (= dO_i . O_i), is summed from
# these same P and dP rather than from the stored output, so that dS_ij = P_ij (dP_ij - delta_i)
# cancels exactly where the math does (one token; a saturated, one-hot softmax) instead of keeping
# the rounding difference between two ways of computing dO . v_j.
@triton.jit
def _attention_bwd_p_dp(
    q, k, kt, v, do, row_max, inv_sum, rows_m, rows_n, seq_len, scale_log2, dropout, mask,
    MASK_N: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    if ROPE == 0:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:  # q and k rotated, k' as the (Dh, keys) tile kt (see rope_cols)
        s = tl.dot(q, kt, input_precision=PRECISION)
    if MASK != 0:
        s = s + _mask_term(mask, rows_m[:, None], rows_n[None, :], seq_len, MASK)
    p = tl.exp2((s - row_max[:, None]) * scale_log2) * inv_sum[:, None]
    if MASK_N:
        p = tl.where((rows_n < seq_len)[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        _, _, _, keep_scale = dropout
        keep = _dropout_keep(dropout, rows_m[:, None], rows_n[None, :], seq_len)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    return p, dp


# One query block of the dK/dV kernel: query rows i = start_m + offs_m against the program's key
# rows j (its k and v tiles), in (key, query) tiles of BLOCK_N x BLOCK_M (the kernel's formulas):
#   S^T = k q^T,  P^T = 2^((S^T - m) c) / l,  dP~^T = v dO^T,  dV += P~^T dO,  dK += dS^T q   -> (dK, dV)
# P~^T and dS^T enter their products as computed, as left operands; the only transposes are of the
# q and dO tiles as loaded (as the forward's of k); with ROPE, q' is loaded rotated twice, as
# (queries, Dh) and as (Dh, queries). A transposed computed tile feeding tl.dot (tl.trans(P~), out
# of the accumulator's MMA layout) is what Triton miscompiles on Hopper (triton-lang/triton#6124:
# a wrong dK on an H100); the compile gate (`make check-gpu`) fails any variant whose TTGIR has one.
# Loads are masked on the rows only in the tail block (MASK_M), where query rows past the sequence
# (columns here) get P~ = dS = 0: they load q, dO, m and 1 / l as 0, but a non-finite key gives them
# S = 0 * inf = NaN, which would reach every dK and dV row. Keys past the sequence are not masked:
# the kernel discards their rows of dK and dV at its store, which are all they reach.
# ``q_tile``, ``do_tile``: the int32 offsets of the block's q and dO tiles from its first row.
@triton.jit
def _attention_bwd_dkdv_query_block(
    dk, dv, k, v, q_base, do_base, q_tile, do_tile, stats, start_m, offs_m, offs_n, offs_d, mask_d, layout,
    stride_do_l, scale_log2, dropout, mask, rope,
    MASK_M: tl.constexpr, EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    ROPE: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, _ = layout
    RowMax, RowInvSum, Delta, row_stats = stats
    rows_m = start_m + offs_m
    q_rot, qt_rot = rotated_pair(q_base, rows_m, offs_d, layout, rope, ROPE)
    if ROPE == 0:
        q = _load_tile(
            q_base + tl.cast(start_m, tl.int64) * stride_l + q_tile, rows_m, seq_len, mask_d, MASK_M, EVEN_D
        )
    else:
        q = q_rot
    do_ptrs = do_base + tl.cast(start_m, tl.int64) * stride_do_l + do_tile
    do = _load_tile(do_ptrs, rows_m, seq_len, mask_d, MASK_M, EVEN_D)
    stats_ptrs = row_stats + start_m + offs_m
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
        s_t = s_t + _mask_term(mask, rows_m[None, :], offs_n[:, None], seq_len, MASK)
    p_t = tl.exp2((s_t - row_max[None, :]) * scale_log2) * inv_sum[None, :]
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    if DROPOUT:
        _, _, _, keep_scale = dropout
        keep_t = _dropout_keep(dropout, rows_m[None, :], offs_n[:, None], seq_len)
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


# The dK/dV kernel's pass over the query blocks for its key rows offs_n: the blocks inside the
# sequence, then the tail block, each by _attention_bwd_dkdv_query_block -> (dK, dV), unscaled.
# ``kv_ptrs``, ``kv_mask``: the program's K tile and its load mask (V's is at + model_dim columns);
# ``k_base``: its head's k (row 0).
@triton.jit
def _attention_bwd_dkdv_queries(
    k, v, k_base, kv_ptrs, kv_mask, q_base, do_base, cols, do_cols, stats, offs_n, offs_d, mask_d, layout,
    model_dim, stride_do_l, scale_log2, dropout, mask, rope,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, stride_c = layout
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    q_tile = offs_m[:, None] * stride_l + cols
    do_tile = offs_m[:, None] * stride_do_l + do_cols
    full_end = (seq_len // BLOCK_M) * BLOCK_M
    for start_m in range(0, full_end, BLOCK_M):
        dk, dv = _attention_bwd_dkdv_query_block(
            dk=dk, dv=dv, k=k, v=v, q_base=q_base, do_base=do_base, q_tile=q_tile, do_tile=do_tile,
            stats=stats, start_m=start_m, offs_m=offs_m, offs_n=offs_n, offs_d=offs_d, mask_d=mask_d,
            layout=layout, stride_do_l=stride_do_l, scale_log2=scale_log2, dropout=dropout, mask=mask,
            rope=rope, MASK_M=False, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE,
            MASK=MASK,
        )  # fmt: skip
    if BLOCK_TAIL > 0:
        # K and V loaded again for the tail, volatile so that the compiler cannot merge the loads
        # with the first: given the same k and v, Triton makes the tail's dot-operand copies of them
        # at that first load and keeps them live across the loop beside the loop's own (spilling up
        # to 3.3 KB per thread: float32 at head dim 128).
        if ROPE == 0:
            k = tl.load(kv_ptrs, mask=kv_mask, other=0.0, volatile=True)
        else:
            k = load_rotated(k_base, offs_n[:, None], offs_d[None, :], layout, rope, ROPE, True)
        v = tl.load(kv_ptrs + tl.cast(model_dim, tl.int64) * stride_c, mask=kv_mask, other=0.0, volatile=True)
        offs_t = tl.arange(0, BLOCK_TAIL)
        dk, dv = _attention_bwd_dkdv_query_block(
            dk=dk, dv=dv, k=k, v=v, q_base=q_base, do_base=do_base, q_tile=offs_t[:, None] * stride_l + cols,
            do_tile=offs_t[:, None] * stride_do_l + do_cols, stats=stats, start_m=full_end, offs_m=offs_t,
            offs_n=offs_n, offs_d=offs_d, mask_d=mask_d, layout=layout, stride_do_l=stride_do_l,
            scale_log2=scale_log2, dropout=dropout, mask=mask, rope=rope, MASK_M=True, EVEN_D=EVEN_D,
            DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
        )  # fmt: skip
    return dk, dv


# The backward kernels' common start, each program's: its block of BLOCK rows (``start``, its first)
# and (batch, head), the mask, RoPE tables and dropout of that head, and the head's q, k and dO bases
# (v follows k at model_dim columns). ``floats``: (dropout_p, inv_scale, mask_limit), taken as float32.
@triton.jit
def _attention_bwd_program(
    QKV, DOut, Seed, Cos, Sin, Mask, seq_len, num_heads, head_dim, model_dim, rope_start,
    qkv_strides, do_strides, cos_strides, sin_strides, mask_strides, floats,
    BLOCK: tl.constexpr, DROPOUT: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    stride_qkv_b, stride_qkv_c = qkv_strides
    stride_do_b, stride_do_c = do_strides
    dropout_p, inv_scale, mask_limit = as_float32(floats[0]), as_float32(floats[1]), as_float32(floats[2])
    pid, pid_bh, batch, head = _block_and_head(seq_len, num_heads, BLOCK)
    mask = _mask_of(Mask, batch, head, mask_strides, inv_scale, mask_limit)
    rope = rope_of(Cos, Sin, batch, head, rope_start, cos_strides, sin_strides, ROPE)
    dropout = _dropout_of(Seed, pid_bh, dropout_p, DROPOUT)
    q_base = QKV + batch.to(tl.int64) * stride_qkv_b + (head * head_dim).to(tl.int64) * stride_qkv_c
    k_base = q_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    do_base = DOut + batch.to(tl.int64) * stride_do_b + (head * head_dim).to(tl.int64) * stride_do_c
    return pid * BLOCK, pid_bh, batch, head, mask, rope, dropout, q_base, k_base, do_base


# dK and dV, one program per (block of BLOCK_N key rows, batch * head), looping over query blocks
# with every tile key-major, (key j, query i): the transposes of the forward's tiles.
#   S^T = K Q^T,  P^T_ji = 2^((S^T_ji - m_i) c) / l_i,  P~^T = z^T * P^T / (1 - p)
#   dV = sum_i P~^T_i dO_i                                (O = P~ V)
#   dP~^T = V dO^T,  dP^T = z^T * dP~^T / (1 - p),  dS^T_ji = P^T_ji (dP^T_ji - delta_i)
#   dK = scale * sum_i dS^T_i Q_i
# (the derivative of O = P~ V with respect to V, and of S = scale Q K^T through the softmax,
# dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik), with respect to K: dK = scale dS^T Q). Key-major, no
# computed tile is transposed (see the query block). K and V are loaded once (and again for the
# tail); the key rows past the sequence are masked on those loads and the stores only. With ROPE
# (see rope_cols) K is rotated as loaded, and dK, the gradient of the rotated k', is taken back
# through the rotation: dk = dK' cos - rot(dK' sin). Shapes: qkv and dqkv (B, L, 3D), dO (B, L, D),
# row statistics and delta (B*H, L), rope tables as in the forward.
@triton.jit
def _attention_bwd_dkdv_kernel(
    QKV, DOut, RowMax, RowInvSum, Delta, Seed, DQKV, Cos, Sin, Mask,
    seq_len, num_heads, head_dim, model_dim, rope_start,
    stride_qkv_b, stride_qkv_l, stride_qkv_c,
    stride_do_b, stride_do_l, stride_do_c,
    stride_dqkv_b, stride_dqkv_l,
    stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d,
    stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    scale, scale_log2, dropout_p, inv_scale, mask_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    scale, scale_log2 = as_float32(scale), as_float32(scale_log2)
    start_n, pid_bh, batch, head, mask, rope, dropout, q_base, k_base, do_base = _attention_bwd_program(
        QKV, DOut, Seed, Cos, Sin, Mask, seq_len, num_heads, head_dim=head_dim, model_dim=model_dim,
        rope_start=rope_start, qkv_strides=(stride_qkv_b, stride_qkv_c), do_strides=(stride_do_b, stride_do_c),
        cos_strides=(stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d),
        sin_strides=(stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d),
        mask_strides=(stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n),
        floats=(dropout_p, inv_scale, mask_limit), BLOCK=BLOCK_N, DROPOUT=DROPOUT, ROPE=ROPE,
    )  # fmt: skip
    layout = (seq_len, head_dim, stride_qkv_l, stride_qkv_c)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    kv_ptrs = (
        k_base
        + tl.cast(start_n, tl.int64) * stride_qkv_l
        + (tl.arange(0, BLOCK_N)[:, None] * stride_qkv_l + cols)
    )
    if ROPE == 0:
        k = _load_tile(kv_ptrs, offs_n, seq_len, mask_d, True, EVEN_D)
    else:
        k = load_rotated(k_base, offs_n[:, None], offs_d[None, :], layout, rope, ROPE, False)
    v = _load_tile(
        kv_ptrs + tl.cast(model_dim, tl.int64) * stride_qkv_c, offs_n, seq_len, mask_d, True, EVEN_D
    )
    if EVEN_D:
        kv_mask = (offs_n < seq_len)[:, None]
    else:
        kv_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
    dk, dv = _attention_bwd_dkdv_queries(
        k=k, v=v, k_base=k_base, kv_ptrs=kv_ptrs, kv_mask=kv_mask, q_base=q_base, do_base=do_base, cols=cols, do_cols=offs_d[None, :] * stride_do_c,
        stats=(RowMax, RowInvSum, Delta, pid_bh.to(tl.int64) * seq_len), offs_n=offs_n, offs_d=offs_d,
        mask_d=mask_d, layout=layout, model_dim=model_dim, stride_do_l=stride_do_l, scale_log2=scale_log2,
        dropout=dropout, mask=mask, rope=rope, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_TAIL=BLOCK_TAIL,
        BLOCK_D=BLOCK_D, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
    )  # fmt: skip
    out_base = (
        DQKV
        + batch.to(tl.int64) * stride_dqkv_b
        + tl.cast(start_n, tl.int64) * stride_dqkv_l
        + head * head_dim
    )
    row_tile = tl.arange(0, BLOCK_N)[:, None] * stride_dqkv_l
    _store_qk_grad(
        base=out_base + model_dim, row_tile=row_tile, g=dk * scale, rows=offs_n, offs_d=offs_d,
        mask_d=mask_d, seq_len=seq_len, head_dim=head_dim, rope=rope, ROWS=BLOCK_N, BLOCK_D=BLOCK_D,
        EVEN_D=EVEN_D, ROPE=ROPE,
    )  # fmt: skip
    _store_tile(out_base + 2 * model_dim + (row_tile + offs_d[None, :]), dv, offs_n, seq_len, mask_d, EVEN_D)


# One key block of the dQ kernel's two passes: k and the recomputed (P, dP) of its query rows,
# masked on the key length only in the tail block (MASK_N). With ROPE, k is the rotated k', loaded
# as (Dh, keys) for S and, in the second pass (FOR_DQ), also as (keys, Dh) for dQ.
# ``kv_tile``: the int32 offsets of the block's (keys, Dh) tile from its first key's row.
@triton.jit
def _attention_bwd_dq_key_block(
    q, do, row_max, inv_sum, k_base, v_base, kv_tile, start_n, offs_m, offs_n, offs_d, mask_d, layout,
    scale_log2, dropout, mask, rope,
    FOR_DQ: tl.constexpr, MASK_N: tl.constexpr, EVEN_D: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, ROPE: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, _ = layout
    rows_n = start_n + offs_n
    row_offset = tl.cast(start_n, tl.int64) * stride_l
    if ROPE == 0:
        k = _load_tile(k_base + row_offset + kv_tile, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
        kt = 0
    elif FOR_DQ:
        k, kt = rotated_pair(k_base, rows_n, offs_d, layout, rope, ROPE)
    else:
        k = 0
        kt = load_rotated(k_base, rows_n[None, :], offs_d[:, None], layout, rope, ROPE, False)
    v = _load_tile(v_base + row_offset + kv_tile, rows_n, seq_len, mask_d, MASK_N, EVEN_D)
    p, dp = _attention_bwd_p_dp(
        q=q, k=k, kt=kt, v=v, do=do, row_max=row_max, inv_sum=inv_sum, rows_m=offs_m, rows_n=rows_n,
        seq_len=seq_len, scale_log2=scale_log2, dropout=dropout, mask=mask, MASK_N=MASK_N, DROPOUT=DROPOUT,
        PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
    )  # fmt: skip
    return k, p, dp


# One pass of the dQ kernel over the key blocks of its query rows offs_m: the blocks inside the
# sequence, then the tail block, each by _attention_bwd_dq_key_block. The first pass (FOR_DQ false)
# returns (sum_j P_ij dP_ij, sum_j P_ij, 0) of each row; the second, given delta, (0, 0, dQ): the
# unscaled sum_j dS_ij k_j (of the rotated q' with ROPE). ``cols``: the int32 column offsets of a
# (rows, Dh) tile of qkv.
@triton.jit
def _attention_bwd_dq_keys(
    q, do, row_max, inv_sum, delta, k_base, v_base, cols, offs_m, offs_d, mask_d, layout, scale_log2, dropout,
    mask, rope,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    FOR_DQ: tl.constexpr, EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    ROPE: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    seq_len, _, stride_l, _ = layout
    weighted = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_tile = offs_n[:, None] * stride_l + cols
    full_end = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        k, p, dp = _attention_bwd_dq_key_block(
            q=q, do=do, row_max=row_max, inv_sum=inv_sum, k_base=k_base, v_base=v_base, kv_tile=kv_tile,
            start_n=start_n, offs_m=offs_m, offs_n=offs_n, offs_d=offs_d, mask_d=mask_d, layout=layout,
            scale_log2=scale_log2, dropout=dropout, mask=mask, rope=rope, FOR_DQ=FOR_DQ, MASK_N=False,
            EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
        )  # fmt: skip
        if FOR_DQ:
            dq += tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, input_precision=PRECISION)
        else:
            weighted += tl.sum(p * dp, 1)
            row_sum += tl.sum(p, 1)
    if BLOCK_TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        k, p, dp = _attention_bwd_dq_key_block(
            q=q, do=do, row_max=row_max, inv_sum=inv_sum, k_base=k_base, v_base=v_base,
            kv_tile=offs_t[:, None] * stride_l + cols, start_n=full_end, offs_m=offs_m, offs_n=offs_t,
            offs_d=offs_d, mask_d=mask_d, layout=layout, scale_log2=scale_log2, dropout=dropout, mask=mask,
            rope=rope, FOR_DQ=FOR_DQ, MASK_N=True, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION,
            ROPE=ROPE, MASK=MASK,
        )  # fmt: skip
        if FOR_DQ:
            dq += tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, input_precision=PRECISION)
        else:
            weighted += tl.sum(p * dp, 1)
            row_sum += tl.sum(p, 1)
    return weighted, row_sum, dq


# dQ and delta, one program per (block of BLOCK_M query rows, batch * head), in two passes over the
# key blocks (it runs before the dK/dV kernel, which reads delta):
#   delta_i = sum_j P_ij dP_ij / sum_j P_ij           (stored; dividing by the recomputed row sum, 1 up
#                                                      to the rounding of 1 / l, keeps that rounding a
#                                                      relative error of dS instead of an absolute one)
#   dQ = scale * sum_j dS_ij k_j,  dS = P (dP - delta)
# (the derivative of S = scale Q K^T through the softmax with respect to Q). dS is recomputed in both
# kernels rather than shared through atomics: a deterministic result. With ROPE (see rope_cols), q
# is rotated as loaded, each key block's K as (Dh, keys) for S (both passes) and as (keys, Dh) for dQ
# (the second), and dQ, the gradient of the rotated q', is taken back through the rotation:
# dq = dQ' cos - rot(dQ' sin). Shapes: qkv and dqkv (B, L, 3D), dO (B, L, D), row statistics and
# delta (B*H, L), rope tables as in the forward.
@triton.jit
def _attention_bwd_dq_kernel(
    QKV, DOut, RowMax, RowInvSum, Delta, Seed, DQKV, Cos, Sin, Mask,
    seq_len, num_heads, head_dim, model_dim, rope_start,
    stride_qkv_b, stride_qkv_l, stride_qkv_c,
    stride_do_b, stride_do_l, stride_do_c,
    stride_dqkv_b, stride_dqkv_l,
    stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d,
    stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    scale, scale_log2, dropout_p, inv_scale, mask_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr,
    MASK: tl.constexpr,
):  # fmt: skip
    scale, scale_log2 = as_float32(scale), as_float32(scale_log2)
    start_m, pid_bh, batch, head, mask, rope, dropout, q_base, k_base, do_base = _attention_bwd_program(
        QKV, DOut, Seed, Cos, Sin, Mask, seq_len, num_heads, head_dim=head_dim, model_dim=model_dim,
        rope_start=rope_start, qkv_strides=(stride_qkv_b, stride_qkv_c), do_strides=(stride_do_b, stride_do_c),
        cos_strides=(stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d),
        sin_strides=(stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d),
        mask_strides=(stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n),
        floats=(dropout_p, inv_scale, mask_limit), BLOCK=BLOCK_M, DROPOUT=DROPOUT, ROPE=ROPE,
    )  # fmt: skip
    layout = (seq_len, head_dim, stride_qkv_l, stride_qkv_c)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_len
    mask_d = offs_d < head_dim
    cols = offs_d[None, :] * stride_qkv_c
    v_base = k_base + tl.cast(model_dim, tl.int64) * stride_qkv_c
    if ROPE == 0:
        q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qkv_l + cols
        q = _load_tile(
            q_base + tl.cast(start_m, tl.int64) * stride_qkv_l + q_tile, offs_m, seq_len, mask_d, True, EVEN_D
        )
    else:
        q = load_rotated(q_base, offs_m[:, None], offs_d[None, :], layout, rope, ROPE, False)
    do_tile = tl.arange(0, BLOCK_M)[:, None] * stride_do_l + offs_d[None, :] * stride_do_c
    do = _load_tile(
        do_base + tl.cast(start_m, tl.int64) * stride_do_l + do_tile, offs_m, seq_len, mask_d, True, EVEN_D
    )
    row_stats = pid_bh.to(tl.int64) * seq_len
    row_max = tl.load(RowMax + row_stats + offs_m, mask=mask_m, other=0.0)
    inv_sum = tl.load(RowInvSum + row_stats + offs_m, mask=mask_m, other=0.0)
    weighted, row_sum, _ = _attention_bwd_dq_keys(
        q=q, do=do, row_max=row_max, inv_sum=inv_sum, delta=0.0, k_base=k_base, v_base=v_base, cols=cols,
        offs_m=offs_m, offs_d=offs_d, mask_d=mask_d, layout=layout, scale_log2=scale_log2, dropout=dropout,
        mask=mask, rope=rope, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_TAIL=BLOCK_TAIL, BLOCK_D=BLOCK_D,
        FOR_DQ=False, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
    )  # fmt: skip
    delta = weighted / tl.where(mask_m & (row_sum != 0.0), row_sum, 1.0)  # 0 / 1 where every key is masked
    tl.store(Delta + row_stats + offs_m, delta, mask=mask_m)
    _, _, dq = _attention_bwd_dq_keys(
        q=q, do=do, row_max=row_max, inv_sum=inv_sum, delta=delta, k_base=k_base, v_base=v_base, cols=cols,
        offs_m=offs_m, offs_d=offs_d, mask_d=mask_d, layout=layout, scale_log2=scale_log2, dropout=dropout,
        mask=mask, rope=rope, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_TAIL=BLOCK_TAIL, BLOCK_D=BLOCK_D,
        FOR_DQ=True, EVEN_D=EVEN_D, DROPOUT=DROPOUT, PRECISION=PRECISION, ROPE=ROPE, MASK=MASK,
    )  # fmt: skip
    _store_qk_grad(
        base=DQKV + batch.to(tl.int64) * stride_dqkv_b + tl.cast(start_m, tl.int64) * stride_dqkv_l + head * head_dim,
        row_tile=tl.arange(0, BLOCK_M)[:, None] * stride_dqkv_l, g=dq * scale, rows=offs_m, offs_d=offs_d,
        mask_d=mask_d, seq_len=seq_len, head_dim=head_dim, rope=rope, ROWS=BLOCK_M, BLOCK_D=BLOCK_D,
        EVEN_D=EVEN_D, ROPE=ROPE,
    )  # fmt: skip
