"""python -m benchmarks.host_overhead: the host cost of one call of every op, per backend, beside the
plain PyTorch call, in microseconds.

Each op runs forward on tiny tensors (batch 2, 5 tokens, width 16: the device's work is negligible,
so the time is the host's: argument checks, dispatch, autograd bookkeeping, launches), inputs
requiring grad as in training. A measurement is ``calls`` back-to-back calls with the device
synchronised only before and after the loop; the figure is the median over ``rounds`` of the loop
time / ``calls``. Columns: ``pytorch`` (the op's eager reference, called directly), then
``vk.<op>`` under each backend (``use_backend(name, strict=True)`` around the loop), and
``torch-pykey``: the torch backend with the per-call key read in Python instead of by the extension's
C++ (``backend.use_native_call_key(None)``): what the C++ key saves, side by side.
On the CPU, Triton only runs interpreted, which measures the interpreter, not a host cost: n/a.

``--simulated-gpu`` measures instead, on the simulated sm_90 device (``tools.cuda_sim``: the code a
GPU runs, launches stubbed), this project's own Python per warm call of ``vk.<op>`` at ViT-B/16
shapes in bfloat16: forward on the triton and auto backends, backward on triton (the GEMMs by the
TMA kernel, sm_90's default); the GEMM ops again with the pointer kernel ("<op> (pointer)", what
sm_80 and operands TMA cannot read run). Each call's time is
taken less what it spends in PyTorch's calls and in the (stubbed) launch, and less what entering
those calls costs the simulation (the calls of one warm call made again with nothing of ours around
them: ``Recorder.entry_seconds``). An autograd Function's apply and the autograd engine are
PyTorch's; the forward and backward they call are ours. What PyTorch's calls and Triton's launcher
cost on a real GPU comes on top; this is the part the project controls. It is the small difference
of two large times, an upper bound read to a few microseconds. Beside each figure, ``least``: the
least any Python implementation of the op can read on this meter (its launches made again by hand,
``least_ours``). Exact and the same on every machine are the counts beside them, per warm triton
call each way: the Python functions of ``vit_kernels`` it enters (``frames``) and the PyTorch calls
it makes (``torch calls``: tensor attributes, allocations, views; each costs the host 0.1-3 us on a
GPU).

    python -m benchmarks.host_overhead [--device cuda] [--calls N] [--rounds N] [--ops a,b] [--json FILE]
    python -m benchmarks.host_overhead --simulated-gpu [--calls N] [--rounds N] [--ops a,b] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Union
from unittest import mock

import torch

import vit_kernels as vk
from tools.op_specs import OPS, SPECS, Shape
from vit_kernels import backend
from benchmarks._timer import time_runs

TINY = Shape("tiny", batch=2, tokens=5, dim=16, heads=2, hidden=32, channels=3, image=8, patch=4)
COLUMNS = ("pytorch", "torch", "torch-pykey", "extension", "triton", "auto")
# (calls per loop, loops) by device type: on the CPU a tiny op's own work is tens of microseconds.
DEFAULT_LOOPS = {"cuda": (300, 7), "cpu": (100, 5)}


def inputs_requiring_grad(op: str, shape: Shape, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``op``'s inputs at ``shape`` (``SPECS[op].make_inputs``), each requiring grad, as in training."""
    return {name: t.requires_grad_() for name, t in SPECS[op].make_inputs(shape, device, dtype).items()}


@contextlib.contextmanager
def _torch_with_python_key() -> Iterator[None]:
    """The torch backend (strict), its per-call key read in Python instead of by the extension."""
    native = backend._native_key
    backend.use_native_call_key(None)
    try:
        with vk.use_backend("torch", strict=True):
            yield
    finally:
        backend.use_native_call_key(native)


def _column_context(name: str) -> contextlib.AbstractContextManager:
    if name == "pytorch":
        return contextlib.nullcontext()
    if name == "torch-pykey":
        return _torch_with_python_key()
    return vk.use_backend(name, strict=True)


def _loop(name: str, fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``calls`` back-to-back calls of ``fn`` under column ``name``'s backend."""

    def loop():
        with _column_context(name):
            for _ in range(calls):
                fn()

    return loop


def _reason(op: str, name: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if name in ("pytorch", "auto"):
        return None
    if name == "torch-pykey":
        return (
            None
            if backend._native_key is not None
            else "the extension is not built: torch reads the key in Python"
        )
    if name == "triton" and device.type == "cpu":
        return "Triton runs only interpreted on the CPU"
    return backend.unsupported_reason(op, name, device, dtype)


def _column(name: str, op: str, inputs: dict[str, torch.Tensor]) -> Callable[[], object]:
    """One call of column ``name``: the reference called directly, or ``vk.<op>`` (the backend is
    chosen around the loop)."""
    spec = SPECS[op]
    if name == "pytorch":
        return lambda: spec.reference(TINY, **inputs)
    return lambda: spec.run(TINY, **inputs)


def measure_op(
    op: str, device: torch.device, dtype: torch.dtype = torch.float32, calls: int = 300, rounds: int = 7
) -> dict[str, Union[str, float]]:
    """{"op": op, column: microseconds per call, or "n/a: <reason>", ...} for every column. The
    columns are timed in turn within each round (so that load from other processes hits them
    alike), after one untimed warm-up round (which also lets ``auto`` make its first-call choice)."""
    inputs = inputs_requiring_grad(op, TINY, device, dtype)
    row: dict[str, Union[str, float]] = {"op": op}
    runs = {}
    for name in COLUMNS:
        reason = _reason(op, name, device, dtype)
        if reason is None:
            try:
                loop = _loop(name, _column(name, op, inputs), calls)
                loop()
                runs[name] = loop
            except backend.CannotRunError as error:
                reason = str(error).splitlines()[0]
            except Exception as error:  # e.g. a Triton compile error at the tiny shape on a GPU
                reason = f"failed: {type(error).__name__}: {error}".splitlines()[0][:200]
        if reason is not None:
            row[name] = f"n/a: {reason}"
    samples = time_runs(runs, device, rounds=rounds, back_to_back=True)
    row.update({name: statistics.median(values) * 1e3 / calls for name, values in samples.items()})
    return {"op": op, **{name: row[name] for name in COLUMNS}}


def measure(
    device: torch.device,
    ops: tuple[str, ...] = OPS,
    calls: int = 300,
    rounds: int = 7,
    admit: Callable[[str], bool] = lambda op: True,
) -> list[dict[str, Union[str, float]]]:
    """One row per op admitted by ``admit`` (a time budget), see ``measure_op``."""
    return [measure_op(op, device, calls=calls, rounds=rounds) for op in ops if admit(op)]


SIMULATED_BACKENDS = ("triton", "auto")
SIMULATED_COLUMNS = (
    *SIMULATED_BACKENDS,
    "least",
    "frames",
    "torch calls",
    "backward",
    "least bwd",
    "bwd frames",
    "bwd torch calls",
)
PACKAGE_DIR = str(Path(vk.__file__).resolve().parent)
# The op specs' calls (the measured call's own wrapper) live in the package but are not the op's.
SPECS_FILE = str(Path(PACKAGE_DIR) / "ops" / "specs.py")


def warm_call_counts(recorder, call: Callable[[], object]) -> tuple[int, int]:
    """(frames, torch calls) of one ``call()`` on the simulated device: the Python functions of the
    ``vit_kernels`` package it enters, and the PyTorch calls (a tensor's device read included) it
    makes, as the recorder counts them (an autograd Function's apply and the autograd engine count
    as one PyTorch call each, and what our code they call makes is counted too)."""
    frames = 0

    def count(frame, event, arg):
        nonlocal frames
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE_DIR) and name != SPECS_FILE:
            frames += 1

    _, before = recorder.mark()
    sys.setprofile(count)
    try:
        call()
    finally:
        sys.setprofile(None)
    return frames, sum(recorder.calls[kind] - before[kind] for kind in ("torch", "device"))


def _least_ours(recorder, call: Callable[[], object], calls: int, rounds: int, before=None) -> float:
    """Our Python per ``call()`` in us: the least over ``rounds`` loops of ``calls`` calls, the
    simulation's cost of entering the calls it makes taken out (``Recorder.entry_seconds``).
    ``before``: run untimed ahead of each call (a forward, whose graph the timed backward uses)."""
    prepare = before or (lambda: None)
    prepare()
    entry = recorder.entry_seconds(recorder.capture(call))
    samples = []
    for _ in range(rounds):
        gc.collect()
        gc.disable()  # a collection inside the loop would count as ours (timeit does the same)
        try:
            ours = 0.0
            for _ in range(calls):
                prepare()
                mark, started = recorder.mark(), time.perf_counter()
                call()
                ours += recorder.our_seconds(time.perf_counter() - started, mark, entry)
        finally:
            gc.enable()
        samples.append(ours / calls * 1e6)
    return max(0.0, min(samples))


VIT_B = Shape(
    "vit_base_patch16_224",
    batch=2,
    tokens=197,
    dim=768,
    heads=12,
    hidden=3072,
    channels=3,
    image=224,
    patch=16,
)


def forward_then_backward(call: Callable[[], object]) -> tuple[Callable[[], list], Callable[[], None]]:
    """(forward, backward): ``call()`` kept as a graph (forward returns its outputs as a list), then
    its backward from fixed random output gradients (one per output, made at the first forward)."""
    graph: dict[str, list] = {}

    def forward() -> list:
        outputs = call()
        graph["outputs"] = outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
        graph.setdefault("grads", [torch.randn_like(o) for o in outputs])
        return outputs

    def backward():
        torch.autograd.backward(graph["outputs"], graph["grads"])

    return forward, backward


# The ops whose GEMMs run by the persistent TMA kernel on sm_90 where descriptors read the operands
# (the table's default there), else by the pointer kernel (sm_80, an unaligned operand): measured
# again with the pointer kernel's default tile, as "<op> (pointer)".
GEMM_OPS = ("linear_gelu", "linear", "mlp", "swiglu", "swiglu_mlp")


@contextlib.contextmanager
def pointer_tiles() -> Iterator[None]:
    """Inside the block, every GEMM launches the pointer kernel's tiles, as where TMA cannot read its
    operands. Every tile choice of the process is forgotten on entry and on exit: for the simulated
    device, whose tile cache lives in memory only, not for a real GPU's."""
    from vit_kernels import _tiles
    from vit_kernels.ops import gemm

    def candidates(dtype, m, n, tma=False):
        return offered(dtype, m, n, False)

    offered = gemm.gemm_candidates
    _tiles.forget()
    try:
        with mock.patch.object(gemm, "gemm_candidates", candidates):
            yield
    finally:
        _tiles.forget()


def measure_simulated(
    ops: tuple[str, ...] = OPS, calls: int = 200, rounds: int = 5
) -> list[dict[str, Union[str, float]]]:
    """{"op": op, "triton": us, "auto": us, "least": us, "frames": n, "torch calls": n, "backward":
    us, "least bwd": us, "bwd frames": n, "bwd torch calls": n} per op: our Python per warm forward
    call (inputs requiring grad) on the simulated sm_90 device by backend, and per warm backward
    call on the triton backend, the least over ``rounds`` loops of ``calls`` calls (ours is the
    small difference of two large times, so other processes' load shows in it: load only adds),
    each way beside the least any Python implementation reads (``least_ours``), and the counts of
    one warm triton call each way (``warm_call_counts``); then a row "<op> (pointer)" per op of
    ``GEMM_OPS`` asked for, measured under ``pointer_tiles``."""
    from tools.cuda_sim import simulated_cuda

    rows = []
    with simulated_cuda(90) as recorder:
        for op in ops:
            rows.append(_simulated_row(recorder, op, op, calls, rounds))
        for op in (op for op in GEMM_OPS if op in ops):
            with pointer_tiles():
                rows.append(_simulated_row(recorder, op, f"{op} (pointer)", calls, rounds))
    return rows


def _simulated_row(recorder, op: str, label: str, calls: int, rounds: int) -> dict[str, Union[str, float]]:
    """``measure_simulated``'s row of ``op``, named ``label``."""
    inputs = inputs_requiring_grad(op, VIT_B, torch.device("cuda"), torch.bfloat16)
    row: dict[str, Union[str, float]] = {"op": label}
    for name in SIMULATED_BACKENDS:
        with vk.use_backend(name, strict=name != "auto"):
            call = functools.partial(SPECS[op].run, VIT_B, **inputs)
            for _ in range(3):  # the first call decides the backend and the tile
                call()
            row[name] = _least_ours(recorder, call, calls, rounds)
            if name != "triton":
                continue
            row["frames"], row["torch calls"] = warm_call_counts(recorder, call)
            forward, backward = forward_then_backward(call)
            for _ in range(3):  # the backward's own first-call decisions
                forward()
                backward()
            row["backward"] = _least_ours(recorder, backward, calls, rounds, before=forward)
            forward()
            row["bwd frames"], row["bwd torch calls"] = warm_call_counts(recorder, backward)
            row["least"], row["least bwd"] = least_ours(recorder, inputs, forward, backward, calls, rounds)
    return row


class _Replay(torch.autograd.Function):
    """``least_ours``' op: a forward that makes each launch of an op's warm forward again, each after
    allocating an output as an op does, and saves its inputs; a backward that reads them back and
    does the same with the launches of the op's warm backward."""

    @staticmethod
    def forward(ctx, x, weight, launches):
        ctx.save_for_backward(x, weight)
        ctx.backward_launches = launches[1]
        return _launch_again(x, launches[0])

    @staticmethod
    def backward(ctx, grad):
        x, _ = ctx.saved_tensors
        return _launch_again(x, ctx.backward_launches), None, None


def _launch_again(x: torch.Tensor, launches: list) -> torch.Tensor:
    """Per launch in ``launches``: an output of x's shape allocated, the launch made again (stubbed:
    which tensors it names costs nothing) -> the last output."""
    for launch in launches:
        output = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return output


def least_ours(
    recorder,
    inputs: dict[str, torch.Tensor],
    forward: Callable[[], list],
    backward: Callable[[], None],
    calls: int,
    rounds: int,
) -> tuple[float, float]:
    """The least our Python per warm call of an op can be on this meter, forward and backward, in us:
    the op's warm call made again by hand from what it launches, and nothing else. Its launches each
    way (one warm ``forward()`` and ``backward()``) are found by one dictionary lookup of the first
    two inputs' shapes, dtypes and devices; then ``_Replay``'s apply allocates an output and makes
    the launch again per launch, and saves the inputs; its backward does the same with the
    backward's launches. What the op reads above it is what dispatch, the autograd glue, the bodies
    and the launchers add."""
    from tools.cuda_sim import ours

    first = len(recorder.launches)
    forward()
    middle = len(recorder.launches)
    backward()
    x, weight = (list(inputs.values()) * 2)[:2]  # the one input twice where there is one
    launches = {
        (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device): (
            recorder.launches[first:middle],
            recorder.launches[middle:],
        )
    }

    def replay():
        found = launches[(x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device)]
        return _Replay.apply(x, weight, found)

    with (
        mock.patch.object(_Replay, "forward", staticmethod(ours(_Replay.forward))),
        mock.patch.object(_Replay, "backward", staticmethod(ours(_Replay.backward))),
    ):
        forward_again, backward_again = forward_then_backward(replay)
        for _ in range(3):
            forward_again()
            backward_again()
        return (
            _least_ours(recorder, replay, calls, rounds),
            _least_ours(recorder, backward_again, calls, rounds, before=forward_again),
        )


def _cell(value: Union[str, float, int]) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if isinstance(value, float) else "n/a"


def table(
    rows: list[dict[str, Union[str, float]]], markdown: bool = False, columns: tuple[str, ...] = COLUMNS
) -> str:
    """op x ``columns`` in us/call, as aligned text or a markdown table; the reasons behind each n/a
    follow the table."""
    header = ["op (us/call)", *columns]
    cells = [[str(r["op"]), *(_cell(r[c]) for c in columns)] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(columns) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
    else:
        widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
        lines = [
            "  ".join(
                text.ljust(w) if i == 0 else text.rjust(w) for i, (text, w) in enumerate(zip(line, widths))
            )
            for line in [header, *cells]
        ]
    reasons = sorted({f"{c}: {str(r[c])[5:]}" for r in rows for c in columns if isinstance(r[c], str)})
    return "\n".join(lines + ([""] + [f"n/a {reason}" for reason in reasons] if reasons else []))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--calls", type=int, default=None, help="calls per timed loop (default: 300 on CUDA, 100 on the CPU)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed loops per op and column, the median kept (default: 7 on CUDA, 5 on the CPU)",
    )
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    parser.add_argument(
        "--simulated-gpu",
        action="store_true",
        help="our Python per warm call on the simulated sm_90 device (triton and auto backends)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ops = tuple(op for op in args.ops.split(",") if op)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
    if args.simulated_gpu:
        rows = measure_simulated(ops, args.calls or 200, args.rounds or 5)
        device = "simulated sm_90"
        print(
            f"our Python per warm call on the {device} device ({VIT_B.label}, bfloat16, inputs requiring grad; "
            "PyTorch's calls and the launch excluded), us, forward by backend and backward on triton, each beside "
            "the least any Python can be (the op's launches made again by hand: least_ours); and one warm "
            "triton call's vit_kernels frames and PyTorch calls each way:"
        )
        print(table(rows, columns=SIMULATED_COLUMNS))
    else:
        calls, rounds = DEFAULT_LOOPS[device.type]
        rows = measure(device, ops, args.calls or calls, args.rounds or rounds)
        print(f"host cost per call on {device} (tiny float32 tensors, forward, inputs requiring grad), us:")
        print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
