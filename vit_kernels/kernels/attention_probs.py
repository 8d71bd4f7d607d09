"""The attention probabilities kernel (``return_probs``): P = softmax(scale q k^T) of one packed qkv,
from the flash forward's saved row statistics (launched by ``vit_kernels.ops.attention_probs``)."""

from __future__ import annotations

from vit_kernels._triton import as_float32, tl, triton
from vit_kernels.kernels.attention import _block_and_head


# Probabilities for return_probs: P_ij = 2^((s_ij - m_i) c) / l_i, recomputed from the saved row statistics,
# one program per (block of query rows, batch * head), written to (B, H, L, L).
@triton.jit
def _attention_probs_kernel(
    QKV, RowMax, RowInvSum, Probs, seq_len, num_heads, head_dim, model_dim, stride_qkv_b, stride_qkv_l,
    stride_qkv_c, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
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
