"""``vk.selftest()`` and ``python -m vit_kernels.selftest``: what a user with a GPU runs first.

Every op on every backend that can take it here, output and every input gradient, against float64,
passing when each relative error is at most ``ERROR_RATIO`` x PyTorch's own in the same dtype or under
the dtype's floor (``vit_kernels._accuracy``). Each Triton launcher runs the tile its table names for
the shape: every table entry the GPU would run there. Without a model: ViT-S/16's shapes at batch 4,
in float32, float16 and bfloat16 (the CPU: float32), against each op's formula (``ops.specs``). With
one: the calls ``model(*example_inputs)`` makes, against the op's reference run in float64. The report is
JSON to attach to a bug report; the benchmarks, not this, say how fast each backend is.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import types
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _accuracy, _signature, backend, tuning
from vit_kernels._accuracy import ERROR_RATIO, FLOORS, without_autocast
from vit_kernels._files import write_atomically
from vit_kernels.ops.specs import SPECS, Shape

SHAPE = Shape("vit_small_patch16_224", 4, 197, 384, 6, 1536, channels=3, image=224, patch=16)


@without_autocast()
def _check(row: dict, arg_names: list[str], args: Sequence[Any], fn, truth, reference) -> dict:
    """``fn(*args)``, outputs and gradients for one fixed random cotangent, against ``truth`` in
    float64 and beside ``reference`` (PyTorch's own) in the call's dtype: ``row`` filled in."""
    grad = _signature.needs_grad(args)
    upstream: list = []
    device = args[0].device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            exact = tuning._runner(truth, args, grad, upstream, torch.float64)()
            own = tuning._runner(reference, args, grad, upstream)()
            got = tuning._runner(fn, args, grad, upstream)()
        if len(got) != len(exact):
            raise RuntimeError(f"{len(got)} outputs and gradients, the formula gives {len(exact)}")
    except backend.CannotRunError as error:  # outside the backend's limits: not a failure
        return {**row, "passed": True, "skipped": str(error)[:500]}
    except Exception as error:  # reported per row: the point is to see every failure at once
        return {**row, "passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
    leaves = [n for n, a in zip(arg_names, args) if grad and isinstance(a, torch.Tensor) and a.requires_grad]
    names = [f"output {i}" for i in range(len(exact) - len(leaves))] + [f"d{n}" for n in leaves]
    kept = [i for i, e in enumerate(exact) if e is not None]  # an input the formula does not use
    exact = [exact[i] for i in kept]
    errors = [_accuracy.errors([results[i] for i in kept], exact) for results in (got, own)]
    row.update(_accuracy.judge([names[i] for i in kept], *errors, FLOORS[getattr(torch, row["dtype"])]))
    return row


def _row(op: str, name: str, dtype: torch.dtype, device: torch.device) -> dict:
    return {"op": op, "backend": name, "dtype": str(dtype).removeprefix("torch."), "device": str(device)}


def check_op(op: str, name: str, dtype: torch.dtype, device: torch.device) -> dict:
    """``op`` on backend ``name`` at ``SHAPE`` in ``dtype`` against its formula: the row."""
    spec = SPECS[op]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        inputs = {k: t.requires_grad_() for k, t in spec.make_inputs(SHAPE, device, dtype).items()}
    keys = list(inputs)

    def by_name(fn: Callable) -> Callable:
        return lambda *args: fn(SHAPE, **dict(zip(keys, args)))

    def run(*args):
        with backend.use_backend(name, strict=True):
            return by_name(spec.run)(*args)

    row, truth, reference = _row(op, name, dtype, device), by_name(spec.formula), by_name(spec.reference)
    return _check(row, keys, list(inputs.values()), run, truth, reference)


def check_call(op: str, args: Sequence[Any], name: str) -> dict:
    """One captured call of ``op`` (its arguments as the implementations take them) on ``name``,
    against the op's reference in float64."""
    impls = backend._registry[op]
    args = backend.validation_args.get(op, lambda a: a)(tuple(args))
    row = _row(op, name, args[0].dtype, args[0].device)
    row["shapes"] = _signature.describe_arguments(_signature.argument_key(args, args[0].dtype))
    torch_fn, names = impls["torch"].fn, [f"(argument {i})" for i in range(len(args))]
    return _check(row, names, args, impls[name].fn, torch_fn, torch_fn)


def calls_of(model, example_inputs: Sequence[Any], grad: bool, device_type: str, autocast) -> list[tuple]:
    """(op, arguments) of each distinct signature ``model(*example_inputs)`` meets, copied as the
    implementations receive them (after autocast's casts), from one forward on the torch backend
    (with grad mode ``grad``: a training step's signatures, or an inference pass's)."""
    seen: dict[tuple, tuple[str, tuple]] = {}
    saved = {op: impls["torch"] for op, impls in backend._registry.items()}

    def recording(op: str, fn: Callable) -> Callable:
        def run(*args):
            key = (op, _signature.argument_key(args, args[0].dtype), _signature.needs_grad(args))
            if key not in seen:
                seen[key] = (op, tuple(_copy(a, grad) for a in args))
            return fn(*args)

        return run

    try:
        for op, impl in saved.items():
            backend._registry[op]["torch"] = dataclasses.replace(impl, fn=recording(op, impl.fn))
        backend._fast.clear()
        with backend.use_backend("torch"), torch.set_grad_enabled(grad):
            with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
                model(*example_inputs)
    finally:
        for op, impl in saved.items():
            backend._registry[op]["torch"] = impl
        backend._fast.clear()
    return list(seen.values())


def _copy(a: Any, grad: bool) -> Any:
    return a.detach().clone().requires_grad_(grad and a.requires_grad) if isinstance(a, torch.Tensor) else a


def _capable(op: str, device: torch.device, dtype: torch.dtype, args: Sequence[Any] = ()) -> list[str]:
    """The backends that can take ``op`` here (and ``args``, given, within their shape limits)."""
    can = [b for b in backend.BACKENDS if backend.unsupported_reason(op, b, device, dtype) is None]
    return [b for b in can if not args or backend._registry[op][b].limits(*args) is None]


def cases(ops: Sequence[str] = backend.OPS) -> Iterator[tuple[str, str, torch.dtype, torch.device]]:
    """(op, backend, dtype, device) of each check at ``SHAPE``: every CUDA device in float32, float16
    and bfloat16; without one, the CPU in float32."""
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if torch.cuda.is_available() else (torch.float32,)
    for device, dtype, op in itertools.product(devices, dtypes, ops):
        yield from ((op, name, dtype, device) for name in _capable(op, device, dtype))


def header() -> dict:
    """Device, versions, PyTorch's precision defaults in force, the rule and the backends."""
    return {
        "gpu": torch.cuda.is_available(),
        "versions": {**tuning.stamp(), "python": platform.python_version()},
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "rule": f"pass when relative error <= max({ERROR_RATIO:g} x PyTorch's own, floor) per output and "
        f"gradient; floors { ({str(k).removeprefix('torch.'): v for k, v in FLOORS.items()}) }",
        "available_backends": backend.available_backends(),
    }


def describe_row(row: dict) -> str:
    """One printed line per check: PASS/FAIL, op, backend, dtype, device, error against PyTorch's."""
    what = row.get("skipped", "")[:60] + row.get("error", "")
    if "max_error" in row:
        e, ratio, own, worst = (row[k] for k in ("max_error", "error_ratio", "pytorch_error", "worst_tensor"))
        what = f"error {e:.2g} = {ratio:.2f}x PyTorch's {own:.2g} ({worst})"
    head = f"{'PASS' if row['passed'] else 'FAIL'} {row['op']:12s} {row['backend']:10s} {row['dtype']:9s}"
    return " ".join(part for part in (head, f"{row['device']:7s}", row.get("shapes"), what) if part)


def selftest(
    model: Optional[torch.nn.Module] = None,
    example_inputs: Sequence[Any] = (),
    *,
    grad: Optional[bool] = None,
    autocast: Optional[torch.dtype] = None,
    ops: Sequence[str] = backend.OPS,
    out: Optional[str] = None,
) -> dict:
    """Check every op on every backend that can take it here (the module's docstring says how).

    model, example_inputs: at the calls ``model(*example_inputs)`` makes (e.g. ``(images,)``, images
    (N, C, H, W)), with grad (default: in training mode) and autocast's dtype as ``vk.tune`` takes them.
    ops: which ops; out: a JSON file rewritten atomically after each check.
    Prints a line per check; returns ``header()`` with the rows in ``"checks"`` and ``"passed"``."""
    if not ops or any(op not in backend.OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {backend.OPS}, got {list(ops)!r}")
    if model is None:
        rows = (check_op(op, name, dtype, device) for op, name, dtype, device in cases(ops))
    else:
        grad, device_type = tuning.run_options(model, example_inputs, grad, autocast)
        calls = [c for c in calls_of(model, example_inputs, grad, device_type, autocast) if c[0] in ops]
        rows = (
            check_call(op, args, name)
            for op, args in calls
            for name in _capable(op, args[0].device, args[0].dtype, args)
        )
    report = {**header(), "threads": torch.get_num_threads(), "passed": True, "checks": []}
    if not report["gpu"]:
        print("selftest: no CUDA GPU found: the CPU checks only (nothing was run on a GPU)")
    for row in rows:
        report["checks"].append(row)
        report["passed"] &= row["passed"]
        print(describe_row(row), flush=True)
        if out is not None:
            write_atomically(out, json.dumps(report, indent=1, default=str))
    return report


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, without the usage block
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(op.strip() for op in text.split(",") if op.strip())
    if not ops or any(op not in backend.OPS for op in ops):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {', '.join(backend.OPS)}, got {text!r}"
        )
    return ops


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: exit 0 when every check passed, 1 when one failed, 2 for bad options."""
    parser = _Parser(prog="python -m vit_kernels.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/selftest.json", help="the report (default: %(default)s)")
    parser.add_argument("--ops", type=_ops, default=backend.OPS, help="comma-separated ops (default: all)")
    parser.add_argument("--threads", type=int, help="torch's intra-op CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"argument --threads: must be 1 or more, got '{args.threads}'")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    try:
        write_atomically(args.out, "{}")  # a folder given, or one that cannot be written: before the checks
        report = selftest(ops=args.ops, out=args.out)
    except OSError as error:
        folder = os.path.abspath(error.filename or args.out) + os.sep  # a file where a folder should be
        where = f"{error.filename}: " if os.path.abspath(args.out).startswith(folder) else ""
        parser.exit(2, f"{parser.prog}: error: cannot write {args.out}: {where}{error.strerror or error}\n")
    failed = sum(not row["passed"] for row in report["checks"])
    print(f"selftest: {len(report['checks']) - failed} passed, {failed} failed; results in {args.out}")
    return 0 if report["passed"] else 1


class _Callable(types.ModuleType):  # vk.selftest(...) runs selftest; vk.selftest.main and the rest stay
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return selftest(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable

if __name__ == "__main__":
    sys.exit(main())
