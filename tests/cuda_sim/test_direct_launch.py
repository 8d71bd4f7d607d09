"""Direct launches (``_triton.DirectLaunch``) on the simulated device: with them on, a warm call of
every op, forward and backward, at ViT-B/16 shapes in bfloat16, launches its planned kernels
directly and records the same launches (kernel, grid, arguments, keywords) as with them off. The
simulated compiled kernel takes only what Triton's launcher takes (a three-dimensional grid, one
value per kernel parameter in order): a layout error fails here."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from benchmarks.host_overhead import VIT_B, forward_then_backward, inputs_requiring_grad, pointer_tiles
from tests.helpers import spy_direct_launches
from tools.op_specs import OPS, SPECS
from vit_kernels import _triton


def _warm_launches(sim, op: str, inputs: dict) -> list:
    """The launches of the third forward + backward call (the first two decide the backend, the tiles
    and, with direct launches on, the plans' direct launches)."""
    forward, backward = forward_then_backward(lambda: SPECS[op].run(VIT_B, **inputs))
    for _ in range(3):
        start = len(sim.launches)
        forward()
        backward()
    return sim.launches[start:]


def _same_launch(a, b) -> bool:
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
            )
        return x == y

    return (
        a.kernel is b.kernel
        and a.grid == b.grid
        and a.kwargs == b.kwargs
        and len(a.args) == len(b.args)
        and all(same(x, y) for x, y in zip(a.args, b.args))
    )


@pytest.mark.parametrize("op", OPS)
def test_a_warm_call_launches_directly_what_kernel_grid_launches(sim, monkeypatch, op):
    inputs = inputs_requiring_grad(op, VIT_B, "cuda", torch.bfloat16)
    direct_calls = spy_direct_launches(monkeypatch)
    # the GEMMs by the pointer kernel: the TMA kernel's launches copy their descriptors, not direct
    with vk.use_backend("triton", strict=True), pointer_tiles():
        with _triton.direct_launch(False):
            through_jit = _warm_launches(sim, op, inputs)
        assert not direct_calls
        with _triton.direct_launch(True):
            direct = _warm_launches(sim, op, inputs)
    assert through_jit and len(direct) == len(through_jit)
    assert all(_same_launch(a, b) for a, b in zip(direct, through_jit)), (direct, through_jit)
    assert any(direct_calls), "no launch of a warm call was direct"
