"""Argument validation shared by the public ops: clear errors that name the argument and what was
expected, raised before any kernel runs (never a silent broadcast, never a crash in a kernel)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_float_tensor(name: str, t: object, *, ndim: Optional[int] = None, layout: str = "") -> torch.Tensor:
    """``t`` must be a floating-point tensor, with ``ndim`` dimensions when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor{' ' + layout if layout else ''}, got {type(t).__name__}"
        )
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float32, float16, bfloat16 or float64), got {t.dtype}"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {shape_of(t)}".rstrip())
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    """``t`` must have exactly the shape ``expected`` (described as ``layout``)."""
    if shape_of(t) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {shape_of(t)}")


def check_optional_shape(name: str, t: Optional[torch.Tensor], expected: Sequence[int], layout: str) -> None:
    if t is not None:
        check_float_tensor(name, t)
        check_shape(name, t, expected, layout)


def check_same_device(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}: move them to one device"
            )


def check_same_dtype(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != reference.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {reference_name} has {reference.dtype}: they must match"
            )


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_probability(name: str, value: object) -> float:
    """A dropout probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    return float(value)


def check_optional_positive_float(name: str, value: object) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be None or a positive finite float, got {value!r}")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


# device type -> whether autocast exists for it (meta: no); filled for the common types up front, so
# that torch.compile does not trace a first call that fills it (and retrace once it is filled)
_autocast_devices: dict[str, bool] = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta")}


def autocast_dtype_of(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for ``device_type`` tensors, or None when autocast is off there."""
    available = _autocast_devices.get(device_type)
    if available is None:
        available = _autocast_devices.setdefault(device_type, torch.amp.is_autocast_available(device_type))
    if available and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def one_device_and_dtype(
    name: str,
    first: torch.Tensor,
    kept: Optional[dict[str, Optional[torch.Tensor]]] = None,
    /,
    **operands: Optional[torch.Tensor],
) -> tuple[Optional[torch.Tensor], ...]:
    """A GEMM op's tensors checked: ``operands`` and ``kept`` (a residual, a class token: tensors
    added, not multiplied) on ``first``'s device; ``first`` and ``operands`` cast to autocast's dtype
    where it is on; then all of ``first``'s dtype, ``kept`` too unless autocast is on (its adds
    promote). None entries are absent tensors. -> (first, *operands), as cast."""
    kept = kept or {}
    check_same_device(name, first, **operands, **kept)
    amp = autocast_dtype_of(first.device.type)
    first, *cast = cast_all(amp, first, *operands.values())
    check_same_dtype(name, first, **dict(zip(operands, cast)))
    if amp is None:
        check_same_dtype(name, first, **kept)
    return (first, *cast)


def cast_all(
    dtype: Optional[torch.dtype], *tensors: Optional[torch.Tensor]
) -> tuple[Optional[torch.Tensor], ...]:
    """Cast every tensor to ``dtype`` (None leaves them as they are)."""
    if dtype is None:
        return tensors
    return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in tensors)
