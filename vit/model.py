"""A readable Vision Transformer on the fused layers, and a registry of named presets.

The timm presets (``vit_*_patch16_224``) have timm's architecture and state-dict keys, so
``model.load_state_dict(timm_model.state_dict(), strict=True)`` works, and
``create_model(name, checkpoint_path=...)`` loads timm, Hugging Face or torchvision weights from a
safetensors file (``vit/weights.py``). Layer classes are injected (``patch_embed_layer``,
``block_layer``, ``norm_layer``) so experiments can swap one without forking the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vit.pooling import AttentionPool
from vit.rope import axial_rope_tables
from vit.weights import load_pretrained
from vit_kernels.activations import ACTIVATIONS
from vit_kernels.nn import MLP_TYPES, Block, LayerNorm, LayerScale, PatchEmbed

POS_EMBED_KINDS = ("learned", "sincos")
POOLS = ("token", "avg", "map")


@dataclass(frozen=True)
class ViTConfig:
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    mlp_hidden_dim: Optional[int] = None  # overrides mlp_ratio when set
    qkv_bias: bool = True
    act: str = "gelu"  # one of vit_kernels.activations.ACTIVATIONS: gelu | gelu_tanh | quick_gelu | relu
    mlp_type: str = "mlp"  # mlp (fc1 -> act -> fc2) | swiglu (timm's SwiGLU, EVA02: act unused)
    mlp_norm: bool = False  # swiglu only: LayerNorm on the hidden features (EVA02-B/L's scale_mlp)
    rope: bool = False  # 2-D rotary position embedding of the patch tokens in attention (EVA02; vit/rope.py)
    rope_ref_grid: Optional[int] = (
        None  # rope positions rescaled to this square grid (EVA02's ref_feat_shape)
    )
    norm_first: bool = True  # pre-norm (ViT); False = post-norm (nn.TransformerEncoderLayer)
    norm_eps: float = 1e-6
    final_norm: bool = True
    class_token: bool = True
    pos_embed: str = "learned"  # learned | sincos (a fixed buffer)
    global_pool: str = "token"  # token | avg | map (attention pooling, SigLIP: vit.pooling.AttentionPool)
    fc_norm: bool = False  # LayerNorm of the pooled features before the head (timm's fc_norm; EVA02)
    drop_rate: float = 0.0  # after attention projection and in the MLP
    attn_drop_rate: float = 0.0  # on attention probabilities
    pos_drop_rate: float = 0.0  # on the embedded tokens
    drop_path_rate: float = 0.0  # stochastic depth of the last block; rising linearly from 0 at the first
    init_values: Optional[float] = None  # LayerScale (CaiT, DINOv2; timm's ls1/ls2.gamma) initialised to this
    init_std: Optional[float] = 0.02  # Linear weights ~ N(0, init_std); None keeps PyTorch's fan-in
    # default, which trains tiny models much faster than timm's 0.02

    def __post_init__(self) -> None:
        for name in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {value!r}")
        if self.img_size % self.patch_size:
            raise ValueError(
                f"ViTConfig.img_size={self.img_size} must be divisible by patch_size={self.patch_size}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(f"ViTConfig.num_heads={self.num_heads} must divide embed_dim={self.embed_dim}")
        if (
            isinstance(self.drop_path_rate, bool)
            or not isinstance(self.drop_path_rate, (int, float))
            or not (0.0 <= self.drop_path_rate < 1.0)
        ):
            raise ValueError(
                f"ViTConfig.drop_path_rate must be a float in [0, 1), got {self.drop_path_rate!r}"
            )
        if self.init_values is not None and (
            isinstance(self.init_values, bool)
            or not isinstance(self.init_values, (int, float))
            or not math.isfinite(self.init_values)
            or self.init_values <= 0
        ):
            raise ValueError(
                f"ViTConfig.init_values must be None or a positive float, got {self.init_values!r}"
            )
        if self.num_classes < 0:
            raise ValueError(f"ViTConfig.num_classes must be >= 0 (0 = no head), got {self.num_classes}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"ViTConfig.act must be one of {ACTIVATIONS}, got {self.act!r}")
        if self.pos_embed not in POS_EMBED_KINDS:
            raise ValueError(f"ViTConfig.pos_embed must be one of {POS_EMBED_KINDS}, got {self.pos_embed!r}")
        if self.pos_embed == "sincos" and self.embed_dim % 4:
            raise ValueError(
                f"sincos position embedding needs embed_dim divisible by 4, got {self.embed_dim}"
            )
        if self.global_pool not in POOLS:
            raise ValueError(f"ViTConfig.global_pool must be one of {POOLS}, got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if self.mlp_type not in MLP_TYPES:
            raise ValueError(f"ViTConfig.mlp_type must be one of {MLP_TYPES}, got {self.mlp_type!r}")
        if self.mlp_norm and self.mlp_type != "swiglu":
            raise ValueError(f"ViTConfig.mlp_norm=True needs mlp_type='swiglu', got {self.mlp_type!r}")
        if self.rope and (self.embed_dim // self.num_heads) % 4:
            raise ValueError(
                f"ViTConfig.rope=True needs a head dim (embed_dim // num_heads) divisible by 4, got "
                f"{self.embed_dim // self.num_heads}"
            )
        if self.rope_ref_grid is not None and (
            isinstance(self.rope_ref_grid, bool)
            or not isinstance(self.rope_ref_grid, int)
            or self.rope_ref_grid <= 0
        ):
            raise ValueError(
                f"ViTConfig.rope_ref_grid must be None or a positive int, got {self.rope_ref_grid!r}"
            )

    @property
    def num_patches(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + int(self.class_token)

    @property
    def mlp_hidden_features(self) -> int:
        return self.mlp_hidden_dim or int(self.embed_dim * self.mlp_ratio)

    def drop_path_rates(self) -> list[float]:
        """Per block, as timm: ``linspace(0, drop_path_rate, depth)`` in float32, so the rates (and the
        1 / (1 - rate) scaling) are the very numbers timm uses."""
        return torch.linspace(
            0.0, self.drop_path_rate, self.depth, dtype=torch.float32, device="cpu"
        ).tolist()


def sincos_pos_embed(grid: int, dim: int, class_token: bool) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding, (1, T, dim): half the channels encode the row,
    half the column, each as [sin(p * w_k), cos(p * w_k)] with w_k = 10000^(-k / (dim/4)).
    The class token gets zeros."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    rows, cols = torch.meshgrid(
        torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij"
    )

    def encode(positions: torch.Tensor) -> torch.Tensor:
        angles = positions.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    table = torch.cat([encode(rows), encode(cols)], dim=1)
    if class_token:
        table = torch.cat([torch.zeros(1, dim, dtype=torch.float64), table], dim=0)
    return table.unsqueeze(0).float()


class ViT(nn.Module):
    """images (N, C, H, W) -> logits (N, num_classes).

    timm's model API: ``get_classifier``, ``reset_classifier``, ``no_weight_decay``,
    ``set_grad_checkpointing``; stochastic depth through ``ViTConfig.drop_path_rate``.
    """

    def __init__(
        self,
        config: ViTConfig,
        *,
        patch_embed_layer: type[nn.Module] = PatchEmbed,
        block_layer: type[nn.Module] = Block,
        norm_layer: type[nn.Module] = LayerNorm,
    ) -> None:
        super().__init__()
        self.config = config
        dim = config.embed_dim
        self.patch_embed = patch_embed_layer(config.img_size, config.patch_size, config.in_chans, dim)
        # timm keeps the class token and position embedding on the model; patch_embed adds them.
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.class_token else None
        grid = config.img_size // config.patch_size
        if config.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, config.num_tokens, dim))
        else:
            self.register_buffer("pos_embed", sincos_pos_embed(grid, dim, config.class_token))
        self.pos_drop = nn.Dropout(config.pos_drop_rate)
        if config.rope:  # not saved: computed from the config, as timm's non-persistent buffers
            ref = None if config.rope_ref_grid is None else (config.rope_ref_grid,) * 2
            cos, sin = axial_rope_tables((grid, grid), dim // config.num_heads, ref_grid=ref)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.blocks = nn.ModuleList(
            block_layer(
                dim,
                config.num_heads,
                mlp_hidden_dim=config.mlp_hidden_features,
                qkv_bias=config.qkv_bias,
                act=config.act,
                norm_first=config.norm_first,
                eps=config.norm_eps,
                drop=config.drop_rate,
                attn_drop=config.attn_drop_rate,
                drop_path=rate,
                **({"init_values": config.init_values} if config.init_values is not None else {}),
                **(
                    {"mlp_type": config.mlp_type, "mlp_norm": config.mlp_norm}
                    if config.mlp_type != "mlp"
                    else {}
                ),
            )
            for rate in config.drop_path_rates()
        )
        self.norm = norm_layer(dim, eps=config.norm_eps) if config.final_norm else nn.Identity()
        self.attn_pool = None
        if config.global_pool == "map":
            self.attn_pool = AttentionPool(
                dim, config.num_heads, config.mlp_hidden_features, config.act, config.norm_eps
            )
        self.fc_norm = norm_layer(dim, eps=config.norm_eps) if config.fc_norm else nn.Identity()
        self.head = self._new_head(config.num_classes)
        self.grad_checkpointing = False
        self.reset_parameters()

    def _new_head(self, num_classes: int, **factory: object) -> nn.Module:
        """Linear(embed_dim, num_classes), or Identity for 0 classes (forward returns the pooled features)."""
        return nn.Linear(self.config.embed_dim, num_classes, **factory) if num_classes > 0 else nn.Identity()

    def _init_linear(self, module: nn.Linear) -> None:
        if self.config.init_std is not None:
            nn.init.trunc_normal_(module.weight, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def reset_parameters(self) -> None:
        """timm's ViT initialisation: truncated normal (std 0.02) for the learned position embedding
        and, unless ``init_std`` is None, linear layers (biases zero); a tiny normal for the class token."""
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                self._init_linear(module)
            elif isinstance(module, LayerScale):
                module.reset_parameters()
        if self.attn_pool is not None:
            self.attn_pool.reset_parameters()
        patch_weight = self.patch_embed.proj.weight
        nn.init.trunc_normal_(patch_weight, std=math.sqrt(1.0 / patch_weight[0].numel()))

    def forward_features(
        self, images: torch.Tensor, return_attention: bool = False
    ) -> Union[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]]]:
        """images (N, C, H, W) -> tokens (N, T, D) [, per-block attention (N, H, T, T)]."""
        x = self.pos_drop(self.patch_embed(images, cls_token=self.cls_token, pos_embed=self.pos_embed))
        maps = []
        extra = {"rope": (self.rope_cos, self.rope_sin)} if self.config.rope else {}
        for block in self.blocks:
            if return_attention:
                x, probs = self._run_block(block, x, return_probs=True, **extra)
                maps.append(probs)
            else:
                x = self._run_block(block, x, **extra)
        x = self.norm(x)
        return (x, maps) if return_attention else x

    def _run_block(
        self, block: nn.Module, x: torch.Tensor, **kwargs: object
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """block(x), recomputed in backward instead of keeping its activations when gradient
        checkpointing is on (training with grad enabled). Non-reentrant checkpointing restores the RNG
        state for the recomputation, so dropout and drop path masks, and the gradients, are the same."""
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False, **kwargs)
        return block(x, **kwargs)

    def forward_head(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N, T, D) -> logits (N, num_classes)."""
        prefix = int(self.config.class_token)
        if self.attn_pool is not None:
            pooled = self.attn_pool(tokens)
        elif self.config.global_pool == "token":
            pooled = tokens[:, 0]
        else:
            pooled = tokens[:, prefix:].mean(dim=1)
        return self.head(self.fc_norm(pooled))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))

    def attention_maps(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The attention probabilities of every block, each (N, heads, T, T)."""
        return self.forward_features(images, return_attention=True)[1]

    def get_classifier(self) -> nn.Module:
        """The head: Linear(embed_dim, num_classes), or Identity when num_classes is 0."""
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the head with a freshly initialised one for ``num_classes`` (0: no head, forward
        returns the pooled features (N, embed_dim)), on the model's device and dtype;
        ``global_pool`` ("token" | "avg"), when given, changes the pooling; attention pooling ("map")
        has weights of its own, so it is chosen when the model is created, not here. ``config`` follows."""
        changes: dict[str, object] = {"num_classes": num_classes}
        if global_pool is not None:
            if "map" in (global_pool, self.config.global_pool) and global_pool != self.config.global_pool:
                raise ValueError(
                    f"global_pool cannot change from {self.config.global_pool!r} to {global_pool!r}: attention "
                    "pooling ('map') has weights of its own; create the model with the pooling it needs"
                )
            changes["global_pool"] = global_pool
        self.config = dataclasses.replace(self.config, **changes)  # validates both
        reference = self.patch_embed.proj.weight
        self.head = self._new_head(num_classes, device=reference.device, dtype=reference.dtype)
        if isinstance(self.head, nn.Linear):
            self._init_linear(self.head)
        self.head.train(self.training)

    def no_weight_decay(self) -> set[str]:
        """Parameter names to exempt from weight decay, as timm's ViT (which also lists reg_token and
        dist_token, tokens this model does not have)."""
        return {"pos_embed", "cls_token"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations (training only)."""
        self.grad_checkpointing = bool(enable)


def _timm(embed_dim: int, depth: int, num_heads: int) -> ViTConfig:
    return ViTConfig(embed_dim=embed_dim, depth=depth, num_heads=num_heads)


def _eva02(embed_dim: int, num_heads: int, mlp_norm: bool) -> ViTConfig:
    return ViTConfig(
        patch_size=14,
        embed_dim=embed_dim,
        depth=12,
        num_heads=num_heads,
        mlp_hidden_dim=int(embed_dim * 4 * 2 / 3),
        mlp_type="swiglu",
        mlp_norm=mlp_norm,
        rope=True,
        rope_ref_grid=16,
        global_pool="avg",
        fc_norm=True,
        final_norm=False,
    )


PRESETS: dict[str, ViTConfig] = {
    "vit_tiny_patch16_224": _timm(192, 12, 3),
    "vit_small_patch16_224": _timm(384, 12, 6),
    "vit_base_patch16_224": _timm(768, 12, 12),
    "vit_large_patch16_224": _timm(1024, 24, 16),
    # SigLIP image towers as timm builds them: no class token, attention pooling (MAP), exact GELU
    "vit_base_patch16_siglip_224": ViTConfig(
        embed_dim=768, depth=12, num_heads=12, class_token=False, global_pool="map"
    ),
    "vit_so400m_patch14_siglip_224": ViTConfig(
        patch_size=14,
        embed_dim=1152,
        depth=27,
        num_heads=16,
        mlp_hidden_dim=4304,
        class_token=False,
        global_pool="map",
    ),
    # EVA02 as timm builds it: SwiGLU MLP (hidden int(D * 8/3)), 2-D RoPE of the patch tokens in every
    # block's attention (positions on the 16 x 16 grid of pretraining), mean of the patch tokens -> fc_norm
    "eva02_tiny_patch14_224": _eva02(192, 3, mlp_norm=False),
    "eva02_small_patch14_224": _eva02(384, 6, mlp_norm=False),
    "eva02_base_patch14_224": _eva02(768, 12, mlp_norm=True),
    # Post-norm blocks computed exactly as nn.TransformerEncoderLayer(norm_first=False, activation="relu").
    "vit_mnist_postnorm": ViTConfig(
        img_size=28,
        patch_size=7,
        in_chans=1,
        num_classes=10,
        embed_dim=64,
        depth=3,
        num_heads=8,
        mlp_hidden_dim=2048,
        act="relu",
        norm_first=False,
        norm_eps=1e-5,
        final_norm=False,
        drop_rate=0.1,
        attn_drop_rate=0.1,
    ),
    "vit_cifar10_small": ViTConfig(
        img_size=32,
        patch_size=4,
        in_chans=3,
        num_classes=10,
        embed_dim=48,
        depth=4,
        num_heads=4,
        mlp_hidden_dim=192,
        act="gelu_tanh",
        norm_eps=1e-5,
        final_norm=False,
    ),
    "vit_mnist_sincos": ViTConfig(
        img_size=28,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        embed_dim=8,
        depth=2,
        num_heads=2,
        mlp_ratio=4.0,
        pos_embed="sincos",
        norm_eps=1e-5,
    ),
    # 8x8 digits in 4x4 patches: 4 patches + class token = 5 tokens. Smaller patches leave a model
    # this size too little data to learn where each patch sits.
    "vit_digits": ViTConfig(
        img_size=8,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        embed_dim=64,
        depth=3,
        num_heads=4,
        mlp_ratio=2.0,
        norm_eps=1e-5,
        init_std=None,
    ),
}


def list_models() -> list[str]:
    """The preset names, sorted."""
    return sorted(PRESETS)


def get_config(name: str, **overrides: object) -> ViTConfig:
    """The preset ``name`` with ``overrides`` (ViTConfig fields) applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(list_models())}")
    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ViTConfig field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(PRESETS[name], **overrides)


def create_model(name: str, checkpoint_path: Union[str, Path, None] = None, **overrides: object) -> ViT:
    """A ViT of preset ``name`` with ``overrides``, e.g. ``create_model("vit_base_patch16_224", num_classes=3)``:
    freshly initialised, or with the weights of ``checkpoint_path`` (a timm, Hugging Face or
    torchvision ``.safetensors`` file; see ``vit.weights.load_pretrained``)."""
    model = ViT(get_config(name, **overrides))
    if checkpoint_path is not None:
        load_pretrained(model, checkpoint_path)
    return model
