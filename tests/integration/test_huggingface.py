"""Hugging Face ViT: attention through transformers' AttentionInterface (attn_implementation=
"vit_kernels"), MLP, patch embeddings and norms swapped by patch_model; exact in float64."""

import pytest
import torch
from exactness import compare, patched_copy, tiny_transformers_config, tiny_transformers_model
from transformers import ViTForImageClassification

from vit_kernels.integrations import huggingface


def _models(hidden_act="gelu", **extra):
    def config():  # one each: the attention implementation is kept on the config
        return tiny_transformers_config("ViTConfig", num_labels=5, hidden_act=hidden_act, **extra)

    reference = ViTForImageClassification._from_config(
        config(), attn_implementation="sdpa"
    ).double()  # eager softmaxes in float32
    huggingface.register()
    fused = ViTForImageClassification._from_config(config(), attn_implementation="vit_kernels").double()
    fused.load_state_dict(reference.state_dict())
    assert reference.config._attn_implementation == "sdpa"
    assert fused.config._attn_implementation == "vit_kernels"
    return reference, fused


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("training", [False, True])
def test_vit_for_image_classification_is_exact(hidden_act, training, record_difference):
    reference, fused = _models(hidden_act)
    reference.train(training), fused.train(training)
    fused, report = patched_copy(fused)
    assert report.skipped == [], report
    kinds = [new for _, _, new in report.replaced]
    assert sum("AttentionInterface" in k or "attention interface" in k for k in kinds) == 2, report
    assert sum(k.endswith(".Mlp") for k in kinds) == 2 and sum("PatchEmbeddings" in k for k in kinds) == 1
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference("huggingface ViT", *compare(reference, fused, images, output_of=lambda out: out.logits))


def test_sdpa_attention_is_switched_to_the_fused_kernel(record_difference):
    reference, _ = _models()
    fused, report = patched_copy(reference)
    assert (
        fused.config._attn_implementation == "vit_kernels" and reference.config._attn_implementation == "sdpa"
    )
    assert report.skipped == [], report
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference(
        "huggingface ViT (sdpa switched)",
        *compare(reference, fused, images, output_of=lambda out: out.logits),
    )


def test_attention_on_an_implementation_the_user_chose_is_left_and_reported():
    reference, _ = _models()
    for module in reference.modules():
        if hasattr(module, "config"):
            module.config._attn_implementation_internal = "flash_attention_2"  # as if loaded so, on a GPU
    reasons = dict(patched_copy(reference)[1].skipped)
    attention = [why for name, why in reasons.items() if name.endswith("attention")]
    assert len(attention) == 2 and all("'flash_attention_2' attention" in why for why in attention), reasons


VISION_TOWERS = {
    "clip": ("CLIPVisionConfig", "CLIPVisionModel", {"hidden_act": "gelu"}),
    "clip_quick_gelu": ("CLIPVisionConfig", "CLIPVisionModel", {"hidden_act": "quick_gelu"}),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", {}),
    "siglip2": ("Siglip2VisionConfig", "Siglip2VisionModel", {"num_patches": 16}),
    "dinov2": ("Dinov2Config", "Dinov2Model", {"layerscale_value": 0.5}),
    "dinov2_registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 4}),
    "dinov2_swiglu": ("Dinov2Config", "Dinov2Model", {"use_swiglu_ffn": True}),
    "dinov2_registers_swiglu": (
        "Dinov2WithRegistersConfig",
        "Dinov2WithRegistersModel",
        {"num_register_tokens": 4, "use_swiglu_ffn": True},
    ),
}


def _tower_inputs(family, config, batch=2):
    if family != "siglip2":
        return (torch.randn(batch, 3, 32, 32, dtype=torch.float64),), {}
    patches = torch.randn(batch, 16, 3 * 8 * 8, dtype=torch.float64)
    mask = torch.ones(batch, 16, dtype=torch.long)
    mask[1, 12:] = 0  # the second image is 12 patches of a 4x3 grid, padded
    shapes = torch.tensor([[4, 4], [4, 3]])
    return (patches,), {"pixel_attention_mask": mask, "spatial_shapes": shapes}


@pytest.mark.parametrize("family", sorted(VISION_TOWERS))
@pytest.mark.parametrize("training", [False, True])
def test_vision_towers_fuse_attention_and_mlp_and_stay_exact(family, training, record_difference):
    config_name, model_name, extra = VISION_TOWERS[family]
    torch.manual_seed(0)
    reference = tiny_transformers_model(
        config_name, model_name, hidden_dropout_prob=0.0, attention_dropout=0.0, **extra
    ).double()
    config = reference.config
    reference.train(training)
    fused, report = patched_copy(reference)
    kinds = [(name, new) for name, _, new in report.replaced]
    attention = [
        name for name, new in kinds if "attention interface" in new and not name.endswith("head.attention")
    ]
    mlps = [
        name
        for name, new in kinds
        if (new.endswith(".Mlp") or "SwiGLUFFN" in new) and name.startswith("encoder.")
    ]
    assert len(attention) == 2, report
    assert len(mlps) == 2, report
    args, kwargs = _tower_inputs(family, config)

    def pooled(out):
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state

    if family == "siglip2":  # patches and a padding mask in: the masked calls run fused with the mask
        reference_out = pooled(reference(*args, **kwargs))
        fused_out = pooled(fused(*args, **kwargs))
        torch.testing.assert_close(fused_out, reference_out, rtol=1e-10, atol=1e-10)
        cotangent = torch.randn_like(reference_out)
        (reference_out * cotangent).sum().backward()
        (fused_out * cotangent).sum().backward()
        fused_params = dict(fused.named_parameters())
        for name, param in reference.named_parameters():
            if param.grad is not None:
                torch.testing.assert_close(
                    fused_params[name].grad, param.grad, rtol=1e-10, atol=1e-10, msg=name
                )
        return
    record_difference(f"huggingface {family}", *compare(reference, fused, args[0], output_of=pooled))


@pytest.mark.parametrize("family", ["siglip", "dinov2_swiglu"])
def test_a_compiled_patched_vision_tower_matches_eager(family):
    """torch.compile of a patched tower (the attention interface, the fused MLP or SwiGLU, SigLIP's
    pooling head): the same output and gradients as the eager patched model."""
    config_name, model_name, extra = VISION_TOWERS[family]
    torch.manual_seed(0)
    model, _ = patched_copy(tiny_transformers_model(config_name, model_name, layers=1, **extra).double())
    config = model.config
    model.eval()
    (images,), _ = _tower_inputs(family, config)
    weight = next(p for name, p in model.named_parameters() if name.startswith("embeddings.patch_embedding"))

    def run(module):
        out = module(images)
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state

    expected = run(model)
    (expected_grad,) = torch.autograd.grad(expected.sum(), weight)
    actual = run(torch.compile(model))
    (actual_grad,) = torch.autograd.grad(actual.sum(), weight)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-10, atol=1e-10)


def test_masks_run_fused_and_cross_attention_runs_transformers_own(monkeypatch):
    """A self-attention mask (additive or boolean, SDPA's form) runs the fused op with it;
    cross-attention takes transformers' SDPA path: the result of an unpatched model either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    huggingface.register()
    module = torch.nn.Module()
    module.is_causal = False
    q, kv = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 7, 4, dtype=torch.float64)
    additive = torch.randn(1, 1, 5, 5, dtype=torch.float64)
    keep = torch.rand(1, 1, 5, 5) > 0.4
    keep[..., 0] = True
    fused_calls, fused = [], huggingface.vkf.attention
    monkeypatch.setattr(huggingface.vkf, "attention", lambda *a, **k: fused_calls.append(k) or fused(*a, **k))
    for args in ((q, q, q, additive), (q, q, q, keep), (q, kv, kv, None), (q, q, q, None)):
        out, _ = huggingface.attention_forward(module, *args)
        expected, _ = sdpa_attention_forward(module, *args)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert [call["attn_mask"] is None for call in fused_calls] == [
        False,
        False,
        True,
    ]  # not the cross-attention


def test_siglip_vision_model_patches_and_stays_exact(record_difference):
    """SigLIP's pooling head is cross-attention (an nn.MultiheadAttention with a learned probe):
    patched, it runs as before; the encoder's norms are fused."""
    torch.manual_seed(0)
    reference = tiny_transformers_model("SiglipVisionConfig", "SiglipVisionModel").double()
    fused, report = patched_copy(reference)
    assert any(name.endswith("head.attention") for name, _, _ in report.replaced), report
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference(
        "huggingface SigLIP", *compare(reference, fused, images, output_of=lambda out: out.pooler_output)
    )


def test_an_image_size_the_patch_does_not_divide_runs_as_unpatched():
    """ViT with interpolate_pos_encoding on 36x36 images in 8x8 patches: the convolution drops the
    remainder, and so does the patched model (its patch embedding's own forward runs)."""
    reference, _ = _models()
    fused, _ = patched_copy(reference)
    images = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    expected = reference(images, interpolate_pos_encoding=True).logits
    torch.testing.assert_close(
        fused(images, interpolate_pos_encoding=True).logits, expected, rtol=1e-10, atol=1e-10
    )
