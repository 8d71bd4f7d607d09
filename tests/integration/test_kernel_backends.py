"""The patched real models in float32 on each kernel backend (Triton through its interpreter, the C++
extension built CPU-only), against the same model in float64: output and every parameter gradient
within max(float32 floor, 2 x PyTorch's own float32 error). The float64 tests elsewhere show the
swap is exact; these show the kernels behind it hold up inside real models."""

import pytest
import timm
import torch
from exactness import compare_in_float32, patched_copy, tiny_transformers_config
from torchvision.models import VisionTransformer
from transformers import ViTForImageClassification

import vit_kernels as vk
from vit_kernels import backend
from vit_kernels.integrations import huggingface

KERNEL_BACKENDS = [
    name
    for name in ("triton", "extension")
    if backend.unsupported_reason("attention", name, torch.device("cpu"), torch.float32) is None
]
# The kernel ops a backend must have run in each model (the others may be outside its limits, e.g.
# the extension's linear takes only calls with a residual; dispatch hands those to another backend).
KERNEL_OPS = {"attention", "layer_norm"}


def timm_vit():
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        num_classes=5,
        reg_tokens=2,
        init_values=0.1,
    )
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() < 2 else None
    return model


def huggingface_vit():
    huggingface.register()
    config = tiny_transformers_config("ViTConfig", num_labels=5)
    return ViTForImageClassification._from_config(config, attn_implementation="vit_kernels")


def torchvision_vit():
    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5
    )
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


MODELS = {
    "timm": (timm_vit, lambda out: out),
    "huggingface": (huggingface_vit, lambda out: out.logits),
    "torchvision": (torchvision_vit, lambda out: out),
}


@pytest.mark.skipif(not KERNEL_BACKENDS, reason="neither Triton's interpreter nor the extension can run here")
@pytest.mark.parametrize("backend_name", KERNEL_BACKENDS)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_patched_models_in_float32_on_kernel_backends(family, backend_name, record_difference):
    make, output_of = MODELS[family]
    reference = make().double().eval()
    patched, _ = patched_copy(reference)
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    backend.clear_decisions()
    differences = compare_in_float32(reference, patched, images, backend_name, output_of)
    ran = {op for op in KERNEL_OPS if backend_name in vk.explain().ran(op)}
    assert ran == KERNEL_OPS, f"{backend_name} did not run {KERNEL_OPS - ran}:\n{vk.explain()}"
    record_difference(f"{family} float32 on {backend_name}", *differences)


ROPE_MODELS = {  # the rotary layouts: interleaved pairs (EVA02) and half-split pairs with register tokens (DINOv3)
    "eva02": ("eva02_tiny_patch14_224", {"img_size": 28, "depth": 1, "ref_feat_shape": (2, 2)}),
    "dinov3": (
        "vit_base_patch16_dinov3",
        {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 64, "num_heads": 4},
    ),
}


@pytest.mark.skipif("triton" not in KERNEL_BACKENDS, reason="Triton's interpreter cannot run here")
@pytest.mark.parametrize("family", sorted(ROPE_MODELS))
def test_rope_vits_in_float32_on_triton(family, record_difference):
    """The rotation inside the Triton attention kernels, forward and backward, in a real RoPE ViT."""
    name, overrides = ROPE_MODELS[family]
    reference = timm.create_model(name, pretrained=False, num_classes=5, **overrides)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() < 2 else None
    reference = reference.double().eval()
    patched, _ = patched_copy(reference)
    size = overrides["img_size"]
    backend.clear_decisions()
    differences = compare_in_float32(
        reference, patched, torch.randn(2, 3, size, size, dtype=torch.float64), "triton"
    )
    assert "triton" in vk.explain().ran("attention"), vk.explain()
    record_difference(f"timm {family} float32 on triton", *differences)
