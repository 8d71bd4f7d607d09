"""Multi-head softmax attention from a packed ``qkv`` tensor.

    q, k, v = split(qkv)                      each (B, H, L, Dh), D = H * Dh
    S = scale * q @ k^T                       (B, H, L, L), scale = Dh ** -0.5 by default
    P = softmax(S, dim=-1)
    O = dropout(P) @ v  -> (B, L, D)          heads concatenated, ready for the output projection
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from vit_kernels import backend


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, 3*D) -> q, k, v, each a (B, H, L, Dh) view (no copy)."""
    batch, length, three_d = qkv.shape
    head_dim = three_d // (3 * num_heads)
    q, k, v = qkv.unflatten(-1, (3, num_heads, head_dim)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


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
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Reference attention: ``F.scaled_dot_product_attention``, or explicit softmax when the
    probabilities are asked for. ``probs`` (B, H, L, L) are the softmax before dropout."""
    q, k, v = split_qkv(qkv, num_heads)
    if not return_probs:
        return merge_heads(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)
    dropped = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    return merge_heads(dropped @ v), probs


backend.register("attention", "torch", attention_ref)
