"""python -m vit_kernels.selftest [--out FILE] [--no-pytest]: what a user with a GPU runs first.

On each CUDA device it checks every op on every backend that can run there, in float32, float16
and bfloat16, output and every input gradient against a float64 evaluation of the reference
(tolerance per dtype), times forward + backward of each against the PyTorch reference, and, when
run from a source checkout, runs the CUDA tests (``pytest -m gpu``). It writes one JSON file
(device, versions, pass/fail per op, backend and dtype, speed versus the reference) to attach to a
bug report. Without a GPU it runs the same checks on the CPU for the backends that run there, says
clearly that there is no GPU, and exits 0 when they pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import vit_kernels as vk
from vit_kernels import backend
from vit_kernels.op_specs import SPECS, Shape

# Tolerances of a backend against the float64 reference, per dtype: (atol, rtol).
TOLERANCES = {torch.float64: (1e-9, 1e-7), torch.float32: (2e-4, 2e-3), torch.float16: (2e-2, 2e-2),
              torch.bfloat16: (1e-1, 5e-2)}
# ViT-S/16 at batch 4; the inputs are those of the op specs (scaled so activations stay O(1)).
SHAPE = Shape("vit_small_patch16_224", batch=4, tokens=197, dim=384, heads=6, hidden=1536, channels=3, image=224,
              patch=16)


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


def _run(fn: Callable, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Outputs, then the gradient of every input, for a fixed random cotangent."""
    leaves = list(inputs.values())
    outputs = fn(**inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    g = torch.Generator(device="cpu").manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outputs]
    grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    return [o.detach() for o in outputs] + [gr for gr in grads if gr is not None]


def _as_float64(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().double().requires_grad_() for name, t in inputs.items()}


def _time(fn: Callable, inputs: dict[str, torch.Tensor], device: torch.device) -> float:
    """Median milliseconds of forward + backward."""
    def step():
        _run(fn, inputs)

    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=10, rep=50))
    step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def check_op(op: str, name: str, dtype: torch.dtype, device: torch.device, timed: bool) -> dict:
    """One op on one backend in one dtype: max error against float64, pass/fail, and speed."""
    inputs = _inputs(op, dtype, device)
    fn = _call(op)
    row = {"op": op, "backend": name, "dtype": str(dtype).replace("torch.", ""), "device": str(device)}
    try:
        with vk.use_backend(name, strict=True):
            actual = _run(fn, inputs)
        with vk.use_backend("torch"):
            expected = _run(fn, _as_float64(inputs))
    except backend.CannotRunError as error:  # outside the backend's limits: not a failure
        row.update(passed=True, skipped=str(error)[:500])
        return row
    except Exception as error:  # reported per row: the point is to see every failure at once
        row.update(passed=False, error=f"{type(error).__name__}: {error}"[:500])
        return row
    atol, rtol = TOLERANCES[dtype]
    errors = [((a.double() - e).abs() - rtol * e.abs()).max().item() for a, e in zip(actual, expected)]
    row.update(passed=all(err <= atol for err in errors), max_excess_error=max(errors), atol=atol, rtol=rtol)
    if timed and row["passed"]:
        with vk.use_backend(name, strict=True):
            row["ms"] = _time(fn, inputs, device)
        with vk.use_backend("torch"):
            row["reference_ms"] = _time(fn, inputs, device)
        row["speedup_vs_reference"] = row["reference_ms"] / row["ms"]
    return row


def _backends_for(device: torch.device, dtype: torch.dtype, op: str) -> list[str]:
    return [b for b in backend.BACKENDS if backend.unsupported_reason(op, b, device, dtype) is None]


def _pytest_gpu() -> dict:
    tests = Path(__file__).resolve().parent.parent / "tests"
    if not tests.is_dir():
        return {"ran": False, "why": "no tests/ folder beside the package (not a source checkout)"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tests)], capture_output=True, text=True)
    return {"ran": True, "exit_code": done.returncode, "summary": done.stdout.strip().splitlines()[-1:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vit_kernels.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="vit-kernels-selftest.json", help="results file (JSON)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the CUDA test suite")
    args = parser.parse_args(argv)

    has_gpu = torch.cuda.is_available()
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if has_gpu else (torch.float32,)
    if not has_gpu:
        print("selftest: no CUDA GPU found: running the CPU checks only (nothing was run on a GPU)")
    import triton  # noqa: F401  (versions below)

    report = {
        "gpu": has_gpu,
        "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else platform.processor() or "cpu" for d in devices],
        "versions": {"vit_kernels": vk.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "triton": sys.modules["triton"].__version__, "python": platform.python_version()},
        "available_backends": backend.available_backends(),
        "checks": [],
    }
    for device in devices:
        for dtype in dtypes:
            for op in backend.OPS:
                for name in _backends_for(device, dtype, op):
                    row = check_op(op, name, dtype, device, timed=name != "torch")
                    report["checks"].append(row)
                    speed = f"{row['speedup_vs_reference']:.2f}x reference" if "speedup_vs_reference" in row else ""
                    print(f"{'PASS' if row['passed'] else 'FAIL'} {op:12s} {name:10s} {row['dtype']:9s} "
                          f"{row['device']:7s} {speed} {row.get('error', '')}", flush=True)
    if has_gpu and not args.no_pytest:
        report["pytest_gpu"] = _pytest_gpu()
    Path(args.out).write_text(json.dumps(report, indent=1))
    failed = [r for r in report["checks"] if not r["passed"]]
    pytest_failed = report.get("pytest_gpu", {}).get("exit_code", 0) not in (0, 5)
    print(f"selftest: {len(report['checks']) - len(failed)} passed, {len(failed)} failed"
          f"{'; CUDA tests failed' if pytest_failed else ''}; results in {args.out}")
    return 1 if failed or pytest_failed else 0


if __name__ == "__main__":
    sys.exit(main())
