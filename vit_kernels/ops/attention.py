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

import functools
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from vit_kernels import _ext, _signature, backend
from vit_kernels._autograd import differentiable, direct, tracing
from vit_kernels._ext import ExtensionOps
from vit_kernels._accuracy import check_against, reference_dtype
from vit_kernels._tiles import (
    TileChooser,
    decided,
    keep,
    plain_repr,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import (
    HAS_TRITON,
    capability,
    cdiv,
    dot_precision,
    interpreted,
    launch,
    next_power_of_2,
)
from vit_kernels.kernels.attention import (
    _attention_bwd_dkdv_kernel,
    _attention_bwd_dq_kernel,
    _attention_fwd_kernel,
    _attention_probs_kernel,
)
from vit_kernels.ops.rope import apply_rope, tables_4d

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


class AttentionTile(NamedTuple):
    """One launch configuration of an attention kernel: (query, key) blocks, warps, pipeline
    stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    __repr__ = plain_repr


def _tiles(*tiles: tuple) -> tuple[AttentionTile, ...]:
    return tuple(AttentionTile(*tile) for tile in tiles)


def _pairs(*pairs: tuple) -> tuple[tuple[AttentionTile, AttentionTile], ...]:
    return tuple((AttentionTile(*dq), AttentionTile(*dkdv)) for dq, dkdv in pairs)


# Launch configurations on a GPU, per (float32 or 16-bit, padded head dim) (``vit_kernels._tiles``):
# the first one is the default (checked once on the user's GPU; ``ATTENTION_BWD_DEFAULTS`` puts the
# pair measured on an architecture ahead of it there), and ``vk.tune`` searches them all. Forward: tiles. Backward: (dQ tile, dK/dV tile) pairs,
# the dK/dV kernel (which keeps dK, dV, K and V tiles live across its loop) with narrower query
# blocks. float32 stays exact (ieee FMA, no tf32) and holds its tiles in registers without tensor
# cores: smaller tiles. The 16-bit lists hold 128-row, 8-warp forward tiles (two warpgroups of 64
# rows on sm_90) and backward pairs with 128-row dQ or 128-key dK/dV tiles. Every entry is compiled
# for sm_80 and sm_90 by `make check-gpu` (no spills) and run against float64 by the GPU tests
# (tests/test_tiles.py). The defaults are the fastest right ones an H100 measured, and the 16-bit
# head-dim-128 dK/dV tiles (32, 64, 8, 2) and (32, 64, 4, 2), which computed a wrong dK there, are
# left out (benchmarks/results/h100-2026-11-22.md).
ATTENTION_FWD_TILES = {
    (False, 64): _tiles(
        (64, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 4),
        (64, 64, 4, 2),
        (64, 64, 4, 4),
    ),
    (False, 128): _tiles(
        (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)
    ),
    (False, 256): _tiles((64, 32, 8, 1), (32, 32, 4, 1)),
    (True, 64): _tiles((32, 32, 4, 2), (64, 32, 8, 2)),
    (True, 128): _tiles((32, 32, 8, 1), (16, 32, 8, 1)),
    (True, 256): _tiles((16, 32, 4, 1)),
}
ATTENTION_BWD_TILES = {
    (False, 64): _pairs(
        ((64, 64, 4, 3), (64, 64, 4, 2)),
        ((64, 64, 4, 2), (32, 64, 4, 2)),
        ((64, 64, 4, 3), (32, 64, 4, 2)),
        ((32, 64, 4, 2), (64, 64, 4, 2)),
        ((64, 64, 4, 3), (64, 64, 4, 3)),
        ((128, 64, 8, 2), (64, 64, 4, 2)),
        ((64, 64, 4, 3), (64, 128, 8, 2)),
    ),
    (False, 128): _pairs(
        ((64, 32, 4, 2), (32, 32, 4, 1)), ((64, 32, 4, 2), (16, 32, 8, 1)), ((32, 32, 4, 2), (16, 32, 4, 1))
    ),
    (False, 256): _pairs(((32, 32, 8, 1), (16, 32, 8, 1))),
    (True, 64): _pairs(((32, 32, 4, 1), (16, 32, 4, 1))),
    (True, 128): _pairs(((16, 32, 4, 1), (16, 32, 8, 1))),
    (True, 256): _pairs(((16, 16, 4, 1), (16, 16, 8, 1))),
}
# Per architecture, where one was measured, the pair that runs first (before the table's): on sm_90
# the 16-bit head-dim-64 backward the H100 and the H200 both chose, dQ (64, 64, 4, 3) with dK/dV
# (32, 64, 4, 2): forward + backward 0.484 ms against 0.689 with the table's first pair (ViT-B/16,
# B=128, bf16; benchmarks/results/h100-2026-11-26.md, h200-2026-11-27.md).
ATTENTION_BWD_DEFAULTS = {90: {(False, 64): _pairs(((64, 64, 4, 3), (32, 64, 4, 2)))[0]}}
# A rotating call's kernels load per block two more q or k tiles (the partner columns) and the
# cos and sin tiles, each buffered once per pipeline stage: at 3 stages the 16-bit head-dim-64
# tiles pass sm_80's 163 KB of shared memory per block (`make check-gpu`), so they run at most 2;
# so does a masked call, whose kernels load a (BLOCK_M, BLOCK_N) mask tile per block beside them,
# and which takes only tiles of at most MASK_MAX_TILE elements: a float32 128 x 128 mask tile (64 KB
# per stage) takes the forward to 180 KB of shared memory at 2 stages, over sm_80's 163 KB.
EXTRA_LOADS_MAX_STAGES = 2
MASK_MAX_TILE = 64 * 128
INTERPRETER_TILE = 32  # fixed and small: the interpreter's cost is per tile op, not per flop
VALIDATION_BATCH = 4  # images of the call that candidate tiles are checked on (all are timed)
VALIDATION_BYTES = 1 << 30  # what the references' scores may take (long sequences check fewer images)
FWD_CHOOSER = TileChooser("attention forward", lambda: (_attention_fwd_kernel,))
BWD_CHOOSER = TileChooser(
    "attention backward", lambda: (_attention_bwd_dq_kernel, _attention_bwd_dkdv_kernel)
)


def tile_report() -> list[dict]:
    """Every attention tile choice made in this process: kernel, key (dtype, head dim, length,
    batch x heads bucket), the tile chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("forward", FWD_CHOOSER) + report_rows("backward", BWD_CHOOSER)


def _block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, next_power_of_2(head_dim))


def _tile_key(dtype: torch.dtype, head_dim: int) -> tuple[bool, int]:
    return dtype == torch.float32, max(64, _block_d(head_dim))


def _fit(tile: int, seq_len: int) -> int:
    """Tiles no longer than the sequence (at least 16 rows, the smallest tl.dot operand). A tile is
    a compile-time constant: under torch.compile with dynamic shapes ``seq_len`` is a SymInt, made
    concrete here (a guard on the length, which the kernel is specialised for anyway)."""
    return max(16, min(tile, next_power_of_2(int(seq_len))))


def _fitted(tile: AttentionTile, seq_len: int, extra_loads: bool = False) -> AttentionTile:
    """``tile`` with both blocks fitted to the sequence; for a rotating or masked call
    (``extra_loads``) at most EXTRA_LOADS_MAX_STAGES stages."""
    return AttentionTile(
        _fit(tile.block_m, seq_len),
        _fit(tile.block_n, seq_len),
        tile.warps,
        min(tile.stages, EXTRA_LOADS_MAX_STAGES) if extra_loads else tile.stages,
    )


def _unique(tiles) -> tuple:
    return tuple(dict.fromkeys(tiles))


def _mask_fits(tile: AttentionTile) -> bool:
    return tile.block_m * tile.block_n <= MASK_MAX_TILE


def fwd_candidates(
    dtype: torch.dtype, head_dim: int, seq_len: int, rope: bool = False, masked: bool = False
) -> tuple:
    """The forward tiles for this call on a GPU, fitted to the sequence (duplicates dropped); for a
    rotating or masked call at most EXTRA_LOADS_MAX_STAGES stages, for a masked one only tiles of at
    most MASK_MAX_TILE elements."""
    return _unique(
        _fitted(t, seq_len, rope or masked)
        for t in ATTENTION_FWD_TILES[_tile_key(dtype, head_dim)]
        if not masked or _mask_fits(t)
    )


def bwd_candidates(
    dtype: torch.dtype, head_dim: int, seq_len: int, rope: bool = False, masked: bool = False, arch: int = 0
) -> tuple:
    """The backward (dQ tile, dK/dV tile) pairs for this call on a GPU of compute capability
    ``arch`` (90 for sm_90), the pair measured there first where one was, fitted to the sequence
    (as ``fwd_candidates``)."""
    key = _tile_key(dtype, head_dim)
    default = ATTENTION_BWD_DEFAULTS.get(arch, {}).get(key)
    first = () if default is None else (default,)
    return _unique(
        (_fitted(dq, seq_len, rope or masked), _fitted(dkdv, seq_len, rope or masked))
        for dq, dkdv in first + ATTENTION_BWD_TILES[key]
        if not masked or (_mask_fits(dq) and _mask_fits(dkdv))
    )


def _tail_block(block: int, seq_len: int) -> int:
    """The kernels' BLOCK_TAIL: rows of the one masked block after the ``seq_len // block`` full
    blocks of a loop over the sequence, L mod ``block`` padded to a power of two (at least 16, the
    smallest tl.dot operand, and at most ``block``), or 0 where ``block`` divides L (no tail)."""
    rest = int(seq_len) % block
    return 0 if rest == 0 else max(16, next_power_of_2(rest))


def _interpreter_tile(seq_len: int) -> AttentionTile:
    block = _fit(INTERPRETER_TILE, seq_len)
    return AttentionTile(block, block, 1, 1)


def _row_blocks(block: int, seq_len: int, batch_heads: int) -> tuple[int]:
    """The flattened grid of ``_block_and_head``: (row blocks x batch * heads,)."""
    return (cdiv(seq_len, block) * batch_heads,)


def _shape(qkv: torch.Tensor, num_heads: int) -> tuple[int, int, int, int]:
    batch, seq_len, three_d = qkv.shape
    model_dim = three_d // 3
    return batch, seq_len, model_dim, model_dim // num_heads


def _chooser_key(
    qkv: torch.Tensor, num_heads: int, rope: Optional[tuple] = None, mask: Optional[torch.Tensor] = None
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
        key += (f"rope={rope[2]}",)
    return key if mask is None else key + (f"mask={MASK_KINDS[_mask_code(mask)]}",)


def _launch_config(
    tile: AttentionTile,
    over_keys: bool,
    qkv: torch.Tensor,
    num_heads: int,
    dropout_p: float,
    rope: Optional[tuple],
    mask: Optional[torch.Tensor],
) -> tuple[tuple[int], dict]:
    """(grid, keyword arguments) of one launch of an attention kernel with ``tile``: its programs
    walk query blocks (the forward, dQ) or, ``over_keys``, key blocks (dK/dV), each looping over the
    other kind (whose last block is the tail). A decided call finds it in its plan (``_plan_key``)."""
    batch, seq_len, _, head_dim = _shape(qkv, num_heads)
    bm, bn, warps, stages = tile
    rows, looped = (bn, bm) if over_keys else (bm, bn)
    block_d = _block_d(head_dim)
    return _row_blocks(rows, seq_len, batch * num_heads), dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_TAIL=_tail_block(looped, seq_len),
        BLOCK_D=block_d,
        EVEN_D=head_dim == block_d,
        DROPOUT=dropout_p > 0,
        PRECISION=dot_precision(qkv.dtype),
        ROPE=0 if rope is None else ROPE_CODES[rope[2]],
        MASK=0 if mask is None else _mask_code(mask),
        num_warps=warps,
        num_stages=stages,
    )


def _plan_key(
    qkv: torch.Tensor, num_heads: int, scale: float, dropout_p: float, rope: Optional[tuple], mask
) -> tuple:
    """Everything a call's tile choice and launch depend on besides its tensors' data: the plans of a
    decided call are kept under it (``_tiles.decided``)."""
    key = (qkv.shape, qkv.stride(), qkv.dtype, qkv.device, num_heads, scale, dropout_p)
    if rope is not None:
        key += (rope[2], rope[0].shape, rope[0].stride(), rope[1].shape, rope[1].stride())
    return key if mask is None else key + (mask.dtype, mask.shape, mask.stride())


_FWD_PLANS: dict[tuple, tuple] = {}  # _plan_key -> (generation, _fwd_plan)
_BWD_PLANS: dict[tuple, tuple] = {}  # _plan_key + dO's strides -> (generation, _bwd_plan)


ROPE_CODES = {"interleaved": 1, "half": 2}  # the kernels' ROPE (0: no rotation)


def _launch_tensors(qkv: torch.Tensor, num_heads: int, rope: Optional[tuple], mask) -> tuple:
    """(Cos, Sin, Mask) for the kernels: the tables and the mask as (B, H, L_r, Dh) and (B, H, L, L)
    views (stride 0 where broadcast; a float64 mask cast to float32); qkv as the placeholder pointer
    (never read) of each one absent."""
    cos, sin = (qkv, qkv) if rope is None else tables_4d(qkv, num_heads, rope[0], rope[1])
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


def _validation_images(qkv: torch.Tensor, num_heads: int) -> int:
    """How many images of the call candidates are checked on: up to VALIDATION_BATCH, fewer where the
    reference's materialised (H, L, L) scores would pass VALIDATION_BYTES (at least one)."""
    batch, seq_len = int(qkv.shape[0]), int(qkv.shape[1])
    per_image = 3 * num_heads * seq_len * seq_len * 8  # scores, probabilities and a gradient, float64
    return max(1, min(VALIDATION_BATCH, batch, VALIDATION_BYTES // per_image))


def _reference_attention(
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    grad_out: Optional[torch.Tensor],
    dtype: torch.dtype,
    rope: Optional[tuple] = None,
    mask: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """SDPA on the first ``_validation_images`` images of qkv computed in ``dtype``: [out] or, given
    grad_out, [dq, dk, dv] each (n, L, D); with rope (cos, sin, layout), of the rotated q and k. With
    an attention mask, the masked softmax written out (``masked_softmax``): rows whose every key is
    masked are 0 by that rule on every device, whatever SDPA's kernel for the device does with them."""
    n = _validation_images(qkv, num_heads)
    leaf = qkv[:n].detach().to(dtype).requires_grad_(grad_out is not None)
    q, k, v = split_qkv(leaf, num_heads)
    if rope is not None:
        cos, sin = (t[:n].detach() for t in tables_4d(qkv, num_heads, rope[0], rope[1]))
        q, k = apply_rope(q, cos, sin, rope[2]), apply_rope(k, cos, sin, rope[2])
    if mask is not None:
        batch, seq_len = qkv.shape[0], qkv.shape[1]
        mask = mask.expand(batch, num_heads, seq_len, seq_len)[:n].detach()
        out = explicit_attention(q, k, v, scale, 0.0, lambda scores: masked_softmax(scores, mask))[0]
    else:
        q, k, v = sdpa_aligned(q), sdpa_aligned(k), sdpa_aligned(v)
        out = merge_heads(F.scaled_dot_product_attention(q, k, v, scale=scale))
    if grad_out is None:
        return [out.detach()]
    (grad,) = torch.autograd.grad(out, leaf, grad_out[:n].to(dtype))
    return list(grad.chunk(3, dim=-1))


def _check_against_pytorch(
    names: Sequence[str],
    parts_of: Callable[[Sequence[torch.Tensor]], list],
    qkv: torch.Tensor,
    num_heads: int,
    scale: float,
    grad_out: Optional[torch.Tensor] = None,
    rope: Optional[tuple] = None,
    mask: Optional[torch.Tensor] = None,
) -> Callable:
    """A check for the TileChooser: each part of a candidate's outputs (on the validation images)
    within twice the error of PyTorch's own SDPA in the same dtype, against SDPA in float64 (float32
    inputs) or float32 (16-bit inputs), on q and k rotated by ``rope`` and with ``mask`` where given.
    The references are computed once, on first use."""

    def references():
        with torch.enable_grad():
            return tuple(
                _reference_attention(qkv, num_heads, scale, grad_out, dtype, rope, mask)
                for dtype in (reference_dtype(qkv.dtype), qkv.dtype)
            )

    return check_against(names, references, qkv.dtype, parts_of)


if HAS_TRITON:

    def _fwd_plan(tile, qkv, num_heads, scale, dropout_p, rope, mask) -> tuple:
        """(out's shape, the statistics' shape, grid, arguments after the tensors, keywords) of the
        forward launch with ``tile``."""
        batch, seq_len, model_dim, _ = _shape(qkv, num_heads)
        head, strides, (inv_scale, limit) = _launch_scalars(qkv, num_heads, scale, rope, mask)
        grid, config = _launch_config(tile, False, qkv, num_heads, dropout_p, rope, mask)
        out_strides = (seq_len * model_dim, model_dim)  # of the new (B, L, D) out (L, D > 0: validated)
        args = (*head, *out_strides, *strides, scale * LOG2E, dropout_p, inv_scale, limit)
        return (batch, seq_len, model_dim), (2, batch * num_heads, seq_len), grid, args, config

    def _launch_fwd(plan, qkv, seed, rope=None, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward kernel launched by ``plan`` (``_fwd_plan``) -> out, row statistics."""
        out_shape, stats_shape, grid, args, config = plan
        device = qkv.device
        out = torch.empty(out_shape, dtype=qkv.dtype, device=device)
        stats = torch.empty(stats_shape, dtype=torch.float32, device=device)
        cos, sin, mask = _launch_tensors(qkv, args[1], rope, mask)
        tensors = (qkv, out, stats[0], stats[1], seed, cos, sin, mask)
        launch(_attention_fwd_kernel, grid, *tensors, *args, plan=plan, **config)
        return out, stats

    def fwd_tile(qkv, num_heads, scale, seed, rope=None, mask=None) -> tuple:
        """The forward tile to launch: see ``_tiles.tile_to_launch`` (validated without dropout)."""

        def trial():
            def run(tile):
                return [
                    _launch_fwd(
                        _fwd_plan(tile, qkv, num_heads, scale, 0.0, rope, mask), qkv, seed, rope, mask
                    )[0]
                ]

            n = _validation_images(qkv, num_heads)
            return run, _check_against_pytorch(
                ["out"], lambda outputs: [outputs[0][:n]], qkv, num_heads, scale, rope=rope, mask=mask
            )

        return tile_to_launch(
            FWD_CHOOSER,
            qkv.device,
            lambda: _chooser_key(qkv, num_heads, rope, mask),
            lambda: _interpreter_tile(qkv.shape[1]),
            lambda: fwd_candidates(
                qkv.dtype, _shape(qkv, num_heads)[3], qkv.shape[1], rope is not None, mask is not None
            ),
            trial,
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
        rope = None if cos is None else (cos, sin, rope_layout)
        key = _plan_key(qkv, num_heads, scale, dropout_p, rope, mask)
        plan = decided(_FWD_PLANS, key)
        if plan is None:
            tile = fwd_tile(qkv, num_heads, scale, seed, rope, mask)
            made = _fwd_plan(tile, qkv, num_heads, scale, dropout_p, rope, mask)
            chooser_key = functools.partial(_chooser_key, qkv, num_heads, rope, mask)
            plan = keep(_FWD_PLANS, key, made, FWD_CHOOSER, qkv.device, chooser_key)
        return _launch_fwd(plan, qkv, seed, rope, mask)

    def _bwd_plan(tiles, grad_out, qkv, num_heads, scale, dropout_p, rope, mask) -> tuple:
        """(dqkv's shape, (grid, keywords) of the dQ launch and of the dK/dV launch with ``tiles``, the
        arguments after the tensors)."""
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
        return (
            dqkv_shape,
            _launch_config(tiles[0], False, qkv, num_heads, dropout_p, rope, mask),
            _launch_config(tiles[1], True, qkv, num_heads, dropout_p, rope, mask),
            args,
        )

    def _launch_bwd(plan, grad_out, qkv, stats, seed, rope=None, mask=None) -> torch.Tensor:
        """The dQ kernel (first: it writes delta), then the dK/dV kernel, launched by ``plan``
        (``_bwd_plan``) -> dqkv (B, L, 3D)."""
        dqkv_shape, (dq_grid, dq_config), (dkdv_grid, dkdv_config), args = plan
        row_max, inv_sum = stats[0], stats[1]
        delta = torch.empty_like(row_max)
        dqkv = torch.empty(dqkv_shape, dtype=qkv.dtype, device=qkv.device)
        cos, sin, mask = _launch_tensors(qkv, args[1], rope, mask)
        tensors = (qkv, grad_out, row_max, inv_sum, delta, seed, dqkv, cos, sin, mask)
        launch(_attention_bwd_dq_kernel, dq_grid, *tensors, *args, plan=plan, **dq_config)
        launch(_attention_bwd_dkdv_kernel, dkdv_grid, *tensors, *args, plan=plan, **dkdv_config)
        return dqkv

    def bwd_tiles(grad_out, qkv, stats, seed, num_heads, scale, rope=None, mask=None) -> tuple:
        """The backward tile pair (dQ tile, dK/dV tile) to launch: see ``_tiles.tile_to_launch``."""

        def trial():
            def run(tiles):
                plan = _bwd_plan(tiles, grad_out, qkv, num_heads, scale, 0.0, rope, mask)
                return [_launch_bwd(plan, grad_out, qkv, stats, seed, rope, mask)]

            n = _validation_images(qkv, num_heads)
            return run, _check_against_pytorch(
                ["dq", "dk", "dv"],
                lambda outputs: list(outputs[0][:n].chunk(3, dim=-1)),
                qkv,
                num_heads,
                scale,
                grad_out,
                rope,
                mask,
            )

        return tile_to_launch(
            BWD_CHOOSER,
            qkv.device,
            lambda: _chooser_key(qkv, num_heads, rope, mask),
            lambda: (_interpreter_tile(qkv.shape[1]),) * 2,
            lambda: bwd_candidates(
                qkv.dtype,
                _shape(qkv, num_heads)[3],
                qkv.shape[1],
                rope is not None,
                mask is not None,
                capability(qkv.device),
            ),
            trial,
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
        rope = None if cos is None else (cos, sin, rope_layout)
        key = (*_plan_key(qkv, num_heads, scale, dropout_p, rope, mask), grad_out.stride())
        plan = decided(_BWD_PLANS, key)
        if plan is None:
            tiles = bwd_tiles(grad_out, qkv, stats, seed, num_heads, scale, rope, mask)
            made = _bwd_plan(tiles, grad_out, qkv, num_heads, scale, dropout_p, rope, mask)
            chooser_key = functools.partial(_chooser_key, qkv, num_heads, rope, mask)
            plan = keep(_BWD_PLANS, key, made, BWD_CHOOSER, qkv.device, chooser_key)
        return _launch_bwd(plan, grad_out, qkv, stats, seed, rope, mask)

    attention_bwd = direct(_attention_bwd)

    def _attention_probs(
        qkv: torch.Tensor, stats: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        """The softmax probabilities (B, H, L, L) from qkv and the forward's row statistics."""
        batch, seq_len, model_dim, head_dim = _shape(qkv, num_heads)
        if interpreted(qkv.device):
            bm, bn, warps, stages = _interpreter_tile(seq_len)
        else:  # one q tile against k tiles, as in dQ: the default pair's dQ tile
            bm, bn, warps, stages = bwd_candidates(qkv.dtype, head_dim, seq_len)[0][0]
        probs = torch.empty((batch, num_heads, seq_len, seq_len), dtype=qkv.dtype, device=qkv.device)
        grid = _row_blocks(bm, seq_len, batch * num_heads)
        tensors = (qkv, stats[0], stats[1], probs)
        sizes = (seq_len, num_heads, head_dim, model_dim, *qkv.stride(), scale * LOG2E)
        config = dict(
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_D=_block_d(head_dim),
            PRECISION=dot_precision(qkv.dtype),
            num_warps=warps,
            num_stages=stages,
        )
        launch(_attention_probs_kernel, grid, *tensors, *sizes, **config)
        return probs

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
    loses to SDPA by 4-15x (1.34 vs 0.09 ms forward, 3.20 vs 0.83 ms forward+backward at ViT-B/16,
    B=128, bf16, H100), so it is not offered there at all."""
    if device.type == "cuda":
        return EXTENSION_CUDA_REASON
    return _ext.supports(device, dtype)


def _triton_default(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    """The table's default on sm_90 in 16 bits with gradients, eager and under torch.compile: Triton,
    whose forward + backward from the packed qkv took 0.484 ms on an H100 against SDPA's 0.843 and
    torch.compile's 0.729 (ViT-B/16, B=128, bf16; benchmarks/results/h100-2026-11-26.md). Without gradients SDPA's forward (cuDNN,
    0.086 ms against 0.120) stays; other architectures were never measured: the reference."""
    return grad and dtype in (torch.float16, torch.bfloat16) and capability(device) == 90


backend.implementations(
    "attention",
    validation_args=_without_dropout,
    torch=backend.Impl(attention_ref),
    triton=backend.Impl(
        attention_triton,
        supports=backend.triton_supports_dot,
        limits=_triton_limits,
        preferred=_triton_default,
        compiled=_triton_default,
    ),
    extension=backend.Impl(attention_extension, supports=_extension_supports, limits=_extension_limits),
)
