"""The launch configurations of the attention kernels (``vit_kernels._tiles``): the tile tables per
float32 / 16 bits and padded head dim, the pair measured first per architecture, a call's
candidates fitted to its sequence, and the forward and backward tile choosers."""

from __future__ import annotations

from typing import NamedTuple

import torch

from vit_kernels._tiles import TileChooser, plain_repr, report_rows
from vit_kernels._triton import cdiv, next_power_of_2


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
# pair measured on an architecture ahead of it there), and ``vk.tune`` searches them all.
# Forward: tiles. Backward: (dQ tile, dK/dV tile) pairs, the dK/dV kernel (which keeps dK, dV, K and
# V tiles live across its loop) with narrower query blocks. float32 stays exact (ieee FMA, no tf32)
# and holds its tiles in registers without tensor cores: smaller tiles. The 16-bit lists hold
# 128-row, 8-warp forward tiles (two warpgroups of 64 rows on sm_90) and backward pairs with 128-row
# dQ or 128-key dK/dV tiles. Every entry compiles for sm_80 and sm_90 without spills (`make
# check-gpu`) and is run against float64 by the GPU tests (tests/test_tiles.py). The 16-bit
# head-dim-128 dK/dV tiles (32, 64, 8, 2) and (32, 64, 4, 2) compute a wrong dK on an H100 and are
# not listed (benchmarks/results/h100-2026-11-22.md).
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
FWD_CHOOSER = TileChooser("attention forward")
BWD_CHOOSER = TileChooser("attention backward")


def tile_report() -> list[dict]:
    """Every attention tile choice made in this process: kernel, key (dtype, head dim, length,
    batch x heads bucket), the tile chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("forward", FWD_CHOOSER) + report_rows("backward", BWD_CHOOSER)


def row_blocks(block: int, seq_len: int, batch_heads: int) -> tuple[int]:
    """The flattened grid of the kernels' ``_block_and_head``: (row blocks x batch * heads,)."""
    return (cdiv(seq_len, block) * batch_heads,)


def padded_head_dim(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, next_power_of_2(head_dim))


def tile_key(dtype: torch.dtype, head_dim: int) -> tuple[bool, int]:
    return dtype == torch.float32, max(64, padded_head_dim(head_dim))


def _fit(tile: int, seq_len: int) -> int:
    """Tiles no longer than the sequence (at least 16 rows, the smallest tl.dot operand). A tile is
    a compile-time constant: under torch.compile with dynamic shapes ``seq_len`` is a SymInt, made
    concrete here (a guard on the length, which the kernel is specialised for anyway)."""
    return max(16, min(tile, next_power_of_2(int(seq_len))))


def fitted(tile: AttentionTile, seq_len: int, extra_loads: bool = False) -> AttentionTile:
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
        fitted(t, seq_len, rope or masked)
        for t in ATTENTION_FWD_TILES[tile_key(dtype, head_dim)]
        if not masked or _mask_fits(t)
    )


def bwd_candidates(
    dtype: torch.dtype, head_dim: int, seq_len: int, rope: bool = False, masked: bool = False, arch: int = 0
) -> tuple:
    """The backward (dQ tile, dK/dV tile) pairs for this call on a GPU of compute capability
    ``arch`` (90 for sm_90), the pair measured there first where one was, fitted to the sequence
    (as ``fwd_candidates``)."""
    key = tile_key(dtype, head_dim)
    default = ATTENTION_BWD_DEFAULTS.get(arch, {}).get(key)
    first = () if default is None else (default,)
    return _unique(
        (fitted(dq, seq_len, rope or masked), fitted(dkdv, seq_len, rope or masked))
        for dq, dkdv in first + ATTENTION_BWD_TILES[key]
        if not masked or (_mask_fits(dq) and _mask_fits(dkdv))
    )


def interpreter_tile(seq_len: int) -> AttentionTile:
    block = _fit(INTERPRETER_TILE, seq_len)
    return AttentionTile(block, block, 1, 1)
