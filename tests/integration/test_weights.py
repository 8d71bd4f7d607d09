"""vit.create_model(name, checkpoint_path=...) on files written by the real timm, transformers and
torchvision (pretrained=False, tiny sizes, random weights): the same logits and input gradients as
the original in float64; the position embedding resampled to the same numbers as timm's own loading
path; another num_classes keeps every feature; drop path draws the same masks as timm's."""

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import checkpoint_filter_fn
from torchvision.models import VisionTransformer
from transformers import ViTConfig as HFViTConfig
from transformers import ViTForImageClassification, ViTModel

import vit
from vit.weights import load_pretrained

TOLERANCE = 1e-10
# A timm ViT small enough for the CPU: 4x4 patches of 8x8 pixels, two blocks.
TIMM = {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 5}
HF = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 5,
    "hidden_act": "gelu",
}
TORCHVISION = {
    "image_size": 32,
    "patch_size": 8,
    "num_layers": 2,
    "num_heads": 4,
    "hidden_dim": 32,
    "mlp_dim": 64,
    "num_classes": 5,
}
# Ours for the Hugging Face and torchvision models above; their LayerNorm eps is not in the weights.
OURS = {
    "img_size": 32,
    "patch_size": 8,
    "depth": 2,
    "embed_dim": 32,
    "num_heads": 4,
    "mlp_hidden_dim": 64,
    "num_classes": 5,
}


@pytest.fixture(autouse=True)
def float64_models():
    """Every model (theirs and ours) is built in float64, so loading copies without rounding."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Random everywhere (the libraries zero class tokens, biases and heads), in eval mode."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.2)
    return model.eval()


def _save(tmp_path, state: dict, name: str = "model.safetensors") -> str:
    path = str(tmp_path / name)
    save_file({key: value.detach().contiguous() for key, value in state.items()}, path)
    return path


def _assert_same(reference, ours, images: torch.Tensor) -> tuple[float, float]:
    """Outputs and the gradient with respect to the images agree to TOLERANCE; returns both diffs."""
    inputs = [images.clone().requires_grad_(True) for _ in range(2)]
    expected, actual = reference(inputs[0]), ours(inputs[1])
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)
    cotangent = torch.randn_like(expected)
    (expected * cotangent).sum().backward()
    (actual * cotangent).sum().backward()
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=TOLERANCE, atol=TOLERANCE)
    return (actual - expected).abs().max().item(), (inputs[1].grad - inputs[0].grad).abs().max().item()


def _images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size)


# ---- each library's file, loaded exactly --------------------------------------------------------


@pytest.mark.parametrize(
    "name,overrides,ours_only",
    [
        ("vit_tiny_patch16_224", {}, {}),
        ("vit_small_patch16_224", {"depth": 1, "qkv_bias": False, "mlp_ratio": 2.0}, {}),
        # SigLIP: no class token, attention pooling (MAP head: latent query, q/kv/proj, norm, MLP)
        ("vit_base_patch16_siglip_224", {"embed_dim": 64, "num_heads": 4}, {}),
        # SigLIP so400m's head dim 72 and an MLP width that is not 4x (timm's ratio, our width), at a
        # width the CPU runs
        (
            "vit_so400m_patch14_siglip_224",
            {"img_size": 28, "patch_size": 14, "embed_dim": 144, "num_heads": 2, "mlp_ratio": 200 / 144},
            {"mlp_hidden_dim": 200},
        ),
        # LayerScale (DINOv2-style ls1 / ls2.gamma), folded into each branch's last GEMM
        ("vit_small_patch16_224", {"depth": 2, "init_values": 1e-5}, {}),
        # EVA02: 2-D RoPE (positions on the 16 x 16 pretraining grid), SwiGLU (Ti/S: timm's GluMlp, one
        # packed fc1; B/L: SwiGLU with its hidden LayerNorm and separate q, k, v projections), fc_norm
        ("eva02_tiny_patch14_224", {"embed_dim": 64, "num_heads": 2}, {"mlp_hidden_dim": 170}),
        ("eva02_base_patch14_224", {"embed_dim": 64, "num_heads": 2}, {"mlp_hidden_dim": 170}),
    ],
)
def test_timm_checkpoint_loads_exactly(tmp_path, name, overrides, ours_only, record_difference):
    reference = _randomized(timm.create_model(name, pretrained=False, **{**TIMM, **overrides}))
    path = _save(tmp_path, reference.state_dict())
    ours = vit.create_model(name, checkpoint_path=path, **{**TIMM, **overrides, **ours_only}).eval()
    record_difference(
        f"weights: timm {name}", *_assert_same(reference, ours, _images(overrides.get("img_size", 32)))
    )


def test_huggingface_files_load_exactly(tmp_path, record_difference):
    """Both layouts: save_pretrained's file (transformers 4.x names, as on the hub) and the 5.x
    module names of state_dict()."""
    reference = _randomized(
        ViTForImageClassification._from_config(HFViTConfig(**HF), attn_implementation="sdpa")
    )
    reference.save_pretrained(tmp_path / "hub")
    logits = lambda model: lambda images: model(images).logits  # noqa: E731
    for path in (str(tmp_path / "hub" / "model.safetensors"), _save(tmp_path, reference.state_dict())):
        ours = vit.create_model("vit_base_patch16_224", checkpoint_path=path, **OURS, norm_eps=1e-12).eval()
        record_difference("weights: huggingface", *_assert_same(logits(reference), ours, _images()))
    assert "vit.encoder.layer.0.attention.attention.query.weight" in _keys(
        tmp_path / "hub" / "model.safetensors"
    )


def _keys(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return set(file.keys())


def test_huggingface_vit_model_features_and_its_unused_pooler(tmp_path, record_difference):
    reference = _randomized(ViTModel._from_config(HFViTConfig(**HF), attn_implementation="sdpa"))
    ours = vit.create_model("vit_base_patch16_224", **{**OURS, "num_classes": 0}, norm_eps=1e-12).eval()
    report = load_pretrained(ours, _save(tmp_path, reference.state_dict()))
    assert report.source == "huggingface" and report.unused == ("pooler.dense.bias", "pooler.dense.weight")
    hidden = lambda images: reference(images).last_hidden_state  # noqa: E731
    record_difference("weights: huggingface", *_assert_same(hidden, ours.forward_features, _images()))


def test_torchvision_checkpoint_loads_exactly(tmp_path, record_difference):
    reference = _randomized(VisionTransformer(**TORCHVISION))
    ours = vit.create_model(
        "vit_base_patch16_224", checkpoint_path=_save(tmp_path, reference.state_dict()), **OURS
    )
    record_difference("weights: torchvision", *_assert_same(reference, ours.eval(), _images()))


def test_torchvision_legacy_mlp_names_load(tmp_path, record_difference):
    """Files from before torchvision 0.13 name the MLP linear_1 / linear_2; torchvision still reads them."""
    reference = _randomized(VisionTransformer(**TORCHVISION))
    legacy = {
        key.replace(".mlp.0.", ".mlp.linear_1.").replace(".mlp.3.", ".mlp.linear_2."): value
        for key, value in reference.state_dict().items()
    }
    assert any(".mlp.linear_1." in key for key in legacy)
    VisionTransformer(**TORCHVISION).load_state_dict(legacy)  # the names are torchvision's own
    ours = vit.create_model("vit_base_patch16_224", checkpoint_path=_save(tmp_path, legacy), **OURS)
    record_difference("weights: torchvision", *_assert_same(reference, ours.eval(), _images()))


# ---- another image size, another num_classes ----------------------------------------------------


@pytest.mark.parametrize("size", [48, 24, 40])
def test_another_image_size_resamples_as_timm(tmp_path, size, record_difference):
    """The checkpoint's 4x4 grid to (size/8)^2: the very tensor timm's resample_abs_pos_embed gives,
    and the logits of a timm model created at that size and loaded through timm's checkpoint_filter_fn."""
    source = _randomized(timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM))
    state = source.state_dict()
    ours = vit.create_model("vit_tiny_patch16_224", **{**TIMM, "img_size": size}).eval()
    report = load_pretrained(ours, _save(tmp_path, state))
    grid = size // 8
    assert report.pos_embed_resampled == ((4, 4), (grid, grid))
    expected = resample_abs_pos_embed(state["pos_embed"], new_size=[grid, grid], num_prefix_tokens=1)
    torch.testing.assert_close(ours.pos_embed.detach(), expected, rtol=0, atol=0)
    reference = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, **{**TIMM, "img_size": size}
    ).eval()
    reference.load_state_dict(checkpoint_filter_fn(dict(state), reference))
    record_difference("weights: timm, resampled", *_assert_same(reference, ours, _images(size)))


@pytest.mark.parametrize("num_classes", [3, 0])
def test_another_num_classes_keeps_every_feature(tmp_path, num_classes):
    reference = _randomized(timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM))
    ours = vit.create_model("vit_tiny_patch16_224", **{**TIMM, "num_classes": num_classes}).eval()
    assert not load_pretrained(ours, _save(tmp_path, reference.state_dict())).head_loaded
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(
            ours.forward_features(images), reference.forward_features(images), rtol=TOLERANCE, atol=TOLERANCE
        )
        pooled = reference.forward_head(reference.forward_features(images), pre_logits=True)
        if num_classes == 0:
            torch.testing.assert_close(ours(images), pooled, rtol=TOLERANCE, atol=TOLERANCE)
        else:
            assert ours(images).shape == (2, num_classes)


def test_another_depth_is_refused_by_name(tmp_path):
    path = _save(tmp_path, timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM).state_dict())
    with pytest.raises(ValueError, match=r"depth: checkpoint 2, model 1\)"):
        vit.create_model("vit_tiny_patch16_224", checkpoint_path=path, **{**TIMM, "depth": 1})


# ---- training: drop path as timm ----------------------------------------------------------------


def test_drop_path_draws_timms_masks(tmp_path, record_difference):
    """Same seed, same weights, training mode: timm's DropPath and ours draw the same per-sample
    masks in the same order (attention branch, then MLP branch, block by block), so the outputs and
    gradients agree; gradient checkpointing on ours changes neither."""
    reference = _randomized(
        timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM, drop_path_rate=0.5)
    )
    path = _save(tmp_path, reference.state_dict())
    ours = vit.create_model("vit_tiny_patch16_224", checkpoint_path=path, **TIMM, drop_path_rate=0.5)
    rates = [getattr(block.drop_path1, "drop_prob", 0.0) for block in reference.blocks]  # Identity at rate 0
    assert [block.drop_path for block in ours.blocks] == rates == [0.0, 0.5]
    reference.train(), ours.train()
    images = torch.randn(8, 3, 32, 32)

    def seeded(model):
        def run(inputs):
            torch.manual_seed(99)
            return model(inputs)

        return run

    for checkpointing in (False, True):
        ours.set_grad_checkpointing(checkpointing)
        record_difference("weights: timm, drop path", *_assert_same(seeded(reference), seeded(ours), images))
    torch.manual_seed(99)
    assert not torch.allclose(ours(images), ours.eval()(images)), "the masks must drop something"
