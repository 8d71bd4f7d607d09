"""Hugging Face ViT: attention through transformers' AttentionInterface (attn_implementation=
"vit_kernels"), MLP, patch embeddings and norms swapped by patch_model; exact in float64."""

import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from exactness import compare, patched_copy
from vit_kernels.integrations import huggingface

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              image_size=32, patch_size=8, num_labels=5)


def _models(hidden_act="gelu", **extra):
    def config():  # one each: the attention implementation is kept on the config
        return ViTConfig(**CONFIG, hidden_act=hidden_act, **extra)

    reference = ViTForImageClassification._from_config(config(), attn_implementation="sdpa").double()  # eager softmaxes in float32
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


def test_attention_left_on_another_implementation_is_reported():
    reference, _ = _models()
    reasons = dict(patched_copy(reference)[1].skipped)
    attention = [why for name, why in reasons.items() if name.endswith("attention")]
    assert len(attention) == 2 and all("attn_implementation='vit_kernels'" in why for why in attention), reasons


def test_a_mask_or_cross_attention_runs_transformers_own_attention():
    """What the fused kernel does not compute (a mask, cross-attention) takes transformers' SDPA
    path: the result of an unpatched model, never an error."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    huggingface.register()
    module = torch.nn.Module()
    module.is_causal = False
    q, kv = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 7, 4, dtype=torch.float64)
    mask = torch.randn(1, 1, 5, 5, dtype=torch.float64)
    for args in ((q, q, q, mask), (q, kv, kv, None)):
        out, _ = huggingface.attention_forward(module, *args)
        expected, _ = sdpa_attention_forward(module, *args)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_siglip_vision_model_patches_and_stays_exact(record_difference):
    """SigLIP's pooling head is cross-attention (an nn.MultiheadAttention with a learned probe):
    patched, it runs as before; the encoder's norms are fused."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    reference = SiglipVisionModel._from_config(config, attn_implementation="sdpa").double()
    fused, report = patched_copy(reference)
    assert any(name.endswith("head.attention") for name, _, _ in report.replaced), report
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference("huggingface SigLIP", *compare(reference, fused, images, output_of=lambda out: out.pooler_output))
