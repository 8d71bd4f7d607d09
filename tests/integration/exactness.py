"""Patch a copy of a model and compare it with the original: outputs and every parameter gradient."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

import vit_kernels as vk

TOLERANCE = 1e-10  # float64


def patched_copy(model: nn.Module) -> tuple[nn.Module, vk.PatchReport]:
    """A deep copy of ``model`` with its layers patched, and the report."""
    patched = copy.deepcopy(model)
    return patched, vk.patch_model(patched)


def compare(
    reference: nn.Module,
    patched: nn.Module,
    inputs: torch.Tensor,
    output_of: Callable[[object], torch.Tensor] = lambda out: out,
) -> tuple[float, float]:
    """Run both on ``inputs``, backpropagate one random cotangent, assert the outputs and every
    parameter gradient (same names) agree to TOLERANCE; return (max output diff, max grad diff)."""
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
    expected, actual = output_of(reference(inputs)), output_of(patched(inputs))
    output_diff = (actual - expected).abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)
    cotangent = torch.randn_like(expected)
    (expected * cotangent).sum().backward()
    (actual * cotangent).sum().backward()
    reference_params = dict(reference.named_parameters())
    patched_params = dict(patched.named_parameters())
    assert patched_params.keys() == reference_params.keys(), "parameter names must not change"
    grad_diff = 0.0
    for name, param in reference_params.items():
        if param.grad is None:
            assert patched_params[name].grad is None, name
            continue
        got = patched_params[name].grad
        assert got is not None, f"{name} has no gradient after patching"
        torch.testing.assert_close(got, param.grad, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m: f"{name}: {m}")
        grad_diff = max(grad_diff, (got - param.grad).abs().max().item())
    return output_diff, grad_diff
