"""The compiled ops of vit_kernels._C, called directly: opcheck (schema, fake, autograd registration,
AOT dispatch), each op and its gradients against float64 formulas, and the TORCH_CHECK messages that
bad input reaches. The public ops on the ``extension`` backend are covered by test_<op>.py."""

import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    CUDA_DTYPES,
    DTYPE_NAMES,
    GELU_APPROXIMATIONS,
    TOLERANCES,
    check_against_formula,
    cuda_param,
    gelu_formula,
    requires_cuda,
)
from vit_kernels import _ext
from vit_kernels._accuracy import ERROR_RATIO, FLOORS

BUILT = _ext.extension_unavailable_reason() is None
pytestmark = pytest.mark.skipif(
    not BUILT, reason=f"vit_kernels._C is not built: {_ext.extension_unavailable_reason()}"
)
ops = torch.ops.vit_kernels if BUILT else None


@pytest.mark.skipif(
    os.environ.get("VIT_KERNELS_SKIP_EXT", "0") not in ("", "0"), reason="VIT_KERNELS_SKIP_EXT is set"
)
def test_extension_is_built():
    """`pip install -e .` builds the extension wherever a C++ compiler is found: a failed build must not
    pass silently as "extension unavailable"."""
    assert BUILT, _ext.extension_unavailable_reason()


# ---- float64 formulas ----------------------------------------------------------------------------


def layer_norm_formula(x, residual, weight, bias, eps):
    s = x if residual is None else x + residual
    y = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, s)


def bias_gelu_formula(x, bias, approximate):
    return gelu_formula(x if bias is None else x + bias, approximate)


def patchify_formula(images, patch_size):
    return F.unfold(images, patch_size, stride=patch_size).transpose(1, 2)


def unpatchify_formula(patches, channels, height, width, patch_size):
    return F.fold(patches.transpose(1, 2), (height, width), patch_size, stride=patch_size)


def fused_layer_norm(x, residual, weight, bias, eps):
    """(y, x + residual), or y alone without a residual (the op then returns an empty s)."""
    y, s, _, _ = ops.fused_layer_norm(x, residual, weight, bias, eps)
    return y if residual is None else (y, s)


LAYER_NORM_INPUTS = ["x", "residual", "weight", "bias"]


CPU_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 1023), (7, 13), (2, 197, 192), (3, 5, 768)])
@pytest.mark.parametrize("parts", ["residual+affine", "affine", "residual", "bare"])
def test_fused_layer_norm(dtype, shape, parts):
    dim = shape[-1]
    x = torch.randn(shape) * 2 + 0.5
    residual = torch.randn(shape) if "residual" in parts else None
    weight, bias = (torch.randn(dim), torch.randn(dim)) if "affine" in parts else (None, None)
    check_against_formula(
        fused_layer_norm, layer_norm_formula, [x, residual, weight, bias], dtype, LAYER_NORM_INPUTS, eps=1e-5
    )


def test_fused_layer_norm_statistics():
    x = torch.randn(9, 31, dtype=torch.float64)
    _, _, mean, rstd = ops.fused_layer_norm(x, None, None, None, 1e-6)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, (x.var(-1, unbiased=False) + 1e-6).rsqrt())


@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1023), (2, 17, 96), (5, 1536)])
def test_bias_gelu(dtype, approximate, shape):
    x = torch.randn(shape) * 3  # covers the tails, where erf and tanh saturate
    check_against_formula(
        ops.bias_gelu,
        bias_gelu_formula,
        [x, torch.randn(shape[-1])],
        dtype,
        ["x", "bias"],
        approximate=approximate,
    )


def test_bias_gelu_without_bias():
    x = torch.randn(4, 33)
    check_against_formula(
        ops.bias_gelu, bias_gelu_formula, [x, None], torch.float32, ["x", "bias"], approximate="none"
    )


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 197, 197), (4, 1023), (6, 50)])
def test_softmax(dtype, shape):
    x = torch.randn(shape) * 4
    check_against_formula(ops.softmax, lambda t: torch.softmax(t, -1), [x], dtype, ["x"])


def test_softmax_large_logits():
    """Max subtraction: logits of 1e4 neither overflow nor lose the winner."""
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [-5e3, -5e3, -5e3]])
    torch.testing.assert_close(ops.softmax(x), torch.softmax(x.double(), -1).float())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "geometry", [(2, 3, 8, 12, 4), (1, 1, 7, 7, 7), (3, 2, 11, 10, 3), (2, 3, 32, 32, 16)]
)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_patchify(dtype, geometry, layout):
    """im2col from either layout, and its adjoint as the gradient; 11x10 with P=3 leaves a border no
    patch reaches, whose gradient must be zero."""
    n, c, h, w, p = geometry
    images = torch.randn(n, c, h, w)

    def op(images, patch_size):
        if layout == "channels_last":
            images = images.contiguous(memory_format=torch.channels_last)
        return ops.patchify(images, patch_size)

    check_against_formula(op, patchify_formula, [images], dtype, ["images"], patch_size=p)


@pytest.mark.parametrize("geometry", [(2, 3, 8, 12, 4), (3, 2, 11, 10, 3)])
def test_unpatchify(geometry):
    n, c, h, w, p = geometry
    patches = torch.randn(n, (h // p) * (w // p), c * p * p)
    for dtype in (torch.float64, torch.float32):
        check_against_formula(
            ops.unpatchify,
            unpatchify_formula,
            [patches],
            dtype,
            ["patches"],
            channels=c,
            height=h,
            width=w,
            patch_size=p,
        )


# ---- opcheck: schema, fake tensors, autograd registration, AOT dispatch ----------------------------


def opcheck_cases():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    y, s, mean, rstd = ops.fused_layer_norm(x.detach(), r.detach(), w.detach(), b.detach(), 1e-5)
    images = torch.randn(2, 3, 8, 12, requires_grad=True)
    return {
        "fused_layer_norm": (ops.fused_layer_norm, (x, r, w, b, 1e-5)),
        "fused_layer_norm_plain": (ops.fused_layer_norm, (x, None, None, None, 1e-5)),
        "fused_layer_norm_backward": (
            ops.fused_layer_norm_backward,
            (torch.randn_like(y), torch.randn_like(s), s, w.detach(), mean, rstd, True),
        ),
        "bias_gelu": (
            ops.bias_gelu,
            (torch.randn(3, 11, requires_grad=True), torch.randn(11, requires_grad=True), "tanh"),
        ),
        "bias_gelu_backward": (
            ops.bias_gelu_backward,
            (torch.randn(3, 11), torch.randn(3, 11), torch.randn(11), "none", True),
        ),
        "bias_gelu_backward_no_bias_grad": (
            ops.bias_gelu_backward,
            (torch.randn(3, 11), torch.randn(3, 11), None, "tanh", False),
        ),
        "softmax": (ops.softmax, (torch.randn(2, 3, 17, 17, requires_grad=True),)),
        "softmax_backward": (ops.softmax_backward, (torch.randn(4, 9), torch.softmax(torch.randn(4, 9), -1))),
        "patchify": (ops.patchify, (images, 4)),
        "patchify_channels_last": (
            ops.patchify,
            (images.detach().contiguous(memory_format=torch.channels_last).requires_grad_(), 4),
        ),
        "unpatchify": (ops.unpatchify, (torch.randn(2, 6, 48, requires_grad=True), 3, 8, 12, 4)),
        # the compositions (csrc/compositions.cpp)
        "linear_residual": (
            ops.linear_residual,
            (
                x,
                torch.randn(6, 7, dtype=torch.float64, requires_grad=True),
                torch.randn(6, dtype=torch.float64, requires_grad=True),
                torch.randn(5, 6, dtype=torch.float64, requires_grad=True),
            ),
        ),
        "linear_gelu": (
            ops.linear_gelu,
            (x, torch.randn(6, 7, dtype=torch.float64, requires_grad=True), None, "none"),
        ),
        "mlp": (
            ops.mlp,
            (
                x,
                torch.randn(9, 7, dtype=torch.float64, requires_grad=True),
                torch.randn(9, dtype=torch.float64, requires_grad=True),
                torch.randn(7, 9, dtype=torch.float64, requires_grad=True),
                None,
                "tanh",
                r,
            ),
        ),
        "attention_explicit": (
            ops.attention_explicit,
            (torch.randn(2, 5, 24, requires_grad=True), 2, 0.3, 0.0),
        ),
    }


@pytest.mark.parametrize("case", sorted(opcheck_cases() if BUILT else {}))
def test_opcheck(case):
    op, args = opcheck_cases()[case]
    torch.library.opcheck(op, args)


# ---- the C++ autograd (csrc/autograd.cpp) ---------------------------------------------------------


@pytest.mark.parametrize(
    "present,needs",
    [
        (present, needs)
        for present in ("", "r", "w", "b", "rw", "rb", "wb", "rwb")
        for needs in ("x", "r", "w", "b", "all")
        if needs in present + "x" + "all"
    ],
)
def test_layer_norm_gradients_of_every_argument_subset(present, needs):
    """Autograd gives edges only to the tensors present; each gradient asked for is the formula's and
    the others are not computed, whichever optional arguments are absent."""
    dim = 6
    made = {
        "x": torch.randn(4, dim, dtype=torch.float64),
        "r": torch.randn(4, dim, dtype=torch.float64) if "r" in present else None,
        "w": torch.randn(dim, dtype=torch.float64) if "w" in present else None,
        "b": torch.randn(dim, dtype=torch.float64) if "b" in present else None,
    }
    for name, t in made.items():
        if t is not None and needs in (name, "all"):
            t.requires_grad_()
    args = [made[k] for k in "xrwb"]
    y, s, _, _ = ops.fused_layer_norm(*args, 1e-5)
    upstream_y, upstream_s = torch.randn_like(y), torch.randn_like(s)
    loss = (y * upstream_y).sum() + ((s * upstream_s).sum() if made["r"] is not None else 0)
    grads = torch.autograd.grad(loss, [t for t in args if t is not None and t.requires_grad])
    leaves = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in args]
    expected = layer_norm_formula(*leaves, 1e-5)
    expected_y, expected_s = expected if made["r"] is not None else (expected, None)
    reference_loss = (expected_y * upstream_y).sum() + (
        (expected_s * upstream_s).sum() if expected_s is not None else 0
    )
    reference = torch.autograd.grad(reference_loss, [t for t in leaves if t is not None and t.requires_grad])
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("with_bias,needs", [(True, "x"), (True, "bias"), (True, "both"), (False, "x")])
def test_bias_gelu_gradients_of_every_argument_subset(with_bias, needs):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=needs in ("x", "both"))
    bias = torch.randn(5, dtype=torch.float64, requires_grad=needs in ("bias", "both")) if with_bias else None
    inputs = [t for t in (x, bias) if t is not None and t.requires_grad]
    upstream = torch.randn(3, 5, dtype=torch.float64)
    grads = torch.autograd.grad((ops.bias_gelu(x, bias, "none") * upstream).sum(), inputs)
    reference = torch.autograd.grad((bias_gelu_formula(x, bias, "none") * upstream).sum(), inputs)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)


def bias_gelu_backward_formula(grad_out, x, bias, approximate):
    """(d z, d bias) of y = gelu(z), z = x + bias, in float64: d z = grad_out * gelu'(z), d bias = sum_rows d z."""
    z = (x if bias is None else x + bias).double().requires_grad_(True)
    (dz,) = torch.autograd.grad(gelu_formula(z, approximate), z, grad_out.double())
    return dz, dz.reshape(-1, dz.shape[-1]).sum(0)


BIAS_GELU_BACKWARD_CASES = [
    pytest.param("cpu", dtype, shape, id=f"cpu-{DTYPE_NAMES[dtype]}-{'x'.join(map(str, shape))}")
    for dtype in CPU_DTYPES
    for shape in [(1, 1), (3, 1023), (2, 17, 96), (0, 8)]
] + [
    # one column tile and one row slice; scalar columns (1023); a partial last column tile (1000
    # columns: 125 16-bit packs) over several row slices; thousands of rows in ~130 slices
    cuda_param("cuda", dtype, shape, id=f"{DTYPE_NAMES[dtype]}-{'x'.join(map(str, shape))}")
    for dtype in CUDA_DTYPES
    for shape in [(1, 1), (3, 1023), (2, 197, 1000), (128, 197, 96), (0, 8)]
]


@pytest.mark.parametrize("device,dtype,shape", BIAS_GELU_BACKWARD_CASES)
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
def test_bias_gelu_backward_reduces_the_bias_gradient(device, dtype, shape, approximate):
    """d z in the input's dtype and d bias in float32 (float64 for float64) from one call, against
    float64; the bias gradient only when asked for (else an empty tensor), deterministic (a second call
    gives the same bits), and 0 over no rows."""
    if device == "cuda" and not _ext.HAS_CUDA_KERNELS:
        pytest.skip("vit_kernels._C has no CUDA kernels")
    grad_out, x, bias = torch.randn(shape), torch.randn(shape) * 3, torch.randn(shape[-1])
    args = [t.to(device, dtype) for t in (grad_out, x, bias)]
    dz, db = ops.bias_gelu_backward(*args, approximate, True)
    want_dz, want_db = bias_gelu_backward_formula(*[t.cpu() for t in args], approximate)
    reduced = torch.float64 if dtype == torch.float64 else torch.float32
    assert dz.dtype == dtype and dz.shape == x.shape and db.dtype == reduced and db.shape == (shape[-1],)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(dz.cpu().double(), want_dz, atol=atol, rtol=rtol)
    # a sum of up to thousands of rounded terms: the tolerance grows with the square root of the count
    rows = max(1, want_dz.numel() // shape[-1])
    torch.testing.assert_close(db.cpu().double(), want_db, atol=atol * rows**0.5, rtol=rtol)
    again_dz, again_db = ops.bias_gelu_backward(*args, approximate, True)
    assert torch.equal(again_dz, dz) and torch.equal(again_db, db)
    dz_only, nothing = ops.bias_gelu_backward(*args, approximate, False)
    assert torch.equal(dz_only, dz) and nothing.numel() == 0
    no_bias_dz, no_bias_db = ops.bias_gelu_backward(args[0], args[1], None, approximate, True)
    want_no_bias_dz, want_no_bias_db = bias_gelu_backward_formula(
        args[0].cpu(), args[1].cpu(), None, approximate
    )
    torch.testing.assert_close(no_bias_dz.cpu().double(), want_no_bias_dz, atol=atol, rtol=rtol)
    torch.testing.assert_close(no_bias_db.cpu().double(), want_no_bias_db, atol=atol * rows**0.5, rtol=rtol)


@pytest.mark.parametrize("op", ["fused_layer_norm", "bias_gelu", "softmax"])
def test_a_second_derivative_through_a_kernel_backward_raises(op):
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    call = {
        "fused_layer_norm": lambda: ops.fused_layer_norm(x, None, None, None, 1e-5)[0],
        "bias_gelu": lambda: ops.bias_gelu(x, None, "none"),
        "softmax": lambda: ops.softmax(x),
    }[op]
    (grad,) = torch.autograd.grad(call().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"differentiate twice vit_kernels::{op}"):
        grad.sum().backward()


def test_compositions_decompose_into_the_kernels():
    """Under torch.compile AOTAutograd decomposes the C++ compositions: the forward graph holds the
    GEMM and the kernel op, the backward graph the kernel's backward op."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return make_boxed_func(gm.forward)

    x = torch.randn(2, 5, 8, requires_grad=True)
    weight, bias = torch.randn(12, 8, requires_grad=True), torch.randn(12, requires_grad=True)
    compiled = torch.compile(
        lambda *a: ops.linear_gelu(*a, "none"), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)
    )
    out = compiled(x, weight, bias)
    out.sum().backward()
    forward, backward = graphs
    assert "vit_kernels.bias_gelu.default" in forward and any("mm" in t for t in forward), forward
    assert "vit_kernels.bias_gelu_backward.default" in backward, backward
    torch.testing.assert_close(out, F.gelu(F.linear(x, weight, bias)), atol=1e-5, rtol=1e-5)


# ---- bad input reaches a TORCH_CHECK that says what was expected -------------------------------------


BAD_INPUTS = [
    (
        lambda: ops.fused_layer_norm(torch.randint(0, 5, (3, 4)), None, None, None, 1e-5),
        "x must be float32, float16 or bfloat16",
    ),
    (lambda: ops.fused_layer_norm(torch.randn(4, 3).t(), None, None, None, 1e-5), "x must be contiguous"),
    (
        lambda: ops.fused_layer_norm(torch.randn(3, 4), torch.randn(3, 5), None, None, 1e-5),
        "residual must have the input's shape",
    ),
    (
        lambda: ops.fused_layer_norm(torch.randn(3, 4), torch.randn(3, 4).double(), None, None, 1e-5),
        "residual has dtype",
    ),
    (
        lambda: ops.fused_layer_norm(torch.randn(3, 4), None, torch.randn(5), None, 1e-5),
        r"weight must have shape \(4,\)",
    ),
    (lambda: ops.fused_layer_norm(torch.randn(3, 0), None, None, None, 1e-5), "C > 0"),
    (
        lambda: ops.fused_layer_norm_backward(
            torch.randn(3, 4), None, torch.randn(3, 4), None, torch.randn(2), torch.randn(3), True
        ),
        r"mean must be a contiguous \(3,\)",
    ),
    (lambda: ops.bias_gelu(torch.randn(3, 4), torch.randn(3), "none"), r"bias must have shape \(4,\)"),
    (
        lambda: ops.bias_gelu(torch.randn(3, 4), None, "sigmoid"),
        "approximate must be 'none', 'tanh' or 'quick'",
    ),
    (
        lambda: ops.bias_gelu_backward(torch.randn(3, 5), torch.randn(3, 4), None, "none", True),
        "grad_out must have the input's shape",
    ),
    (lambda: ops.softmax(torch.randn(4, 6)[:, ::2]), "x must be contiguous"),
    (lambda: ops.softmax_backward(torch.randn(4, 6), torch.randn(4, 6).half()), "grad_out has dtype"),
    (lambda: ops.patchify(torch.randn(2, 3, 8), 4), r"images must have shape \(N, C, H, W\)"),
    (lambda: ops.patchify(torch.randn(2, 3, 8, 8), 0), "patch_size must be positive"),
    (lambda: ops.patchify(torch.randn(2, 3, 8, 8), 9), "smaller than one 9x9 patch"),
    (lambda: ops.patchify(torch.randn(2, 3, 8, 16)[..., ::2], 4), "contiguous NCHW or channels_last"),
    (lambda: ops.unpatchify(torch.randn(2, 5, 48), 3, 8, 12, 4), r"patches must have shape \(N, 6, 48\)"),
]


@pytest.mark.parametrize("index", range(len(BAD_INPUTS)))
def test_bad_input_is_a_clear_error(index):
    call, message = BAD_INPUTS[index]
    with pytest.raises(RuntimeError, match=message):
        call()


# ---- CUDA kernels (skip without a GPU) ----------------------------------------------------------

# Each CUDA kernel within twice PyTorch's own error in the same dtype: its formula, a PyTorch
# composition, run on the same CUDA inputs in that dtype, is the baseline.
needs_cuda_kernels = pytest.mark.skipif(
    not _ext.HAS_CUDA_KERNELS, reason="vit_kernels._C has no CUDA kernels"
)


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1023), (2, 197, 768), (5, 1024), (4, 6144)])
def test_cuda_fused_layer_norm(dtype, shape):
    dim = shape[-1]
    inputs = [torch.randn(shape), torch.randn(shape), torch.randn(dim), torch.randn(dim)]
    check_against_formula(
        fused_layer_norm,
        layer_norm_formula,
        inputs,
        dtype,
        LAYER_NORM_INPUTS,
        device="cuda",
        baseline=layer_norm_formula,
        eps=1e-5,
    )


def _layer_norm_grads(fn, inputs, upstream):
    """Gradients of (x, residual, weight, bias) of ``fn`` (returning (y, s)) for the upstream (dy, ds)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    torch.autograd.backward(list(fn(*leaves)), list(upstream))
    return [t.grad for t in leaves]


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("shape", [(2, 197, 768), (64, 197, 1024), (16, 8192), (3, 8191), (9, 100)])
def test_cuda_layer_norm_param_grads(dtype, shape):
    """d(weight), d(bias) (and d(x)) of the fused residual LayerNorm within 2x PyTorch's own error:
    F.layer_norm in the same dtype on CUDA, both against float64 on the same (rounded) inputs; a
    floor of one rounding of the result. The reduction is deterministic: a second run gives the
    same bits. (8191 and 100 columns take the scalar kernels, 8192 the widest vector ones.)"""
    dim = shape[-1]
    inputs = [
        t.to(dtype) for t in (torch.randn(shape), torch.randn(shape), torch.randn(dim), torch.randn(dim))
    ]
    upstream = [torch.randn(shape).to(dtype) for _ in range(2)]

    def torch_layer_norm(x, residual, weight, bias):
        s = x + residual
        return F.layer_norm(s, (dim,), weight, bias, 1e-5), s

    def ours(x, residual, weight, bias):
        return fused_layer_norm(x, residual, weight, bias, 1e-5)

    exact = _layer_norm_grads(torch_layer_norm, [t.double() for t in inputs], [g.double() for g in upstream])
    on_cuda = [t.cuda() for t in inputs], [g.cuda() for g in upstream]
    theirs = _layer_norm_grads(torch_layer_norm, *on_cuda)
    mine = _layer_norm_grads(ours, *on_cuda)
    again = _layer_norm_grads(ours, *on_cuda)
    for name, m, t, e, a in zip(LAYER_NORM_INPUTS, mine, theirs, exact, again):
        assert m.dtype == dtype
        assert torch.equal(m, a), f"d{name} differs between two runs"
        error = (m.double().cpu() - e).abs().max().item()
        reference = (t.double().cpu() - e).abs().max().item()
        floor = FLOORS[dtype] * e.abs().max().item()
        assert error <= ERROR_RATIO * reference + floor, (
            f"d{name}: error {error:.3g}, PyTorch's {reference:.3g}, floor {floor:.3g}"
        )


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1023), (197, 3072), (2, 197, 1000), (8192, 96)])
def test_cuda_bias_gelu(dtype, approximate, shape):
    inputs = [torch.randn(shape) * 3, torch.randn(shape[-1])]
    check_against_formula(
        ops.bias_gelu,
        bias_gelu_formula,
        inputs,
        dtype,
        ["x", "bias"],
        device="cuda",
        baseline=bias_gelu_formula,
        approximate=approximate,
    )


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 12, 197, 197), (3, 1023)])
def test_cuda_softmax(dtype, shape):
    def softmax(t):
        return torch.softmax(t, -1)

    check_against_formula(
        ops.softmax, softmax, [torch.randn(shape) * 4], dtype, ["x"], device="cuda", baseline=softmax
    )


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("geometry", [(2, 3, 224, 224, 16), (3, 2, 11, 10, 3)])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_cuda_patchify(dtype, geometry, layout):
    n, c, h, w, p = geometry

    def op(images, patch_size):
        if layout == "channels_last":
            images = images.contiguous(memory_format=torch.channels_last)
        return ops.patchify(images, patch_size)

    check_against_formula(
        op,
        patchify_formula,
        [torch.randn(n, c, h, w)],
        dtype,
        ["images"],
        device="cuda",
        baseline=patchify_formula,
        patch_size=p,
    )


@requires_cuda
@needs_cuda_kernels
@pytest.mark.parametrize("case", sorted(opcheck_cases() if BUILT else {}))
def test_cuda_opcheck(case):
    op, args = opcheck_cases()[case]
    # float32 on the GPU (its kernels take no float64); channels_last survives .to().
    args = tuple(
        a.detach().to("cuda", torch.float32).requires_grad_(a.requires_grad)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )
    torch.library.opcheck(op, args)


def test_compiled_autograd_runs_the_cpp_backwards():
    """Compiled autograd collects the C++ nodes (it asserts on a non-differentiable output set)."""
    x = torch.randn(4, 8, requires_grad=True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    upstream = torch.randn(4, 8)

    def loss():
        y = ops.fused_layer_norm(x, None, w, b, 1e-5)[0]
        return (ops.softmax(ops.bias_gelu(y, b, "none")) * upstream).sum()

    expected = torch.autograd.grad(loss(), [x, w, b])
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        loss().backward()
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["linear_residual", "attention_explicit"])
def test_compositions_stay_symbolic_under_dynamic_shapes(op):
    """Sizes are read as SymInts: new batch sizes reuse the graph instead of recompiling."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    w, b = torch.randn(6, 8), torch.randn(6)
    if op == "linear_residual":
        fn = torch.compile(lambda x, r: ops.linear_residual(x, w, b, r), backend=counter, dynamic=True)
        calls = [(torch.randn(n, 5, 8), torch.randn(n, 5, 6)) for n in (2, 3, 4)]
    else:
        fn = torch.compile(
            lambda qkv: ops.attention_explicit(qkv, 2, 0.5, 0.0)[0], backend=counter, dynamic=True
        )
        calls = [(torch.randn(n, 5, 24),) for n in (2, 3, 4)]
    for args in calls:
        fn(*args)
    assert counter.frame_count == 1


def test_attention_explicit_rejects_bad_heads():
    with pytest.raises(RuntimeError, match="num_heads must be positive"):
        ops.attention_explicit(torch.randn(1, 2, 6), 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match=r"qkv must have shape \(B, L, 3 \* num_heads \* head_dim\)"):
        ops.attention_explicit(torch.randn(1, 2, 10), 4, 1.0, 0.0)


def explicit_attention_formula(qkv, num_heads, scale):
    """(out (B, L, D), P (B, H, L, L)) of softmax(scale q k^T) v, by PyTorch's own ops."""
    batch, length, three_d = qkv.shape
    q, k, v = qkv.view(batch, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    probs = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1)
    return (probs @ v).transpose(1, 2).reshape(batch, length, three_d // 3), probs


@pytest.mark.parametrize("through", ["out", "probs", "both"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_attention_explicit_gradient_through_either_output(through, dtype):
    """The one-node backward of attention_explicit (dV = P^T dO, dP = dO V^T + the gradient reaching
    P, dS = scale softmax'(dP), dQ = dS K, dK = dS^T Q) against autograd of the formula in float64,
    with the loss reaching the output, the probabilities, or both."""
    qkv = torch.randn(3, 7, 36)
    upstream = torch.randn(3, 7, 12), torch.randn(3, 2, 7, 7)

    def loss(out, probs):
        terms = {
            "out": (out * upstream[0].to(out.dtype)).sum(),
            "probs": (probs * upstream[1].to(probs.dtype)).sum(),
        }
        return sum(terms[name] for name in terms if through in (name, "both"))

    mine_input = qkv.to(dtype).requires_grad_(True)
    (mine,) = torch.autograd.grad(loss(*ops.attention_explicit(mine_input, 2, 0.4, 0.0)), mine_input)
    exact_input = qkv.to(dtype).double().requires_grad_(True)
    (exact,) = torch.autograd.grad(loss(*explicit_attention_formula(exact_input, 2, 0.4)), exact_input)
    assert mine.dtype == dtype and mine.shape == qkv.shape
    atol, rtol = {torch.float64: (1e-10, 1e-8), torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}[
        dtype
    ]
    torch.testing.assert_close(mine.double(), exact, atol=atol, rtol=rtol)


def test_attention_explicit_backward_stays_symbolic_under_dynamic_shapes():
    """Compiled with gradients (AOT autograd, dynamic shapes): one graph serves three batch sizes, and
    its gradients are eager's."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(
        lambda qkv: ops.attention_explicit(qkv, 2, 0.5, 0.0)[0].square().sum(), backend=counter, dynamic=True
    )
    for n in (2, 3, 4):
        qkv = torch.randn(n, 5, 24, requires_grad=True)
        (compiled,) = torch.autograd.grad(fn(qkv), qkv)
        (eager,) = torch.autograd.grad(ops.attention_explicit(qkv, 2, 0.5, 0.0)[0].square().sum(), qkv)
        torch.testing.assert_close(compiled, eager)
    assert counter.frame_count == 1
