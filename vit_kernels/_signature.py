"""Call signatures: what ``vk.tune`` decides per, and what ``explain`` lists.

A signature is (op, device name, dtype, whether gradients are needed, the arguments): tensors become
their shape (the first tensor's leading dimension, and that of every other tensor of 3 or more
dimensions, rounded up to a power of two, so batch sizes 5..8 share one decision), a dtype where it
differs from the op's and whether they are contiguous; other arguments are kept by value.
"""

from __future__ import annotations

import functools
import platform
from typing import Any, Sequence

import torch

_PLAIN = (type(None), bool, int, float, str)


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 stays 0): the batch bucket of a signature."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def argument_key(args: Sequence[Any], dtype: torch.dtype) -> tuple:
    """The hashable, JSON-friendly part of a signature that describes the arguments."""
    parts, first = [], True
    for a in args:
        if isinstance(a, torch.Tensor):
            shape = tuple(a.shape)
            if shape and (first or len(shape) >= 3):
                shape = (bucket(shape[0]),) + shape[1:]
            parts.append((shape, "" if a.dtype is dtype else str(a.dtype)[6:], a.is_contiguous()))
            first = False
        else:
            parts.append(a if isinstance(a, _PLAIN) else type(a).__name__)
    return tuple(parts)


def describe_arguments(key: tuple) -> str:
    """``argument_key`` for people: ``(B~8,197,192) (192) 1e-06``."""
    words = []
    for part in key:
        if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], tuple):
            shape, dtype, contiguous = part
            words.append(
                f"({','.join(map(str, shape))})"
                + (f":{dtype}" if dtype else "")
                + ("" if contiguous else ":strided")
            )
        else:
            words.append("-" if part is None else repr(part))
    return " ".join(words)


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    """The hardware a decision is for: ``cpu (<model name>)`` or ``cuda (<GPU name>)``."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())})"
    return f"cpu ({_cpu_name()})" if device.type == "cpu" else device.type


def needs_grad(args: Sequence[Any]) -> bool:
    """Whether the call will record autograd history: grad mode on and some tensor requires grad."""
    if torch.is_grad_enabled():
        for a in args:  # a loop, not a generator: on the warm call's path, a frame costs
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return True
    return False


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph: nothing may synchronise or be timed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def untimeable(args: Sequence[Any]) -> bool:
    """Whether the call's tensors are not real data on a real device (fake, meta, functorch or other
    subclasses, a dispatch mode, TorchScript tracing, graph capture): nothing may be timed."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or torch.jit.is_tracing() or capturing_cuda_graph():
        return True
    if _get_current_dispatch_mode() is not None:
        return True
    return any(
        isinstance(a, torch.Tensor)
        and (
            type(a) not in (torch.Tensor, torch.nn.Parameter)
            or a.device.type == "meta"
            or torch._C._functorch.is_functorch_wrapped_tensor(a)
        )
        for a in args
    )


def traced_key(args: Sequence[Any]) -> tuple:
    """The part of a signature readable while torch.compile traces without specialising on a size:
    which arguments are tensors, the others by value."""
    return tuple(
        "tensor" if isinstance(a, torch.Tensor) else a if isinstance(a, _PLAIN) else type(a).__name__
        for a in args
    )
