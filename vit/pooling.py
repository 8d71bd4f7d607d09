"""Attention pooling (MAP: multihead attention pooling), the head of SigLIP-style towers.

A learned latent query attends over the tokens, then a residual MLP:

    q = latent W_q^T + b_q                       (1, 1, D), expanded over the batch
    k, v = split(tokens W_kv^T + b_kv)           each (N, H, T, Dh)
    pooled = softmax(q k^T / sqrt(Dh)) v         (N, 1, D), heads concatenated
    pooled = pooled W_proj^T + b_proj
    pooled = pooled + mlp(norm(pooled))          -> (N, D), the latent's row

Parameter names are timm's ``AttentionPoolLatent`` (``latent``, ``q``, ``kv``, ``proj``, ``norm``,
``mlp.fc1``, ``mlp.fc2``), so timm SigLIP weights load unchanged. One query per image is no
workload for a fused self-attention kernel: the attention itself is PyTorch's SDPA; the projections,
the norm and the MLP (its residual add fused) run on the fused ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import vit_kernels.functional as vkf
from vit_kernels.nn import LayerNorm, Mlp


class AttentionPool(nn.Module):
    """tokens (N, T, D) -> pooled (N, D)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_hidden_dim: int, act: str = "gelu", eps: float = 1e-6
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        self.num_heads = num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp_hidden_dim, act=act)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm's latent initialisation: truncated normal with std dim ** -0.5."""
        nn.init.trunc_normal_(self.latent, std=self.latent.shape[-1] ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length, dim = tokens.shape
        heads = self.num_heads
        q = vkf.linear(self.latent, self.q.weight, self.q.bias).expand(batch, -1, -1)
        q = q.reshape(batch, 1, heads, dim // heads).transpose(1, 2)
        kv = vkf.linear(tokens, self.kv.weight, self.kv.bias)
        k, v = kv.reshape(batch, length, 2, heads, dim // heads).permute(2, 0, 3, 1, 4).unbind(0)
        pooled = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, 1, dim)
        pooled = vkf.linear(pooled, self.proj.weight, self.proj.bias)
        return self.mlp(self.norm(pooled), residual=pooled)[:, 0]
