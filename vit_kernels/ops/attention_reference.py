"""The PyTorch side of ``vk.attention``: the reference implementation (SDPA, or the softmax
written out where the probabilities are asked for), attention masks in SDPA's conventions, the
workarounds SDPA's fused CUDA kernels need (aligned layouts and biases).

    q, k, v = split_qkv(qkv)                  each (B, H, L, Dh), D = H * Dh
    O = merge_heads(softmax(scale q k^T + mask) v)   (B, L, D)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from vit_kernels.ops.rope import apply_rope


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, 3*D) -> q, k, v, each a (B, H, L, Dh) view (no copy)."""
    q, k, v = qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


SDPA_ALIGNMENT_BYTES = 16
SDPA_ALIGNMENT_ELEMENTS = 16  # of an attention bias's rows: PyTorch pads a mask's key dimension to 16 too


def sdpa_misaligned(t: torch.Tensor) -> bool:
    """Whether SDPA's fused CUDA kernels would refuse the layout of ``t`` (B, H, L, Dh): they need
    the data pointer and the batch, head and row strides to be multiples of 16 bytes and unit
    stride along Dh, and raise ("query is not correctly aligned (strideM)") instead of falling back,
    e.g. for a qkv sliced out of a wider tensor."""
    strides, size = t.stride(), t.element_size()
    if strides[-1] != 1 or t.data_ptr() % SDPA_ALIGNMENT_BYTES:
        return True
    shape = t.shape
    for dim in range(len(strides) - 1):  # a loop, not a generator: this runs on every eager SDPA call
        if shape[dim] > 1 and (strides[dim] * size) % SDPA_ALIGNMENT_BYTES:
            return True
    return False


def sdpa_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, L, Dh), or a fresh contiguous copy of it on CUDA where ``sdpa_misaligned``.
    CPU tensors, and tensors being traced (Inductor places SDPA's inputs itself), pass unchanged."""
    if t.device.type != "cuda" or torch.compiler.is_compiling() or not sdpa_misaligned(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def sdpa_aligned_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``mask`` (SDPA's: boolean, or additive, broadcastable to (B, H, L, L)) as SDPA's memory-efficient
    CUDA kernel reads it safely: a fresh additive bias (a boolean mask becomes 0 / -inf in ``dtype``,
    a float one keeps its dtype) whose rows start on 16-element boundaries, the key dimension padded
    and sliced back. That kernel reads the bias with vector loads, and masks of other layouts (a key
    length that is no multiple of 16, a bias cut from a wider one) are a known source of its
    misaligned-address faults, which kill the process's CUDA context. CPU tensors, and tensors being
    traced, pass unchanged."""
    if mask is None or mask.device.type != "cuda" or torch.compiler.is_compiling():
        return mask
    return padded_bias(mask, dtype)


def padded_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as a fresh additive bias with 16-element-aligned rows (see ``sdpa_aligned_mask``);
    differentiable in a float mask."""
    keys = mask.shape[-1]
    padded = -(-keys // SDPA_ALIGNMENT_ELEMENTS) * SDPA_ALIGNMENT_ELEMENTS
    bias_dtype = dtype if mask.dtype == torch.bool else mask.dtype
    bias = torch.zeros((*mask.shape[:-1], padded), dtype=bias_dtype, device=mask.device).narrow(-1, 0, keys)
    if mask.dtype == torch.bool:
        return bias.masked_fill_(~mask, float("-inf"))
    return bias.copy_(mask)


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
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    rope_layout: str = "interleaved",
    attn_mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Reference attention: ``F.scaled_dot_product_attention``, or explicit softmax when the
    probabilities are asked for. ``probs`` (B, H, L, L) are the softmax before dropout. With tables
    cos, sin (broadcastable to (B, H, L_r, Dh)), q and k are rotated first (``rope.apply_rope``):
    differentiable in the tables too. ``attn_mask`` as SDPA's (a row with every key masked: P = 0)."""
    q, k, v = split_qkv(qkv, num_heads)
    if cos is not None:
        q, k = apply_rope(q, cos, sin, rope_layout), apply_rope(k, cos, sin, rope_layout)
    if not return_probs:
        q, k, v = sdpa_aligned(q), sdpa_aligned(k), sdpa_aligned(v)
        mask = sdpa_aligned_mask(mask_for_sdpa(attn_mask, q.dtype), q.dtype)
        return merge_heads(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        )
    return explicit_attention(q, k, v, scale, dropout_p, lambda scores: masked_softmax(scores, attn_mask))


def masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(scores + mask) over the last dimension with SDPA's conventions: a boolean mask keeps
    the True keys, a float one is added (in the wider of the two dtypes: a float32 finfo.min stays
    finite beside 16-bit scores); a row whose every score is -inf gets P = 0 (no gradient).
    Returned in the dtype of ``scores``."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    if mask.dtype == torch.bool:
        masked = scores.masked_fill(~mask, float("-inf"))
    else:
        masked = scores + mask
    dead = (masked == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(masked.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0).to(scores.dtype)


def probs_by_torch(
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    rope_layout: str,
    mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """softmax(scale q' k'^T + mask) (B, H, L, L), q' and k' rotated where tables are given, by
    PyTorch's ops (differentiable)."""
    q, k, _ = split_qkv(qkv, num_heads)
    if cos is not None:
        q, k = apply_rope(q, cos, sin, rope_layout), apply_rope(k, cos, sin, rope_layout)
    return masked_softmax((q @ k.transpose(-2, -1)) * scale, mask)


def explicit_attention(q, k, v, scale, dropout_p, softmax):
    """q, k, v (B, H, L, Dh) -> (out (B, L, H*Dh), probs (B, H, L, L)) with the scores materialised:
    probs = softmax(q k^T * scale), out = dropout(probs) v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs = softmax((q @ k.transpose(-2, -1)) * scale)
    dropped = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    return merge_heads(dropped @ v), probs


def mask_for_sdpa(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An attention mask as SDPA takes it for queries of ``dtype``: boolean, or float32 or ``dtype``;
    another float dtype is cast to ``dtype`` by ``finite_cast``."""
    if mask is None or mask.dtype in (torch.bool, torch.float32, dtype):
        return mask
    return finite_cast(mask, dtype)


def finite_cast(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask in ``dtype``, its finite values clamped to that dtype's range first, so that
    finfo(float64).min stays a finite, uniform row (as in its own dtype) instead of -inf; infinities
    and NaN are kept."""
    largest = torch.finfo(dtype).max
    if largest >= torch.finfo(mask.dtype).max:  # a wider dtype holds every value
        return mask.to(dtype)
    return torch.where(mask.isinf(), mask, mask.clamp(-largest, largest)).to(dtype)


def mask_broadcasts(mask: torch.Tensor, batch: int, num_heads: int, length: int) -> bool:
    """Whether ``mask`` broadcasts to (B, H, L, L) = (batch, num_heads, length, length), SDPA's rule
    (1 to 4 dimensions, each 1 or the full size)."""
    target = (batch, num_heads, length, length)
    return 1 <= mask.dim() <= 4 and all(
        size in (1, want) for size, want in zip(reversed(mask.shape), reversed(target))
    )


def check_attention_mask(mask: object, qkv: torch.Tensor, num_heads: int) -> None:
    """Raises unless ``mask`` is None or a boolean or floating-point tensor on qkv's device that
    broadcasts to (B, H, L, L) (SDPA's rule)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be boolean (True = attend) or floating-point (added), got {mask.dtype}"
        )
    batch, length = qkv.shape[0], qkv.shape[1]
    if not mask_broadcasts(mask, batch, num_heads, length):
        raise ValueError(
            f"attn_mask must broadcast to (B, H, L, L) = {(batch, num_heads, length, length)}, got shape "
            f"{tuple(mask.shape)}"
        )
    if mask.device != qkv.device:
        raise ValueError(f"attn_mask is on {mask.device} but qkv is on {qkv.device}: move them to one device")
