"""Patch embedding: patchify + projection (+ class token + position embedding).

    X (N, C, H, W) -> patches (N, L, C*P*P), L = (H/P) * (W/P)
    E = patches @ W^T + b                     W in nn.Conv2d layout (D, C, P, P)
    T = [cls ; E] + pos                       (N, L [+1], D)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import backend


def patch_embed_ref(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    patch_size: int,
    cls_token: Optional[torch.Tensor] = None,
    pos_embed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Eager reference: conv (stride = kernel = P), flatten, transpose, cat, add."""
    tokens = F.conv2d(images, weight, bias, stride=patch_size).flatten(2).transpose(1, 2)
    if cls_token is not None:
        tokens = torch.cat([cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
    if pos_embed is not None:
        tokens = tokens + pos_embed
    return tokens


backend.register("patch_embed", "torch", patch_embed_ref)
