"""The GPU's tile-table tests (``tests/test_tiles.py``) run here too, on the simulated device: the first
and last case of each table and its first TMA tile, so that what they pin (a launcher's tile choice,
by its name in its module) still exists and is still the choice the launchers call. The values are not checked here (a simulated tensor holds no data: ``check_against_formula``
is replaced by a run of the call forward and backward whose outputs and gradients are checked for
dtype, device and shape); on a GPU the same test compares them with float64 formulas."""

from __future__ import annotations

import pytest
import torch

from tests import test_tiles
from tests.helpers import outputs_and_grads

TILE_TESTS = (
    "test_attention_tile",
    "test_linear_tile",
    "test_linear_gelu_tile",
    "test_mlp_tile",
    "test_patch_embed_tile",
    "test_layer_norm_tile",
)


def _cases(name: str) -> list:
    """The first and last parameter sets of the tile test ``name`` and its first TMA one, as pytest
    params with their ids."""
    (mark,) = [m for m in getattr(test_tiles, name).pytestmark if m.name == "parametrize"]
    cases = mark.args[1]
    assert cases, f"{name} has no cases"
    chosen = [cases[0], cases[-1]] + [case for case in cases if case.id.endswith("-tma")][:1]
    return [pytest.param(name, case.values, id=f"{name}-{case.id}") for case in chosen]


def _run_without_values(fn, formula, inputs, dtype, names, device, baseline=None, grad_parts=None, **kwargs):
    """``check_against_formula``'s call of ``fn`` on ``device`` in ``dtype``, forward and backward,
    with what a simulated tensor can show checked: each output's dtype and device, and a gradient of
    each input's shape for every input the formula differentiates."""
    cast = [None if t is None else t.to(device, dtype) for t in inputs]
    outs, grads, _ = outputs_and_grads(fn, cast, **kwargs)
    _, formula_grads, _ = outputs_and_grads(
        formula, [None if t is None else t.double() for t in inputs], **kwargs
    )
    for i, out in enumerate(outs):
        assert (out.dtype, out.device.type) == (dtype, torch.device(device).type), f"output {i}"
    for name, grad, formula_grad, given in zip(names, grads, formula_grads, cast):
        if formula_grad is not None:
            assert grad is not None and grad.shape == given.shape, f"d{name}"


@pytest.mark.parametrize("name,values", [case for name in TILE_TESTS for case in _cases(name)])
def test_a_tile_test_runs_its_pinned_tile_on_the_simulated_device(sim, monkeypatch, name, values):
    monkeypatch.setattr(test_tiles, "check_against_formula", _run_without_values)
    getattr(test_tiles, name)(monkeypatch, *values)
