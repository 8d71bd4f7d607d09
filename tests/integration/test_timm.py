"""patch_model on real timm models (pretrained=False, tiny sizes): outputs and every parameter
gradient equal to the original in float64, train and eval; BEiT attention is skipped with a reason."""

import inspect

import pytest
import timm
import torch
from exactness import compare, patched_copy

from vit_kernels import nn as vkn

SMALL = {"img_size": 32, "num_classes": 5}
FAMILIES = {
    "vit_tiny": ("vit_tiny_patch16_224", {"depth": 2, "patch_size": 8}),
    "vit_small": ("vit_small_patch16_224", {"depth": 1}),
    "vit_base": ("vit_base_patch16_224", {"depth": 1}),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", {"depth": 2, "patch_size": 8}),
    "avg_pool_no_class_token": (
        "vit_tiny_patch16_224",
        {"depth": 2, "patch_size": 8, "class_token": False, "global_pool": "avg"},
    ),
    "registers_layer_scale": (
        "vit_tiny_patch16_224",
        {"depth": 2, "patch_size": 8, "reg_tokens": 4, "init_values": 0.1},
    ),
    "reg4_gap": ("vit_base_patch16_reg4_gap_256", {"depth": 1, "embed_dim": 64, "num_heads": 4}),
    "clip_quick_gelu": ("vit_base_patch16_clip_quickgelu_224", {"depth": 1, "embed_dim": 64, "num_heads": 4}),
}


def _timm_vit(name, **overrides):
    model = timm.create_model(name, pretrained=False, **{**SMALL, **overrides}).double()
    for p in model.parameters():  # random everywhere (timm zeroes class tokens and some biases)
        torch.nn.init.normal_(p, std=0.2) if p.dim() < 2 else None
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("training", [False, True])
def test_plain_timm_vits_are_exact(family, training, record_difference):
    name, overrides = FAMILIES[family]
    reference = _timm_vit(name, **overrides).train(training)
    model, report = patched_copy(reference)
    assert report.skipped == [], report
    depth = overrides["depth"]
    kinds = [new.rsplit(".", 1)[-1] for _, _, new in report.replaced]
    assert (
        kinds.count("Attention") == depth
        and kinds.count("Mlp") == depth
        and kinds.count("FusedPatchEmbed") == 1
    )
    assert kinds.count("FusedBlock") == depth  # the residual adds (and LayerScale) in the branches' GEMMs
    assert isinstance(model.blocks[0].attn, vkn.Attention) and isinstance(model.blocks[0].mlp, vkn.Mlp)
    assert model.state_dict().keys() == reference.state_dict().keys()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    record_difference(f"timm {family}", *compare(reference, model, images))


@pytest.mark.parametrize("training", [False, True])
def test_block_residual_adds_and_layer_scale_run_in_the_last_gemms(training, monkeypatch, record_difference):
    """A timm block with LayerScale (DINOv2-style): both branches hand their residual and gamma to the
    last GEMM (the attention projection, the MLP); where drop path drops (training, the second block:
    rates rise from 0 at the first) the add runs as timm's, exact either way."""
    reference = _timm_vit(
        "vit_tiny_patch16_224",
        depth=2,
        patch_size=8,
        init_values=0.1,
        drop_path_rate=0.5 if training else 0.0,
    ).train(training)
    _assert_adds_in_the_last_gemms(reference, training, monkeypatch, record_difference, "timm layer scale")


def _assert_adds_in_the_last_gemms(reference, training, monkeypatch, record_difference, label):
    """The patched copy of ``reference`` (two blocks, LayerScale, drop path 0 in the first block) gives
    the same output; without drop path all four branches hand their residual and gamma to their last
    GEMM (``residual=``, ``layer_scale=``), with it (training) the first block's two only."""
    from vit_kernels import functional as vkf

    model, _ = patched_copy(reference)
    calls = []
    for name in ("linear", "mlp", "swiglu_mlp"):
        fused = getattr(vkf, name)
        monkeypatch.setattr(
            vkf,
            name,
            lambda *a, fused=fused, name=name, **k: (
                calls.append((name, k.get("residual") is not None, k.get("layer_scale") is not None))
                or fused(*a, **k)
            ),
        )
    torch.manual_seed(0)
    expected = reference(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    torch.manual_seed(0)
    actual = model(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    fused_adds = [c for c in calls if c[1] and c[2]]
    assert len(fused_adds) == (2 if training else 4), calls
    if not training:
        record_difference(label, *compare(reference, model, torch.randn(2, 3, 32, 32, dtype=torch.float64)))


def test_dynamic_image_size_is_exact(record_difference):
    reference = _timm_vit("vit_tiny_patch16_224", depth=2, patch_size=8, dynamic_img_size=True)
    model, report = patched_copy(reference)
    assert report.skipped == [], report
    for size in ((32, 32), (48, 40)):
        images = torch.randn(2, 3, *size, dtype=torch.float64)
        record_difference("timm dynamic_img_size", *compare(reference, model, images))


def test_beit_attention_is_skipped_with_its_parameters_named(record_difference):
    reference = _timm_vit("beit_base_patch16_224", depth=1, embed_dim=64, num_heads=4)
    model, report = patched_copy(reference)
    reasons = dict(report.skipped)
    assert "q_bias" in reasons["blocks.0.attn"] and "relative_position_bias_table" in reasons["blocks.0.attn"]
    assert type(model.blocks[0].attn) is type(reference.blocks[0].attn)
    record_difference(
        "timm beit (attention kept)",
        *compare(reference, model, torch.randn(2, 3, 32, 32, dtype=torch.float64)),
    )


def test_qk_norm_and_a_gelu_glu_are_reported_not_swapped():
    model = _timm_vit("vit_tiny_patch16_224", depth=1, qk_norm=True)
    reasons = dict(patched_copy(model)[1].skipped)
    assert "qk_norm" in reasons["blocks.0.attn"]
    eva = _timm_vit("vit_base_patch16_rope_reg1_gap_256", **ROPE_SMALL, qk_norm=True)
    assert "qk_norm" in dict(patched_copy(eva)[1].skipped)["blocks.0.attn"]
    gelu_glu = _timm_vit("vit_tiny_patch16_224", depth=1, patch_size=8, mlp_layer=timm.layers.GluMlp)  # GEGLU
    assert "gates with GELU, not SiLU" in dict(patched_copy(gelu_glu)[1].skipped)["blocks.0.mlp"]


# timm's RoPE ViTs (timm.models.eva): (model, overrides, the attention class, the rope layout)
ROPE_SMALL = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64, "num_heads": 4}
ROPE_FAMILIES = {
    # EVA02: separate q/k/v projections, SwiGLU packed in one fc1 (GluMlp; base and up: split, with a
    # LayerNorm in the hidden layer)
    "eva02": (
        "eva02_tiny_patch14_224",
        {"img_size": 28, "depth": 2, "ref_feat_shape": (2, 2)},
        "EvaAttention",
        "interleaved",
    ),
    "eva02_scale_mlp": (
        "eva02_base_patch14_224",
        {"img_size": 28, "depth": 2, "embed_dim": 64, "num_heads": 4, "ref_feat_shape": (2, 2)},
        "EvaAttention",
        "interleaved",
    ),
    "rope_reg1_gap": ("vit_base_patch16_rope_reg1_gap_256", ROPE_SMALL, "EvaAttention", "interleaved"),
    "rope_mixed": ("vit_base_patch16_rope_mixed_224", ROPE_SMALL, "AttentionRope", "interleaved"),
    "dinov3": ("vit_base_patch16_dinov3", ROPE_SMALL, "EvaAttention", "half"),
    "pe_core": (
        "vit_pe_core_base_patch16_224",
        {**ROPE_SMALL, "ref_feat_shape": (4, 4)},
        "AttentionRope",
        "interleaved",
    ),
}


@pytest.fixture
def attention_calls(monkeypatch):
    """The (rope layout or None, cos table shape) of every vk.attention call the timm adapter makes."""
    from vit_kernels.integrations import timm as adapter

    calls, fused = [], adapter.vkf.attention

    def spy(qkv, num_heads, **kwargs):
        rope = kwargs.get("rope")
        calls.append(None if rope is None else (kwargs["rope_layout"], tuple(rope[0].shape)))
        return fused(qkv, num_heads, **kwargs)

    monkeypatch.setattr(adapter.vkf, "attention", spy)
    return calls


@pytest.mark.parametrize("family", sorted(ROPE_FAMILIES))
@pytest.mark.parametrize("training", [False, True])
def test_rope_vits_fuse_attention_with_the_rotation_and_stay_exact(
    family, training, attention_calls, record_difference
):
    """EVA02, the RoPE ViTs (axial and mixed), DINOv3 (half layout, class + register tokens) and the
    Perception Encoder: attention runs the fused op with the rotary tables, exact in float64."""
    name, overrides, attention_class, layout = ROPE_FAMILIES[family]
    reference = _timm_vit(name, **overrides)
    reference.train(training)
    model, report = patched_copy(reference)
    fused = [n for n, _, new in report.replaced if new.endswith(f"Fused{attention_class}")]
    assert len(fused) == overrides["depth"], report
    mlps = [n for n, _, new in report.replaced if n.startswith("blocks.") and n.endswith(".mlp")]
    assert len(mlps) == overrides["depth"], report  # Mlp, or SwiGLU / GluMlp computing forward fused
    blocks = [n for n, _, new in report.replaced if new.endswith("FusedEvaBlock")]
    assert len(blocks) == overrides["depth"], report  # the residual adds in the branches' last GEMMs
    images = torch.randn(2, 3, overrides["img_size"], overrides["img_size"], dtype=torch.float64)
    record_difference(f"timm {family}", *compare(reference, model, images))
    assert attention_calls and all(call is not None and call[0] == layout for call in attention_calls), (
        attention_calls
    )


@pytest.mark.parametrize("training", [False, True])
def test_eva_block_residual_adds_and_gammas_run_in_the_last_gemms(training, monkeypatch, record_difference):
    """DINOv3's EvaBlocks (gamma_1, gamma_2): both branches hand their residual and gamma to the last
    GEMM (the attention projection, the MLP's fc2); where drop path drops (training, the second block)
    the add runs as timm's, exact either way."""
    name, overrides, _, _ = ROPE_FAMILIES["dinov3"]
    reference = _timm_vit(name, **{**overrides, "drop_path_rate": 0.5 if training else 0.0}).train(training)
    assert reference.blocks[0].gamma_1 is not None and reference.blocks[0].gamma_2 is not None
    _assert_adds_in_the_last_gemms(reference, training, monkeypatch, record_difference, "timm eva block")


def test_rope_attention_with_a_mask_is_fused_and_a_causal_call_runs_timms_own(attention_calls):
    """A mask (NaFlex) runs fused with the rotation; a causal call or a table for other tokens than
    the block has runs timm's forward: the same result either way."""
    reference = _timm_vit("vit_base_patch16_rope_reg1_gap_256", **ROPE_SMALL)
    model, _ = patched_copy(reference)
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    rope = reference.rope.get_embed(shape=(4, 4)).double()
    mask = torch.rand(2, 1, 17, 17) > 0.3
    mask[..., 0] = True
    additive = torch.zeros(2, 1, 17, 17, dtype=torch.float64).masked_fill(
        ~mask, torch.finfo(torch.float64).min
    )
    for kwargs in ({"rope": rope, "attn_mask": mask}, {"rope": rope, "attn_mask": additive}):
        torch.testing.assert_close(model.blocks[0].attn(x, **kwargs), reference.blocks[0].attn(x, **kwargs))
    assert attention_calls == [("interleaved", (16, 16))] * 2
    torch.testing.assert_close(
        model.blocks[0].attn(x, rope=rope, is_causal=True),
        reference.blocks[0].attn(x, rope=rope, is_causal=True),
    )
    for attention in (model.blocks[0].attn, reference.blocks[0].attn):  # 8 rows for 16 tokens: timm's error
        with pytest.raises(RuntimeError, match="size of tensor"):
            attention(x, rope=rope[:8])
    assert len(attention_calls) == 2


NAFLEX_SMALL = {"depth": 2, "embed_dim": 64, "num_heads": 4, "num_classes": 5}


def _naflex_batch(batch_valid=(16, 11), grid=(4, 4), patch=16):
    """A NaFlex collator's dict: patches (B, N, P*P*3) float64, their (row, column) coordinates and
    which are valid, the second image a 11-patch one padded to N = 16."""
    rows, cols = grid
    coords = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(
        -1, 2
    )
    count = rows * cols
    valid = torch.arange(count)[None, :] < torch.tensor(batch_valid)[:, None]
    patches = torch.randn(len(batch_valid), count, patch * patch * 3, dtype=torch.float64)
    return {
        "patches": patches,
        "patch_coord": coords.expand(len(batch_valid), count, 2).clone(),
        "patch_valid": valid,
    }


@pytest.mark.parametrize("rope_type", ["", "axial"])
@pytest.mark.parametrize("training", [False, True])
def test_naflex_padded_batch_runs_masked_attention_fused(rope_type, training, monkeypatch, record_difference):
    """A NaFlex ViT on a padded batch: every block's attention runs the fused op with timm's padding
    mask (learned position embedding, or axial RoPE), exact in float64, forward and every gradient."""
    from vit_kernels import functional as vkf

    reference = timm.create_model(
        "naflexvit_base_patch16_gap", pretrained=False, rope_type=rope_type, **NAFLEX_SMALL
    ).double()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() < 2 else None
    reference.train(training)
    model, report = patched_copy(reference)
    attentions = [n for n, _, _ in report.replaced if n.endswith(".attn")]
    assert len(attentions) == NAFLEX_SMALL["depth"], report
    masks, fused = [], vkf.attention

    def spy(qkv, num_heads, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return fused(qkv, num_heads, **kwargs)

    monkeypatch.setattr(vkf, "attention", spy)  # the module every layer and adapter calls through
    record_difference(f"timm naflex rope={rope_type or 'none'}", *compare(reference, model, _naflex_batch()))
    tokens = 16 + reference.num_prefix_tokens
    assert len(masks) >= NAFLEX_SMALL["depth"] and all(
        m is not None and m.shape[-1] == tokens for m in masks
    ), [None if m is None else tuple(m.shape) for m in masks]


def test_a_mask_runs_masked_attention_exactly():
    """A patched block given a mask (NaFlex ViTs mask padded patches) or is_causal computes what the
    unpatched block does, forward and backward."""
    reference = _timm_vit("vit_tiny_patch16_224", depth=1, patch_size=8)
    model, _ = patched_copy(reference)
    tokens = torch.randn(2, 17, 192, dtype=torch.float64)
    keep = torch.ones(2, 1, 17, 17, dtype=torch.bool)
    keep[1, ..., 12:] = False  # the second image has 5 padded patches
    for kwargs in (
        {"attn_mask": torch.randn(17, 17, dtype=torch.float64)},
        {"attn_mask": keep},
        {"is_causal": True},
    ):
        if (
            "is_causal" in kwargs
            and "is_causal" not in inspect.signature(type(reference.blocks[0]).forward).parameters
        ):
            continue
        first = tokens.clone().requires_grad_()
        second = tokens.clone().requires_grad_()
        expected, actual = reference.blocks[0](first, **kwargs), model.blocks[0](second, **kwargs)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
        cotangent = torch.randn_like(expected)
        torch.testing.assert_close(
            torch.autograd.grad(actual, second, cotangent)[0],
            torch.autograd.grad(expected, first, cotangent)[0],
            rtol=1e-10,
            atol=1e-10,
        )


@pytest.mark.parametrize("family", ["eva02", "dinov3"])
def test_a_compiled_patched_rope_vit_matches_eager(family):
    """torch.compile of a patched RoPE ViT: the same output and gradients as the eager patched model."""
    name, overrides, _, _ = ROPE_FAMILIES[family]
    model, _ = patched_copy(_timm_vit(name, **{**overrides, "depth": 1}))
    images = torch.randn(2, 3, overrides["img_size"], overrides["img_size"], dtype=torch.float64)
    expected = model(images)
    (expected_grad,) = torch.autograd.grad(expected.sum(), model.patch_embed.proj.weight)
    compiled = torch.compile(model)
    actual = compiled(images)
    (actual_grad,) = torch.autograd.grad(actual.sum(), model.patch_embed.proj.weight)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-10, atol=1e-10)


def test_a_compiled_patched_vit_with_registers_and_layer_scale_matches_eager():
    """torch.compile of a patched timm ViT whose blocks run fused (residual adds and LayerScale in the
    GEMMs): the same output and gradients as the eager patched model."""
    name, overrides = FAMILIES["registers_layer_scale"]
    model, _ = patched_copy(_timm_vit(name, **{**overrides, "depth": 1}))
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = model(images)
    (expected_grad,) = torch.autograd.grad(expected.sum(), model.blocks[0].ls1.gamma)
    actual = torch.compile(model)(images)
    (actual_grad,) = torch.autograd.grad(actual.sum(), model.blocks[0].ls1.gamma)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-10, atol=1e-10)
