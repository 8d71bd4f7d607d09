"""Rotary position embedding (RoPE) of attention's q and k: the torch reference rotation and the
validation of the tables, shared by the attention backends.

For a head-dim vector x and one token's tables cos, sin (each of width Dh):

    x' = x * cos + rot(x) * sin
    rot(x) = (-x1, x0, -x3, x2, ...)             layout "interleaved": pairs (2i, 2i+1) (timm's ``rot``, EVA02)
    rot(x) = cat(-x[Dh/2:], x[:Dh/2])            layout "half": pairs (i, i + Dh/2) (``rope_rotate_half``, DINOv3)

(timm's ``apply_rot_embed(x, sin, cos, half=...)``). rot is a signed swap within each pair, so
rot^T = -rot and the gradient of x' with respect to x is dx = g * cos - rot(g * sin). With tables of
L_r <= L rows, the last L_r tokens are rotated and the first L - L_r (class and register tokens) are
left as they are: timm's ``num_prefix_tokens`` convention.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from vit_kernels._checks import check_choice, check_float_tensor, shape_of

ROPE_LAYOUTS = ("interleaved", "half")


class Rope(NamedTuple):
    """A call's rotation: the tables cos, sin (each broadcastable to (B, H, L_r, Dh)) and the pair
    layout, one of ROPE_LAYOUTS."""

    cos: torch.Tensor
    sin: torch.Tensor
    layout: str


def rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    """rot(x) along the last dimension (even width): the signed pair swap of ``layout``."""
    if layout == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the rotation is computed in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x (B, H, L, Dh) with its last L_r tokens rotated, computed in float32 (float64 for float64 x)
    and returned in x's dtype; cos, sin broadcast to (B, H, L_r, Dh). Differentiable in x, cos, sin."""
    length, rotated = x.shape[-2], cos.shape[-2]
    wide = compute_dtype(x.dtype)
    tail = x[..., length - rotated :, :].to(wide)
    tail = (tail * cos.to(wide) + rotate(tail, layout) * sin.to(wide)).to(x.dtype)
    if rotated == length:
        return tail
    return torch.cat([x[..., : length - rotated, :], tail], dim=-2)


def check_rope(
    rope: object, rope_layout: object, qkv: torch.Tensor, num_heads: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Validates ``rope = (cos, sin)`` (or None) and ``rope_layout`` for a qkv (B, L, 3*D) of
    ``num_heads`` heads; returns (cos, sin), or (None, None) without rope. Each table: a floating-point
    tensor of 2 to 4 dimensions on qkv's device, both of one shape and dtype, broadcastable to
    (B, H, L_r, Dh) with 1 <= L_r <= L; Dh even."""
    check_choice("rope_layout", rope_layout, ROPE_LAYOUTS)
    if rope is None:
        return None, None
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError(f"rope must be None or a pair (cos, sin) of tensors, got {type(rope).__name__}")
    cos, sin = rope
    batch, length, three_d = qkv.shape
    head_dim = three_d // 3 // num_heads
    if head_dim % 2:
        raise ValueError(f"rope needs an even head dim (q and k rotate in pairs), got Dh = {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_float_tensor(f"rope {name}", table, layout="broadcastable to (B, H, L_r, Dh)")
        if not 2 <= table.dim() <= 4:
            raise ValueError(
                f"rope {name} must have 2 to 4 dimensions, broadcastable to (B, H, L_r, Dh) = "
                f"({batch}, {num_heads}, L_r, {head_dim}), got shape {shape_of(table)}"
            )
        if table.device != qkv.device:
            raise ValueError(
                f"rope {name} is on {table.device} but qkv is on {qkv.device}: move them to one device"
            )
    if shape_of(cos) != shape_of(sin):
        raise ValueError(
            f"rope cos and sin must have the same shape, got {shape_of(cos)} and {shape_of(sin)}"
        )
    if cos.dtype != sin.dtype:
        raise TypeError(f"rope cos has dtype {cos.dtype} but sin has {sin.dtype}: they must match")
    rows = cos.shape[-2]
    expected = (batch, num_heads, rows, head_dim)
    leading = (1,) * (4 - cos.dim()) + shape_of(cos)
    if leading[-1] != head_dim or any(n not in (1, want) for n, want in zip(leading[:2], expected[:2])):
        raise ValueError(
            f"rope cos and sin must broadcast to (B, H, L_r, Dh) = ({batch}, {num_heads}, L_r, "
            f"{head_dim}), got shape {shape_of(cos)}"
        )
    if not 1 <= rows <= length:
        raise ValueError(
            f"rope tables must rotate 1 <= L_r <= L = {length} tokens (the last L_r), got L_r = {rows} "
            f"from shape {shape_of(cos)}"
        )
    return cos, sin


def tables_4d(
    qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as (B, H, L_r, Dh) views (broadcast dimensions get stride 0: no copy)."""
    batch, _, three_d = qkv.shape
    shape = (batch, num_heads, cos.shape[-2], three_d // 3 // num_heads)
    return cos.expand(shape), sin.expand(shape)
