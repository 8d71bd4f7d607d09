"""How far a benchmark run's figures can be trusted: the machine's noise, measured before and after
the run, and an interval on every speed-up.

* The probe: a fixed small workload (square float32 matmuls on the benchmark's device, on the
  threads the benchmarks use) repeated for about a second. Identical work should take identical
  time; the spread of its times, (q80 - q20) / median, is the noise any measurement in the run
  carries. Other processes that take a core from one of the benchmark's threads show up here.
* The load: the 1-minute load average, against the CPUs it counts (the whole machine's, which is
  what ``os.getloadavg`` averages over; the cores this process may use are recorded beside it).
* Each speed-up (another implementation's median / this one's, same case, same run) gets a
  bootstrap interval from the two rows' samples; a ratio whose interval spans more than
  ``RATIO_SPAN_LIMIT`` (high / low) is marked untrusted: the samples do not pin it down.

A run is noisy when the probe's spread exceeds ``SPREAD_LIMIT``, the load exceeds ``LOAD_LIMIT``
per CPU, or more than ``UNTRUSTED_LIMIT`` of the speed-ups are untrusted; the markdown report's
first line then says so, with the figures.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from benchmarks import stats
from benchmarks.environment import usable_cores
from benchmarks.timing import time_call

SPREAD_LIMIT = 0.10  # probe (q80 - q20) / median above this: timings move by more than 10% on their own
LOAD_LIMIT = 0.5  # 1-minute load per CPU above this: other work holds more than half the machine
RATIO_SPAN_LIMIT = 1.2  # a speed-up's interval high / low above this (about +-10%) is not pinned down
UNTRUSTED_LIMIT = 0.25  # more than this fraction of untrusted speed-ups makes the whole run noisy
CONFIDENCE = 0.95
PROBE_SIZE = {"cpu": 256, "cuda": 2048}
PROBE_MATMULS = 4


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def probe(device: torch.device, seconds: float = 1.0, own_load: float = 0.0) -> dict[str, object]:
    """Time a fixed workload (PROBE_MATMULS square matmuls) repeatedly for about ``seconds``: its
    median, q20 / q80, relative spread, and the load average and cores at that moment. ``own_load``:
    how much of that load average the suite itself made (its threads, after it ran), which is not
    other processes' noise."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    size = PROBE_SIZE[kind]
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device)
    b = torch.randn(size, size, generator=generator).to(device)

    def work(_):
        out = a
        for _ in range(PROBE_MATMULS):
            out = torch.mm(out, b).mul_(1.0 / size)  # rescaled so repeated products stay finite
        return out

    timing = time_call(work, device, warmup=5, repeats=200, budget_s=seconds)
    return {
        "workload": f"{PROBE_MATMULS} float32 matmuls {size}x{size} on {device.type}",
        "samples": len(timing.samples_ms),
        "median_ms": timing.median_ms,
        "q20_ms": timing.q20_ms,
        "q80_ms": timing.q80_ms,
        "spread": (timing.q80_ms - timing.q20_ms) / timing.median_ms,
        "load_1min": load_average(),
        "own_load": own_load,
        "cpu_count": os.cpu_count() or usable_cores(),
        "usable_cores": usable_cores(),
        "threads": torch.get_num_threads(),
    }


def ratio_interval(this_ms: Sequence[float], other_ms: Sequence[float]) -> Optional[tuple[float, float]]:
    """The CONFIDENCE interval of median(other) / median(this) (a speed-up of this over other), or
    None when either side has fewer than 3 samples."""
    if len(this_ms) < 3 or len(other_ms) < 3:
        return None
    ratio = stats.unpaired_ratio(this_ms, other_ms, CONFIDENCE, resamples=2000)
    return ratio.low, ratio.high


def trusted(interval: Optional[Sequence[float]]) -> bool:
    """Whether a ratio's interval is narrow enough to report the ratio as a figure."""
    return interval is not None and interval[0] > 0 and interval[1] / interval[0] <= RATIO_SPAN_LIMIT


def count_ratios(rows: list[dict[str, object]]) -> tuple[int, int]:
    """(untrusted speed-ups, all speed-ups) over the rows."""
    total = untrusted = 0
    for row in rows:
        for name in row.get("speedup", {}):
            total += 1
            untrusted += not trusted(row.get("speedup_interval", {}).get(name))
    return untrusted, total


def assess(probes: list[dict[str, object]], rows: list[dict[str, object]]) -> dict[str, object]:
    """The run's noise record (for the results JSON): the probes, the limits, the untrusted
    speed-ups, ``noisy`` and, when noisy, ``reasons`` (each a phrase with its figures)."""
    reasons = []
    worst = max(probes, key=lambda p: p["spread"]) if probes else None
    if worst is not None and worst["spread"] > SPREAD_LIMIT:
        reasons.append(
            f"a fixed workload's times spread by {worst['spread']:.0%} (q20-q80 over the median; "
            f"quiet is under {SPREAD_LIMIT:.0%})"
        )
    loads = [p for p in probes if p.get("load_1min") is not None]

    def others(p):  # the load of other processes: the suite's own threads are not noise
        return max(0.0, p["load_1min"] - p.get("own_load", 0.0))

    busiest = max(loads, key=others) if loads else None
    if busiest is not None and others(busiest) > LOAD_LIMIT * busiest["cpu_count"]:
        own = f", {busiest['own_load']:g} of it this run's" if busiest.get("own_load") else ""
        reasons.append(
            f"the 1-minute load average was {busiest['load_1min']:.1f}{own} on {busiest['cpu_count']} "
            f"CPUs ({busiest['usable_cores']} usable here)"
        )
    untrusted, total = count_ratios(rows)
    if total and untrusted > UNTRUSTED_LIMIT * total:
        reasons.append(
            f"{untrusted} of {total} speed-ups have {CONFIDENCE:.0%} intervals wider than "
            f"{RATIO_SPAN_LIMIT:g}x high/low"
        )
    return {
        "noisy": bool(reasons),
        "reasons": reasons,
        "probes": probes,
        "untrusted_speedups": untrusted,
        "speedups": total,
        "limits": {
            "spread": SPREAD_LIMIT,
            "load_per_cpu": LOAD_LIMIT,
            "ratio_span": RATIO_SPAN_LIMIT,
            "untrusted_fraction": UNTRUSTED_LIMIT,
            "confidence": CONFIDENCE,
        },
    }


def headline(noise: Optional[dict[str, object]]) -> Optional[str]:
    """The report's first line for a noisy run, else None."""
    if not noise or not noise.get("noisy"):
        return None
    return (
        "**Too noisy to trust: " + "; ".join(noise["reasons"]) + ".** Speed-ups marked ? are not pinned "
        "down by their samples; rerun on a quiet machine before quoting any figure below."
    )


def summary(noise: Optional[dict[str, object]]) -> Optional[str]:
    """One line with the probe and load figures, for a run that is not noisy."""
    if not noise or not noise.get("probes"):
        return None
    worst = max(noise["probes"], key=lambda p: p["spread"])
    load = (
        ""
        if worst.get("load_1min") is None
        else f", 1-minute load {worst['load_1min']:.1f} on {worst['cpu_count']} CPUs"
    )
    marked = (
        f"; {noise['untrusted_speedups']} of {noise['speedups']} speed-ups marked ? (interval wider than "
        f"{RATIO_SPAN_LIMIT:g}x high/low)"
        if noise.get("untrusted_speedups")
        else ""
    )
    return f"Noise: a fixed workload's times spread by {worst['spread']:.1%}{load}; {worst['threads']} threads{marked}."
