"""A Vision Transformer family on the fused ``vit_kernels`` layers: model, presets, data, training."""

from vit.model import PRESETS, ViT, ViTConfig, create_model, get_config, list_models
from vit.weights import LoadReport, load_pretrained

__all__ = [
    "PRESETS",
    "LoadReport",
    "ViT",
    "ViTConfig",
    "create_model",
    "get_config",
    "list_models",
    "load_pretrained",
]
