"""Which implementation of each op runs: ``auto | triton | extension | torch``.

Every op (``patch_embed``, ``attention``, ...) has up to three implementations, each registered here
by the module that defines it. The choice is made once per call of an op, from the op name, the
device and the dtype of its main input; nothing here reads the environment after import.

* ``torch``: the pure-PyTorch reference, runs everywhere, the fallback.
* ``triton``: the Triton kernels; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
* ``extension``: the compiled ``vit_kernels._C`` ops (CUDA kernels and C++ CPU kernels).

``auto`` walks the backends in order of preference and takes the first one whose implementation
supports the device and dtype *and* declares itself worth choosing there (an implementation is only
preferred where the benchmarks show it faster than the reference). It never fails: ``torch`` is last.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

BACKENDS = ("triton", "extension", "torch")  # auto's order of preference
CHOICES = ("auto",) + BACKENDS
OPS = ("patch_embed", "attention", "linear_gelu", "linear", "mlp", "layer_norm")

# Read once, at import: the interpreter flag decides whether Triton kernels may run on CPU tensors.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_TRITON = importlib.util.find_spec("triton") is not None

# ``supports(device, dtype)`` returns None when the implementation can run there, else the reason.
SupportCheck = Callable[[torch.device, torch.dtype], Optional[str]]
# ``preferred(device, dtype)`` says whether ``auto`` should pick the implementation there.
Preference = Callable[[torch.device, torch.dtype], bool]


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    fn: Callable
    supports: SupportCheck
    preferred: Preference


def _always(device: torch.device, dtype: torch.dtype) -> None:
    return None


def _everywhere(device: torch.device, dtype: torch.dtype) -> bool:
    return True


_registry: dict[str, dict[str, Implementation]] = {op: {} for op in OPS}
_backend_checks: dict[str, Callable[[], Optional[str]]] = {}
_preference = "auto"


def register(
    op: str,
    backend: str,
    fn: Callable,
    *,
    supports: SupportCheck = _always,
    preferred: Preference = _everywhere,
) -> None:
    """Register ``fn`` as the ``backend`` implementation of ``op``."""
    if op not in _registry:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _registry[op][backend] = Implementation(op, backend, fn, supports, preferred)


def register_backend_check(backend: str, check: Callable[[], Optional[str]]) -> None:
    """Register a whole-backend check: returns None when usable on this machine, else the reason."""
    _backend_checks[backend] = check


def triton_unavailable_reason() -> Optional[str]:
    """Why the Triton backend cannot run on this machine, or None when it can."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not TRITON_INTERPRET:
        return "no CUDA device, and TRITON_INTERPRET=1 is not set for running Triton on the CPU"
    return None


def triton_device_reason(device: torch.device) -> Optional[str]:
    """Why Triton kernels cannot run on tensors of ``device``, or None when they can."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if not TRITON_INTERPRET:
            return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
        return None
    return f"Triton kernels do not run on {device.type} tensors"


def triton_supports_elementwise(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for Triton kernels without tl.dot: float32, float16, bfloat16 on CUDA or the interpreter."""
    reason = triton_device_reason(device)
    if reason is None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"the Triton kernels take float32, float16 or bfloat16, not {dtype}"
    return reason


def triton_supports_dot(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for Triton kernels built on tl.dot, which the interpreter gets wrong in bfloat16."""
    reason = triton_supports_elementwise(device, dtype)
    if reason is None and dtype == torch.bfloat16 and device.type == "cpu":
        reason = "the Triton interpreter computes bfloat16 tl.dot wrongly; bfloat16 runs on CUDA only"
    return reason


def on_cuda(device: torch.device, dtype: torch.dtype) -> bool:
    """``auto`` preference for kernels measured faster than the reference on CUDA (interpreted
    Triton on the CPU never is)."""
    return device.type == "cuda"


register_backend_check("triton", triton_unavailable_reason)
register_backend_check("torch", lambda: None)


def backend_unavailable_reason(backend: str) -> Optional[str]:
    """Why ``backend`` cannot be used on this machine at all, or None when it can."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {CHOICES}, got {backend!r}")
    check = _backend_checks.get(backend)
    if check is None:
        return f"the {backend} backend is not installed"
    return check()


def available_backends() -> dict[str, dict[str, object]]:
    """For each backend and op: ``True`` when it can run here, else the reason why not.

    Example: ``{"triton": {"attention": "triton is not installed ...", ...}, "torch": {...}}``.
    A backend's per-op entry only says whether it can run on this machine at all; whether it
    supports a given device and dtype is decided per call.
    """
    report: dict[str, dict[str, object]] = {}
    for backend in BACKENDS:
        machine_reason = backend_unavailable_reason(backend)
        report[backend] = {}
        for op in OPS:
            if backend not in _registry[op]:
                report[backend][op] = "not implemented by this backend"
            elif machine_reason is not None:
                report[backend][op] = machine_reason
            else:
                report[backend][op] = True
    return report


def get_backend() -> str:
    """The current preference: ``"auto"`` or a backend name."""
    return _preference


def set_backend(name: str) -> None:
    """Prefer ``name`` for every op it implements (``"auto"`` restores the automatic choice).

    Raises ValueError for an unknown name and RuntimeError, with the reason, for a backend that is
    not installed or cannot run on this machine.
    """
    global _preference
    if name not in CHOICES:
        raise ValueError(f"backend must be one of {CHOICES}, got {name!r}")
    if name != "auto":
        reason = backend_unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
    _preference = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: ``with use_backend("torch"): ...`` restores the previous choice on exit."""
    previous = _preference
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def unsupported_reason(op: str, backend: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when ``backend`` implements ``op`` and can run it on ``device`` in ``dtype``, else why not."""
    impl = _registry[op].get(backend)
    if impl is None:
        return f"{backend} does not implement {op}"
    return backend_unavailable_reason(backend) or impl.supports(device, dtype)


def resolve(op: str, device: torch.device, dtype: torch.dtype) -> Implementation:
    """The implementation of ``op`` that runs for a main input on ``device`` with ``dtype``."""
    impls = _registry[op]
    if _preference != "auto" and _preference in impls:
        impl = impls[_preference]
        reason = impl.supports(device, dtype)
        if reason is not None:
            raise RuntimeError(
                f"backend {_preference!r} cannot run {op} on {device.type} {dtype}: {reason}; "
                f"use set_backend('auto') to fall back automatically"
            )
        return impl
    for backend in BACKENDS:
        impl = impls.get(backend)
        if impl is not None and impl.supports(device, dtype) is None and impl.preferred(device, dtype):
            return impl
    return impls["torch"]


def apply_environment() -> None:
    """Take the initial preference from ``VIT_KERNELS_BACKEND`` (called once, after registration)."""
    name = os.environ.get("VIT_KERNELS_BACKEND", "auto").strip() or "auto"
    if name not in CHOICES:
        raise ValueError(f"VIT_KERNELS_BACKEND must be one of {CHOICES}, got {name!r}")
    set_backend(name)

