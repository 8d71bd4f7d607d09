"""vk.attention on every backend that runs here against an explicit float64 formula: output,
dqkv, probabilities, dropout, and error no larger than twice PyTorch's own in the same dtype."""

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import (
    CPU_BACKENDS,
    CUDA_DTYPES,
    assert_close,
    check_against_formula,
    device_backend_dtypes,
    device_backends,
    requires_cuda,
    skip_unless_offered,
)
from vit_kernels import backend
from vit_kernels.ops import attention, attention_reference


def attention_formula(qkv, num_heads, scale=None):
    """Per head: softmax(scale * q k^T) v, heads concatenated. qkv (B, L, 3D) -> (B, L, D)."""
    batch, length, three_d = qkv.shape
    dim = three_d // 3
    head_dim = dim // num_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = qkv[..., :dim], qkv[..., dim : 2 * dim], qkv[..., 2 * dim :]
    outs, all_probs = [], []
    for h in range(num_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        scores = torch.einsum("bid,bjd->bij", q[..., cols], k[..., cols]) * scale
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        outs.append(torch.einsum("bij,bjd->bid", probs, v[..., cols]))
        all_probs.append(probs)
    return torch.cat(outs, dim=-1), torch.stack(all_probs, dim=1)


def out_only(qkv, num_heads, **kwargs):
    return vk.attention(qkv, num_heads, **kwargs)


def formula_out(qkv, num_heads, scale=None):
    return attention_formula(qkv, num_heads, scale)[0]


QKV_PARTS = {"qkv": ("q", "k", "v")}  # dqkv compared as dq, dk and dv, each on its own


def check_attention_against_formula(
    qkv, dtype, device, num_heads, formula=formula_out, check=check_against_formula, **kwargs
):
    """vk.attention(qkv (B, L, 3D), num_heads, **kwargs) in ``dtype`` on ``device`` against
    ``formula`` (qkv, num_heads, **kwargs) -> (B, L, D) in float64: the output and dq, dk and dv,
    each on its own. ``check`` is the comparison, ``check_against_formula`` unless a caller passes
    its own."""
    check(
        out_only, formula, [qkv], dtype, ["qkv"], device, grad_parts=QKV_PARTS, num_heads=num_heads, **kwargs
    )


# float16 on the torch backend is PyTorch's own error: test_error_within_twice_pytorch measures it.
OP = "attention"  # the on_backend fixture skips a backend that does not offer it on the device
CPU_PAIRS = [("torch", torch.float32)] + [
    (name, dt) for name in CPU_BACKENDS[1:] for dt in (torch.float32, torch.float16)
]
BACKEND_DTYPES = device_backend_dtypes("attention", CPU_PAIRS)


@pytest.mark.pairwise
@pytest.mark.parametrize("length", [1, 17, 50, 65, 197])
@pytest.mark.parametrize("head_dim", [4, 8, 12, 15, 32, 64])
@pytest.mark.parametrize("device,backend_name,dtype", BACKEND_DTYPES)
def test_attention_matches_formula(device, backend_name, dtype, length, head_dim):
    heads = 2
    qkv = torch.randn(1 if length == 197 else 2, length, 3 * heads * head_dim)
    with vk.use_backend(backend_name):
        check_against_formula(out_only, formula_out, [qkv], dtype, ["qkv"], device, num_heads=heads)


# The Triton kernels run the blocks inside the sequence without masks and then one masked tail
# block (L mod the block, padded to a power of two): lengths the block divides (no tail: the
# interpreter's 32-row tile at L = 32, 64, 96; L = 16 is a single 16-row block), one row past a
# block (L = 33: a 16-row tail holding 1), one short (L = 31: a lone tail), L = 1; head dims 1
# (padded to 16), 80 (padded to 128: masked columns) and 256 (unpadded, the largest).
TAIL_DTYPES = device_backend_dtypes(
    "attention", [("triton", dt) for dt in (torch.float32, torch.float16) if "triton" in CPU_BACKENDS]
)


@pytest.mark.pairwise
@pytest.mark.parametrize("length", [1, 16, 31, 32, 33, 64, 96])
@pytest.mark.parametrize("head_dim", [1, 80, 256])
@pytest.mark.parametrize("device,backend_name,dtype", TAIL_DTYPES)
def test_tail_blocks_match_formula(device, backend_name, dtype, length, head_dim):
    """Output and every gradient (dq, dk, dv each on its own) against the float64 formula."""
    heads = 2
    qkv = torch.randn(2, length, 3 * heads * head_dim)
    with vk.use_backend(backend_name, strict=True):
        check_attention_against_formula(qkv, dtype, device, heads)


# The backward at the ViT head dims, 64 (ViT-B and -L), 80 and 96 (padded to 128: masked columns)
# and 128, at lengths with a tail block for the interpreter's 32-row tile (L = 50: 18 rows in a 32-row
# tail; L = 197: 5 rows in a 16-row one): dq, dk and dv each on its own against float64.
@pytest.mark.pairwise
@pytest.mark.parametrize("length", [50, 197])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("device,backend_name,dtype", TAIL_DTYPES)
def test_backward_at_vit_head_dims_matches_formula(device, backend_name, dtype, length, head_dim):
    heads = 2
    qkv = torch.randn(2 if length < 100 else 1, length, 3 * heads * head_dim)
    with vk.use_backend(backend_name, strict=True):
        check_attention_against_formula(qkv, dtype, device, heads)


@pytest.mark.parametrize(
    "length,block_n,tail",
    [
        (197, 64, 16),
        (197, 32, 16),
        (192, 64, 0),
        (64, 64, 0),
        (65, 64, 16),
        (1, 16, 16),
        (100, 64, 64),
        (81, 64, 32),
    ],
)
def test_tail_block_is_the_remainder_padded(length, block_n, tail):
    assert attention._tail_block(block_n, length) == tail


@pytest.mark.parametrize("length", [197, 256])
def test_gpu_launches_mask_only_a_tail_block(length):
    """On a GPU (the simulated H100, launches recorded) each kernel gets the tail of its own loop:
    the forward's and dQ's over key blocks (BLOCK_N), dK/dV's over query blocks (BLOCK_M)."""
    from tools.cuda_sim import simulated_cuda

    with simulated_cuda(90) as device:
        qkv = torch.empty(2, length, 3 * 2 * 64, dtype=torch.bfloat16, device="cuda")
        seed = torch.empty(1, dtype=torch.int64, device="cuda")
        out, stats = attention.attention_fwd(qkv, 2, 0.125, 0.0, seed)
        attention.attention_bwd(torch.empty_like(out), qkv, stats, seed, 2, 0.125, 0.0)
    launches = device.launches
    assert launches
    for launch in launches:
        looped = launch.kwargs[
            "BLOCK_M" if launch.kernel.fn.__name__ == "_attention_bwd_dkdv_kernel" else "BLOCK_N"
        ]
        assert launch.kwargs["BLOCK_TAIL"] == attention._tail_block(looped, length)
        assert launch.kwargs["EVEN_D"] is True
        assert (launch.kwargs["BLOCK_TAIL"] == 0) == (length % looped == 0)


def test_float64_reference_is_exact():
    qkv = torch.randn(2, 17, 3 * 3 * 8)
    with vk.use_backend("torch"):
        check_against_formula(out_only, formula_out, [qkv], torch.float64, ["qkv"], num_heads=3)


def _max_errors(qkv16: torch.Tensor, heads: int, upstream: torch.Tensor):
    """Max |out - ref| and |dqkv - ref| of vk.attention on qkv16, against float64."""
    qkv = qkv16.detach().clone().requires_grad_(True)
    out = vk.attention(qkv, heads)
    (grad,) = torch.autograd.grad(out, qkv, upstream.to(out.dtype))
    wide = qkv16.detach().double().requires_grad_(True)
    ref = formula_out(wide, heads)
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    return (out.double() - ref).abs().max().item(), (grad.double() - ref_grad).abs().max().item()


@pytest.mark.parametrize("length,head_dim", [(17, 8), (65, 15), (197, 64)])
def test_error_within_twice_pytorch(length, head_dim):
    """In float16 the Triton kernels may err at most 2x what PyTorch's attention errs, same inputs."""
    if "triton" not in CPU_BACKENDS:
        pytest.skip("the Triton backend does not run here")
    heads = 2
    qkv16 = torch.randn(1, length, 3 * heads * head_dim).half()
    upstream = torch.randn(1, length, heads * head_dim)
    with vk.use_backend("torch"):
        torch_out_err, torch_grad_err = _max_errors(qkv16, heads, upstream)
    with vk.use_backend("triton"):
        out_err, grad_err = _max_errors(qkv16, heads, upstream)
    floor = 1e-3  # PyTorch's float16 CPU attention accumulates in float32 too; allow one fp16 ulp near 1
    assert out_err <= 2 * torch_out_err + floor, (out_err, torch_out_err)
    assert grad_err <= 2 * torch_grad_err + floor, (grad_err, torch_grad_err)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_attention_scale(on_backend, scale):
    qkv = torch.randn(2, 17, 3 * 2 * 8)
    check_against_formula(out_only, formula_out, [qkv], torch.float32, ["qkv"], num_heads=2, scale=scale)


def test_attention_strided_qkv(on_backend):
    """A qkv view with non-unit outer strides (a slice of a wider buffer) is read in place."""
    wide = torch.randn(2, 17, 3 * 24 + 5)
    qkv = wide[..., 3 : 3 + 72].requires_grad_(False)
    assert not qkv.is_contiguous()
    check_against_formula(out_only, formula_out, [qkv], torch.float32, ["qkv"], num_heads=4)
    torch.testing.assert_close(
        vk.attention(qkv, 4), formula_out(qkv.contiguous().double(), 4).float(), atol=1e-4, rtol=1e-4
    )


def test_attention_transposed_qkv_view(on_backend):
    """qkv with a non-unit last-dimension stride (a transposed view) is read by strides too."""
    base = torch.randn(2, 3 * 16, 9)
    qkv = base.transpose(1, 2)
    assert qkv.stride(-1) != 1
    torch.testing.assert_close(
        vk.attention(qkv, 2).double(), formula_out(qkv.double(), 2), atol=1e-4, rtol=1e-4
    )


def test_attention_huge_logits_stay_finite(on_backend):
    qkv = torch.randn(1, 33, 3 * 16) * 100.0  # |scores| ~ 1e4
    out = vk.attention(qkv, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), formula_out(qkv.double(), 2), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("length", [1, 17, 50, 64])
def test_return_probs(on_backend, length):
    qkv = torch.randn(2, length, 3 * 3 * 4, requires_grad=True)
    out, probs = vk.attention(qkv, 3, return_probs=True)
    ref_out, ref_probs = attention_formula(qkv.detach().double(), 3)
    assert probs.shape == (2, 3, length, length)
    torch.testing.assert_close(
        probs.sum(-1).double(), torch.ones(2, 3, length, dtype=torch.float64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(probs.detach().double(), ref_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.detach().double(), ref_out, atol=1e-5, rtol=1e-5)
    # gradients flow through both outputs
    w_out, w_probs = torch.randn_like(out), torch.randn_like(probs)
    (grad,) = torch.autograd.grad((out * w_out).sum() + (probs * w_probs).sum(), qkv)
    wide = qkv.detach().double().requires_grad_(True)
    ref_out, ref_probs = attention_formula(wide, 3)
    (ref_grad,) = torch.autograd.grad((ref_out * w_out).sum() + (ref_probs * w_probs).sum(), wide)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


def test_dropout_is_unbiased_and_seeded():
    qkv = torch.randn(1, 9, 3 * 8, dtype=torch.float64)
    reference = formula_out(qkv, 2)
    with vk.use_backend("torch"):
        torch.manual_seed(1)
        first = vk.attention(qkv, 2, dropout_p=0.3)
        torch.manual_seed(1)
        again = vk.attention(qkv, 2, dropout_p=0.3)
        torch.testing.assert_close(first, again)
        assert not torch.allclose(first, reference)
        mean = torch.stack([vk.attention(qkv, 2, dropout_p=0.3) for _ in range(3000)]).mean(0)
    torch.testing.assert_close(mean, reference, atol=0.08, rtol=0.0)


def _dropout_masks(batch: int, heads: int, length: int, p: float, seed: int) -> torch.Tensor:
    """The keep masks (B, H, L, L), (query, key): with v = identity (head dim L) each head's output
    *is* its dropped probabilities."""
    q_k = torch.randn(batch, length, 2 * heads * length)
    identity = torch.eye(length).repeat(1, heads).expand(batch, length, heads * length)
    qkv = torch.cat([q_k, identity], dim=-1)
    torch.manual_seed(seed)
    out, probs = vk.attention(qkv, heads, dropout_p=p, return_probs=True)
    out = out.unflatten(-1, (heads, length)).transpose(1, 2)  # (B, H, L, L)
    mask = out != 0
    torch.testing.assert_close(out[mask], probs[mask] / (1 - p), atol=1e-5, rtol=1e-5)
    return mask


def _dropout_mask(length: int, p: float, seed: int) -> torch.Tensor:
    """The keep mask (L, L) of one head of one image."""
    return _dropout_masks(1, 1, length, p, seed)[0, 0]


_MASKS: dict[tuple, torch.Tensor] = {}


def _cached_dropout_masks(*args) -> torch.Tensor:
    """``_dropout_masks``, drawn once per process for each (batch, heads, length, p, seed)."""
    if args not in _MASKS:
        _MASKS[args] = _dropout_masks(*args)
    return _MASKS[args]


@pytest.mark.parametrize("p", [0.1, 0.25])
def test_dropout_kept_fraction_and_reproducible(on_backend, p):
    length = 64
    mask = _dropout_mask(length, p, seed=7)
    assert abs(mask.double().mean().item() - (1 - p)) < 0.03
    assert torch.equal(mask, _dropout_mask(length, p, seed=7)), "the same seed must give the same mask"
    assert not torch.equal(mask, _dropout_mask(length, p, seed=8))


@pytest.mark.parametrize(
    "length", [24, 32, 33]
)  # a lone tail block, none, a 1-key tail (interpreter tile 32)
@pytest.mark.parametrize("return_probs", [True, False])
def test_dropout_gradient_is_that_of_the_masked_function(on_backend, return_probs, length):
    """out = (mask * P / (1 - p)) v with the very mask drawn for that seed; dqkv is its gradient."""
    if on_backend == "torch" and not return_probs:
        pytest.skip("SDPA draws its mask differently from the probs path: checked with return_probs only")
    p, seed = 0.2, 3
    mask = _dropout_mask(length, p, seed).double()
    qkv = torch.randn(1, length, 3 * length, requires_grad=True)
    torch.manual_seed(seed)
    result = vk.attention(qkv, 1, dropout_p=p, return_probs=return_probs)
    out = result[0] if return_probs else result
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, upstream)

    wide = qkv.detach().double().requires_grad_(True)
    q, k, v = wide[..., :length], wide[..., length : 2 * length], wide[..., 2 * length :]
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(length), dim=-1)
    ref = (probs * mask / (1 - p)) @ v
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


# Every head dim at L = 50; at ViT's L = 197 (about 10 s a case under the interpreter) head dim 64 in
# the default run, the others in the slow one
_DROPOUT_SHAPES = (
    [(d, 50) for d in (64, 80, 96, 128)]
    + [(64, 197)]
    + [pytest.param(d, 197, marks=pytest.mark.slow) for d in (80, 96, 128)]
)


@pytest.mark.parametrize("head_dim,length", _DROPOUT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_gradient_at_vit_head_dims(dtype, head_dim, length):
    """With dropout, at the ViT head dims and lengths with a tail block (two heads; two images at
    L = 50): out = (z * P / (1 - p)) v with the masks z drawn for that seed (the dK/dV kernel draws
    them on transposed tiles), and dq, dk, dv each its gradient, against float64."""
    if "triton" not in CPU_BACKENDS:
        pytest.skip("the Triton backend does not run here")
    p, seed, batch, heads = 0.2, 3, 2 if length < 100 else 1, 2
    with vk.use_backend("triton", strict=True):
        mask = _cached_dropout_masks(batch, heads, length, p, seed).double()
        qkv = torch.randn(batch, length, 3 * heads * head_dim).to(dtype).requires_grad_(True)
        torch.manual_seed(seed)
        out = vk.attention(qkv, heads, dropout_p=p)
    upstream = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, qkv, upstream.to(dtype))

    wide = qkv.detach().double().requires_grad_(True)
    q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2) for t in wide.chunk(3, dim=-1))
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(head_dim), dim=-1)
    ref = attention_reference.merge_heads((probs * mask / (1 - p)) @ v)
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    assert_close(out, ref, dtype, "out")
    for name, part, ref_part in zip("qkv", grad.chunk(3, dim=-1), ref_grad.chunk(3, dim=-1)):
        assert_close(part, ref_part, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extension_attention_is_not_offered_on_cuda(dtype):
    """The extension's attention materialises the scores (4-15x slower than SDPA on an H100): its
    support check refuses CUDA with that reason, and a strict request raises naming it, decided from
    the device alone (a CPU-only machine can construct torch.device("cuda") and ask)."""
    from vit_kernels import _ext, backend
    from vit_kernels.ops.attention import EXTENSION_CUDA_REASON, _extension_supports

    cuda = torch.device("cuda")
    assert _extension_supports(cuda, dtype) == EXTENSION_CUDA_REASON
    assert "(B, H, L, L)" in EXTENSION_CUDA_REASON and "SDPA" in EXTENSION_CUDA_REASON
    # CPU behaviour unchanged: the extension's own answer
    cpu = torch.device("cpu")
    assert _extension_supports(cpu, dtype) == _ext.supports(cpu, dtype)
    if backend.backend_unavailable_reason("extension") is None:
        assert backend.unsupported_reason("attention", "extension", cuda, dtype) == EXTENSION_CUDA_REASON
        with vk.use_backend("extension", strict=True):
            with pytest.raises(backend.CannotRunError, match=r"materialises the \(B, H, L, L\) scores"):
                backend.resolve("attention", cuda, dtype)


def test_registered_ops_pass_opcheck():
    if "triton" not in CPU_BACKENDS:
        pytest.skip("the Triton backend does not run here")
    qkv = torch.randn(2, 17, 3 * 16, requires_grad=True)
    seed = torch.zeros(1, dtype=torch.int64)
    # fake-tensor and AOT checks trace the kernels, which needs a GPU: see test_opcheck_full_on_cuda
    utils = ("test_schema", "test_autograd_registration")
    torch.library.opcheck(torch.ops.vit_kernels.attention_fwd, (qkv, 2, 0.35, 0.0, seed), test_utils=utils)
    _, lse = torch.ops.vit_kernels.attention_fwd(qkv, 2, 0.35, 0.0, seed)
    torch.library.opcheck(
        torch.ops.vit_kernels.attention_probs, (qkv, lse.detach(), 2, 0.35), test_utils=utils
    )


# ---- GPU only: bfloat16, the full opcheck, torch.compile --------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "length,head_dim", [(1, 4), (17, 8), (65, 15), (197, 64), (257, 64), (577, 64), (50, 128)]
)
def test_cuda_error_within_twice_pytorch(dtype, length, head_dim):
    """Longer sequences and wider heads than the formula test: output and dqkv within twice
    PyTorch's own error (its SDPA on the same 16-bit inputs)."""
    qkv = torch.randn(2, length, 3 * 3 * head_dim)
    with vk.use_backend("triton"):
        check_against_formula(out_only, formula_out, [qkv], dtype, ["qkv"], "cuda", num_heads=3)


@requires_cuda
def test_opcheck_full_on_cuda():
    qkv = torch.randn(2, 17, 3 * 16, device="cuda", requires_grad=True)
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.vit_kernels.attention_fwd, (qkv, 2, 0.35, 0.0, seed))


@requires_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_compiles_without_graph_break(dtype):
    qkv = torch.randn(4, 197, 3 * 192, device="cuda", dtype=dtype, requires_grad=True)

    def step(x):
        return vk.attention(x, 3).float().square().sum()

    with vk.use_backend("triton"):
        compiled = torch.compile(step, fullgraph=True)
        loss = compiled(qkv)
        loss.backward()
        (grad,) = torch.autograd.grad(step(qkv), qkv)
    torch.testing.assert_close(loss, step(qkv), atol=1e-2, rtol=1e-2)
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("device,name", device_backends())
def test_head_dims_beyond_the_kernel_are_a_limit_of_its_table(device, name):
    """Head dim 260 > 256: Triton cannot take the call; strict raises naming the limit, otherwise
    the reference runs, with a warning and a fallback row in explain()."""
    skip_unless_offered("attention", name, device)
    qkv = torch.randn(1, 5, 3 * 260, device=device)
    backend.clear_decisions()  # explain() below must list this test's calls only
    if name != "triton":
        with vk.use_backend(name, strict=True):
            check_against_formula(out_only, formula_out, [qkv], torch.float32, ["qkv"], num_heads=1)
        return
    with vk.use_backend("triton", strict=True), pytest.raises(RuntimeError, match="head dim 260 > 256"):
        vk.attention(qkv, 1)
    with vk.use_backend("triton"), pytest.warns(RuntimeWarning, match="head dim 260 > 256"):
        check_against_formula(out_only, formula_out, [qkv], torch.float32, ["qkv"], num_heads=1)
    (row,) = {(r.backend, r.source) for r in vk.explain() if r.requested == "triton"}
    assert row == ("torch", "fallback")


def test_sdpa_layouts_it_would_refuse_are_recognised():
    """The torch backend copies q, k and v before SDPA on CUDA where its fused kernels would raise
    on the layout (a qkv cut out of a wider tensor has rows that are not 16-byte aligned)."""
    from vit_kernels.ops.attention_reference import sdpa_misaligned, split_qkv

    aligned = torch.randn(2, 17, 3 * 64, dtype=torch.float16)
    assert not any(sdpa_misaligned(t) for t in split_qkv(aligned, 4))
    wider = torch.randn(2, 17, 3 * 64 + 3, dtype=torch.float16)
    cut = wider[..., 3:]  # rows of 3 * 64 + 3 halves: a 390-byte row stride
    assert all(sdpa_misaligned(t) for t in split_qkv(cut, 4))
    offset = torch.randn(2 * 17 * 3 * 64 + 1, dtype=torch.float16)[1:].view(2, 17, 3 * 64)
    assert all(sdpa_misaligned(t) for t in split_qkv(offset, 4))  # the data pointer is 2 bytes off


@pytest.mark.parametrize("shape", [(2, 1, 1, 50), (17, 17), (2, 3, 5, 5), (1, 1, 7, 33)])
def test_masks_reach_sdpa_as_an_aligned_bias(shape):
    """On CUDA the torch backend hands SDPA a fresh bias whose rows start on 16-element boundaries:
    a boolean mask as 0 / -inf in the queries' dtype, a float one with its values (and its gradient)."""
    from vit_kernels.ops.attention_reference import SDPA_ALIGNMENT_ELEMENTS, padded_bias

    keep = torch.rand(shape) < 0.6
    bias = padded_bias(keep, torch.float16)
    assert bias.dtype == torch.float16 and bias.shape == keep.shape
    assert torch.equal(bias == 0, keep) and torch.equal(bias == float("-inf"), ~keep)
    assert bias.stride(-2) % SDPA_ALIGNMENT_ELEMENTS == 0 and bias.storage_offset() == 0
    additive = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    copied = padded_bias(additive, torch.float16)
    assert copied.dtype == torch.float64 and torch.equal(copied, additive)
    assert copied.stride(-2) % SDPA_ALIGNMENT_ELEMENTS == 0
    upstream = torch.randn(shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(copied, additive, upstream)
    assert torch.equal(grad, upstream)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_backend_takes_a_misaligned_qkv_on_cuda(dtype):
    wider = torch.randn(2, 197, 3 * 192 + 5, device="cuda", dtype=dtype)
    qkv = wider[..., 5:]
    with vk.use_backend("torch", strict=True):
        out = vk.attention(qkv, 3)
    expected = vk.attention(qkv.contiguous().double(), 3)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_a_loss_on_the_probabilities_alone(on_backend):
    """Only the attention maps reach the loss (the output is unused): d qkv is the probabilities'
    own gradient, no gradient of the output being made up."""
    qkv = torch.randn(2, 9, 24, dtype=torch.float64 if on_backend != "triton" else torch.float32)
    upstream = torch.randn(2, 2, 9, 9, dtype=qkv.dtype)
    mine_input = qkv.clone().requires_grad_(True)
    _, probs = vk.attention(mine_input, 2, return_probs=True)
    (mine,) = torch.autograd.grad((probs * upstream).sum(), mine_input)
    exact_input = qkv.double().requires_grad_(True)
    (exact,) = torch.autograd.grad(
        (attention_formula(exact_input, 2)[1] * upstream.double()).sum(), exact_input
    )
    torch.testing.assert_close(mine.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    "triton" not in CPU_BACKENDS, reason="Triton runs on the CPU only under TRITON_INTERPRET=1"
)
def test_a_call_without_dropout_reads_no_seed_and_allocates_none():
    """Without dropout the kernels never read the seed: every call passes one tensor per device,
    made outside inference mode so that a later call with gradients may save it, and never while
    tracing (a graph must not hold a global tensor)."""
    attention._UNUSED_SEEDS.clear()
    qkv = torch.randn(2, 5, 3 * 16, dtype=torch.float32)
    with vk.use_backend("triton", strict=True):
        with torch.inference_mode():
            served = vk.attention(qkv, 2)
        seed = attention._UNUSED_SEEDS[qkv.device]
        assert not seed.is_inference()
        leaf = qkv.clone().requires_grad_(True)
        trained = vk.attention(leaf, 2)
        (grad,) = torch.autograd.grad((trained * trained).sum(), leaf)
        assert attention._UNUSED_SEEDS == {qkv.device: seed}
    wide = qkv.double().requires_grad_(True)
    expected = formula_out(wide, 2)
    (expected_grad,) = torch.autograd.grad((expected * expected).sum(), wide)
    assert_close(served, expected, torch.float32, "out (inference mode)")
    assert_close(trained.detach(), expected.detach(), torch.float32, "out")
    assert_close(grad, expected_grad, torch.float32, "dqkv")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        traced = attention._unused_seed(qkv.device)
    assert traced is not seed and attention._UNUSED_SEEDS == {qkv.device: seed}
