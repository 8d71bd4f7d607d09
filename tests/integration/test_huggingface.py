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


def test_a_mask_is_refused_clearly():
    huggingface.register()
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="attention_mask"):
        huggingface.attention_forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 5, 5))
