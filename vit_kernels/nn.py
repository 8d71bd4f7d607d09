"""Drop-in ``nn.Module`` layers built on the fused ops, with timm's parameter names, so a timm
state dict loads unchanged (``patch_embed.proj``, ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ...).

Residual adds are passed *into* the layers (``attn(h, residual=x)``) so they land in the epilogue
of the last GEMM instead of costing a separate read and write of the activations.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vit_kernels import functional as vkf
from vit_kernels._checks import check_choice, check_positive_int, check_probability
from vit_kernels.activations import ACTIVATIONS, gelu_approximate

MLP_TYPES = ("mlp", "swiglu")  # Block's MLP: fc1 -> activation -> fc2 (Mlp), or timm's SwiGLU


def _to_pair(value: Union[int, tuple[int, int]], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return (check_positive_int(name, value),) * 2
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return check_positive_int(name, value[0]), check_positive_int(name, value[1])
    raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")


def _project(h, weight, bias, drop: float, residual, layer_scale) -> torch.Tensor:
    """The branch's last GEMM [+ residual]: the add fused into it unless ``drop`` > 0 (dropout in
    training) stands between them."""
    if not drop:
        return vkf.linear(h, weight, bias, residual=residual, layer_scale=layer_scale)
    out = F.dropout(vkf.linear(h, weight, bias, layer_scale=layer_scale), drop, True)
    return out if residual is None else residual + out


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth (timm's ``drop_path``): in training, zero each sample's whole branch output
    with probability ``p`` and scale the kept ones by 1 / (1 - p), so the expected value is ``x``.

    x (B, ...) -> (B, ...); one Bernoulli(1 - p) draw per sample, broadcast over the other dims.
    """
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


def self_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: Optional[torch.Tensor],
    proj_weight: torch.Tensor,
    proj_bias: Optional[torch.Tensor],
    num_heads: int,
    *,
    attn_drop: float = 0.0,
    proj_drop: float = 0.0,
    training: bool = False,
    residual: Optional[torch.Tensor] = None,
    return_probs: bool = False,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    rope_layout: str = "interleaved",
    attn_mask: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Packed-projection self-attention on the fused ops, shared by every attention layer.

    x (B, L, D); qkv_weight (3*D', D) as one ``Linear(D, 3*D')``; proj_weight (D_out, D').
    Returns (B, L, D_out) [+ residual] and, with ``return_probs``, the probabilities (B, H, L, L).
    Dropout acts only when ``training``; the residual add is fused into the projection when no
    dropout follows it. ``rope = (cos, sin)``, ``rope_layout``: rotary position embedding of q and
    k; ``attn_mask``: SDPA's mask; both as ``vk.attention`` takes them. ``layer_scale`` gamma
    (D_out,) scales the projection's output before the residual add (LayerScale), in its GEMM.
    """
    qkv = vkf.linear(x, qkv_weight, qkv_bias)
    result = vkf.attention(
        qkv,
        num_heads,
        dropout_p=attn_drop if training else 0.0,
        return_probs=return_probs,
        rope=rope,
        rope_layout=rope_layout,
        attn_mask=attn_mask,
    )
    out, probs = result if return_probs else (result, None)
    out = _project(out, proj_weight, proj_bias, proj_drop if training else 0.0, residual, layer_scale)
    return (out, probs) if return_probs else out


def feed_forward(
    x: torch.Tensor,
    fc1: nn.Linear,
    fc2: nn.Linear,
    act: str,
    *,
    hidden_drop: float = 0.0,
    out_drop: float = 0.0,
    training: bool = False,
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """fc1 -> act -> dropout(hidden_drop) -> fc2 -> dropout(out_drop) [+ residual], fused where
    dropout allows; ``layer_scale`` gamma (D_out,) scales fc2's output before the add, in its GEMM.
    x (..., D_in) -> (..., D_out)."""
    hidden_dropping = training and hidden_drop > 0
    out_dropping = training and out_drop > 0
    approximate = gelu_approximate(act)
    if approximate is not None and not hidden_dropping and not out_dropping:
        return vkf.mlp(
            x,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            fc2.bias,
            approximate=approximate,
            residual=residual,
            layer_scale=layer_scale,
        )
    if approximate is not None:
        hidden = vkf.linear_gelu(x, fc1.weight, fc1.bias, approximate=approximate)
    else:
        hidden = torch.relu(vkf.linear(x, fc1.weight, fc1.bias))
    hidden = F.dropout(hidden, hidden_drop, hidden_dropping)
    return _project(hidden, fc2.weight, fc2.bias, out_drop if out_dropping else 0.0, residual, layer_scale)


class PatchEmbed(nn.Module):
    """Image to tokens: (N, C, H, W) -> (N, T, D), one fused op.

    The class token and position embedding belong to the model (timm keeps them there too) and are
    passed to ``forward``, which adds them in the same kernel.
    """

    def __init__(
        self,
        img_size: Union[int, tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.img_size = _to_pair(img_size, "img_size")
        self.patch_size = check_positive_int("patch_size", patch_size)
        if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
            raise ValueError(f"img_size {self.img_size} must be divisible by patch_size={patch_size}")
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(
        self,
        images: torch.Tensor,
        cls_token: Optional[torch.Tensor] = None,
        pos_embed: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if images.dim() == 4 and tuple(images.shape[-2:]) != self.img_size:
            raise ValueError(
                f"images must be {self.img_size[0]}x{self.img_size[1]}, got {tuple(images.shape)}"
            )
        return vkf.patch_embed(
            images,
            self.proj.weight,
            self.proj.bias,
            patch_size=self.patch_size,
            cls_token=cls_token,
            pos_embed=pos_embed,
        )


class Attention(nn.Module):
    """Multi-head self-attention: qkv Linear, fused attention, proj Linear (+ residual)."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = check_probability("attn_drop", attn_drop)
        self.proj_drop = check_probability("proj_drop", proj_drop)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
        *,
        return_probs: bool = False,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        rope_layout: str = "interleaved",
        layer_scale: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, L, D) -> (B, L, D) [+ residual]; with ``return_probs`` also (B, H, L, L);
        ``layer_scale`` gamma (D,): residual + gamma * proj(...) (LayerScale), in the proj GEMM.

        ``attn_mask`` (boolean, True = attend, or additive, broadcastable to (B, H, L, L), as SDPA's)
        masks the scores inside the fused kernel (NaFlex ViTs mask padded patches); ``is_causal``
        masks with the lower triangle, as SDPA (which takes one or the other) does.
        ``rope = (cos, sin)`` (each broadcastable to (B, H, L_r, Dh)) rotates q and k of the last L_r
        tokens, pairs as ``rope_layout`` says: see ``vk.attention``.
        """
        if is_causal:
            if attn_mask is not None:
                raise ValueError("Attention takes attn_mask or is_causal=True, not both (as SDPA)")
            length = x.shape[-2]
            attn_mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        return self_attention(
            x,
            self.qkv.weight,
            self.qkv.bias,
            self.proj.weight,
            self.proj.bias,
            self.num_heads,
            attn_drop=self.attn_drop,
            proj_drop=self.proj_drop,
            training=self.training,
            residual=residual,
            return_probs=return_probs,
            rope=rope,
            rope_layout=rope_layout,
            attn_mask=attn_mask,
            layer_scale=layer_scale,
        )


class Mlp(nn.Module):
    """fc1 -> activation -> dropout -> fc2 -> dropout (+ residual), fused where dropout allows."""

    def __init__(
        self,
        in_features: int,
        hidden_features: Optional[int] = None,
        out_features: Optional[int] = None,
        act: str = "gelu",
        bias: bool = True,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.act = check_choice("act", act, ACTIVATIONS)
        self.drop = check_probability("drop", drop)
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
        layer_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x (..., D) -> (..., D_out) [+ residual]; ``layer_scale`` gamma (D_out,) scales fc2's output."""
        return feed_forward(
            x,
            self.fc1,
            self.fc2,
            self.act,
            hidden_drop=self.drop,
            out_drop=self.drop,
            training=self.training,
            residual=residual,
            layer_scale=layer_scale,
        )


class SwiGLU(nn.Module):
    """timm's ``SwiGLU`` MLP (EVA02, LLaMA-style ViTs): fc2(norm(silu(fc1_g(x)) * fc1_x(x))), with
    timm's parameter names (``fc1_g``, ``fc1_x``, ``norm``, ``fc2``), so its state dicts load unchanged.

    ``bias`` and ``drop`` take one value or a (hidden layer, output) pair, as in timm. With
    ``norm=True`` the hidden layer is normalised by a LayerNorm of ``norm_eps`` (EVA02's
    ``scale_mlp``): ``vk.swiglu`` -> ``vk.layer_norm`` -> ``vk.linear``; without it, and without
    dropout in training, the whole MLP is one ``vk.swiglu_mlp`` call with the residual in its last epilogue.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: Optional[int] = None,
        out_features: Optional[int] = None,
        bias: Union[bool, tuple[bool, bool]] = True,
        norm: bool = False,
        drop: Union[float, tuple[float, float]] = 0.0,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        hidden_bias, out_bias = bias if isinstance(bias, (tuple, list)) else (bias, bias)
        drops = drop if isinstance(drop, (tuple, list)) else (drop, drop)
        self.hidden_drop = check_probability("drop", drops[0])
        self.out_drop = check_probability("drop", drops[1])
        self.fc1_g = nn.Linear(in_features, hidden_features, bias=hidden_bias)
        self.fc1_x = nn.Linear(in_features, hidden_features, bias=hidden_bias)
        self.norm = LayerNorm(hidden_features, eps=norm_eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=out_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
        layer_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x (..., D) -> (..., D_out) [+ residual]; ``layer_scale`` gamma (D_out,) scales fc2's output."""
        hidden_dropping = self.training and self.hidden_drop > 0
        out_dropping = self.training and self.out_drop > 0
        g, u, fc2 = self.fc1_g, self.fc1_x, self.fc2
        if isinstance(self.norm, nn.Identity) and not hidden_dropping and not out_dropping:
            return vkf.swiglu_mlp(
                x,
                g.weight,
                g.bias,
                u.weight,
                u.bias,
                fc2.weight,
                fc2.bias,
                residual=residual,
                layer_scale=layer_scale,
            )
        hidden = F.dropout(
            vkf.swiglu(x, g.weight, g.bias, u.weight, u.bias), self.hidden_drop, hidden_dropping
        )
        hidden = self.norm(hidden)
        drop = self.out_drop if out_dropping else 0.0
        return _project(hidden, fc2.weight, fc2.bias, drop, residual, layer_scale)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension on the fused op; ``forward(x, residual)`` returns
    ``(LN(x + residual), x + residual)``."""

    def __init__(
        self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True, bias: bool = True
    ):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"normalized_shape must be a single int, got {normalized_shape!r}")

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return vkf.layer_norm(x, self.weight, self.bias, self.eps, residual=residual)


class LayerScale(nn.Module):
    """x * gamma over the last dimension (CaiT, DINOv2), timm's parameter name ``gamma`` (D,). A block
    does not call it: it hands ``gamma`` to the branch's last GEMM (``layer_scale=``), which scales
    and adds the residual in its epilogue."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = float(init_values)
        self.gamma = nn.Parameter(torch.full((check_positive_int("dim", dim),), self.init_values))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """A transformer encoder block.

    pre-norm (``norm_first=True``, ViT/timm):   x = x + attn(norm1(x));  x = x + mlp(norm2(x))
    post-norm (``nn.TransformerEncoderLayer``): x = norm1(x + attn(x));  x = norm2(x + mlp(x))
    Each residual add is fused into the last GEMM of its branch. With ``init_values`` each branch is
    scaled by a LayerScale (``ls1``, ``ls2``: x + gamma * attn(...)), folded into that same GEMM.
    ``mlp_type="swiglu"`` takes timm's ``SwiGLU`` MLP (EVA02; ``act`` unused), with a LayerNorm on its
    hidden features when ``mlp_norm`` (EVA02-B/L's ``scale_mlp``); ``forward(x, rope=(cos, sin))``
    rotates q and k inside attention (see ``vk.attention``).
    ``drop_path`` (stochastic depth, as timm's blocks) drops each branch per sample in training; it
    scales the branch before the add, so while it is active the add runs unfused.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_hidden_dim: Optional[int] = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        act: str = "gelu",
        norm_first: bool = True,
        eps: float = 1e-6,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: Optional[float] = None,
        mlp_type: str = "mlp",
        mlp_norm: bool = False,
    ) -> None:
        super().__init__()
        check_choice("mlp_type", mlp_type, MLP_TYPES)
        if mlp_norm and mlp_type != "swiglu":
            raise ValueError(f"mlp_norm=True needs mlp_type='swiglu', got mlp_type={mlp_type!r}")
        self.norm_first = norm_first
        self.drop_path = check_probability("drop_path", drop_path)
        self.norm1 = LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = LayerNorm(dim, eps=eps)
        hidden = mlp_hidden_dim or int(dim * mlp_ratio)
        if mlp_type == "swiglu":
            self.mlp = SwiGLU(dim, hidden, norm=mlp_norm, drop=drop, norm_eps=eps)
        else:
            self.mlp = Mlp(dim, hidden, act=act, drop=drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        return_probs: bool = False,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, L, D) -> (B, L, D); with ``return_probs`` also the attention (B, H, L, L); ``rope``
        (cos, sin), each (L_r, Dh), rotates q and k of the last L_r tokens (interleaved pairs)."""
        attn_input = self.norm1(x) if self.norm_first else x
        attn_args = {"return_probs": True} if return_probs else {}
        if rope is not None:
            attn_args["rope"] = rope
        result = self._residual_branch(self.attn, self.ls1, attn_input, x, **attn_args)
        x, probs = result if return_probs else (result, None)
        if self.norm_first:
            x = self._residual_branch(self.mlp, self.ls2, self.norm2(x), x)
        else:
            x = self.norm1(x)
            x = self.norm2(self._residual_branch(self.mlp, self.ls2, x, x))
        return (x, probs) if return_probs else x

    def _residual_branch(
        self, branch: nn.Module, scale: nn.Module, inputs: torch.Tensor, x: torch.Tensor, **extra: object
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x + drop_path(scale(branch(inputs, **extra))), the LayerScale and the add fused into the
        branch's last GEMM (the add unless drop path is active); with ``return_probs`` (attention only)
        the probabilities come back beside it."""
        return_probs = bool(extra.get("return_probs", False))
        if isinstance(scale, LayerScale):
            extra["layer_scale"] = scale.gamma
        if not (self.training and self.drop_path > 0):
            return branch(inputs, residual=x, **extra)
        result = branch(inputs, **extra)
        out, probs = result if return_probs else (result, None)
        out = x + drop_path(out, self.drop_path, True)
        return (out, probs) if return_probs else out
