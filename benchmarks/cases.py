"""The per-op benchmark cases: each op of a ViT block at the shapes of a model preset.

A case makes fresh random inputs, runs the public op (whichever backend is in force), names the
eager reference (what ``torch.compile`` is given), and counts its work: FLOPs for GEMM-like ops
(reported as TFLOP/s), bytes moved for memory-bound ones (reported as GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import vit_kernels as vk
from vit.model import get_config
from vit_kernels.ops.attention import attention_ref, explicit_attention, split_qkv
from vit_kernels.ops.layer_norm import layer_norm_ref
from vit_kernels.ops.linear import linear_gelu_ref, linear_ref, mlp_ref
from vit_kernels.ops.patch_embed import patch_embed_ref

OPS = ("patch_embed", "attention", "linear_gelu", "linear", "mlp", "layer_norm")
# Kernels of the extension timed on their own against the eager code they replace.
KERNELS = ("bias_gelu",)


@dataclass(frozen=True)
class Shape:
    """The op shapes of one ViT preset at one batch size."""

    model: str
    batch: int
    tokens: int
    dim: int
    heads: int
    hidden: int
    channels: int
    image: int
    patch: int

    @property
    def label(self) -> str:
        return f"{self.model} B={self.batch} L={self.tokens} D={self.dim}"

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


def shape_of(model: str, batch: int) -> Shape:
    config = get_config(model)
    patches = (config.img_size // config.patch_size) ** 2
    hidden = config.mlp_hidden_dim or int(config.embed_dim * config.mlp_ratio)
    return Shape(model, batch, patches + int(config.class_token), config.embed_dim, config.num_heads, hidden,
                 config.in_chans, config.img_size, config.patch_size)


@dataclass(frozen=True)
class OpCase:
    op: str
    shape: Shape
    make_inputs: Callable[[torch.device, torch.dtype], dict[str, torch.Tensor]]
    run: Callable[..., object]          # the public op: vk.<op>(**inputs), or the bare kernel
    reference: Callable[..., object]    # the eager reference with the same inputs
    flops: float                        # forward FLOPs (0: memory-bound)
    bytes_per_element: int              # forward tensors read + written, per (rows x D) element

    def work(self, mode: str, itemsize: int) -> tuple[float, str]:
        """(amount, unit) of work for ``mode``: FLOPs for GEMM-like ops, bytes for memory-bound ones.
        Backward does twice the forward's GEMM work (2.5x for attention, which recomputes P)."""
        backward_factor = 2.5 if self.op == "attention" else 2.0
        factor = {"forward": 1.0, "backward": backward_factor, "full": 1.0 + backward_factor}[mode]
        if self.flops:
            return self.flops * factor, "TFLOP/s"
        moved = self.bytes_per_element * self.shape.rows * self.shape.dim * itemsize  # backward counted alike
        return moved * (2.0 if mode == "full" else 1.0), "GB/s"


def _randn(device, dtype, *shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def build_case(op: str, s: Shape) -> OpCase:
    """The case for ``op`` at shape ``s``."""
    M, D, Hd = s.rows, s.dim, s.hidden
    if op == "patch_embed":
        patches = (s.image // s.patch) ** 2

        def make(device, dtype):
            return {
                "images": _randn(device, dtype, s.batch, s.channels, s.image, s.image),
                "weight": _randn(device, dtype, D, s.channels, s.patch, s.patch, scale=0.05),
                "bias": _randn(device, dtype, D), "cls_token": _randn(device, dtype, 1, 1, D),
                "pos_embed": _randn(device, dtype, 1, s.tokens, D),
            }

        def run(images, weight, bias, cls_token, pos_embed):
            return vk.patch_embed(images, weight, bias, patch_size=s.patch, cls_token=cls_token, pos_embed=pos_embed)

        def ref(images, weight, bias, cls_token, pos_embed):
            return patch_embed_ref(images, weight, bias, s.patch, cls_token, pos_embed)

        return OpCase(op, s, make, run, ref, 2.0 * s.batch * patches * D * s.channels * s.patch**2, 0)
    if op == "attention":
        def make(device, dtype):
            return {"qkv": _randn(device, dtype, s.batch, s.tokens, 3 * D)}

        return OpCase(
            op, s, make, lambda qkv: vk.attention(qkv, s.heads), lambda qkv: attention_ref(qkv, s.heads),
            4.0 * s.batch * s.tokens**2 * D, 0,
        )
    if op == "linear_gelu":
        def make(device, dtype):
            return {"x": _randn(device, dtype, M, D), "weight": _randn(device, dtype, Hd, D, scale=D**-0.5),
                    "bias": _randn(device, dtype, Hd)}

        return OpCase(op, s, make, vk.linear_gelu, linear_gelu_ref, 2.0 * M * D * Hd, 0)
    if op == "linear":  # the attention output projection with its residual add
        def make(device, dtype):
            return {"x": _randn(device, dtype, M, D), "weight": _randn(device, dtype, D, D, scale=D**-0.5),
                    "bias": _randn(device, dtype, D), "residual": _randn(device, dtype, M, D)}

        return OpCase(op, s, make, vk.linear, linear_ref, 2.0 * M * D * D, 0)
    if op == "mlp":
        def make(device, dtype):
            return {"x": _randn(device, dtype, M, D), "fc1_weight": _randn(device, dtype, Hd, D, scale=D**-0.5),
                    "fc1_bias": _randn(device, dtype, Hd), "fc2_weight": _randn(device, dtype, D, Hd, scale=Hd**-0.5),
                    "fc2_bias": _randn(device, dtype, D), "residual": _randn(device, dtype, M, D)}

        return OpCase(op, s, make, vk.mlp, mlp_ref, 4.0 * M * D * Hd, 0)
    if op == "layer_norm":  # with the fused residual add: reads x, r; writes y, s
        def make(device, dtype):
            return {"x": _randn(device, dtype, s.batch, s.tokens, D), "weight": _randn(device, dtype, D),
                    "bias": _randn(device, dtype, D), "residual": _randn(device, dtype, s.batch, s.tokens, D)}

        def run(x, weight, bias, residual):
            return vk.layer_norm(x, weight, bias, 1e-6, residual=residual)

        def ref(x, weight, bias, residual):
            return layer_norm_ref(x, weight, bias, 1e-6, residual)

        return OpCase(op, s, make, run, ref, 0, 4)
    if op == "bias_gelu":  # the C++/CUDA epilogue of linear_gelu: reads z, writes gelu(z + b)
        def make(device, dtype):
            return {"x": _randn(device, dtype, M, Hd), "bias": _randn(device, dtype, Hd)}

        def kernel(x, bias):
            return torch.ops.vit_kernels.bias_gelu(x, bias, "none")

        def eager(x, bias):
            return torch.nn.functional.gelu(x + bias)

        return OpCase(op, s, make, kernel, eager, 0, 2 * Hd // D)
    raise ValueError(f"op must be one of {OPS + KERNELS}, got {op!r}")


def eager_math_attention(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Attention as eager PyTorch without SDPA: q k^T, softmax, @ v (what most ViT code did)."""

    def run(qkv):
        q, k, v = split_qkv(qkv, heads)
        return explicit_attention(q, k, v, None, 0.0, lambda scores: torch.softmax(scores, dim=-1))[0]

    return run
