"""The tiles that run by default, as a user's first call runs them on this GPU (``gpu`` cases, CUDA
only), at ViT-B/16's own shapes: no pin, no search: each op's table entry for the device's
architecture runs, and the output and every gradient must stay within twice PyTorch's own error in
the same dtype against float64 (``tests.helpers.check_against_formula``). First of all the bfloat16
attention backward at L = 197, head dim 64 (`make gpu-session` runs this file first)."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from tests.helpers import CUDA, check_against_formula, cuda_param, device_reason
from tests.test_attention import check_attention_against_formula
from tests.test_layer_norm import check_layer_norm_against_formula
from tests.test_linear import check_mlp_against_formula, mlp_inputs
from tests.test_patch_embed import NAMES as PATCH_EMBED_NAMES
from tests.test_patch_embed import make_inputs, patch_embed_formula, run_patch_embed
from vit_kernels import _tiles
from vit_kernels._triton import HAS_TRITON, capability
from vit_kernels.ops import attention_tiles

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

SKIP = device_reason("triton", CUDA)
SIXTEEN_BITS = [
    cuda_param(torch.bfloat16, id="bf16", skip_reason=SKIP),
    cuda_param(torch.float16, id="fp16", skip_reason=SKIP),
]
BATCH, LENGTH, DIM, HEADS = 4, 197, 768, 12  # ViT-B/16


@pytest.fixture(autouse=True)
def chosen(monkeypatch) -> dict:
    """The tile each chooser's new keys got (the table's default: nothing is tuned or loaded)."""
    _tiles.forget()
    tiles: dict = {}
    choose = _tiles.TileChooser.choose

    def recorded(self, key, *args):
        tile = choose(self, key, *args)
        tiles.setdefault(self.name, set()).add(tile)
        return tile

    monkeypatch.setattr(_tiles.TileChooser, "choose", recorded)
    yield tiles
    assert vk.explain().tiles == []
    _tiles.forget()


@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_the_default_attention_at_vit_b16(dtype, chosen):
    qkv = torch.randn(BATCH, LENGTH, 3 * DIM)
    with vk.use_backend("triton", strict=True):
        check_attention_against_formula(qkv, dtype, CUDA, HEADS)
    default = attention_tiles.bwd_candidates(dtype, DIM // HEADS, LENGTH, arch=capability(CUDA))[0]
    assert chosen[attention_tiles.BWD_CHOOSER.name] == {default}


@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_the_default_patch_embedding_at_vit_b16(dtype):
    inputs = make_inputs(BATCH, 3, 224, 224, 16, DIM)
    with vk.use_backend("triton", strict=True):
        check_against_formula(
            run_patch_embed, patch_embed_formula, inputs, dtype, PATCH_EMBED_NAMES, CUDA, patch_size=16
        )


@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_the_default_gemms_of_a_vit_b16_mlp(dtype):
    """fc1 + GELU saving the pre-activation, fc2 + residual, GELU' and the split-K weight gradients:
    by the TMA kernel on sm_90, else the pointer kernel's default."""
    with vk.use_backend("triton", strict=True):
        check_mlp_against_formula(mlp_inputs((BATCH, LENGTH), DIM, 4 * DIM), dtype, CUDA)


@pytest.mark.parametrize("dtype", SIXTEEN_BITS)
def test_the_default_layer_norm_at_vit_b16(dtype):
    inputs = [
        torch.randn(BATCH * LENGTH, DIM) * 3 + 1,
        torch.randn(DIM),
        torch.randn(DIM),
        torch.randn(BATCH * LENGTH, DIM),
    ]
    with vk.use_backend("triton", strict=True):
        check_layer_norm_against_formula(inputs, dtype, CUDA, eps=1e-6)
