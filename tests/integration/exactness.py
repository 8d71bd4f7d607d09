"""Patch a copy of a model and compare it with the original: outputs and every parameter gradient."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

import vit_kernels as vk

TOLERANCE = 1e-10  # float64
FLOAT32_FLOOR = (1e-4, 1e-4)  # (atol, rtol) below which float32 differences are not judged


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
        torch.testing.assert_close(
            got, param.grad, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, name=name: f"{name}: {m}"
        )
        grad_diff = max(grad_diff, (got - param.grad).abs().max().item())
    return output_diff, grad_diff


def _output_and_grads(
    model: nn.Module,
    inputs: torch.Tensor,
    cotangent: torch.Tensor,
    output_of: Callable[[object], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """{"output": output, parameter name: its gradient} after backpropagating ``cotangent``."""
    model.zero_grad(set_to_none=True)
    out = output_of(model(inputs))
    (out * cotangent.to(out.dtype)).sum().backward()
    values = {"output": out.detach()}
    values.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return values


def compare_in_float32(
    reference: nn.Module,
    patched: nn.Module,
    inputs: torch.Tensor,
    backend_name: str,
    output_of: Callable[[object], torch.Tensor] = lambda out: out,
) -> tuple[float, float]:
    """``reference`` in float64 is the truth; a float32 copy of it is PyTorch's own float32 answer
    (both on the torch backend). The float32 ``patched`` model runs on ``backend_name``: its output
    and every parameter gradient must be within max(FLOAT32_FLOOR, 2 x PyTorch's own float32
    error) of the truth. Returns (max output error, max gradient error) of the patched model."""
    truth_model = reference.double()
    baseline_model = copy.deepcopy(reference).float()
    cotangent = torch.randn_like(output_of(truth_model(inputs.double())))
    truth = _output_and_grads(truth_model, inputs.double(), cotangent, output_of)
    baseline = _output_and_grads(baseline_model, inputs.float(), cotangent, output_of)
    with vk.use_backend(backend_name):
        ours = _output_and_grads(patched.float(), inputs.float(), cotangent, output_of)
    assert ours.keys() == truth.keys(), (
        f"gradients differ in which parameters have one: {ours.keys() ^ truth.keys()}"
    )
    atol, rtol = FLOAT32_FLOOR
    worst = {"output": 0.0, "gradient": 0.0}
    for name, exact in truth.items():
        error = (ours[name].double() - exact).abs().max().item()
        own = (baseline[name].double() - exact).abs().max().item()
        bound = max(atol + rtol * exact.abs().max().item(), 2 * own)
        assert error <= bound, (
            f"{name}: error {error:.3g} > bound {bound:.3g} (PyTorch's own float32 error {own:.3g})"
        )
        kind = "output" if name == "output" else "gradient"
        worst[kind] = max(worst[kind], error)
    return worst["output"], worst["gradient"]


def tiny_transformers_config(config_name: str, layers: int = 2, **extra):
    """The transformers config ``config_name`` at the tests' tiny size (width 32, 4 heads, hidden 64,
    32 x 32 images in 8 x 8 patches); ``extra``: more config fields."""
    import transformers

    return getattr(transformers, config_name)(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        **extra,
    )


def tiny_transformers_model(config_name: str, model_name: str, layers: int = 2, **extra) -> nn.Module:
    """A freshly initialised transformers vision model ``model_name`` of the tiny config
    ``config_name`` (``tiny_transformers_config``), on SDPA."""
    import transformers

    config = tiny_transformers_config(config_name, layers, **extra)
    return getattr(transformers, model_name)._from_config(config, attn_implementation="sdpa")
