"""patch_model swaps timm-style layers for fused ones, keeps the parameters, keeps the output."""

import torch
from torch import nn

import vit_kernels as vk
from tests import timm_like
from vit_kernels import nn as vkn


def test_patch_model_replaces_known_layers_and_keeps_outputs():
    model = timm_like.VisionTransformer().double().eval()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    before = model(images)
    params_before = {name: p for name, p in model.named_parameters()}
    report = vk.patch_model(model)
    replaced = {name: new for name, _, new in report.replaced}
    assert replaced["patch_embed"] == "PatchEmbed"
    assert replaced["blocks.0.attn"] == "Attention" and replaced["blocks.1.mlp"] == "Mlp"
    assert replaced["blocks.1.norm2"] == "LayerNorm" and replaced["norm"] == "LayerNorm"
    assert isinstance(model.blocks[0].attn, vkn.Attention) and isinstance(model.patch_embed, vkn.PatchEmbed)
    assert len(report.replaced) == 1 + 2 * 4 + 1
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before), "parameters must be the same tensors"
    torch.testing.assert_close(model(images), before)
    assert "replaced 10 layer(s)" in str(report)


def test_patch_model_skips_what_it_cannot_fuse():
    model = nn.Sequential(timm_like.Mlp(8, 16, act_layer=nn.SiLU), nn.LayerNorm((4, 8)))
    report = vk.patch_model(model)
    assert report.replaced == []
    reasons = dict(report.skipped)
    assert "SiLU" in reasons["0"] and "last dimension" in reasons["1"]


def test_patch_model_preserves_training_mode_and_dropout():
    model = timm_like.Mlp(8, 16, drop=0.25).train()
    wrapper = nn.Sequential(model)
    vk.patch_model(wrapper)
    assert wrapper[0].training and wrapper[0].drop == 0.25
