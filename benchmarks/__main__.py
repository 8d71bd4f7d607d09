"""python -m benchmarks: the per-op benchmarks, the end-to-end table (``benchmarks.headline``), or
the regression gate.

    python -m benchmarks --out results.json            # every op on the GPU (or CPU if none)
    python -m benchmarks --quick --out quick.json      # a few minutes on a CPU: the whole per-op path
    python -m benchmarks e2e [--quick]                 # the end-to-end table: eager, vk, compile, vk+compile
    python -m benchmarks ab --baseline origin/main     # the gate: baseline vs working tree, A/B rounds
    python -m benchmarks --compare BASELINE.json --results CURRENT.json --threshold 0.05

Run `python -m benchmarks ab --help` for the gate's options.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks import ab, cases, cli, compare, environment, headline, noise, ops_bench, peaks, report
from vit_kernels import backend
from vit_kernels._files import write_atomically

# (model, batch) pairs of the per-op shapes: the ViT presets, then EVA02-B/14 (RoPE, SwiGLU),
# DINOv3-B (half RoPE) and a padded NaFlex batch (key-padding mask).
FULL_OP_SHAPES = [
    ("vit_tiny_patch16_224", 256),
    ("vit_small_patch16_224", 256),
    ("vit_base_patch16_224", 256),
    ("vit_large_patch16_224", 256),
    ("vit_base_patch16_siglip_224", 256),
    ("vit_so400m_patch14_siglip_224", 64),
    ("vit_cifar10_small", 256),
    ("vit_digits", 256),
    ("eva02_base_patch14_224", 256),
    ("vit_base_patch16_dinov3", 256),
    ("naflexvit_base_patch16_gap", 256),
]
# On a CPU: ViT shapes at small batches, the smallest preset for interpreted Triton; the rotating and
# the masked attention at ViT-B widths.
QUICK_OP_SHAPES = [
    ("vit_digits", 8),
    ("vit_small_patch16_224", 8),
    ("vit_base_patch16_224", 4),
    ("vit_base_patch16_dinov3", 2),
    ("naflexvit_base_patch16_gap", 2),
]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a CPU / CI smoke run")
    cli.add_device_option(parser)
    parser.add_argument(
        "--ops",
        default=",".join(cases.OPS + cases.KERNELS),
        help="comma-separated ops (and extension kernels) to time ('' for none)",
    )
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated dtypes (default: bfloat16,float16,float32 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--modes", default=",".join(ops_bench.MODES), help="per-op modes: forward,backward,full"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument(
        "--out", type=Path, default=None, help="write every row to this JSON file (default: none)"
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the tables to this markdown file (default: none)"
    )
    parser.add_argument(
        "--plots", type=Path, default=None, help="write PNG plots to this folder (default: none)"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="BASELINE",
        help="regression gate: baseline JSON (default: none, run the suite)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="CURRENT",
        help="regression gate: current JSON, with --compare (default: none)",
    )
    parser.add_argument(
        "--threshold", type=float, default=0.05, help="regression gate: allowed slowdown (0.05 = 5%%)"
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="regression gate: bootstrap interval level"
    )
    parser.add_argument(
        "--threads",
        type=cli.positive_int,
        default=None,
        metavar="N",
        help="torch intra-op CPU threads (default: OMP_NUM_THREADS if set, else the cores this "
        f"process may use, {environment.usable_cores()} here)",
    )
    args = parser.parse_args(argv)
    if (args.compare is None) != (args.results is None):
        parser.error("--compare BASELINE and --results CURRENT go together")
    return args


def _choices(text: str, valid, what: str, option: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in valid]
    if unknown:
        raise SystemExit(
            f"{option}: unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(valid)}"
        )
    return chosen


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    device = cli.check_device("--device", args.device)
    default_dtypes = "bfloat16,float16,float32" if device.type == "cuda" else "float32"
    dtypes = [DTYPES[d] for d in _choices(args.dtypes or default_dtypes, DTYPES, "dtype", "--dtypes")]
    ops = _choices(args.ops, cases.OPS + cases.KERNELS, "op", "--ops")
    modes = _choices(args.modes, ops_bench.MODES, "mode", "--modes")
    if not dtypes:
        raise SystemExit("--dtypes: expected at least one of " + ", ".join(DTYPES))
    if ops and not modes:
        raise SystemExit("--modes: expected at least one of " + ", ".join(ops_bench.MODES))
    cli.check_output("--out", args.out)
    cli.check_output("--markdown", args.markdown)
    cli.check_output("--plots", args.plots, folder=True)
    threads = environment.set_threads(args.threads)
    meta = environment.describe(device)
    print(
        f"benchmarks on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_sha']})",
        file=sys.stderr,
    )
    probes = [noise.probe(device)]
    print(
        f"noise: a fixed workload's times spread by {probes[0]['spread']:.1%}; 1-minute load "
        f"{probes[0]['load_1min'] if probes[0]['load_1min'] is None else round(probes[0]['load_1min'], 2)} on "
        f"{probes[0]['cpu_count']} CPUs; {probes[0]['threads']} threads",
        file=sys.stderr,
    )
    measured = peaks.measure_peaks(device, dtypes, args.quick)
    print("peaks: " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items()), file=sys.stderr)
    rows: list[dict[str, object]] = []
    op_shapes = QUICK_OP_SHAPES if args.quick else FULL_OP_SHAPES
    interpreter = device.type == "cpu" and backend.TRITON_INTERPRET
    for model, batch in op_shapes:
        shape = cases.shape_of(model, batch)
        tiny = shape.rows * shape.dim <= 8 * 5 * 64  # the interpreter runs a kernel per program, slowly
        for op in ops:
            if args.quick and shape.attention and op != "attention":
                continue  # the quick run times the variant shapes' attention only
            for dtype in dtypes:
                started = time.perf_counter()
                new = ops_bench.run_case(
                    cases.build_case(op, shape),
                    device,
                    dtype,
                    modes,
                    measured,
                    compile_reference=not args.no_compile and (not args.quick or tiny),
                    interpreted_triton=interpreter and tiny,
                    meta=meta,
                )
                rows += new
                print(
                    f"  {op:12s} {shape.label:45s} {str(dtype):15s} {len(new):2d} rows "
                    f"{time.perf_counter() - started:6.1f} s",
                    file=sys.stderr,
                )
    # load that arrived during the run counts too; the suite's own threads (1 on a GPU) do not
    probes.append(noise.probe(device, own_load=float(threads if device.type == "cpu" else 1)))
    found = noise.assess(probes, rows)
    table = report.markdown(rows, measured, meta, found)
    print(table)
    if found["noisy"]:
        print("benchmarks: too noisy to trust: " + "; ".join(found["reasons"]), file=sys.stderr)
    try:
        if args.out:
            report.write_json(
                args.out,
                rows,
                measured,
                {
                    **meta,
                    "command": " ".join(sys.argv),
                    "quick": args.quick,
                    "threads": threads,
                    "noise": found,
                },
            )
        if args.markdown:
            write_atomically(args.markdown, table)
        if args.plots:
            for path in report.plot(rows, args.plots):
                print(f"wrote {path}", file=sys.stderr)
    except OSError as error:  # checked before the run; the disk or the folder changed since
        raise SystemExit(
            f"cannot write {error.filename or 'the results'}: {error.strerror or error}"
        ) from None
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["e2e"]:
        return headline.main(argv[1:])
    if argv[:1] == ["ab"]:
        parser = cli.Parser(prog="python -m benchmarks ab", description=ab.__doc__)
        ab.add_arguments(parser)
        return ab.main(parser.parse_args(argv[1:]))
    args = parse_args(argv)
    if args.compare is not None:
        return compare.main(args.compare, args.results, args.threshold, args.confidence)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(
        cli.run(
            "python -m benchmarks" + ("".join(f" {a}" for a in sys.argv[1:2] if a in ("ab", "e2e"))), main
        )
    )
