"""The regression gate's verdicts, printed table and exit code, shared by ``python -m benchmarks ab``
(paired rounds) and ``--compare`` (two results files).

Exit codes: 1 when any metric is a REGRESSION (its whole interval lies above 1 + threshold) or the
candidate fails a case the baseline passes; 3 when none is but some are inconclusive (the interval
straddles the threshold: noise too high to tell) or slower by a margin that lies inside the runs'
own noise (NOISY, from ``--compare``); 0 otherwise. A NOISY speed-up does not change the exit code:
it is no evidence of a regression either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from benchmarks.stats import FASTER, INCONCLUSIVE, REGRESSION, WITHIN, Ratio

EXIT_OK, EXIT_REGRESSION, EXIT_INCONCLUSIVE = 0, 1, 3
BROKEN = "BROKEN"  # the candidate fails validation (or crashes) where the baseline does not
NOISY = "too noisy"  # past the threshold by its interval, but inside either run's own spread


@dataclass(frozen=True)
class Comparison:
    case: str
    baseline_ms: Optional[float]
    candidate_ms: Optional[float]
    ratio: Optional[Ratio]  # None: no samples to build an interval from
    verdict: str  # REGRESSION | within | faster | inconclusive | BROKEN | not compared: why
    note: str = ""  # e.g. "confirmed" / "regression not confirmed" (ab's second run)

    @property
    def rounds(self) -> int:
        return self.ratio.samples if self.ratio else 0


def judge(case: str, baseline_ms: float, candidate_ms: float, ratio: Ratio, threshold: float) -> Comparison:
    return Comparison(case, baseline_ms, candidate_ms, ratio, ratio.verdict(threshold))


def check_threshold(threshold: float) -> None:
    if not 0 <= threshold < 10:
        raise SystemExit(f"--threshold must be a fraction such as 0.05 (5% slower), got {threshold}")


def check_confidence(confidence: float) -> None:
    if not 0.5 <= confidence < 1:
        raise SystemExit(f"--confidence must be in [0.5, 1), got {confidence}")


def _kind(verdict: str) -> str:
    """The verdict without its detail: ``BROKEN (invalid: ...)`` is BROKEN."""
    return BROKEN if verdict.startswith(BROKEN) else verdict


def exit_code(comparisons: list[Comparison]) -> int:
    verdicts = {_kind(c.verdict) for c in comparisons}
    if REGRESSION in verdicts or BROKEN in verdicts:
        return EXIT_REGRESSION
    slower_in_noise = any(
        c.verdict == NOISY and c.ratio is not None and c.ratio.value > 1 for c in comparisons
    )
    return EXIT_INCONCLUSIVE if INCONCLUSIVE in verdicts or slower_in_noise else EXIT_OK


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(comparisons: list[Comparison], confidence: float) -> str:
    """Aligned columns: case, baseline ms, candidate ms, ratio, interval, rounds, verdict."""
    head = ("case", "baseline ms", "candidate ms", "ratio", f"{confidence:.0%} interval", "n", "verdict")
    body = [
        (
            c.case,
            _ms(c.baseline_ms),
            _ms(c.candidate_ms),
            f"{c.ratio.value:.3f}" if c.ratio else "-",
            f"[{c.ratio.low:.3f}, {c.ratio.high:.3f}]" if c.ratio and c.ratio.samples > 1 else "-",
            str(c.rounds) if c.ratio else "-",
            f"{c.verdict} ({c.note})" if c.note else c.verdict,
        )
        for c in comparisons
    ]
    widths = [max(len(row[k]) for row in [head] + body) for k in range(len(head))]
    align = ["<", ">", ">", ">", ">", ">", "<"]
    return "\n".join(
        "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)).rstrip()
        for row in [head] + body
    )


def summary(comparisons: list[Comparison], threshold: float) -> str:
    counts = {
        v: sum(_kind(c.verdict) == v for c in comparisons)
        for v in (REGRESSION, BROKEN, INCONCLUSIVE, WITHIN, FASTER, NOISY)
    }
    other = len(comparisons) - sum(counts.values())
    parts = [
        f"{counts[REGRESSION]} regression(s) beyond {threshold:.0%}",
        f"{counts[BROKEN]} broken",
        f"{counts[INCONCLUSIVE]} inconclusive",
        f"{counts[WITHIN]} within {threshold:.0%}",
        f"{counts[FASTER]} faster by more than {threshold:.0%}",
    ]
    if counts[NOISY]:  # only --compare judges against the runs' own spread
        parts.append(f"{counts[NOISY]} too noisy to judge")
    if other:
        parts.append(f"{other} not compared")
    return "; ".join(parts)
