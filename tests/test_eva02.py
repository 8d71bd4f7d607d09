"""The EVA02-style ViT (vit.create_model("eva02_*")): its 2-D rotary tables, the model against its
formula written out in float64 (RoPE of the patch tokens, SwiGLU with its hidden LayerNorm, mean
pooling with fc_norm), forward and every gradient, on the torch and Triton backends, and timm's
EVA02 file layouts converted to ours."""

import math

import pytest
import torch
import torch.nn.functional as F

import vit
import vit_kernels as vk
from vit.rope import axial_rope_tables
from vit.weights import load_pretrained, rename_keys

# A CPU-sized EVA02: 4 x 4 patches of 4 x 4 pixels (positions rescaled to timm's 16 x 16 grid),
# head dim 16, SwiGLU hidden 40.
SMALL = {
    "img_size": 16,
    "patch_size": 4,
    "embed_dim": 32,
    "num_heads": 2,
    "depth": 2,
    "mlp_hidden_dim": 40,
    "num_classes": 3,
}


@pytest.mark.parametrize(
    "grid,head_dim,ref_grid", [((4, 4), 16, (16, 16)), ((3, 5), 8, None), ((2, 6), 24, (4, 4))]
)
def test_axial_rope_tables_match_their_formula(grid, head_dim, ref_grid):
    """cos[n, 2m] = cos[n, 2m+1] = cos(f_m), f = [i w_0 .. i w_{Dh/4-1}, j w_0 .. j w_{Dh/4-1}],
    w_k = 10000^(-k / (Dh/4)), (i, j) the patch's row and column (rescaled to ref_grid)."""
    cos, sin = axial_rope_tables(grid, head_dim, ref_grid=ref_grid)
    h, w = grid
    assert cos.shape == sin.shape == (h * w, head_dim) and cos.dtype == torch.float32
    bands = head_dim // 4
    for n in range(h * w):
        i, j = divmod(n, w)
        if ref_grid is not None:
            i, j = i * ref_grid[0] / h, j * ref_grid[1] / w
        angles = [p * 10000.0 ** (-k / bands) for p in (i, j) for k in range(bands)]
        for m, angle in enumerate(angles):
            for column in (2 * m, 2 * m + 1):
                assert math.isclose(cos[n, column].item(), math.cos(angle), abs_tol=2e-6)
                assert math.isclose(sin[n, column].item(), math.sin(angle), abs_tol=2e-6)
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        axial_rope_tables(grid, 6)


def _rotate_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, Dh), the last L_r tokens: (x_{2m}, x_{2m+1}) -> (x_{2m} c - x_{2m+1} s, x_{2m+1} c + x_{2m} s)."""
    prefix, tail = x[..., : x.shape[-2] - cos.shape[0], :], x[..., x.shape[-2] - cos.shape[0] :, :]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    c, s = cos[:, 0::2], sin[:, 0::2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    return torch.cat([prefix, rotated], dim=-2)


def _eva02_formula(model, images: torch.Tensor) -> torch.Tensor:
    """The logits of an EVA02-style ViT, written out: conv patches + class token + position embedding;
    per block x += proj(softmax(rot(q) rot(k)^T / sqrt(Dh)) v) on LN1(x), x += fc2(LN(silu(g) * u)) on
    LN2(x); mean of the patch tokens -> fc_norm -> head."""
    config, eps = model.config, model.config.norm_eps
    patches = F.conv2d(
        images, model.patch_embed.proj.weight, model.patch_embed.proj.bias, stride=config.patch_size
    )
    x = torch.cat([model.cls_token.expand(len(images), -1, -1), patches.flatten(2).transpose(1, 2)], 1)
    x = x + model.pos_embed
    batch, length, dim = x.shape
    heads = config.num_heads
    for block in model.blocks:
        h = F.layer_norm(x, (dim,), block.norm1.weight, block.norm1.bias, eps)
        q, k, v = (
            (h @ block.attn.qkv.weight.T + block.attn.qkv.bias).reshape(batch, length, 3, heads, -1).unbind(2)
        )
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = (_rotate_formula(t, model.rope_cos, model.rope_sin) for t in (q, k))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        attended = (probs @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + attended @ block.attn.proj.weight.T + block.attn.proj.bias
        h = F.layer_norm(x, (dim,), block.norm2.weight, block.norm2.bias, eps)
        mlp = block.mlp
        gate, up = h @ mlp.fc1_g.weight.T + mlp.fc1_g.bias, h @ mlp.fc1_x.weight.T + mlp.fc1_x.bias
        hidden = gate * torch.sigmoid(gate) * up
        if config.mlp_norm:
            hidden = F.layer_norm(hidden, hidden.shape[-1:], mlp.norm.weight, mlp.norm.bias, eps)
        x = x + hidden @ mlp.fc2.weight.T + mlp.fc2.bias
    pooled = F.layer_norm(x[:, 1:].mean(1), (dim,), model.fc_norm.weight, model.fc_norm.bias, eps)
    return pooled @ model.head.weight.T + model.head.bias


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "eva02_base_patch14_224"])
def test_eva02_model_matches_its_formula(name, backend, dtype):
    """Logits and every parameter's gradient against the formula in float64 (the Triton kernels,
    which take 32 and 16 bits, in float32 under the interpreter)."""
    import copy

    from vit_kernels import backend as backends

    if backend == "triton" and backends.triton_device_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton backend does not run here")
    torch.manual_seed(0)
    model = vit.create_model(name, **SMALL).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    expected = _eva02_formula(model, images)
    cotangent = torch.randn_like(expected)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), list(model.parameters()))
    ours = copy.deepcopy(model).to(dtype)
    with vk.use_backend(backend, strict=True):
        actual = ours(images.to(dtype))
        grads = torch.autograd.grad((actual * cotangent.to(dtype)).sum(), list(ours.parameters()))
    tolerance = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
    for (key, _), got, want in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(
            got.double(),
            want,
            rtol=tolerance,
            atol=tolerance * want.abs().max().item(),
            msg=lambda m, key=key: f"{key}: {m}",
        )


def _timm_eva02_layout(state: dict[str, torch.Tensor], fused_qkv: bool, packed_mlp: bool) -> dict:
    """Our state dict in the names of timm's Eva: a fused qkv weight with q_bias / v_bias (EVA02-Ti/S)
    or q/k/v_proj (k without bias: EVA02-B/L); the gate and up projections packed into GluMlp's fc1."""
    out = {}
    for key, value in state.items():
        if ".attn.qkv." in key:
            prefix, param = key.split(".attn.qkv.")
            q, k, v = value.chunk(3)
            if fused_qkv and param == "weight":
                out[key] = value
            elif fused_qkv:
                out[f"{prefix}.attn.q_bias"], out[f"{prefix}.attn.v_bias"] = q, v
            else:
                for name, part in (("q", q), ("k", k), ("v", v)):
                    if not (name == "k" and param == "bias"):
                        out[f"{prefix}.attn.{name}_proj.{param}"] = part
        elif packed_mlp and ".mlp.fc1_g." in key:
            out[key.replace(".fc1_g.", ".fc1.")] = torch.cat(
                [value, state[key.replace(".fc1_g.", ".fc1_x.")]]
            )
        elif not (packed_mlp and ".mlp.fc1_x." in key):
            out[key] = value
    return out


@pytest.mark.parametrize(
    "name,fused_qkv,packed_mlp",
    [("eva02_tiny_patch14_224", True, True), ("eva02_base_patch14_224", False, False)],
)
def test_timm_eva02_layouts_load_into_the_same_model(tmp_path, name, fused_qkv, packed_mlp):
    from safetensors.torch import save_file

    source = vit.create_model(name, **SMALL)
    state = source.state_dict()
    for key in [k for k in state if k.endswith(".attn.qkv.bias")]:
        state[key][SMALL["embed_dim"] : 2 * SMALL["embed_dim"]] = 0  # EVA02 has no k bias
    timm_state = _timm_eva02_layout(state, fused_qkv, packed_mlp)
    assert ("blocks.0.attn.q_bias" in timm_state) == fused_qkv and (
        "blocks.0.mlp.fc1.weight" in timm_state
    ) == packed_mlp
    renamed, origin, _ = rename_keys(timm_state, "timm")
    assert set(renamed) == set(state)
    save_file({k: v.contiguous() for k, v in timm_state.items()}, str(tmp_path / "eva.safetensors"))
    target = vit.create_model(name, **SMALL)
    load_pretrained(target, tmp_path / "eva.safetensors")
    for key, value in state.items():
        assert torch.equal(target.state_dict()[key], value), key
    assert "zero k bias" in origin["blocks.0.attn.qkv.bias"]


def test_eva02_architecture_mismatches_are_named(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {
            k: v.contiguous()
            for k, v in vit.create_model("eva02_base_patch14_224", **SMALL).state_dict().items()
        },
        str(tmp_path / "eva.safetensors"),
    )
    with pytest.raises(ValueError, match="mlp_norm: checkpoint True, model False"):
        vit.create_model("eva02_tiny_patch14_224", checkpoint_path=tmp_path / "eva.safetensors", **SMALL)
    with pytest.raises(ValueError, match="mlp_type: checkpoint 'swiglu', model 'mlp'"):
        vit.create_model(
            "vit_base_patch16_224",
            checkpoint_path=tmp_path / "eva.safetensors",
            **{**SMALL, "fc_norm": True, "final_norm": False, "global_pool": "avg"},
        )


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"mlp_norm": True}, "mlp_norm=True needs mlp_type='swiglu'"),
        ({"mlp_type": "geglu"}, "mlp_type must be one of"),
        ({"rope": True, "embed_dim": 36, "num_heads": 6}, "head dim .* divisible by 4, got 6"),
        ({"rope_ref_grid": 0}, "rope_ref_grid must be None or a positive int"),
    ],
)
def test_eva02_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        vit.create_model("vit_tiny_patch16_224", **overrides)


# timm 1.0.31's eva02_*_patch14_224 at 1000 classes: parameter count, depth, width
EVA02_TIMM = {
    "eva02_tiny_patch14_224": (5_695_144, 12, 192),
    "eva02_small_patch14_224": (22_006_120, 12, 384),
    "eva02_base_patch14_224": (86_527_720, 12, 768),
}


@pytest.mark.parametrize("name", sorted(EVA02_TIMM))
def test_eva02_presets_have_timm_counts(name):
    """timm's count plus one k bias (D,) per block: ours is one qkv Linear, whose k bias loads as zero
    from timm's files (a k bias shifts each query's scores by a constant: softmax ignores it)."""
    count, depth, dim = EVA02_TIMM[name]
    assert sum(p.numel() for p in vit.create_model(name).parameters()) == count + depth * dim
