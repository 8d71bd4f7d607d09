"""Benchmark timing on the benchmarks' timer (``benchmarks._timer``): median and 20th/80th
percentiles in milliseconds, after warm-up, and every sample (so that two runs can be compared with
confidence intervals).

Callers pass ``call(i)`` and the number of input copies: successive runs use different copies, so a
kernel is not timed on inputs left in cache by the previous run (``copies_to_rotate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from benchmarks._timer import time_runs

Call = Callable[[int], object]  # call(i) runs on input set i


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q20_ms: float
    q80_ms: float
    samples_ms: tuple[float, ...] = ()


def _summarise(samples_ms) -> Timing:
    samples = [float(s) for s in samples_ms]
    q20, median, q80 = np.quantile(np.asarray(samples), [0.2, 0.5, 0.8])
    return Timing(float(median), float(q20), float(q80), tuple(samples))


def _samples(call: Call, device: torch.device, copies: int, **options) -> list[float]:
    """The timer's samples (ms) of ``call(i)``, i cycling over ``copies`` input sets, at least 3;
    ``options``: ``time_runs``'s other keywords."""
    counter = iter(range(1 << 62))
    return time_runs({"call": lambda: call(next(counter) % copies)}, device, min_rounds=3, **options)["call"]


def time_call(
    call: Call,
    device: torch.device,
    copies: int = 1,
    *,
    warmup: int = 3,
    repeats: int = 20,
    budget_s: float = 2.0,
) -> Timing:
    """Time ``call(i)`` (i cycling over ``copies`` input sets) back to back: at least 3 and at most
    ``repeats`` samples, fewer when one run is long enough that ``repeats`` would exceed ``budget_s``."""
    samples = _samples(
        call, device, copies, rounds=repeats, budget_s=budget_s, warmup=warmup, back_to_back=True
    )
    return _summarise(samples)


def copies_to_rotate(bytes_per_set: int, device: torch.device) -> int:
    """How many input sets to cycle through so that consecutive runs do not share cache: enough to
    exceed twice the last-level cache (L2 on a GPU, assumed 64 MiB on the CPU), at most 8."""
    cache = 64 << 20
    if device.type == "cuda":
        cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", cache)
    return int(max(1, min(8, -(-2 * cache // max(bytes_per_set, 1)))))


def slice_min_ms(
    call: Call, device: torch.device, copies: int = 1, *, slice_ms: float = 20.0, max_calls: int = 200
) -> float:
    """One sample for an A/B round: the fastest of the calls that fit in ``slice_ms`` (at least 3, at
    most ``max_calls``) after one warm-up call; each call from an idle device on CUDA. Load from other
    processes only ever adds time, so the fastest call is the one least disturbed by it."""
    return min(_samples(call, device, copies, rounds=max_calls, budget_s=slice_ms / 1e3, warmup=1))
