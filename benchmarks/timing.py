"""Timing with synchronisation: median and 20th/80th percentiles in milliseconds, after warm-up,
and every sample (so that two runs can be compared with confidence intervals).

On CUDA, ``triton.testing.do_bench`` (CUDA events, and it clears the L2 cache before every run)
when triton is installed, else CUDA events directly. On the CPU, ``time.perf_counter``. Callers pass
``call(i)`` and the number of input copies: successive runs use different copies, so a kernel is
not timed on inputs left in cache by the previous run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


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


def _rotating(call: Callable[[int], object], copies: int) -> Callable[[], object]:
    counter = iter(range(1 << 62))
    return lambda: call(next(counter) % copies)


def time_call(
    call: Callable[[int], object], device: torch.device, copies: int = 1, *, warmup: int = 3, repeats: int = 20,
    budget_s: float = 2.0,
) -> Timing:
    """Time ``call(i)`` (i cycling over ``copies`` input sets): at least 3 and at most ``repeats``
    samples, fewer when one run is long enough that ``repeats`` would exceed ``budget_s``."""
    run = _rotating(call, copies)
    if device.type == "cuda":
        return _time_cuda(run, warmup, repeats, budget_s)
    for _ in range(warmup):
        run()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() - started < budget_s):
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarise(samples)


def _time_cuda(run: Callable[[], object], warmup: int, repeats: int, budget_s: float = 2.0) -> Timing:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        samples = do_bench(run, warmup=25, rep=100, return_mode="all")
        if len(samples) < 3:  # a long call (an e2e step): do_bench's 100 ms window held only 1-2 runs
            n = max(3, min(repeats, int(budget_s * 1e3 / max(samples))))
            samples = do_bench(run, warmup=1, rep=1.2 * n * max(samples), return_mode="all")
        return _summarise(samples)
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return _summarise(samples)


def copies_to_rotate(bytes_per_set: int, device: torch.device) -> int:
    """How many input sets to cycle through so that consecutive runs do not share cache: enough to
    exceed twice the last-level cache (L2 on a GPU, assumed 64 MiB on the CPU), at most 8."""
    cache = 64 << 20
    if device.type == "cuda":
        cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", cache)
    return int(max(1, min(8, -(-2 * cache // max(bytes_per_set, 1)))))


def slice_min_ms(call: Callable[[int], object], device: torch.device, copies: int = 1, *, slice_ms: float = 20.0,
                 max_calls: int = 200) -> float:
    """One sample for an A/B round: the fastest of the calls that fit in ``slice_ms`` (at least 3, at
    most ``max_calls``) after one warm-up call; each call synchronised on CUDA. Load from other
    processes only ever adds time, so the fastest call is the one least disturbed by it."""
    run = _rotating(call, copies)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    sync()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < 3 or (len(samples) < max_calls and (time.perf_counter() - started) * 1e3 < slice_ms):
        t0 = time.perf_counter()
        run()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)
