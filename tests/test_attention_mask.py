"""vk.attention with an attention mask (``attn_mask``, SDPA's convention: boolean True = attend, or
additive, broadcastable to (B, H, L, L)) on every backend that runs here, against a float64 formula
written out below: output, dqkv, probabilities, dropout, rope, rows with every key masked, finite
(finfo.min) masks, mask layouts, and the errors of bad masks."""

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import CPU_BACKENDS
from tests.test_attention import _dropout_mask, check_attention_against_formula
from tests.test_attention_rope import assert_out_probs_and_grad, frequency_tables, rope_formula
from vit_kernels import backend
from vit_kernels.ops import attention, attention_tiles

MASK_BACKENDS = [name for name in CPU_BACKENDS if name != "extension"]
TRITON = "triton" in CPU_BACKENDS
FLOAT32_MIN = torch.finfo(torch.float32).min


def masked_formula(
    qkv,
    num_heads,
    attn_mask=None,
    scale=None,
    dropout_mask=None,
    dropout_p=0.0,
    rope=None,
    rope_layout="interleaved",
):
    """(out (B, L, D), probs (B, H, L, L)) in the dtype of qkv: S = scale q k^T + b (b = the additive
    mask, or 0 / -inf of a boolean one), P = softmax(S) per row, 0 in a row whose every S is -inf,
    out = (P times the keep mask / (1 - p)) v; q and k rotated first where ``rope`` is given."""
    batch, length, three_d = qkv.shape
    head_dim = three_d // (3 * num_heads)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = (t.unflatten(-1, (num_heads, head_dim)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    if rope is None:
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    else:  # the rotated scores up to a constant per row (log P of the rope formula): softmax ignores it
        scores = rope_formula(qkv, num_heads, rope, rope_layout, scale=scale)[1].log()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    dead = (scores == float("-inf")).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    dropped = probs if dropout_mask is None else probs * dropout_mask / (1 - dropout_p)
    out = (
        torch.einsum("bhij,bhjd->bhid", dropped, v)
        .transpose(1, 2)
        .reshape(batch, length, num_heads * head_dim)
    )
    return out, probs


def valid_tokens(batch: int, length: int, counts) -> torch.Tensor:
    """(B, L) bool: the first ``counts[b]`` tokens of image b are valid (a padded NaFlex batch)."""
    return torch.arange(length)[None, :] < torch.tensor(counts)[:, None]


def make_mask(kind: str, batch: int, heads: int, length: int) -> torch.Tensor:
    """A mask of ``kind``: key padding (B, 1, 1, L) boolean or as an expanded view; symmetric padding
    (B, 1, L, L) boolean or float (finfo.min, as timm's NaFlex builds it: padded queries keep every
    key, at finfo.min); per-head additive (H, L, L); a strided float view; a 2-D (L, L) boolean mask."""
    valid = valid_tokens(batch, length, [length - 3 * b for b in range(batch)])
    pair = (valid[:, :, None] & valid[:, None, :])[:, None]
    if kind == "key_bool":
        return valid[:, None, None, :]
    if kind == "key_expanded":
        return valid[:, None, None, :].expand(batch, heads, length, length)
    if kind == "pair_bool":
        return pair
    if kind == "pair_min":
        return torch.zeros(pair.shape).masked_fill(~pair, FLOAT32_MIN)
    if kind == "additive":
        return torch.randn(heads, length, length)
    if kind == "strided":
        return torch.randn(heads, 2 * length, 2 * length)[:, ::2, 1::2]
    if kind == "square_bool":  # every row keeps its diagonal: a random pattern, never an empty row
        return (torch.rand(length, length) < 0.6) | torch.eye(length, dtype=torch.bool)
    raise AssertionError(kind)


def formula_out(qkv, num_heads, **kwargs):
    return masked_formula(qkv, num_heads, **kwargs)[0]


KINDS = ["key_bool", "key_expanded", "pair_bool", "pair_min", "additive", "strided", "square_bool"]
# (length, heads, head dim): one length with a tail block for the interpreter's 32-row tile, one
# longer than two tiles, a head dim that is not a power of two
SHAPES = [(17, 2, 8), (50, 2, 12), (70, 1, 72)]
PARAMS = [
    pytest.param(name, torch.float32, kind, shape, id=f"{name}-{kind}-{shape[0]}")
    for name in MASK_BACKENDS
    for kind in KINDS
    for shape in SHAPES
    if not (name == "torch" and kind == "pair_min")
]  # torch: see test_finite_mask_rows_stay_finite
PARAMS += [
    pytest.param("triton", torch.float16, kind, (33, 2, 16), id=f"triton-fp16-{kind}")
    for kind in ("key_bool", "pair_min", "additive")
    if TRITON
]


@pytest.mark.parametrize("backend_name,dtype,kind,shape", PARAMS)
def test_mask_matches_formula(backend_name, dtype, kind, shape):
    """Output and dq, dk, dv (each on its own) against the float64 formula, every row included (rows
    whose every key is masked: zero output and gradient)."""
    length, heads, head_dim = shape
    batch = 2
    mask = make_mask(kind, batch, heads, length)
    qkv = torch.randn(batch, length, 3 * heads * head_dim)
    with vk.use_backend(backend_name, strict=True):
        check_attention_against_formula(qkv, dtype, "cpu", heads, formula_out, attn_mask=mask)


@pytest.mark.parametrize("backend_name", MASK_BACKENDS)
def test_rows_with_every_key_masked_are_zero(backend_name):
    """A query row whose every key is masked out gets out = 0, probabilities 0 and no gradient (SDPA's
    rule), also where the first key blocks of a row are masked and later ones are not."""
    heads, head_dim, length = 2, 8, 70
    mask = torch.ones(length, length, dtype=torch.bool)
    mask[5] = False  # an empty row
    mask[9, :60] = False  # only the last keys, past two 32-key blocks
    qkv = torch.randn(1, length, 3 * heads * head_dim, requires_grad=True)
    with vk.use_backend(backend_name, strict=True):
        out, probs = vk.attention(qkv, heads, attn_mask=mask, return_probs=True)
        out_alone = vk.attention(qkv, heads, attn_mask=mask)
    assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5])) and torch.equal(out_alone[0, 5], out[0, 5])
    assert torch.equal(probs[0, :, 5], torch.zeros_like(probs[0, :, 5]))
    ref_out, ref_probs = masked_formula(qkv.detach().double(), heads, attn_mask=mask)
    torch.testing.assert_close(out_alone.detach().double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs.detach().double(), ref_probs, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out_alone, qkv, upstream)
    assert torch.isfinite(grad).all()
    q_grad = grad[0, 5, : heads * head_dim]
    assert torch.equal(q_grad, torch.zeros_like(q_grad))


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend_name", MASK_BACKENDS)
def test_finite_mask_rows_stay_finite(backend_name, mask_dtype):
    """timm's NaFlex mask (finfo(dtype).min where a query or key is padding, in the mask's own dtype):
    finite everywhere, a padded query attending uniformly to every key, as SDPA computes it; the valid
    tokens' output and the gradient of a loss on them are those of the formula. (SDPA's float32 CPU
    kernel differentiates the padded rows its own way, so only the valid rows' gradient is compared
    on every backend.)"""
    heads, head_dim, length = 2, 16, 40
    valid = valid_tokens(2, length, [length, 29])
    pair = (valid[:, :, None] & valid[:, None, :])[:, None]
    mask = torch.zeros(pair.shape, dtype=mask_dtype).masked_fill(~pair, torch.finfo(mask_dtype).min)
    qkv = torch.randn(2, length, 3 * heads * head_dim, requires_grad=True)
    with vk.use_backend(backend_name, strict=True):
        out = vk.attention(qkv, heads, attn_mask=mask)
    assert torch.isfinite(out).all()
    v_mean = qkv.detach()[1, :, 2 * heads * head_dim :].mean(0)  # a padded query: uniform over all keys
    torch.testing.assert_close(out.detach()[1, 35], v_mean, atol=1e-5, rtol=1e-5)
    mask = mask.float()
    wide = qkv.detach().double().requires_grad_(True)
    ref = formula_out(wide, heads, attn_mask=mask)
    keep = valid[..., None].float()
    upstream = torch.randn_like(out) * keep
    torch.testing.assert_close(
        (out * keep).detach().double(), (ref * keep.double()).detach(), atol=1e-5, rtol=1e-5
    )
    (grad,) = torch.autograd.grad(out, qkv, upstream)
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend_name", MASK_BACKENDS)
def test_return_probs_with_mask_and_rope(backend_name):
    """Probabilities of a masked, rotating call are those of the rotated q and k, masked; gradients
    flow through out and probs."""
    heads, head_dim, length = 2, 12, 19
    cos, sin = frequency_tables(length - 1, head_dim, "half")
    mask = make_mask("key_bool", 2, heads, length)
    qkv = torch.randn(2, length, 3 * heads * head_dim, requires_grad=True)
    with vk.use_backend(backend_name, strict=True):
        out, probs = vk.attention(
            qkv, heads, return_probs=True, rope=(cos, sin), rope_layout="half", attn_mask=mask
        )
    wide = qkv.detach().double().requires_grad_(True)
    ref_out, ref_probs = masked_formula(wide, heads, attn_mask=mask, rope=(cos, sin), rope_layout="half")
    assert_out_probs_and_grad(out, probs, qkv, ref_out, ref_probs, wide)


@pytest.mark.skipif(not TRITON, reason="the Triton backend does not run here")
def test_dropout_with_mask():
    """Dropout of a masked call: out and dqkv are those of (z * P / (1 - p)) v with the mask z drawn
    for the seed (it depends on the seed and positions only) and P the masked probabilities."""
    p, seed, length, head_dim = 0.2, 3, 33, 16
    mask = torch.randn(length, length)
    mask[:, 20:] = float("-inf")
    qkv = torch.randn(1, length, 3 * head_dim, requires_grad=True)
    with vk.use_backend("triton", strict=True):
        keep = _dropout_mask(length, p, seed).double()
        torch.manual_seed(seed)
        out = vk.attention(qkv, 1, dropout_p=p, attn_mask=mask)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, upstream)
    wide = qkv.detach().double().requires_grad_(True)
    ref = formula_out(wide, 1, attn_mask=mask, dropout_mask=keep, dropout_p=p)
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    torch.testing.assert_close(out.detach().double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


def test_mask_that_requires_grad():
    """The torch reference differentiates an additive mask; the Triton kernels do not, so they
    decline such a call (strict raises naming it; otherwise the reference runs it)."""
    heads, head_dim, length = 2, 8, 11
    mask = torch.randn(heads, length, length, requires_grad=True)
    qkv = torch.randn(1, length, 3 * heads * head_dim)
    wide_mask = mask.detach().double().requires_grad_(True)
    ref = formula_out(qkv.double(), heads, attn_mask=wide_mask)
    upstream = torch.randn_like(ref)
    (ref_grad,) = torch.autograd.grad(ref, wide_mask, upstream)
    with vk.use_backend("torch", strict=True):
        out = vk.attention(qkv, heads, attn_mask=mask)
    (grad,) = torch.autograd.grad(out, mask, upstream.float())
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=1e-5)
    if TRITON:
        with vk.use_backend("triton", strict=True), pytest.raises(backend.CannotRunError, match="attn_mask"):
            vk.attention(qkv, heads, attn_mask=mask)
        with vk.use_backend("triton"), pytest.warns(RuntimeWarning, match="attn_mask"):
            fallback = vk.attention(qkv, heads, attn_mask=mask)
        torch.testing.assert_close(fallback.detach().double(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_extension_declares_masks_unsupported():
    """The C++ attention takes no mask: a limit of its table, so strict raises naming it and a plain
    request runs another backend."""
    if "extension" not in CPU_BACKENDS:
        pytest.skip("the extension is not built here")
    mask = make_mask("key_bool", 1, 2, 9)
    qkv = torch.randn(1, 9, 3 * 16)
    with vk.use_backend("extension", strict=True), pytest.raises(backend.CannotRunError, match="attn_mask"):
        vk.attention(qkv, 2, attn_mask=mask)
    with vk.use_backend("extension"), pytest.warns(RuntimeWarning, match="attn_mask"):
        out = vk.attention(qkv, 2, attn_mask=mask)
    torch.testing.assert_close(
        out.double(), formula_out(qkv.double(), 2, attn_mask=mask), atol=1e-5, rtol=1e-5
    )


def test_chooser_key_and_launches_tell_masked_calls_apart():
    """A masked call is its own kernel variant (MASK = 1 additive, 2 boolean; 0 without) and its own
    tile choice; on the simulated H100 each launch carries its mask's code and broadcast strides."""
    from tools.cuda_sim import simulated_cuda

    qkv = torch.empty(2, 197, 3 * 2 * 64)
    keys = {
        attention._chooser_key(qkv, 2, mask=mask)
        for mask in (None, torch.ones(197, dtype=torch.bool), torch.zeros(197))
    }
    assert len(keys) == 3
    for dtype, code in ((torch.bool, 2), (torch.float32, 1)):
        with simulated_cuda(90) as device:
            qkv = torch.empty(2, 197, 3 * 2 * 64, dtype=torch.bfloat16, device="cuda")
            mask = torch.empty(2, 1, 1, 197, dtype=dtype, device="cuda")
            seed = torch.empty(1, dtype=torch.int64, device="cuda")
            out, stats = attention.attention_fwd(qkv, 2, 0.125, 0.0, seed, None, None, "interleaved", mask)
            attention.attention_bwd(
                torch.empty_like(out), qkv, stats, seed, 2, 0.125, 0.0, None, None, "interleaved", mask
            )
            attention.attention_fwd(qkv, 2, 0.125, 0.0, seed)
        codes = [launch.kwargs["MASK"] for launch in device.launches]
        assert codes and set(codes) == {code, 0}
        names = attention._attention_fwd_kernel.arg_names
        strides = [names.index(f"stride_mask_{axis}") for axis in "bhmn"]
        masked = [
            launch
            for launch in device.launches
            if launch.kernel is attention._attention_fwd_kernel and launch.kwargs["MASK"]
        ]
        assert masked and all([launch.args[i] for i in strides] == [197, 0, 0, 1] for launch in masked)


BAD = [
    (dict(attn_mask=[[True]]), TypeError, r"attn_mask must be None or a torch.Tensor, got list"),
    (
        dict(attn_mask=torch.ones(9, 9, dtype=torch.int64)),
        TypeError,
        r"attn_mask must be boolean .* got torch.int64",
    ),
    (
        dict(attn_mask=torch.ones(9, 8)),
        ValueError,
        r"attn_mask must broadcast to \(B, H, L, L\) = \(2, 2, 9, 9\)",
    ),
    (dict(attn_mask=torch.ones(3, 1, 9, 9)), ValueError, r"broadcast to \(B, H, L, L\)"),
    (dict(attn_mask=torch.ones(1, 2, 1, 9, 9)), ValueError, r"broadcast to \(B, H, L, L\) .* got shape"),
    (dict(attn_mask=torch.ones((), dtype=torch.bool)), ValueError, r"broadcast to \(B, H, L, L\)"),
    (dict(attn_mask=torch.ones(9, 9, device="meta")), ValueError, r"attn_mask is on meta but qkv is on cpu"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_masks_raise(kwargs, error, message):
    qkv = torch.randn(2, 9, 3 * 16)
    with pytest.raises(error, match=message):
        vk.attention(qkv, 2, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_masked_candidates_fit_the_mask_tile(dtype, head_dim):
    """A masked call's candidates: tiles of at most MASK_MAX_TILE elements at most
    EXTRA_LOADS_MAX_STAGES stages (a 128 x 128 float32 mask tile passes sm_80's shared memory), the
    same first (default) tile as an unmasked call where that one fits."""
    for candidates in (
        attention_tiles.fwd_candidates(dtype, head_dim, 197, True, True),
        [t for pair in attention_tiles.bwd_candidates(dtype, head_dim, 197, True, True) for t in pair],
    ):
        assert candidates
        assert all(
            bm * bn <= attention_tiles.MASK_MAX_TILE and stages <= attention_tiles.EXTRA_LOADS_MAX_STAGES
            for bm, bn, _, stages in candidates
        )
    plain = attention_tiles.fwd_candidates(dtype, head_dim, 197)[0]
    if plain[0] * plain[1] <= attention_tiles.MASK_MAX_TILE:
        assert attention_tiles.fwd_candidates(dtype, head_dim, 197, True, True)[0][:3] == plain[:3]
