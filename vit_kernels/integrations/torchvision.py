"""torchvision's ViT (``vit_b_16`` and family) on the fused ops.

Its ``EncoderBlock`` is made of layers patched elsewhere (``nn.LayerNorm``, ``nn.MultiheadAttention``
with batch_first) and an ``MLPBlock``, which keeps its class (and its ``0``/``3`` state-dict keys) and
computes ``forward`` with the fused MLP. The patch projection ``conv_proj`` is called by the model's
own ``_process_input``, so it is left alone (and listed as skipped).
"""

from __future__ import annotations

from torch import nn

from vit_kernels import nn as vkn
from vit_kernels.integrations._common import (
    Rule,
    Swap,
    activation_name,
    unknown_forward_args,
    with_fused_forward,
)


def mlp_block_forward(self, input):
    """(..., D) -> (..., D): Linear, activation, Dropout, Linear, Dropout."""
    fc1, act, drop1, fc2, drop2 = self
    return vkn.feed_forward(
        input, fc1, fc2, activation_name(act), hidden_drop=drop1.p, out_drop=drop2.p, training=self.training
    )


def swap_mlp_block(module: nn.Module) -> Swap:
    why = unknown_forward_args(module, ("input",))
    if why:
        return Swap.skip(why)
    layers = list(module)
    kinds = [type(layer) for layer in layers]
    if (
        len(layers) != 5
        or kinds[0] is not nn.Linear
        or kinds[3] is not nn.Linear
        or kinds[2] is not nn.Dropout
        or kinds[4] is not nn.Dropout
        or activation_name(layers[1]) is None
    ):
        return Swap.skip(
            f"is not Linear, GELU/ReLU, Dropout, Linear, Dropout (got {[k.__name__ for k in kinds]})"
        )
    return Swap(with_fused_forward(module, mlp_block_forward), descend=False)


RULES: dict[str, Rule] = {
    "torchvision.models.vision_transformer.MLPBlock": swap_mlp_block,
}
