"""Adapters for models we don't own: which layers of timm, Hugging Face transformers, torchvision
and plain PyTorch ``patch_model`` swaps for fused ones, and the exactness checks behind each swap.

Classes are recognised by their qualified name (``timm.layers.attention.Attention``), so none of
those libraries is imported here. ``RULES`` maps each such name to its rule; a rule either returns
the replacement or the reason the layer stays as it is.
"""

from vit_kernels.integrations import huggingface, timm, torch_nn, torchvision
from vit_kernels.integrations._common import Rule, Swap

RULES: dict[str, Rule] = {**torch_nn.RULES, **timm.RULES, **huggingface.RULES, **torchvision.RULES}

__all__ = ["RULES", "Rule", "Swap", "huggingface", "timm", "torch_nn", "torchvision"]
