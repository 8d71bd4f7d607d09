"""Ratios with bootstrap confidence intervals, and the gate's verdict on them.

A metric is a time (lower is better). The ratio is candidate / baseline: 1.25 means the candidate
takes 25% longer. Two estimators:

* ``paired_ratio``: per-round pairs (the baseline and the candidate timed back to back in the same
  round, as ``python -m benchmarks ab`` does). The statistic is the median of the per-round ratios,
  so a burst of load that hits one round moves one pair, not the estimate.
* ``unpaired_ratio``: two independent sets of samples (two results files). The statistic is the
  ratio of the medians; each side is resampled on its own.

Both give a percentile bootstrap interval from ``resamples`` draws of a fixed-seed generator, so the
same samples always give the same report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

REGRESSION, WITHIN, FASTER, INCONCLUSIVE = "REGRESSION", "within", "faster", "inconclusive"
Times = Sequence[float]  # one side's samples of a metric: positive times


@dataclass(frozen=True)
class Ratio:
    """candidate / baseline time, with its ``confidence`` interval [low, high] over ``samples`` rounds
    (or the smaller side's sample count when unpaired)."""

    value: float
    low: float
    high: float
    samples: int

    def verdict(self, threshold: float) -> str:
        """REGRESSION when the whole interval is above 1 + threshold, ``within`` when the whole
        interval is at or below it (``faster`` when it is also wholly below 1 - threshold), else
        ``inconclusive``."""
        if self.low > 1.0 + threshold:
            return REGRESSION
        if self.high <= 1.0 + threshold:
            return FASTER if self.high < 1.0 - threshold else WITHIN
        return INCONCLUSIVE


def _positive(values: Times, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)) or not np.all(array > 0):
        raise ValueError(f"{name} must be a non-empty list of positive finite times, got {values!r}")
    return array


def _interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail])
    return float(low), float(high)


def _checked(
    baseline: Times, candidate: Times, confidence: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """Both sides as arrays (each a non-empty list of positive finite times), and the fixed-seed
    generator of the bootstrap draws."""
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    base, cand = _positive(baseline, "baseline"), _positive(candidate, "candidate")
    return base, cand, np.random.default_rng(seed)


def _resampled_medians(values: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """The median of each of ``resamples`` bootstrap resamples of ``values``."""
    return np.median(values[rng.integers(0, values.size, size=(resamples, values.size))], axis=1)


def paired_ratio(
    baseline: Times, candidate: Times, confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> Ratio:
    """Median of candidate[i] / baseline[i] over rounds i, with a bootstrap interval over rounds."""
    base, cand, rng = _checked(baseline, candidate, confidence, seed)
    if base.shape != cand.shape:
        raise ValueError(
            f"paired samples need one baseline and one candidate time per round, got "
            f"{base.size} and {cand.size}"
        )
    logs = np.log(cand / base)
    low, high = _interval(_resampled_medians(logs, rng, resamples), confidence)
    return Ratio(float(np.exp(np.median(logs))), float(np.exp(low)), float(np.exp(high)), int(logs.size))


def unpaired_ratio(
    baseline: Times, candidate: Times, confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> Ratio:
    """median(candidate) / median(baseline), each side resampled independently."""
    base, cand, rng = _checked(baseline, candidate, confidence, seed)
    base_draws = _resampled_medians(base, rng, resamples)
    cand_draws = _resampled_medians(cand, rng, resamples)
    low, high = _interval(cand_draws / base_draws, confidence)
    return Ratio(float(np.median(cand) / np.median(base)), low, high, int(min(base.size, cand.size)))
