"""Weights from local files (vit/weights.py) and timm's model API on ViT: round trips through
safetensors, position-embedding resampling, head reset, refused files and architectures,
reset_classifier / get_classifier / no_weight_decay, gradient checkpointing and drop path.
Loading real timm, Hugging Face and torchvision checkpoints is checked in tests/integration."""

import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import vit
from vit.weights import load_pretrained, resample_pos_embed
from vit_kernels.nn import Block, drop_path

TINY = {"img_size": 16, "patch_size": 4, "embed_dim": 24, "depth": 2, "num_heads": 2, "num_classes": 5}


def tiny(**overrides) -> vit.ViT:
    """A small timm-layout ViT (16 patches + class token), random everywhere, in float64."""
    model = vit.create_model("vit_tiny_patch16_224", **{**TINY, **overrides}).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)  # biases, norms and the class token start constant
    return model


def saved(tmp_path, state: dict, name: str = "model.safetensors") -> str:
    path = tmp_path / name
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    return str(path)


def images(model: vit.ViT, batch: int = 2) -> torch.Tensor:
    c = model.config
    return torch.randn(batch, c.in_chans, c.img_size, c.img_size, dtype=torch.float64)


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("vit_tiny_patch16_224", TINY),
        ("vit_mnist_postnorm", {"depth": 1}),
        ("vit_mnist_sincos", {}),
        ("vit_digits", {"depth": 1}),
        ("vit_base_patch16_siglip_224", {**TINY, "num_heads": 2}),
    ],
)
def test_own_state_dict_round_trips(tmp_path, name, overrides):
    source = vit.create_model(name, **overrides).eval()
    path = saved(tmp_path, source.state_dict())
    loaded = vit.create_model(name, checkpoint_path=path, **overrides).eval()
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    x = torch.randn(2, source.config.in_chans, source.config.img_size, source.config.img_size)
    assert torch.equal(loaded(x), source(x))


def test_load_pretrained_reports_and_casts_to_the_model_dtype(tmp_path):
    source = tiny()
    path = saved(tmp_path, {k: v.float() for k, v in source.state_dict().items()})
    target = vit.create_model("vit_tiny_patch16_224", **TINY).double()
    report = load_pretrained(target, path)
    assert (report.source, report.pos_embed_resampled, report.head_loaded, report.unused) == (
        "timm",
        None,
        True,
        (),
    )
    assert target.pos_embed.dtype == torch.float64
    torch.testing.assert_close(target.pos_embed, source.pos_embed.float().double(), rtol=0, atol=0)


# ---- position embedding -----------------------------------------------------------------------


def _grid_embed(grid: int, dim: int, value) -> torch.Tensor:
    """(1, 1 + grid*grid, dim): a class token of 7s, then value(row, col) (grid, grid) per channel."""
    steps = torch.arange(grid, dtype=torch.float64)
    rows, cols = torch.meshgrid(steps, steps, indexing="ij")
    patches = value(rows, cols).reshape(-1, 1).expand(-1, dim)
    return torch.cat([torch.full((1, dim), 7.0, dtype=torch.float64), patches]).unsqueeze(0)


@pytest.mark.parametrize("old,new", [(4, 8), (8, 4), (6, 9), (5, 5)])
def test_resampling_keeps_a_constant_grid_and_the_class_token(old, new):
    embed = _grid_embed(old, 3, lambda r, c: torch.full_like(r, -2.5))
    out = resample_pos_embed(embed, (new, new), (old, old))
    assert out.shape == (1, 1 + new * new, 3) and out.dtype == torch.float64
    torch.testing.assert_close(out[:, 0], embed[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(
        out[:, 1:], torch.full((1, new * new, 3), -2.5, dtype=torch.float64), rtol=0, atol=1e-6
    )


def test_resampling_a_linear_ramp_is_linear_inside_the_grid():
    """Bicubic interpolation (align_corners=False) reproduces a linear function wherever its 4x4
    stencil lies inside the grid: output index j sits at source coordinate (j + 0.5) * old/new - 0.5."""
    old, new = 8, 16
    embed = _grid_embed(old, 2, lambda r, c: 0.5 * r - 1.25 * c + 3.0)
    out = resample_pos_embed(embed, (new, new), (old, old))[0, 1:, 0].reshape(new, new)
    coords = (torch.arange(new, dtype=torch.float64) + 0.5) * old / new - 0.5
    inside = (coords.floor() >= 1) & (coords.floor() + 2 <= old - 1)
    expected = 0.5 * coords[:, None] - 1.25 * coords[None, :] + 3.0
    assert inside.sum() >= 6
    torch.testing.assert_close(out[inside][:, inside], expected[inside][:, inside], rtol=0, atol=1e-5)
    assert (out.diff(dim=0) > 0).all() and (out.diff(dim=1) < 0).all(), (
        "the ramp stays monotonic up to the borders"
    )


def test_resampling_without_a_class_token_and_in_half_precision():
    embed = torch.randn(1, 16, 4, dtype=torch.float16)
    out = resample_pos_embed(embed, (2, 3), (4, 4), num_prefix_tokens=0)
    assert out.shape == (1, 6, 4) and out.dtype == torch.float16


def test_another_image_size_resamples_the_loaded_position_embedding(tmp_path):
    source = tiny()
    path = saved(tmp_path, source.state_dict())
    target = vit.create_model("vit_tiny_patch16_224", **{**TINY, "img_size": 24}).double()
    report = load_pretrained(target, path)
    assert report.pos_embed_resampled == ((4, 4), (6, 6)) and report.head_loaded
    expected = resample_pos_embed(source.pos_embed.detach(), (6, 6), (4, 4))
    torch.testing.assert_close(target.pos_embed.detach(), expected, rtol=0, atol=0)
    for key, value in source.state_dict().items():
        if key != "pos_embed":
            assert torch.equal(target.state_dict()[key], value), key
    assert target.eval()(torch.randn(2, 3, 24, 24, dtype=torch.float64)).shape == (2, 5)


def test_a_position_embedding_that_is_not_a_square_grid_is_refused(tmp_path):
    state = tiny().state_dict()
    state["pos_embed"] = state["pos_embed"][:, :13]  # class token + 12 patches
    expected = r"pos_embed's 13 tokens leave 12 patch positions after 1 class token\(s\): not a square grid"
    with pytest.raises(ValueError, match=expected):
        vit.create_model("vit_tiny_patch16_224", checkpoint_path=saved(tmp_path, state), **TINY)


def test_a_learned_embedding_into_the_sincos_model_is_refused(tmp_path):
    state = vit.create_model("vit_mnist_sincos").state_dict()
    state["pos_embed"] = torch.randn_like(state["pos_embed"])
    with pytest.raises(ValueError, match="fixed sin-cos table .* pos_embed='learned'"):
        vit.create_model("vit_mnist_sincos", checkpoint_path=saved(tmp_path, state))


# ---- head -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_classes", [3, 0])
def test_another_num_classes_keeps_the_model_head_and_loads_the_rest(tmp_path, num_classes):
    source = tiny()
    torch.manual_seed(0)
    fresh = vit.create_model("vit_tiny_patch16_224", **{**TINY, "num_classes": num_classes}).double()
    torch.manual_seed(0)
    target = vit.create_model("vit_tiny_patch16_224", **{**TINY, "num_classes": num_classes}).double().eval()
    assert not load_pretrained(target, saved(tmp_path, source.state_dict())).head_loaded
    x = images(source)
    assert torch.equal(target.forward_features(x), source.forward_features(x))
    if num_classes:
        assert torch.equal(target.head.weight, fresh.head.weight) and torch.equal(
            target.head.bias, fresh.head.bias
        )
        assert target(x).shape == (2, num_classes)
    else:
        assert isinstance(target.head, nn.Identity) and target(x).shape == (2, TINY["embed_dim"])


def test_a_checkpoint_without_a_head_loads_into_a_model_with_one(tmp_path):
    source = tiny(num_classes=0)
    target = vit.create_model("vit_tiny_patch16_224", **TINY)
    assert not load_pretrained(target, saved(tmp_path, source.state_dict())).head_loaded
    assert target.head.weight.shape == (5, TINY["embed_dim"])


# ---- refused files and architectures ----------------------------------------------------------


@pytest.mark.parametrize("suffix", [".bin", ".pth", ".pt", ".ckpt"])
def test_pickled_checkpoints_are_refused_by_name(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    torch.save(tiny().state_dict(), path)
    expected = rf"checkpoint_path '.*model\{suffix}' is a pickled checkpoint.*safetensors\.torch\.save_file"
    with pytest.raises(ValueError, match=expected):
        vit.create_model("vit_tiny_patch16_224", checkpoint_path=path, **TINY)


def test_pickled_or_broken_contents_are_refused(tmp_path):
    disguised = tmp_path / "disguised.safetensors"
    torch.save(tiny().state_dict(), disguised)
    with pytest.raises(
        ValueError, match=r"is a pickled \(torch.save\) checkpoint, which is not loaded: convert it"
    ):
        load_pretrained(tiny(), disguised)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        load_pretrained(tiny(), broken)
    with pytest.raises(FileNotFoundError, match="checkpoint_path .*absent.safetensors' is not a file"):
        load_pretrained(tiny(), tmp_path / "absent.safetensors")


def test_unknown_formats_are_refused_with_their_keys(tmp_path):
    path = saved(tmp_path, {"backbone.stem.weight": torch.zeros(2), "fc.weight": torch.zeros(2, 2)})
    with pytest.raises(
        ValueError, match="cannot tell its format .* its keys start backbone.stem.weight, fc.weight"
    ):
        load_pretrained(tiny(), path)


def test_missing_unexpected_and_mis_shaped_keys_are_named(tmp_path):
    state = tiny().state_dict()
    del state["blocks.1.mlp.fc2.bias"]
    state["blocks.0.attn.q_norm.weight"] = torch.ones(12)
    state["blocks.0.norm1.bias"] = torch.zeros(23)
    model = tiny()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_pretrained(model, saved(tmp_path, state))
    message = str(error.value)
    assert "missing (1): blocks.1.mlp.fc2.bias" in message
    assert "unexpected (1): blocks.0.attn.q_norm.weight" in message
    assert "shape mismatch (1): blocks.0.norm1.bias: (23,) (model's blocks.0.norm1.bias: (24,))" in message
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items()), (
        "nothing may be copied"
    )


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            {"depth": 1},
            r"depth: checkpoint 2, model 1\). .*create_model\(name, checkpoint_path=\.\.\., depth=2\)",
        ),
        (
            {"embed_dim": 12, "num_heads": 2},
            r"embed_dim: checkpoint 24, model 12; mlp_hidden_dim: checkpoint 96, model 48",
        ),
        (
            {"patch_size": 8},
            r"patch_size: checkpoint 4, model 8\).*patch_size=4\) \(with an img_size .* not supported",
        ),
        ({"in_chans": 1}, r"in_chans: checkpoint 3, model 1"),
        ({"mlp_ratio": 2.0}, r"mlp_hidden_dim: checkpoint 96, model 48"),
        ({"qkv_bias": False}, r"qkv_bias: checkpoint True, model False"),
        ({"final_norm": False}, r"final_norm: checkpoint True, model False"),
        ({"class_token": False, "global_pool": "avg"}, r"class_token: checkpoint True, model False"),
    ],
)
def test_another_architecture_is_refused_naming_the_fields(tmp_path, overrides, expected):
    path = saved(tmp_path, tiny().state_dict())
    prefix = r"checkpoint_path .* \(timm\) holds another architecture than the model \("
    with pytest.raises(ValueError, match=prefix + expected):
        vit.create_model("vit_tiny_patch16_224", checkpoint_path=path, **{**TINY, **overrides})


# ---- timm's model API -------------------------------------------------------------------------


def test_a_siglip_checkpoint_into_a_model_without_attention_pooling_is_refused(tmp_path):
    siglip = vit.create_model("vit_base_patch16_siglip_224", **TINY)
    with pytest.raises(ValueError, match=r"global_pool: checkpoint 'map', model 'avg'"):
        vit.create_model(
            "vit_tiny_patch16_224",
            checkpoint_path=saved(tmp_path, siglip.state_dict()),
            **{**TINY, "class_token": False, "global_pool": "avg"},
        )
    plain = vit.create_model("vit_tiny_patch16_224", **{**TINY, "class_token": False, "global_pool": "avg"})
    with pytest.raises(
        ValueError, match=r"does not fit the model; missing \(13\): attn_pool.latent, attn_pool.q"
    ):
        vit.create_model(
            "vit_base_patch16_siglip_224",
            checkpoint_path=saved(tmp_path, plain.state_dict(), "plain.st"),
            **TINY,
        )


def test_get_and_reset_classifier():
    model = tiny().train()
    assert model.get_classifier() is model.head
    model.reset_classifier(7)
    head = model.get_classifier()
    assert isinstance(head, nn.Linear) and head.weight.shape == (7, 24) and head.weight.dtype == torch.float64
    assert head.training and model.config.num_classes == 7
    assert torch.equal(head.bias, torch.zeros(7, dtype=torch.float64))
    assert abs(head.weight.std().item() - 0.02) < 0.01, "timm's trunc_normal(std=0.02) initialisation"
    x = images(model)
    model.eval()
    features = model.forward_features(x)
    model.reset_classifier(0, global_pool="avg")
    assert isinstance(model.get_classifier(), nn.Identity) and model.config.global_pool == "avg"
    torch.testing.assert_close(model(x), features[:, 1:].mean(dim=1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="ViTConfig.global_pool must be one of"):
        model.reset_classifier(3, global_pool="max")
    with pytest.raises(ValueError, match="ViTConfig.num_classes must be >= 0"):
        model.reset_classifier(-1)
    no_token = vit.create_model(
        "vit_tiny_patch16_224", **{**TINY, "class_token": False, "global_pool": "avg"}
    )
    with pytest.raises(ValueError, match="global_pool='token' needs class_token=True"):
        no_token.reset_classifier(3, global_pool="token")


def test_no_weight_decay_names_the_tokens_as_timm():
    model = tiny()
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    assert model.no_weight_decay() <= {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("drop_path_rate,drop_rate", [(0.0, 0.0), (0.3, 0.2)])
def test_gradient_checkpointing_gives_the_same_gradients(drop_path_rate, drop_rate):
    model = tiny(drop_path_rate=drop_path_rate, drop_rate=drop_rate).train()
    x = images(model, batch=4)

    def run(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        model.set_grad_checkpointing(checkpointing)
        calls = []
        hook = model.blocks[0].norm1.register_forward_hook(lambda *_: calls.append(1))
        torch.manual_seed(1234)
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        hook.remove()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)

    plain_out, plain_grads, plain_calls = run(False)
    out, grads, calls = run(True)
    assert (plain_calls, calls) == (1, 2), (
        "checkpointing recomputes each block (its first layer at least) in backward"
    )
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    model.eval().set_grad_checkpointing(True)
    calls = []
    hook = model.blocks[0].norm1.register_forward_hook(lambda *_: calls.append(1))
    model(x).sum().backward()
    hook.remove()
    assert len(calls) == 1, "only training checkpoints"


# ---- drop path --------------------------------------------------------------------------------


def test_drop_path_rates_rise_linearly_as_timm():
    model = tiny(depth=5, drop_path_rate=0.2)
    expected = torch.linspace(0, 0.2, 5).tolist()  # float32, as timm
    assert model.config.drop_path_rates() == expected == [block.drop_path for block in model.blocks]
    assert expected[0] == 0.0 and math.isclose(expected[-1], 0.2, rel_tol=1e-7)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"ViTConfig.drop_path_rate must be a float in \[0, 1\)"):
            vit.get_config("vit_digits", drop_path_rate=bad)
    with pytest.raises(ValueError, match=r"drop_path must be a float in \[0, 1\)"):
        Block(8, 2, drop_path=1.0)


def test_drop_path_is_the_identity_in_eval(tmp_path):
    source = tiny()
    dropping = tiny(drop_path_rate=0.5)
    dropping.load_state_dict(source.state_dict())
    x = images(source)
    assert torch.equal(dropping.eval()(x), source(x))
    dropping.train()
    assert not torch.equal(dropping(x), source.train()(x)), "in training it does drop"


def test_drop_path_zeroes_whole_samples_and_keeps_the_mean():
    x = torch.ones(20000, 3, 5, dtype=torch.float64)
    out = drop_path(x, 0.25, training=True)
    per_sample = out.reshape(20000, -1)
    assert ((per_sample == 0).all(dim=1) | (per_sample == 1 / 0.75).all(dim=1)).all(), "one draw per sample"
    kept = (per_sample[:, 0] > 0).double().mean().item()
    assert abs(kept - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 20000)
    assert abs(out.mean().item() - 1.0) < 4 * math.sqrt(0.25 / 0.75 / 20000)
    assert drop_path(x, 0.25, training=False) is x and drop_path(x, 0.0, training=True) is x


@pytest.mark.parametrize("norm_first", [True, False])
def test_block_drop_path_matches_the_formula(norm_first):
    """Training: pre-norm x1 = x + m1/keep * attn(norm1(x)), out = x1 + m2/keep * mlp(norm2(x1));
    post-norm x1 = norm1(x + m1/keep * attn(x)), out = norm2(x1 + m2/keep * mlp(x1)); m ~ Bernoulli(keep)
    per sample, drawn in that order."""
    p, keep = 0.4, 0.6
    block = Block(16, 2, mlp_hidden_dim=24, norm_first=norm_first, drop_path=p).double().train()
    x = torch.randn(12, 5, 16, dtype=torch.float64)
    torch.manual_seed(7)
    out = block(x)
    torch.manual_seed(7)
    m1 = x.new_empty(12, 1, 1).bernoulli_(keep) / keep
    m2 = x.new_empty(12, 1, 1).bernoulli_(keep) / keep
    assert 0 < m1.count_nonzero() < 12 or 0 < m2.count_nonzero() < 12, "the seed must drop some samples"
    if norm_first:
        x1 = x + m1 * block.attn(block.norm1(x))
        expected = x1 + m2 * block.mlp(block.norm2(x1))
    else:
        x1 = block.norm1(x + m1 * block.attn(x))
        expected = block.norm2(x1 + m2 * block.mlp(x1))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out_with_probs, probs = block(x, return_probs=True)
    assert out_with_probs.shape == out.shape and probs.shape == (12, 2, 5, 5)
