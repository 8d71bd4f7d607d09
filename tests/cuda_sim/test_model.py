"""Whole models on the simulated CUDA device: a ViT's training step on every backend, with and
without autocast, ``vk.tune`` measuring every signature of a model, and a ``patch_model``'d
``torch.nn.TransformerEncoderLayer``."""

from __future__ import annotations

import pytest
import torch

import vit
import vit_kernels as vk


def _small_vit():
    return vit.create_model(
        "vit_digits", img_size=32, patch_size=16, in_chans=3, embed_dim=192, num_heads=3, depth=2
    ).to("cuda")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast_bf16"])
@pytest.mark.parametrize("backend_choice", ["triton", "extension", "torch", "auto"])
def test_vit_training_step(sim, backend_choice, autocast):
    model = _small_vit()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    images = torch.randn(4, 3, 32, 32, device="cuda")
    labels = torch.randint(0, 10, (4,), device="cuda")
    with vk.use_backend(backend_choice), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())
    ran = {r.backend for r in vk.explain()}
    if backend_choice == "triton":
        assert "triton" in ran and sim.launches


def test_tune_measures_every_signature(sim):
    model = _small_vit()
    explanation = vk.tune(model, (torch.randn(4, 3, 32, 32, device="cuda"),))
    sources = {r.op: r.source for r in explanation}
    assert set(sources) >= {"patch_embed", "attention", "layer_norm", "mlp", "linear"}, sources
    assert set(sources.values()) <= {"measured", "cache", "only candidate"}, explanation


def test_patched_torch_encoder_layer(sim):
    layer = torch.nn.TransformerEncoderLayer(
        192, 3, 768, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    ).to("cuda")
    report = vk.patch_model(layer)
    assert report.replaced, report
    x = torch.randn(2, 197, 192, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    (grad,) = torch.autograd.grad(out.float().sum(), [x])
    assert grad.shape == x.shape
