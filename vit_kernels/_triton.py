"""Triton, imported softly: the package imports (and its kernels' modules define themselves) without
triton installed; the Triton backend then reports itself unavailable and nothing launches.

Kernel modules write ``from vit_kernels._triton import triton, tl`` and decorate with
``@triton.jit`` as usual.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, NamedTuple

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

    class _Constexpr:
        """``tl.constexpr``'s stand-in: an annotation, or a kernel module's named constant."""

        def __init__(self, value=None):
            self.value = value

    triton = types.SimpleNamespace(
        jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (n - 1).bit_length()
    )
    tl = types.SimpleNamespace(constexpr=_Constexpr)
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
    """ceil(a / b) of host integers. ``triton.cdiv`` is a ConstexprFunction, whose dispatch costs the
    host many times this division; launchers call it several times per launch."""
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


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> int:
    """A CUDA device's compute capability as major * 10 + minor (90 for an H100); 0 elsewhere. The
    tables' per-architecture defaults are keyed by it."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


class LaunchPlan(NamedTuple):
    """One kernel launch of a decided call, besides its tensors (``_tiles.decided``): the launchers'
    ``plan`` for ops with one kernel and one output dtype."""

    grid: tuple
    args: tuple  # the kernel's arguments after the tensors
    config: dict  # the constexprs and warps
    dtype: torch.dtype  # the outputs'
    device: torch.device


# Every kernel is compiled with FP fusion (a * b + c contracted to one fused multiply-add) on, stated
# at each launch rather than left to Triton's default, which Triton 3.10 turns off: the kernels'
# accuracy (the float32 block sums the tests bound) and the compile gate's registers and spills are
# those of the contracted code. Under torch.compile, Inductor compiles the kernels with its options.
FP_FUSION = True


def launch(kernel, grid: tuple, *args, eager: bool = False, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``: through ``torch.library.wrap_triton`` while tracing
    (so that torch.compile and fake tensors see it), directly in eager mode (``eager``: the caller
    found that nothing traces the call, not asked again)."""
    if not eager and tracing():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        kernel[grid](*args, enable_fp_fusion=FP_FUSION, **kwargs)
