"""python -m benchmarks ab: is the candidate slower than the baseline, beyond the noise?

    python -m benchmarks ab --baseline origin/main                    # candidate: the working tree
    python -m benchmarks ab --baseline v0.1.0 --candidate HEAD --ops layer_norm,attention --models none

Each side is a source tree (a git revision exported to a temporary folder, or the working tree);
nothing is built or installed. One long-lived process per side imports that tree's ``vit_kernels``
and ``vit`` (the benchmark code itself is this tree's, copied, the same for both), prepares every
case once (validated against the reference), then the two are timed in alternating rounds,
A B, B A, A B, ... case by case, in the same session: load and frequency drift hit both sides. On
the CPU both sides run one thread, pinned to the same core. A side's time for a case in a round is
the fastest call in a slice of about 20 ms (load only ever adds time).

Per case, the ratio candidate/baseline is the median of the per-round ratios, with a bootstrap
interval. A case is a REGRESSION when its whole interval lies above 1 + threshold; ``within`` when
it lies at or below; otherwise inconclusive, and more rounds are run for the undecided cases until
each is decided or the time budget is spent.

A regression must then be confirmed: its cases are timed again, from new samples, by fresh pairs
of processes (``--confirmations``, 4 by default), one after the other. Two processes running the
same code can differ by several percent, on the CPU by 10-20% for a kernel whose tensors outgrow
the caches, for as long as they live (where their memory happens to lie, which core caches what):
such a process lands in a slow or a fast state, so one pair in four or so can look like a
regression. CPU runs have confirmed 13% ones across two pairs of identical code, more than once: with
two confirmations and a few flagged cases per run, about one run in ten fails on placement alone.
A real slowdown survives every fresh pair; an accident of placement survives four with a chance of
about 1/4^4 = 0.4% per flagged case. Only a regression that every confirming pair finds counts; one
that a pair clears takes that pair's verdict (and says so). Confirming pairs time only the flagged
cases, so each costs seconds.

Exit 1: a confirmed regression (or the candidate fails a case); 3: inconclusive, noise too high;
0: all within the threshold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks import cases, cli, gate, ops_bench, stats, trees

BACKENDS_BY_DEVICE = {"cpu": "torch,extension", "cuda": "torch,triton,extension"}
SHAPES_BY_DEVICE = {"cpu": "vit_digits:8,vit_small_patch16_224:2", "cuda": "vit_base_patch16_224:64"}
MODELS_BY_DEVICE = {"cpu": "vit_digits:64", "cuda": "vit_base_patch16_224:64"}
MODEL_MODES = ("train", "inference")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline", required=True, metavar="REV", help="git revision to compare against (required)"
    )
    parser.add_argument(
        "--candidate",
        default=trees.WORKTREE,
        metavar="REV",
        help="git revision, or 'worktree' (default): the working tree as it is, uncommitted changes included",
    )
    parser.add_argument(
        "--repo", type=Path, default=None, help="the git repository (default: the one holding the cwd)"
    )
    cli.add_device_option(parser)
    parser.add_argument(
        "--ops", default=",".join(cases.OPS + cases.KERNELS), help="comma-separated ops, or 'none'"
    )
    parser.add_argument(
        "--shapes",
        default=None,
        metavar="MODEL:BATCH,...",
        help=f"op shapes (default: {SHAPES_BY_DEVICE['cpu']} on the CPU, {SHAPES_BY_DEVICE['cuda']} on CUDA)",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help=f"op backends (default: {BACKENDS_BY_DEVICE['cpu']} on the CPU, "
        f"{BACKENDS_BY_DEVICE['cuda']} on CUDA)",
    )
    parser.add_argument("--modes", default=",".join(ops_bench.MODES), help="op modes: forward,backward,full")
    parser.add_argument(
        "--models",
        default=None,
        metavar="MODEL:BATCH,...",
        help=f"end-to-end train and inference steps on the auto backend, or 'none' "
        f"(default: {MODELS_BY_DEVICE['cpu']} on the CPU, {MODELS_BY_DEVICE['cuda']} on CUDA)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, float16 or bfloat16 (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument("--threshold", type=float, default=0.05, help="allowed slowdown (0.05 = 5%%)")
    parser.add_argument("--confidence", type=float, default=0.95, help="bootstrap interval level")
    parser.add_argument("--min-rounds", type=int, default=10, help="rounds before the first verdict")
    parser.add_argument("--max-rounds", type=int, default=400, help="never more rounds than this")
    parser.add_argument(
        "--budget",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="time for rounds (setup excluded): undecided cases get rounds until it is spent",
    )
    parser.add_argument(
        "--slice-ms", type=float, default=20.0, help="per round and side, each case runs for about this long"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads in each side (default: 1 on the CPU, where both sides are then pinned to "
        "the same core; 0: torch's default)",
    )
    parser.add_argument(
        "--confirmations",
        type=int,
        default=4,
        help="fresh pairs of processes that must each find a flagged regression again (at least 1)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write every case's samples and verdict to this JSON file (default: none)",
    )


def _list(text: str) -> list[str]:
    return [] if text.strip() in ("", "none") else [t.strip() for t in text.split(",") if t.strip()]


def _model_batches(text: str, what: str) -> list[tuple[str, int]]:
    from vit.model import get_config

    pairs = []
    for item in _list(text):
        model, _, batch = item.partition(":")
        try:
            get_config(model)
            pairs.append((model, int(batch)))
        except (KeyError, ValueError) as error:
            raise SystemExit(
                f"{what}: expected MODEL:BATCH such as vit_digits:8, got {item!r} ({error})"
            ) from None
        if pairs[-1][1] < 1:
            raise SystemExit(f"{what}: the batch must be positive, got {item!r}")
    return pairs


def _checked(chosen: list[str], valid, what: str) -> list[str]:
    unknown = [c for c in chosen if c not in valid]
    if unknown:
        raise SystemExit(f"{what}: unknown {unknown}; choose from {', '.join(valid)}")
    return chosen


def build_cases(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The case specs (see ``ab_worker``) the options ask for. A bare kernel (``cases.KERNELS``) is
    compared on the extension only: its torch column is PyTorch's own eager code, with nothing of
    this project in it to regress (and PyTorch's GELU backward on the CPU runs at one of two speeds,
    1.9x apart, depending on the process: a false alarm waiting to happen)."""
    kind = device.type
    dtype = args.dtype or ("bfloat16" if kind == "cuda" else "float32")
    _checked([dtype], ("float32", "float16", "bfloat16"), "--dtype")
    ops = _checked(_list(args.ops), cases.OPS + cases.KERNELS, "--ops")
    backends = _checked(_list(args.backends or BACKENDS_BY_DEVICE[kind]), ops_bench.BACKENDS, "--backends")
    modes = _checked(_list(args.modes), ops_bench.MODES, "--modes")
    specs = [
        {
            "kind": "op",
            "op": op,
            "model": model,
            "batch": batch,
            "dtype": dtype,
            "backend": backend,
            "mode": mode,
        }
        for model, batch in _model_batches(args.shapes or SHAPES_BY_DEVICE[kind], "--shapes")
        for op in ops
        for backend in (["extension"] if op in cases.KERNELS else backends)
        for mode in modes
    ]
    specs += [
        {"kind": "model", "model": model, "batch": batch, "dtype": dtype, "backend": "auto", "mode": mode}
        for model, batch in _model_batches(args.models or MODELS_BY_DEVICE[kind], "--models")
        for mode in MODEL_MODES
    ]
    if not specs:
        raise SystemExit("nothing to compare: give --ops and/or --models")
    return specs


def label(spec: dict) -> str:
    what = spec["op"] if spec["kind"] == "op" else f"model {spec['model']}"
    shape = f"{spec['model']} B={spec['batch']}" if spec["kind"] == "op" else f"B={spec['batch']}"
    return f"{what} {shape} {spec['dtype']} {spec['backend']} {spec['mode']}"


class Worker:
    """One side's process (``benchmarks.ab_worker``), spoken to one JSON line at a time."""

    def __init__(self, name: str, tree: trees.Tree, harness: Path, log_dir: Path):
        self.name, self.tree = name, tree
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        # OpenMP threads that spin while the other side runs would slow it: they sleep when idle.
        env = {
            "OMP_WAIT_POLICY": "PASSIVE",
            **os.environ,
            "PYTHONPATH": str(tree.root),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        # cwd = the harness: `python -m` puts it first on sys.path, so `benchmarks` is the harness's
        # and `vit_kernels` / `vit` come from this side's tree.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.ab_worker"],
            cwd=harness,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        reply = json.loads(line) if line else {"error": f"the process exited with code {self.process.wait()}"}
        if "error" in reply:
            self._log.flush()
            tail = self.log_path.read_text()[-3000:]
            raise SystemExit(f"the {self.name} side ({self.tree.label}) failed: {reply['error']}\n{tail}")
        return reply

    def time(self, case: int, slice_ms: float) -> float:
        self.send({"cmd": "time", "case": case, "slice_ms": slice_ms})
        return float(self.receive()["ms"])

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()


def _verdicts(specs, comparable, samples, threshold, confidence) -> dict[int, gate.Comparison]:
    out = {}
    for i in comparable:
        base, cand = samples[i]
        ratio = stats.paired_ratio(base, cand, confidence)
        out[i] = gate.judge(label(specs[i]), stats.np.median(base), stats.np.median(cand), ratio, threshold)
    return out


def run_rounds(
    workers: list[Worker], specs: list[dict], comparable: list[int], args
) -> tuple[dict, dict, int, float]:
    """Alternating rounds until every comparable case is decided, ``max_rounds`` or the budget.
    Returns (samples per case: ([baseline ms], [candidate ms])), verdicts, rounds run, seconds)."""
    samples = {i: ([], []) for i in comparable}
    undecided = list(comparable)
    shuffle = random.Random(0).shuffle
    rounds, started, verdicts = 0, time.monotonic(), {}
    round_s = 0.0
    while undecided and rounds < args.max_rounds:
        round_started = time.monotonic()
        shuffle(undecided)
        for i in undecided:
            order = (0, 1) if (rounds + i) % 2 == 0 else (1, 0)
            for side in order:
                samples[i][side].append(workers[side].time(i, args.slice_ms))
        rounds += 1
        round_s = time.monotonic() - round_started
        elapsed = time.monotonic() - started
        out_of_time = elapsed + round_s > args.budget
        if rounds >= args.min_rounds or out_of_time:
            verdicts.update(_verdicts(specs, undecided, samples, args.threshold, args.confidence))
            undecided = [i for i in undecided if verdicts[i].verdict == stats.INCONCLUSIVE]
            if rounds == args.min_rounds or rounds % 10 == 0 or out_of_time:
                print(
                    f"ab: {rounds} rounds, {elapsed:.0f} s: {len(undecided)} of {len(comparable)} cases undecided",
                    file=sys.stderr,
                )
        if out_of_time:
            break
    return samples, verdicts, rounds, time.monotonic() - started


def set_up(workers: list[Worker], specs: list[dict], device: torch.device, threads: int) -> list[dict]:
    """Have each side prepare (and validate) every case; returns their replies (a status per case)."""
    setup = {
        "cmd": "setup",
        "device": str(device),
        "threads": threads,
        "cpus": _shared_cpus(device, threads),
        "cases": specs,
    }
    for worker in workers:
        worker.send(setup)
    replies = [worker.receive() for worker in workers]
    for worker, reply in zip(workers, replies):
        if not Path(reply["vit_kernels"]).resolve().is_relative_to(worker.tree.root.resolve()):
            raise SystemExit(
                f"the {worker.name} side imported vit_kernels from {reply['vit_kernels']}, "
                f"not from {worker.tree.root}"
            )
    return replies


def confirm(
    flagged: list[int],
    specs: list[dict],
    sides,
    harness: Path,
    folder: Path,
    device: torch.device,
    threads: int,
    args,
) -> tuple[dict[int, gate.Comparison], dict[int, tuple[list, list]]]:
    """Time the ``flagged`` cases again, with new samples, by ``args.confirmations`` fresh pairs of
    processes in turn; a case stays a REGRESSION only if every pair finds one again, and takes the
    verdict of the first pair that does not. Returns the verdicts and the samples of the last pair
    that timed each case, by case index."""
    verdicts: dict[int, gate.Comparison] = {}
    samples: dict[int, tuple[list, list]] = {}
    pending = list(flagged)
    for attempt in range(1, args.confirmations + 1):
        if not pending:
            break
        print(
            f"ab: {len(pending)} regression(s) to confirm with fresh pair {attempt} of {args.confirmations}",
            file=sys.stderr,
        )
        subset = [specs[i] for i in pending]
        workers = [
            Worker(f"{name}-confirm{attempt}", tree, harness, folder)
            for name, tree in zip(("baseline", "candidate"), sides)
        ]
        try:
            set_up(workers, subset, device, threads)
            pair_samples, pair_verdicts, _, _ = run_rounds(workers, subset, list(range(len(subset))), args)
        finally:
            for worker in workers:
                worker.close()
        still = []
        for j, i in enumerate(pending):
            samples[i] = pair_samples[j]
            regressed = pair_verdicts[j].verdict == stats.REGRESSION
            note = (
                f"confirmed by {attempt} fresh pair{'s' * (attempt > 1)}"
                if regressed
                else f"regression not confirmed by fresh pair {attempt}"
            )
            verdicts[i] = dataclasses.replace(pair_verdicts[j], note=note)
            if regressed:
                still.append(i)
        pending = still
    return verdicts, samples


def _shared_cpus(device: torch.device, threads: int) -> Optional[list[int]]:
    """With one thread per side on the CPU, the one core both sides are pinned to (the last one this
    process may use): they never run at once, so they meet the same neighbours. Else None."""
    if device.type != "cpu" or threads != 1 or not hasattr(os, "sched_getaffinity"):
        return None
    return [max(os.sched_getaffinity(0))]


def _not_compared(spec: dict, base_status: str, cand_status: str) -> gate.Comparison:
    if base_status == cand_status and base_status.startswith("not compared"):
        return gate.Comparison(label(spec), None, None, None, base_status)
    if base_status == "ok" and cand_status.startswith("invalid"):
        return gate.Comparison(label(spec), None, None, None, gate.BROKEN + f" ({cand_status})")
    why = base_status if base_status != "ok" else cand_status
    side = "baseline" if base_status != "ok" else "candidate"
    return gate.Comparison(label(spec), None, None, None, f"not compared: {side} {why}")


def write_json(
    path: Path,
    meta: dict,
    specs: list[dict],
    comparisons: list[gate.Comparison],
    samples: dict,
    confirmation: dict,
) -> None:
    rows = []
    for i, (spec, c) in enumerate(zip(specs, comparisons)):
        base, cand = samples.get(i, ([], []))
        rows.append(
            {
                **spec,
                "case": c.case,
                "verdict": c.verdict,
                "note": c.note,
                "baseline_samples_ms": base,
                "candidate_samples_ms": cand,
                **({"ratio": c.ratio.value, "low": c.ratio.low, "high": c.ratio.high} if c.ratio else {}),
            }
        )
        if i in confirmation:  # the ratio and verdict are the confirmation's
            rows[-1]["confirmation_baseline_samples_ms"], rows[-1]["confirmation_candidate_samples_ms"] = (
                confirmation[i]
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    os.replace(partial, path)


def main(args: argparse.Namespace) -> int:
    gate.check_threshold(args.threshold)
    if not 0.5 <= args.confidence < 1:
        raise SystemExit(f"--confidence must be in [0.5, 1), got {args.confidence}")
    if args.confirmations < 1:
        raise SystemExit(f"--confirmations must be at least 1, got {args.confirmations}")
    if args.min_rounds < 3 or args.max_rounds < args.min_rounds:
        raise SystemExit(
            f"--min-rounds must be at least 3 and --max-rounds at least --min-rounds, got "
            f"{args.min_rounds} and {args.max_rounds}"
        )
    for option, value in (("--budget", args.budget), ("--slice-ms", args.slice_ms)):
        if not 0 < value < float("inf"):
            raise SystemExit(f"{option} must be a positive number, got {value}")
    device = cli.check_device("--device", args.device)
    specs = build_cases(args, device)
    threads = (1 if device.type == "cpu" else 0) if args.threads is None else args.threads
    if threads < 0:
        raise SystemExit(f"--threads must be 0 (torch's default) or more, got {threads}")
    cli.check_output("--out", args.out)
    if args.repo is not None and not args.repo.is_dir():
        raise SystemExit(f"--repo {args.repo}: expected the folder of a git repository")
    repo = trees.repo_root(args.repo or Path.cwd())
    with tempfile.TemporaryDirectory(prefix="vit-kernels-ab-") as tmp:
        folder = Path(tmp)
        sides = [
            trees.materialise(repo, args.baseline, folder),
            trees.materialise(repo, args.candidate, folder),
        ]
        harness = trees.copy_harness(folder)
        for name, tree in zip(("baseline", "candidate"), sides):
            print(f"ab: {name} {tree.label}" + (f"; {tree.note}" if tree.note else ""), file=sys.stderr)
        workers = [
            Worker(name, tree, harness, folder) for name, tree in zip(("baseline", "candidate"), sides)
        ]
        try:
            replies = set_up(workers, specs, device, threads)
            statuses = [reply["status"] for reply in replies]
            if (replies[0]["extension"] is None) != (replies[1]["extension"] is None):
                one_sided = "not compared: the compiled extension loads on one side only, so auto differs"
                statuses = [
                    [
                        one_sided if spec["backend"] == "auto" and status == "ok" else status
                        for spec, status in zip(specs, side)
                    ]
                    for side in statuses
                ]
            comparable = [i for i in range(len(specs)) if statuses[0][i] == statuses[1][i] == "ok"]
            print(
                f"ab: {len(comparable)} of {len(specs)} cases run on both sides; rounds of about "
                f"{2 * len(comparable) * args.slice_ms / 1e3:.1f} s",
                file=sys.stderr,
            )
            samples, verdicts, rounds, seconds = run_rounds(workers, specs, comparable, args)
        finally:
            for worker in workers:
                worker.close()
        flagged = [i for i in comparable if verdicts[i].verdict == stats.REGRESSION]
        confirmation_samples = {}
        if flagged:
            confirmed, confirmation_samples = confirm(
                flagged, specs, sides, harness, folder, device, threads, args
            )
            verdicts.update(confirmed)
    comparisons = [
        verdicts[i] if i in verdicts else _not_compared(specs[i], statuses[0][i], statuses[1][i])
        for i in range(len(specs))
    ]
    print(f"baseline:  {sides[0].label}" + (f" [{sides[0].note}]" if sides[0].note else ""))
    print(f"candidate: {sides[1].label}" + (f" [{sides[1].note}]" if sides[1].note else ""))
    print(
        f"device: {device}, torch {torch.__version__}; {rounds} rounds in {seconds:.0f} s; ratio = candidate/baseline "
        f"time, median of per-round ratios; threshold {args.threshold:.0%}"
    )
    print(gate.table(comparisons, args.confidence))
    print(gate.summary(comparisons, args.threshold))
    code = gate.exit_code(comparisons)
    if code == gate.EXIT_INCONCLUSIVE:
        print(
            f"inconclusive: noise too high, ran {rounds} rounds ({seconds:.0f} s of a {args.budget:.0f} s budget); "
            f"raise --budget or --threshold, or run on a quieter machine"
        )
    if args.out:
        meta = {
            "baseline": sides[0].label,
            "candidate": sides[1].label,
            "device": str(device),
            "rounds": rounds,
            "seconds": seconds,
            "threshold": args.threshold,
            "confidence": args.confidence,
            "exit_code": code,
        }
        write_json(args.out, meta, specs, comparisons, samples, confirmation_samples)
    return code
