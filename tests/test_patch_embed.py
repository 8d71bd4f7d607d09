"""vk.patch_embed against an explicit float64 formula: output and every gradient."""

import pytest
import torch

import vit_kernels as vk
from tests.helpers import backend_dtypes, check_against_formula, device_backend_dtypes

BACKEND_DTYPES = device_backend_dtypes("patch_embed", backend_dtypes([torch.float32, torch.float16]))


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
    return vk.patch_embed(
        images, weight, bias, patch_size=patch_size, cls_token=cls_token, pos_embed=pos_embed
    )


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
    [
        (2, 3, 32, 32, 4, 48),
        (3, 1, 28, 28, 7, 64),
        (2, 3, 16, 24, 8, 20),
        (1, 3, 32, 48, 16, 37),
        (2, 2, 8, 8, 4, 13),
    ],
)
@pytest.mark.parametrize("device,backend_name,dtype", BACKEND_DTYPES)
def test_patch_embed_matches_formula(device, backend_name, dtype, n, c, h, w, p, dim):
    inputs = make_inputs(n, c, h, w, p, dim)
    with vk.use_backend(backend_name):
        check_against_formula(
            run_patch_embed, patch_embed_formula, inputs, dtype, NAMES, device, patch_size=p
        )


@pytest.mark.parametrize(
    "with_bias,with_cls,with_pos", [(False, False, False), (True, False, True), (False, True, False)]
)
def test_patch_embed_optional_parts(on_backend, with_bias, with_cls, with_pos):
    inputs = make_inputs(2, 3, 16, 16, 4, 24, with_bias, with_cls, with_pos)
    check_against_formula(run_patch_embed, patch_embed_formula, inputs, torch.float32, NAMES, patch_size=4)


def test_patch_embed_channels_last(on_backend):
    """channels_last images are gathered by strides; d(images) comes back in the same layout."""
    images, weight, bias, cls, pos = make_inputs(2, 3, 32, 32, 8, 16)
    images_cl = images.to(memory_format=torch.channels_last).requires_grad_(True)
    out = vk.patch_embed(images_cl, weight, bias, patch_size=8, cls_token=cls, pos_embed=pos)
    torch.testing.assert_close(
        out, patch_embed_formula(images, weight, bias, cls, pos, 8), atol=1e-4, rtol=1e-4
    )
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, images_cl, upstream)
    wide = images.double().requires_grad_(True)
    (ref,) = torch.autograd.grad(
        patch_embed_formula(wide, weight.double(), bias.double(), cls.double(), pos.double(), 8),
        wide,
        upstream.double(),
    )
    torch.testing.assert_close(grad.double(), ref, atol=1e-4, rtol=1e-4)


def test_images_gradient_only_when_asked(on_backend):
    images, weight, bias, cls, pos = make_inputs(2, 3, 16, 16, 4, 12)
    weight.requires_grad_(True)
    out = vk.patch_embed(images, weight, bias, patch_size=4, cls_token=cls, pos_embed=pos)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, weight, upstream)
    wide = weight.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(
        patch_embed_formula(images.double(), wide, bias.double(), cls.double(), pos.double(), 4),
        wide,
        upstream.double(),
    )
    torch.testing.assert_close(grad.double(), ref, atol=1e-4, rtol=1e-4)
    assert images.grad is None


def test_patch_embed_output_shape(on_backend):
    out = vk.patch_embed(
        torch.randn(2, 3, 224, 224),
        torch.randn(192, 3, 16, 16),
        patch_size=16,
        cls_token=torch.randn(1, 1, 192),
        pos_embed=torch.randn(1, 197, 192),
    )
    assert out.shape == (2, 197, 192)
