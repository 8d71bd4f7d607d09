"""python -m benchmarks e2e where timm is installed: the first row of the quick table is timm's model
(``timm:...``), eager and patched by ``vk.patch_model``, each timed on its own inputs; the towers of
the full table build from timm with random weights (no download) and take inputs of their size."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ lives beside the package
from benchmarks import headline  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("variant", ["eager", "vk"])
def test_the_quick_tables_first_row_is_timms_model_patched(variant):
    spec = headline.QUICK_MODELS[0]
    assert spec.name.startswith("timm:") and spec.source == "timm"
    model = headline._model(spec, CPU)
    row = headline.measure(spec, "infer", 2, variant, CPU, torch.float32, model, False)
    assert row["model"] == spec.name and row["images_per_second"] > 0, row


@pytest.mark.parametrize("spec", headline.FULL_MODELS[3:], ids=lambda spec: spec.name)
def test_each_tower_builds_from_timm_and_takes_inputs_of_its_size(spec):
    with torch.device("meta"):
        model = headline._model(spec, torch.device("meta"))
    (images, labels), _ = headline.model_inputs(model, spec, 2, torch.device("meta"))
    size = {
        "vit_large_patch16_384": 384,
        "vit_so400m_patch14_siglip_384": 384,
        "vit_large_patch14_dinov2": 518,
    }
    assert tuple(images.shape) == (2, 3, size[spec.base_name], size[spec.base_name])
    assert labels.shape == (2,)
