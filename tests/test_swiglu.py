"""vk.swiglu, vk.swiglu_mlp and vit_kernels.nn.SwiGLU against float64 formulas written here, output
and every gradient, on the reference, the Triton kernels (the interpreter on the CPU) and auto."""

import math

import pytest
import torch
import torch.nn.functional as F

import vit_kernels as vk
from tests.helpers import (
    CPU_BACKENDS,
    CUDA,
    DTYPE_NAMES,
    assert_within_pytorch_error,
    check_against_formula,
    cuda_kernel_dtypes,
    cuda_param,
    device_reason,
)
from vit_kernels import _tiles, backend
from vit_kernels.nn import SwiGLU
from vit_kernels.ops import swiglu as swiglu_ops

HAS_TRITON_CPU = "triton" in CPU_BACKENDS
needs_triton = pytest.mark.skipif(
    not HAS_TRITON_CPU, reason="the Triton backend needs TRITON_INTERPRET=1 on the CPU"
)
# (backend, dtype) on the CPU: the reference in float64 and float32, Triton (interpreted) in float32
# and float16, and auto (which never picks interpreted Triton) in float32.
CPU_PAIRS = (
    [("torch", torch.float64), ("torch", torch.float32)]
    + ([("triton", torch.float32), ("triton", torch.float16)] if HAS_TRITON_CPU else [])
    + [("auto", torch.float32)]
)


def device_backend_dtypes(op: str) -> list:
    cpu = [pytest.param("cpu", name, dt, id=f"{name}-{str(dt)[6:]}") for name, dt in CPU_PAIRS]
    return cpu + [cuda_param("cuda", "torch", torch.float64, id="torch-fp64")] + cuda_kernel_dtypes(op)


def silu(z):
    return z / (1 + torch.exp(-z))


def swiglu_formula(x, wg, bg, wu, bu):
    # h = silu(x W_g^T + b_g) * (x W_u^T + b_u)
    g = torch.einsum("...k,nk->...n", x, wg) + (0 if bg is None else bg)
    u = torch.einsum("...k,nk->...n", x, wu) + (0 if bu is None else bu)
    return silu(g) * u


def swiglu_mlp_formula(x, wg, bg, wu, bu, wd, bd, residual):
    out = torch.einsum("...k,nk->...n", swiglu_formula(x, wg, bg, wu, bu), wd)
    return out + (0 if bd is None else bd) + (0 if residual is None else residual)


# (x shape, hidden, D_out): odd sizes, EVA02's 2/3 ratio (hidden 171 of 64, not a multiple of 16), one element
SHAPES = [((3, 7, 13), 31, 13), ((2, 17, 64), 171, 40), ((5, 48), 96, 48), ((1, 1, 1), 3, 2)]
NAMES = ["x", "gate_weight", "gate_bias", "up_weight", "up_bias", "down_weight", "down_bias", "residual"]


def make_inputs(x_shape, hidden, out, with_bias, with_residual, gen=None):
    d = x_shape[-1]

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return [
        randn(*x_shape),
        randn(hidden, d, scale=1 / math.sqrt(max(d, 1))),
        randn(hidden) if with_bias else None,
        randn(hidden, d, scale=1 / math.sqrt(max(d, 1))),
        randn(hidden) if with_bias else None,
        randn(out, hidden, scale=1 / math.sqrt(hidden)),
        randn(out) if with_bias else None,
        randn(*x_shape[:-1], out) if with_residual else None,
    ]


def swiglu_call(x, wg, bg, wu, bu):
    return vk.swiglu(x, wg, bg, wu, bu)


def swiglu_mlp_call(x, wg, bg, wu, bu, wd, bd, r):
    return vk.swiglu_mlp(x, wg, bg, wu, bu, wd, bd, residual=r)


@pytest.mark.pairwise
@pytest.mark.parametrize("x_shape,hidden,out", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device,choice,dtype", device_backend_dtypes("swiglu"))
def test_swiglu(device, choice, dtype, x_shape, hidden, out, with_bias):
    inputs = make_inputs(x_shape, hidden, out, with_bias, False)[:5]
    with vk.use_backend(choice, strict=choice != "auto"):  # strict: no fallback from the backend named
        check_against_formula(swiglu_call, swiglu_formula, inputs, dtype, NAMES[:5], device)


@pytest.mark.pairwise
@pytest.mark.parametrize("x_shape,hidden,out", SHAPES)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (False, False)])
@pytest.mark.parametrize("device,choice,dtype", device_backend_dtypes("swiglu_mlp"))
def test_swiglu_mlp(device, choice, dtype, x_shape, hidden, out, with_bias, with_residual):
    inputs = make_inputs(x_shape, hidden, out, with_bias, with_residual)
    with vk.use_backend(choice, strict=choice != "auto"):
        check_against_formula(swiglu_mlp_call, swiglu_mlp_formula, inputs, dtype, NAMES, device)


@pytest.mark.parametrize("backend_name", ["torch"] + (["triton"] if HAS_TRITON_CPU else []))
def test_strided_and_transposed_operands(backend_name):
    """x cut from a wider tensor, transposed weights, a bias with stride 2 and a transposed residual:
    read by strides, the same answer as the formula."""
    x = torch.randn(3, 9, 80)[:, :, 3:67]  # D = 64: two K steps of the interpreter's tile
    wg, wu = torch.randn(64, 24).t() / 8, torch.randn(24, 64) / 8
    bg, bu = torch.randn(48)[::2], torch.randn(24)
    wd, bd = torch.randn(24, 16).t() / 5, torch.randn(16)
    residual = torch.randn(3, 16, 9).transpose(1, 2)
    assert not wg.is_contiguous() and bg.stride() == (2,) and residual.stride(-1) != 1
    with vk.use_backend(backend_name, strict=True):
        check_against_formula(
            swiglu_mlp_call, swiglu_mlp_formula, [x, wg, bg, wu, bu, wd, bd, residual], torch.float32, NAMES
        )
        check_against_formula(
            swiglu_call, swiglu_formula, [x.transpose(0, 1), wg, bg, wu, None], torch.float32, NAMES[:5]
        )


@pytest.mark.parametrize("backend_name", ["torch"] + (["triton"] if HAS_TRITON_CPU else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_without_gradients(backend_name, dtype):
    """Inference takes its own path on Triton (G and U not written): same formula."""
    inputs = make_inputs((2, 33, 48), 80, 40, True, True)
    exact = swiglu_mlp_formula(*(t.double() for t in inputs))
    cast = [t.to(dtype) for t in inputs]
    with torch.no_grad():
        with vk.use_backend(backend_name, strict=True):
            out = swiglu_mlp_call(*cast)
            hidden = swiglu_call(*cast[:5])
        with vk.use_backend("torch"):
            own, own_hidden = swiglu_mlp_call(*cast), swiglu_call(*cast[:5])
    assert out.dtype == dtype and out.shape == exact.shape
    assert_within_pytorch_error("output", out, own, exact, dtype, torch.device("cpu"))
    assert_within_pytorch_error(
        "hidden",
        hidden,
        own_hidden,
        swiglu_formula(*(t.double() for t in inputs[:5])),
        dtype,
        torch.device("cpu"),
    )


@needs_triton
def test_triton_inference_writes_no_preactivations():
    """Without gradients the dual GEMM launches without SAVE_PREACT (G and U, M x hidden each, are
    only read by backward); with them it writes both. One dual launch computes the gate and up
    projections, and swiglu_mlp's down projection is one GEMM with the residual in its epilogue."""
    from tools.cuda_sim import simulated_cuda
    from vit_kernels.ops import swiglu

    def launches(grad: bool) -> list:
        with simulated_cuda(90) as device:
            x = torch.empty(4, 197, 64, device="cuda", requires_grad=grad)
            wg, wu, b = (
                torch.empty(171, 64, device="cuda"),
                torch.empty(171, 64, device="cuda"),
                torch.empty(171, device="cuda"),
            )
            wd, r = torch.empty(64, 171, device="cuda"), torch.empty(4, 197, 64, device="cuda")
            swiglu.swiglu_triton(x, wg, b, wu, b)
            swiglu.swiglu_mlp_triton(x, wg, b, wu, b, wd, None, r)
        return device.launches

    for grad in (False, True):
        recorded = launches(grad)
        dual = [launch for launch in recorded if launch.kernel.fn.__name__ == "_swiglu_fwd_kernel"]
        assert dual and {launch.kwargs["SAVE_PREACT"] for launch in dual} == {grad}
        gemms = [launch for launch in recorded if launch.kernel.fn.__name__ == "_linear_kernel"]
        assert gemms and {launch.kwargs["HAS_RESIDUAL"] for launch in gemms} == {True}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_gating_backward_and_bias_sums(dtype):
    """dG, dU and their float32 column sums from the one elementwise pass: 83 rows (several row
    slices, the last step partial) by 37 columns (a partial strip), against float64; no sums when
    no bias gradient is asked for."""
    from vit_kernels.ops import swiglu

    dh, g, u = torch.randn(83, 37), torch.randn(83, 37) * 3, torch.randn(83, 37)
    g64, u64 = g.to(dtype).double().requires_grad_(), u.to(dtype).double().requires_grad_()
    want_g, want_u = torch.autograd.grad(silu(g64) * u64, (g64, u64), dh.to(dtype).double())
    dg, du, dbg, dbu = swiglu._swiglu_backward(dh.to(dtype), g.to(dtype), u.to(dtype), True)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert dg.dtype == du.dtype == dtype and dbg.dtype == dbu.dtype == torch.float32 and dbg.shape == (37,)
    for got, want in ((dg, want_g), (du, want_u)):
        torch.testing.assert_close(got.double(), want, atol=tolerance * 10, rtol=tolerance)
    for got, want in ((dbg, want_g), (dbu, want_u)):
        torch.testing.assert_close(got.double(), want.sum(0), atol=tolerance * 100, rtol=tolerance)
    dg_only, du_only, none_g, none_u = swiglu._swiglu_backward(dh.to(dtype), g.to(dtype), u.to(dtype), False)
    assert torch.equal(dg_only, dg) and torch.equal(du_only, du) and none_g is None and none_u is None


def timm_swiglu(state: dict, x: torch.Tensor, norm_eps=None) -> torch.Tensor:
    """timm.layers.mlp.SwiGLU.forward in float64, from its state dict: fc2(norm(silu(fc1_g(x)) * fc1_x(x)))."""
    s = {k: v.double() for k, v in state.items()}
    h = silu(F.linear(x, s["fc1_g.weight"], s.get("fc1_g.bias"))) * F.linear(
        x, s["fc1_x.weight"], s.get("fc1_x.bias")
    )
    if norm_eps is not None:
        h = F.layer_norm(h, h.shape[-1:], s["norm.weight"], s["norm.bias"], norm_eps)
    return F.linear(h, s["fc2.weight"], s.get("fc2.bias"))


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("bias", [True, (True, False)])
@pytest.mark.parametrize("backend_name", ["torch"] + (["triton"] if HAS_TRITON_CPU else []))
def test_layer_loads_timm_state_dict(backend_name, norm, bias):
    """A timm-style state dict (fc1_g, fc1_x, norm, fc2) loads unchanged, strictly, and the layer
    computes timm's formula, with the residual added."""
    d, hidden, out = 24, 64, 24
    keys = ["fc1_g.weight", "fc1_x.weight", "fc2.weight"]
    state = {
        "fc1_g.weight": torch.randn(hidden, d) / 5,
        "fc1_x.weight": torch.randn(hidden, d) / 5,
        "fc2.weight": torch.randn(out, hidden) / 8,
    }
    hidden_bias, out_bias = bias if isinstance(bias, tuple) else (bias, bias)
    if hidden_bias:
        state.update({"fc1_g.bias": torch.randn(hidden), "fc1_x.bias": torch.randn(hidden)})
    if out_bias:
        state["fc2.bias"] = torch.randn(out)
    if norm:
        state.update({"norm.weight": torch.rand(hidden) + 0.5, "norm.bias": torch.randn(hidden)})
    layer = SwiGLU(d, hidden, out, bias=bias, norm=norm).eval()
    assert set(layer.state_dict()) == set(state) and set(keys) <= set(state)
    layer.load_state_dict(state, strict=True)
    x, residual = torch.randn(2, 5, d), torch.randn(2, 5, out)
    exact = timm_swiglu(state, x.double(), 1e-6 if norm else None)
    with vk.use_backend(backend_name, strict=True), torch.no_grad():
        torch.testing.assert_close(layer(x).double(), exact, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            layer(x, residual=residual).double(), exact + residual, atol=1e-4, rtol=1e-4
        )
    y = layer.train()(x.requires_grad_())
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_layer_dropout_in_training_only():
    layer = SwiGLU(8, 16, drop=0.5)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(layer.eval()(x), layer(x))
        torch.manual_seed(0)
        dropped = layer.train()(x)
    assert not torch.allclose(dropped, layer.eval()(x))


W = torch.randn(6, 4)
BAD_CALLS = [
    ("swiglu", (torch.randn(2, 4), W, None, torch.randn(6, 5), None), ValueError, "up_weight"),
    ("swiglu", (torch.randn(2, 5), W, None, W, None), ValueError, "gate_weight.shape[1]"),
    ("swiglu", (torch.randn(2, 4), W, torch.randn(5), W, None), ValueError, "gate_bias"),
    ("swiglu", (torch.randn(2, 4), W, None, W, torch.randn(7)), ValueError, "up_bias"),
    ("swiglu", (torch.randn(2, 4), W, None, W.double(), None), TypeError, "up_weight"),
    ("swiglu", (torch.randn(2, 4), W, None, "W", None), TypeError, "up_weight"),
    ("swiglu_mlp", (torch.randn(2, 4), W, None, W, None, torch.randn(3, 5), None), ValueError, "down_weight"),
    (
        "swiglu_mlp",
        (torch.randn(2, 4), W, None, W, None, torch.randn(3, 6), torch.randn(4)),
        ValueError,
        "down_bias",
    ),
    (
        "swiglu_mlp",
        (torch.randn(2, 4), W, None, W, None, torch.randn(3, 6), None, torch.randn(2, 4)),
        ValueError,
        "residual",
    ),
    (
        "swiglu_mlp",
        (torch.randn(2, 4), W, None, W, None, torch.randn(3, 6), None, torch.randn(2, 3).half()),
        TypeError,
        "residual",
    ),
]


@pytest.mark.parametrize("op,args,error,name", BAD_CALLS)
def test_bad_inputs_name_the_argument(op, args, error, name):
    with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        if op == "swiglu":
            vk.swiglu(*args)
        else:
            vk.swiglu_mlp(*args[:7], residual=args[7] if len(args) > 7 else None)


def test_extension_declares_no_kernel():
    """The extension has no SwiGLU kernel: its table says so (strict raises naming it), auto runs another."""
    for op in ("swiglu", "swiglu_mlp"):
        assert "no SwiGLU kernel" in backend.unsupported_reason(
            op, "extension", torch.device("cpu"), torch.float32
        )
    with vk.use_backend("extension", strict=True), pytest.raises(backend.CannotRunError, match="SwiGLU"):
        vk.swiglu(torch.randn(2, 4), W, None, W, None)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("backend_name", ["triton"] if HAS_TRITON_CPU else [])
@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e4, -1e4])
def test_non_finite_and_saturating_values_match_pytorch(backend_name, value):
    """A NaN, an infinity or a huge value in x: the outputs and every gradient have NaN and
    infinities where PyTorch's own composition has them, and the same finite values."""
    x = torch.randn(3, 4)
    x[1, 2] = value
    wg, wu, wd = torch.randn(5, 4), torch.randn(5, 4), torch.randn(3, 5)
    bg, bu, bd = torch.randn(5), torch.randn(5), torch.randn(3)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        return [out.detach(), *grads]

    def pytorch(x, wg, bg, wu, bu, wd, bd):
        return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    def ours(x, wg, bg, wu, bu, wd, bd):
        return vk.swiglu_mlp(x, wg, bg, wu, bu, wd, bd)

    expected = run(pytorch)
    with vk.use_backend(backend_name, strict=True):
        actual = run(ours)
    for what, a, e in zip(["output"] + [f"d{n}" for n in NAMES[:7]], actual, expected):
        assert torch.equal(a.isnan(), e.isnan()), (
            f"{what}: NaN at {a.isnan().nonzero().tolist()}, PyTorch at {e.isnan().nonzero().tolist()}"
        )
        assert torch.equal(a.isposinf(), e.isposinf()) and torch.equal(a.isneginf(), e.isneginf()), what
        finite = e.isfinite()
        torch.testing.assert_close(
            a[finite], e[finite], atol=1e-3, rtol=1e-4, msg=lambda m, what=what: f"{what}: {m}"
        )


@pytest.mark.parametrize("backend_name", ["torch"] + (["triton"] if HAS_TRITON_CPU else []))
def test_empty_batch_and_empty_width(backend_name):
    """No rows: empty outputs and zero weight gradients; K = 0: H = silu(b_g) * b_u."""
    with vk.use_backend(backend_name, strict=True):
        inputs = make_inputs((0, 4), 6, 3, True, True)
        check_against_formula(swiglu_mlp_call, swiglu_mlp_formula, inputs, torch.float32, NAMES)
        inputs = make_inputs((3, 0), 6, 3, True, False)
        check_against_formula(swiglu_mlp_call, swiglu_mlp_formula, inputs, torch.float32, NAMES)


# ---- every entry of the dual GEMM's tile table, run on the GPU (``gpu`` cases, CUDA only) ----------------
# Compiling is not correctness (``make check-gpu`` only compiles them): each tile is pinned in turn and
# the output and every gradient stay within twice PyTorch's own error against float64. 12 x 197 rows,
# widths no tile divides (masked edges everywhere).

CUDA_SKIP = device_reason("triton", CUDA)


def dual_tile_cases() -> list:
    return [
        cuda_param(dtype, tile, id=f"{DTYPE_NAMES[dtype]}-{'x'.join(map(str, tile))}", skip_reason=CUDA_SKIP)
        for dtypes, tiles in (
            ((torch.float16, torch.bfloat16), swiglu_ops.SWIGLU_TILES_16BIT),
            ((torch.float32,), swiglu_ops.SWIGLU_TILES_FP32),
        )
        for dtype in dtypes
        for tile in tiles
    ]


@pytest.mark.parametrize("dtype,tile", dual_tile_cases())
def test_dual_gemm_tile_on_the_gpu(monkeypatch, dtype, tile):
    launched: list = []
    monkeypatch.setattr(swiglu_ops, "_dual_tile", lambda gemm: launched.append(tile) or tile)
    inputs = make_inputs((12, 197, 200), 304, 200, True, True)
    with vk.use_backend("triton", strict=True):
        check_against_formula(swiglu_mlp_call, swiglu_mlp_formula, inputs, dtype, NAMES, CUDA)
    assert launched, "the dual GEMM did not run the pinned tile"


@pytest.mark.parametrize(
    "dtype",
    [
        cuda_param(torch.bfloat16, id="bf16", skip_reason=CUDA_SKIP),
        cuda_param(torch.float32, id="fp32", skip_reason=CUDA_SKIP),
    ],
)
def test_dual_gemm_tile_choice_on_the_gpu(dtype):
    """As a user's first call makes it: every candidate validated and timed, the fastest right one kept."""
    _tiles.forget()
    x = torch.randn(24, 197, 768, device=CUDA, dtype=dtype)
    wg, wu = ((torch.randn(2048, 768, device=CUDA) / math.sqrt(768)).to(dtype) for _ in range(2))
    b = torch.randn(2048, device=CUDA, dtype=dtype)
    with vk.use_backend("triton", strict=True), torch.no_grad():
        h = vk.swiglu(x, wg, b, wu, b)
    (row,) = swiglu_ops.tile_report()
    assert set(row["candidates"]) == {repr(t) for t in swiglu_ops.swiglu_candidates(dtype, 24 * 197, 2048)}
    times = {t: trial for t, trial in row["candidates"].items() if isinstance(trial, float)}
    assert times and row["chosen"] == min(times, key=times.get), row
    exact = swiglu_formula(x.double(), wg.double(), b.double(), wu.double(), b.double())
    own = F.silu(F.linear(x, wg, b)) * F.linear(x, wu, b)
    assert_within_pytorch_error("H", h, own, exact, dtype, CUDA)
