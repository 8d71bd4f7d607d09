"""Plain PyTorch layers on the fused ops.

* ``nn.LayerNorm`` over one dimension    -> ``vit_kernels.nn.LayerNorm`` (same weight and bias);
* ``nn.MultiheadAttention``              keeps its class's attributes and parameters
  (``in_proj_weight``, ``out_proj``) and computes self-attention (query is key is value, packed
  in-projection, no bias_k/bias_v/zero-attention) with the fused ops;
* ``nn.TransformerEncoderLayer``         keeps its children and computes ``forward`` (pre- or
  post-norm, batch_first or not, ReLU or GELU, every dropout) with the fused ops, each residual add
  fused into the last GEMM of its branch.

A call the fused ops cannot compute exactly (a mask, causal attention, cross-attention) runs the
layer's own PyTorch forward: a patched model never raises where the original would not.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vit_kernels import nn as vkn
from vit_kernels.activations import GELU, RELU
from vit_kernels.integrations._common import (
    Rule,
    Swap,
    activation_name,
    describe_activation,
    unfused_forward,
    unknown_forward_args,
    unknown_parts,
    with_fused_forward,
)

MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)
ENCODER_LAYER_ARGS = ("src", "src_mask", "src_key_padding_mask", "is_causal")
ENCODER_LAYER_CHILDREN = (
    "self_attn",
    "linear1",
    "dropout",
    "linear2",
    "norm1",
    "norm2",
    "dropout1",
    "dropout2",
    "activation",
)


def swap_layer_norm(module: nn.Module) -> Swap:
    if len(module.normalized_shape) != 1:
        return Swap.skip("normalizes over more than the last dimension")
    new = vkn.LayerNorm(module.normalized_shape[0], eps=module.eps, elementwise_affine=False, bias=False)
    new.weight, new.bias = module.weight, module.bias
    return Swap(new)


def _to_batch_first(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(B, L, D) from (B, L, D) / (L, B, D) / unbatched (L, D)."""
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x if batch_first else x.transpose(0, 1)


def _from_batch_first(x: torch.Tensor, like: torch.Tensor, batch_first: bool) -> torch.Tensor:
    if like.dim() == 2:
        return x.squeeze(0)
    return x if batch_first else x.transpose(0, 1)


def _mha_self_attention(
    self, x: torch.Tensor, *, residual=None, proj_drop: float = 0.0, return_probs: bool = False
):
    """x (B, L, D) -> (B, L, D) [+ residual] [, probs (B, H, L, L)]: the module's packed in-projection,
    attention (its dropout on the probabilities) and out-projection."""
    return vkn.self_attention(
        x,
        self.in_proj_weight,
        self.in_proj_bias,
        self.out_proj.weight,
        self.out_proj.bias,
        self.num_heads,
        attn_drop=self.dropout,
        proj_drop=proj_drop,
        training=self.training,
        residual=residual,
        return_probs=return_probs,
    )


def mha_forward(
    self,
    query,
    key,
    value,
    key_padding_mask=None,
    need_weights=True,
    attn_mask=None,
    average_attn_weights=True,
    is_causal=False,
):
    """Self-attention as ``nn.MultiheadAttention.forward``: (L, B, D) or batch_first (B, L, D) or
    unbatched (L, D) -> (output, weights or None); weights (B, L, L) averaged over heads, or (B, H, L, L)."""
    if (
        key is not query
        or value is not query
        or key_padding_mask is not None
        or attn_mask is not None
        or is_causal
        or query.is_nested
    ):
        return unfused_forward(
            self,
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    x = _to_batch_first(query, self.batch_first)
    result = _mha_self_attention(self, x, return_probs=need_weights)
    out, probs = result if need_weights else (result, None)
    if probs is not None:
        probs = probs.mean(dim=1) if average_attn_weights else probs
        probs = probs.squeeze(0) if query.dim() == 2 else probs
    return _from_batch_first(out, query, self.batch_first), probs


def _mha_problem(module: nn.Module) -> Optional[str]:
    """Why ``module`` (an nn.MultiheadAttention) cannot run on the fused ops, or None."""
    why = unknown_forward_args(module, MHA_ARGS)
    if why:
        return why
    if not module._qkv_same_embed_dim or module.in_proj_weight is None:
        return "projects q, k and v separately (kdim/vdim differ from embed_dim)"
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return "uses bias_k/bias_v or add_zero_attn"
    if type(module.out_proj) not in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "out_proj is not a Linear"
    return None


def swap_multihead_attention(module: nn.Module) -> Swap:
    why = _mha_problem(module)
    return Swap.skip(why) if why else Swap(with_fused_forward(module, mha_forward), descend=False)


def encoder_layer_forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
    """``nn.TransformerEncoderLayer.forward`` on the fused ops: src (L, B, D), batch_first (B, L, D)
    or unbatched (L, D) -> same shape."""
    if src_mask is not None or src_key_padding_mask is not None or is_causal or src.is_nested:
        return unfused_forward(
            self, src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal
        )
    batch_first = self.self_attn.batch_first
    x = _to_batch_first(src, batch_first)
    act = activation_name(self.activation)
    drop = {"hidden_drop": self.dropout.p, "out_drop": self.dropout2.p, "training": self.training}
    if self.norm_first:
        x = _mha_self_attention(self.self_attn, self.norm1(x), residual=x, proj_drop=self.dropout1.p)
        x = vkn.feed_forward(self.norm2(x), self.linear1, self.linear2, act, residual=x, **drop)
    else:
        x = self.norm1(_mha_self_attention(self.self_attn, x, residual=x, proj_drop=self.dropout1.p))
        x = self.norm2(vkn.feed_forward(x, self.linear1, self.linear2, act, residual=x, **drop))
    return _from_batch_first(x, src, batch_first)


def swap_encoder_layer(module: nn.Module) -> Swap:
    why = unknown_parts(module, ENCODER_LAYER_CHILDREN) or unknown_forward_args(module, ENCODER_LAYER_ARGS)
    if why:
        return Swap.skip(why)
    if activation_name(module.activation) not in (RELU, GELU):
        return Swap.skip(f"activation {describe_activation(module.activation)} is not ReLU or GELU")
    attention_problem = (
        _mha_problem(module.self_attn) if type(module.self_attn) is nn.MultiheadAttention else None
    )
    if attention_problem:
        return Swap.skip(f"self_attn {attention_problem}")
    if any(type(getattr(module, n)) is not nn.Dropout for n in ("dropout", "dropout1", "dropout2")):
        return Swap.skip("dropout layers are not nn.Dropout")
    if any(type(getattr(module, n)) is not nn.Linear for n in ("linear1", "linear2")):
        return Swap.skip("linear1/linear2 are not nn.Linear")
    # Its norms and self_attn are swapped as the walk descends into it.
    return Swap(with_fused_forward(module, encoder_layer_forward), descend=True)


RULES: dict[str, Rule] = {
    "torch.nn.modules.normalization.LayerNorm": swap_layer_norm,
    "torch.nn.modules.activation.MultiheadAttention": swap_multihead_attention,
    "torch.nn.modules.transformer.TransformerEncoderLayer": swap_encoder_layer,
}
