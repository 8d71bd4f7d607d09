"""Measuring the candidates of one call signature: validate each against the reference, time it.

Every candidate runs on clones of the call's real inputs (detached; leaves that require grad where
the originals do), so the caller's autograd graph is untouched; the RNG state of the CPU and of the
call's CUDA device is restored afterwards. With gradients needed, a run is forward + backward (the
gradients of the cloned leaves against a fixed random upstream gradient), else forward only.

Validation is the tile choosers' rule (``_accuracy.first_problem``): every output and every gradient
within twice the error of the reference implementation run in the call's dtype (PyTorch's own), or
within the dtype's floor, against the reference computed in ``_accuracy.reference_dtype`` (float64
for float32 and float64 calls, float32 for 16-bit ones) on the same values, with autocast off.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from vit_kernels import _accuracy, _timer


@dataclass
class Candidate:
    """The outcome for one implementation: its median time, or why it is not valid."""

    backend: str
    time_ms: Optional[float] = None  # the statistic that ranks: min on the CPU, median on CUDA
    median_ms: Optional[float] = None  # the median, which must agree on the CPU (see backend)
    error: Optional[str] = None  # validation failure or exception: the implementation is excluded

    @property
    def valid(self) -> bool:
        return self.error is None


def _clone(a: Any, dtype: Optional[torch.dtype] = None, grad: bool = False) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    c = a.detach().clone()
    if dtype is not None and c.is_floating_point() and c.dtype != torch.float64:
        c = c.to(dtype)
    return c.requires_grad_(grad and a.requires_grad and c.is_floating_point())


def _outputs(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


class _Runner:
    """Runs one implementation on its own clones of the inputs, forward (+ backward)."""

    def __init__(self, fn: Callable, args: Sequence[Any], grad: bool, upstream: Optional[list], dtype=None):
        self.fn, self.grad = fn, grad
        self.args = [_clone(a, dtype, grad) for a in args]
        self.leaves = [a for a in self.args if isinstance(a, torch.Tensor) and a.requires_grad]
        self.upstream = upstream

    def __call__(self) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        with torch.set_grad_enabled(self.grad):
            outs = _outputs(self.fn(*self.args))
            if not self.grad or not self.leaves:
                return [o.detach() for o in outs], []
            if self.upstream is None:
                generator = torch.Generator().manual_seed(0)
                self.upstream = [
                    torch.randn(o.shape, generator=generator).to(o.device, torch.float32) for o in outs
                ]
            pairs = [(o, u.to(o.dtype)) for o, u in zip(outs, self.upstream) if o.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], self.leaves, [u for _, u in pairs], allow_unused=True
            )
            return [o.detach() for o in outs], list(grads)


def _mismatch(
    actual: tuple[list, list], own: tuple[list, list], exact: tuple[list, list], dtype: torch.dtype
) -> Optional[str]:
    """Why a candidate's (outputs, gradients) are wrong, or None: the same tensors, shapes, and each
    within ``_accuracy.first_problem``'s rule against ``exact``, PyTorch's own being ``own``."""
    parts = []
    for what, got, theirs, want in zip(("output", "gradient"), actual, own, exact):
        if len(got) != len(want):
            return f"{len(got)} {what}s, the reference gives {len(want)}"
        for i, (a, p, r) in enumerate(zip(got, theirs, want)):
            if r is None or a is None or p is None:
                if (r is None) != (a is None) and (r if a is None else a).abs().max() > 0:
                    return f"{what} {i} is missing"
                continue
            if a.shape != r.shape:
                return f"{what} {i} has shape {tuple(a.shape)}, the reference {tuple(r.shape)}"
            parts.append((f"{what} {i}", a.detach(), p.detach(), r.detach()))
    return _accuracy.first_problem(parts, _accuracy.FLOORS.get(dtype, _accuracy.FLOORS[torch.float32]))


def _time(runs: dict[str, Callable], device: torch.device) -> dict[str, tuple[float, float]]:
    """(ranking, median) milliseconds per run of each of ``runs`` (after the untimed run that
    validated it), timed by ``_timer.search_times``. On CUDA the median ranks; on the CPU, shared with
    other processes, the minimum (the least disturbed run)."""
    times = _timer.search_times(runs, device)
    pick = statistics.median if device.type == "cuda" else min
    return {name: (pick(t), statistics.median(t)) for name, t in times.items()}


@_accuracy.without_autocast()
def measure(
    candidates: dict[str, Callable],
    args: Sequence[Any],
    validation_args: Sequence[Any],
    device: torch.device,
    dtype: torch.dtype,
    grad: bool,
) -> dict[str, Candidate]:
    """Validate and time each of ``candidates`` (backend -> fn; the reference among them under its
    name) on clones of ``args``. ``validation_args`` are the same call made deterministic (e.g.
    dropout off), used for the comparison; timing uses ``args``."""
    results: dict[str, Candidate] = {}
    reference = candidates["torch"]
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=devices):
        wide = _accuracy.reference_dtype(dtype)
        expected = _Runner(reference, validation_args, grad, None, wide)
        exact = expected()
        own = _Runner(reference, validation_args, grad, expected.upstream)()  # PyTorch's own, in dtype
        runs: dict[str, _Runner] = {}
        for name, fn in candidates.items():
            result = results[name] = Candidate(name)
            try:
                got = own if fn is reference else _Runner(fn, validation_args, grad, expected.upstream)()
                result.error = _mismatch(got, own, exact, dtype)
                if result.error is None:
                    runs[name] = _Runner(fn, args, grad, expected.upstream)
            except Exception as error:  # an implementation that raises is excluded, not fatal
                result.error = f"raised {type(error).__name__}: {error}"
        try:
            for name, (ms, median) in _time(runs, device).items():
                results[name].time_ms, results[name].median_ms = ms, median
                if not math.isfinite(ms):
                    results[name].error = "its time is not finite"
        except Exception as error:
            for name in runs:
                results[name].error = f"raised {type(error).__name__} while timed: {error}"
    return results
