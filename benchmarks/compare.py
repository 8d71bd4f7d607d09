"""The file-vs-file gate: compare two results files case by case.

Cases are keyed by (kind, op or model, shape, dtype, implementation, mode); the metric is the time
(throughput is its inverse). When both rows hold their samples (``samples_ms``, written by every
run since they were added), the ratio current/baseline gets a bootstrap interval and the same
verdicts and exit codes as ``python -m benchmarks ab`` (see ``benchmarks.gate``). Older files
without samples are compared on the medians alone (verdict REGRESSION or within, no interval).

The two runs were made at different times: load and clock drift between them are not controlled,
which ``python -m benchmarks ab`` (both sides in alternating rounds) is for.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import gate, stats
from benchmarks.report import read_json

MIN_SAMPLES = 3


def _cases(data: dict[str, object]) -> dict[tuple, dict[str, object]]:
    out = {}
    for row in data["rows"]:
        if "median_ms" not in row:
            continue
        key = (row["kind"], row.get("op") or row.get("model"), row["shape"], row["dtype"], row["backend"], row["mode"])
        out[key] = row
    return out


def compare_rows(key: tuple, old: dict, new: dict, threshold: float, confidence: float) -> gate.Comparison:
    name = " ".join(map(str, key[1:]))
    base, cand = old.get("samples_ms") or [], new.get("samples_ms") or []
    if len(base) >= MIN_SAMPLES and len(cand) >= MIN_SAMPLES:
        ratio = stats.unpaired_ratio(base, cand, confidence)
        return gate.judge(name, old["median_ms"], new["median_ms"], ratio, threshold)
    point = new["median_ms"] / old["median_ms"]
    verdict = stats.REGRESSION if point > 1 + threshold else stats.WITHIN
    return gate.Comparison(name, old["median_ms"], new["median_ms"], stats.Ratio(point, point, point, 1), verdict)


def compare(baseline_path: Path, current_path: Path, threshold: float,
            confidence: float = 0.95) -> tuple[str, list[gate.Comparison]]:
    """(printable report, one comparison per shared case)."""
    gate.check_threshold(threshold)
    baseline, current = _cases(read_json(baseline_path)), _cases(read_json(current_path))
    shared = sorted(set(baseline) & set(current), key=str)
    comparisons = [compare_rows(key, baseline[key], current[key], threshold, confidence) for key in shared]
    without = sum(c.rounds <= 1 for c in comparisons)
    lines = [gate.table(comparisons, confidence), "",
             f"{len(shared)} shared cases ({len(set(baseline) - set(current))} only in the baseline, "
             f"{len(set(current) - set(baseline))} only in the current results"
             + (f"; {without} without samples, compared on medians alone" if without else "") + ").",
             gate.summary(comparisons, threshold) + "."]
    if gate.exit_code(comparisons) == gate.EXIT_INCONCLUSIVE:
        lines.append("inconclusive: noise too high for the samples these files hold")
    return "\n".join(lines), comparisons


def main(baseline_path: Path, current_path: Path, threshold: float, confidence: float = 0.95) -> int:
    report, comparisons = compare(baseline_path, current_path, threshold, confidence)
    print(report)
    return gate.exit_code(comparisons)
