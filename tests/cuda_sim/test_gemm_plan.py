"""A GEMM call seen before skips working out its K split, tile and launch (``ops.gemm._PLANS``), until
a tile choice changes: a tile pinned after the plan was made is the one launched."""

from __future__ import annotations

import torch

import vit_kernels as vk
from vit_kernels.kernels.gemm import _linear_kernel
from vit_kernels.ops import gemm


def _launched_blocks(sim, call) -> list[tuple[int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of each pointer-GEMM launch ``call()`` makes."""
    start = len(sim.launches)
    call()
    return [
        (launch.kwargs["BLOCK_M"], launch.kwargs["BLOCK_N"], launch.kwargs["BLOCK_K"])
        for launch in sim.launches[start:]
        if launch.kernel is _linear_kernel
    ]


def test_a_planned_gemm_launches_the_tile_its_key_holds_now(sim, monkeypatch):
    x = torch.randn(16, 197, 192, device="cuda", dtype=torch.float32)
    w = torch.randn(576, 192, device="cuda", dtype=torch.float32)
    gemm._PLANS.clear()
    keys, tile_to_launch = [], gemm.tile_to_launch

    def spied(chooser, device, key, *args):
        keys.append(key())
        return tile_to_launch(chooser, device, key, *args)

    monkeypatch.setattr(gemm, "tile_to_launch", spied)
    with vk.use_backend("triton", strict=True):
        (chosen,) = _launched_blocks(sim, lambda: vk.linear(x, w))
        assert len(gemm._PLANS) == 1 and not gemm.GEMM_CHOOSER.report()  # the table's tile, not kept
        assert _launched_blocks(sim, lambda: vk.linear(x, w)) == [chosen]
        (tile_key,) = keys  # the warm call chose nothing: its plan was kept
        candidates = gemm.gemm_candidates(torch.float32, 16 * 197, 576, False)
        chosen = next(t for t in candidates if t[:3] == chosen)
        other = next(t for t in candidates if t != chosen)
        gemm.GEMM_CHOOSER.pin(tile_key, other)
        assert _launched_blocks(sim, lambda: vk.linear(x, w)) == [other[:3]]
        assert len(gemm._PLANS) == 1  # the plan was made again, under its key
        gemm.GEMM_CHOOSER.pin(tile_key, chosen)
        assert _launched_blocks(sim, lambda: vk.linear(x, w)) == [chosen[:3]]
