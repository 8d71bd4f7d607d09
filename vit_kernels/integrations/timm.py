"""timm's ViT layers on the fused ops (timm need not be installed: classes are named, not imported).

* ``timm.layers.attention.Attention``  -> ``vit_kernels.nn.Attention`` (same ``qkv``/``proj``)
  when it has no q/k norm, no scale norm, no gate, and attn_dim equals the input width;
* ``timm.layers.mlp.Mlp``              -> ``vit_kernels.nn.Mlp`` (same ``fc1``/``fc2``)
  for GELU, GELU(tanh), QuickGELU or ReLU, no hidden norm, one dropout rate, Linear projections;
* ``timm.layers.patch_embed.PatchEmbed`` keeps its class's methods (``set_input_size``,
  ``dynamic_feat_size``, ...) and computes ``forward`` with the fused patch embedding, for square
  patches, stride == kernel, no padding, no token norm, tokens (NLC) or an NHWC grid (dynamic size);
* ``timm.layers.norm.LayerNorm``        -> ``vit_kernels.nn.LayerNorm`` unless timm's fast norm is on.
"""

from __future__ import annotations

from torch import nn

import vit_kernels.functional as vkf
from vit_kernels import nn as vkn
from vit_kernels.integrations._common import (
    Rule,
    Swap,
    activation_name,
    describe_activation,
    dropout_p,
    is_identity,
    unfused_forward,
    unknown_forward_args,
    unknown_parts,
    with_fused_forward,
)
from vit_kernels.integrations.torch_nn import swap_layer_norm

ATTENTION_CHILDREN = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj", "proj_drop")
MLP_CHILDREN = ("fc1", "act", "drop1", "norm", "fc2", "drop2")
PATCH_EMBED_CHILDREN = ("proj", "norm")


def swap_attention(module: nn.Module) -> Swap:
    why = unknown_parts(module, ATTENTION_CHILDREN) or unknown_forward_args(module, ("x", "attn_mask", "is_causal"))
    if why:
        return Swap.skip(why)
    if not (is_identity(module.q_norm) and is_identity(module.k_norm)):
        return Swap.skip("normalizes q and k (qk_norm)")
    if not is_identity(module.norm):
        return Swap.skip("normalizes the attention output (scale_norm)")
    if getattr(module, "gate", None) is not None:
        return Swap.skip("gates the attention output (gated)")
    if not isinstance(module.qkv, nn.Linear) or not isinstance(module.proj, nn.Linear):
        return Swap.skip("qkv/proj are not nn.Linear")
    dim = module.qkv.in_features
    if module.num_heads * module.head_dim != dim or module.qkv.out_features != 3 * dim:
        return Swap.skip(f"attention width {module.num_heads}x{module.head_dim} differs from the input width {dim}")
    if abs(module.scale - module.head_dim ** -0.5) > 1e-12:
        return Swap.skip(f"uses a non-default scale {module.scale}")
    attn_drop, proj_drop = dropout_p(module.attn_drop), dropout_p(module.proj_drop)
    if attn_drop is None or proj_drop is None:
        return Swap.skip("attn_drop/proj_drop are not nn.Dropout")
    new = vkn.Attention(dim, module.num_heads, attn_drop=attn_drop, proj_drop=proj_drop)
    new.qkv, new.proj = module.qkv, module.proj
    return Swap(new)


def swap_mlp(module: nn.Module) -> Swap:
    why = unknown_parts(module, MLP_CHILDREN) or unknown_forward_args(module, ("x",))
    if why:
        return Swap.skip(why)
    act = activation_name(module.act)
    if act is None:
        return Swap.skip(f"activation {describe_activation(module.act)} is not one of GELU, GELU(tanh), QuickGELU, ReLU")
    if not is_identity(module.norm):
        return Swap.skip("normalizes inside the MLP")
    if type(module.fc1) is not nn.Linear or type(module.fc2) is not nn.Linear:
        return Swap.skip("fc1/fc2 are not nn.Linear (use_conv)")
    drop1, drop2 = dropout_p(module.drop1), dropout_p(module.drop2)
    if drop1 is None or drop2 is None or drop1 != drop2:
        return Swap.skip(f"uses two different dropout rates ({drop1}, {drop2})")
    new = vkn.Mlp(module.fc1.in_features, module.fc1.out_features, module.fc2.out_features, act=act, drop=drop1)
    new.fc1, new.fc2 = module.fc1, module.fc2
    return Swap(new)


def patch_embed_forward(self, x):
    """images (N, C, H, W) -> tokens (N, L, D), or the grid (N, H/P, W/P, D) when not flattening."""
    n, _, height, width = x.shape
    patch = self.proj.kernel_size[0]
    strict = self.img_size is not None and self.strict_img_size
    if (strict and (height, width) != tuple(self.img_size)) or height % patch or width % patch:
        return unfused_forward(self, x)  # timm's own checks and conv: its error, or the remainder dropped
    tokens = vkf.patch_embed(x, self.proj.weight, self.proj.bias, patch_size=patch)
    return tokens if self.flatten else tokens.reshape(n, height // patch, width // patch, tokens.shape[-1])


def swap_patch_embed(module: nn.Module) -> Swap:
    why = unknown_parts(module, PATCH_EMBED_CHILDREN) or unknown_forward_args(module, ("x",))
    if why:
        return Swap.skip(why)
    proj = module.proj
    if type(proj) is not nn.Conv2d or proj.kernel_size != proj.stride or proj.kernel_size[0] != proj.kernel_size[1]:
        return Swap.skip("projection is not a square Conv2d with stride == kernel")
    if proj.padding not in ((0, 0), "valid") or proj.dilation != (1, 1) or proj.groups != 1:
        return Swap.skip("projection uses padding, dilation or groups")
    if getattr(module, "dynamic_img_pad", False):
        return Swap.skip("pads images to a multiple of the patch size (dynamic_img_pad)")
    if not is_identity(module.norm):
        return Swap.skip("normalizes the tokens")
    if not module.flatten and str(getattr(module.output_fmt, "value", module.output_fmt)) != "NHWC":
        return Swap.skip(f"outputs the {module.output_fmt} format (only NLC tokens and the NHWC grid are fused)")
    return Swap(with_fused_forward(module, patch_embed_forward), descend=False)


def swap_timm_layer_norm(module: nn.Module) -> Swap:
    if getattr(module, "_fast_norm", False):
        return Swap.skip("uses timm's fast (low-precision) norm")
    return swap_layer_norm(module)


RULES: dict[str, Rule] = {
    "timm.layers.attention.Attention": swap_attention,
    "timm.layers.mlp.Mlp": swap_mlp,
    "timm.layers.patch_embed.PatchEmbed": swap_patch_embed,
    "timm.layers.norm.LayerNorm": swap_timm_layer_norm,
}
