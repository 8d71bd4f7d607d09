"""The one accuracy rule: a result is right when its error is at most twice PyTorch's own in the
same dtype, or below the dtype's floor.

Errors are measured against an exact reference (float64 for float32 inputs, float32 for 16-bit
ones), relative to the reference's largest magnitude. The table choosers' checks, ``auto``'s
validation when it measures, the selftest, the benchmarks and the GPU tests all judge by it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence

import torch


def relative_error(actual: torch.Tensor, reference: torch.Tensor, scale: float = 0.0) -> float:
    """max |actual - reference| / max(max |reference|, ``scale``, tiny), in float64 (inf where NaN
    appears; 0 for empty tensors)."""
    if reference.numel() == 0:
        return 0.0
    difference = (actual.double() - reference.double()).abs()
    if difference.isnan().any():
        return math.inf
    return difference.max().item() / max(reference.double().abs().max().item(), scale, 1e-30)


# A part's error is measured against at least this share of the largest reference among the parts
# checked together: a part that is zero in exact arithmetic (attention's dQ and dK at length 1, a
# width-1 LayerNorm's input gradient) is then judged by the scale of its siblings instead of by its
# own rounding residue of 1e-17, against which PyTorch's own answer and an exact zero both fail.
SIBLING_SCALE = 1e-3


def sibling_scale(references: Sequence[Optional[torch.Tensor]]) -> float:
    """SIBLING_SCALE x the largest max |reference| among ``references`` (None and empty ones left
    out): the least scale each of them is measured against; 0 where any is not finite."""
    largest = max(
        (float(r.double().abs().max()) for r in references if r is not None and r.numel()), default=0.0
    )
    return SIBLING_SCALE * largest if math.isfinite(largest) else 0.0


# The rule: a result is right when its error is at most ERROR_RATIO x PyTorch's own in the same dtype
# (or below the dtype's floor, FLOORS below).
ERROR_RATIO = 2.0


def first_problem(
    parts: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], floor: float
) -> Optional[str]:
    """None when every ``(name, actual, pytorch, reference)`` part is right, else the first failure:
    ``actual``'s error against ``reference`` at most twice ``pytorch``'s (the same computation by
    PyTorch in the same dtype) or below ``floor``, both relative to max(max |reference|,
    SIBLING_SCALE x the largest max |reference| of the parts)."""
    parts = list(parts)
    scale = sibling_scale([reference for *_, reference in parts])
    for name, actual, pytorch, reference in parts:
        error, own = relative_error(actual, reference, scale), relative_error(pytorch, reference, scale)
        if error > max(ERROR_RATIO * own, floor):
            return f"{name}: relative error {error:.2e} > {ERROR_RATIO:g} x PyTorch's {own:.2e} (floor {floor:.0e})"
    return None


def check_against(
    names: Sequence[str],
    references: Callable[[], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    dtype: torch.dtype,
    parts_of: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] = list,
) -> Callable[[Sequence[torch.Tensor]], Optional[str]]:
    """A check for the TileChooser, by ``first_problem``'s rule with ``dtype``'s floor: the named
    parts of a candidate's outputs (``parts_of(outputs)``: all of them by default) against
    ``references() -> (exact, PyTorch's own in the same dtype)``, made once, at the first check."""
    made: list = []

    def check(outputs: Sequence[torch.Tensor]) -> Optional[str]:
        if not made:
            made.extend(references())
        exact, own = made
        return first_problem(list(zip(names, parts_of(outputs), own, exact, strict=True)), FLOORS[dtype])

    return check


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a candidate's exact reference is computed in: float64 for float32 (and float64)
    inputs, float32 for 16-bit ones."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


# The rule's floor per dtype: a relative error (of the largest reference magnitude) below which any
# result passes, so that results PyTorch happens to get (nearly) exact do not fail every candidate.
# In units of the dtype's eps (2^-10 float16, 2^-7 bfloat16, 2^-23 float32, 2^-52 float64):
# - float16 and bfloat16, one unit (9.8e-4, 7.8e-3): an output rounded once to the dtype passes, and
#   the H100's wrong dK (off by 1.3e-2 to 8.4e-2 where PyTorch's own error was 5e-4 in float16 and
#   4e-3 in bfloat16, benchmarks/results/h100-2026-11-22.md) fails;
# - float32, four units (4.8e-7): PyTorch's own error is itself one or two units (cuBLAS, SDPA), and
#   another summation order as exact differs by as much (the Triton GEMMs and attention at 1.3 to
#   3.8 units, PyTorch at 0.4 to 1.6: benchmarks/results/h200-2026-11-26.md);
# - float64, 4096 units (9.1e-13): the same exact sums in other orders.
# One table for the tile choosers, auto, the selftest, the benchmarks and the GPU tests
# (tests/helpers.error_bound).
FLOOR_ULPS = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 4, torch.float64: 4096}
FLOORS = {dtype: units * torch.finfo(dtype).eps for dtype, units in FLOOR_ULPS.items()}


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off on every device type: validation compares against a float64 / float32 reference
    that autocast would otherwise compute in 16 bits (then PyTorch's own error reads 0 and the rule
    proves nothing), and candidates run as the kernels' launchers call them."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield
