"""vk.attention with rotary position embedding (``rope=(cos, sin)``) on every backend that runs here
against a float64 formula written out below: output, dqkv, probabilities, dropout, prefix tokens,
both pair layouts, table shapes and strides, and the errors of bad tables."""

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import CPU_BACKENDS, assert_close
from tests.test_attention import _dropout_mask, check_attention_against_formula
from vit_kernels import backend
from vit_kernels import nn as vkn
from vit_kernels.ops import attention
from vit_kernels.ops.rope import Rope

ROPE_BACKENDS = [name for name in CPU_BACKENDS if name != "extension"]
TRITON = "triton" in CPU_BACKENDS


def rotation_matrix(head_dim: int, layout: str) -> torch.Tensor:
    """R (Dh, Dh) float64 with rot(x) = x @ R: the signed pair swap, (x_a, x_b) -> (-x_b, x_a) on
    the pairs (a, b) = (2i, 2i + 1) ("interleaved") or (i, i + Dh/2) ("half")."""
    half = head_dim // 2
    pairs = (
        [(2 * i, 2 * i + 1) for i in range(half)]
        if layout == "interleaved"
        else [(i, i + half) for i in range(half)]
    )
    rot = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for a, b in pairs:
        rot[b, a] = -1.0  # rot(x)_a = -x_b
        rot[a, b] = 1.0  # rot(x)_b = x_a
    return rot


def rope_formula(
    qkv, num_heads, rope, rope_layout="interleaved", scale=None, dropout_mask=None, dropout_p=0.0
):
    """(out (B, L, D), probs (B, H, L, L)): per head, q and k of the last L_r tokens rotated,
    x' = x cos + (x @ R) sin, then softmax(scale q' k'^T) (times the keep mask / (1 - p)) v."""
    cos, sin = rope
    batch, length, three_d = qkv.shape
    dim = three_d // 3
    head_dim = dim // num_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    rot = rotation_matrix(head_dim, rope_layout).to(qkv.dtype)
    cos = cos.to(qkv.dtype).expand(batch, num_heads, cos.shape[-2], head_dim)
    sin = sin.to(qkv.dtype).expand(batch, num_heads, sin.shape[-2], head_dim)
    start = length - cos.shape[-2]
    q, k, v = qkv[..., :dim], qkv[..., dim : 2 * dim], qkv[..., 2 * dim :]
    outs, all_probs = [], []
    for h in range(num_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)

        def rotated(x, h=h, cols=cols):
            x = x[..., cols]
            tail = x[:, start:]
            tail = tail * cos[:, h] + torch.einsum("bld,de->ble", tail, rot) * sin[:, h]
            return torch.cat([x[:, :start], tail], dim=1)

        scores = torch.einsum("bid,bjd->bij", rotated(q), rotated(k)) * scale
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        dropped = probs if dropout_mask is None else probs * dropout_mask / (1 - dropout_p)
        outs.append(torch.einsum("bij,bjd->bid", dropped, v[..., cols]))
        all_probs.append(probs)
    return torch.cat(outs, dim=-1), torch.stack(all_probs, dim=1)


def rope_angles(rows: int, head_dim: int, layout: str, theta: float = 100.0) -> torch.Tensor:
    """Real RoPE angles (rows, Dh) float64: position * theta^(-2i/Dh) for pair i, on both columns of
    the pair (adjacent for "interleaved", i and i + Dh/2 for "half")."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * freqs[None, :]
    return (
        angles.repeat_interleave(2, dim=-1)
        if layout == "interleaved"
        else torch.cat([angles, angles], dim=-1)
    )


def frequency_tables(rows: int, head_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (rows, Dh) float32 of ``rope_angles``."""
    angles = rope_angles(rows, head_dim, layout)
    return angles.cos().float(), angles.sin().float()


def make_tables(kind: str, batch: int, heads: int, rows: int, head_dim: int, layout: str):
    """cos, sin of ``kind``: (L_r, Dh), (H, L_r, Dh), (B, 1, L_r, Dh), an expanded view, a strided
    (non-contiguous) view, or random values (not a rotation: the formula holds for any table)."""
    cos, sin = frequency_tables(rows, head_dim, layout)
    if kind == "LD":
        return cos, sin
    if kind == "HLD":  # per-head tables: each head its own phase
        angles = (
            rope_angles(rows, head_dim, layout)
            + torch.arange(heads, dtype=torch.float64)[:, None, None] * 0.3
        )
        return angles.cos().float(), angles.sin().float()
    if kind == "B1LD":
        return cos.expand(batch, 1, rows, head_dim).clone(), sin.expand(batch, 1, rows, head_dim).clone()
    if kind == "expanded":
        return cos.expand(batch, heads, rows, head_dim), sin.expand(batch, heads, rows, head_dim)
    if kind == "strided":  # every other row and column of wider tables
        wide_cos, wide_sin = frequency_tables(2 * rows, 2 * head_dim, layout)
        return wide_cos[::2, ::2], wide_sin[::2, ::2]
    if kind == "random":
        return torch.randn(heads, rows, head_dim), torch.randn(heads, rows, head_dim)
    raise AssertionError(kind)


def formula_out(qkv, num_heads, **kwargs):
    return rope_formula(qkv, num_heads, **kwargs)[0]


# (length, heads, head dim, prefix tokens, tables, layout): prefix 0, 1 and 5; odd lengths (one with
# a tail block for the interpreter's 32-row tile); head dims 8, 12, 64 and 72 (SigLIP-so400m's, not a
# power of two: padded columns, and "half" pairs (i, i + 36) across the padding).
CASES = [
    (17, 2, 8, 1, "LD", "interleaved"),
    (17, 2, 8, 0, "HLD", "half"),
    (50, 2, 12, 5, "B1LD", "half"),
    (50, 1, 72, 1, "LD", "half"),
    (33, 2, 72, 5, "strided", "interleaved"),
    (197, 1, 64, 1, "expanded", "interleaved"),
    (24, 2, 16, 1, "random", "half"),
    (20, 3, 12, 5, "random", "interleaved"),
]
# the torch reference in float32; triton in float32 and (a subset) float16, with float32 tables
PARAMS = [pytest.param("torch", torch.float32, case, id=f"torch-fp32-{i}") for i, case in enumerate(CASES)]
PARAMS += [
    pytest.param("triton", torch.float32, case, id=f"triton-fp32-{i}")
    for i, case in enumerate(CASES)
    if TRITON
]
PARAMS += [
    pytest.param("triton", torch.float16, case, id=f"triton-fp16-{i}")
    for i, case in enumerate(CASES)
    if TRITON and i in (0, 3, 4, 6)
]


@pytest.mark.parametrize("backend_name,dtype,case", PARAMS)
def test_rope_matches_formula(backend_name, dtype, case):
    """Output and dq, dk, dv (each on its own) against the float64 formula."""
    length, heads, head_dim, prefix, kind, layout = case
    batch = 1 if length > 100 else 2
    cos, sin = make_tables(kind, batch, heads, length - prefix, head_dim, layout)
    qkv = torch.randn(batch, length, 3 * heads * head_dim)
    with vk.use_backend(backend_name, strict=True):
        check_attention_against_formula(
            qkv, dtype, "cpu", heads, formula_out, rope=(cos, sin), rope_layout=layout
        )


def test_rope_rotates_only_the_last_tokens_and_not_v():
    """With tables of L - 1 rows the first token's q and k are left as they are: identity tables on
    the rotated rows change nothing, and v is never rotated."""
    qkv = torch.randn(2, 9, 3 * 2 * 8, dtype=torch.float64)
    ones, zeros = torch.ones(8, 8, dtype=torch.float64), torch.zeros(8, 8, dtype=torch.float64)
    with vk.use_backend("torch"):
        torch.testing.assert_close(vk.attention(qkv, 2, rope=(ones, zeros)), vk.attention(qkv, 2))
        # a quarter turn of every pair: q' = rot(q) on tokens 1.., token 0 untouched
        turned = vk.attention(qkv, 2, rope=(zeros, ones), rope_layout="half", return_probs=True)[1]
    q, k = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in qkv[..., :32].chunk(2, dim=-1))
    rot = rotation_matrix(8, "half").double()
    q = torch.cat([q[:, :, :1], q[:, :, 1:] @ rot], dim=2)
    k = torch.cat([k[:, :, :1], k[:, :, 1:] @ rot], dim=2)
    torch.testing.assert_close(turned, torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1))


@pytest.mark.parametrize("backend_name", ROPE_BACKENDS)
def test_return_probs_with_rope(backend_name):
    """The probabilities are those of the rotated q and k; gradients flow through both outputs."""
    heads, head_dim, length = 2, 12, 19
    cos, sin = frequency_tables(length - 1, head_dim, "half")
    qkv = torch.randn(2, length, 3 * heads * head_dim, requires_grad=True)
    with vk.use_backend(backend_name, strict=True):
        out, probs = vk.attention(qkv, heads, return_probs=True, rope=(cos, sin), rope_layout="half")
    wide = qkv.detach().double().requires_grad_(True)
    ref_out, ref_probs = rope_formula(wide, heads, (cos, sin), "half")
    assert_out_probs_and_grad(out, probs, qkv, ref_out, ref_probs, wide)


def assert_out_probs_and_grad(out, probs, qkv, ref_out, ref_probs, wide) -> None:
    """out and probs of ``qkv`` against the float64 ones of ``wide`` (its float64 copy), and the
    gradient of a random weighting of both."""
    torch.testing.assert_close(probs.detach().double(), ref_probs.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.detach().double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    w_out, w_probs = torch.randn_like(out), torch.randn_like(probs)
    (grad,) = torch.autograd.grad((out * w_out).sum() + (probs * w_probs).sum(), qkv)
    (ref_grad,) = torch.autograd.grad((ref_out * w_out).sum() + (ref_probs * w_probs).sum(), wide)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "backend_name,return_probs", [("torch", True)] + [("triton", rp) for rp in (False, True) if TRITON]
)
def test_dropout_with_rope(backend_name, return_probs):
    """Dropout of a rotating call: the same seed gives the same output, and out and dqkv are those of
    (z * P' / (1 - p)) v with the very mask z drawn for that seed (drawn without rope: it depends on
    the seed and positions only) and P' the probabilities of the rotated q and k."""
    p, seed, length, head_dim, layout = 0.2, 3, 33, 16, "interleaved"
    cos, sin = frequency_tables(length - 1, head_dim, layout)
    with vk.use_backend(backend_name, strict=True):
        mask = _dropout_mask(length, p, seed).double()
        qkv = torch.randn(1, length, 3 * head_dim, requires_grad=True)
        torch.manual_seed(seed)
        result = vk.attention(
            qkv, 1, dropout_p=p, return_probs=return_probs, rope=(cos, sin), rope_layout=layout
        )
        torch.manual_seed(seed)
        again = vk.attention(
            qkv, 1, dropout_p=p, return_probs=return_probs, rope=(cos, sin), rope_layout=layout
        )
    out = result[0] if return_probs else result
    torch.testing.assert_close(out, again[0] if return_probs else again, atol=0, rtol=0)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, upstream)
    wide = qkv.detach().double().requires_grad_(True)
    ref = rope_formula(wide, 1, (cos, sin), layout, dropout_mask=mask, dropout_p=p)[0]
    (ref_grad,) = torch.autograd.grad(ref, wide, upstream.double())
    torch.testing.assert_close(out.detach().double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


def test_tables_that_require_grad():
    """The torch reference differentiates the tables too; the Triton kernels do not, so they decline
    such a call (strict raises naming it; otherwise the reference runs it)."""
    heads, head_dim, length = 2, 8, 11
    cos, sin = (t.requires_grad_(True) for t in frequency_tables(length - 1, head_dim, "interleaved"))
    qkv = torch.randn(1, length, 3 * heads * head_dim, dtype=torch.float64)
    wide_cos, wide_sin = (t.detach().double().requires_grad_(True) for t in (cos, sin))
    ref = rope_formula(qkv, heads, (wide_cos, wide_sin))[0]
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (wide_cos, wide_sin), upstream)
    with vk.use_backend("torch", strict=True):
        out = vk.attention(qkv, heads, rope=(cos, sin))
    grads = torch.autograd.grad(out, (cos, sin), upstream)
    for name, g, r in zip(("dcos", "dsin"), grads, ref_grads):
        assert_close(g, r, torch.float32, name)
    if TRITON:
        with (
            vk.use_backend("triton", strict=True),
            pytest.raises(backend.CannotRunError, match="require grad"),
        ):
            vk.attention(qkv.float(), heads, rope=(cos, sin))
        with vk.use_backend("triton"), pytest.warns(RuntimeWarning, match="require grad"):
            fallback = vk.attention(qkv.float(), heads, rope=(cos, sin))
        torch.testing.assert_close(fallback.double(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_extension_declares_rope_unsupported():
    """The C++ attention has no rope: a limit of its table, so strict raises naming it and auto or
    a plain request runs another backend."""
    if "extension" not in CPU_BACKENDS:
        pytest.skip("the extension is not built here")
    cos, sin = frequency_tables(8, 8, "interleaved")
    qkv = torch.randn(1, 9, 3 * 16)
    with vk.use_backend("extension", strict=True), pytest.raises(backend.CannotRunError, match="rope"):
        vk.attention(qkv, 2, rope=(cos, sin))
    with vk.use_backend("extension"), pytest.warns(RuntimeWarning, match="rope"):
        out = vk.attention(qkv, 2, rope=(cos, sin))
    torch.testing.assert_close(
        out.double(), formula_out(qkv.double(), 2, rope=(cos, sin)), atol=1e-5, rtol=1e-5
    )


def test_attention_layer_passes_rope_through():
    """vit_kernels.nn.Attention(x, rope=...) = proj(attention of its qkv with rope)."""
    layer = vkn.Attention(24, num_heads=2, qkv_bias=True).eval()
    x = torch.randn(2, 10, 24)
    cos, sin = frequency_tables(9, 12, "half")
    with vk.use_backend("torch"):
        out = layer(x, rope=(cos, sin), rope_layout="half")
    qkv = torch.nn.functional.linear(x, layer.qkv.weight, layer.qkv.bias).double()
    expected = torch.nn.functional.linear(
        formula_out(qkv, 2, rope=(cos, sin), rope_layout="half"),
        layer.proj.weight.double(),
        layer.proj.bias.double(),
    )
    torch.testing.assert_close(out.detach().double(), expected.detach(), atol=1e-5, rtol=1e-5)
    with vk.use_backend("torch"):  # rope and a causal mask together: the mask applies to the rotated scores
        causal = layer(x, rope=(cos, sin), rope_layout="half", is_causal=True)
    keep = torch.ones(10, 10, dtype=torch.bool).tril()
    scores = rope_formula(qkv, 2, (cos, sin), "half")[1].log().masked_fill(~keep, float("-inf"))
    heads_out = torch.softmax(scores, -1) @ qkv[..., 48:].unflatten(-1, (2, 12)).transpose(1, 2)
    expected = torch.nn.functional.linear(
        heads_out.transpose(1, 2).reshape(2, 10, 24), layer.proj.weight.double(), layer.proj.bias.double()
    )
    torch.testing.assert_close(causal.detach().double(), expected.detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attn_mask or is_causal=True, not both"):
        layer(x, attn_mask=keep, is_causal=True)


def test_chooser_key_and_launches_tell_rope_calls_apart():
    """A rotating call is its own kernel variant (ROPE = 1 or 2; 0 without rope) and its own tile
    choice; on the simulated H100 every launch of a rotating call carries its layout's code."""
    from tools.cuda_sim import simulated_cuda

    qkv = torch.empty(2, 197, 3 * 2 * 64)
    plain = attention._chooser_key(qkv, 2)
    assert attention._chooser_key(qkv, 2, Rope(None, None, "half")) not in (
        plain,
        attention._chooser_key(qkv, 2, Rope(None, None, "interleaved")),
    )
    for layout, code in (("interleaved", 1), ("half", 2)):
        with simulated_cuda(90) as device:
            qkv = torch.empty(2, 197, 3 * 2 * 64, dtype=torch.bfloat16, device="cuda")
            cos = torch.empty(196, 64, device="cuda")
            seed = torch.empty(1, dtype=torch.int64, device="cuda")
            out, stats = attention.attention_fwd(qkv, 2, 0.125, 0.0, seed, cos, cos, layout)
            attention.attention_bwd(torch.empty_like(out), qkv, stats, seed, 2, 0.125, 0.0, cos, cos, layout)
            attention.attention_fwd(qkv, 2, 0.125, 0.0, seed)
        codes = [launch.kwargs["ROPE"] for launch in device.launches]
        assert codes and set(codes) == {code, 0}
        assert all(
            launch.args[attention._attention_fwd_kernel.arg_names.index("rope_start")] == 1
            for launch in device.launches
            if launch.kernel is attention._attention_fwd_kernel and launch.kwargs["ROPE"]
        )


BAD = [
    (dict(rope=torch.ones(4, 8)), TypeError, r"rope must be None or a pair \(cos, sin\)"),
    (dict(rope=(torch.ones(8, 8),)), TypeError, r"rope must be None or a pair"),
    (dict(rope=([[1.0]], torch.ones(8, 8))), TypeError, r"rope cos must be a torch.Tensor"),
    (
        dict(rope=(torch.ones(8, 8, dtype=torch.int64), torch.ones(8, 8, dtype=torch.int64))),
        TypeError,
        r"rope cos must be a floating-point tensor",
    ),
    (dict(rope=(torch.ones(8), torch.ones(8))), ValueError, r"rope cos must have 2 to 4 dimensions"),
    (dict(rope=(torch.ones(1, 1, 1, 8, 8), torch.ones(1, 1, 1, 8, 8))), ValueError, r"2 to 4 dimensions"),
    (
        dict(rope=(torch.ones(8, 8), torch.ones(7, 8))),
        ValueError,
        r"rope cos and sin must have the same shape",
    ),
    (dict(rope=(torch.ones(8, 8), torch.ones(8, 8, dtype=torch.float64))), TypeError, r"rope cos has dtype"),
    (
        dict(rope=(torch.ones(8, 6), torch.ones(8, 6))),
        ValueError,
        r"broadcast to \(B, H, L_r, Dh\) = \(2, 2, L_r, 8\)",
    ),
    (dict(rope=(torch.ones(3, 8, 8), torch.ones(3, 8, 8))), ValueError, r"broadcast to \(B, H, L_r, Dh\)"),
    (
        dict(rope=(torch.ones(3, 1, 8, 8), torch.ones(3, 1, 8, 8))),
        ValueError,
        r"broadcast to \(B, H, L_r, Dh\)",
    ),
    (dict(rope=(torch.ones(10, 8), torch.ones(10, 8))), ValueError, r"1 <= L_r <= L = 9 .* got L_r = 10"),
    (
        dict(rope=(torch.ones(8, 8), torch.ones(8, 8)), rope_layout="rotate_half"),
        ValueError,
        r"rope_layout must be one of \('interleaved', 'half'\)",
    ),
    (dict(rope_layout=None), ValueError, r"rope_layout must be one of"),
    (
        dict(rope=(torch.ones(8, 8, device="meta"), torch.ones(8, 8, device="meta"))),
        ValueError,
        r"rope cos is on meta but qkv is on cpu",
    ),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_rope_arguments_raise(kwargs, error, message):
    qkv = torch.randn(2, 9, 3 * 16)
    with pytest.raises(error, match=message):
        vk.attention(qkv, 2, **kwargs)


def test_odd_head_dim_with_rope_raises():
    with pytest.raises(ValueError, match="rope needs an even head dim .* Dh = 5"):
        vk.attention(torch.randn(1, 4, 3 * 10), 2, rope=(torch.ones(4, 5), torch.ones(4, 5)))
