"""The regression gate: compare two results files metric by metric.

Metrics are keyed by (kind, op or model, shape, dtype, implementation, mode). Tracked: the median
time (lower is better) and the throughput (higher is better). A metric regresses when it is worse
than the baseline by more than ``threshold`` (0.05 = 5%).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import read_json


def _metrics(data: dict[str, object]) -> dict[tuple, dict[str, float]]:
    out = {}
    for row in data["rows"]:
        if "median_ms" not in row:
            continue
        key = (row["kind"], row.get("op") or row.get("model"), row["shape"], row["dtype"], row["backend"], row["mode"])
        out[key] = {"median_ms": row["median_ms"], "throughput": row["throughput"]}
    return out


def compare(baseline_path: Path, current_path: Path, threshold: float) -> tuple[str, int]:
    """(printable table, number of regressions)."""
    if not threshold >= 0:
        raise SystemExit(f"--threshold must be a non-negative fraction such as 0.05, got {threshold}")
    baseline, current = _metrics(read_json(baseline_path)), _metrics(read_json(current_path))
    shared = sorted(set(baseline) & set(current), key=str)
    lines = ["| case | metric | baseline | current | change | verdict |", "| --- | --- | --- | --- | --- | --- |"]
    regressions = 0
    for key in shared:
        for metric, lower_is_better in (("median_ms", True), ("throughput", False)):
            old, new = baseline[key][metric], current[key][metric]
            change = (new - old) / old if old else 0.0
            worse = change > threshold if lower_is_better else change < -threshold
            regressions += worse
            verdict = "REGRESSION" if worse else "ok"
            lines.append(f"| {' / '.join(map(str, key))} | {metric} | {old:.4g} | {new:.4g} | {change:+.1%} | {verdict} |")
    summary = (f"{len(shared)} shared cases ({len(set(baseline) - set(current))} only in the baseline, "
               f"{len(set(current) - set(baseline))} only in the current results); "
               f"{regressions} metric(s) worse by more than {threshold:.1%}.")
    return "\n".join(lines + ["", summary]), regressions
