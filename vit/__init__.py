"""A Vision Transformer family on the fused ``vit_kernels`` layers: model, presets, data, training."""

from vit.model import PRESETS, ViT, ViTConfig, create_model, get_config, list_models

__all__ = ["PRESETS", "ViT", "ViTConfig", "create_model", "get_config", "list_models"]
