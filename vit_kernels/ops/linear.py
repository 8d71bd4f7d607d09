"""Linear layers with fused epilogues.

    linear:      Y = X @ W^T + b (+ R)
    linear_gelu: Y = gelu(X @ W^T + b)
        gelu(z)      = z * Phi(z)                                   ("none", exact erf)
        gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   ("tanh")
    mlp:         Y = linear(linear_gelu(X, W1, b1), W2, b2, R)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import backend


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,), residual (..., N) -> (..., N)."""
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def linear_gelu_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    approximate: str = "none",
) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) -> gelu(x @ W^T + b) (..., N)."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def mlp_ref(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    fc2_bias: Optional[torch.Tensor],
    approximate: str = "none",
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (..., D), fc1_weight (Hd, D), fc2_weight (D_out, Hd) -> (..., D_out)."""
    hidden = linear_gelu_ref(x, fc1_weight, fc1_bias, approximate)
    return linear_ref(hidden, fc2_weight, fc2_bias, residual)


backend.register("linear", "torch", linear_ref)
backend.register("linear_gelu", "torch", linear_gelu_ref)
backend.register("mlp", "torch", mlp_ref)
