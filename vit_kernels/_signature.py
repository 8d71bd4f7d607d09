"""Call signatures for dispatch: what ``auto`` measures once and caches, and what ``explain`` lists.

A signature is (op, device name, dtype, argument shapes with the batch bucketed, flags, whether
gradients are needed). Tensors become their shape (the first tensor's leading dimension, and that
of every other tensor of 3 or more dimensions, rounded up to a power of two, so batch sizes 5..8
share one decision), a dtype when it differs from the op's, and whether they are contiguous; the
other arguments (flags, eps, scale, ...) are kept by value.
"""

from __future__ import annotations

import functools
import platform
from typing import Any, Sequence

import torch


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 stays 0): the batch bucket of a signature."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _tensor_part(t: torch.Tensor, dtype: torch.dtype, first: bool) -> tuple:
    shape = tuple(t.shape)  # torch.Size holds Python ints
    if shape and (first or len(shape) >= 3):
        shape = (bucket(shape[0]),) + shape[1:]
    return (shape, "" if t.dtype is dtype else str(t.dtype)[6:], t.is_contiguous())  # "torch.float16"[6:]


_PLAIN = (type(None), bool, int, float, str)


def argument_key(args: Sequence[Any], dtype: torch.dtype) -> tuple:
    """The hashable, JSON-friendly part of a signature that describes the arguments. (On every
    call's path: kept to a few microseconds.)"""
    parts = []
    first = True
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(_tensor_part(a, dtype, first))
            first = False
        elif isinstance(a, _PLAIN):
            parts.append(a)
        else:
            parts.append(type(a).__name__)
    return tuple(parts)


def describe_arguments(key: tuple) -> str:
    """A short human-readable form of ``argument_key``: ``(B~8,197,192)x(192,) eps=1e-06``."""
    words = []
    for part in key:
        if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], tuple):
            shape, dtype, contiguous = part
            text = "(" + ",".join(str(s) for s in shape) + ")"
            text += (f":{dtype}" if dtype else "") + ("" if contiguous else ":strided")
            words.append(text)
        elif part is None:
            words.append("-")
        else:
            words.append(repr(part))
    return " ".join(words)


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The hardware a decision was measured on: ``cpu (<model name>)`` or ``cuda (<GPU name>)``."""
    if device.type == "cuda":
        return (
            f"cuda ({_cuda_name(device.index if device.index is not None else torch.cuda.current_device())})"
        )
    if device.type == "cpu":
        return f"cpu ({_cpu_name()})"
    return device.type


def needs_grad(args: Sequence[Any]) -> bool:
    """Whether the call will record autograd history: grad mode on and some tensor requires grad."""
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph (torch.cuda.graph, CUDA-graph trees):
    nothing may synchronise or be timed there."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def untimeable(args: Sequence[Any]) -> bool:
    """True when the call's tensors are not real data on a real device (fake, meta, functorch or other
    tensor subclasses, a python dispatch mode such as FakeTensorMode or make_fx's proxy mode, or
    TorchScript tracing), or a CUDA graph is being captured: nothing may be timed, and the cached
    decision or the table decides."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or capturing_cuda_graph():
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return True
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in (torch.Tensor, torch.nn.Parameter) or a.device.type == "meta":
                return True
            if torch._C._functorch.is_functorch_wrapped_tensor(a):
                return True
    return False


def traced_key(args: Sequence[Any]) -> tuple:
    """The part of a signature that can be read while torch.compile traces without specialising on
    (or guarding) any size: which arguments are tensors ("tensor") and the others by value. Under
    tracing a measured decision is matched by op, device, dtype and grad mode (see backend)."""
    return tuple(
        "tensor" if isinstance(a, torch.Tensor) else a if isinstance(a, _PLAIN) else type(a).__name__
        for a in args
    )
