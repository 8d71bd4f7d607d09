"""Triton, imported softly: the package imports (and its kernels' modules define themselves) without
triton installed; the Triton backend then reports itself unavailable and nothing launches.

Kernel modules write ``from vit_kernels._triton import triton, tl`` and decorate with
``@triton.jit`` as usual.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Callable, Iterator

import torch

from vit_kernels._autograd import tracing

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    try:  # host-side TMA descriptors (triton 3.4+)
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - older triton: the TMA kernels are not offered
        TensorDescriptor = None
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    def _jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(
        jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (n - 1).bit_length()
    )
    tl = types.SimpleNamespace(constexpr=object)
    TensorDescriptor = None


if HAS_TRITON:

    @triton.jit
    def as_float32(x):
        """A float scalar argument as float32. Triton's own launcher passes Python floats as fp32,
        but torch.compile (Inductor) passes them as fp64, which would turn every expression that
        touches them into fp64 (and fail where a loop-carried fp32 value meets one): kernels
        convert their float scalars once, on entry."""
        return tl.cast(x, tl.float32)
else:  # pragma: no cover

    def as_float32(x):
        return x


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers. ``triton.cdiv`` is a ConstexprFunction: about 2 us a call on
    the host, against 0.1 us for this; launchers call it several times per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


LAUNCH_CONFIGS = 4096  # distinct calls each launch lookup keeps (lru_cache's maxsize, a plan table's size)


def cached_call(made: Callable, *args):
    """``made(*args)`` of a ``functools.lru_cache``'d ``made`` (a launch's configuration from the
    call's sizes: a decided call looks it up); made afresh, and kept nowhere, where the sizes are
    symbolic (torch.compile with dynamic shapes: a SymInt has no hash)."""
    try:
        return made(*args)
    except TypeError:
        return made.__wrapped__(*args)


def dot_precision(dtype) -> str:
    """tl.dot input precision: exact products for float32 inputs (tf32 would lose accuracy that
    PyTorch's float32 reference keeps); 16-bit inputs multiply exactly either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted(device) -> bool:
    """Whether kernels launched on tensors of ``device`` run in the Triton interpreter: CPU tensors
    (only possible under TRITON_INTERPRET=1). CUDA tensors get the GPU's launch configurations."""
    return device.type == "cpu"


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (asked once); 2 under the interpreter, so that the CPU tests walk several
    tiles per program."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device()
        ).multi_processor_count
    return 2


_recorders: dict[int, list] = {}  # thread id -> the launches recorded there instead of run


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Inside the block, this thread's launches are appended to the yielded list as (kernel, grid,
    args, kwargs) instead of being run (``vit_kernels._proof`` replays them in a child process)."""
    thread = threading.get_ident()
    outer = _recorders.get(thread)
    launches = _recorders[thread] = []
    try:
        yield launches
    finally:
        if outer is None:
            del _recorders[thread]
        else:
            _recorders[thread] = outer


def recording() -> bool:
    """Whether this thread's launches are being recorded (``recorded_launches``)."""
    return bool(_recorders) and threading.get_ident() in _recorders


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``: through ``torch.library.wrap_triton`` while tracing
    (so that torch.compile and fake tensors see it), directly in eager mode; recorded instead inside
    ``recorded_launches``."""
    recorded = _recorders.get(threading.get_ident()) if _recorders else None  # an empty dict: one test
    if recorded is not None:
        recorded.append((kernel, grid, args, kwargs))
    elif tracing():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    else:  # eager: no tracing wrapper to build and consult on every launch
        kernel[grid](*args, **kwargs)


__all__ = [
    "HAS_TRITON",
    "TensorDescriptor",
    "cdiv",
    "dot_precision",
    "as_float32",
    "cached_call",
    "LAUNCH_CONFIGS",
    "interpreted",
    "launch",
    "multiprocessors",
    "next_power_of_2",
    "recorded_launches",
    "recording",
    "triton",
    "tl",
]
