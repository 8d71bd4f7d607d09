"""Writing results: the JSON file (every row plus the run's peaks), a markdown table, PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, rows: list[dict[str, object]], peaks: dict[str, float], meta: dict[str, object]) -> None:
    """Atomically: a partial file renamed over ``path``, so a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"meta": meta, "peaks": peaks, "rows": rows}, indent=1) + "\n")
    os.replace(partial, path)


def read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"cannot read benchmark results from {path}: {error}")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"{path} is not a benchmark results file (expected a JSON object with a 'rows' list)")
    return data


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _percent(fraction) -> str:
    """A fraction of peak as a percentage; "n/a" where there is no trustworthy peak."""
    return "n/a" if fraction is None else f"{100 * fraction:.2g}%"


def _speedups(row: dict[str, object]) -> str:
    return ", ".join(f"{name} {ratio:.2f}x" for name, ratio in sorted(row.get("speedup", {}).items()))


def markdown(rows: list[dict[str, object]], peaks: dict[str, float], meta: dict[str, object]) -> str:
    """Tables of the timed rows (ops, then models), and the rows skipped or failing validation."""
    lines = [f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; commit {meta['git_sha']}.",
             "Peaks measured in this run: " + ", ".join(f"{k} {v:.4g}" for k, v in peaks.items()) + ".", ""]
    ops = [r for r in rows if r["kind"] == "op" and "median_ms" in r]
    if ops:
        lines += ["| op | shape | dtype | mode | implementation | median ms (q20-q80) | throughput | of peak | speedup over |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in ops:
            lines.append(
                f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['mode']} | {r['backend']} | "
                f"{_fmt(r['median_ms'])} ({_fmt(r['q20_ms'])}-{_fmt(r['q80_ms'])}) | {_fmt(r['throughput'])} {r['unit']} | "
                f"{_percent(r['fraction_of_peak'])} | {_speedups(r)} |"
            )
        lines.append("")
    models = [r for r in rows if r["kind"] == "model" and "median_ms" in r]
    if models:
        lines += ["| model | batch | dtype | step | variant | images/s | median ms (q20-q80) | model TFLOP/s (of peak) | peak memory MiB | speedup over |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in models:
            lines.append(
                f"| {r['model']} | {r['shape']} | {r['dtype']} | {r['mode']} | {r['backend']} | {_fmt(r['throughput'], 4)} | "
                f"{_fmt(r['median_ms'])} ({_fmt(r['q20_ms'])}-{_fmt(r['q80_ms'])}) | "
                f"{_fmt(r['model_tflops'])} ({_percent(r['fraction_of_peak'])}) | "
                f"{_fmt(r['peak_memory_mb'], 5)} | {_speedups(r)} |"
            )
        lines.append("")
    other = [r for r in rows if "median_ms" not in r]
    if other:
        lines += ["Not timed:", ""]
        for r in other:
            what = r.get("op") or r.get("model")
            lines.append(f"- {what} {r['shape']} {r['dtype']} {r['backend']}: {r.get('invalid') or r.get('skipped')}")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, object]], out_dir: Path) -> list[Path]:
    """speedup_<op>.png (each implementation's speedup over the torch backend, per shape and mode) and
    images_per_second.png (per model, step and variant). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    ops = sorted({r["op"] for r in rows if r["kind"] == "op" and "median_ms" in r})
    for op in ops:
        timed = [r for r in rows if r.get("op") == op and "median_ms" in r and r["backend"] != "torch" and "torch" in r["speedup"]]
        if not timed:
            continue
        groups = sorted({(r["shape"], r["dtype"], r["mode"]) for r in timed})
        names = sorted({r["backend"] for r in timed})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4))
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = [next((r["speedup"]["torch"] for r in timed if (r["shape"], r["dtype"], r["mode"]) == g and r["backend"] == name), 0)
                      for g in groups]
            ax.bar([i + j * width for i in range(len(groups))], values, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{d} {m}" for s, d, m in groups], fontsize=6, rotation=30, ha="right")
        ax.set_ylabel("speedup over the torch backend")
        ax.set_title(op)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"speedup_{op}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    models = [r for r in rows if r["kind"] == "model" and "median_ms" in r]
    if models:
        labels = [f"{r['model']} {r['shape']} {r['mode']}\n{r['backend']}" for r in models]
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(models) + 1.5))
        ax.barh(range(len(models)), [r["throughput"] for r in models])
        ax.set_yticks(range(len(models)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("images / second")
        fig.tight_layout()
        path = out_dir / "images_per_second.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
