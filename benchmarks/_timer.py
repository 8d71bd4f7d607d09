"""The benchmarks' timer: milliseconds per run of one or more callables, in interleaved rounds. Runs are interleaved (A B C, A B C, ...) so that a burst of
load from another process, or a clock change, hits every candidate alike.

On CUDA a run is bracketed by two CUDA events on the current stream, so the device's time between
them is taken: kernel time, plus any gap in which the device waited for the host to launch. Two
modes:

- ``back_to_back=False`` (the runtime's choice): the device is synchronised before every run, so it
  starts idle and the host's launch cost counts in full, as it does for a call that nothing else
  hides;
- ``back_to_back=True`` (the benchmarks'): synchronised once per round, so the host may run ahead
  and a run's time is the device's throughput time, as in a training step that keeps the GPU busy.

On the CPU, ``time.perf_counter`` around each run.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping

import torch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(
    runs: Mapping[Hashable, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    budget_s: float = float("inf"),
    min_rounds: int = 1,
    warmup: int = 0,
    back_to_back: bool = False,
) -> dict[Hashable, list[float]]:
    """Milliseconds of each run of ``runs`` (key -> callable), one sample per round: ``warmup``
    untimed rounds, then timed rounds until ``rounds`` of them or, after ``min_rounds``, until the
    timed rounds have taken ``budget_s`` seconds of the host's wall time (back to back on CUDA the
    host may be ahead of the device: ``rounds`` bounds the device's time)."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    _synchronize(device)
    samples: dict[Hashable, list[float]] = {name: [] for name in runs}
    pending: list = []  # (name, start event, end event) not read yet
    started = time.perf_counter()
    for done in range(1, rounds + 1):
        for name, run in runs.items():
            if device.type != "cuda":
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) * 1e3)
                continue
            if not back_to_back:
                _synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            pending.append((name, start, end))
        if done >= min_rounds and time.perf_counter() - started >= budget_s:
            break
    _synchronize(device)
    for name, start, end in pending:
        samples[name].append(float(start.elapsed_time(end)))
    return samples
