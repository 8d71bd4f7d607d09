"""timm's ViT layers on the fused ops (timm need not be installed: classes are named, not imported).

* ``timm.layers.attention.Attention``  -> ``vit_kernels.nn.Attention`` (same ``qkv``/``proj``)
  when it has no q/k norm, no scale norm, no gate, and attn_dim equals the input width;
* ``timm.layers.mlp.Mlp``              -> ``vit_kernels.nn.Mlp`` (same ``fc1``/``fc2``)
  for GELU, GELU(tanh), QuickGELU or ReLU, no hidden norm, one dropout rate, Linear projections;
* ``timm.models.eva.EvaAttention`` (EVA02, the ``vit_*_rope_*`` ViTs, DINOv3) and
  ``timm.layers.attention.AttentionRope`` (Perception Encoder, the mixed-RoPE ViTs) keep their class,
  parameters and methods and compute ``forward`` with the fused attention, rotary embedding inside the
  kernel (``rope_attention_forward``), masked too (NaFlex's padding), when q and k are not normalized
  and every head has its own k and v (no grouped-query attention); a causal call, or a mask or rope
  table of a shape timm itself would not apply, runs timm's own forward;
* ``timm.layers.mlp.SwiGLU`` and ``GluMlp`` with SiLU (EVA02's SwiGLU, packed or not) keep their class
  and parameters and compute ``forward`` with ``vk.swiglu_mlp`` (or ``vk.swiglu``, their hidden norm
  and ``vk.linear`` where a norm or dropout sits between), for Linear projections;
* ``timm.layers.patch_embed.PatchEmbed`` keeps its class's methods (``set_input_size``,
  ``dynamic_feat_size``, ...) and computes ``forward`` with the fused patch embedding, for square
  patches, stride == kernel, no padding, no token norm, tokens (NLC) or an NHWC grid (dynamic size);
* ``timm.layers.norm.LayerNorm``        -> ``vit_kernels.nn.LayerNorm`` unless timm's fast norm is on;
* ``timm.models.vision_transformer.Block`` keeps its class and children and computes ``forward`` with
  each residual add, and its LayerScale (``ls1``, ``ls2``: DINOv2, CaiT-style ViTs), in the last GEMM
  of the branch, where the branch's layer was swapped for ours and no drop path is dropping;
  ``timm.models.eva.EvaBlock`` likewise, with its ``gamma_1`` / ``gamma_2``.
"""

from __future__ import annotations

import torch
from torch import nn

import vit_kernels.functional as vkf
from vit_kernels import nn as vkn
from vit_kernels.integrations._common import (
    Rule,
    Swap,
    activation_name,
    describe_activation,
    dropout_p,
    fusable_mask,
    is_identity,
    is_silu,
    mlp_activation_problem,
    patch_projection_problem,
    project,
    qualified_name,
    unfused_forward,
    unknown_forward_args,
    unknown_parts,
    with_fused_forward,
)
from vit_kernels.integrations._common import swiglu_forward as fused_swiglu
from vit_kernels.integrations.torch_nn import swap_layer_norm

ATTENTION_CHILDREN = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj", "proj_drop")
ROPE_ATTENTION_CHILDREN = ATTENTION_CHILDREN + ("q_proj", "k_proj", "v_proj")
ROPE_ATTENTION_TENSORS = ("q_bias", "k_bias", "v_bias")
MLP_CHILDREN = ("fc1", "act", "drop1", "norm", "fc2", "drop2")
BLOCK_CHILDREN = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
PATCH_EMBED_CHILDREN = ("proj", "norm")


def swap_attention(module: nn.Module) -> Swap:
    why = unknown_parts(module, ATTENTION_CHILDREN) or unknown_forward_args(
        module, ("x", "attn_mask", "is_causal")
    )
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
        return Swap.skip(
            f"attention width {module.num_heads}x{module.head_dim} differs from the input width {dim}"
        )
    if abs(module.scale - module.head_dim**-0.5) > 1e-12:
        return Swap.skip(f"uses a non-default scale {module.scale}")
    attn_drop, proj_drop = dropout_p(module.attn_drop), dropout_p(module.proj_drop)
    if attn_drop is None or proj_drop is None:
        return Swap.skip("attn_drop/proj_drop are not nn.Dropout")
    new = vkn.Attention(dim, module.num_heads, attn_drop=attn_drop, proj_drop=proj_drop)
    new.qkv, new.proj = module.qkv, module.proj
    return Swap(new)


def swap_mlp(module: nn.Module) -> Swap:
    why = (
        unknown_parts(module, MLP_CHILDREN)
        or unknown_forward_args(module, ("x",))
        or mlp_activation_problem(module.act)
    )
    if why:
        return Swap.skip(why)
    if not is_identity(module.norm):
        return Swap.skip("normalizes inside the MLP")
    if type(module.fc1) is not nn.Linear or type(module.fc2) is not nn.Linear:
        return Swap.skip("fc1/fc2 are not nn.Linear (use_conv)")
    drop1, drop2 = dropout_p(module.drop1), dropout_p(module.drop2)
    if drop1 is None or drop2 is None or drop1 != drop2:
        return Swap.skip(f"uses two different dropout rates ({drop1}, {drop2})")
    act = activation_name(module.act)
    new = vkn.Mlp(
        module.fc1.in_features, module.fc1.out_features, module.fc2.out_features, act=act, drop=drop1
    )
    new.fc1, new.fc2 = module.fc1, module.fc2
    return Swap(new)


def _packed_qkv(self, x: torch.Tensor) -> torch.Tensor:
    """x (B, L, D) -> qkv (B, L, 3*D') as the module projects it: one ``qkv`` Linear (EVA's bias
    being q_bias | k_bias | v_bias), or ``q_proj``/``k_proj``/``v_proj`` as one GEMM over their
    concatenated weights."""
    if self.qkv is not None:
        bias = getattr(self, "q_bias", None)
        if bias is None:
            return vkf.linear(x, self.qkv.weight, self.qkv.bias)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if getattr(self, "qkv_bias_separate", False):
            return vkf.linear(x, self.qkv.weight) + bias
        return vkf.linear(x, self.qkv.weight, bias)
    projections = (self.q_proj, self.k_proj, self.v_proj)
    weight = torch.cat([p.weight for p in projections])
    if all(p.bias is None for p in projections):
        return vkf.linear(x, weight)
    bias = torch.cat(
        [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections]
    )
    return vkf.linear(x, weight, bias)


def _rope_tables(self, rope: torch.Tensor, x: torch.Tensor):
    """timm's rope tensor (..., L_r, 2 * Dh), sin | cos, -> (cos, sin) as ``vk.attention`` takes
    them, or None where timm's own forward must run: a table that does not broadcast against
    (B, H, L_r, Dh), or one for more tokens than follow the prefix."""
    batch, length = x.shape[0], x.shape[1]
    rows = length - self.num_prefix_tokens
    if rope.dim() < 2 or rope.dim() > 4 or rope.shape[-1] != 2 * self.head_dim or rope.shape[-2] != rows:
        return None
    leading = (1,) * (4 - rope.dim()) + tuple(rope.shape[:-2])
    if leading[0] not in (1, batch) or leading[1] not in (1, self.num_heads):
        return None
    sin, cos = rope.chunk(2, -1)
    return cos, sin


def rope_attention_forward(
    self, x, rope=None, attn_mask=None, is_causal=False, residual=None, layer_scale=None
):
    """timm's EvaAttention / AttentionRope forward, x (B, L, D) -> (B, L, D_out): the packed q, k, v
    projection, then the fused attention rotating q and k of the tokens after the prefix as its
    kernels load them, masked by ``attn_mask`` (SDPA's); the output norm, gate and projection as timm
    computes them. With ``residual`` (B, L, D_out) [and ``layer_scale`` gamma (D_out,)], a block's
    ``residual + gamma * attention``, the add and the scale in the projection's GEMM."""
    tables = None if rope is None else _rope_tables(self, rope, x)
    fusable = fusable_mask(attn_mask, x.device, x.shape[0], self.num_heads, x.shape[1])
    if is_causal or (rope is not None and tables is None) or not fusable:
        out = unfused_forward(self, x, rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        out = out if layer_scale is None else layer_scale * out
        return out if residual is None else residual + out
    gate = self.gate(x).sigmoid() if self.gate is not None else None
    out = vkf.attention(
        _packed_qkv(self, x),
        self.num_heads,
        dropout_p=dropout_p(self.attn_drop) if self.training else 0.0,
        rope=tables,
        rope_layout="half" if getattr(self, "rotate_half", False) else "interleaved",
        attn_mask=attn_mask,
    )
    out = self.norm(out)
    if gate is not None:
        out = out * gate
    if residual is None and layer_scale is None:
        return self.proj_drop(self.proj(out))
    return project(self.proj, self.proj_drop, out, residual, layer_scale)


def swap_rope_attention(module: nn.Module) -> Swap:
    why = unknown_parts(module, ROPE_ATTENTION_CHILDREN, ROPE_ATTENTION_TENSORS) or unknown_forward_args(
        module, ("x", "rope", "attn_mask", "is_causal")
    )
    if why:
        return Swap.skip(why)
    if not (is_identity(module.q_norm) and is_identity(module.k_norm)):
        return Swap.skip("normalizes q and k (qk_norm)")
    if getattr(module, "num_kv_groups", 1) != 1:
        return Swap.skip(f"shares k and v between {module.num_kv_groups} heads (grouped-query attention)")
    projections = [module.qkv] if module.qkv is not None else [module.q_proj, module.k_proj, module.v_proj]
    if not all(type(p) is nn.Linear for p in projections + [module.proj]):
        return Swap.skip("the q/k/v or output projections are not nn.Linear")
    width = module.num_heads * module.head_dim
    if sum(p.out_features for p in projections) != 3 * width:
        return Swap.skip("q, k and v differ in width")
    if abs(module.scale - module.head_dim**-0.5) > 1e-12:
        return Swap.skip(f"uses a non-default scale {module.scale}")
    if dropout_p(module.attn_drop) is None or dropout_p(module.proj_drop) is None:
        return Swap.skip("attn_drop/proj_drop are not nn.Dropout")
    return Swap(with_fused_forward(module, rope_attention_forward), descend=True)


def swiglu_forward(self, x, residual=None, layer_scale=None):
    """timm's SwiGLU, x (..., D) -> (..., D_out): gate fc1_g, up fc1_x; ``residual`` [``layer_scale``]:
    residual + gamma * that, in fc2's GEMM (EvaBlock's add)."""
    gate, up = (self.fc1_g.weight, self.fc1_g.bias), (self.fc1_x.weight, self.fc1_x.bias)
    return fused_swiglu(self, x, gate, up, self.norm, self.drop1, self.fc2, self.drop2, residual, layer_scale)


def glu_mlp_forward(self, x, residual=None, layer_scale=None):
    """timm's GluMlp with SiLU, x (..., D) -> (..., D_out): fc1's two halves are the gate and the up
    projection (the gate second when ``gate_last``), read as views; ``residual`` as ``swiglu_forward``."""
    half = self.fc1.out_features // 2
    weight, bias = self.fc1.weight, self.fc1.bias
    first = (weight[:half], None if bias is None else bias[:half])
    second = (weight[half:], None if bias is None else bias[half:])
    gate, up = (second, first) if self.gate_last else (first, second)
    return fused_swiglu(self, x, gate, up, self.norm, self.drop1, self.fc2, self.drop2, residual, layer_scale)


def _swap_gated_mlp(module: nn.Module, projections: tuple[str, ...], forward) -> Swap:
    why = unknown_parts(
        module, projections + ("act", "drop1", "norm", "fc2", "drop2")
    ) or unknown_forward_args(module, ("x",))
    if why:
        return Swap.skip(why)
    if not is_silu(module.act):
        return Swap.skip(f"gates with {describe_activation(module.act)}, not SiLU")
    if not all(type(getattr(module, name)) is nn.Linear for name in projections + ("fc2",)):
        return Swap.skip("its projections are not nn.Linear (use_conv)")
    return Swap(with_fused_forward(module, forward), descend=True)


def swap_swiglu(module: nn.Module) -> Swap:
    return _swap_gated_mlp(module, ("fc1_g", "fc1_x"), swiglu_forward)


def swap_glu_mlp(module: nn.Module) -> Swap:
    return _swap_gated_mlp(module, ("fc1",), glu_mlp_forward)


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
    why = (
        unknown_parts(module, PATCH_EMBED_CHILDREN)
        or unknown_forward_args(module, ("x",))
        or patch_projection_problem(module.proj, unpadded=((0, 0), "valid"))
    )
    if why:
        return Swap.skip(why)
    if getattr(module, "dynamic_img_pad", False):
        return Swap.skip("pads images to a multiple of the patch size (dynamic_img_pad)")
    if not is_identity(module.norm):
        return Swap.skip("normalizes the tokens")
    if not module.flatten and str(getattr(module.output_fmt, "value", module.output_fmt)) != "NHWC":
        return Swap.skip(
            f"outputs the {module.output_fmt} format (only NLC tokens and the NHWC grid are fused)"
        )
    return Swap(with_fused_forward(module, patch_embed_forward), descend=False)


def swap_timm_layer_norm(module: nn.Module) -> Swap:
    if getattr(module, "_fast_norm", False):
        return Swap.skip("uses timm's fast (low-precision) norm")
    return swap_layer_norm(module)


def _layer_scale(module: nn.Module):
    """timm's LayerScale's gamma (D,), None for Identity; False for anything else (not folded)."""
    if is_identity(module):
        return None
    if qualified_name(type(module)) == "timm.layers.layer_scale.LayerScale" and not module.inplace:
        return module.gamma
    return False


def _drops(module: nn.Module) -> bool:
    """Whether a block's drop path (Identity, or timm's DropPath) drops now: in training, p > 0."""
    return not is_identity(module) and module.training and float(getattr(module, "drop_prob", 1.0)) > 0


def block_forward(self, x, attn_mask=None, is_causal=False):
    """timm's ViT block, x (B, L, D) -> (B, L, D): x + drop_path(ls(branch(norm(x)))) for attention,
    then the MLP, each residual add and LayerScale in the branch's last GEMM (``residual=``,
    ``layer_scale=``) where the branch runs our layer and its drop path is not dropping; otherwise
    that branch as timm computes it."""
    gamma = _layer_scale(self.ls1)
    if isinstance(self.attn, vkn.Attention) and gamma is not False and not _drops(self.drop_path1):
        x = self.attn(self.norm1(x), residual=x, attn_mask=attn_mask, is_causal=is_causal, layer_scale=gamma)
    else:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
    gamma = _layer_scale(self.ls2)
    if isinstance(self.mlp, vkn.Mlp) and gamma is not False and not _drops(self.drop_path2):
        return self.mlp(self.norm2(x), residual=x, layer_scale=gamma)
    return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def swap_block(module: nn.Module) -> Swap:
    why = unknown_parts(module, BLOCK_CHILDREN) or unknown_forward_args(
        module, ("x", "attn_mask", "is_causal")
    )
    if why:
        return Swap.skip(why)
    if _layer_scale(module.ls1) is False or _layer_scale(module.ls2) is False:
        return Swap.skip("its layer scale is not timm's LayerScale (or scales in place)")
    return Swap(with_fused_forward(module, block_forward), descend=True)


EVA_BLOCK_CHILDREN = ("norm1", "attn", "drop_path1", "norm2", "mlp", "drop_path2")
EVA_BLOCK_TENSORS = ("gamma_1", "gamma_2")
_RESIDUAL_MLP_FORWARDS = (swiglu_forward, glu_mlp_forward)


def eva_block_forward(self, x, rope=None, attn_mask=None, is_causal=False):
    """timm's EvaBlock (EVA02, the RoPE ViTs, DINOv3), x (B, L, D) -> (B, L, D):
    x + drop_path(gamma * branch(norm(x))) for attention, then the MLP, each residual add and gamma
    in the branch's last GEMM where the branch runs fused and its drop path is not dropping;
    otherwise that branch as timm computes it."""
    if type(self.attn).forward is rope_attention_forward and not _drops(self.drop_path1):
        x = self.attn(
            self.norm1(x),
            rope=rope,
            attn_mask=attn_mask,
            is_causal=is_causal,
            residual=x,
            layer_scale=self.gamma_1,
        )
    else:
        x_attn = self.attn(self.norm1(x), rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(x_attn if self.gamma_1 is None else self.gamma_1 * x_attn)
    fused_mlp = isinstance(self.mlp, vkn.Mlp) or type(self.mlp).forward in _RESIDUAL_MLP_FORWARDS
    if fused_mlp and not _drops(self.drop_path2):
        return self.mlp(self.norm2(x), residual=x, layer_scale=self.gamma_2)
    x_mlp = self.mlp(self.norm2(x))
    return x + self.drop_path2(x_mlp if self.gamma_2 is None else self.gamma_2 * x_mlp)


def swap_eva_block(module: nn.Module) -> Swap:
    why = unknown_parts(module, EVA_BLOCK_CHILDREN, EVA_BLOCK_TENSORS) or unknown_forward_args(
        module, ("x", "rope", "attn_mask", "is_causal")
    )
    if why:
        return Swap.skip(why)
    return Swap(with_fused_forward(module, eva_block_forward), descend=True)


RULES: dict[str, Rule] = {
    "timm.models.vision_transformer.Block": swap_block,
    "timm.models.eva.EvaBlock": swap_eva_block,
    "timm.layers.attention.Attention": swap_attention,
    "timm.models.eva.EvaAttention": swap_rope_attention,
    "timm.layers.attention.AttentionRope": swap_rope_attention,
    "timm.layers.mlp.Mlp": swap_mlp,
    "timm.layers.mlp.SwiGLU": swap_swiglu,
    "timm.layers.mlp.GluMlp": swap_glu_mlp,
    "timm.layers.patch_embed.PatchEmbed": swap_patch_embed,
    "timm.layers.norm.LayerNorm": swap_timm_layer_norm,
}
