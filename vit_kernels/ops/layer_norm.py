"""LayerNorm over the last dimension, with an optional fused residual add.

    s = x (+ r)
    y = (s - mean(s)) * rstd * w + b,   rstd = 1 / sqrt(var(s) + eps)
    returns y, or (y, s) when a residual is given (s is the new residual stream)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from vit_kernels import backend


def layer_norm_ref(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-6,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x (..., D), weight (D,), bias (D,), residual (..., D) -> y (..., D) [, s (..., D)]."""
    summed = x if residual is None else x + residual
    y = F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, summed)


backend.register("layer_norm", "torch", layer_norm_ref)
