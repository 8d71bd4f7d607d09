"""vit_kernels.nn layers: timm names, the same math as PyTorch's own layers, dropout behaviour."""

import pytest
import torch
from torch import nn

from vit_kernels.nn import Attention, Block, LayerNorm, Mlp, PatchEmbed


def copy_encoder_layer(block: Block, layer: nn.TransformerEncoderLayer) -> None:
    """Load an nn.TransformerEncoderLayer's weights into a Block (same math, timm names)."""
    block.load_state_dict(
        {
            "norm1.weight": layer.norm1.weight,
            "norm1.bias": layer.norm1.bias,
            "norm2.weight": layer.norm2.weight,
            "norm2.bias": layer.norm2.bias,
            "attn.qkv.weight": layer.self_attn.in_proj_weight,
            "attn.qkv.bias": layer.self_attn.in_proj_bias,
            "attn.proj.weight": layer.self_attn.out_proj.weight,
            "attn.proj.bias": layer.self_attn.out_proj.bias,
            "mlp.fc1.weight": layer.linear1.weight,
            "mlp.fc1.bias": layer.linear1.bias,
            "mlp.fc2.weight": layer.linear2.weight,
            "mlp.fc2.bias": layer.linear2.bias,
        },
        strict=True,
    )


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_block_equals_transformer_encoder_layer(norm_first, act):
    layer = nn.TransformerEncoderLayer(
        32, 4, 80, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first
    ).double()
    block = Block(32, 4, mlp_hidden_dim=80, act=act, norm_first=norm_first, eps=1e-5).double()
    copy_encoder_layer(block, layer)
    x = torch.randn(3, 17, 32, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = block(x), layer(x_ref)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(
        block.named_parameters(),
        [
            layer.norm1.weight,
            layer.norm1.bias,
            layer.self_attn.in_proj_weight,
            layer.self_attn.in_proj_bias,
            layer.self_attn.out_proj.weight,
            layer.self_attn.out_proj.bias,
            layer.norm2.weight,
            layer.norm2.bias,
            layer.linear1.weight,
            layer.linear1.bias,
            layer.linear2.weight,
            layer.linear2.bias,
        ],
    ):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_block_returns_attention_probabilities():
    block = Block(24, 3, mlp_ratio=2.0).eval()
    x = torch.randn(2, 10, 24)
    out, probs = block(x, return_probs=True)
    torch.testing.assert_close(out, block(x))
    assert probs.shape == (2, 3, 10, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 10))


def test_attention_module_matches_multihead_attention():
    mha = nn.MultiheadAttention(24, 3, batch_first=True).double()
    attn = Attention(24, 3, qkv_bias=True).double()
    attn.qkv.weight.data.copy_(mha.in_proj_weight)
    attn.qkv.bias.data.copy_(mha.in_proj_bias)
    attn.proj.load_state_dict(mha.out_proj.state_dict())
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    ref, ref_weights = mha(x, x, x, average_attn_weights=False)
    out, probs = attn(x, return_probs=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(probs, ref_weights)
    residual = torch.randn_like(x)
    torch.testing.assert_close(attn(x, residual=residual), ref + residual)
    mask = torch.randn(11, 11, dtype=torch.float64)
    torch.testing.assert_close(attn(x, attn_mask=mask), mha(x, x, x, attn_mask=mask)[0])


@pytest.mark.parametrize(
    "act,fn",
    [
        ("gelu", nn.GELU()),
        ("gelu_tanh", nn.GELU("tanh")),
        ("quick_gelu", lambda z: z * torch.sigmoid(1.702 * z)),
        ("relu", nn.ReLU()),
    ],
)
def test_mlp_module(act, fn):
    mlp = Mlp(12, 40, act=act).double()
    x = torch.randn(3, 12, dtype=torch.float64)
    expected = mlp.fc2(fn(mlp.fc1(x)))
    torch.testing.assert_close(mlp(x), expected)
    residual = torch.randn(3, 12, dtype=torch.float64)
    torch.testing.assert_close(mlp(x, residual=residual), expected + residual)


@pytest.mark.parametrize(
    "module_factory",
    [
        lambda: Mlp(16, 32, drop=0.5),
        lambda: Attention(16, 2, attn_drop=0.5, proj_drop=0.5),
        lambda: Block(16, 2, drop=0.3, attn_drop=0.3),
    ],
)
def test_dropout_only_in_training(module_factory):
    module = module_factory()
    x = torch.randn(4, 9, 16)
    module.eval()
    torch.testing.assert_close(module(x), module(x))
    module.train()
    torch.manual_seed(0)
    first = module(x)
    torch.manual_seed(0)
    torch.testing.assert_close(module(x), first)
    module.eval()
    assert not torch.allclose(first, module(x))


def test_layer_norm_module_is_nn_layer_norm_compatible():
    ours, ref = LayerNorm(20, eps=1e-5), nn.LayerNorm(20, eps=1e-5)
    ref.weight.data.normal_()
    ref.bias.data.normal_()
    ours.load_state_dict(ref.state_dict())
    x, r = torch.randn(3, 20), torch.randn(3, 20)
    torch.testing.assert_close(ours(x), ref(x))
    y, s = ours(x, residual=r)
    torch.testing.assert_close(y, ref(x + r))
    torch.testing.assert_close(s, x + r)


def test_patch_embed_module():
    embed = PatchEmbed(img_size=(16, 24), patch_size=8, in_chans=2, embed_dim=10)
    assert embed.num_patches == 6 and embed.grid_size == (2, 3)
    images = torch.randn(3, 2, 16, 24)
    expected = embed.proj(images).flatten(2).transpose(1, 2)
    torch.testing.assert_close(embed(images), expected)
    with pytest.raises(ValueError, match="images must be 16x24"):
        embed(torch.randn(3, 2, 16, 16))
    with pytest.raises(ValueError, match="img_size .* must be divisible by patch_size"):
        PatchEmbed(img_size=30, patch_size=8)


def test_module_arguments_are_validated():
    with pytest.raises(ValueError, match="num_heads=5 must divide dim=16"):
        Attention(16, 5)
    with pytest.raises(ValueError, match="act must be one of"):
        Mlp(8, act="swish")
    with pytest.raises(ValueError, match="drop must be a float in"):
        Mlp(8, drop=1.5)


@pytest.mark.parametrize("return_probs", [False, True])
def test_attention_with_a_mask_computes_masked_softmax_attention(return_probs):
    """A masked or causal call (NaFlex ViTs mask padded patches) against the float64 formula."""
    torch.manual_seed(0)
    attention = Attention(8, 2, qkv_bias=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True] * 4 + [False], [True] * 5]).view(2, 1, 1, 5)
    additive = torch.zeros(2, 1, 1, 5, dtype=torch.float64).masked_fill(~keep, float("-inf"))

    def formula(x, mask_add):
        q, k, v = (x @ attention.qkv.weight.T + attention.qkv.bias).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + mask_add, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(2, 5, 8) @ attention.proj.weight.T + attention.proj.bias
        return out, probs

    causal_add = torch.zeros(5, 5, dtype=torch.float64).masked_fill(
        torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")
    )
    for kwargs, mask_add in (
        ({"attn_mask": keep}, additive),
        ({"attn_mask": additive}, additive),
        ({"is_causal": True}, causal_add),
    ):
        result = attention(x, return_probs=return_probs, **kwargs)
        out, probs = result if return_probs else (result, None)
        expected, expected_probs = formula(x, mask_add)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        if return_probs:
            torch.testing.assert_close(probs, expected_probs, rtol=1e-10, atol=1e-12)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
