"""Hugging Face vision transformers on the fused ops: ViT, CLIP's and SigLIP(2)'s vision towers,
DINOv2 (with registers).

Attention runs through transformers' own dispatch: ``register()`` adds ``"vit_kernels"`` to
``AttentionInterface``. ``patch_model`` registers it and switches a model whose attention runs
transformers' ``sdpa`` implementation (its default; the same mathematics) to it, by the config its
attention modules read; a model loaded with another implementation (eager, which returns attention
weights, flash, flex) keeps it, and the report says so. Self-attention runs fused, masked too (SigLIP2's
padding mask); a call the fused kernel does not compute (cross-attention, causal) runs transformers'
SDPA. ``patch_model`` swaps the rest:

* the MLPs (``fc1``, activation, ``fc2``) -> ``vit_kernels.nn.Mlp`` (same ``fc1``/``fc2``) for GELU,
  GELU(tanh), QuickGELU, ReLU;
* DINOv2's SwiGLU feed-forward (``use_swiglu_ffn``) keeps its class and computes ``forward`` with
  ``vk.swiglu_mlp``;
* ``ViTPatchEmbeddings``   keeps its class and computes ``forward`` with the fused patch embedding;
* ``nn.LayerNorm``         as for any PyTorch model.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import vit_kernels.functional as vkf
from vit_kernels import nn as vkn
from vit_kernels.integrations._common import (
    Rule,
    Swap,
    activation_name,
    describe_activation,
    fusable_mask,
    is_silu,
    mlp_activation_problem,
    patch_projection_problem,
    unfused_forward,
    unknown_forward_args,
    unknown_parts,
    with_fused_forward,
)
from vit_kernels.integrations._common import swiglu_forward as fused_swiglu

ATTN_IMPLEMENTATION = "vit_kernels"


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query/key/value (B, H, L, Dh) -> (out (B, L, H, Dh), None).

    Self-attention runs fused, with its mask (SDPA's form, as ``register`` has transformers build it:
    boolean or additive, broadcastable to (B, H, L, L)); causal attention, differing q/k/v shapes
    (cross-attention, grouped queries) or a mask of another shape run transformers' own SDPA
    attention, as an unpatched model would.
    """
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    batch, heads, length, head_dim = query.shape
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, :length]  # as transformers' SDPA attention slices it
    fusable = fusable_mask(attention_mask, query.device, batch, heads, length)
    if causal or key.shape != query.shape or value.shape != query.shape or not fusable:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    qkv = torch.cat(
        [t.transpose(1, 2).reshape(batch, length, heads * head_dim) for t in (query, key, value)], dim=-1
    )
    out = vkf.attention(qkv, heads, scale=scaling, dropout_p=dropout, attn_mask=attention_mask)
    return out.view(batch, length, heads, head_dim), None


def register() -> str:
    """Register ``attention_forward`` as ``attn_implementation="vit_kernels"``; returns that name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    try:  # masks in SDPA's form (what the fused attention, and SDPA, take), not dropped as an unknown kind's
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    except ImportError:  # pragma: no cover - transformers before masking_utils builds masks per model
        pass
    return ATTN_IMPLEMENTATION


# What transformers computes as the fused kernel does, weights not returned: its SDPA attention.
# ("eager" returns attention weights, which a user who chose it may be reading: left as it is.)
SWITCHABLE = ("sdpa",)


def attention_dispatch(module: nn.Module) -> Swap:
    """HF attention modules are not swapped: they call the configured attention function, which is
    switched to ours where the model runs transformers' SDPA attention."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation in SWITCHABLE:
        config._attn_implementation = register()  # the config every attention module of the tower reads
        implementation = ATTN_IMPLEMENTATION
    if implementation == ATTN_IMPLEMENTATION:
        return Swap(module, descend=False)
    return Swap(
        None,
        (
            f"runs transformers' {implementation!r} attention, chosen when the model was loaded; load it with "
            f"attn_implementation='sdpa' (the default) or '{ATTN_IMPLEMENTATION}' to have it fused"
        ),
        descend=False,
    )


def swap_mlp(module: nn.Module) -> Swap:
    """fc1 -> activation_fn -> fc2, as ViT's, CLIP's, SigLIP's and DINOv2's MLPs compute it."""
    why = (
        unknown_parts(module, ("fc1", "fc2", "activation_fn"))
        or unknown_forward_args(module, ("hidden_states",))
        or mlp_activation_problem(module.activation_fn)
    )
    if why:
        return Swap.skip(why)
    if type(module.fc1) is not nn.Linear or type(module.fc2) is not nn.Linear:
        return Swap.skip("fc1/fc2 are not nn.Linear")
    act = activation_name(module.activation_fn)
    new = vkn.Mlp(module.fc1.in_features, module.fc1.out_features, module.fc2.out_features, act=act)
    new.fc1, new.fc2 = module.fc1, module.fc2
    return Swap(new)


def swiglu_ffn_forward(self, x):
    """DINOv2's SwiGLU feed-forward, x (..., D) -> (..., D): down(silu(gate(x)) * up(x)), one fused call."""
    gate, up = (self.gate_proj.weight, self.gate_proj.bias), (self.up_proj.weight, self.up_proj.bias)
    return fused_swiglu(self, x, gate, up, None, None, self.down_proj, None)


def swap_swiglu_ffn(module: nn.Module) -> Swap:
    why = unknown_parts(module, ("gate_proj", "up_proj", "down_proj", "act_fn")) or unknown_forward_args(
        module, ("x",)
    )
    if why:
        return Swap.skip(why)
    if not is_silu(module.act_fn):
        return Swap.skip(f"gates with {describe_activation(module.act_fn)}, not SiLU")
    if not all(type(getattr(module, name)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj")):
        return Swap.skip("its projections are not nn.Linear")
    return Swap(with_fused_forward(module, swiglu_ffn_forward), descend=False)


def patch_embeddings_forward(self, pixel_values, *args, **kwargs):
    """pixel_values (N, C, H, W) -> tokens (N, L, D)."""
    patch = self.projection.kernel_size[0]
    if (
        args
        or kwargs
        or pixel_values.shape[1] != self.num_channels
        or pixel_values.shape[-1] % patch
        or pixel_values.shape[-2] % patch
    ):
        return unfused_forward(
            self, pixel_values, *args, **kwargs
        )  # its own checks, or the remainder dropped
    return vkf.patch_embed(
        pixel_values, self.projection.weight, self.projection.bias, patch_size=self.projection.kernel_size[0]
    )


def swap_patch_embeddings(module: nn.Module) -> Swap:
    why = (
        unknown_parts(module, ("projection",))
        or unknown_forward_args(module, ("pixel_values",))
        or patch_projection_problem(module.projection)
    )
    if why:
        return Swap.skip(why)
    return Swap(with_fused_forward(module, patch_embeddings_forward), descend=False)


_MODELS = "transformers.models"
# (module, class prefix) of the vision towers whose attention and MLP are named <prefix>Attention / <prefix>MLP
_TOWERS = (
    ("clip.modeling_clip", "CLIP"),
    ("siglip.modeling_siglip", "Siglip"),
    ("siglip2.modeling_siglip2", "Siglip2"),
    ("dinov2.modeling_dinov2", "Dinov2"),
    ("dinov2_with_registers.modeling_dinov2_with_registers", "Dinov2WithRegisters"),
)
RULES: dict[str, Rule] = {
    f"{_MODELS}.vit.modeling_vit.ViTAttention": attention_dispatch,
    f"{_MODELS}.vit.modeling_vit.ViTMLP": swap_mlp,
    f"{_MODELS}.vit.modeling_vit.ViTPatchEmbeddings": swap_patch_embeddings,
    **{
        f"{_MODELS}.{module}.{prefix}{layer}": rule
        for module, prefix in _TOWERS
        for layer, rule in (("Attention", attention_dispatch), ("MLP", swap_mlp))
    },
    f"{_MODELS}.dinov2.modeling_dinov2.Dinov2SwiGLUFFN": swap_swiglu_ffn,
    f"{_MODELS}.dinov2_with_registers.modeling_dinov2_with_registers.Dinov2WithRegistersSwiGLUFFN": swap_swiglu_ffn,
}
