"""python -m benchmarks.gpu_report (make gpu-report): everything measured on one GPU, in one command
of about 6 minutes on an H100, written to one JSON and one markdown file.

Sections, in order, each with a time budget (what does not fit in it is left out and listed as such):
the device and versions; the GPU tests (``pytest -m gpu``, exit 5 = failure); the selftest (every op,
backend and dtype against PyTorch's own error); the host cost per call of every op and backend; a
training step captured in a CUDA graph on every backend; per-op timings at ViT-B/L/S/Ti/16 shapes
against plain PyTorch, each SDPA backend and torch.compile. The issues' targets are printed beside
the measured figures (the end-to-end table is ``python -m benchmarks e2e``'s).

Without a GPU it says so, runs the CPU part (the environment, the collection count of
``pytest -m gpu``, the selftest on the CPU, the host-cost table) and exits 0. ``--sections`` picks
sections (on a CPU, the GPU ones then run as a smoke test of their code at the smallest preset with
``--quick``). The exit code is 0 whenever the report is written: failures are in the report.

    python -m benchmarks.gpu_report [--out build/gpu-report] [--total 335] [--sections a,b] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from benchmarks import environment, gpu_report_markdown, headline, targets
from benchmarks.report import write_op_table
from benchmarks.budget import Budget, shares
from benchmarks.gpu_report_sections import CPU_SECTIONS, SECTIONS, Context
from tools.op_specs import OPS
from vit_kernels import backend
from vit_kernels._files import write_atomically

NO_GPU = "No CUDA GPU found: nothing in this report was measured on a GPU (the CPU part ran on the CPU)."
DEFAULT_TOTAL_S = 335.0  # the sections' budgets, scaled to this; startup and writing make up about 6 minutes


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=Path("build/gpu-report"), help="folder for the report files"
    )
    parser.add_argument(
        "--total",
        type=float,
        default=DEFAULT_TOTAL_S,
        help="seconds for all sections together: their budgets are scaled to it (default %(default)s)",
    )
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated, from {', '.join(SECTIONS)} (default: all on a GPU, "
        f"{', '.join(CPU_SECTIONS)} without one)",
    )
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    parser.add_argument(
        "--quick", action="store_true", help="fewer calls and the smallest preset: a smoke run"
    )
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    args = parser.parse_args(argv)
    args.ops = tuple(op for op in args.ops.split(",") if op)
    chosen = (
        args.sections.split(",")
        if args.sections
        else list(SECTIONS if torch.cuda.is_available() else CPU_SECTIONS)
    )
    unknown = [s for s in chosen if s not in SECTIONS] + [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(
            f"unknown sections or ops {unknown}; sections: {', '.join(SECTIONS)}; ops: {', '.join(OPS)}"
        )
    args.sections = [s for s in SECTIONS if s in chosen]
    return args


def run_sections(
    ctx: Context, names: list[str], total_s: float, after=lambda results: None
) -> dict[str, dict]:
    """Each section in turn under its budget (scaled so that all fit in ``total_s``, and shrunk in
    proportion when an earlier one overran); an exception is recorded, not raised."""
    wanted = {name: SECTIONS[name][1] for name in names}
    scale = total_s / sum(wanted.values())
    deadline = time.perf_counter() + total_s
    results: dict[str, dict] = {}
    for i, name in enumerate(names):
        later = {n: wanted[n] * scale for n in names[i:]}
        budget = Budget(
            shares(later, max(0.0, deadline - time.perf_counter()))[name],
            on_admit=lambda label, name=name: print(
                f"gpu-report: {name}: {label}", file=sys.stderr, flush=True
            ),
        )
        print(f"gpu-report: {name} (budget {budget.seconds:.0f} s) ...", file=sys.stderr, flush=True)
        try:
            results[name] = {"status": "ok", "result": SECTIONS[name][0](ctx, budget)}
        except Exception as error:  # one section's failure must not lose the others
            results[name] = {
                "status": "error",
                "result": None,
                "error": "".join(traceback.format_exception(error))[-4000:].strip(),
            }
        results[name].update(budget.summary())
        if budget.skipped:
            results[name]["status"] += f" (budget spent: {len(budget.skipped)} left out)"
        print(
            f"gpu-report: {name} {results[name]['status']} in {budget.used():.0f} s",
            file=sys.stderr,
            flush=True,
        )
        after(results)
    return results


def _all_rows(sections: dict[str, dict]) -> list[dict]:
    return list(((sections.get("ops") or {}).get("result") or {}).get("rows", []))


def build(args: argparse.Namespace) -> dict:
    """Run the chosen sections; the report as a JSON-able dict."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if device.type != "cuda":
        print(f"gpu-report: {NO_GPU}", file=sys.stderr)
    ctx = Context(
        device, quick=args.quick, compile=not args.no_compile, ops=args.ops, meta=environment.describe(device)
    )

    def data(sections: dict[str, dict]) -> dict:
        return {
            "report": "vit-kernels gpu-report",
            "gpu": device.type == "cuda",
            "note": None if device.type == "cuda" else NO_GPU,
            "device": ctx.meta["device"],
            "command": " ".join(["python -m benchmarks.gpu_report", *sys.argv[1:]]),
            "started": stamp,
            "seconds": time.perf_counter() - started,
            "total_budget_s": args.total,
            "triton_interpret": backend.TRITON_INTERPRET,
            "targets": targets.compare(_all_rows(sections)),
            "sections": sections,
        }

    def partial(sections: dict[str, dict]) -> None:  # a run killed later still leaves what was done
        try:
            write(data(sections), args.out)
        except Exception as error:
            print(f"gpu-report: could not write the partial report: {error}", file=sys.stderr)

    return data(run_sections(ctx, args.sections, args.total, after=partial))


def write(data: dict, out: Path) -> tuple[Path, ...]:
    """gpu-report.json and gpu-report.md in ``out``, each written atomically; with the ops section
    done, its per-op table too (``report.write_op_table``: ``ops-<gpu>-<date>.json``)."""
    paths = out / "gpu-report.json", out / "gpu-report.md"
    write_atomically(paths[0], json.dumps(data, indent=1, default=str) + "\n")
    write_atomically(paths[1], gpu_report_markdown.render(data) + "\n")
    ops = (data["sections"].get("ops") or {}).get("result") or {}
    if not ops.get("rows"):
        return paths
    device = torch.device("cuda" if data["gpu"] else "cpu")
    key = (out, data["started"])  # this run's table: named once, rewritten by later partial writes
    _op_tables[key] = write_op_table(
        out,
        data["device"],
        headline.device_slug(device),
        data["started"][:10],
        ops["rows"],
        _op_tables.get(key),
    )
    return paths + (_op_tables[key],)


_op_tables: dict[tuple, Path] = {}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    data = build(args)
    for path in write(data, args.out):
        print(f"gpu-report: wrote {path}")
    summary = [f"{name}: {s['status']}" for name, s in data["sections"].items()]
    print(f"gpu-report: {'GPU' if data['gpu'] else NO_GPU} {data['seconds']:.0f} s; " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
