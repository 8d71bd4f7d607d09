"""The one accuracy rule: a result is right when its error is at most twice PyTorch's own in the same
dtype, or below the dtype's floor. Errors are measured against an exact reference (float64 for
float32 inputs, float32 for 16-bit ones), relative to the reference's largest magnitude. ``vk.tune``'s
validation, the selftest, the benchmarks and the GPU tests judge by it (docs/tiles-and-validation.md).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import torch

ERROR_RATIO = 2.0
# A part's error is measured against at least this share of the largest reference among the parts
# checked together: a part that is zero in exact arithmetic (attention's dQ and dK at length 1) is
# judged by its siblings' scale, not by its own rounding residue, which an exact zero fails too.
SIBLING_SCALE = 1e-3
# The floor per dtype in units of its eps: one unit in 16 bits (an output rounded once passes, the
# H100's wrong dK of 1.3e-2 to 8.4e-2 fails: benchmarks/results/h100-2026-11-22.md); four in float32,
# where PyTorch's own error is one or two units and another exact summation order as many.
FLOOR_ULPS = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 4, torch.float64: 4096}
FLOORS = {dtype: units * torch.finfo(dtype).eps for dtype, units in FLOOR_ULPS.items()}


def relative_error(actual: torch.Tensor, reference: torch.Tensor, scale: float = 0.0) -> float:
    """max |actual - reference| / max(max |reference|, ``scale``), in float64 (inf with NaN; 0 empty)."""
    if reference.numel() == 0:
        return 0.0
    difference = (actual.double() - reference.double()).abs()
    if difference.isnan().any():
        return math.inf
    return difference.max().item() / max(reference.double().abs().max().item(), scale, 1e-30)


def sibling_scale(references: Sequence[Optional[torch.Tensor]]) -> float:
    """SIBLING_SCALE x the largest max |reference| among ``references`` (0 where any is not finite)."""
    sizes = [float(r.double().abs().max()) for r in references if r is not None and r.numel()]
    largest = max(sizes, default=0.0)
    return SIBLING_SCALE * largest if math.isfinite(largest) else 0.0


def errors(results: Sequence[Optional[torch.Tensor]], exact: Sequence[torch.Tensor]) -> list[float]:
    """Each result's ``relative_error`` against its exact value, all on the siblings' scale (a
    missing result, such as a gradient not computed, reads as zeros)."""
    scale = sibling_scale(exact)
    return [
        relative_error(torch.zeros_like(e) if r is None else r.to(e.device), e, scale)
        for r, e in zip(results, exact, strict=True)
    ]


def judge(
    names: Sequence[str], errors: Sequence[float], pytorch_errors: Sequence[float], floor: float
) -> dict:
    """The rule per named tensor; the verdict's fields: ``passed``, the worst tensor (largest error /
    bound), its error, PyTorch's, their ratio, the bound, the floor, and every tensor."""
    tensors = []
    for name, error, own in zip(names, errors, pytorch_errors, strict=True):
        bound = max(ERROR_RATIO * own, floor)
        ratio = error / own if own > 0 else (math.inf if error > 0 else 0.0)
        tensors.append(dict(tensor=name, error=error, pytorch_error=own, bound=bound, ratio=ratio))
        tensors[-1]["passed"] = error <= bound
    w = max(tensors, key=lambda t: t["error"] / t["bound"])
    summary = dict(worst_tensor=w["tensor"], max_error=w["error"], pytorch_error=w["pytorch_error"])
    summary.update(error_ratio=w["ratio"], bound=w["bound"], error_floor=floor, tensors=tensors)
    return dict(passed=all(t["passed"] for t in tensors), **summary)


def first_problem(
    parts: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], floor: float
) -> Optional[str]:
    """None when every ``(name, actual, pytorch, reference)`` part is right, else the first failure."""
    if not parts:
        return None
    names, actual, own, exact = zip(*parts)
    verdict = judge(names, errors(actual, exact), errors(own, exact), floor)
    failed = next((t for t in verdict["tensors"] if not t["passed"]), None)
    if failed is None:
        return None
    return (
        f"{failed['tensor']}: relative error {failed['error']:.2e} > {ERROR_RATIO:g} x PyTorch's "
        f"{failed['pytorch_error']:.2e} (floor {floor:.0e})"
    )


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an exact reference is computed in: float64 for float32 and float64, else float32."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off: a float64 / float32 reference computed in 16 bits would make PyTorch's own error
    read 0, and the rule would prove nothing."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield
