"""Whole models on the simulated CUDA device: a ViT's training step on every backend, with and
without autocast, ``vk.tune`` searching every signature of a model under autocast and its file
run by a process that searches nothing, and a ``patch_model``'d
``torch.nn.TransformerEncoderLayer``."""

from __future__ import annotations

import pytest
import torch

import vit
import vit_kernels as vk
from vit_kernels import _tiles, backend, tuning


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


def test_tune_under_autocast_searches_the_steps_signatures_and_the_step_then_searches_nothing(
    sim, tmp_path, monkeypatch
):
    """``vk.tune(..., autocast=torch.bfloat16)`` searches the bfloat16 signatures a bf16 step meets
    (backends and tiles); saved and loaded into a process that knows nothing, the step runs the
    tuned choices and searches nothing."""
    model = _small_vit()
    images = torch.randn(4, 3, 32, 32, device="cuda")
    explanation = vk.tune(model, (images,), autocast=torch.bfloat16)
    sources = {r.op: r.source for r in explanation}
    assert set(sources) >= {"patch_embed", "attention", "layer_norm", "mlp", "linear"}, sources
    assert set(sources.values()) <= {"tuned", "only candidate"}, explanation
    assert {r.dtype for r in explanation if r.op == "attention"} == {"torch.bfloat16"}, explanation
    tuned = {(r.op, r.shapes, r.grad): r.backend for r in explanation}
    assert vk.tuning.tuning()["tiles"], "auto's measurement of the triton candidates searched no tile"
    vk.save_tuning(tmp_path / "tuning.json")
    backend.clear_decisions()
    _tiles.forget()

    def searched(*args, **kwargs):
        raise AssertionError("searched after loading the tuning")

    monkeypatch.setattr(tuning, "search_backends", searched)
    monkeypatch.setattr(tuning, "search_tiles", searched)
    vk.load_tuning(tmp_path / "tuning.json")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(images).float().sum().backward()
    rows = [r for r in vk.explain() if r.source != "only candidate"]
    assert rows and {r.source for r in rows} == {"tuned"}, vk.explain()
    assert {(r.op, r.shapes, r.grad): r.backend for r in rows}.items() <= tuned.items()
    with vk.use_backend("triton"), torch.autocast("cuda", dtype=torch.bfloat16):
        model(images).float().sum().backward()  # every kernel's tile as tuned, none checked or searched
    assert {t["how"] for t in vk.explain().tiles} == {"loaded"}, vk.explain().tiles


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
