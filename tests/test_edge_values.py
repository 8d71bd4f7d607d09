"""Non-finite and empty inputs behave on every backend as they do in PyTorch: NaN and Inf propagate
to the same outputs and gradients (no clamping), empty batches give empty results, and inputs
PyTorch refuses are refused by every backend with the same Python exception type. Non-finite and
empty inputs run on CUDA too (``gpu`` cases), against PyTorch's float32 results on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vit_kernels as vk
from tests.helpers import (
    CPU_BACKENDS,
    CUDA_DTYPES,
    DTYPE_NAMES,
    TOLERANCES,
    cuda_param,
    device_backends,
    exact_float32,
    skip_unless_offered,
)
from vit_kernels import _ext


def run(fn, inputs, device="cpu"):
    """fn(*leaves) on ``device`` and the gradient of every tensor input for a fixed upstream gradient
    of ones; float32 without TF32 on CUDA (as on the CPU)."""
    leaves = [
        t.detach().clone().to(device).requires_grad_(True) if isinstance(t, torch.Tensor) else t
        for t in inputs
    ]
    with exact_float32(device):
        result = fn(*leaves)
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        targets = [t for t in leaves if isinstance(t, torch.Tensor)]
        grads = torch.autograd.grad(outs, targets, [torch.ones_like(o) for o in outs], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """NaN where PyTorch has NaN, the same infinities, close finite values."""
    actual = actual.cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual.isnan(), expected.isnan()), (
        f"{what}: NaN at {actual.isnan().nonzero().tolist()}, PyTorch at {expected.isnan().nonzero().tolist()}"
    )
    assert torch.equal(actual.isposinf(), expected.isposinf()), f"{what}: +inf differs from PyTorch"
    assert torch.equal(actual.isneginf(), expected.isneginf()), f"{what}: -inf differs from PyTorch"
    finite = expected.isfinite()
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(
        actual[finite], expected[finite], atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def poke(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


NAN, INF = float("nan"), float("inf")

# (name, our op, PyTorch's own composition, inputs): one non-finite value placed in an input.
x8, w5, b5 = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5)
r5 = torch.randn(4, 5)
ln_w, ln_b = torch.randn(8), torch.randn(8)
w_hidden, w_out = torch.randn(6, 8), torch.randn(8, 6)
qkv = torch.randn(2, 5, 24)
# An +inf in key 3 of image 1, head 0 (head dim 4), at dimension 1, where every query of that head
# has a negative component: every score against that key is -inf, so the forward is finite and the
# gradient NaN only in dQ's dimension 1 (0 * inf), while dK and dV stay finite.
qkv_inf_key = qkv.clone()
qkv_inf_key[1, :, 1] = -qkv_inf_key[1, :, 1].abs() - 0.5
qkv_inf_key[1, 3, 9] = float("inf")
images, patch_w = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 4, 4)


def torch_attention(qkv, probs=False):
    """softmax(q k^T / sqrt(Dh)) v with PyTorch's softmax: NaN and Inf as the math gives them."""
    b, length, three_d = qkv.shape
    q, k, v = qkv.unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
    p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    out = (p @ v).transpose(1, 2).reshape(b, length, three_d // 3)
    return (out, p) if probs else out


class MathGelu(torch.autograd.Function):
    """GELU and its derivative evaluated element by element with Python's ``math`` (libm, scalar):
    the IEEE value of the formula, the same on every CPU. PyTorch's own vectorised GELU is not:
    on AVX-512 it returns NaN for +inf, where the formula (and PyTorch on AVX2) gives +inf.
        none: gelu(u) = u Phi(u),  gelu'(u) = Phi(u) + u phi(u)
        tanh: gelu(u) = u (1 + tanh(t)) / 2,  t = c (u + 0.044715 u^3),  c = sqrt(2 / pi)
              gelu'(u) = (1 + tanh(t)) / 2 + u (1 - tanh(t)^2) c (1 + 3 * 0.044715 u^2) / 2
        quick: gelu(u) = u s,  s = 1 / (1 + exp(-1.702 u)),  gelu'(u) = s + 1.702 u s (1 - s)"""

    @staticmethod
    def forward(ctx, u, approximate):
        ctx.save_for_backward(u)
        ctx.approximate = approximate
        return MathGelu.elementwise(u, approximate, derivative=False)

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        return grad * MathGelu.elementwise(u, ctx.approximate, derivative=True), None

    @staticmethod
    def elementwise(u: torch.Tensor, approximate: str, derivative: bool) -> torch.Tensor:
        def value(x: float) -> float:
            if approximate == "tanh":
                c = math.sqrt(2 / math.pi)
                th = math.tanh(c * (x + 0.044715 * x**3))
                if derivative:
                    return (1 + th) / 2 + x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x) / 2
                return x * (1 + th) / 2
            if approximate == "quick":
                s = 1 / (1 + math.exp(-1.702 * x)) if x > -400 else 0.0  # exp overflows past -417
                return s + 1.702 * x * s * (1 - s) if derivative else x * s
            cdf = (1 + math.erf(x / math.sqrt(2))) / 2
            return cdf + x * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if derivative else x * cdf

        flat = [value(float(x)) for x in u.detach().double().flatten().tolist()]
        return torch.tensor(flat, dtype=torch.float64).reshape(u.shape).to(u.dtype)


def math_gelu(u: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return MathGelu.apply(u, approximate)


def linear_residual(x, w, b, r):
    return vk.linear(x, w, b, residual=r)


def linear_residual_reference(x, w, b, r):
    return F.linear(x, w, b) + r


def layer_norm(x, w, b):
    return vk.layer_norm(x, w, b)


def layer_norm_reference(x, w, b):
    return F.layer_norm(x, (8,), w, b, 1e-6)


def attention_probs(t):
    return vk.attention(t, 2, return_probs=True)


def attention_probs_reference(t):
    return torch_attention(t, True)


def patch_embed(x, w):
    return vk.patch_embed(x, w, patch_size=4)


def patch_embed_reference(x, w):
    return F.conv2d(x, w, stride=4).flatten(2).transpose(1, 2)


def linear_gelu_and_reference(approximate="none"):
    """(our op, PyTorch's composition) of linear_gelu with GELU ``approximate``."""
    return (
        lambda x, w, b: vk.linear_gelu(x, w, b, approximate=approximate),
        lambda x, w, b: math_gelu(F.linear(x, w, b), approximate),
    )


NON_FINITE_CASES = [
    ("layer_norm nan", layer_norm, layer_norm_reference, [poke(x8, (1, 2), NAN), ln_w, ln_b]),
    ("layer_norm inf", layer_norm, layer_norm_reference, [poke(x8, (1, 2), INF), ln_w, ln_b]),
    ("layer_norm 1e30 (variance overflows)", layer_norm, layer_norm_reference, [x8 * 1e30, ln_w, ln_b]),
    # linear with a residual: the extension implements linear only fused with its residual add.
    ("linear nan", linear_residual, linear_residual_reference, [poke(x8, (0, 3), NAN), w5, b5, r5]),
    ("linear inf bias", linear_residual, linear_residual_reference, [x8, w5, poke(b5, (2,), -INF), r5]),
    ("linear inf residual", linear_residual, linear_residual_reference, [x8, w5, b5, poke(r5, (1, 4), INF)]),
    ("linear_gelu +inf", *linear_gelu_and_reference(), [x8, w5, poke(b5, (1,), INF)]),
    ("linear_gelu -inf tanh", *linear_gelu_and_reference("tanh"), [x8, w5, poke(b5, (1,), -INF)]),
    ("linear_gelu +inf quick", *linear_gelu_and_reference("quick"), [x8, w5, poke(b5, (1,), INF)]),
    ("linear_gelu -inf quick", *linear_gelu_and_reference("quick"), [x8, w5, poke(b5, (3,), -INF)]),
    ("linear_gelu nan", *linear_gelu_and_reference(), [poke(x8, (2, 0), NAN), w5, b5]),
    (
        "mlp nan",
        lambda x, w1, w2: vk.mlp(x, w1, None, w2, None),
        lambda x, w1, w2: F.linear(math_gelu(F.linear(x, w1)), w2),
        [poke(x8, (3, 7), NAN), w_hidden, w_out],
    ),
    ("attention nan (probs)", attention_probs, attention_probs_reference, [poke(qkv, (0, 1, 0), NAN)]),
    ("attention +inf key (probs)", attention_probs, attention_probs_reference, [poke(qkv, (1, 3, 9), INF)]),
    (
        "attention +inf key, all scores -inf (probs)",
        attention_probs,
        attention_probs_reference,
        [qkv_inf_key],
    ),
    ("attention +inf key, all scores -inf", lambda t: vk.attention(t, 2), torch_attention, [qkv_inf_key]),
    ("attention nan", lambda t: vk.attention(t, 2), torch_attention, [poke(qkv, (0, 1, 0), NAN)]),
    ("attention -inf value", lambda t: vk.attention(t, 2), torch_attention, [poke(qkv, (1, 2, 20), -INF)]),
    ("patch_embed nan", patch_embed, patch_embed_reference, [poke(images, (1, 2, 5, 6), NAN), patch_w]),
    ("patch_embed inf", patch_embed, patch_embed_reference, [poke(images, (0, 0, 0, 0), INF), patch_w]),
]


def torch_backend_exemption(name: str) -> str | None:
    """Why the torch backend (PyTorch's own ops) is not held to the formula in case ``name``, or None.

    Its attention without probabilities is F.scaled_dot_product_attention, whose fused CPU kernel
    does not follow the math for non-finite inputs (a NaN query gives a finite row); its GELU is
    F.gelu, whose vectorised CPU kernel returns NaN for +inf on AVX-512 CPUs (+inf on AVX2). Both are
    PyTorch's own behaviour, which depends on the CPU; the kernel backends are held to the formula."""
    if name.startswith("attention") and "probs" not in name:
        return "SDPA's fused CPU kernel does not follow the math for non-finite inputs"
    if name == "linear_gelu +inf":
        return "PyTorch's vectorised CPU GELU gives NaN for +inf on AVX-512 (+inf on AVX2)"
    return None


def kernel_op(name: str) -> str:
    return name.split()[0]


@pytest.mark.parametrize("device,backend_name", device_backends())
@pytest.mark.parametrize("name,op,reference,inputs", NON_FINITE_CASES, ids=[c[0] for c in NON_FINITE_CASES])
def test_non_finite_values_propagate_as_in_pytorch(device, backend_name, name, op, reference, inputs):
    skip_unless_offered(kernel_op(name), backend_name, device)
    exemption = torch_backend_exemption(name) if backend_name == "torch" else None
    if exemption is not None:
        pytest.skip(f"the torch backend is PyTorch's own op here: {exemption}")
    expected_outs, expected_grads = run(reference, inputs)
    with vk.use_backend(backend_name):
        outs, grads = run(op, inputs, device)
    for i, (o, e) in enumerate(zip(outs, expected_outs)):
        assert_same_values(o, e, f"{name} on {backend_name}: output {i}")
    for i, (g, e) in enumerate(zip(grads, expected_grads)):
        assert_same_values(g, e, f"{name} on {backend_name}: gradient of input {i}")


# Empty inputs: (name, op, inputs, expected output shape)
EMPTY_CASES = [
    ("linear no rows", linear_residual, [torch.randn(0, 8), w5, b5, torch.randn(0, 5)], (0, 5)),
    ("linear K = 0", linear_residual, [torch.randn(3, 0), torch.randn(5, 0), b5, torch.randn(3, 5)], (3, 5)),
    (
        "linear N = 0",
        lambda x, w, r: vk.linear(x, w, residual=r),
        [torch.randn(3, 8), torch.randn(0, 8), torch.randn(3, 0)],
        (3, 0),
    ),
    (
        "linear_gelu K = 0",
        lambda x, w, b: vk.linear_gelu(x, w, b),
        [torch.randn(2, 3, 0), torch.randn(5, 0), b5],
        (2, 3, 5),
    ),
    (
        "mlp no rows",
        lambda x, w1, w2: vk.mlp(x, w1, None, w2, None),
        [torch.randn(0, 8), w_hidden, w_out],
        (0, 8),
    ),
    (
        "mlp hidden = 0",
        lambda x, w1, w2, b2: vk.mlp(x, w1, None, w2, b2),
        [torch.randn(2, 8), torch.randn(0, 8), torch.randn(8, 0), ln_b],
        (2, 8),
    ),
    ("layer_norm no rows", layer_norm, [torch.randn(0, 8), ln_w, ln_b], (0, 8)),
    ("attention no images", lambda t: vk.attention(t, 2), [torch.randn(0, 5, 24)], (0, 5, 8)),
    ("patch_embed no images", patch_embed, [torch.randn(0, 3, 8, 8), patch_w], (0, 4, 8)),
]


@pytest.mark.parametrize("device,backend_name", device_backends())
@pytest.mark.parametrize("name,op,inputs,shape", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES])
def test_empty_inputs_give_what_pytorch_gives(device, backend_name, name, op, inputs, shape):
    skip_unless_offered(kernel_op(name), backend_name, device)
    with vk.use_backend("torch"):
        expected_outs, expected_grads = run(op, inputs)
    with vk.use_backend(backend_name):
        outs, grads = run(op, inputs, device)
    assert tuple(outs[0].shape) == shape
    for o, e in zip(outs + grads, expected_outs + expected_grads):
        assert (o is None) == (e is None)
        if e is not None:
            assert_same_values(o, e, f"{name} on {backend_name}")


# Inputs PyTorch refuses (F.conv2d on an image smaller than a patch; a LayerNorm over zero features is
# refused here as meaningless) raise the same ValueError, naming the argument, on every backend.
REFUSED_CASES = [
    (
        "patch_embed 0x0 images",
        lambda: vk.patch_embed(torch.randn(2, 3, 0, 0), patch_w, patch_size=4),
        "images height and width",
    ),
    (
        "attention without tokens",
        lambda: vk.attention(torch.randn(2, 0, 24), 2),
        "qkv must hold at least one token",
    ),
    (
        "layer_norm of width 0",
        lambda: vk.layer_norm(torch.randn(3, 0), None, None),
        "x must have a non-empty last dimension",
    ),
]


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("name,call,message", REFUSED_CASES, ids=[c[0] for c in REFUSED_CASES])
def test_refused_inputs_raise_the_same_error_everywhere(backend_name, name, call, message):
    with vk.use_backend(backend_name), pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(_ext.extension_unavailable_reason() is not None, reason="vit_kernels._C is not built")
@pytest.mark.parametrize(
    "device,dtype",
    [
        *[
            pytest.param("cpu", dt, id=f"dtype{i}")
            for i, dt in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16))
        ],
        *[
            cuda_param("cuda", dt, id=DTYPE_NAMES[dt], skip_reason=_ext.supports(torch.device("cuda"), dt))
            for dt in CUDA_DTYPES
        ],
    ],
)
def test_extension_softmax_non_finite_rows_as_torch(device, dtype):
    """NaN anywhere in a row, +inf, or a row of -inf give NaN rows as torch.softmax does; large
    finite logits stay exact."""
    rows = torch.tensor(
        [
            [NAN, 1.0, 2.0, 0.5],
            [INF, 1.0, 2.0, 0.5],
            [-INF, -INF, -INF, -INF],
            [-INF, 1.0, -INF, 3.0],
            [80.0, -80.0, 0.0, 1.0],
            [1e4, 1.0, -1e4, 2.0],
        ]
    ).to(dtype)
    ours = torch.ops.vit_kernels.softmax(rows.to(device))
    assert_same_values(ours, torch.softmax(rows, dim=-1), f"softmax {dtype} on {device}")
    x = torch.linspace(-120.0, 100.0, 4096, dtype=torch.float32, device=device).reshape(-1, 4)
    assert torch.isfinite(torch.ops.vit_kernels.softmax(x)).all()
    torch.testing.assert_close(torch.ops.vit_kernels.softmax(x), torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
