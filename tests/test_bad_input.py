"""Every public op rejects bad arguments with a ValueError/TypeError that names the argument."""

import pytest
import torch

import vit_kernels as vk
from tests.helpers import requires_cuda

x = torch.randn(2, 5, 8)
w = torch.randn(16, 8)
b = torch.randn(16)
images = torch.randn(2, 3, 16, 16)
pw = torch.randn(8, 3, 4, 4)
qkv = torch.randn(2, 5, 24)

CASES = [
    # attention
    (lambda: vk.attention(torch.randn(2, 24), 2), ValueError, "qkv must have 3 dimensions"),
    (lambda: vk.attention(torch.randn(2, 5, 25), 1), ValueError, "3\\*D"),
    (lambda: vk.attention(qkv, 3), ValueError, "num_heads=3 must divide"),
    (lambda: vk.attention(qkv, 0), ValueError, "num_heads must be a positive int"),
    (lambda: vk.attention(qkv, 2, dropout_p=1.0), ValueError, "dropout_p must be a float in \\[0, 1\\)"),
    (lambda: vk.attention(qkv, 2, dropout_p=-0.1), ValueError, "dropout_p"),
    (lambda: vk.attention(qkv, 2, scale=-1.0), ValueError, "scale must be None or a positive"),
    (lambda: vk.attention(qkv.long(), 2), TypeError, "qkv must be a floating-point tensor"),
    (lambda: vk.attention(qkv.numpy(), 2), TypeError, "qkv must be a torch.Tensor"),
    (lambda: vk.attention(torch.randn(2, 0, 24), 2), ValueError, "at least one token"),
    # patch_embed
    (
        lambda: vk.patch_embed(torch.randn(3, 16, 16), pw, patch_size=4),
        ValueError,
        "images must have 4 dimensions",
    ),
    (
        lambda: vk.patch_embed(torch.randn(2, 1, 16, 16), pw, patch_size=4),
        ValueError,
        "weight must have shape",
    ),
    (
        lambda: vk.patch_embed(torch.randn(2, 3, 18, 16), pw, patch_size=4),
        ValueError,
        "positive multiples of patch_size=4",
    ),
    (lambda: vk.patch_embed(images, pw, patch_size=2), ValueError, "weight must have shape"),
    (lambda: vk.patch_embed(images, pw, torch.randn(7), patch_size=4), ValueError, "bias must have shape"),
    (
        lambda: vk.patch_embed(images, pw, patch_size=4, pos_embed=torch.randn(1, 17, 8)),
        ValueError,
        "pos_embed must have shape",
    ),
    (
        lambda: vk.patch_embed(
            images, pw, patch_size=4, cls_token=torch.randn(1, 1, 8), pos_embed=torch.randn(1, 16, 8)
        ),
        ValueError,
        "pos_embed must have shape",
    ),
    (
        lambda: vk.patch_embed(images, pw, patch_size=4, cls_token=torch.randn(1, 8)),
        ValueError,
        "cls_token must have shape",
    ),
    (lambda: vk.patch_embed(images, pw.double(), patch_size=4), TypeError, "weight has dtype torch.float64"),
    (lambda: vk.patch_embed(images, pw, patch_size=0), ValueError, "patch_size must be a positive int"),
    # linear family
    (lambda: vk.linear(x, torch.randn(16, 7)), ValueError, "x last dimension must equal weight.shape\\[1\\]"),
    (lambda: vk.linear(x, torch.randn(16)), ValueError, "weight must have 2 dimensions"),
    (lambda: vk.linear(x, w, torch.randn(15)), ValueError, "bias must have shape"),
    (lambda: vk.linear(x, w, b, residual=torch.randn(2, 5, 15)), ValueError, "residual must have shape"),
    (lambda: vk.linear(x, w, b, residual=torch.randn(1, 5, 16)), ValueError, "residual must have shape"),
    (lambda: vk.linear(x, w, b, residual=torch.randn(2, 5, 16).double()), TypeError, "residual has dtype"),
    (lambda: vk.linear(x.half(), w), TypeError, "weight has dtype torch.float32 but x has torch.float16"),
    (lambda: vk.linear_gelu(x, w, b, approximate="fast"), ValueError, "approximate must be one of"),
    (lambda: vk.mlp(x, w, b, torch.randn(8, 15), None), ValueError, "fc2_weight must have shape"),
    (lambda: vk.mlp(x, w, b, torch.randn(8, 16), torch.randn(9)), ValueError, "fc2_bias must have shape"),
    (
        lambda: vk.mlp(x, w, b, torch.randn(8, 16), None, residual=torch.randn(2, 5, 16)),
        ValueError,
        "residual must have shape",
    ),
    # layer_norm
    (lambda: vk.layer_norm(x, torch.randn(7), None), ValueError, "weight must have shape"),
    (lambda: vk.layer_norm(x, None, torch.randn(9)), ValueError, "bias must have shape"),
    (
        lambda: vk.layer_norm(x, None, None, residual=torch.randn(5, 8)),
        ValueError,
        "residual must have shape",
    ),
    (lambda: vk.layer_norm(x, None, None, eps=0.0), ValueError, "eps must be"),
    (lambda: vk.layer_norm(x, torch.randn(8).double(), None), TypeError, "weight has dtype"),
    (lambda: vk.layer_norm(torch.randn(2, 0), None, None), ValueError, "non-empty last dimension"),
]


@pytest.mark.parametrize("call,error,message", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_input_is_rejected_clearly(call, error, message):
    with pytest.raises(error, match=message):
        call()


@requires_cuda
def test_device_mismatch():
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        vk.linear(x.cuda(), w)


def test_device_mismatch_on_meta():
    with pytest.raises(ValueError, match="weight is on cpu but x is on meta"):
        vk.linear(x.to("meta"), w)
