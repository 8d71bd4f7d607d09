"""vit-kernels: fused kernels for Vision Transformers as drop-in PyTorch ops and layers.

    import vit_kernels as vk
    out = vk.attention(qkv, num_heads=12)          # qkv (B, L, 3*D) -> (B, L, D)
    vk.set_backend("torch")                          # or "auto" | "triton" | "extension"
"""

from vit_kernels import _ext  # noqa: F401  (registers the extension backend check)
from vit_kernels.backend import available_backends, get_backend, set_backend, use_backend
from vit_kernels.functional import attention, layer_norm, linear, linear_gelu, mlp, patch_embed

from vit_kernels import backend as _backend

_backend.apply_environment()

from vit_kernels.patching import PatchReport, patch_model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "attention",
    "available_backends",
    "get_backend",
    "layer_norm",
    "linear",
    "linear_gelu",
    "mlp",
    "patch_embed",
    "patch_model",
    "PatchReport",
    "set_backend",
    "use_backend",
]
