"""One spec per op, shared by the selftest, the tests and the benchmarks: the inputs at a shape, the
public call, the eager reference, the float64 formula written out, and the work the op does.

The benchmarks time ``run`` against ``reference`` (what ``torch.compile`` is given) on
``make_inputs``; the tests check ``run``, on every backend, against ``formula`` on the same inputs,
output and every input gradient. ``formula`` is the math of the op spelled out in PyTorch (for
attention: softmax(q k^T * scale) v), deliberately not a call of the backends' own reference, so
that a reference with a bug cannot agree with itself.

Ops: the public ops (``backend.OPS``) and the extension kernels timed on their own against the
eager code they replace (``KERNELS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

import vit_kernels as vk  # the public ops, looked up at call time (as users call them)
from vit_kernels import backend
from vit_kernels.ops.attention_reference import attention_ref
from vit_kernels.ops.layer_norm import layer_norm_ref
from vit_kernels.ops.linear import linear_gelu_ref, linear_ref, mlp_ref
from vit_kernels.ops.patch_embed import patch_embed_ref
from vit_kernels.ops.swiglu import swiglu_mlp_ref, swiglu_ref

OPS = backend.OPS
# Kernels of the extension timed on their own against the eager code they replace.
KERNELS = ("bias_gelu",)
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    """The op shapes of one ViT at one batch size (``benchmarks.cases.shape_of`` reads them from a
    model preset)."""

    model: str
    batch: int
    tokens: int  # patches + class token
    dim: int  # D = heads * head dim
    heads: int
    hidden: int  # the MLP's hidden width
    channels: int
    image: int  # square images of image x image pixels
    patch: int
    # what the model's attention computes beside softmax(q k^T) v: "" nothing; "rope_interleaved" or
    # "rope_half" rotary embedding of the patch tokens (EVA02, DINOv3); "key_padding" a boolean
    # key-padding mask, a quarter of every other image's tokens padding (a NaFlex batch)
    attention: str = ""

    @property
    def label(self) -> str:
        return f"{self.model} B={self.batch} L={self.tokens} D={self.dim}"

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


@dataclass(frozen=True)
class OpSpec:
    """What the tests and the benchmarks know of one op. Every callable takes the shape first, then
    the inputs by name, as ``make_inputs`` returns them."""

    name: str
    make_inputs: Callable[[Shape, torch.device, torch.dtype], dict[str, torch.Tensor]]
    run: Callable[..., object]  # the public op, vk.<op>(...) (for a kernel: the bare kernel)
    reference: Callable[..., object]  # the eager PyTorch reference, what torch.compile is given
    formula: Callable[..., object]  # the math written out, run in float64 by the tests
    flops: Callable[[Shape], float]  # forward FLOPs (0: memory-bound)
    bytes_per_element: Callable[[Shape], int]  # forward tensors read + written, per (rows x D) element
    backward_factor: float = 2.0  # backward work / forward work (2.5 for attention, which recomputes P)


def _randn(device, dtype, *shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _linear_params(device, dtype, in_features: int, out_features: int, prefix: str = "") -> dict:
    """The parameters of a ``Linear(in_features, out_features)`` as the op names them
    (``<prefix>weight``, ``<prefix>bias``): weight (out_features, in_features) scaled by
    in_features ** -0.5, bias (out_features,); drawn in that order."""
    return {
        f"{prefix}weight": _randn(device, dtype, out_features, in_features, scale=in_features**-0.5),
        f"{prefix}bias": _randn(device, dtype, out_features),
    }


def _gemm_spec(
    name: str,
    layers: Callable[[Shape], list[tuple[int, int, str]]],
    reference: Callable[..., object],
    *,
    formula: Callable[..., object],
    flops: Callable[[Shape], float],
    residual: bool = False,
) -> OpSpec:
    """The spec of a GEMM op whose public call and reference take the inputs by name: x (rows, D),
    the weight and bias of each of ``layers(s)`` ((in_features, out_features, prefix), as
    ``_linear_params`` names them) and, with ``residual``, a residual (rows, D); drawn in that order."""

    def make_inputs(s: Shape, device, dtype) -> dict:
        inputs = {"x": _randn(device, dtype, s.rows, s.dim)}
        for in_features, out_features, prefix in layers(s):
            inputs.update(_linear_params(device, dtype, in_features, out_features, prefix))
        if residual:
            inputs["residual"] = _randn(device, dtype, s.rows, s.dim)
        return inputs

    return OpSpec(
        name,
        make_inputs,
        run=lambda s, **inputs: getattr(vk, name)(**inputs),
        reference=lambda s, **inputs: reference(**inputs),
        formula=formula,
        flops=flops,
        bytes_per_element=lambda s: 0,
    )


def _gelu(z: torch.Tensor) -> torch.Tensor:
    """gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2)) (the exact form, approximate="none")."""
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


# ---- patch_embed -------------------------------------------------------------------------------------


def _patch_embed_inputs(s: Shape, device, dtype):
    return {
        "images": _randn(device, dtype, s.batch, s.channels, s.image, s.image),
        "weight": _randn(device, dtype, s.dim, s.channels, s.patch, s.patch, scale=0.05),
        "bias": _randn(device, dtype, s.dim),
        "cls_token": _randn(device, dtype, 1, 1, s.dim),
        "pos_embed": _randn(device, dtype, 1, s.tokens, s.dim),
    }


def _patch_embed_formula(s: Shape, images, weight, bias, cls_token, pos_embed):
    # tokens[n, l] = sum_{c,i,j} images[n, c, ph P + i, pw P + j] W[d, c, i, j] + b[d], l = ph Wp + pw;
    # then [cls | tokens] + pos
    n, c, h, w = images.shape
    p = s.patch
    patches = images.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
    tokens = patches @ weight.reshape(weight.shape[0], -1).t() + bias
    tokens = torch.cat([cls_token.expand(n, -1, -1), tokens], dim=1)
    return tokens + pos_embed


# ---- attention ---------------------------------------------------------------------------------------


_EXTRAS: dict[tuple, dict] = {}


def attention_extras(s: Shape, device: torch.device) -> dict:
    """``vk.attention``'s keyword arguments for the shape's ``attention`` variant (made once per
    shape and device, outside any timed call): real RoPE tables (L_r, Dh) float32 of the patch
    tokens (theta 100, the prefix tokens unrotated), or a boolean (B, 1, 1, L) key-padding mask."""
    key = (s, str(device))
    if key not in _EXTRAS:
        head_dim = s.dim // s.heads
        if s.attention.startswith("rope_"):
            layout = s.attention[len("rope_") :]
            freqs = 100.0 ** (-torch.arange(head_dim // 2, dtype=torch.float64) / (head_dim // 2))
            angles = torch.arange(s.patches, dtype=torch.float64)[:, None] * freqs[None, :]
            angles = (
                angles.repeat_interleave(2, -1)
                if layout == "interleaved"
                else torch.cat([angles, angles], -1)
            )
            _EXTRAS[key] = {
                "rope": (angles.cos().float().to(device), angles.sin().float().to(device)),
                "rope_layout": layout,
            }
        elif s.attention == "key_padding":
            counts = torch.tensor([s.tokens - (s.tokens // 4) * (i % 2) for i in range(s.batch)])
            valid = torch.arange(s.tokens)[None, :] < counts[:, None]
            _EXTRAS[key] = {"attn_mask": valid[:, None, None, :].to(device)}
        else:
            _EXTRAS[key] = {}
    return _EXTRAS[key]


def _attention_reference(s: Shape, qkv):
    extras = attention_extras(s, qkv.device)
    cos, sin = extras.get("rope", (None, None))
    return attention_ref(
        qkv,
        s.heads,
        cos=cos,
        sin=sin,
        rope_layout=extras.get("rope_layout", "interleaved"),
        attn_mask=extras.get("attn_mask"),
    )


def _attention_formula(s: Shape, qkv):
    # qkv (B, L, 3D) = [q | k | v], each (B, L, H, Dh); out = softmax(q k^T / sqrt(Dh)) v, heads concatenated
    # (the plain variant: rope and masks have formulas of their own in tests/test_attention_rope.py and
    # tests/test_attention_mask.py)
    if s.attention:
        raise ValueError(f"the attention formula is the plain variant's, not {s.attention!r}")
    b, length, three_d = qkv.shape
    head_dim = three_d // 3 // s.heads
    q, k, v = qkv.reshape(b, length, 3, s.heads, head_dim).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-2, -1) * head_dim**-0.5
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    return (probs @ v).transpose(1, 2).reshape(b, length, three_d // 3)


# ---- layer_norm (with the fused residual add) ------------------------------------------------------


def _layer_norm_formula(s: Shape, x, weight, bias, residual):
    # s = x + r;  y = (s - mean(s)) / sqrt(var(s) + eps) * w + b  (biased variance);  -> (y, s)
    summed = x + residual
    mean = summed.mean(-1, keepdim=True)
    var = ((summed - mean) ** 2).mean(-1, keepdim=True)
    return (summed - mean) / torch.sqrt(var + LAYER_NORM_EPS) * weight + bias, summed


SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "patch_embed",
            _patch_embed_inputs,
            run=lambda s, images, weight, bias, cls_token, pos_embed: vk.patch_embed(
                images, weight, bias, patch_size=s.patch, cls_token=cls_token, pos_embed=pos_embed
            ),
            reference=lambda s, images, weight, bias, cls_token, pos_embed: patch_embed_ref(
                images, weight, bias, s.patch, cls_token, pos_embed
            ),
            formula=_patch_embed_formula,
            flops=lambda s: 2.0 * s.batch * s.patches * s.dim * s.channels * s.patch**2,
            bytes_per_element=lambda s: 0,
        ),
        OpSpec(
            "attention",
            lambda s, device, dtype: {"qkv": _randn(device, dtype, s.batch, s.tokens, 3 * s.dim)},
            run=lambda s, qkv: vk.attention(qkv, s.heads, **attention_extras(s, qkv.device)),
            reference=lambda s, qkv: _attention_reference(s, qkv),
            formula=_attention_formula,
            flops=lambda s: 4.0 * s.batch * s.tokens**2 * s.dim,
            bytes_per_element=lambda s: 0,
            backward_factor=2.5,
        ),
        _gemm_spec(
            "linear_gelu",
            lambda s: [(s.dim, s.hidden, "")],
            linear_gelu_ref,
            formula=lambda s, x, weight, bias: _gelu(x @ weight.t() + bias),
            flops=lambda s: 2.0 * s.rows * s.dim * s.hidden,
        ),
        _gemm_spec(  # the attention output projection with its residual add
            "linear",
            lambda s: [(s.dim, s.dim, "")],
            linear_ref,
            formula=lambda s, x, weight, bias, residual: x @ weight.t() + bias + residual,
            flops=lambda s: 2.0 * s.rows * s.dim * s.dim,
            residual=True,
        ),
        _gemm_spec(
            "mlp",
            lambda s: [(s.dim, s.hidden, "fc1_"), (s.hidden, s.dim, "fc2_")],
            mlp_ref,
            formula=lambda s, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, residual: (
                _gelu(x @ fc1_weight.t() + fc1_bias) @ fc2_weight.t() + fc2_bias + residual
            ),
            flops=lambda s: 4.0 * s.rows * s.dim * s.hidden,
            residual=True,
        ),
        OpSpec(  # with the fused residual add: reads x, r; writes y, s
            "layer_norm",
            lambda s, device, dtype: {
                "x": _randn(device, dtype, s.batch, s.tokens, s.dim),
                "weight": _randn(device, dtype, s.dim),
                "bias": _randn(device, dtype, s.dim),
                "residual": _randn(device, dtype, s.batch, s.tokens, s.dim),
            },
            run=lambda s, x, weight, bias, residual: vk.layer_norm(
                x, weight, bias, LAYER_NORM_EPS, residual=residual
            ),
            reference=lambda s, x, weight, bias, residual: layer_norm_ref(
                x, weight, bias, LAYER_NORM_EPS, residual
            ),
            formula=_layer_norm_formula,
            flops=lambda s: 0,
            bytes_per_element=lambda s: 4,
        ),
        OpSpec(  # the C++/CUDA epilogue of linear_gelu: reads z, writes gelu(z + b)
            "bias_gelu",
            lambda s, device, dtype: {
                "x": _randn(device, dtype, s.rows, s.hidden),
                "bias": _randn(device, dtype, s.hidden),
            },
            run=lambda s, x, bias: torch.ops.vit_kernels.bias_gelu(x, bias, "none"),
            reference=lambda s, x, bias: torch.nn.functional.gelu(x + bias),
            formula=lambda s, x, bias: _gelu(x + bias),
            flops=lambda s: 0,
            bytes_per_element=lambda s: 2 * s.hidden // s.dim,
        ),
    )
}
# ---- swiglu and swiglu_mlp (the gated MLP of EVA02 and LLaMA-style models; ops/swiglu.py) --------------


def _silu(z: torch.Tensor) -> torch.Tensor:
    """silu(z) = z * sigmoid(z) = z / (1 + exp(-z))."""
    return z / (1.0 + torch.exp(-z))


def _swiglu_formula(s: Shape, x, gate_weight, gate_bias, up_weight, up_bias):
    # h = silu(x W_g^T + b_g) * (x W_u^T + b_u)
    return _silu(x @ gate_weight.t() + gate_bias) * (x @ up_weight.t() + up_bias)


def _swiglu_layers(s: Shape) -> list[tuple[int, int, str]]:
    """The gate and up projections of a SwiGLU MLP, (in_features, out_features, prefix)."""
    return [(s.dim, s.hidden, "gate_"), (s.dim, s.hidden, "up_")]


SPECS["swiglu"] = _gemm_spec(
    "swiglu",
    _swiglu_layers,
    swiglu_ref,
    formula=_swiglu_formula,
    flops=lambda s: 4.0 * s.rows * s.dim * s.hidden,
)
SPECS["swiglu_mlp"] = _gemm_spec(
    "swiglu_mlp",
    lambda s: _swiglu_layers(s) + [(s.hidden, s.dim, "down_")],
    swiglu_mlp_ref,
    formula=lambda s, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual: (
        _swiglu_formula(s, x, gate_weight, gate_bias, up_weight, up_bias) @ down_weight.t()
        + down_bias
        + residual
    ),
    flops=lambda s: 6.0 * s.rows * s.dim * s.hidden,
    residual=True,
)
SPECS = {name: SPECS[name] for name in OPS + KERNELS}  # in the order of backend.OPS, then the kernels
assert tuple(SPECS) == OPS + KERNELS, "one spec per op of backend.OPS and per kernel of KERNELS"
