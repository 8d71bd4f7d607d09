"""Triton, imported softly: the package imports (and its kernels' modules define themselves) without
triton installed; the Triton backend then reports itself unavailable and nothing launches.

Kernel modules write ``from vit_kernels._triton import triton, tl`` and decorate with
``@triton.jit`` as usual.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
import types
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from vit_kernels import _env
from vit_kernels._autograd import tracing
from vit_kernels._logging import LOGGER

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


def launch(kernel, grid: tuple, *args, plan=None, eager: bool = False, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``: through ``torch.library.wrap_triton`` while tracing
    (so that torch.compile and fake tensors see it), directly in eager mode; recorded instead inside
    ``recorded_launches``. ``plan``: the launch plan the grid, the arguments that are not tensors and
    the keywords come from (a plan table's value, which stays the same object while it is current):
    a call of the same plan with tensors of the same dtypes and 16-byte alignment launches the kernel
    its first call compiled directly (``DirectLaunch``). ``eager``: the caller found that nothing
    traces the call (not asked again). With the package's log at INFO, an eager launch of a new
    variant is a log line (``_run_logged``)."""
    recorded = _recorders.get(threading.get_ident()) if _recorders else None  # an empty dict: one test
    if recorded is not None:
        recorded.append((kernel, grid, args, {**kwargs, "enable_fp_fusion": FP_FUSION}))
    elif not eager and tracing():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    elif plan is None or not _direct["enabled"]:  # eager: no tracing wrapper to build and consult
        if LOGGER.isEnabledFor(logging.INFO):
            _run_logged(kernel, grid, args, kwargs)
        else:
            kernel[grid](*args, enable_fp_fusion=FP_FUSION, **kwargs)
    else:
        direct = _direct_launches.get((kernel, id(plan)))
        if direct is None or direct.plan is not plan or not direct(args):
            if LOGGER.isEnabledFor(logging.INFO):
                compiled = _run_logged(kernel, grid, args, kwargs)
            else:
                compiled = kernel[grid](*args, enable_fp_fusion=FP_FUSION, **kwargs)
            if len(_direct_launches) >= LAUNCH_CONFIGS:
                _direct_launches.clear()
            _direct_launches[(kernel, id(plan))] = DirectLaunch.of(kernel, plan, grid, compiled, args, kwargs)


def _run_logged(kernel, grid: tuple, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)`` in eager mode with the package's log at INFO
    (``vk.set_verbosity("info")``), returning what it returns (the compiled kernel on a GPU): each
    new variant of a kernel (a first call of its launch configuration, dtypes and specialisation) is
    a log line with the seconds its first launch took: its compile, or its load from Triton's
    on-disk cache."""
    before = _variants(kernel)
    started = time.perf_counter()
    compiled = kernel[grid](*args, enable_fp_fusion=FP_FUSION, **kwargs)
    seconds = time.perf_counter() - started
    if before is not None and _variants(kernel) <= before:  # a variant Triton had: nothing to say
        return compiled
    config = " ".join(f"{k}={v}" for k, v in kwargs.items())
    dtypes = ",".join(dict.fromkeys(str(a.dtype)[6:] for a in args if isinstance(a, torch.Tensor)))
    if before is not None:
        how = "compiled, or loaded from Triton's cache"
    else:  # the interpreter, or a Triton that keeps its variants elsewhere: the first launch
        if (kernel, config, dtypes) in _first_launches:
            return compiled
        _first_launches.add((kernel, config, dtypes))
        interpreted = type(kernel).__name__ == "InterpretedFunction"
        how = (
            "interpreted"
            if interpreted
            else "its variants not counted: the first launch of its configuration"
        )
    name = getattr(kernel, "fn", kernel).__name__
    LOGGER.info("kernel %s %s for %s: first launch in %.2f s (%s)", name, config, dtypes, seconds, how)
    return compiled


_first_launches: set = set()  # (kernel, config, dtypes) launched, where Triton's variants are not counted


def _variants(kernel) -> Optional[int]:
    """How many variants of ``kernel`` Triton has compiled or loaded in this process, on every device
    (its per-device caches, whose first member maps a specialisation to its compiled kernel); None
    where it keeps none (the interpreter)."""
    caches = getattr(kernel, "device_caches", None)
    return None if caches is None else sum(len(cache[0]) for cache in caches.values())


class DirectLaunch:
    """A compiled kernel launched without Triton's per-call work, for the calls of one launch plan.

    ``kernel[grid](*args)`` binds every argument, works out its specialisation (each tensor's dtype
    and 16-byte alignment, each integer's divisibility by 16 and equality to 1), builds a text key
    from it and the options and looks the compiled kernel up, on every call. Within one plan
    everything but the tensors' data is fixed (the plan was made from the call's shapes, strides,
    dtypes and device), so a later call of the plan that passes tensors of the same dtype and
    alignment at the same places and the same other arguments is the same specialisation: its
    compiled kernel is launched by ``CompiledKernel[grid]``, the launcher ``kernel[grid]`` ends in,
    with the argument list ``kernel[grid]`` gives it (every parameter in order: the positional
    arguments, then the keywords' and defaults' values), on the current stream as ``kernel[grid]``.
    Any other call (or one on another current device) takes ``kernel[grid]``, which compiles or finds
    its kernel and becomes the plan's direct launch. What Triton reads per call besides the
    arguments (its ``knobs``' debug and instrumentation options, a kernel's pre-run hooks, changed
    globals) is read at the plan's first call only."""

    __slots__ = ("plan", "device", "checks", "split", "scalars", "tail", "run")

    def __init__(self, plan, device: int, checks: tuple, split: int, scalars: tuple, tail: tuple, run):
        self.plan = plan
        self.device = device  # the current device its kernel was loaded on
        self.checks = checks  # (index, (dtype, 16-byte aligned) of a tensor, else the value) up to split
        self.split = split  # the arguments from here on are neither tensors nor None
        self.scalars = scalars
        self.tail = tail
        self.run = run

    @staticmethod
    def of(kernel, plan, grid: tuple, compiled, args: tuple, kwargs: dict):
        """The direct launch of ``plan`` after ``compiled = kernel[grid](*args, **kwargs)``, or None
        where ``compiled`` is no compiled kernel (the interpreter) or the arguments cannot be laid
        out as ``kernel[grid]`` lays them out."""
        if not isinstance(compiled, triton.compiler.CompiledKernel):
            return None
        parameters = _parameters(kernel.fn)
        if len(args) > len(parameters):
            return None
        tail = []
        for parameter in parameters[len(args) :]:
            if parameter.name not in kwargs and parameter.default is parameter.empty:
                return None
            tail.append(kwargs.get(parameter.name, parameter.default))
        split = max(
            (i + 1 for i, a in enumerate(args) if a is None or isinstance(a, torch.Tensor)), default=0
        )
        checks = tuple(
            (i, (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a)
            for i, a in enumerate(args[:split])
        )
        # CompiledKernel[grid] reads three dimensions where kernel[grid] fills the missing ones with 1
        grid = (*grid, *(1,) * (3 - len(grid)))
        return DirectLaunch(
            plan, torch.cuda.current_device(), checks, split, args[split:], tuple(tail), compiled[grid]
        )

    def __call__(self, args: tuple) -> bool:
        """Launch on ``args`` if they are the same specialisation; whether it launched."""
        if args[self.split :] != self.scalars:
            return False
        for i, expected in self.checks:
            a = args[i]
            if isinstance(a, torch.Tensor):
                if expected != (a.dtype, a.data_ptr() % 16 == 0):
                    return False
            elif a is not expected and a != expected:
                return False
        if torch.cuda.current_device() != self.device:
            return False
        self.run(*args, *self.tail)
        return True


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> tuple:
    """A kernel's Python function's parameters, in order."""
    return tuple(inspect.signature(fn).parameters.values())


# Off unless VIT_KERNELS_DIRECT_LAUNCH=1: on an H200 it gave kernel[grid]'s bits for the five ops whose
# warm calls launch planned kernels and saved 9-44 us per call (benchmarks/results/h200-2026-11-28.md);
# the GEMM ops' case (the pointer kernel) has not run on a GPU yet (make test-gpu's
# tests/test_direct_launch.py), nor a whole model (the end-to-end table's vk-direct).
_direct = {"enabled": _env.flag("VIT_KERNELS_DIRECT_LAUNCH", default=False)}
_direct_launches: dict = {}  # (kernel, id(plan)) -> DirectLaunch of that plan, or None


@contextlib.contextmanager
def direct_launch(enabled: bool) -> Iterator[None]:
    """Inside the block, whether a plan's later calls launch its compiled kernel directly
    (``DirectLaunch``) or every launch goes through ``kernel[grid]`` (for the whole process, every
    thread: the benchmarks' and tests' switch; ``VIT_KERNELS_DIRECT_LAUNCH`` sets it at import)."""
    before, _direct["enabled"] = _direct["enabled"], enabled
    try:
        yield
    finally:
        _direct["enabled"] = before
