"""Loads the compiled extension ``vit_kernels._C`` when it was built, and says why when it was not;
one that was built but cannot be loaded (built for another torch) warns at import
(``ExtensionLoadWarning``) with the reason and the command that rebuilds it.
Once it loads, the fake (meta) implementation of each of its ops is registered here (their
autograd is C++, csrc/autograd.cpp), so that they trace under torch.compile.

The ops (schemas in csrc/ops.cpp; rows are the leading dimensions of a contiguous (..., C) tensor):

* ``fused_layer_norm(x, residual?, weight?, bias?, eps) -> (y, s, mean, rstd)``
* ``bias_gelu(x, bias?, approximate) -> gelu(x + bias)``
* ``softmax(x) -> softmax over the last dimension``
* ``patchify(images (N, C, H, W), P) -> (N, (H/P)(W/P), C*P*P)`` and its adjoint ``unpatchify``
* and the backward of each: ``fused_layer_norm_backward``, ``bias_gelu_backward``, ``softmax_backward``.

The package works without the extension: the ``extension`` backend then reports itself unavailable
and ``auto`` never picks it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from vit_kernels import backend

EXTENSION = "vit_kernels._C"


class ExtensionLoadWarning(UserWarning):
    """The compiled extension exists but cannot be loaded (e.g. built against another torch), so the
    ``extension`` backend is off until it is rebuilt. A warning of its own so that it can be
    filtered (or turned into an error) without touching other warnings."""


PACKAGE_DIR = Path(__file__).resolve().parent


def rebuild_command(package_dir: Path = PACKAGE_DIR) -> str:
    """The command that rebuilds the extension for the torch this interpreter imports: an editable
    reinstall of the source checkout holding ``package_dir`` (its build starts from an empty build
    folder, so a stale object is never reused), or a reinstall from source elsewhere."""
    root = package_dir.parent
    pip = f"{sys.executable} -m pip install --no-build-isolation --no-deps"
    if (root / "setup.py").is_file():
        return f"{pip} -e {root}"
    return f"{pip} --force-reinstall <vit-kernels source folder or sdist>"


def _load() -> tuple[Optional[ModuleType], Optional[str]]:
    """(the extension module, None), or (None, why it is unavailable). Never built is the expected
    state of a pure-Python install (VIT_KERNELS_SKIP_EXT=1, no compiler) and stays quiet; built but
    unloadable (an undefined symbol after a torch upgrade, a wrong architecture, a registration
    error) would otherwise leave every ``auto`` choice silently on the slower backends, so it warns,
    once per process, with the reason and the rebuild command."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, f"the compiled extension {EXTENSION} is not built (pip install -e . builds it)"
    try:
        return importlib.import_module(EXTENSION), None
    except Exception as error:  # noqa: BLE001 (an extension's static initialisers can raise anything)
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        where = spec.origin or EXTENSION
        reason = f"the compiled extension {where} was built but failed to load ({detail})"
        warnings.warn(
            f"{reason}; the extension backend is off until it is rebuilt for torch {torch.__version__}: "
            f"{rebuild_command()}",
            ExtensionLoadWarning,
            stacklevel=2,
        )
        return None, reason


_C, _load_error = _load()

LOADED = _C is not None
# The warm call's key read in C++ (csrc/fast_path_key.cpp; absent from an older build: Python's then).
backend.use_native_call_key(getattr(_C, "fast_path_key", None))

# The CUDA kernels exist only when the extension was compiled with nvcc.
HAS_CUDA_KERNELS = _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
    "vit_kernels::fused_layer_norm", "CUDA"
)
CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ExtensionOps:
    """The default overloads of the named ``torch.ops.vit_kernels`` ops, as attributes, looked up
    once (resolving ``torch.ops.<namespace>.<name>`` costs a few microseconds per call)."""

    def __init__(self, *names: str):
        for name in names:
            setattr(self, name, getattr(torch.ops.vit_kernels, name).default)


def extension_unavailable_reason() -> Optional[str]:
    """None when ``vit_kernels._C`` is loaded, else why it is not."""
    return _load_error


def supports(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for the extension's implementations: None when they run on ``device``/``dtype``."""
    if _load_error is not None:
        return _load_error
    if device.type == "cpu":
        return None if dtype in CPU_DTYPES else f"the C++ CPU kernels take {CPU_DTYPES}, not {dtype}"
    if device.type == "cuda":
        if not HAS_CUDA_KERNELS:
            return (
                "vit_kernels._C was built without CUDA kernels (torch without CUDA, or no nvcc at build time)"
            )
        return None if dtype in CUDA_DTYPES else f"the CUDA kernels take {CUDA_DTYPES}, not {dtype}"
    return f"the extension has no kernels for {device.type} tensors"


backend.register_backend_check("extension", extension_unavailable_reason)


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _row_count(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() else 1


def _register_fakes() -> None:
    """Fake (meta) implementations of the C++/CUDA ops, from their schemas (csrc/ops.cpp)."""

    @torch.library.register_fake("vit_kernels::fused_layer_norm")
    def _(x, residual, weight, bias, eps):
        summed = torch.empty_like(x) if residual is not None else x.new_empty((0,))
        stats = x.new_empty((_row_count(x),), dtype=_stat_dtype(x))
        return torch.empty_like(x), summed, stats, torch.empty_like(stats)

    @torch.library.register_fake("vit_kernels::fused_layer_norm_backward")
    def _(grad_out, grad_summed, summed, weight, mean, rstd, weight_bias_grad):
        reduced = summed.new_empty((summed.shape[-1] if weight_bias_grad else 0,), dtype=_stat_dtype(summed))
        return torch.empty_like(summed), reduced, torch.empty_like(reduced)

    @torch.library.register_fake("vit_kernels::bias_gelu")
    def _(x, bias, approximate):
        return torch.empty_like(x)

    @torch.library.register_fake("vit_kernels::bias_gelu_backward")
    def _(grad_out, x, bias, approximate, bias_grad):
        return torch.empty_like(x), x.new_empty((x.shape[-1] if bias_grad else 0,), dtype=_stat_dtype(x))

    @torch.library.register_fake("vit_kernels::attention_explicit")
    def _(qkv, num_heads, scale, dropout_p):
        batch, length, three_d = qkv.shape
        return qkv.new_empty((batch, length, three_d // 3)), qkv.new_empty((batch, num_heads, length, length))

    @torch.library.register_fake("vit_kernels::softmax")
    def _(x):
        return torch.empty_like(x)

    @torch.library.register_fake("vit_kernels::softmax_backward")
    def _(grad_out, out):
        return torch.empty_like(out)

    @torch.library.register_fake("vit_kernels::patchify")  # patchify and unpatchify: each the other's adjoint
    def _(images, patch_size):
        n, c, h, w = images.shape
        return images.new_empty((n, (h // patch_size) * (w // patch_size), c * patch_size * patch_size))

    @torch.library.register_fake("vit_kernels::unpatchify")
    def _(patches, channels, height, width, patch_size):
        return patches.new_empty((patches.shape[0], channels, height, width))


if LOADED:
    _register_fakes()
