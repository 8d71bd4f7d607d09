"""Writing results: the JSON file (every row plus the run's peaks), a markdown table, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from benchmarks import noise as noise_
from vit_kernels._files import write_atomically


def write_json(
    path: Path, rows: list[dict[str, object]], peaks: dict[str, float], meta: dict[str, object]
) -> None:
    """Every row, the run's peaks and its metadata, atomically (``write_atomically``)."""
    write_atomically(path, json.dumps({"meta": meta, "peaks": peaks, "rows": rows}, indent=1) + "\n")


def read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise SystemExit(f"cannot read benchmark results from {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SystemExit(f"{path} is not a benchmark results file: not JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(
            f"{path} is not a benchmark results file (expected a JSON object with a 'rows' list)"
        )
    return data


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _percent(fraction) -> str:
    """A fraction of peak as a percentage; "n/a" where there is no trustworthy peak."""
    return "n/a" if fraction is None else f"{100 * fraction:.2g}%"


def _speedups(row: dict[str, object]) -> str:
    """``name 1.23x`` per other implementation; a ratio whose interval is too wide to trust (or
    unknown: a row without samples) as ``name 313x? (12-900)``, its interval in brackets."""
    parts = []
    intervals = row.get("speedup_interval", {})
    for name, ratio in sorted(row.get("speedup", {}).items()):
        interval = intervals.get(name)
        if noise_.trusted(interval):
            parts.append(f"{name} {ratio:.3g}x")
        elif interval is None:
            parts.append(f"{name} {ratio:.3g}x? (no interval)")
        else:
            parts.append(f"{name} {ratio:.3g}x? ({interval[0]:.3g}-{interval[1]:.3g})")
    return ", ".join(parts)


OP_COLUMNS = ("op", "shape", "dtype", "mode", "implementation", "median ms (q20-q80)")
OP_COLUMNS += ("throughput", "of peak", "speedup over")


def _median_and_quantiles(row: dict[str, object]) -> str:
    """``median (q20-q80)`` of a timed row, in milliseconds."""
    return f"{_fmt(row['median_ms'])} ({_fmt(row['q20_ms'])}-{_fmt(row['q80_ms'])})"


def _table(columns: tuple[str, ...], cells: list[list[object]]) -> list[str]:
    """The lines of a markdown table: the header of ``columns``, one line per row of ``cells`` (one
    per column), then a blank line; none where there are no rows."""
    if not cells:
        return []
    header = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return header + ["| " + " | ".join(map(str, row)) + " |" for row in cells] + [""]


def markdown(
    rows: list[dict[str, object]],
    peaks: dict[str, float],
    meta: dict[str, object],
    noise: Optional[dict[str, object]] = None,
) -> str:
    """The table of the timed per-op rows, and the rows skipped or failing validation.
    ``noise`` (``benchmarks.noise.assess``): on a noisy run the first line says so, with its figures;
    on a quiet one a line gives them after the device."""
    warning = noise_.headline(noise)
    lines = [warning] if warning else []
    lines.append(
        f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; commit {meta['git_sha']}."
    )
    quiet = None if warning else noise_.summary(noise)
    if quiet:
        lines.append(quiet)
    lines += ["Peaks measured in this run: " + ", ".join(f"{k} {v:.4g}" for k, v in peaks.items()) + ".", ""]
    ops = [r for r in rows if r["kind"] == "op" and "median_ms" in r]
    lines += _table(
        OP_COLUMNS,
        [
            [
                *(r[field] for field in ("op", "shape", "dtype", "mode", "backend")),
                _median_and_quantiles(r),
                f"{_fmt(r['throughput'])} {r['unit']}",
                _percent(r["fraction_of_peak"]),
                _speedups(r),
            ]
            for r in ops
        ],
    )
    other = [r for r in rows if "median_ms" not in r]
    if other:
        lines += ["Not timed:", ""]
        for r in other:
            lines.append(
                f"- {r.get('op')} {r['shape']} {r['dtype']} {r['backend']}: {r.get('invalid') or r.get('skipped')}"
            )
        lines.append("")
    return "\n".join(lines)


LOG_SPAN = 10.0  # values spanning more than this factor go on a log axis


def _log_if_wide(ax, values: list[float], axis: str) -> None:
    """A log scale on ``axis`` ("x" or "y") when the positive values span more than LOG_SPAN."""
    positive = [v for v in values if v and v > 0]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def _label_bars(ax, bars, values: list[float], suffix: str) -> None:
    for bar, value in zip(bars, values):
        if not value:
            continue
        text = (f"{value:,.0f}" if value >= 1000 else f"{value:.3g}") + suffix
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            fontsize=7,
            rotation=90,
        )


def _speedup_figure(plt, op: str, timed: list[dict[str, object]]):
    """One panel per shape; in each, per mode (and dtype) a bar per implementation: its speedup
    over the torch backend, value printed on the bar."""
    shapes = sorted({r["shape"] for r in timed}, key=lambda s: [r["shape"] for r in timed].index(s))
    names = sorted({r["backend"] for r in timed})
    dtypes = sorted({r["dtype"] for r in timed})
    colours = {name: f"C{k}" for k, name in enumerate(names)}
    fig, axes = plt.subplots(
        1, len(shapes), figsize=(4.2 * len(shapes) + 0.5, 4.6), squeeze=False, sharey=True
    )
    values_all = [r["speedup"]["torch"] for r in timed]
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in timed if r["shape"] == shape]
        groups = [
            (d, m)
            for d in dtypes
            for m in ("forward", "backward", "full")
            if any(r["dtype"] == d and r["mode"] == m for r in rows)
        ]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = [
                next(
                    (
                        r["speedup"]["torch"]
                        for r in rows
                        if (r["dtype"], r["mode"]) == g and r["backend"] == name
                    ),
                    0,
                )
                for g in groups
            ]
            bars = ax.bar(
                [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))],
                values,
                width,
                label=name,
                color=colours[name],
            )
            _label_bars(ax, bars, values, "x")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([m if len(dtypes) == 1 else f"{d}\n{m}" for d, m in groups], fontsize=9)
        ax.set_title(shape, fontsize=9)
        ax.margins(y=0.25)
    _log_if_wide(axes[0][0], values_all, "y")
    axes[0][0].set_ylabel("speedup over the torch backend (x)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=9, ncol=len(names))
    fig.suptitle(
        f"{op}: speedup over the torch backend ({', '.join(dtypes)}; above 1 = faster)",
        fontsize=11,
        x=0.02,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def plot(rows: list[dict[str, object]], out_dir: Path) -> list[Path]:
    """speedup_<op>.png (per op: a panel per shape, each implementation's speedup over the torch
    backend per mode). Axes go logarithmic where the values span more than 10x. Returns the files
    written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {}
    for op in sorted({r["op"] for r in rows if r["kind"] == "op" and "median_ms" in r}):
        timed = [
            r
            for r in rows
            if r.get("op") == op
            and "median_ms" in r
            and r["backend"] != "torch"
            and "torch" in r.get("speedup", {})
        ]
        if timed:
            figures[f"speedup_{op}.png"] = _speedup_figure(plt, op, timed)
    written = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def e2e_chart(report: dict, path: Path, variants: tuple) -> Optional[Path]:
    """The end-to-end table as bars (``python -m benchmarks e2e``): a panel per model, mode and
    batch, images/s per variant in ``variants``' order (one not measured says so), the plain
    PyTorch variants grey and the vk ones coloured; written atomically beside the markdown. None
    where matplotlib is absent or nothing was measured."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r.get("images_per_second")]
    keys = list(dict.fromkeys((r["model"], r["mode"], r["batch"]) for r in rows))
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(8.5, 1.2 + 1.5 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        found = {
            r["variant"]: r["images_per_second"] for r in rows if (r["model"], r["mode"], r["batch"]) == key
        }
        names = [v for v in variants if v in found or not v.endswith("tuned")]  # a twin missing: said
        colours = ["tab:orange" if v.startswith("vk") else "tab:grey" for v in names]
        ax.barh(names, [found.get(v, 0.0) for v in names], color=colours)
        ax.invert_yaxis()
        for y, v in enumerate(names):
            ax.text(
                found.get(v, 0.0),
                y,
                f" {found[v]:,.0f}" if v in found else " not measured",
                va="center",
                fontsize=8,
            )
        ax.set_title(f"{key[0]} {key[1]} B={key[2]}", fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        ax.margins(x=0.15)
    fig.suptitle(
        f"End to end on {report['device']}, {report['date']}: images / second (higher is better)",
        fontsize=10,
        x=0.02,
        ha="left",
    )
    fig.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(temporary, dpi=100)
    plt.close(fig)
    temporary.replace(path)
    return path


# The per-op table's names: ``ops_bench``'s implementation names as variants, its modes.
OP_VARIANTS = {
    "pytorch": "eager",
    "torch.compile": "compile",
    "auto": "vk",
    "torch": "vk-torch",
    "triton": "vk-triton",
    "extension": "vk-extension",
    "eager_math": "eager-math",
    "sdpa_flash": "flash",
    "sdpa_efficient": "efficient",
    "sdpa_cudnn": "cudnn",
    "sdpa_math": "math",
}
OP_MODES = {"forward": "fwd", "full": "fwd+bwd"}


def op_table_rows(rows: list[dict]) -> list[dict]:
    """The timed per-op rows in the one per-op schema: ``op``, ``shape`` (the model, then
    ``B=<batch>``), ``mode`` (fwd | fwd+bwd), ``variant``, ``median_ms``, ``q20_ms``, ``q80_ms``
    (and ``dtype``)."""
    return [
        {
            "op": r["op"],
            "shape": " ".join(r["shape"].split()[:2]),
            "mode": OP_MODES.get(r["mode"], r["mode"]),
            "variant": OP_VARIANTS.get(r["backend"], r["backend"]),
            "dtype": r["dtype"],
            **{key: r[key] for key in ("median_ms", "q20_ms", "q80_ms")},
        }
        for r in rows
        if r.get("kind") == "op" and "median_ms" in r
    ]


def write_op_table(
    out_dir: Path, device_name: str, slug: str, date: str, rows: list[dict], path: Optional[Path] = None
) -> Path:
    """``<out_dir>/ops-<slug>-<date>.json`` (``-2``, ``-3``, ... after the first of a day; ``path``:
    this run's, rewritten): a top-level ``device`` and ``date``, and ``op_table_rows(rows)``,
    atomically."""
    if path is None:
        path, n = out_dir / f"ops-{slug}-{date}.json", 1
        while path.exists():
            n += 1
            path = out_dir / f"ops-{slug}-{date}-{n}.json"
    table = {"device": device_name, "date": date, "rows": op_table_rows(rows)}
    write_atomically(path, json.dumps(table, indent=1) + "\n")
    return path
