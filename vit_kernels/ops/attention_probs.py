"""The attention probabilities of ``vk.attention(..., return_probs=True)`` on the Triton backend:

    P = softmax(scale q k^T)        (B, H, L, L), q, k = split(qkv)
    dS = P * (dP - rowsum(dP * P));  dq = scale dS k,  dk = scale dS^T q,  dv = 0

recomputed by one kernel from the row statistics the flash forward saved (``ops.attention``); the
backward runs as tensor ops (the probabilities are materialised anyway).
"""

from __future__ import annotations

import torch

from vit_kernels._autograd import differentiable
from vit_kernels._triton import dot_precision, interpreted, launch
from vit_kernels.kernels.attention import LOG2E
from vit_kernels.kernels.attention_probs import _attention_probs_kernel
from vit_kernels.ops.attention_reference import merge_heads, split_qkv
from vit_kernels.ops.attention_tiles import bwd_candidates, interpreter_tile, padded_head_dim, row_blocks


def _attention_probs(qkv: torch.Tensor, stats: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """The softmax probabilities (B, H, L, L) from qkv and the forward's row statistics."""
    batch, seq_len, three_d = qkv.shape
    model_dim = three_d // 3
    head_dim = model_dim // num_heads
    if interpreted(qkv.device):
        bm, bn, warps, stages = interpreter_tile(seq_len)
    else:  # one q tile against k tiles, as in dQ: the default pair's dQ tile
        bm, bn, warps, stages = bwd_candidates(qkv.dtype, head_dim, seq_len)[0][0]
    probs = torch.empty((batch, num_heads, seq_len, seq_len), dtype=qkv.dtype, device=qkv.device)
    grid = row_blocks(bm, seq_len, batch * num_heads)
    tensors = (qkv, stats[0], stats[1], probs)
    sizes = (seq_len, num_heads, head_dim, model_dim, *qkv.stride(), scale * LOG2E)
    config = dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=padded_head_dim(head_dim),
        PRECISION=dot_precision(qkv.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    launch(_attention_probs_kernel, grid, *tensors, *sizes, **config)
    return probs


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
    _attention_probs,
    _probs_backward,
    _probs_setup_context,
    double_backward=True,
)
