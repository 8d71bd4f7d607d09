"""The public ops: ``backend.call`` validates the arguments (``_prepare_<op>``), picks the
implementation (the op's table in ``vit_kernels/ops/<op>.py``; see ``vk.explain()``) and runs it;
later calls of the same signature go straight to the implementation chosen.

Every op is differentiable on every backend. Shapes use D = H * Dh (model width = heads x head dim).

Dtypes: without autocast, all tensors of one op must share a dtype. Under ``torch.autocast`` the
GEMM operands are cast to the autocast dtype (as ``F.linear`` would be), epilogue tensors (residual,
class token, position embedding) keep theirs and the result takes the promoted dtype, and
``layer_norm`` computes in float32 (as autocast runs ``F.layer_norm``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from vit_kernels import backend
from vit_kernels._checks import (
    autocast_dtype_of,
    cast_all,
    check_choice,
    check_float_tensor,
    check_optional_positive_float,
    check_optional_shape,
    check_positive_int,
    check_probability,
    check_same_device,
    check_same_dtype,
    check_shape,
    one_device_and_dtype,
    shape_of,
)
from vit_kernels.activations import GELU_APPROXIMATIONS
from vit_kernels.ops import attention as _attention  # noqa: F401  (registers implementations)
from vit_kernels.ops import layer_norm as _layer_norm  # noqa: F401
from vit_kernels.ops import linear as _linear  # noqa: F401
from vit_kernels.ops import patch_embed as _patch_embed  # noqa: F401
from vit_kernels.ops import swiglu as _swiglu  # noqa: F401
from vit_kernels.ops.attention_reference import check_attention_mask
from vit_kernels.ops.rope import check_rope


def patch_embed(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    patch_size: int,
    cls_token: Optional[torch.Tensor] = None,
    pos_embed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Patchify + project (+ class token + position embedding).

    images (N, C, H, W), NCHW or channels_last; weight (D, C, P, P) as in ``nn.Conv2d``; bias (D,);
    cls_token (1, 1, D); pos_embed (1, T, D) with T = L + (cls_token is not None),
    L = (H / P) * (W / P). Returns (N, T, D).
    """
    return backend.call(
        "patch_embed", (images, weight, bias, patch_size, cls_token, pos_embed), _prepare_patch_embed
    )


def _prepare_patch_embed(images, weight, bias, patch_size, cls_token, pos_embed):
    check_float_tensor("images", images, ndim=4, layout="(N, C, H, W)")
    check_float_tensor("weight", weight, ndim=4, layout="(D, C, P, P)")
    patch_size = check_positive_int("patch_size", patch_size)
    n, channels, height, width = images.shape
    dim = weight.shape[0]
    check_shape("weight", weight, (dim, channels, patch_size, patch_size), "(D, C, P, P)")
    if height % patch_size or width % patch_size or height == 0 or width == 0:
        raise ValueError(
            f"images height and width must be positive multiples of patch_size={patch_size}, got {height}x{width}"
        )
    num_patches = (height // patch_size) * (width // patch_size)
    tokens = num_patches + (cls_token is not None)
    check_optional_shape("bias", bias, (dim,), "(D,)")
    check_optional_shape("cls_token", cls_token, (1, 1, dim), "(1, 1, D)")
    check_optional_shape("pos_embed", pos_embed, (1, tokens, dim), "(1, L + class token, D)")
    images, weight, bias = one_device_and_dtype(
        "images", images, dict(cls_token=cls_token, pos_embed=pos_embed), weight=weight, bias=bias
    )
    return (images, weight, bias, patch_size, cls_token, pos_embed)


def attention(
    qkv: torch.Tensor,
    num_heads: int,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_probs: bool = False,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    rope_layout: str = "interleaved",
    attn_mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention from packed projections.

    qkv (B, L, 3*D) as produced by one ``Linear(D, 3*D)``: [q | k | v], each split into
    ``num_heads`` heads of Dh = D / num_heads. ``scale`` defaults to Dh ** -0.5. ``dropout_p`` drops
    attention probabilities (pass 0 in eval mode). Returns out (B, L, D), and with
    ``return_probs`` also the softmax probabilities (B, H, L, L), taken before dropout.

    ``rope = (cos, sin)``: rotary position embedding of q and k (v is left as it is), each table
    broadcastable to (B, H, L_r, Dh) with L_r <= L (e.g. (L_r, Dh)); the last L_r tokens are rotated,
    the first L - L_r (class and register tokens) are not: x' = x * cos + rot(x) * sin, rot pairing
    the columns (2i, 2i+1) (``rope_layout="interleaved"``, EVA02) or (i, i + Dh/2) (``"half"``,
    DINOv3). Dh must be even; the tables keep their dtype (also under autocast) and the rotation is
    computed in float32. See ``vit_kernels.ops.rope``.

    ``attn_mask``: as SDPA's, broadcastable to (B, H, L, L): boolean (True = attend) or additive (any
    float dtype, kept also under autocast), e.g. a key-padding mask ``valid[:, None, None, :]`` of
    valid tokens ``valid`` (B, L) for a padded (NaFlex) batch. A query row whose every key is masked
    (-inf) gets zero output, probabilities and gradient, as SDPA's; finite masks such as
    ``finfo.min`` (timm's, transformers') stay finite. The mask gets no gradient on the Triton backend.
    """
    cos, sin = (None, None) if rope is None else _rope_pair(rope)
    return backend.call(
        "attention",
        (qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask),
        _prepare_attention,
    )


def _rope_pair(rope: object) -> tuple:
    """(cos, sin) out of ``rope``, checked to be a pair (the tables themselves: ``check_rope``)."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError(f"rope must be None or a pair (cos, sin) of tensors, got {type(rope).__name__}")
    return rope[0], rope[1]


def _prepare_attention(qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask):
    check_float_tensor("qkv", qkv, ndim=3, layout="(B, L, 3*D)")
    num_heads = check_positive_int("num_heads", num_heads)
    batch, length, three_d = qkv.shape
    if three_d == 0 or three_d % 3:
        raise ValueError(f"qkv last dimension must be 3*D with D > 0, got shape {shape_of(qkv)}")
    dim = three_d // 3
    if dim % num_heads:
        raise ValueError(
            f"num_heads={num_heads} must divide the width D={dim} of qkv (B, L, 3*D) = {shape_of(qkv)}"
        )
    if length == 0:
        raise ValueError(f"qkv must hold at least one token, got shape {shape_of(qkv)}")
    scale = check_optional_positive_float("scale", scale)
    dropout_p = check_probability("dropout_p", dropout_p)
    if not isinstance(return_probs, bool):
        raise TypeError(f"return_probs must be a bool, got {type(return_probs).__name__}")
    if (cos is None) != (sin is None):
        raise TypeError("rope must be a pair (cos, sin) of tensors, got None for one of them")
    check_rope(None if cos is None else (cos, sin), rope_layout, qkv, num_heads)
    check_attention_mask(attn_mask, qkv, num_heads)
    return qkv, num_heads, scale, dropout_p, return_probs, cos, sin, rope_layout, attn_mask


def _check_linear_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    weight_name: str = "weight",
    bias_name: str = "bias",
) -> int:
    """Checks x (..., K), weight (N, K), bias (N,); returns N."""
    check_float_tensor("x", x, layout="(..., K)")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., K), got shape {shape_of(x)}")
    check_float_tensor(weight_name, weight, ndim=2, layout="(N, K)")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(
            f"x last dimension must equal {weight_name}.shape[1] = K = {in_features}, got x of shape {shape_of(x)}"
        )
    check_optional_shape(bias_name, bias, (out_features,), "(N,)")
    return out_features


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x @ W^T + b (+ residual), the add fused into the GEMM epilogue; with ``layer_scale`` gamma (N,)
    (LayerScale, CaiT / DINOv2), residual + gamma * (x @ W^T + b) (see ``fold_layer_scale``).

    x (..., K), weight (N, K), bias (N,), residual (..., N) -> (..., N).
    """
    if layer_scale is not None:
        weight, bias = fold_layer_scale(layer_scale, weight, bias, "weight")
    return backend.call("linear", (x, weight, bias, residual), _prepare_linear)


def fold_layer_scale(
    layer_scale: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], weight_name: str
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """LayerScale folded into the last projection of a branch: gamma * (h W^T + b) = h (gamma W)^T +
    gamma b, so that the GEMM with the scaled weight (N, K) and bias (N,) computes
    residual + gamma * (h W^T + b) in its epilogue, on every backend. The scaling is weight-sized
    work (N x K), where scaling the output would read and write the (M, N) activations once more;
    autograd takes the gradients back through it: dgamma_n = sum_k dW'_nk W_nk + b_n db'_n,
    dW = gamma dW', db = gamma db'. layer_scale (N,), weight (N, K), bias (N,) or None."""
    check_float_tensor("layer_scale", layer_scale, ndim=1, layout="(N,)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return weight, bias  # the op's own checks name what is wrong with the weight
    check_shape("layer_scale", layer_scale, (weight.shape[0],), f"(N,) with N = {weight_name}.shape[0]")
    check_same_device("layer_scale", layer_scale, **{weight_name: weight})
    check_same_dtype("layer_scale", layer_scale, **{weight_name: weight})
    return layer_scale[:, None] * weight, None if bias is None else layer_scale * bias


def _prepare_linear(x, weight, bias, residual):
    out_features = _check_linear_args(x, weight, bias)
    check_optional_shape("residual", residual, (*x.shape[:-1], out_features), "(..., N)")
    x, weight, bias = one_device_and_dtype("x", x, dict(residual=residual), weight=weight, bias=bias)
    return (x, weight, bias, residual)


def linear_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    approximate: str = "none",
) -> torch.Tensor:
    """gelu(x @ W^T + b), GELU exact (``"none"``), tanh-approximate (``"tanh"``) or the sigmoid
    form of CLIP-style models, QuickGELU z * sigmoid(1.702 z) (``"quick"``).

    x (..., K), weight (N, K), bias (N,) -> (..., N).
    """
    return backend.call("linear_gelu", (x, weight, bias, approximate), _prepare_linear_gelu)


def _prepare_linear_gelu(x, weight, bias, approximate):
    _check_linear_args(x, weight, bias)
    approximate = check_choice("approximate", approximate, GELU_APPROXIMATIONS)
    x, weight, bias = one_device_and_dtype("x", x, weight=weight, bias=bias)
    return (x, weight, bias, approximate)


def mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    fc2_bias: Optional[torch.Tensor],
    *,
    approximate: str = "none",
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """fc2(gelu(fc1(x))) (+ residual), the GELU named by ``approximate`` as in ``linear_gelu``; with
    ``layer_scale`` gamma (D_out,), residual + gamma * fc2(...) (``fold_layer_scale``).

    x (..., D), fc1_weight (Hd, D), fc1_bias (Hd,), fc2_weight (D_out, Hd), fc2_bias (D_out,),
    residual (..., D_out) -> (..., D_out).
    """
    if layer_scale is not None:
        fc2_weight, fc2_bias = fold_layer_scale(layer_scale, fc2_weight, fc2_bias, "fc2_weight")
    return backend.call(
        "mlp", (x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate, residual), _prepare_mlp
    )


def _prepare_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate, residual):
    hidden = _check_linear_args(x, fc1_weight, fc1_bias, "fc1_weight", "fc1_bias")
    _check_output_projection(
        x, fc2_weight, fc2_bias, residual, hidden, ("fc2_weight", "fc2_bias", "fc1_weight")
    )
    approximate = check_choice("approximate", approximate, GELU_APPROXIMATIONS)
    x, fc1_weight, fc1_bias, fc2_weight, fc2_bias = one_device_and_dtype(
        "x",
        x,
        dict(residual=residual),
        fc1_weight=fc1_weight,
        fc1_bias=fc1_bias,
        fc2_weight=fc2_weight,
        fc2_bias=fc2_bias,
    )
    return (x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate, residual)


def _check_output_projection(x, weight, bias, residual, hidden: int, names: tuple[str, str, str]) -> None:
    """The last projection of an MLP: weight (D_out, Hd) taking the hidden width ``hidden``, bias
    (D_out,) or None, residual (..., D_out) or None. ``names``: (weight, bias, the hidden layer's weight)."""
    weight_name, bias_name, hidden_name = names
    check_float_tensor(weight_name, weight, ndim=2, layout="(D_out, Hd)")
    if weight.shape[1] != hidden:
        raise ValueError(
            f"{weight_name} must have shape (D_out, Hd) with Hd = {hidden_name}.shape[0] = {hidden}, "
            f"got {shape_of(weight)}"
        )
    check_optional_shape(bias_name, bias, (weight.shape[0],), "(D_out,)")
    check_optional_shape("residual", residual, (*x.shape[:-1], weight.shape[0]), "(..., D_out)")


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-6,
    *,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """LayerNorm over the last dimension, optionally of ``x + residual``.

    x (..., D), weight (D,) or None, bias (D,) or None, residual (..., D).
    Returns y (..., D); with a residual, (y, s) where s = x + residual and y = LN(s).
    """
    return backend.call("layer_norm", (x, weight, bias, eps, residual), _prepare_layer_norm)


def _prepare_layer_norm(x, weight, bias, eps, residual):
    check_float_tensor("x", x, layout="(..., D)")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (..., D), got shape {shape_of(x)}")
    dim = x.shape[-1]
    check_optional_shape("weight", weight, (dim,), "(D,)")
    check_optional_shape("bias", bias, (dim,), "(D,)")
    check_optional_shape("residual", residual, shape_of(x), "(..., D) like x")
    eps = check_optional_positive_float("eps", eps)
    if eps is None:
        raise ValueError("eps must be a positive finite float, got None")
    check_same_device("x", x, weight=weight, bias=bias, residual=residual)
    if autocast_dtype_of(x.device.type) is not None:
        x, weight, bias, residual = cast_all(torch.float32, x, weight, bias, residual)
    check_same_dtype("x", x, weight=weight, bias=bias, residual=residual)
    return (x, weight, bias, eps, residual)


def swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """The gated hidden layer of a SwiGLU MLP: silu(x W_g^T + b_g) * (x W_u^T + b_u), silu(z) = z sigmoid(z).

    x (..., D), gate_weight (Hd, D), gate_bias (Hd,) or None, up_weight (Hd, D), up_bias (Hd,) or
    None -> (..., Hd). For models with a norm in the hidden layer (EVA02's ``scale_mlp``), which then
    call ``layer_norm`` and ``linear`` themselves; ``swiglu_mlp`` fuses the whole MLP.
    """
    return backend.call("swiglu", (x, gate_weight, gate_bias, up_weight, up_bias), _prepare_swiglu)


def _check_swiglu_args(x, gate_weight, gate_bias, up_weight, up_bias) -> int:
    """Checks x (..., D), gate_weight and up_weight (Hd, D), the biases (Hd,); returns Hd."""
    hidden = _check_linear_args(x, gate_weight, gate_bias, "gate_weight", "gate_bias")
    check_float_tensor("up_weight", up_weight, ndim=2, layout="(Hd, D)")
    check_shape("up_weight", up_weight, tuple(gate_weight.shape), "(Hd, D) like gate_weight")
    check_optional_shape("up_bias", up_bias, (hidden,), "(Hd,)")
    return hidden


def _prepare_swiglu(x, gate_weight, gate_bias, up_weight, up_bias):
    _check_swiglu_args(x, gate_weight, gate_bias, up_weight, up_bias)
    x, gate_weight, gate_bias, up_weight, up_bias = one_device_and_dtype(
        "x", x, gate_weight=gate_weight, gate_bias=gate_bias, up_weight=up_weight, up_bias=up_bias
    )
    return (x, gate_weight, gate_bias, up_weight, up_bias)


def swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    *,
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A SwiGLU MLP: (silu(x W_g^T + b_g) * (x W_u^T + b_u)) W_d^T + b_d (+ residual), the residual
    added in the last GEMM's epilogue; with ``layer_scale`` gamma (D_out,), residual + gamma * (...)
    (``fold_layer_scale``).

    x (..., D), gate_weight and up_weight (Hd, D), gate_bias and up_bias (Hd,) or None, down_weight
    (D_out, Hd), down_bias (D_out,) or None, residual (..., D_out) -> (..., D_out).
    """
    if layer_scale is not None:
        down_weight, down_bias = fold_layer_scale(layer_scale, down_weight, down_bias, "down_weight")
    return backend.call(
        "swiglu_mlp",
        (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual),
        _prepare_swiglu_mlp,
    )


def _prepare_swiglu_mlp(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual):
    hidden = _check_swiglu_args(x, gate_weight, gate_bias, up_weight, up_bias)
    _check_output_projection(
        x, down_weight, down_bias, residual, hidden, ("down_weight", "down_bias", "gate_weight")
    )
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias = one_device_and_dtype(
        "x",
        x,
        dict(residual=residual),
        gate_weight=gate_weight,
        gate_bias=gate_bias,
        up_weight=up_weight,
        up_bias=up_bias,
        down_weight=down_weight,
        down_bias=down_bias,
    )
    return x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual
