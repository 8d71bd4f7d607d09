"""python -m tools.selftest: what a user with a GPU runs first.

On each CUDA device it checks every op on every backend that can run there, in float32, float16
and bfloat16, output and every input gradient against a float64 evaluation of the op's formula,
judged against PyTorch's own error: the plain PyTorch eager computation of the op (its reference,
in the same dtype, on the same device, with PyTorch's defaults, TF32 convolutions included) is
compared with the same float64 evaluation, and a backend passes when each of its errors is at most
``ERROR_RATIO`` times PyTorch's (or within a small floor per dtype, so that exact cases do not
demand zero error). Errors are relative: max |error| over the largest magnitude of the tensor's
float64 value (at least ``SIBLING_SCALE`` of the largest among the op's outputs and gradients), as
the tile choosers measure them, so that one floor serves a weight gradient summed over thousands of
rows and an output of order 1. It times forward + backward of each against the PyTorch reference and, when
run from a source checkout, runs the CUDA tests (``pytest -m gpu``; exit 5, no tests collected,
fails). It writes one JSON file (device, versions, pass/fail per op, backend and dtype with both
errors and their ratio, speed versus the reference; ``build/selftest.json`` unless ``--out`` names
another) to attach to a bug report. Without a GPU it runs the same checks on the CPU for the
backends that run there, says clearly that there is no GPU, and exits 0 when they pass. torch runs
on as many intra-op threads as this process has cores, or ``--threads``. A mistake in the options
ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

import vit_kernels as vk
from tools import gpu_tests
from tools.op_specs import SPECS, Shape
from vit_kernels import backend
from vit.cli import OneLineErrors, positive_int, set_threads, usable_cores
from vit_kernels._accuracy import ERROR_RATIO, FLOORS, relative_error, sibling_scale
from benchmarks._timer import time_runs

# A backend passes when each of its relative errors against float64 is at most ERROR_RATIO x
# PyTorch's own in the same dtype, or at most the dtype's floor: the tile choosers' rule and table.
# ViT-S/16 at batch 4; the inputs are those of the op specs (scaled so activations stay O(1)).
SHAPE = Shape(
    "vit_small_patch16_224",
    batch=4,
    tokens=197,
    dim=384,
    heads=6,
    hidden=1536,
    channels=3,
    image=224,
    patch=16,
)


def _inputs(op: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The op spec's random inputs of ``op`` at ``SHAPE``, the same on every run, requiring grad."""
    if op not in backend.OPS:
        raise ValueError(f"op must be one of {backend.OPS}, got {op!r}")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        inputs = SPECS[op].make_inputs(SHAPE, device, dtype)
    return {name: t.requires_grad_() for name, t in inputs.items()}


def _call(op: str) -> Callable[..., object]:
    """The public op of ``op``'s spec, taking the spec's inputs by name."""
    spec = SPECS[op]
    return lambda **inputs: spec.run(SHAPE, **inputs)


def _run(
    fn: Callable, inputs: dict[str, torch.Tensor], cotangents: Optional[list] = None
) -> list[torch.Tensor]:
    """Outputs, then the gradient of every input, for a fixed random cotangent."""
    leaves = list(inputs.values())
    outputs = fn(**inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    if cotangents is None:
        g = torch.Generator(device="cpu").manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outputs]
    grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    return [o.detach() for o in outputs] + [gr for gr in grads if gr is not None]


def _as_float64(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().double().requires_grad_() for name, t in inputs.items()}


def _errors(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> list[float]:
    """Each tensor's relative error against its float64 value (``_accuracy.relative_error``), the scale
    at least SIBLING_SCALE of the largest float64 magnitude among ``expected``."""
    scale = sibling_scale(expected)
    return [relative_error(a.to(e.device), e, scale) for a, e in zip(actual, expected)]


_truth: dict[tuple[str, str, str], tuple[list[str], list[torch.Tensor], list[float]]] = {}


def ground_truth(
    op: str, dtype: torch.dtype, device: torch.device
) -> tuple[list[str], list[torch.Tensor], list[float]]:
    """(tensor names, the float64 formula's outputs and gradients, PyTorch's own error per tensor):
    the op's eager reference run in ``dtype`` on ``device`` with PyTorch's defaults (nothing here
    changes TF32 or reduction settings), against the formula in float64 on the same rounded inputs.
    Computed once per op, dtype and device."""
    key = (op, str(dtype), str(device))
    if key not in _truth:
        spec, inputs = SPECS[op], _inputs(op, dtype, device)
        expected = _run(lambda **t: spec.formula(SHAPE, **t), _as_float64(inputs))
        pytorch = _run(lambda **t: spec.reference(SHAPE, **t), inputs)
        outputs = len(expected) - len(inputs)
        names = [f"output {i}" for i in range(outputs)] + [f"d{name}" for name in inputs]
        _truth[key] = (names, expected, _errors(pytorch, expected))
    return _truth[key]


def judge(names: list[str], errors: list[float], pytorch_errors: list[float], dtype: torch.dtype) -> dict:
    """Pass/fail of one backend's errors against PyTorch's own, per tensor; the row fields: the
    worst tensor (largest error / bound), its error, PyTorch's error, their ratio, and every tensor."""
    floor = FLOORS[dtype]
    tensors = []
    for name, error, own in zip(names, errors, pytorch_errors):
        bound = max(ERROR_RATIO * own, floor)
        tensors.append(
            {
                "tensor": name,
                "error": error,
                "pytorch_error": own,
                "bound": bound,
                "ratio": error / own if own > 0 else (0.0 if error == 0 else float("inf")),
                "passed": error <= bound,
            }
        )
    worst = max(tensors, key=lambda t: t["error"] / t["bound"])
    return {
        "passed": all(t["passed"] for t in tensors),
        "worst_tensor": worst["tensor"],
        "max_error": worst["error"],
        "pytorch_error": worst["pytorch_error"],
        "error_ratio": worst["ratio"],
        "bound": worst["bound"],
        "allowed_ratio": ERROR_RATIO,
        "error_floor": floor,
        "tensors": tensors,
    }


def _time(fn: Callable, inputs: dict[str, torch.Tensor], device: torch.device) -> float:
    """Median milliseconds of forward + backward."""
    outputs = fn(**inputs)  # the cotangents once, here: drawn on the CPU per step they outweigh the kernels
    g = torch.Generator(device="cpu").manual_seed(1)
    cotangents = [
        torch.randn(o.shape, generator=g).to(o.device, o.dtype)
        for o in (outputs if isinstance(outputs, tuple) else [outputs])
    ]

    def step():
        _run(fn, inputs, cotangents)

    cuda = device.type == "cuda"
    samples = time_runs(
        {"step": step}, device, rounds=25 if cuda else 3, budget_s=0.5, min_rounds=3, warmup=3 if cuda else 1
    )
    return statistics.median(samples["step"])


def check_op(op: str, name: str, dtype: torch.dtype, device: torch.device, timed: bool) -> dict:
    """One op on one backend in one dtype: its error and PyTorch's against float64, pass/fail, speed."""
    inputs = _inputs(op, dtype, device)
    fn = _call(op)
    row = {"op": op, "backend": name, "dtype": str(dtype).replace("torch.", ""), "device": str(device)}
    try:
        with vk.use_backend(name, strict=True):
            actual = _run(fn, inputs)
        names, expected, pytorch_errors = ground_truth(op, dtype, device)
        if len(actual) != len(expected):
            raise RuntimeError(
                f"{len(actual)} outputs and gradients, expected {len(expected)} ({', '.join(names)})"
            )
    except backend.CannotRunError as error:  # outside the backend's limits: not a failure
        row.update(passed=True, skipped=str(error)[:500])
        return row
    except Exception as error:  # reported per row: the point is to see every failure at once
        row.update(passed=False, error=f"{type(error).__name__}: {error}"[:500])
        return row
    row.update(judge(names, _errors(actual, expected), pytorch_errors, dtype))
    if timed and row["passed"]:
        with vk.use_backend(name, strict=True):
            row["ms"] = _time(fn, inputs, device)
        with vk.use_backend("torch"):
            row["reference_ms"] = _time(fn, inputs, device)
        row["speedup_vs_reference"] = row["reference_ms"] / row["ms"]
    return row


def _backends_for(device: torch.device, dtype: torch.dtype, op: str) -> list[str]:
    return [b for b in backend.BACKENDS if backend.unsupported_reason(op, b, device, dtype) is None]


def devices_and_dtypes() -> tuple[list[torch.device], tuple[torch.dtype, ...]]:
    """Every CUDA device with float32, float16 and bfloat16; without one, the CPU in float32."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())], (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        )
    return [torch.device("cpu")], (torch.float32,)


def cases(ops: tuple[str, ...] = backend.OPS) -> Iterator[tuple[str, str, torch.dtype, torch.device]]:
    """(op, backend, dtype, device) for every check this machine can run."""
    devices, dtypes = devices_and_dtypes()
    for device in devices:
        for dtype in dtypes:
            for op in ops:
                for name in _backends_for(device, dtype, op):
                    yield op, name, dtype, device


def describe_row(row: dict) -> str:
    """One printed line per check: PASS/FAIL, op, backend, dtype, device, error vs PyTorch's, speed."""
    errors = (
        f"error {row['max_error']:.2g} = {row['error_ratio']:.2f}x PyTorch's {row['pytorch_error']:.2g} "
        f"({row['worst_tensor']})"
        if "max_error" in row
        else row.get("skipped", "")[:60]
    )
    speed = f"; {row['speedup_vs_reference']:.2f}x reference" if "speedup_vs_reference" in row else ""
    return (
        f"{'PASS' if row['passed'] else 'FAIL'} {row['op']:12s} {row['backend']:10s} {row['dtype']:9s} "
        f"{row['device']:7s} {errors}{speed} {row.get('error', '')}"
    )


def header() -> dict:
    """Device, versions, PyTorch's precision defaults in force and the available backends."""
    import triton  # noqa: F401  (versions below)

    devices, _ = devices_and_dtypes()
    return {
        "gpu": torch.cuda.is_available(),
        "devices": [
            torch.cuda.get_device_name(d) if d.type == "cuda" else platform.processor() or "cpu"
            for d in devices
        ],
        "versions": {
            "vit_kernels": vk.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": sys.modules["triton"].__version__,
            "python": platform.python_version(),
        },
        "pytorch_defaults": {
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        },
        "rule": f"pass when relative error <= max({ERROR_RATIO:g} x PyTorch's own, floor) per output and gradient; "
        f"floors { ({str(k).removeprefix('torch.'): v for k, v in FLOORS.items()}) }",
        "available_backends": backend.available_backends(),
    }


PROG = "python -m tools.selftest"
DEFAULT_OUT = Path("build") / "selftest.json"


def _writable_file(text: str) -> Path:
    """A results file that can be written: not a folder, under a folder that exists (or can be made
    there) and is writable. Checked before the checks run, not after."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file name")
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not writable")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineErrors(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=_writable_file, default=str(DEFAULT_OUT), help="results file (JSON)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the CUDA test suite")
    parser.add_argument("--ops", default=",".join(backend.OPS), help="comma-separated ops to check")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"torch intra-op CPU threads (default: OMP_NUM_THREADS if set, else the cores this process "
        f"may use, {usable_cores()} here)",
    )
    args = parser.parse_args(argv)
    args.ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    unknown = [op for op in args.ops if op not in backend.OPS]
    if unknown or not args.ops:
        parser.error(
            f"argument --ops: expected a comma-separated subset of {', '.join(backend.OPS)}, got "
            f"{', '.join(map(repr, unknown)) or 'none'}"
        )
    return args


def _write(path: Path, report: dict) -> None:
    """The JSON, written beside ``path`` and renamed over it: a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)

    report = {**header(), "threads": threads, "checks": []}
    if not report["gpu"]:
        print("selftest: no CUDA GPU found: running the CPU checks only (nothing was run on a GPU)")
    for op, name, dtype, device in cases():
        if op not in args.ops:
            continue
        row = check_op(op, name, dtype, device, timed=name != "torch")
        report["checks"].append(row)
        print(describe_row(row), flush=True)
    if report["gpu"] and not args.no_pytest:
        report["pytest_gpu"] = gpu_tests.run_gpu_tests()
    try:
        _write(args.out, report)
    except OSError as error:  # the folder changed during the run: say so in one line, keep the printed rows
        print(f"{PROG}: error: cannot write {args.out}: {error.strerror or error}", file=sys.stderr)
        return 2
    failed = [r for r in report["checks"] if not r["passed"]]
    pytest_failed = "pytest_gpu" in report and not report["pytest_gpu"].get("passed", True)
    print(
        f"selftest: {len(report['checks']) - len(failed)} passed, {len(failed)} failed"
        f"{'; CUDA tests failed: ' + report['pytest_gpu'].get('summary', '') if pytest_failed else ''}; "
        f"results in {args.out}"
    )
    return 1 if failed or pytest_failed else 0


if __name__ == "__main__":
    sys.exit(main())
