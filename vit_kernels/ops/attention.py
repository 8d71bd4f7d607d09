"""Multi-head softmax attention from a packed ``qkv`` tensor.

    q, k, v = split(qkv)                      each (B, H, L, Dh), D = H * Dh
    S = scale * q @ k^T                       (B, H, L, L), scale = Dh ** -0.5 by default
    P = softmax(S, dim=-1)
    O = dropout(P) @ v  -> (B, L, D)          heads concatenated, ready for the output projection

The Triton kernels read q, k and v straight out of ``qkv`` by strides and write O in (B, L, D):
no permute, no copy. Forward is flash-style (online softmax, fp32 accumulation) and saves the
log-sum-exp per row; backward recomputes P from it (FlashAttention-2).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from vit_kernels import _ext, _signature, backend
from vit_kernels._autograd import differentiable, direct, tracing
from vit_kernels._ext import ExtensionOps
from vit_kernels._tiles import decided, keep, tile_to_launch
from vit_kernels._triton import (
    capability,
    dot_precision,
    launch,
    next_power_of_2,
)
from vit_kernels.kernels.attention import (
    LOG2E,
    _attention_bwd_dkdv_kernel,
    _attention_bwd_dq_kernel,
    _attention_fwd_kernel,
)
from vit_kernels.ops.attention_reference import (
    attention_ref,
    finite_cast,
    probs_by_torch,
)
from vit_kernels.ops.attention_tiles import (
    BWD_CHOOSER,
    FWD_CHOOSER,
    AttentionTile,
    bwd_candidates,
    fwd_candidates,
    interpreter_tile,
    padded_head_dim,
    row_blocks,
)
from vit_kernels.ops.attention_probs import attention_probs
from vit_kernels.ops.rope import Rope, tables_4d

MAX_HEAD_DIM = 256


def _tail_block(block: int, seq_len: int) -> int:
    """The kernels' BLOCK_TAIL: rows of the one masked block after the ``seq_len // block`` full
    blocks of a loop over the sequence, L mod ``block`` padded to a power of two (at least 16, the
    smallest tl.dot operand, and at most ``block``), or 0 where ``block`` divides L (no tail)."""
    rest = int(seq_len) % block
    return 0 if rest == 0 else max(16, next_power_of_2(rest))


def _shape(qkv: torch.Tensor, num_heads: int) -> tuple[int, int, int, int]:
    batch, seq_len, three_d = qkv.shape
    model_dim = three_d // 3
    return batch, seq_len, model_dim, model_dim // num_heads


def _chooser_key(
    qkv: torch.Tensor, num_heads: int, rope: Optional[Rope] = None, mask: Optional[torch.Tensor] = None
) -> tuple:
    """What a tile choice is kept for: device, dtype, head dim, length and the batch x heads bucket (the grid),
    as Python ints (under torch.compile with dynamic shapes the sizes are SymInts: made concrete), the
    rope layout of a rotating call and the kind of a masked call's mask (each its own kernel variant)."""
    batch, seq_len, _, head_dim = _shape(qkv, num_heads)
    key = (
        str(qkv.device),
        str(qkv.dtype),
        int(head_dim),
        int(seq_len),
        _signature.bucket(int(batch) * num_heads),
    )
    if rope is not None:
        key += (f"rope={rope.layout}",)
    return key if mask is None else key + (f"mask={MASK_KINDS[_mask_code(mask)]}",)


def _launch_config(
    tile: AttentionTile,
    over_keys: bool,
    qkv: torch.Tensor,
    num_heads: int,
    dropout_p: float,
    rope: Optional[Rope],
    mask: Optional[torch.Tensor],
) -> tuple[tuple[int], dict]:
    """(grid, keyword arguments) of one launch of an attention kernel with ``tile``: its programs
    walk query blocks (the forward, dQ) or, ``over_keys``, key blocks (dK/dV), each looping over the
    other kind (whose last block is the tail). A decided call finds it in its plan (``_plan_key``)."""
    batch, seq_len, _, head_dim = _shape(qkv, num_heads)
    bm, bn, warps, stages = tile
    rows, looped = (bn, bm) if over_keys else (bm, bn)
    block_d = padded_head_dim(head_dim)
    return row_blocks(rows, seq_len, batch * num_heads), dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_TAIL=_tail_block(looped, seq_len),
        BLOCK_D=block_d,
        EVEN_D=head_dim == block_d,
        DROPOUT=dropout_p > 0,
        PRECISION=dot_precision(qkv.dtype),
        ROPE=0 if rope is None else ROPE_CODES[rope.layout],
        MASK=0 if mask is None else _mask_code(mask),
        num_warps=warps,
        num_stages=stages,
    )


def _plan_key(
    qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float, rope: Optional[Rope], mask
) -> tuple:
    """Everything a call's tile choice and launch depend on besides its tensors' data: the plans of a
    decided call are kept under it (``_tiles.decided``)."""
    key = (qkv.shape, qkv.stride(), qkv.dtype, qkv.device, num_heads, scale, dropout_p)
    if rope is not None:
        key += (rope.layout, rope.cos.shape, rope.cos.stride(), rope.sin.shape, rope.sin.stride())
    return key if mask is None else key + (mask.dtype, mask.shape, mask.stride())


_FWD_PLANS: dict[tuple, tuple] = {}  # _plan_key -> _fwd_plan
_BWD_PLANS: dict[tuple, tuple] = {}  # _plan_key + dO's strides -> _bwd_plan


ROPE_CODES = {"interleaved": 1, "half": 2}  # the kernels' ROPE (0: no rotation)


def _launch_tensors(qkv: torch.Tensor, num_heads: int, rope: Optional[Rope], mask) -> tuple:
    """(Cos, Sin, Mask) for the kernels: the tables and the mask as (B, H, L_r, Dh) and (B, H, L, L)
    views (stride 0 where broadcast; a float64 mask cast to float32); qkv as the placeholder pointer
    (never read) of each one absent."""
    cos, sin = (qkv, qkv) if rope is None else tables_4d(qkv, num_heads, rope.cos, rope.sin)
    if mask is not None:
        if mask.dtype == torch.float64:
            mask = finite_cast(mask, torch.float32)
        batch, seq_len = qkv.shape[0], qkv.shape[1]
        return cos, sin, mask.expand(batch, num_heads, seq_len, seq_len)
    return cos, sin, qkv


def _launch_scalars(qkv, num_heads, scale, rope, mask) -> tuple[tuple, tuple, tuple]:
    """The kernels' integer and float arguments, in three runs: (L, H, Dh, D, rope_start = L - L_r,
    qkv's strides), (the 8 table strides, the 4 mask strides), (1 / scale, the clamp limit of the
    mask's finite values: see ``_mask_term``); zeros and placeholders where rope or the mask is absent."""
    _, seq_len, model_dim, head_dim = _shape(qkv, num_heads)
    cos, sin, full = _launch_tensors(qkv, num_heads, rope, mask)
    rope_start, table_strides = (
        (0, (0,) * 8) if rope is None else (seq_len - cos.shape[2], (*cos.stride(), *sin.stride()))
    )
    head = (seq_len, num_heads, head_dim, model_dim, rope_start, *qkv.stride())
    if mask is None:
        return head, (*table_strides, 0, 0, 0, 0), (1.0, FLOAT32_MAX)
    # FLT_MAX * scale, a little below it so that limit / scale rounds to at most FLT_MAX
    return head, (*table_strides, *full.stride()), (1.0 / scale, FLOAT32_MAX * min(scale, 1.0) * (1 - 2**-20))


MASK_KINDS = {1: "additive", 2: "boolean"}  # the kernels' MASK (0: no mask)
FLOAT32_MAX = torch.finfo(torch.float32).max


def _mask_code(mask: torch.Tensor) -> int:
    return 2 if mask.dtype == torch.bool else 1


class ForwardPlan(NamedTuple):
    """What the forward launch of a decided call needs besides its tensors (``_tiles.decided``)."""

    out_shape: tuple  # (B, L, D)
    stats_shape: tuple  # (2, B*H, L): the row max and 1 / the row sum
    grid: tuple
    args: tuple  # the kernel's arguments after the tensors (``_launch_scalars``)
    config: dict  # the constexprs, warps and stages (``_launch_config``)


class BackwardPlan(NamedTuple):
    """What the dQ and dK/dV launches of a decided call need besides their tensors."""

    dqkv_shape: tuple  # (B, L, 3D)
    dq_grid: tuple
    dq_config: dict
    dkdv_grid: tuple
    dkdv_config: dict
    args: tuple  # both kernels' arguments after the tensors


def _fwd_plan(tile, qkv, num_heads, scale, dropout_p, rope, mask) -> ForwardPlan:
    """The forward launch with ``tile``."""
    batch, seq_len, model_dim, _ = _shape(qkv, num_heads)
    head, strides, (inv_scale, limit) = _launch_scalars(qkv, num_heads, scale, rope, mask)
    grid, config = _launch_config(tile, False, qkv, num_heads, dropout_p, rope, mask)
    out_strides = (seq_len * model_dim, model_dim)  # of the new (B, L, D) out (L, D > 0: validated)
    args = (*head, *out_strides, *strides, scale * LOG2E, dropout_p, inv_scale, limit)
    return ForwardPlan((batch, seq_len, model_dim), (2, batch * num_heads, seq_len), grid, args, config)


def _launch_fwd(plan, qkv, seed, rope=None, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel launched by ``plan`` (``_fwd_plan``) -> out, row statistics."""
    device = qkv.device  # read once: a tensor's attribute is a PyTorch call on the host
    out = torch.empty(plan.out_shape, dtype=qkv.dtype, device=device)
    stats = torch.empty(plan.stats_shape, dtype=torch.float32, device=device)
    cos, sin, mask = _launch_tensors(qkv, plan.args[1], rope, mask)
    tensors = (qkv, out, stats[0], stats[1], seed, cos, sin, mask)
    launch(_attention_fwd_kernel, plan.grid, *tensors, *plan.args, **plan.config)
    return out, stats


def fwd_tile(qkv, num_heads, rope=None, mask=None) -> tuple:
    """The forward tile to launch: see ``_tiles.tile_to_launch``."""
    return tile_to_launch(
        FWD_CHOOSER,
        qkv.device,
        lambda: _chooser_key(qkv, num_heads, rope, mask),
        lambda: interpreter_tile(qkv.shape[1]),
        lambda: fwd_candidates(
            qkv.dtype, _shape(qkv, num_heads)[3], qkv.shape[1], rope is not None, mask is not None
        ),
    )


def _attention_fwd(
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    rope_layout: str = "interleaved",
    mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (B, L, 3D) -> out (B, L, D), row statistics (2, B*H, L) float32: the row max of q . k
    and 1 / the row sum of the exponentials. With tables cos, sin (broadcastable to (B, H, L_r, Dh)),
    q and k rotated (``rope_layout``) inside the kernel; with a mask (boolean or additive,
    broadcastable to (B, H, L, L)), the scores masked as SDPA's."""
    rope = None if cos is None else Rope(cos, sin, rope_layout)
    key = _plan_key(qkv, num_heads, scale, dropout_p, rope, mask)
    plan = decided(_FWD_PLANS, key)
    if plan is None:
        tile = fwd_tile(qkv, num_heads, rope, mask)
        made = _fwd_plan(tile, qkv, num_heads, scale, dropout_p, rope, mask)
        plan = keep(_FWD_PLANS, key, made)
    return _launch_fwd(plan, qkv, seed, rope, mask)


def _bwd_plan(tiles, grad_out, qkv, num_heads, scale, dropout_p, rope, mask) -> BackwardPlan:
    """The dQ and dK/dV launches with ``tiles`` (dQ tile, dK/dV tile)."""
    batch, seq_len, model_dim, _ = _shape(qkv, num_heads)
    head, strides, (inv_scale, limit) = _launch_scalars(qkv, num_heads, scale, rope, mask)
    dqkv_shape = (batch, seq_len, 3 * model_dim)
    args = (
        *head,
        *grad_out.stride(),
        seq_len * 3 * model_dim,  # the new (B, L, 3D) dqkv's strides
        3 * model_dim,
        *strides,
        scale,
        scale * LOG2E,
        dropout_p,
        inv_scale,
        limit,
    )
    return BackwardPlan(
        dqkv_shape,
        *_launch_config(tiles[0], False, qkv, num_heads, dropout_p, rope, mask),
        *_launch_config(tiles[1], True, qkv, num_heads, dropout_p, rope, mask),
        args,
    )


def _launch_bwd(plan, grad_out, qkv, stats, seed, rope=None, mask=None) -> torch.Tensor:
    """The dQ kernel (first: it writes delta), then the dK/dV kernel, launched by ``plan``
    (``_bwd_plan``) -> dqkv (B, L, 3D)."""
    row_max, inv_sum = stats[0], stats[1]
    delta = torch.empty_like(row_max)
    dqkv = torch.empty(plan.dqkv_shape, dtype=qkv.dtype, device=qkv.device)
    cos, sin, mask = _launch_tensors(qkv, plan.args[1], rope, mask)
    tensors = (qkv, grad_out, row_max, inv_sum, delta, seed, dqkv, cos, sin, mask)
    launch(_attention_bwd_dq_kernel, plan.dq_grid, *tensors, *plan.args, **plan.dq_config)
    launch(_attention_bwd_dkdv_kernel, plan.dkdv_grid, *tensors, *plan.args, **plan.dkdv_config)
    return dqkv


def bwd_tiles(qkv, num_heads, rope=None, mask=None) -> tuple:
    """The backward tile pair (dQ tile, dK/dV tile) to launch: see ``_tiles.tile_to_launch``."""
    return tile_to_launch(
        BWD_CHOOSER,
        qkv.device,
        lambda: _chooser_key(qkv, num_heads, rope, mask),
        lambda: (interpreter_tile(qkv.shape[1]),) * 2,
        lambda: bwd_candidates(
            qkv.dtype,
            _shape(qkv, num_heads)[3],
            qkv.shape[1],
            rope is not None,
            mask is not None,
            capability(qkv.device),
        ),
    )


def _attention_bwd(
    grad_out: torch.Tensor,
    qkv: torch.Tensor,
    stats: torch.Tensor,
    seed: torch.Tensor,
    num_heads: int,
    scale: float,
    dropout_p: float,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    rope_layout: str = "interleaved",
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dO (B, L, D) -> dqkv (B, L, 3D), packed like qkv (with rope: the gradient of the unrotated
    q and k; the tables and the mask get none)."""
    rope = None if cos is None else Rope(cos, sin, rope_layout)
    key = (*_plan_key(qkv, num_heads, scale, dropout_p, rope, mask), grad_out.stride())
    plan = decided(_BWD_PLANS, key)
    if plan is None:
        tiles = bwd_tiles(qkv, num_heads, rope, mask)
        made = _bwd_plan(tiles, grad_out, qkv, num_heads, scale, dropout_p, rope, mask)
        plan = keep(_BWD_PLANS, key, made)
    return _launch_bwd(plan, grad_out, qkv, stats, seed, rope, mask)


attention_bwd = direct(_attention_bwd)


def _fwd_setup_context(ctx, inputs, output):
    qkv, num_heads, scale, dropout_p, seed, *extra = inputs
    cos, sin, rope_layout, mask = (*extra, *(None, None, "interleaved", None)[len(extra) :])
    out, stats = output
    ctx.save_for_backward(qkv, stats, seed, cos, sin, mask)
    ctx.params, ctx.num_inputs, ctx.rope_layout = (num_heads, scale, dropout_p), len(inputs), rope_layout


def _fwd_backward(ctx, grad_out, grad_stats):
    nones = (None,) * (ctx.num_inputs - 1)
    if grad_out is None:  # only the probabilities were used: their own backward gives d qkv
        return (None, *nones)
    qkv, stats, seed, cos, sin, mask = ctx.saved_tensors
    dqkv = attention_bwd(grad_out, qkv, stats, seed, *ctx.params, cos, sin, ctx.rope_layout, mask)
    return (dqkv, *nones)


attention_fwd = differentiable(_attention_fwd, _fwd_backward, _fwd_setup_context)


def attention_triton(qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask):
    """The Triton implementation of ``vk.attention`` (arguments already validated). With rope or a
    mask, the probabilities asked for are computed by PyTorch's ops (``probs_by_torch``)."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    scale = head_dim**-0.5 if scale is None else scale
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=qkv.device)
    else:  # the shared seed (while tracing, a fresh one)
        seed = None if tracing() else _UNUSED_SEEDS.get(qkv.device)
        if seed is None:
            seed = _unused_seed(qkv.device)
    if cos is None and attn_mask is None:
        out, stats = attention_fwd(qkv, num_heads, scale, dropout_p, seed)
    else:
        out, stats = attention_fwd(qkv, num_heads, scale, dropout_p, seed, cos, sin, rope_layout, attn_mask)
    if not return_probs:
        return out
    if cos is not None or attn_mask is not None:
        return out, probs_by_torch(qkv, num_heads, scale, cos, sin, rope_layout, attn_mask)
    return out, attention_probs(qkv, stats, num_heads, scale)


_UNUSED_SEEDS: dict[torch.device, torch.Tensor] = {}


def _unused_seed(device: torch.device) -> torch.Tensor:
    """The seed argument of a call without dropout, which the kernels never read: one int64 tensor
    per device (``_UNUSED_SEEDS``), made once outside inference mode (so that autograd may save it)
    instead of an allocation per call. While tracing, a fresh one: a graph must not hold a global
    tensor."""
    with torch.inference_mode(False):
        seed = torch.empty(1, dtype=torch.int64, device=device)
    if not tracing() and not _signature.capturing_cuda_graph():
        _UNUSED_SEEDS[device] = seed
    return seed


def attention_extension(qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask):
    """``vk.attention`` for the extension backend, one C++ call (``vit_kernels::attention_explicit``):
    scores by GEMM, the ``vit_kernels::softmax`` kernel, then a GEMM with v. Materialises the
    (B, H, L, L) scores: meant for ``return_probs`` (attention maps), not for speed. 16-bit inputs
    are computed in float32, as fused attention kernels do: scores rounded to 16 bits lose whole
    units at large logits."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    out, probs = _ops.attention_explicit(
        qkv, num_heads, head_dim**-0.5 if scale is None else scale, dropout_p
    )
    return (out, probs) if return_probs else out


if _ext.LOADED:
    _ops = ExtensionOps("attention_explicit")


def _triton_limits(qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask):
    """Head dim <= MAX_HEAD_DIM: a tile of q, k and v must fit in registers / shared memory. The
    kernels rotate q and k and add the mask but compute no gradient of the rope tables or the mask."""
    head_dim = qkv.shape[-1] // (3 * num_heads)
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM} (a q/k/v tile would not fit on chip)"
    if cos is not None and torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "rope tables that require grad (the kernels compute no gradient of cos and sin; torch does)"
    if attn_mask is not None and torch.is_grad_enabled() and attn_mask.requires_grad:
        return "an attn_mask that requires grad (the kernels compute no gradient of the mask; torch does)"
    return None


def _extension_limits(qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask):
    """The C++ attention has no rotary position embedding and no mask."""
    if cos is not None:
        return "rope (the C++ attention does not rotate q and k)"
    return None if attn_mask is None else "attn_mask (the C++ attention takes no mask)"


def _without_dropout(args: tuple) -> tuple:
    """The call made deterministic for validation: dropout off."""
    qkv, num_heads, scale, _, return_probs, *rope_and_mask = args
    return (qkv, num_heads, scale, 0.0, return_probs, *rope_and_mask)


# The implementations of vk.attention: backend -> function, support by device / dtype, shape limits.
EXTENSION_CUDA_REASON = (
    "the extension's attention materialises the (B, H, L, L) scores: 4-15x slower than SDPA on an H100 "
    "(benchmarks/results/h100-2026-11-22.md); use triton or torch on CUDA"
)


def _extension_supports(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """The extension's attention runs on the CPU only: on CUDA its unfused scores-softmax-GEMM path
    loses to SDPA (``EXTENSION_CUDA_REASON``), so it is not offered there at all."""
    if device.type == "cuda":
        return EXTENSION_CUDA_REASON
    return _ext.supports(device, dtype)


def _triton_default(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    """The eager table's default on sm_90 in 16 bits with gradients: Triton, whose forward + backward
    from the packed qkv took 0.484 ms on an H100 against SDPA's 0.843 (ViT-B/16, B=128, bf16;
    benchmarks/results/h100-2026-11-26.md): SDPA's caller splits qkv into three copies and
    concatenates their gradients. Without gradients SDPA's forward (cuDNN, 0.086 ms against 0.120)
    stays; other architectures were never measured: the reference.

    Under torch.compile the reference (Inductor's SDPA, cuDNN on sm_90) everywhere: Inductor folds
    those copies into its neighbours, and in a compiled ViT-B/16 training step (B=128, bf16, H200)
    cuDNN's backward took 2.9 ms of the step against 4.6 ms for Triton's dQ and dK/dV kernels
    (benchmarks/results/e2e-h200-2026-11-28.md)."""
    return grad and dtype in (torch.float16, torch.bfloat16) and capability(device) == 90


def _validation_parts(i, *tensors) -> list[tuple]:
    """Result ``i``: the output, the probabilities (4-D) or dqkv (B, L, 3D), judged as dq, dk and
    dv: a wrong dK (as an H100 computed with two tiles) stands out on its own scale."""
    if i == 0 or tensors[0].dim() != 3:
        return [(f"result {i}", *tensors)]
    return [(name, *parts) for name, *parts in zip(("dq", "dk", "dv"), *(t.chunk(3, -1) for t in tensors))]


backend.implementations(
    "attention",
    validation=_without_dropout,
    parts=_validation_parts,
    torch=backend.Impl(attention_ref),
    triton=backend.Impl(
        attention_triton,
        supports=backend.triton_supports_dot,
        limits=_triton_limits,
        preferred=_triton_default,
    ),
    extension=backend.Impl(attention_extension, supports=_extension_supports, limits=_extension_limits),
)
