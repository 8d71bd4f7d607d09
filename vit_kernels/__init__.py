"""vit-kernels: fused kernels for Vision Transformers as drop-in PyTorch ops and layers.

import vit_kernels as vk
out = vk.attention(qkv, num_heads=12)          # qkv (B, L, 3*D) -> (B, L, D)
vk.set_backend("torch")                          # or "auto" | "triton" | "extension"
with vk.use_backend("triton", strict=True): ...  # this thread / task only; raise, don't fall back
vk.tune(model, (images,), autocast=torch.bfloat16)  # search backends and tiles (asked for only)
vk.save_tuning("tuning.json"); vk.load_tuning("tuning.json")  # ship what was searched
print(vk.explain())                              # what ran for each signature, and why
vk.selftest()                                    # once on a new GPU: every backend against float64
"""

from vit_kernels import _ext  # noqa: F401  (registers the extension backend check)
from vit_kernels import backend as _backend
from vit_kernels.backend import available_backends, explain, get_backend, set_backend, use_backend
from vit_kernels.functional import (
    attention,
    layer_norm,
    linear,
    linear_gelu,
    mlp,
    patch_embed,
    swiglu,
    swiglu_mlp,
)

__version__ = "0.1.0"

_backend.apply_environment()

from vit_kernels.patching import PatchReport, patch_model  # noqa: E402
from vit_kernels.tuning import load_tuning, save_tuning, tune  # noqa: E402


def __getattr__(name: str):
    """``vk.selftest``, imported when first asked for (its module, callable as ``vk.selftest()``):
    not at import, so that ``python -m vit_kernels.selftest`` runs a module imported once."""
    if name == "selftest":
        import importlib

        return importlib.import_module("vit_kernels.selftest")
    raise AttributeError(f"module 'vit_kernels' has no attribute {name!r}")


__all__ = [
    "attention",
    "available_backends",
    "explain",
    "get_backend",
    "layer_norm",
    "linear",
    "linear_gelu",
    "load_tuning",
    "mlp",
    "patch_embed",
    "patch_model",
    "PatchReport",
    "save_tuning",
    "selftest",
    "set_backend",
    "swiglu",
    "swiglu_mlp",
    "tune",
    "use_backend",
]
