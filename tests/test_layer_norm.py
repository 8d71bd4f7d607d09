"""vk.layer_norm (with and without the fused residual add) against a float64 formula."""

import pytest
import torch

import vit_kernels as vk
from tests.helpers import backend_dtypes, check_against_formula, device_backend_dtypes


def layer_norm_formula(x, weight, bias, residual, eps):
    s = x if residual is None else x + residual
    mean = s.mean(-1, keepdim=True)
    var = ((s - mean) ** 2).mean(-1, keepdim=True)
    y = (s - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y if residual is None else (y, s)


def run_layer_norm(x, weight, bias, residual, eps):
    return vk.layer_norm(x, weight, bias, eps, residual=residual)


def check_layer_norm_against_formula(inputs, dtype, device=None, eps=1e-5, check=check_against_formula):
    """vk.layer_norm on ``inputs`` = [x (..., D), weight (D,) or None, bias (D,) or None, residual
    (..., D) or None] in ``dtype`` on ``device`` (by default the inputs' own) against
    layer_norm_formula in float64: y (..., D), with a residual also x + residual (..., D), and every
    input's gradient. ``check`` is the comparison, ``check_against_formula`` unless a caller passes
    its own."""
    check(
        run_layer_norm,
        layer_norm_formula,
        inputs,
        dtype,
        ["x", "weight", "bias", "residual"],
        device,
        eps=eps,
    )


@pytest.mark.pairwise
@pytest.mark.parametrize(
    "shape", [(4, 48), (2, 197, 192), (3, 5, 1023), (1, 1), (7, 13), (2, 17, 768), (37, 384)]
)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    "device,backend_name,dtype",
    device_backend_dtypes("layer_norm", backend_dtypes([torch.float32, torch.float16, torch.bfloat16])),
)
def test_layer_norm(device, backend_name, dtype, shape, with_residual):
    dim = shape[-1]
    inputs = [
        torch.randn(shape) * 3 + 1,
        torch.randn(dim),
        torch.randn(dim),
        torch.randn(shape) if with_residual else None,
    ]
    with vk.use_backend(backend_name):
        check_layer_norm_against_formula(inputs, dtype, device, eps=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_layer_norm_partial_affine(on_backend, with_residual, affine):
    dim = 10
    inputs = [
        torch.randn(3, dim),
        torch.randn(dim) if affine == "weight" else None,
        torch.randn(dim) if affine == "bias" else None,
        torch.randn(3, dim) if with_residual else None,
    ]
    check_layer_norm_against_formula(inputs, torch.float32, eps=1e-6)


def test_layer_norm_strided_rows(on_backend):
    """Rows of a wider buffer (outer stride > D) are read in place."""
    wide = torch.randn(6, 40)
    x = wide[:, 4:36]
    check_layer_norm_against_formula([x, torch.randn(32), torch.randn(32), None], torch.float32, eps=1e-5)


def test_only_the_sum_is_used(on_backend):
    """A gradient reaching only s = x + r (not y) flows to x and r unchanged."""
    x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    _, s = vk.layer_norm(x, torch.ones(16), torch.zeros(16), residual=r)
    g = torch.randn(4, 16)
    s.backward(g)
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(r.grad, g)


def test_layer_norm_returns_sum_with_residual():
    x, r = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    y, s = vk.layer_norm(x, torch.ones(8), torch.zeros(8), residual=r)
    torch.testing.assert_close(s, x + r)
    assert y.shape == x.shape


def test_layer_norm_under_autocast_computes_in_float32():
    x = torch.randn(4, 16).bfloat16()
    residual = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, s = vk.layer_norm(x, torch.ones(16), torch.zeros(16), residual=residual)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(s, x.float() + residual)


def test_a_loss_on_the_residual_sum_alone(on_backend):
    """Only x + residual reaches the loss (the normalised output is unused): its gradient flows to
    x and the residual, none to the affine parameters."""
    x, residual = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    weight, bias = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    x.requires_grad_(True)
    residual.requires_grad_(True)
    upstream = torch.randn(3, 5, 16)
    _, summed = vk.layer_norm(x, weight, bias, residual=residual)
    grads = torch.autograd.grad((summed * upstream).sum(), (x, residual, weight, bias), allow_unused=True)
    torch.testing.assert_close(grads[0], upstream)
    torch.testing.assert_close(grads[1], upstream)
    assert all(g is None or not g.any() for g in grads[2:])
