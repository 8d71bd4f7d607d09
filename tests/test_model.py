"""ViT presets: parameter counts, timm key names and shapes, post-norm semantics, config checks."""

import math

import pytest
import torch
from torch import nn

import vit
from tests.helpers import requires_cuda
from vit.model import sincos_pos_embed

TIMM_COUNTS = {
    "vit_tiny_patch16_224": 5_717_416,
    "vit_small_patch16_224": 22_050_664,
    "vit_base_patch16_224": 86_567_656,
    "vit_large_patch16_224": 304_326_632,
    "vit_base_patch16_siglip_224": 93_653_224,  # timm 1.0.31, num_classes=1000
    "vit_so400m_patch14_siglip_224": 428_833_704,
}


def timm_vit_keys(
    dim: int, depth: int, classes: int = 1000, tokens: int = 197, patch: int = 16
) -> dict[str, tuple]:
    """The state-dict keys and shapes of timm's VisionTransformer for the vit_*_patch16_224 models."""
    keys = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, tokens, dim),
        "patch_embed.proj.weight": (dim, 3, patch, patch),
        "patch_embed.proj.bias": (dim,),
        "norm.weight": (dim,),
        "norm.bias": (dim,),
        "head.weight": (classes, dim),
        "head.bias": (classes,),
    }
    for i in range(depth):
        keys.update(
            {
                f"blocks.{i}.norm1.weight": (dim,),
                f"blocks.{i}.norm1.bias": (dim,),
                f"blocks.{i}.attn.qkv.weight": (3 * dim, dim),
                f"blocks.{i}.attn.qkv.bias": (3 * dim,),
                f"blocks.{i}.attn.proj.weight": (dim, dim),
                f"blocks.{i}.attn.proj.bias": (dim,),
                f"blocks.{i}.norm2.weight": (dim,),
                f"blocks.{i}.norm2.bias": (dim,),
                f"blocks.{i}.mlp.fc1.weight": (4 * dim, dim),
                f"blocks.{i}.mlp.fc1.bias": (4 * dim,),
                f"blocks.{i}.mlp.fc2.weight": (dim, 4 * dim),
                f"blocks.{i}.mlp.fc2.bias": (dim,),
            }
        )
    return keys


@pytest.mark.parametrize(
    "name,dim,depth",
    [
        ("vit_tiny_patch16_224", 192, 12),
        ("vit_small_patch16_224", 384, 12),
        ("vit_base_patch16_224", 768, 12),
        ("vit_large_patch16_224", 1024, 24),
    ],
)
def test_timm_presets_have_timm_keys_and_counts(name, dim, depth):
    with torch.device("meta"):
        model = vit.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == TIMM_COUNTS[name]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == timm_vit_keys(dim, depth)
    assert model.config.norm_eps == 1e-6


@pytest.mark.parametrize("name", ["vit_base_patch16_siglip_224", "vit_so400m_patch14_siglip_224"])
def test_siglip_presets_have_timm_counts(name):
    with torch.device("meta"):
        model = vit.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == TIMM_COUNTS[name]
    assert model.cls_token is None and model.attn_pool is not None and model.config.norm_eps == 1e-6


# Loading real timm state dicts is checked in tests/integration (the environment with timm).


def test_create_model_overrides_and_errors():
    model = vit.create_model("vit_base_patch16_224", num_classes=3, depth=1)
    assert model.head.out_features == 3 and len(model.blocks) == 1
    with pytest.raises(ValueError, match="unknown model 'vit_huge'; valid names: .*vit_digits"):
        vit.create_model("vit_huge")
    with pytest.raises(ValueError, match="unknown ViTConfig field"):
        vit.create_model("vit_digits", width=3)
    with pytest.raises(ValueError, match="num_heads=5 must divide embed_dim=64"):
        vit.create_model("vit_digits", num_heads=5)
    with pytest.raises(ValueError, match="img_size=30 must be divisible by patch_size=4"):
        vit.create_model("vit_digits", img_size=30)
    assert set(vit.list_models()) >= {
        "vit_digits",
        "vit_mnist_postnorm",
        "vit_cifar10_small",
        "vit_mnist_sincos",
    }


SMALL_PRESET_FIELDS = (
    "img_size patch_size in_chans embed_dim depth num_heads mlp_hidden_dim act "
    "norm_first final_norm qkv_bias drop_rate attn_drop_rate"
).split()
SMALL_PRESETS = {
    "vit_mnist_postnorm": (28, 7, 1, 64, 3, 8, 2048, "relu", False, False, True, 0.1, 0.1),
    "vit_cifar10_small": (32, 4, 3, 48, 4, 4, 192, "gelu_tanh", True, False, True, 0.0, 0.0),
}


def test_small_presets_configuration():
    for name, values in SMALL_PRESETS.items():
        config = vit.get_config(name)
        found = {field: getattr(config, field) for field in SMALL_PRESET_FIELDS}
        assert found == dict(zip(SMALL_PRESET_FIELDS, values, strict=True)), name
    for name in ("vit_mnist_postnorm", "vit_cifar10_small", "vit_mnist_sincos", "vit_digits"):
        assert vit.get_config(name).norm_eps == 1e-5


def test_postnorm_preset_blocks_equal_transformer_encoder_layer():
    model = vit.create_model("vit_mnist_postnorm").double().eval()
    layer = nn.TransformerEncoderLayer(
        64, 8, 2048, dropout=0.1, activation="relu", batch_first=True, norm_first=False
    )
    layer = layer.double().eval()
    from tests.test_nn import copy_encoder_layer

    copy_encoder_layer(model.blocks[1], layer)
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    torch.testing.assert_close(model.blocks[1](x), layer(x))
    assert isinstance(model.norm, nn.Identity)
    logits = model(torch.randn(2, 1, 28, 28, dtype=torch.float64))
    assert logits.shape == (2, 10)


def test_sincos_preset_uses_a_fixed_buffer():
    model = vit.create_model("vit_mnist_sincos")
    names = {n for n, _ in model.named_parameters()}
    assert "pos_embed" not in names and "pos_embed" in dict(model.named_buffers())
    assert model.pos_embed.shape == (1, 50, 8) and not model.pos_embed.requires_grad
    torch.testing.assert_close(model.pos_embed[0, 0], torch.zeros(8))
    table = sincos_pos_embed(7, 8, class_token=False)[0]
    # row 0 column 0: sin(0)=0, cos(0)=1 for both halves
    torch.testing.assert_close(table[0], torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]))
    assert len({tuple(row.tolist()) for row in table}) == 49, "every position must be distinct"
    logits = model(torch.randn(3, 1, 28, 28))
    logits.sum().backward()
    assert model.patch_embed.proj.weight.grad is not None


def test_attention_maps_and_avg_pool():
    model = vit.create_model("vit_cifar10_small", global_pool="avg").eval()
    images = torch.randn(2, 3, 32, 32)
    maps = model.attention_maps(images)
    assert len(maps) == 4 and maps[0].shape == (2, 4, 65, 65)
    torch.testing.assert_close(maps[-1].sum(-1), torch.ones(2, 4, 65))
    assert model(images).shape == (2, 10)
    with pytest.raises(ValueError, match="global_pool='token' needs class_token=True"):
        vit.create_model("vit_digits", class_token=False)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("vit_digits", {}),
        ("vit_mnist_sincos", {}),
        ("vit_cifar10_small", {"depth": 1}),
        ("vit_mnist_postnorm", {"depth": 1}),
    ],
)
def test_model_on_triton_backend_matches_torch(name, overrides):
    """The whole model (tiny configurations of the presets) gives the same logits and parameter
    gradients with the Triton kernels as with the reference."""
    from vit_kernels import backend

    if backend.triton_device_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton backend does not run here")
    import vit_kernels as vk

    model = vit.create_model(name, **overrides).eval()
    size = model.config.img_size
    images = torch.randn(2, model.config.in_chans, size, size)
    results = {}
    for choice in ("torch", "triton"):
        model.zero_grad()
        with vk.use_backend(choice):
            logits = model(images)
            logits.square().sum().backward()
        results[choice] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=1e-4)
    for n, g in results["torch"][1].items():
        torch.testing.assert_close(
            results["triton"][1][n], g, atol=1e-4, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}"
        )


def _loss_curve(choice: str, steps: int, batch_size: int, fixed_batch: bool) -> list[float]:
    """The training loss per AdamW step of a small digits ViT on backend ``choice``: a new random batch
    each step, or (``fixed_batch``) the same one, which the model then learns fast and surely."""
    import vit_kernels as vk
    from vit.data import load_digits

    train, _ = load_digits()
    torch.manual_seed(0)
    model = vit.create_model("vit_digits", embed_dim=32, depth=2, num_heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(len(train), (batch_size,), generator=generator)
    losses = []
    with vk.use_backend(choice):
        for _ in range(steps):
            if not fixed_batch:
                batch = torch.randint(len(train), (batch_size,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(train.images[batch]), train.labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def _compare_loss_curves(steps: int, learned: float, batch_size: int, fixed_batch: bool) -> None:
    from vit_kernels import backend

    if backend.triton_device_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton backend does not run here")
    reference = _loss_curve("torch", steps, batch_size, fixed_batch)
    kernels = _loss_curve("triton", steps, batch_size, fixed_batch)
    assert reference[-1] < learned * reference[0], (
        "the run must actually learn for the comparison to mean anything"
    )
    gaps = [abs(a - b) for a, b in zip(reference, kernels)]
    assert max(gaps[:20]) < 1e-3 and max(gaps) < 5e-2, (max(gaps[:20]), max(gaps))


def test_training_follows_the_same_loss_curve_on_triton():
    """4 AdamW steps on one batch of 8 digits (the interpreter takes a few seconds a step): the
    kernels track the reference step for step while the loss falls to under 0.6x (0.44x here)."""
    _compare_loss_curves(4, learned=0.6, batch_size=8, fixed_batch=True)


@pytest.mark.slow
def test_training_follows_the_same_loss_curve_on_triton_long():
    """300 AdamW steps on the digits, the same comparison over a whole short run."""
    _compare_loss_curves(300, learned=0.5, batch_size=16, fixed_batch=False)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_whole_vit_compiles_fullgraph_and_matches_eager_on_cuda(dtype):
    import vit_kernels as vk

    model = vit.create_model("vit_small_patch16_224", num_classes=10).cuda()
    images = torch.randn(8, 3, 224, 224, device="cuda")
    with vk.use_backend("auto"), torch.autocast("cuda", dtype=dtype):
        eager = model(images)
        compiled = torch.compile(model, fullgraph=True)(images)
        compiled.float().sum().backward()
    torch.testing.assert_close(compiled.float(), eager.float(), atol=5e-2, rtol=5e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_attention_pooling_matches_its_formula():
    """SigLIP's MAP head against the formula in float64: one latent query attends over the tokens
    (no class token), then projection, and a residual MLP on its LayerNorm."""
    model = (
        vit.create_model(
            "vit_base_patch16_siglip_224",
            img_size=32,
            patch_size=8,
            embed_dim=32,
            depth=1,
            num_heads=4,
            num_classes=3,
        )
        .double()
        .eval()
    )
    pool = model.attn_pool
    for p in pool.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tokens = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    q = (pool.latent[0, 0] @ pool.q.weight.T + pool.q.bias).reshape(4, 8)  # (heads, Dh)
    kv = tokens @ pool.kv.weight.T + pool.kv.bias  # (N, T, 2D)
    k, v = kv[..., :32].reshape(2, 16, 4, 8), kv[..., 32:].reshape(2, 16, 4, 8)
    weights = torch.softmax(torch.einsum("hd,nthd->nht", q, k) / math.sqrt(8), dim=-1)
    pooled = torch.einsum("nht,nthd->nhd", weights, v).reshape(2, 32) @ pool.proj.weight.T + pool.proj.bias
    normed = torch.nn.functional.layer_norm(pooled, (32,), pool.norm.weight, pool.norm.bias, 1e-6)
    hidden = torch.nn.functional.gelu(normed @ pool.mlp.fc1.weight.T + pool.mlp.fc1.bias)
    expected = pooled + hidden @ pool.mlp.fc2.weight.T + pool.mlp.fc2.bias
    actual = pool(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    cotangent = torch.randn_like(expected)
    grads = torch.autograd.grad((actual * cotangent).sum(), [tokens, pool.latent, pool.kv.weight])
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), [tokens, pool.latent, pool.kv.weight])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(model(images), model.head(pool(model.forward_features(images))))
    assert model.cls_token is None and model.forward_features(images).shape == (2, 16, 32)
    with pytest.raises(ValueError, match="global_pool cannot change from 'map' to 'avg'"):
        model.reset_classifier(5, global_pool="avg")
    model.reset_classifier(5)
    assert model(images).shape == (2, 5)
