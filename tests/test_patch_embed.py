"""vk.patch_embed against an explicit float64 formula: output and every gradient."""

import pytest
import torch

import vit_kernels as vk
from tests.helpers import check_against_formula


def patch_embed_formula(images, weight, bias, cls_token, pos_embed, patch_size):
    """Cut (N, C, H, W) into P x P patches flattened as (c, i, j), multiply by W (D, C*P*P)."""
    n, c, h, w = images.shape
    p = patch_size
    patches = images.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
    tokens = patches @ weight.reshape(weight.shape[0], -1).T
    if bias is not None:
        tokens = tokens + bias
    if cls_token is not None:
        tokens = torch.cat([cls_token.expand(n, 1, -1), tokens], dim=1)
    if pos_embed is not None:
        tokens = tokens + pos_embed
    return tokens


def run_patch_embed(images, weight, bias, cls_token, pos_embed, patch_size):
    return vk.patch_embed(images, weight, bias, patch_size=patch_size, cls_token=cls_token, pos_embed=pos_embed)


def make_inputs(n, c, h, w, p, dim, with_bias=True, with_cls=True, with_pos=True):
    tokens = (h // p) * (w // p) + int(with_cls)
    return [
        torch.randn(n, c, h, w),
        torch.randn(dim, c, p, p) * 0.2,
        torch.randn(dim) if with_bias else None,
        torch.randn(1, 1, dim) if with_cls else None,
        torch.randn(1, tokens, dim) if with_pos else None,
    ]


NAMES = ["images", "weight", "bias", "cls_token", "pos_embed"]


@pytest.mark.parametrize(
    "n,c,h,w,p,dim",
    [(2, 3, 32, 32, 4, 48), (3, 1, 28, 28, 7, 64), (2, 3, 16, 24, 8, 20), (1, 3, 32, 48, 16, 37), (2, 2, 8, 8, 4, 13)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_patch_embed_matches_formula(n, c, h, w, p, dim, dtype):
    inputs = make_inputs(n, c, h, w, p, dim)
    check_against_formula(run_patch_embed, patch_embed_formula, inputs, dtype, NAMES, patch_size=p)


@pytest.mark.parametrize("with_bias,with_cls,with_pos", [(False, False, False), (True, False, True), (False, True, False)])
def test_patch_embed_optional_parts(with_bias, with_cls, with_pos):
    inputs = make_inputs(2, 3, 16, 16, 4, 24, with_bias, with_cls, with_pos)
    check_against_formula(run_patch_embed, patch_embed_formula, inputs, torch.float64, NAMES, patch_size=4)


def test_patch_embed_channels_last():
    images, weight, bias, cls, pos = make_inputs(2, 3, 32, 32, 8, 16)
    expected = patch_embed_formula(images.double(), weight.double(), bias.double(), cls.double(), pos.double(), 8)
    out = vk.patch_embed(images.double().to(memory_format=torch.channels_last), weight.double(), bias.double(),
                         patch_size=8, cls_token=cls.double(), pos_embed=pos.double())
    torch.testing.assert_close(out, expected)


def test_patch_embed_output_shape():
    out = vk.patch_embed(torch.randn(4, 3, 224, 224), torch.randn(192, 3, 16, 16), patch_size=16,
                         cls_token=torch.randn(1, 1, 192), pos_embed=torch.randn(1, 197, 192))
    assert out.shape == (4, 197, 192)
