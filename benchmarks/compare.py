"""The file-vs-file gate: compare two results files case by case.

Cases are keyed by (kind, op or model, shape, dtype, implementation, mode); the metric is the time
(throughput is its inverse). When both rows hold their samples (``samples_ms``), the ratio
current/baseline gets a bootstrap interval and the verdicts of ``python -m benchmarks ab`` (see
``benchmarks.gate``). Older files without samples are compared on the medians alone.

The two runs were made at different times: load and clock drift between them are not controlled
(``python -m benchmarks ab``, both sides in alternating rounds, is for that), and a bootstrap
interval of each median only says how well each run pinned down its own median, not how much a
second run on the same code would move. So a difference is judged only where it lies outside both
runs' own noise:

* each row's spread: the current median must lie outside the baseline's q20-q80 band and the
  baseline's median outside the current one's;
* the machine's drift between the runs, where both files carry the noise probe (a fixed workload
  timed before and after each run): a ratio no further from 1 than the probe's own ratio between
  the runs is what the machine did, not the code.

A slowdown or speed-up that the intervals alone would call a REGRESSION or ``faster`` but that lies
inside that noise is "too noisy to judge" (``gate.NOISY``); the report says how many there were.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks import gate, stats
from benchmarks.report import read_json

MIN_SAMPLES = 3
KEY_FIELDS = ("kind", "shape", "dtype", "backend", "mode")


def _positive(value) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _check_row(path: Path, index: int, row) -> Optional[str]:
    """Why row ``index`` of ``path`` cannot be compared, or None."""
    if not isinstance(row, dict):
        return f"{path}: row {index} is not a JSON object"
    missing = [k for k in KEY_FIELDS if k not in row] + (
        [] if row.get("op") or row.get("model") else ["op or model"]
    )
    if missing:
        return f"{path}: row {index} lacks {', '.join(missing)}"
    unhashable = [k for k in (*KEY_FIELDS, "op", "model") if isinstance(row.get(k), (list, dict))]
    if unhashable:
        return f"{path}: row {index} has {', '.join(unhashable)} that are not plain values"
    if not _positive(row["median_ms"]):
        return f"{path}: row {index} has median_ms {row['median_ms']!r}, expected a positive number"
    samples = row.get("samples_ms")
    if samples is not None and not (isinstance(samples, list) and all(_positive(s) for s in samples)):
        return f"{path}: row {index} has samples_ms that are not a list of positive numbers"
    for field in ("q20_ms", "q80_ms"):
        if row.get(field) is not None and not _positive(row[field]):
            return f"{path}: row {index} has {field} {row[field]!r}, expected a positive number"
    return None


def _cases(data: dict[str, object], path: Path) -> dict[tuple, dict[str, object]]:
    out = {}
    for index, row in enumerate(data["rows"]):
        if isinstance(row, dict) and "median_ms" not in row:
            continue  # skipped or invalid in that run: nothing to compare
        problem = _check_row(path, index, row)
        if problem:
            raise SystemExit(problem)
        key = (
            row["kind"],
            row.get("op") or row.get("model"),
            row["shape"],
            row["dtype"],
            row["backend"],
            row["mode"],
        )
        out[key] = row
    return out


def band(row: dict) -> tuple[float, float]:
    """The row's own q20-q80 spread as log offsets from its median: (<= 0, >= 0). From its samples
    when it has them, else from its q20/q80 fields, else (0, 0)."""
    samples = row.get("samples_ms") or []
    if len(samples) >= MIN_SAMPLES:
        q20, median, q80 = np.quantile(np.asarray(samples, dtype=np.float64), [0.2, 0.5, 0.8])
    elif row.get("q20_ms") and row.get("q80_ms"):
        q20, median, q80 = row["q20_ms"], row["median_ms"], row["q80_ms"]
    else:
        return 0.0, 0.0
    return min(0.0, math.log(q20 / median)), max(0.0, math.log(q80 / median))


def beyond_noise(old: dict, new: dict, point: float, drift: float = 1.0) -> bool:
    """Whether the ratio ``point`` (new / old median) lies outside both rows' q20-q80 bands and
    beyond the machine's ``drift`` (the probe's new / old ratio) in its direction."""
    r = math.log(point)
    old_low, old_high = band(old)
    new_low, new_high = band(new)
    d = math.log(drift)
    if r > 0:  # new median above the old band, old median below the new band, past the drift
        return r > max(old_high, -new_low, d)
    if r < 0:
        return r < min(old_low, -new_high, d)
    return False


def machine_drift(baseline: dict, current: dict) -> Optional[float]:
    """The noise probe's median in the current run / in the baseline run (the medians of each run's
    probes), when both files recorded the same probe workload; else None."""
    probes = []
    for data in (baseline, current):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        noise = meta.get("noise") if isinstance(meta.get("noise"), dict) else {}
        found = noise.get("probes") if isinstance(noise.get("probes"), list) else []
        found = [p for p in found if isinstance(p, dict) and _positive(p.get("median_ms"))]
        probes.append(found)
    if not all(probes) or {p.get("workload") for p in probes[0]} != {p.get("workload") for p in probes[1]}:
        return None
    old, new = (float(np.median([p["median_ms"] for p in side])) for side in probes)
    return new / old


def compare_rows(
    key: tuple, old: dict, new: dict, threshold: float, confidence: float, drift: float = 1.0
) -> gate.Comparison:
    name = " ".join(map(str, key[1:]))
    base, cand = old.get("samples_ms") or [], new.get("samples_ms") or []
    if len(base) >= MIN_SAMPLES and len(cand) >= MIN_SAMPLES:
        ratio = stats.unpaired_ratio(base, cand, confidence)
    else:
        point = new["median_ms"] / old["median_ms"]
        ratio = stats.Ratio(point, point, point, 1)
    verdict = ratio.verdict(threshold)
    if verdict in (stats.REGRESSION, stats.FASTER) and not beyond_noise(old, new, ratio.value, drift):
        side = "slower" if ratio.value > 1 else "faster"
        return gate.Comparison(
            name,
            old["median_ms"],
            new["median_ms"],
            ratio,
            gate.NOISY,
            f"{side}, but within the runs' own spread",
        )
    return gate.Comparison(name, old["median_ms"], new["median_ms"], ratio, verdict)


def compare(
    baseline_path: Path, current_path: Path, threshold: float, confidence: float = 0.95
) -> tuple[str, list[gate.Comparison]]:
    """(printable report, one comparison per shared case)."""
    gate.check_threshold(threshold)
    gate.check_confidence(confidence)
    baseline_data, current_data = read_json(baseline_path), read_json(current_path)
    baseline, current = _cases(baseline_data, baseline_path), _cases(current_data, current_path)
    shared = sorted(set(baseline) & set(current), key=str)
    drift = machine_drift(baseline_data, current_data)
    comparisons = [
        compare_rows(key, baseline[key], current[key], threshold, confidence, drift or 1.0) for key in shared
    ]
    without = sum(c.rounds <= 1 for c in comparisons)
    noisy = sum(c.verdict == gate.NOISY for c in comparisons)
    straddling = sum(c.verdict == stats.INCONCLUSIVE for c in comparisons)
    lines = [
        gate.table(comparisons, confidence),
        "",
        f"{len(shared)} shared cases ({len(set(baseline) - set(current))} only in the baseline, "
        f"{len(set(current) - set(baseline))} only in the current results"
        + (f"; {without} without samples, compared on medians alone" if without else "")
        + ").",
        f"{noisy + straddling} of {len(shared)} cases too noisy to judge: {noisy} with a difference inside "
        f"either run's own q20-q80 spread"
        + ("" if drift is None else " or the machine's drift")
        + f", {straddling} whose interval straddles the threshold.",
        gate.summary(comparisons, threshold) + ".",
    ]
    if drift is not None:
        lines.insert(
            -1,
            f"The noise probe (a fixed workload) ran {drift:.3f}x as long in the current run as in the "
            f"baseline run: changes up to that much in its direction are the machine's.",
        )
    if not shared:
        lines.append("nothing compared: the files share no case")
    if gate.exit_code(comparisons) == gate.EXIT_INCONCLUSIVE:
        lines.append("inconclusive: noise too high for the samples these files hold")
    return "\n".join(lines), comparisons


def main(baseline_path: Path, current_path: Path, threshold: float, confidence: float = 0.95) -> int:
    report, comparisons = compare(baseline_path, current_path, threshold, confidence)
    print(report)
    return gate.exit_code(comparisons)
