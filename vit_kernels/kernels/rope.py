"""Rotary position embedding on attention's tiles (the device side of ``vit_kernels.ops.rope``):
q and k rotated as they are loaded, and the gradient of a rotated tile taken back through the
rotation. Called by the kernels of ``vit_kernels.kernels.attention``.
"""

from __future__ import annotations

from vit_kernels._triton import tl, triton


# Rotary position embedding (ROPE = 1: layout "interleaved", 2: "half"; 0: none, the kernels as
# without it), applied to q and k as their tiles are loaded (vit_kernels/ops/rope.py):
#   x' = x cos + rot(x) sin,  rot(x) = (-x1, x0, -x3, x2, ...) on the pairs of the layout,
#   computed in float32; rows before rope_start = L - L_r (class, register tokens) are not rotated
#   (cos = 1, sin = 0), row i >= rope_start takes table row i - rope_start.
# Scores are invariant to one permutation of the head-dim columns of both q and k, so a rotated
# tile's column c holds the qkv column rope_cols(c): c for "interleaved", and for "half" the
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
def rope_cols(tcols, head_dim, ROPE: tl.constexpr):
    """The qkv column (within a head) that tile column ``tcols`` holds (see above)."""
    if ROPE == 2:
        return tl.where(tcols < head_dim, tcols // 2 + (tcols % 2) * (head_dim // 2), tcols)
    else:
        return tcols


@triton.jit
def rope_of(Cos, Sin, batch, head, rope_start, cos_strides, sin_strides, ROPE: tl.constexpr):
    """The ``rope`` tuple of (batch, head), from the tables' (b, h, l, d) strides (0 without ROPE)."""
    if ROPE == 0:
        rope = 0
    else:
        stride_cos_b, stride_cos_h, stride_cos_l, stride_cos_d = cos_strides
        stride_sin_b, stride_sin_h, stride_sin_l, stride_sin_d = sin_strides
        cos_base = Cos + batch.to(tl.int64) * stride_cos_b + head.to(tl.int64) * stride_cos_h
        sin_base = Sin + batch.to(tl.int64) * stride_sin_b + head.to(tl.int64) * stride_sin_h
        rope = (cos_base, sin_base, rope_start, stride_cos_l, stride_cos_d, stride_sin_l, stride_sin_d)
    return rope


@triton.jit
def rope_tables(rope, rows, tcols, seq_len, head_dim, ROPE: tl.constexpr):
    """float32 cos and sin of sequence rows ``rows`` and tile columns ``tcols``, index tensors that
    broadcast to the tile ((R, 1) and (1, D) for a row-major tile, (1, R) and (D, 1) for a
    transposed one); 1 and 0 (no rotation) for prefix rows and outside the sequence or head dim."""
    cos_base, sin_base, rope_start, stride_cos_l, stride_cos_d, stride_sin_l, stride_sin_d = rope
    cols = rope_cols(tcols, head_dim, ROPE)
    on = (rows >= rope_start) & (rows < seq_len) & (tcols < head_dim)
    table_rows = rows - rope_start
    cos = tl.load(cos_base + table_rows * stride_cos_l + cols * stride_cos_d, mask=on, other=1.0)
    sin = tl.load(sin_base + table_rows * stride_sin_l + cols * stride_sin_d, mask=on, other=0.0)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def load_rotated(base, rows, tcols, layout, rope, ROPE: tl.constexpr, VOLATILE: tl.constexpr):
    """x' = x cos + rot(x) sin of the q or k tile at ``base`` (one head of one image), in tile column
    order, for index tensors ``rows``, ``tcols`` as in ``rope_tables``; 0 outside the sequence and
    head dim. Returned in the dtype of qkv (a dot operand)."""
    seq_len, head_dim, stride_l, stride_c = layout
    mask = (rows < seq_len) & (tcols < head_dim)
    row_offsets = rows * stride_l
    x = tl.load(
        base + row_offsets + rope_cols(tcols, head_dim, ROPE) * stride_c,
        mask=mask,
        other=0.0,
        volatile=VOLATILE,
    )
    partner = tl.load(
        base + row_offsets + rope_cols(tcols ^ 1, head_dim, ROPE) * stride_c,
        mask=mask,
        other=0.0,
        volatile=VOLATILE,
    )
    cos, sin = rope_tables(rope, rows, tcols, seq_len, head_dim, ROPE)
    sign = tl.where(tcols % 2 == 0, -1.0, 1.0)
    return (x.to(tl.float32) * cos + partner.to(tl.float32) * sign * sin).to(x.dtype)


@triton.jit
def rotated_pair(base, rows, offs_d, layout, rope, ROPE: tl.constexpr):
    """The rotated tile of sequence rows ``rows`` as (rows, Dh) and as (Dh, rows), both from loads
    ((0, 0) without ROPE)."""
    if ROPE == 0:
        return 0, 0
    else:
        x = load_rotated(base, rows[:, None], offs_d[None, :], layout, rope, ROPE, False)
        xt = load_rotated(base, rows[None, :], offs_d[:, None], layout, rope, ROPE, False)
        return x, xt


@triton.jit
def rope_grad(g, cos, sin, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx = g cos - rot(g sin) of a float32 (ROWS, BLOCK_D) gradient tile in tile column order."""
    even, odd = tl.split(tl.reshape(g * sin, (ROWS, BLOCK_D // 2, 2)))
    return g * cos - tl.reshape(tl.join(-odd, even), (ROWS, BLOCK_D))
