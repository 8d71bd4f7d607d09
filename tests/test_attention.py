"""vk.attention on every available backend against an explicit float64 formula."""

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import check_against_formula


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


@pytest.mark.parametrize("length", [1, 17, 50, 65, 197])
@pytest.mark.parametrize("head_dim", [4, 8, 12, 15, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_matches_formula(length, head_dim, dtype):
    heads = 3
    qkv = torch.randn(2, length, 3 * heads * head_dim)
    check_against_formula(out_only, formula_out, [qkv], dtype, ["qkv"], num_heads=heads)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_attention_scale(scale):
    qkv = torch.randn(2, 17, 3 * 2 * 8)
    check_against_formula(out_only, formula_out, [qkv], torch.float64, ["qkv"], num_heads=2, scale=scale)


def test_attention_strided_qkv():
    """A qkv view with non-unit outer strides (a slice of a wider buffer) gives the same result."""
    wide = torch.randn(2, 17, 3 * 24 + 5, dtype=torch.float64)
    qkv = wide[..., 3:3 + 72]
    assert not qkv.is_contiguous()
    torch.testing.assert_close(vk.attention(qkv, 4), formula_out(qkv.contiguous(), 4))


def test_attention_huge_logits_stay_finite():
    qkv = torch.randn(1, 33, 3 * 16, dtype=torch.float64) * 100.0  # |scores| ~ 1e4
    out = vk.attention(qkv, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, formula_out(qkv, 2))


@pytest.mark.parametrize("length", [1, 17, 50])
def test_return_probs(length):
    qkv = torch.randn(2, length, 3 * 3 * 4, dtype=torch.float64, requires_grad=True)
    out, probs = vk.attention(qkv, 3, return_probs=True)
    ref_out, ref_probs = attention_formula(qkv.detach(), 3)
    assert probs.shape == (2, 3, length, length)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, length, dtype=torch.float64))
    torch.testing.assert_close(probs.detach(), ref_probs)
    torch.testing.assert_close(out.detach(), ref_out)
    # the probabilities are differentiable too
    weights = torch.randn_like(probs)
    (grad,) = torch.autograd.grad((probs * weights).sum(), qkv)
    qkv64 = qkv.detach().clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((attention_formula(qkv64, 3)[1] * weights).sum(), qkv64)
    torch.testing.assert_close(grad, ref_grad)


def test_dropout_is_unbiased_and_seeded():
    qkv = torch.randn(1, 9, 3 * 8, dtype=torch.float64)
    reference = formula_out(qkv, 2)
    torch.manual_seed(1)
    first = vk.attention(qkv, 2, dropout_p=0.3)
    torch.manual_seed(1)
    again = vk.attention(qkv, 2, dropout_p=0.3)
    torch.testing.assert_close(first, again)
    assert not torch.allclose(first, reference)
    mean = torch.stack([vk.attention(qkv, 2, dropout_p=0.3) for _ in range(3000)]).mean(0)
    torch.testing.assert_close(mean, reference, atol=0.08, rtol=0.0)


def test_dropout_kept_fraction_in_probs_path():
    """With return_probs the dropped probabilities feed the output: out = (mask * P / (1-p)) @ v.
    Recover the mask from v = identity and check the kept fraction."""
    length, p = 64, 0.25
    dim = length  # one head, v = identity so out = dropped probabilities
    q_k = torch.randn(1, length, 2 * dim, dtype=torch.float64)
    v = torch.eye(length, dtype=torch.float64).unsqueeze(0)
    qkv = torch.cat([q_k, v], dim=-1)
    out, probs = vk.attention(qkv, 1, dropout_p=p, return_probs=True)
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.03
    torch.testing.assert_close(out[out != 0], (probs[0][out != 0] / (1 - p)))
