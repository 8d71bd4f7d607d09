"""torchvision's ViT blocks (those of vit_b_16) on the fused layers; exact in float64."""

import pytest
import torch
from exactness import compare, patched_copy
from torchvision.models import VisionTransformer, vit_b_16


@pytest.mark.parametrize("training", [False, True])
def test_vision_transformer_blocks_are_exact(training, record_difference):
    reference = (
        VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5
        )
        .double()
        .train(training)
    )
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model, report = patched_copy(reference)
    assert [name for name, _ in report.skipped] == ["conv_proj"], report
    assert "patch-embedding-like" in report.skipped[0][1]
    kinds = [new.rsplit(".", 1)[-1] for _, _, new in report.replaced]
    assert kinds.count("FusedMultiheadAttention") == 2 and kinds.count("FusedMLPBlock") == 2
    assert kinds.count("LayerNorm") == 2 * 2 + 1
    assert model.state_dict().keys() == reference.state_dict().keys()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference("torchvision ViT", *compare(reference, model, images))


def test_vit_b_16_every_block_is_covered():
    with torch.device("meta"):
        model = vit_b_16()
    report = patched_copy(model)[1]
    blocks = {name.split(".")[2] for name, _, _ in report.replaced if name.startswith("encoder.layers.")}
    assert len(blocks) == 12 and [name for name, _ in report.skipped] == ["conv_proj"]
