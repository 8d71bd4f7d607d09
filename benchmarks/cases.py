"""The per-op benchmark cases: each op of a ViT block at the shapes of a model preset.

The ops, their inputs, eager references and work counts are ``tools.op_specs`` (which the
tests check against float64 formulas); a case binds one spec to one shape. It makes fresh random
inputs, runs the public op (whichever backend is in force), names the eager reference (what
``torch.compile`` is given), and counts its work: FLOPs for GEMM-like ops (reported as TFLOP/s),
bytes moved for memory-bound ones (reported as GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tools.op_specs import KERNELS, OPS, SPECS, Shape
from vit.model import get_config
from vit_kernels.ops.attention_reference import explicit_attention, split_qkv

__all__ = ["KERNELS", "OPS", "OpCase", "Shape", "build_case", "eager_math_attention", "shape_of"]


# Op shapes of models that are not presets of vit: (tokens, width, heads, MLP hidden, image, patch,
# attention variant). EVA02-B/14 (SwiGLU hidden 2048, interleaved RoPE, a class token), DINOv3-B
# (half-layout RoPE, a class token and 4 registers), a padded NaFlex ViT-B/16 batch (4 registers,
# key-padding mask).
OTHER_MODELS = {
    "eva02_base_patch14_224": (257, 768, 12, 2048, 224, 14, "rope_interleaved"),
    "vit_base_patch16_dinov3": (201, 768, 12, 3072, 224, 16, "rope_half"),
    "naflexvit_base_patch16_gap": (260, 768, 12, 3072, 256, 16, "key_padding"),
}


def shape_of(model: str, batch: int) -> Shape:
    """The op shapes of model preset ``model`` (or of one of OTHER_MODELS) at batch size ``batch``."""
    if model in OTHER_MODELS:
        tokens, dim, heads, hidden, image, patch, attention = OTHER_MODELS[model]
        return Shape(model, batch, tokens, dim, heads, hidden, 3, image, patch, attention)
    config = get_config(model)
    patches = (config.img_size // config.patch_size) ** 2
    hidden = config.mlp_hidden_dim or int(config.embed_dim * config.mlp_ratio)
    return Shape(
        model,
        batch,
        patches + int(config.class_token),
        config.embed_dim,
        config.num_heads,
        hidden,
        config.in_chans,
        config.img_size,
        config.patch_size,
    )


@dataclass(frozen=True)
class OpCase:
    op: str
    shape: Shape
    make_inputs: Callable[[torch.device, torch.dtype], dict[str, torch.Tensor]]
    run: Callable[..., object]  # the public op: vk.<op>(**inputs), or the bare kernel
    reference: Callable[..., object]  # the eager reference with the same inputs
    flops: float  # forward FLOPs (0: memory-bound)
    bytes_per_element: int  # forward tensors read + written, per (rows x D) element
    backward_factor: float = 2.0  # backward work / forward work

    def work(self, mode: str, itemsize: int) -> tuple[float, str]:
        """(amount, unit) of work for ``mode``: FLOPs for GEMM-like ops, bytes for memory-bound ones.
        Backward does twice the forward's GEMM work (2.5x for attention, which recomputes P)."""
        factor = {"forward": 1.0, "backward": self.backward_factor, "full": 1.0 + self.backward_factor}[mode]
        if self.flops:
            return self.flops * factor, "TFLOP/s"
        moved = self.bytes_per_element * self.shape.rows * self.shape.dim * itemsize  # backward counted alike
        return moved * (2.0 if mode == "full" else 1.0), "GB/s"


def build_case(op: str, s: Shape) -> OpCase:
    """The case for ``op`` at shape ``s``."""
    spec = SPECS.get(op)
    if spec is None:
        raise ValueError(f"op must be one of {OPS + KERNELS}, got {op!r}")

    def make_inputs(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return spec.make_inputs(s, device, dtype)

    def run(**inputs):
        return spec.run(s, **inputs)

    def reference(**inputs):
        return spec.reference(s, **inputs)

    return OpCase(
        op, s, make_inputs, run, reference, spec.flops(s), spec.bytes_per_element(s), spec.backward_factor
    )


def eager_math_attention(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Attention as eager PyTorch without SDPA: q k^T, softmax, @ v (what most ViT code did)."""

    def run(qkv):
        q, k, v = split_qkv(qkv, heads)
        return explicit_attention(q, k, v, None, 0.0, lambda scores: torch.softmax(scores, dim=-1))[0]

    return run
