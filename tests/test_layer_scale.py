"""LayerScale folded into the last GEMM of a branch (``layer_scale=`` of vk.linear, vk.mlp and
vk.swiglu_mlp; ``init_values`` of vit_kernels.nn.Block and vit's ViTConfig) on every backend that runs
here, against float64 formulas written out below: the output and every gradient, gamma's included."""

import math

import pytest
import torch

import vit
import vit_kernels as vk
from tests.helpers import CPU_BACKENDS, check_against_formula
from vit_kernels import nn as vkn


def _gelu(z):
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def _silu(z):
    return z / (1.0 + torch.exp(-z))


def linear_formula(x, weight, bias, residual, gamma):
    # residual + gamma * (x W^T + b)
    return residual + gamma * (x @ weight.t() + bias)


def mlp_formula(x, w1, b1, w2, b2, residual, gamma):
    return residual + gamma * (_gelu(x @ w1.t() + b1) @ w2.t() + b2)


def swiglu_mlp_formula(x, wg, bg, wu, bu, wd, bd, residual, gamma):
    return residual + gamma * ((_silu(x @ wg.t() + bg) * (x @ wu.t() + bu)) @ wd.t() + bd)


def _linear(x, weight, bias, residual, gamma):
    return vk.linear(x, weight, bias, residual=residual, layer_scale=gamma)


def _mlp(x, w1, b1, w2, b2, residual, gamma):
    return vk.mlp(x, w1, b1, w2, b2, residual=residual, layer_scale=gamma)


def _swiglu_mlp(x, wg, bg, wu, bu, wd, bd, residual, gamma):
    return vk.swiglu_mlp(x, wg, bg, wu, bu, wd, bd, residual=residual, layer_scale=gamma)


def _weight_and_bias(n_out: int, n_in: int) -> list:
    """A random GEMM weight (n_out, n_in), scaled by 1 / sqrt(n_in), and bias (n_out,)."""
    return [torch.randn(n_out, n_in) / n_in**0.5, torch.randn(n_out)]


def _inputs(op: str, rows=(2, 9), dim=24, hidden=40, out=16):
    x = torch.randn(*rows, dim)
    residual = torch.randn(*rows, out)
    gamma = torch.randn(out)  # any sign and size, not only timm's 1e-5 start
    if op == "linear":
        return [x, *_weight_and_bias(out, dim), residual, gamma]
    if op == "mlp":
        return [x, *_weight_and_bias(hidden, dim), *_weight_and_bias(out, hidden), residual, gamma]
    gate_and_up = _weight_and_bias(hidden, dim) + _weight_and_bias(hidden, dim)
    return [x, *gate_and_up, *_weight_and_bias(out, hidden), residual, gamma]


OPS = {
    "linear": (_linear, linear_formula, ["x", "weight", "bias", "residual", "gamma"]),
    "mlp": (
        _mlp,
        mlp_formula,
        ["x", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "residual", "gamma"],
    ),
    "swiglu_mlp": (
        _swiglu_mlp,
        swiglu_mlp_formula,
        [
            "x",
            "gate_weight",
            "gate_bias",
            "up_weight",
            "up_bias",
            "down_weight",
            "down_bias",
            "residual",
            "gamma",
        ],
    ),
}


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_layer_scale_matches_formula(backend_name, op):
    """residual + gamma * (the op's last projection), output and every gradient (x, weights, biases,
    residual, gamma) against the float64 formula; a backend whose table declines the call (the
    extension's SwiGLU) leaves it to auto, which is checked instead."""
    fn, formula, names = OPS[op]
    inputs = _inputs(op)
    choice = backend_name
    if backend_name == "extension" and op == "swiglu_mlp":
        choice = "auto"
    with vk.use_backend(choice, strict=choice != "auto"):
        check_against_formula(fn, formula, inputs, torch.float32, names, "cpu")


def test_layer_scale_without_residual_and_bias():
    """gamma * (x W^T) alone: no residual, no bias."""
    x, weight, gamma = (
        torch.randn(3, 8, dtype=torch.float64),
        torch.randn(5, 8, dtype=torch.float64),
        torch.randn(5, dtype=torch.float64),
    )
    with vk.use_backend("torch"):
        torch.testing.assert_close(vk.linear(x, weight, layer_scale=gamma), gamma * (x @ weight.t()))


def test_block_with_init_values_is_the_layer_scale_formula():
    """vit_kernels.nn.Block(init_values=...): x + g1 * attn(LN(x)), then + g2 * mlp(LN(.)), with
    timm's parameter names ls1.gamma and ls2.gamma; in training with drop path too (unfused add)."""
    block = vkn.Block(16, 2, mlp_ratio=2.0, init_values=0.5).double()
    with torch.no_grad():
        block.ls1.gamma.normal_()
        block.ls2.gamma.normal_()
    assert {"ls1.gamma", "ls2.gamma"} <= set(dict(block.named_parameters()))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with vk.use_backend("torch"):
        out = block.eval()(x)
    attn, mlp = block.attn, block.mlp

    def ln(t, norm):
        return torch.nn.functional.layer_norm(t, (16,), norm.weight, norm.bias, norm.eps)

    with vk.use_backend("torch"):
        s = x + block.ls1.gamma * attn(ln(x, block.norm1))
        expected = s + block.ls2.gamma * mlp(ln(s, block.norm2))
    torch.testing.assert_close(out, expected)
    (dgamma,) = torch.autograd.grad(out.sum(), block.ls1.gamma)
    (expected_dgamma,) = torch.autograd.grad(expected.sum(), block.ls1.gamma)
    torch.testing.assert_close(dgamma, expected_dgamma)


def test_vit_with_init_values_has_layer_scale_and_resets_it():
    model = vit.create_model("vit_digits", init_values=1e-4)
    gammas = [p for n, p in model.named_parameters() if n.endswith(("ls1.gamma", "ls2.gamma"))]
    assert len(gammas) == 2 * model.config.depth
    assert all(torch.equal(g, torch.full_like(g, 1e-4)) for g in gammas)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    for bad in (0.0, -1.0, float("nan"), True, "1e-5"):
        with pytest.raises(ValueError, match="init_values must be None or a positive float"):
            vit.create_model("vit_digits", init_values=bad)


BAD = [
    (dict(layer_scale=[1.0] * 5), TypeError, r"layer_scale must be a torch.Tensor \(N,\), got list"),
    (
        dict(layer_scale=torch.ones(5, dtype=torch.int64)),
        TypeError,
        r"layer_scale must be a floating-point tensor",
    ),
    (dict(layer_scale=torch.ones(1, 5)), ValueError, r"layer_scale must have 1 dimensions \(N,\)"),
    (
        dict(layer_scale=torch.ones(4)),
        ValueError,
        r"layer_scale must have shape \(N,\) with N = weight.shape\[0\]",
    ),
    (dict(layer_scale=torch.ones(5, dtype=torch.float64)), TypeError, r"layer_scale"),
    (dict(layer_scale=torch.ones(5, device="meta")), ValueError, r"layer_scale"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_layer_scale_raises(kwargs, error, message):
    with pytest.raises(error, match=message):
        vk.linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(5), **kwargs)
