"""Property-based differential tests: every op on every backend that runs here, on drawn shapes,
dtypes, layouts and magnitudes, against float64 formulas written below.

Each drawn case builds its inputs in the drawn dtype and layout (transposed, sliced, expanded with
stride 0, cut from a wider tensor, channels_last, every 1-D parameter strided), runs the op and
backpropagates a random upstream gradient, and compares the output and every input gradient with the
same formula in float64 on the same (rounded) inputs. The bound on the max-abs error is
``max(atol + rtol * max|reference|, 2 x PyTorch's own error)``, where PyTorch's own error is that of a
plain PyTorch composition (``F.linear``, ``F.layer_norm``, ``softmax(q k^T) v``, ``F.conv2d``) in the
same dtype on the same inputs. On CUDA (``gpu`` cases, the quick profile) the floor is a few units in
the last place of the largest reference value instead (``tests.helpers.error_bound``).

``make test`` runs a budget of examples per op and backend drawn from the day's seed (a new draw each
day; pytest's header prints it, ``VIT_KERNELS_FUZZ_SEED`` replays it); the ``slow`` tests run the
``thorough`` profile (thousands of cases). Classes of failures found so far are kept as explicit
``@example`` cases, run first under every seed.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

import vit_kernels as vk
from tests.helpers import (
    CPU_BACKENDS,
    CUDA,
    CUDA_BACKENDS,
    FUZZ_SEED,
    GELU_APPROXIMATIONS,
    assert_within_pytorch_error,
    cuda_kernel_dtypes,
    cuda_param,
    device_reason,
    gelu_formula,
)
from vit_kernels import backend
from vit_kernels._accuracy import sibling_scale
from vit_kernels.activations import gelu

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
QUICK = settings(max_examples=int(os.environ.get("VIT_KERNELS_FUZZ_QUICK", "30")), **SETTINGS)
THOROUGH = settings(
    max_examples=int(os.environ.get("VIT_KERNELS_FUZZ_THOROUGH", "600")), derandomize=False, **SETTINGS
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS_2D = ("contiguous", "transposed", "sliced", "offset")
LAYOUTS_1D = ("contiguous", "strided", "expanded", "offset")
RESIDUAL_LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "offset")


# ----------------------------------------------------------------------------- inputs


def make(
    shape: tuple[int, ...],
    layout: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    scale: float = 1.0,
    shift: float = 0.0,
    *,
    device: str = "cpu",
) -> torch.Tensor:
    """Random N(shift, scale^2) values of ``shape`` in ``dtype`` on ``device`` (drawn on the CPU from
    ``gen``, so that a case has the same values on every device), laid out as ``layout``:

    contiguous; transposed (last two dims swapped in memory); sliced / strided (every other
    element of the last dim); expanded (stride 0 along the first dim); offset (cut from a wider
    tensor, non-zero storage offset); channels_last (4-D).
    """

    def randn(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale + shift).to(device, dtype)

    if layout == "contiguous":
        return randn(*shape)
    if layout == "transposed" and len(shape) >= 2:
        return randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if layout in ("sliced", "strided"):
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "expanded":
        return randn(1, *shape[1:]).expand(shape)
    if layout == "offset":
        return randn(*shape[:-1], shape[-1] + 3)[..., 2 : 2 + shape[-1]]
    if layout == "channels_last" and len(shape) == 4:
        return randn(*shape).contiguous(memory_format=torch.channels_last)
    return randn(*shape)


def drawer(case: dict) -> Callable[..., torch.Tensor]:
    """``make`` for one case: values from its seed (one CPU generator, so that a case draws the same
    values on every device), in its dtype, on its device (the CPU unless the case names one)."""
    gen = torch.Generator().manual_seed(case["seed"])

    def sample(shape: tuple[int, ...], layout: str, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return make(shape, layout, case["dtype"], gen, scale, shift, device=case.get("device", "cpu"))

    return sample


def leaf(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The same tensor (same strides and storage) as a leaf that requires grad."""
    return None if t is None else t.detach().requires_grad_(True)


def wide(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A float64 leaf with the values of ``t`` (after its rounding to ``t``'s dtype)."""
    return None if t is None else t.detach().double().requires_grad_(True)


def run(
    fn: Callable, inputs: list, upstream: Optional[list] = None, seed: int = 0
) -> tuple[list, list, list]:
    """fn(*inputs) and the gradients of every input that requires grad for ``upstream`` (random
    N(0, 1) from ``seed`` when not given). Returns (outputs, grads, upstream)."""
    result = fn(*inputs)
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if upstream is None:
        gen = torch.Generator().manual_seed(seed)
        upstream = [torch.randn(o.shape, dtype=torch.float64, generator=gen) for o in outs]
    targets = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(
        outs, targets, [g.to(o.device, o.dtype) for g, o in zip(upstream, outs)], allow_unused=True
    )
    return [o.detach() for o in outs], list(grads), upstream


def check_case(
    name: str,
    backend_name: str,
    op: Callable,
    formula: Callable,
    baseline: Callable,
    inputs: list,
    dtype: torch.dtype,
    input_names: list[str],
    seed: int,
) -> None:
    """``op`` on ``backend_name`` against ``formula`` (float64), bounded by ``baseline``'s error;
    the upstream gradients are drawn from ``seed``, so that a case reproduces exactly."""
    ours_in = [leaf(t) for t in inputs]
    base_in = [leaf(t) for t in inputs]
    ref_in = [wide(t) for t in inputs]
    ref_outs, ref_grads, upstream = run(formula, ref_in, seed=seed)
    try:
        with vk.use_backend(backend_name, strict=True):
            outs, grads, _ = run(op, ours_in, upstream)
    except backend.CannotRunError:
        # Outside the backend's stated limits (e.g. the extension's linear without a residual):
        # dispatch would hand the call to another backend, so there is nothing of this one to check.
        return
    base_outs, base_grads, _ = run(baseline, base_in, upstream)
    names = [f"output {i}" for i in range(len(outs))] + [
        f"d{n}" for n, t in zip(input_names, inputs) if t is not None
    ]
    device = next(t.device for t in inputs if t is not None)
    least_scale = sibling_scale(ref_outs + ref_grads)
    for what, ours, base, ref in zip(names, outs + grads, base_outs + base_grads, ref_outs + ref_grads):
        if ref is None:
            continue
        assert ours is not None, f"{name} on {backend_name}: no {what}"
        assert ours.shape == ref.shape, (
            f"{name} on {backend_name}: {what} shape {tuple(ours.shape)} != {tuple(ref.shape)}"
        )
        assert ours.dtype == dtype, f"{name} on {backend_name}: {what} dtype {ours.dtype}, expected {dtype}"
        assert_within_pytorch_error(
            f"{name} on {backend_name}: {what}", ours, base, ref, dtype, device, least_scale
        )


def runnable(op: str, backend_name: str, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``backend_name`` runs ``op`` on ``device`` tensors of ``dtype`` here. Interpreted
    Triton is left out in bfloat16: the interpreter rounds float32 to bfloat16 by truncation where a
    GPU rounds to nearest (3 - 0.0007 becomes 2.984, not 3), so its bfloat16 results are not the kernel's."""
    if backend_name == "triton" and dtype == torch.bfloat16 and device == "cpu":
        return False
    return backend.unsupported_reason(op, backend_name, torch.device(device), dtype) is None


def fuzz(
    op: str, cases: st.SearchStrategy, check: Callable, examples: list[dict]
) -> tuple[Callable, Callable, Callable]:
    """A quick (the day's seed, ``make test``) and a thorough (``slow``) test of ``check`` over every
    CPU backend, and the quick one on CUDA over every backend (``gpu`` cases), with the regression
    ``examples`` run first. A drawn case the backend cannot run (its dtype) has nothing to check."""

    def body(backend_name: str, case: dict) -> None:
        if not runnable(op, backend_name, case["dtype"]):
            return
        check(case, backend_name)

    def body_on_cuda(backend_name: str, case: dict) -> None:
        if not runnable(op, backend_name, case["dtype"], "cuda"):
            return
        check({**case, "device": "cuda"}, backend_name)

    def build(test_body: Callable, profile: settings, backends: list, marks: tuple = ()) -> Callable:
        test = given(case=cases)(test_body)
        for case in examples:
            test = example(case=case)(test)
        test = profile(test)
        if profile is QUICK:
            test = seed(FUZZ_SEED)(test)
        test = pytest.mark.parametrize("backend_name", backends)(test)
        for mark in marks:
            test = mark(test)
        return test

    on_cuda = [cuda_param(name, id=name, skip_reason=device_reason(name, CUDA)) for name in CUDA_BACKENDS]
    return (
        build(body, QUICK, CPU_BACKENDS),
        build(body, THOROUGH, CPU_BACKENDS, (pytest.mark.slow,)),
        build(body_on_cuda, QUICK, on_cuda),
    )


sizes = st.integers


# ----------------------------------------------------------------------------- linear family


@st.composite
def linear_cases(draw) -> dict:
    return dict(
        batch=draw(st.lists(sizes(1, 7), min_size=0, max_size=2)),
        k=draw(st.sampled_from([1, 2, 3, 5, 7, 13, 17, 24, 31, 40])),
        n=draw(st.sampled_from([1, 2, 3, 5, 8, 11, 19, 24, 37])),
        hidden=draw(st.sampled_from([1, 3, 7, 16, 23, 48])),
        dtype=draw(st.sampled_from(DTYPES)),
        x_layout=draw(st.sampled_from(LAYOUTS_2D)),
        w_layout=draw(st.sampled_from(LAYOUTS_2D)),
        w2_layout=draw(st.sampled_from(LAYOUTS_2D)),
        bias=draw(st.sampled_from((None,) + LAYOUTS_1D)),
        bias2=draw(st.sampled_from((None,) + LAYOUTS_1D)),
        residual=draw(st.sampled_from((None,) + RESIDUAL_LAYOUTS)),
        scale=draw(st.sampled_from([0.1, 1.0, 4.0, 30.0])),
        approximate=draw(st.sampled_from(GELU_APPROXIMATIONS)),
        seed=draw(sizes(0, 2**31 - 1)),
    )


def linear_inputs(case: dict, second: bool = False) -> tuple[list, torch.Size]:
    """x (..., K), W (N, K) or W1 (Hd, K), b, [W2 (N, Hd), b2], residual (..., N)."""
    sample = drawer(case)
    k, n = case["k"], case["n"]
    rows = case["batch"]
    x_shape = (*rows, k) if len(rows) else (k,)
    x = sample(x_shape, case["x_layout"] if len(rows) else "contiguous", case["scale"])
    first_out = case["hidden"] if second else n
    w = sample((first_out, k), case["w_layout"], 1 / math.sqrt(k))
    b = None if case["bias"] is None else sample((first_out,), case["bias"])
    out_shape = (*x_shape[:-1], n)
    extra = []
    if second:
        w2 = sample((n, case["hidden"]), case["w2_layout"], 1 / math.sqrt(case["hidden"]))
        b2 = None if case["bias2"] is None else sample((n,), case["bias2"])
        extra = [w2, b2]
    layout = case["residual"]
    if layout in ("transposed", "expanded") and len(out_shape) < 2:
        layout = "strided"
    r = None if layout is None else sample(out_shape, layout)
    return [x, w, b, *extra, r], out_shape


def check_linear(case: dict, backend_name: str) -> None:
    inputs, _ = linear_inputs(case)
    check_case(
        "linear",
        backend_name,
        lambda x, w, b, r: vk.linear(x, w, b, residual=r),
        lambda x, w, b, r: x @ w.T + (0 if b is None else b) + (0 if r is None else r),
        lambda x, w, b, r: F.linear(x, w, b) + (0 if r is None else r),
        inputs,
        case["dtype"],
        ["x", "weight", "bias", "residual"],
        case["seed"],
    )


def check_linear_gelu(case: dict, backend_name: str) -> None:
    inputs, _ = linear_inputs(case)
    approximate = case["approximate"]
    check_case(
        "linear_gelu",
        backend_name,
        lambda x, w, b: vk.linear_gelu(x, w, b, approximate=approximate),
        lambda x, w, b: gelu_formula(x @ w.T + (0 if b is None else b), approximate),
        lambda x, w, b: gelu(F.linear(x, w, b), approximate),
        inputs[:3],
        case["dtype"],
        ["x", "weight", "bias"],
        case["seed"],
    )


def check_mlp(case: dict, backend_name: str) -> None:
    inputs, _ = linear_inputs(case, second=True)
    approximate = case["approximate"]

    def formula(x, w1, b1, w2, b2, r):
        h = gelu_formula(x @ w1.T + (0 if b1 is None else b1), approximate)
        return h @ w2.T + (0 if b2 is None else b2) + (0 if r is None else r)

    check_case(
        "mlp",
        backend_name,
        lambda x, w1, b1, w2, b2, r: vk.mlp(x, w1, b1, w2, b2, approximate=approximate, residual=r),
        formula,
        lambda x, w1, b1, w2, b2, r: (
            F.linear(gelu(F.linear(x, w1, b1), approximate), w2, b2) + (0 if r is None else r)
        ),
        inputs,
        case["dtype"],
        ["x", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "residual"],
        case["seed"],
    )


LINEAR_BASE = dict(
    batch=[3, 5],
    k=13,
    n=11,
    hidden=23,
    dtype=torch.float32,
    x_layout="contiguous",
    w_layout="contiguous",
    w2_layout="contiguous",
    bias="contiguous",
    bias2="contiguous",
    residual=None,
    scale=1.0,
    approximate="none",
    seed=1,
)
LINEAR_EXAMPLES = [  # the failure classes found so far: strided biases, non-unit-stride residuals
    {**LINEAR_BASE, "bias": "strided", "bias2": "strided"},
    {**LINEAR_BASE, "residual": "transposed"},
    {**LINEAR_BASE, "residual": "expanded", "bias": "expanded"},
    {
        **LINEAR_BASE,
        "x_layout": "transposed",
        "w_layout": "transposed",
        "dtype": torch.float16,
        "approximate": "tanh",
    },
]

test_linear_fuzz, test_linear_fuzz_thorough, test_linear_fuzz_on_cuda = fuzz(
    "linear", linear_cases(), check_linear, LINEAR_EXAMPLES
)
test_linear_gelu_fuzz, test_linear_gelu_fuzz_thorough, test_linear_gelu_fuzz_on_cuda = fuzz(
    "linear_gelu", linear_cases(), check_linear_gelu, LINEAR_EXAMPLES
)
test_mlp_fuzz, test_mlp_fuzz_thorough, test_mlp_fuzz_on_cuda = fuzz(
    "mlp", linear_cases(), check_mlp, LINEAR_EXAMPLES
)


def swiglu_inputs(case: dict) -> list:
    """x (..., K), W_g (Hd, K), b_g, W_u (Hd, K), b_u, W_d (N, Hd), b_d, residual (..., N)."""
    x, wg, bg, wd, bd, r = linear_inputs(case, second=True)[0]
    sample = drawer({**case, "seed": case["seed"] + 1})
    wu = sample(tuple(wg.shape), case["w2_layout"], 1 / math.sqrt(case["k"]))
    bu = None if case["bias"] is None else sample((case["hidden"],), case["bias"])
    return [x, wg, bg, wu, bu, wd, bd, r]


def swiglu_formula(x, wg, bg, wu, bu):
    # silu(g) * u, silu(g) = g / (1 + exp(-g))
    g = x @ wg.T + (0 if bg is None else bg)
    return g / (1 + torch.exp(-g)) * (x @ wu.T + (0 if bu is None else bu))


def check_swiglu(case: dict, backend_name: str) -> None:
    inputs = swiglu_inputs(case)
    check_case(
        "swiglu",
        backend_name,
        vk.swiglu,
        swiglu_formula,
        lambda x, wg, bg, wu, bu: F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu),
        inputs[:5],
        case["dtype"],
        ["x", "gate_weight", "gate_bias", "up_weight", "up_bias"],
        case["seed"],
    )


def check_swiglu_mlp(case: dict, backend_name: str) -> None:
    inputs = swiglu_inputs(case)

    def formula(x, wg, bg, wu, bu, wd, bd, r):
        return swiglu_formula(x, wg, bg, wu, bu) @ wd.T + (0 if bd is None else bd) + (0 if r is None else r)

    check_case(
        "swiglu_mlp",
        backend_name,
        lambda x, wg, bg, wu, bu, wd, bd, r: vk.swiglu_mlp(x, wg, bg, wu, bu, wd, bd, residual=r),
        formula,
        lambda x, wg, bg, wu, bu, wd, bd, r: (
            F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd) + (0 if r is None else r)
        ),
        inputs,
        case["dtype"],
        ["x", "gate_weight", "gate_bias", "up_weight", "up_bias", "down_weight", "down_bias", "residual"],
        case["seed"],
    )


test_swiglu_fuzz, test_swiglu_fuzz_thorough, test_swiglu_fuzz_on_cuda = fuzz(
    "swiglu", linear_cases(), check_swiglu, LINEAR_EXAMPLES
)
test_swiglu_mlp_fuzz, test_swiglu_mlp_fuzz_thorough, test_swiglu_mlp_fuzz_on_cuda = fuzz(
    "swiglu_mlp", linear_cases(), check_swiglu_mlp, LINEAR_EXAMPLES
)


# ----------------------------------------------------------------------------- layer_norm


@st.composite
def layer_norm_cases(draw) -> dict:
    return dict(
        batch=draw(st.lists(sizes(1, 6), min_size=0, max_size=2)),
        dim=draw(st.sampled_from([1, 2, 3, 7, 16, 33, 48, 100, 130])),
        dtype=draw(st.sampled_from(DTYPES)),
        x_layout=draw(st.sampled_from(LAYOUTS_2D + ("expanded",))),
        weight=draw(st.sampled_from((None,) + LAYOUTS_1D)),
        bias=draw(st.sampled_from((None,) + LAYOUTS_1D)),
        residual=draw(st.sampled_from((None,) + RESIDUAL_LAYOUTS)),
        shift=draw(st.sampled_from([0.0, 3.0, 100.0, 1000.0])),
        scale=draw(st.sampled_from([1e-3, 1.0, 50.0])),
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        seed=draw(sizes(0, 2**31 - 1)),
    )


def check_layer_norm(case: dict, backend_name: str) -> None:
    sample = drawer(case)
    dtype, dim, eps = case["dtype"], case["dim"], case["eps"]
    shape = (*case["batch"], dim)
    matrix = len(shape) >= 2

    def layout(name: str) -> Optional[str]:
        chosen = case[name]
        return chosen if matrix or chosen not in ("transposed", "expanded") else "sliced"

    x = sample(shape, layout("x_layout"), case["scale"], case["shift"])
    w = None if case["weight"] is None else sample((dim,), case["weight"], 1.0, 1.0)
    b = None if case["bias"] is None else sample((dim,), case["bias"])
    r = None if case["residual"] is None else sample(shape, layout("residual"), case["scale"])

    def formula(x, w, b, r):
        # s = x + r, returned in the input dtype and normalised as returned (its rounding passes the
        # gradient through unchanged);  y = (s - mean(s)) / sqrt(var(s) + eps) * w + b  (biased variance)
        s = x if r is None else x + r
        s = s + (s.to(dtype).double() - s).detach()
        mean = s.mean(-1, keepdim=True)
        y = (s - mean) / torch.sqrt(((s - mean) ** 2).mean(-1, keepdim=True) + eps)
        y = y * (1 if w is None else w) + (0 if b is None else b)
        return y if r is None else (y, s)

    def baseline(x, w, b, r):
        s = x if r is None else x + r
        y = F.layer_norm(s, (dim,), w, b, eps)
        return y if r is None else (y, s)

    check_case(
        "layer_norm",
        backend_name,
        lambda x, w, b, r: vk.layer_norm(x, w, b, eps, residual=r),
        formula,
        baseline,
        [x, w, b, r],
        dtype,
        ["x", "weight", "bias", "residual"],
        case["seed"],
    )


LAYER_NORM_BASE = dict(
    batch=[4],
    dim=33,
    dtype=torch.float32,
    x_layout="contiguous",
    weight="contiguous",
    bias="contiguous",
    residual=None,
    shift=0.0,
    scale=1.0,
    eps=1e-6,
    seed=2,
)
LAYER_NORM_EXAMPLES = [  # strided weight/bias; rows with a large mean
    {**LAYER_NORM_BASE, "weight": "strided", "bias": "strided"},
    {**LAYER_NORM_BASE, "residual": "transposed", "x_layout": "expanded"},
    {**LAYER_NORM_BASE, "shift": 1000.0, "scale": 1.0},
    {**LAYER_NORM_BASE, "shift": 1000.0, "scale": 1e-3, "dtype": torch.float16},
]

test_layer_norm_fuzz, test_layer_norm_fuzz_thorough, test_layer_norm_fuzz_on_cuda = fuzz(
    "layer_norm", layer_norm_cases(), check_layer_norm, LAYER_NORM_EXAMPLES
)


# ----------------------------------------------------------------------------- attention


def attention64(qkv: torch.Tensor, heads: int, scale: float, mask=None) -> torch.Tensor:
    """Per head h: softmax(scale q_h k_h^T + mask) v_h, heads concatenated; qkv (B, L, 3D) -> (B, L, D).
    A boolean mask keeps its True keys, a float one is added (the drawn masks never empty a row)."""
    b, length, three_d = qkv.shape
    dim = three_d // 3
    q, k, v = (
        qkv[..., i * dim : (i + 1) * dim].reshape(b, length, heads, -1).transpose(1, 2) for i in range(3)
    )
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
        )
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    return (probs @ v).transpose(1, 2).reshape(b, length, dim), probs


def attention_pytorch(qkv: torch.Tensor, heads: int, scale: float, return_probs: bool, mask=None):
    """PyTorch's own attention in the input's dtype: ``F.scaled_dot_product_attention``, or, for the
    probabilities (which it does not return), softmax(scale q k^T + mask) and its product with v."""
    b, length, three_d = qkv.shape
    dim = three_d // 3
    q, k, v = (
        qkv[..., i * dim : (i + 1) * dim].reshape(b, length, heads, -1).transpose(1, 2) for i in range(3)
    )
    if not return_probs:
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            .transpose(1, 2)
            .reshape(b, length, dim)
        )
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).to(qkv.dtype)
    return (probs @ v).transpose(1, 2).reshape(b, length, dim), probs


@st.composite
def attention_cases(draw) -> dict:
    return dict(
        batch=draw(sizes(1, 3)),
        length=draw(st.sampled_from([1, 2, 3, 5, 7, 16, 17, 31, 50])),
        heads=draw(sizes(1, 3)),
        head_dim=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 15, 16, 20, 64])),
        dtype=draw(st.sampled_from(DTYPES)),
        layout=draw(st.sampled_from(["contiguous", "transposed", "sliced", "offset"])),
        magnitude=draw(st.sampled_from([0.3, 1.0, 3.0, 10.0, 30.0])),
        scale=draw(st.sampled_from([None, 0.05, 1.0])),
        return_probs=draw(st.booleans()),
        seed=draw(sizes(0, 2**31 - 1)),
        mask=draw(st.sampled_from([None, None, "key_padding", "boolean", "additive"])),
    )


def attention_mask(case: dict):
    """The case's attention mask, drawn from its seed: None; a boolean key-padding mask (B, 1, 1, L)
    whose images keep 1..L tokens; a boolean (L, L) pattern; an additive float32 (B, H, L, L) one.
    Key 0 is always kept, so that no row is empty."""
    kind = case.get("mask")
    if kind is None:
        return None
    b, heads, length = case["batch"], case["heads"], case["length"]
    generator = torch.Generator().manual_seed(case["seed"])
    device = case.get("device", "cpu")
    if kind == "key_padding":
        counts = torch.randint(1, length + 1, (b,), generator=generator)
        return (torch.arange(length)[None, :] < counts[:, None])[:, None, None, :].to(device)
    if kind == "boolean":
        keep = torch.rand(length, length, generator=generator) < 0.5
        keep[:, 0] = True
        return keep.to(device)
    return (3 * torch.randn(b, heads, length, length, generator=generator)).to(device)


def attention_qkv(case: dict) -> torch.Tensor:
    """qkv (B, L, 3D) in the case's layout: contiguous; transposed (stored (L, B, 3D)); sliced
    (every other token of a longer sequence); offset (cut from a wider projection)."""
    sample = drawer(case)
    b, length, width = case["batch"], case["length"], 3 * case["heads"] * case["head_dim"]
    layout = case["layout"]
    if layout == "transposed":
        return sample((length, b, width), "contiguous", case["magnitude"]).transpose(0, 1)
    if layout == "sliced":
        return sample((b, 2 * length, width), "contiguous", case["magnitude"])[:, ::2]
    return sample((b, length, width), layout, case["magnitude"])


def check_attention(case: dict, backend_name: str) -> None:
    heads, head_dim = case["heads"], case["head_dim"]
    scale = head_dim**-0.5 if case["scale"] is None else case["scale"]
    probs = case["return_probs"]
    mask = attention_mask(case)
    check_case(
        "attention",
        backend_name,
        lambda qkv: vk.attention(qkv, heads, scale=case["scale"], return_probs=probs, attn_mask=mask),
        lambda qkv: (
            attention64(qkv, heads, scale, mask) if probs else attention64(qkv, heads, scale, mask)[0]
        ),
        lambda qkv: attention_pytorch(qkv, heads, scale, probs, mask),
        [attention_qkv(case)],
        case["dtype"],
        ["qkv"],
        case["seed"],
    )


ATTENTION_BASE = dict(
    batch=2,
    length=17,
    heads=2,
    head_dim=8,
    dtype=torch.float32,
    layout="contiguous",
    magnitude=1.0,
    scale=None,
    return_probs=False,
    seed=3,
)
ATTENTION_EXAMPLES = [  # saturated softmax (logits ~1e4), L = 1 (dq = dk = 0), sliced qkv
    {**ATTENTION_BASE, "magnitude": 30.0, "head_dim": 16},
    {**ATTENTION_BASE, "magnitude": 30.0, "head_dim": 64, "length": 5, "return_probs": True},
    {**ATTENTION_BASE, "length": 1},
    {**ATTENTION_BASE, "layout": "sliced", "dtype": torch.float16, "head_dim": 5},
    {**ATTENTION_BASE, "mask": "key_padding", "length": 50, "magnitude": 10.0},
    {**ATTENTION_BASE, "mask": "additive", "dtype": torch.float16, "return_probs": True},
]

test_attention_fuzz, test_attention_fuzz_thorough, test_attention_fuzz_on_cuda = fuzz(
    "attention", attention_cases(), check_attention, ATTENTION_EXAMPLES
)


@pytest.mark.parametrize(
    "device,backend_name,dtype",
    [
        *[
            pytest.param("cpu", name, dt, id=f"dtype{i}-{name}")
            for i, dt in enumerate((torch.float32, torch.float16))
            for name in CPU_BACKENDS[1:]
        ],
        *cuda_kernel_dtypes("attention"),
    ],
)
def test_attention_single_token_gradients_are_exact_zeros(device, backend_name, dtype):
    """With one token the softmax is the constant 1: out = v, so dq = dk = 0 exactly. (The kernel
    backends; the torch backend is PyTorch's scaled_dot_product_attention, whose CPU backward
    leaves rounding-level values there.)"""
    if not runnable("attention", backend_name, dtype, device):
        pytest.skip(backend.unsupported_reason("attention", backend_name, torch.device(device), dtype))
    qkv = (torch.randn(3, 1, 3 * 2 * 16) * 10).to(device, dtype).requires_grad_(True)
    with vk.use_backend(backend_name):
        out = vk.attention(qkv, 2)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.testing.assert_close(out, qkv.detach()[..., 64:], atol=0, rtol=0)
    assert torch.count_nonzero(qkv.grad[..., :64]) == 0, "dq and dk must be exactly zero for L = 1"
    torch.testing.assert_close(qkv.grad[..., 64:], grad_out, atol=0, rtol=0)


# ----------------------------------------------------------------------------- patch_embed


@st.composite
def patch_embed_cases(draw) -> dict:
    return dict(
        batch=draw(sizes(1, 3)),
        channels=draw(st.sampled_from([1, 3, 5])),
        patch=draw(sizes(1, 8)),
        grid=(draw(sizes(1, 4)), draw(sizes(1, 4))),
        dim=draw(st.sampled_from([1, 3, 8, 13, 24])),
        dtype=draw(st.sampled_from(DTYPES)),
        image_layout=draw(st.sampled_from(["contiguous", "channels_last", "sliced", "transposed", "offset"])),
        weight_layout=draw(st.sampled_from(["contiguous", "transposed", "channels_last"])),
        bias=draw(st.sampled_from((None,) + LAYOUTS_1D)),
        cls=draw(st.booleans()),
        pos=draw(st.sampled_from([None, "contiguous", "sliced", "expanded_tokens"])),
        scale=draw(st.sampled_from([0.5, 1.0, 20.0])),
        seed=draw(sizes(0, 2**31 - 1)),
    )


def check_patch_embed(case: dict, backend_name: str) -> None:
    sample = drawer(case)
    dtype, p, dim, c = case["dtype"], case["patch"], case["dim"], case["channels"]
    gh, gw = case["grid"]
    shape = (case["batch"], c, gh * p, gw * p)
    images = sample(shape, case["image_layout"], case["scale"])
    w = sample((dim, c, p, p), case["weight_layout"], 1 / math.sqrt(c * p * p))
    b = None if case["bias"] is None else sample((dim,), case["bias"])
    cls = sample((1, 1, dim), "contiguous") if case["cls"] else None
    tokens = gh * gw + case["cls"]
    if case["pos"] == "expanded_tokens":  # one row broadcast over every token (stride 0)
        pos = sample((1, 1, dim), "contiguous").expand(1, tokens, dim)
    else:
        pos = None if case["pos"] is None else sample((1, tokens, dim), case["pos"])

    def formula(images, w, b, cls, pos):
        # tokens[n, l] = sum_{c,i,j} images[n, c, P r + i, P s + j] w[d, c, i, j] + b[d], l = r * gw + s;
        # then [cls | tokens] + pos
        n = images.shape[0]
        patches = images.reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * p * p)
        out = patches @ w.reshape(dim, -1).T + (0 if b is None else b)
        if cls is not None:
            out = torch.cat([cls.expand(n, 1, dim), out], dim=1)
        return out if pos is None else out + pos

    def baseline(images, w, b, cls, pos):
        out = F.conv2d(images, w, b, stride=p).flatten(2).transpose(1, 2)
        if cls is not None:
            out = torch.cat([cls.expand(out.shape[0], 1, dim), out], dim=1)
        return out if pos is None else out + pos

    check_case(
        "patch_embed",
        backend_name,
        lambda images, w, b, cls, pos: vk.patch_embed(
            images, w, b, patch_size=p, cls_token=cls, pos_embed=pos
        ),
        formula,
        baseline,
        [images, w, b, cls, pos],
        dtype,
        ["images", "weight", "bias", "cls_token", "pos_embed"],
        case["seed"],
    )


PATCH_BASE = dict(
    batch=2,
    channels=3,
    patch=4,
    grid=(3, 2),
    dim=13,
    dtype=torch.float32,
    image_layout="contiguous",
    weight_layout="contiguous",
    bias="contiguous",
    cls=True,
    pos="contiguous",
    scale=1.0,
    seed=4,
)
PATCH_EXAMPLES = [  # strided bias; sliced images; broadcast position embedding
    {**PATCH_BASE, "bias": "strided"},
    {**PATCH_BASE, "image_layout": "sliced", "weight_layout": "transposed", "pos": "expanded_tokens"},
    {**PATCH_BASE, "image_layout": "channels_last", "channels": 5, "patch": 1, "cls": False, "pos": "sliced"},
]

test_patch_embed_fuzz, test_patch_embed_fuzz_thorough, test_patch_embed_fuzz_on_cuda = fuzz(
    "patch_embed", patch_embed_cases(), check_patch_embed, PATCH_EXAMPLES
)
