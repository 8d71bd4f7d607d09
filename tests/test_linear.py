"""vk.linear, vk.linear_gelu and vk.mlp against explicit float64 formulas, output and every gradient."""

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import (
    CPU_BACKENDS,
    GELU_APPROXIMATIONS,
    assert_within_pytorch_error,
    backend_dtypes,
    check_against_formula,
    device_backend_dtypes,
    gelu_formula,
)
from vit_kernels.activations import GELU_FORMS, gelu_act

CPU_PAIRS = backend_dtypes([torch.float32, torch.float16])


def linear_formula(x, weight, bias, residual):
    out = torch.einsum("...k,nk->...n", x, weight)
    out = out if bias is None else out + bias
    return out if residual is None else out + residual


def linear_gelu_formula(x, weight, bias, approximate):
    return gelu_formula(linear_formula(x, weight, bias, None), approximate)


def mlp_formula(x, w1, b1, w2, b2, residual, approximate):
    return linear_formula(linear_gelu_formula(x, w1, b1, approximate), w2, b2, residual)


MLP_INPUT_NAMES = ["x", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "residual"]


def mlp_inputs(rows, d, hidden, with_bias=True, with_residual=True) -> list:
    """Random vk.mlp inputs in MLP_INPUT_NAMES' order: x (*rows, d), fc1 weight (hidden, d) and bias
    (hidden,), fc2 weight (d, hidden) and bias (d,), residual (*rows, d); the weights scaled by
    1 / sqrt(fan-in), the biases or the residual None where left out."""
    return [
        torch.randn(*rows, d),
        torch.randn(hidden, d) / math.sqrt(d),
        torch.randn(hidden) if with_bias else None,
        torch.randn(d, hidden) / math.sqrt(hidden),
        torch.randn(d) if with_bias else None,
        torch.randn(*rows, d) if with_residual else None,
    ]


def run_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual, approximate):
    return vk.mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate=approximate, residual=residual)


def check_mlp_against_formula(inputs, dtype, device=None, approximate="none", check=check_against_formula):
    """vk.mlp on ``inputs`` (MLP_INPUT_NAMES' order, as ``mlp_inputs`` gives them) with the GELU
    ``approximate`` in ``dtype`` on ``device`` (by default the inputs' own) against mlp_formula in
    float64: the output (..., D) and every input's gradient. ``check`` is the comparison,
    ``check_against_formula`` unless a caller passes its own."""
    check(run_mlp, mlp_formula, inputs, dtype, MLP_INPUT_NAMES, device, approximate=approximate)


SHAPES = [
    ((5, 48), 48, 192),
    ((2, 17, 64), 64, 1023),
    ((3, 7, 13), 13, 31),
    ((1, 1, 1), 1, 3),
    ((2, 197, 48), 48, 48),
]


@pytest.mark.pairwise
@pytest.mark.parametrize("x_shape,k,n", SHAPES)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("device,backend_name,dtype", device_backend_dtypes("linear", CPU_PAIRS))
def test_linear(device, backend_name, dtype, x_shape, k, n, with_bias, with_residual):
    if backend_name == "extension" and not with_residual:
        pytest.skip("the extension's linear takes only calls with a residual to fuse (a limit in its table)")
    inputs = [
        torch.randn(x_shape),
        torch.randn(n, k) / math.sqrt(k),
        torch.randn(n) if with_bias else None,
        torch.randn(*x_shape[:-1], n) if with_residual else None,
    ]

    def run(x, w, b, r):
        return vk.linear(x, w, b, residual=r)

    with vk.use_backend(backend_name):
        check_against_formula(run, linear_formula, inputs, dtype, ["x", "weight", "bias", "residual"], device)


# The 1,023-column shape (about 4 s a case under the interpreter) in the slow run; test_linear and
# test_mlp keep an odd wide GEMM in the default one
_GELU_SHAPES = [
    pytest.param(*shape, marks=pytest.mark.slow) if shape[2] == 1023 else shape for shape in SHAPES
]


@pytest.mark.pairwise
@pytest.mark.parametrize("x_shape,k,n", _GELU_SHAPES)
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device,backend_name,dtype", device_backend_dtypes("linear_gelu", CPU_PAIRS))
def test_linear_gelu(device, backend_name, dtype, x_shape, k, n, approximate, with_bias):
    inputs = [torch.randn(x_shape), torch.randn(n, k) / math.sqrt(k), torch.randn(n) if with_bias else None]
    with vk.use_backend(backend_name):
        check_against_formula(
            lambda x, w, b, approximate: vk.linear_gelu(x, w, b, approximate=approximate),
            linear_gelu_formula,
            inputs,
            dtype,
            ["x", "weight", "bias"],
            device,
            approximate=approximate,
        )


@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("device,backend_name,dtype", device_backend_dtypes("linear_gelu", CPU_PAIRS))
def test_linear_gelu_without_gradients(device, backend_name, dtype, approximate):
    """Inference may take other paths (on CUDA the extension's tanh form is one cuBLASLt GEMM with its
    bias + GELU epilogue): the GELU asked for is the one computed, within twice PyTorch's own error."""
    inputs = [torch.randn(3, 50, 64) * 2, torch.randn(200, 64) / 8, torch.randn(200)]
    exact = linear_gelu_formula(*(t.double() for t in inputs), approximate)
    cast = [t.to(device, dtype) for t in inputs]
    with torch.no_grad():
        with vk.use_backend(backend_name, strict=True):
            out = vk.linear_gelu(*cast, approximate=approximate)
        with vk.use_backend("torch"):
            own = vk.linear_gelu(*cast, approximate=approximate)
    assert out.dtype == dtype and out.shape == exact.shape
    assert_within_pytorch_error("output", out, own, exact, dtype, torch.device(device))


@pytest.mark.pairwise
@pytest.mark.parametrize(
    "x_shape,d,hidden", [((2, 17, 48), 48, 192), ((3, 5, 13), 13, 1023), ((4, 8), 8, 32)]
)
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("with_residual,with_bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("device,backend_name,dtype", device_backend_dtypes("mlp", CPU_PAIRS))
def test_mlp(device, backend_name, dtype, x_shape, d, hidden, approximate, with_residual, with_bias):
    inputs = mlp_inputs(x_shape[:-1], d, hidden, with_bias, with_residual)
    with vk.use_backend(backend_name):
        check_mlp_against_formula(inputs, dtype, device, approximate)


def test_strided_input_is_read_in_place(on_backend):
    wide = torch.randn(2, 9, 40)
    x = wide[:, :, 3:35]  # rows with an outer stride of 40
    w, b = torch.randn(24, 32) / 6, torch.randn(24)
    check_against_formula(
        lambda x, w, b: vk.linear_gelu(x, w, b),
        lambda x, w, b: linear_gelu_formula(x, w, b, "none"),
        [x, w, b],
        torch.float32,
        ["x", "weight", "bias"],
    )


def test_gelu_saturates_without_nan(on_backend):
    """Pre-activations of +-1e4: gelu and its gradient stay finite and exact (every form)."""
    x = torch.tensor([[1.0], [-1.0], [0.0]], requires_grad=True)
    w = torch.tensor([[1e4]])
    for approximate in GELU_APPROXIMATIONS:
        y = vk.linear_gelu(x, w, approximate=approximate)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(y, torch.tensor([[1e4], [0.0], [0.0]]))
        torch.testing.assert_close(g, torch.tensor([[1e4], [0.0], [5e3]]))


def test_autocast_casts_gemm_operands_and_promotes_residual():
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    residual = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = vk.linear(x, w, b)
        with_residual = vk.linear(x, w, b, residual=residual)
        gelu = vk.linear_gelu(x, w, b)
    assert plain.dtype == torch.bfloat16 and gelu.dtype == torch.bfloat16
    assert with_residual.dtype == torch.float32
    torch.testing.assert_close(with_residual, linear_formula(x, w, b, residual), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("residual_layout", ["transposed", "expanded"])
def test_strided_bias_and_residual_are_read_by_strides(on_backend, residual_layout):
    """A bias with stride 2 and a residual whose last dimension is not unit-stride (a transposed
    view, or a broadcast with stride 0): valid inputs, the same answer as the formula."""
    x = torch.randn(3, 5, 16)
    w1, w2 = torch.randn(24, 16) / 4, torch.randn(16, 24) / 5
    b1, b2 = torch.randn(48)[::2], torch.randn(32)[::2]
    if residual_layout == "transposed":
        residual = torch.randn(3, 16, 5).transpose(1, 2)
    else:
        residual = torch.randn(1, 1, 16).expand(3, 5, 16)
    assert b1.stride() == (2,) and (residual.stride(-1) != 1 or residual.stride(0) == 0)
    check_against_formula(
        lambda x, w, b, r: vk.linear(x, w, b, residual=r),
        linear_formula,
        [x, torch.randn(16, 16) / 4, b2, residual],
        torch.float32,
        ["x", "weight", "bias", "residual"],
    )
    check_mlp_against_formula([x, w1, b1, w2, b2, residual], torch.float32)


def test_deep_weight_gradient_is_split_over_k():
    """The weight gradient of a (4 x 197)-row input runs as a split-K GEMM (partial sums added in
    float32) and matches the formula."""
    from vit_kernels.ops.gemm import split_k_slices

    if "triton" not in CPU_BACKENDS:
        pytest.skip("the Triton backend needs TRITON_INTERPRET=1 on the CPU")
    assert split_k_slices(48, 40, 4 * 197, torch.device("cpu")) > 1
    inputs = [torch.randn(4, 197, 40), torch.randn(48, 40) / 7, torch.randn(48), None]
    with vk.use_backend("triton"):
        check_against_formula(
            lambda x, w, b, r: vk.linear(x, w, b, residual=r),
            linear_formula,
            inputs,
            torch.float32,
            ["x", "weight", "bias", "residual"],
        )


@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("device,backend_name,dtype", device_backend_dtypes("mlp", CPU_PAIRS))
def test_mlp_without_gradients(device, backend_name, dtype, approximate, with_residual):
    """Inference takes its own path on Triton (the pre-activation is not written): same formula."""
    inputs = [
        torch.randn(2, 33, 48),
        torch.randn(96, 48) / 7,
        torch.randn(96),
        torch.randn(40, 96) / 10,
        torch.randn(40),
        torch.randn(2, 33, 40) if with_residual else None,
    ]
    exact = mlp_formula(*(None if t is None else t.double() for t in inputs), approximate)
    cast = [None if t is None else t.to(device, dtype) for t in inputs]
    with torch.no_grad():
        with vk.use_backend(backend_name, strict=True):
            out = vk.mlp(*cast[:5], approximate=approximate, residual=cast[5])
        with vk.use_backend("torch"):
            own = vk.mlp(*cast[:5], approximate=approximate, residual=cast[5])
    assert out.dtype == dtype and out.shape == exact.shape
    assert_within_pytorch_error("output", out, own, exact, dtype, torch.device(device))


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
def test_triton_inference_writes_no_preactivation():
    """Without gradients the GELU GEMMs launch without SAVE_PREACT (the M x hidden pre-activation is
    only read by backward); with them, the pre-activation is written."""
    from tools.cuda_sim import simulated_cuda
    from vit_kernels.ops import linear

    def saved(grad: bool) -> set:
        with simulated_cuda(90) as device:
            x = torch.empty(4, 197, 64, device="cuda", requires_grad=grad)
            w1, b1 = torch.empty(256, 64, device="cuda"), torch.empty(256, device="cuda")
            w2, b2 = torch.empty(64, 256, device="cuda"), torch.empty(64, device="cuda")
            linear.linear_gelu_triton(x, w1, b1)
            linear.mlp_triton(x, w1, b1, w2, b2)
        return {
            launch.kwargs["SAVE_PREACT"] for launch in device.launches if launch.kwargs.get("EPILOGUE") == 1
        }

    assert saved(grad=False) == {False}
    assert saved(grad=True) == {True}


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
def test_triton_gelu_backward_reduces_the_bias_gradient(dtype, approximate):
    """dZ = dY * gelu'(Z) and sum_rows dZ (float32) from the one pass of the linear_gelu backward:
    83 rows (several row slices, the last step partial) by 37 columns (a partial column strip),
    against float64; no bias gradient when none is asked for."""
    from vit_kernels.ops import gemm

    grad, preact = torch.randn(83, 37), torch.randn(83, 37) * 3
    z = preact.to(dtype).double().requires_grad_(True)
    (want,) = torch.autograd.grad(gelu_formula(z, approximate), z, grad.to(dtype).double())
    dz, db = gemm._gelu_backward(grad.to(dtype), preact.to(dtype), GELU_FORMS[gelu_act(approximate)], True)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert dz.dtype == dtype and db.dtype == torch.float32 and db.shape == (37,)
    torch.testing.assert_close(dz.double(), want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(db.double(), want.sum(0), atol=tolerance * 10, rtol=tolerance)
    dz_only, nothing = gemm._gelu_backward(
        grad.to(dtype), preact.to(dtype), GELU_FORMS[gelu_act(approximate)], False
    )
    assert torch.equal(dz_only, dz) and nothing is None


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
def test_triton_bias_gradients_ride_in_the_passes_that_write_dz():
    """On the GPU path the GELU layers' bias gradients are reduced where dZ is written: by the
    linear_gelu backward's GELU' pass (BIAS_GRAD) and by mlp's dZ = dY W2 * gelu'(Z) GEMM
    (SUMS_OF_C_COLUMNS), and only when the bias needs one."""
    from tools.cuda_sim import simulated_cuda
    from vit_kernels.activations import GELU
    from vit_kernels.ops import gemm, linear

    def flags(with_bias: bool) -> tuple:
        with simulated_cuda(90) as device:
            x = torch.empty(4, 197, 64, device="cuda")
            w1, w2 = torch.empty(256, 64, device="cuda"), torch.empty(64, 256, device="cuda")
            out, preact = linear.linear_fwd(x, w1, None, None, GELU, True)
            _, hidden, preact2 = linear.mlp_fwd(x, w1, None, w2, None, None, GELU, True)
            linear.linear_bwd(torch.empty_like(out), x, w1, preact, GELU, with_bias)
            linear.mlp_bwd(torch.empty_like(x), x, w1, w2, hidden, preact2, GELU, with_bias, False)
        launches = device.launches
        gelu_pass = {l.kwargs["BIAS_GRAD"] for l in launches if l.kernel.fn.__name__ == "_gelu_bwd_kernel"}
        dz_gemm = {l.kwargs["SUMS"] for l in launches if l.kwargs.get("EPILOGUE") == 2}
        return gelu_pass, dz_gemm

    assert flags(with_bias=True) == ({True}, {gemm.SUMS_OF_C_COLUMNS})
    assert flags(with_bias=False) == ({False}, {gemm.SUMS_NONE})


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
@pytest.mark.parametrize("way", ["separate", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_both_ways_of_the_bias_gradient_match_the_formula(monkeypatch, way, dtype):
    """db = sum_rows dY beside dW = dY^T X, by PyTorch's sum after the GEMM ("separate") or by the
    dW GEMM's row sums ("fused", split over K slices too): both candidates, each right, through the
    linear and mlp backwards (the first of BIAS_GRAD_WAYS is what runs without a measurement)."""
    from vit_kernels.ops import gemm

    monkeypatch.setattr(gemm, "BIAS_GRAD_WAYS", (way,) + tuple(w for w in gemm.BIAS_GRAD_WAYS if w != way))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 37, 48, generator=generator, dtype=torch.float64)
    w, b = (
        torch.randn(40, 48, generator=generator, dtype=torch.float64) / 7,
        torch.randn(40, generator=generator, dtype=torch.float64),
    )
    dy = torch.randn(3, 37, 40, generator=generator, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)]
    with vk.use_backend("triton", strict=True):
        out = vk.linear(*leaves)
    grads = torch.autograd.grad(out, leaves, dy.to(dtype))
    expected = (dy @ w, dy.flatten(0, 1).t() @ x.flatten(0, 1), dy.sum((0, 1)))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(
            got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item()
        )
    dw, db = gemm._weight_and_bias_grads_by(way, dy.flatten(0, 1).to(dtype), x.flatten(0, 1).to(dtype), dtype)
    torch.testing.assert_close(
        db.double(), expected[2], rtol=tolerance, atol=tolerance * expected[2].abs().max().item()
    )
