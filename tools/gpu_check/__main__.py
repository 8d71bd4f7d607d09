"""python -m tools.gpu_check [--all] [--ops attention,...] [--targets 80,90] [--jobs N] [--out DIR]

Compiles every Triton kernel variant the launchers can choose on CUDA for each target, writes
``DIR/report.json`` and ``DIR/report.md``, prints a summary, and exits 1 on any failure:

* a compile error;
* register spills (local memory) in any variant: 16-bit variants must not spill, and the float32
  budget is also zero (FP32_SPILL_BUDGET): exact float32 tiles are sized to fit the register file,
  since a spill costs a local-memory round trip per access in the inner loop;
* shared memory over the target's per-block limit, or no CTA fitting on an SM;
* a transpose of a computed register tile reaching a dot operand in the TTGIR (``ttgir``), the
  pattern Triton miscompiles on Hopper (triton-lang/triton#6124); transposes of tiles as loaded,
  and of shared-memory descriptors, pass;
* a grid dimension over CUDA's limits (2^31 - 1 on x, 65,535 on y and z);
* integer index arithmetic that overflows its type at the recorded sizes (``int_range``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tools.gpu_check import cases as sweeps
from tools.gpu_check.compile import (
    CACHE_ENV,
    GRID_LIMITS,
    TARGETS,
    Compiled,
    Resources,
    Variant,
    bind,
    compile_variant,
    compiled_folder,
    count_line,
    expand,
)
from tools.gpu_check.int_range import find_overflows
from tools.gpu_check.report import write_reports

FP32_SPILL_BUDGET = 0  # bytes of local memory per thread allowed in a float32-only variant
_JOBS: list = []  # (variant, capability, bound), shared with forked workers
_COMPILED: list = [None]  # the Compiled folder in use, or None: compile everything afresh


def _compile_job(index: int) -> tuple[Resources, bool]:
    """-> (what the variant's compile found, whether it was read from the folder)."""
    variant, capability, bound = _JOBS[index]
    compiled = _COMPILED[0]
    if compiled is None:
        return compile_variant(variant, capability, bound), False
    return compiled.compile(variant, capability, bound)


def _is_16bit(bound) -> bool:
    return any(t in ("*fp16", "*bf16") for t in bound.signature.values())


def variant_failures(variant: Variant, capability: int, bound, resources: Resources) -> list[str]:
    """Why one compiled variant fails the gate (none: it passes). Also what the simulated CUDA
    device (tests/cuda_sim) applies to the launches it records."""
    where = f"{variant.name} [{variant.config}] sm_{capability}"
    if resources.error:
        return [f"{where}: compile error: {resources.error}"]
    failures = []
    budget = 0 if _is_16bit(bound) else FP32_SPILL_BUDGET
    if resources.spill_bytes > budget:
        failures.append(f"{where}: {resources.spill_bytes} bytes of spills per thread (budget {budget})")
    if resources.shared_bytes > TARGETS[capability]["smem_block"]:
        failures.append(
            f"{where}: {resources.shared_bytes} bytes of shared memory, over the "
            f"{TARGETS[capability]['smem_block']}-byte limit"
        )
    elif resources.ctas_per_sm == 0:
        failures.append(f"{where}: no CTA fits on an SM")
    for transpose in resources.computed_transposes:
        failures.append(
            f"{where}: transpose of a computed tile feeding a dot (triton-lang/triton#6124): {transpose}"
        )
    return failures


def collect(sweep: sweeps.Sweep, targets: list[int], ops=None, every_tile: bool = False):
    """-> unique compile jobs, per launch its labels, variant, bound key per target (only the cases
    of ``ops`` where given; with ``every_tile``, every candidate of every tile table), and how many
    variant bindings were duplicates of a job already held."""
    jobs: dict[str, tuple[Variant, int, object]] = {}
    launches = []
    bindings = 0
    for case in sweeps.cases(sweep):
        if ops is not None and case.op not in ops:
            continue
        for launch in sweeps.record(case, every_tile):
            for variant in expand(launch):
                keys = {}
                for capability in targets:
                    if capability < getattr(variant.kernel, "min_capability", 0):
                        continue  # a kernel the launchers offer on newer GPUs only
                    bound = bind(variant, capability)
                    jobs.setdefault(bound.key, (variant, capability, bound))
                    keys[capability] = bound.key
                    bindings += 1
                launches.append((case, variant, keys))
    return jobs, launches, bindings - len(jobs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--all", action="store_true", help="the full sweep (every precision, flag, batch 1 to 16,384)"
    )
    parser.add_argument(
        "--every-tile",
        action="store_true",
        help="every candidate of every tile table, as vk.tune searches them (default: the tiles a "
        "first call launches; --all implies it)",
    )
    parser.add_argument(
        "--ops", default=None, help="only these ops' cases, comma-separated (default: every op)"
    )
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated (80, 90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--out", default="build/check-gpu", help="folder for report.json and report.md")
    parser.add_argument(
        "--compiled",
        default=str(compiled_folder()),
        help="folder keeping what each exact variant's compile found, reused by later runs, the aot "
        f"tests and the simulated device's recorded launches (${CACHE_ENV} moves it; empty: compile "
        "every variant afresh)",
    )
    args = parser.parse_args(argv)
    targets = [int(t) for t in args.targets.split(",")]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"--targets must be among {sorted(TARGETS)}, got {unknown}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")

    ops = None if args.ops is None else set(args.ops.split(","))
    known_ops = {case.op for case in sweeps.cases(sweeps.QUICK)}
    if ops is not None and not ops <= known_ops:
        parser.error(f"--ops must be among {sorted(known_ops)}, got {sorted(ops - known_ops)}")

    start = time.time()
    sweep = sweeps.FULL if args.all else sweeps.QUICK
    jobs, launches, duplicates = collect(sweep, targets, ops, every_tile=args.all or args.every_tile)
    keys = list(jobs)
    _JOBS[:] = [jobs[k] for k in keys]
    _COMPILED[0] = Compiled(Path(args.compiled)) if args.compiled else None
    print(
        f"gpu_check: {len(launches)} launches, {len(keys)} unique variants to compile for "
        f"{', '.join(f'sm_{t}' for t in targets)}",
        flush=True,
    )
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            found = list(pool.map(_compile_job, range(len(keys)), chunksize=4))
    else:
        found = [_compile_job(i) for i in range(len(keys))]
    results = {key: resources for key, (resources, _) in zip(keys, found)}
    print(f"gpu_check: {count_line(found, duplicates, _COMPILED[0])}", flush=True)

    failures: list[str] = []
    for key, resources in results.items():
        failures += variant_failures(*jobs[key], resources)
    checked = set()
    for case, variant, keys_by_target in launches:
        label = f"{case.op} {case.precision} {case.shape} {case.flags} batch={case.batch}: {variant.name}"
        for axis, (size, limit) in enumerate(zip(variant.grid, GRID_LIMITS)):
            if size > limit:
                failures.append(f"{label}: grid axis {'xyz'[axis]} = {size} over CUDA's {limit}")
        if not keys_by_target:
            continue
        key = keys_by_target[max(keys_by_target)]
        signature = (key, tuple(sorted(variant.int_args().items())), variant.grid)
        if signature in checked or results[key].error:
            continue
        checked.add(signature)
        for overflow in find_overflows(results[key].ttir, variant.int_args(), variant.grid):
            failures.append(f"{label} [{variant.config}]: {overflow}")

    out = Path(args.out)
    summary = write_reports(out, jobs, results, launches, failures, targets, time.time() - start)
    print(summary)
    for failure in failures[:200]:
        print(f"FAIL {failure}")
    if len(failures) > 200:
        print(f"... and {len(failures) - 200} more failures (all in {out / 'report.json'})")
    print(f"gpu_check: {len(failures)} failures; report in {out / 'report.md'} ({time.time() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
