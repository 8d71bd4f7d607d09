"""Per-op benchmarks: every op x implementation x mode x shape x dtype, validated against the
reference before it is timed, with speedups over every other implementation measured in the same run.

Implementations: the backends (``torch`` = the eager reference, which for attention is SDPA;
``triton``; ``extension``), ``torch.compile`` of the reference, and for attention ``eager_math``
(q k^T, softmax, @ v without SDPA). Modes: ``forward`` (no autograd), ``backward`` (the backward
of one recorded forward, replayed), ``full`` (forward + backward).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

import vit_kernels as vk
from benchmarks import noise
from benchmarks.cases import KERNELS, OpCase, eager_math_attention
from benchmarks.peaks import fraction_of
from benchmarks.timing import copies_to_rotate, time_call
from vit_kernels import _accuracy, _ext, backend

MODES = ("forward", "backward", "full")
# The backward mode replays one recorded graph (retain_graph=True), which compiled graphs that donate
# their saved buffers to the backward refuse: keep them for this process.
torch._functorch.config.donated_buffer = False
# Every case's compiled reference is the same Python function (cases.build_case's closure) with other
# closed-over values: each shape and dtype is one more cache entry of that code object, and past
# Dynamo's default limit (8) it would silently run eager under the torch.compile name.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
BACKENDS = ("torch", "triton", "extension")


def implementations(
    case: OpCase, device: torch.device, dtype: torch.dtype, compile_reference: bool, interpreted_triton: bool
) -> dict[str, Callable[..., object] | str]:
    """name -> callable, or name -> the reason it does not run here."""
    found: dict[str, Callable[..., object] | str] = {}
    if case.op in KERNELS:  # a bare extension kernel against the eager code it replaces
        found["torch"] = case.reference
        found["extension"] = _ext.supports(device, dtype) or case.run
    else:
        for name in BACKENDS:
            reason = backend.unsupported_reason(case.op, name, device, dtype)
            if reason is None and name == "triton" and device.type == "cpu" and not interpreted_triton:
                reason = "interpreted Triton is only run at the smallest shapes"
            found[name] = reason if reason is not None else on_backend(name, case.run)
    if compile_reference:
        found["torch.compile"] = torch.compile(case.reference, dynamic=False)
    if case.op == "attention" and not case.shape.attention:  # explicit softmax of the plain variant
        found["eager_math"] = eager_math_attention(case.shape.heads)
    return found


def on_backend(name: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` on backend ``name``, strictly: a call outside its limits raises CannotRunError (the row
    is then skipped with the reason) instead of timing the fallback under this backend's name."""

    def run(**inputs):
        with vk.use_backend(name, strict=True):
            return fn(**inputs)

    return run


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _forward_backward(fn, inputs: dict[str, torch.Tensor], upstream: list[torch.Tensor]):
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    outs = _outputs(fn(**leaves))
    grads = torch.autograd.grad(outs, list(leaves.values()), [u.to(o.dtype) for u, o in zip(upstream, outs)])
    return [o.detach() for o in outs], list(grads)


def validate(case: OpCase, fn, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> Optional[str]:
    """None when ``fn``'s outputs and input gradients are right by the runtime's one rule
    (``vit_kernels._accuracy.first_problem``): within twice the error of the reference run in ``dtype``
    (PyTorch's own), or the dtype's floor, against the reference computed in float64 (float32 for
    16-bit inputs) from the same rounded inputs and upstream gradients; else what differs."""
    wide = {k: v.detach().to(_accuracy.reference_dtype(dtype)).requires_grad_() for k, v in inputs.items()}
    ref_outs = _outputs(case.reference(**wide))
    upstream = [torch.randn_like(o) for o in ref_outs]
    ref_grads = torch.autograd.grad(ref_outs, list(wide.values()), upstream)
    own_outs, own_grads = _forward_backward(case.reference, inputs, upstream)
    outs, grads = _forward_backward(fn, inputs, upstream)
    names = [f"output {i}" for i in range(len(outs))] + [f"d{name}" for name in inputs]
    if len(outs) != len(ref_outs):
        return f"{len(outs)} outputs, the reference gives {len(ref_outs)}"
    parts = zip(names, outs + grads, own_outs + own_grads, [r.detach() for r in ref_outs] + list(ref_grads))
    return _accuracy.first_problem(list(parts), _accuracy.FLOORS[dtype])


def timed_call(fn, input_sets: list[dict[str, torch.Tensor]], mode: str) -> Callable[[int], object]:
    if mode == "forward":

        def call(i):
            with torch.no_grad():
                return fn(**input_sets[i])

        return call
    leaves = [{k: v.detach().requires_grad_() for k, v in inputs.items()} for inputs in input_sets]
    if mode == "full":

        def call(i):  # autograd.grad: no .grad accumulation (an extra add per input) in the timed run
            outs = _outputs(fn(**leaves[i]))
            return torch.autograd.grad(
                outs, list(leaves[i].values()), [torch.ones_like(o) for o in outs], allow_unused=True
            )

        return call
    recorded = []
    for leaf_set in leaves:  # backward: record each forward once, replay only its backward
        outs = _outputs(fn(**leaf_set))
        recorded.append((outs, [torch.ones_like(o) for o in outs], list(leaf_set.values())))

    def call(i):
        outs, seeds, inputs = recorded[i]
        return torch.autograd.grad(outs, inputs, seeds, retain_graph=True)

    return call


def run_case(
    case: OpCase,
    device: torch.device,
    dtype: torch.dtype,
    modes: Iterable[str],
    peaks: dict[str, float],
    compile_reference: bool,
    interpreted_triton: bool,
    meta: dict[str, object],
    extra: Optional[dict[str, Callable[..., object] | str]] = None,
) -> list[dict[str, object]]:
    """Rows for every implementation and mode of one case (with speedups filled in); ``extra``
    adds implementations (name -> callable taking the case's inputs, or the reason it is absent)."""
    first = case.make_inputs(device, dtype)
    set_bytes = sum(t.numel() * t.element_size() for t in first.values())
    input_sets = [first] + [
        case.make_inputs(device, dtype) for _ in range(copies_to_rotate(set_bytes, device) - 1)
    ]
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    found = {**implementations(case, device, dtype, compile_reference, interpreted_triton), **(extra or {})}
    for name, fn in found.items():
        base = {
            "kind": "op",
            "op": case.op,
            "shape": case.shape.label,
            "dtype": str(dtype).removeprefix("torch."),
            "backend": name,
            **meta,
        }
        if isinstance(fn, str):
            rows.append({**base, "mode": "all", "skipped": fn})
            continue
        try:
            problem = validate(case, fn, first, dtype)
        except backend.CannotRunError as error:
            rows.append({**base, "mode": "all", "skipped": str(error)})
            continue
        except Exception as error:  # a failed compile or kernel is reported, not fatal to the run
            problem = f"{type(error).__name__}: {error}".splitlines()[0]
        if problem is not None:
            rows.append({**base, "mode": "all", "invalid": problem})
            continue
        for mode in modes:
            try:
                timing = time_call(timed_call(fn, input_sets, mode), device, len(input_sets))
            except Exception as error:  # e.g. a no_grad recompile of torch.compile failing: this row only
                rows.append(
                    {**base, "mode": mode, "invalid": f"{type(error).__name__}: {error}".splitlines()[0]}
                )
                continue
            amount, unit = case.work(mode, itemsize)
            throughput = (
                amount / (timing.median_ms * 1e-3) / 1e12
                if unit == "TFLOP/s"
                else amount / (timing.median_ms * 1e-3) / 1e9
            )
            peak = (
                peaks.get(f"matmul_tflops_{base['dtype']}") if unit == "TFLOP/s" else peaks.get("copy_gbps")
            )
            rows.append(
                {
                    **base,
                    "mode": mode,
                    "median_ms": timing.median_ms,
                    "q20_ms": timing.q20_ms,
                    "q80_ms": timing.q80_ms,
                    "samples_ms": list(timing.samples_ms),
                    "throughput": throughput,
                    "unit": unit,
                    "fraction_of_peak": fraction_of(throughput, peak),
                }
            )
    add_speedups(rows, ("op", "shape", "dtype", "mode"))
    return rows


def add_speedups(rows: list[dict[str, object]], key_fields: tuple[str, ...]) -> None:
    """For each timed row: ``speedup`` = {other implementation: its median / this median}, over the
    rows that share ``key_fields`` (measured side by side in this run); ``speedup_interval`` = the
    bootstrap interval of each ratio from the two rows' samples (None without samples), and
    ``speedup_untrusted`` = the names whose interval is too wide to report the ratio as a figure."""
    groups: dict[tuple, list[dict[str, object]]] = {}
    for row in rows:
        if "median_ms" in row:
            groups.setdefault(tuple(row[k] for k in key_fields), []).append(row)
    for group in groups.values():
        for row in group:
            others = [other for other in group if other is not row]
            row["speedup"] = {other["backend"]: other["median_ms"] / row["median_ms"] for other in others}
            row["speedup_interval"] = {
                other["backend"]: noise.ratio_interval(
                    row.get("samples_ms") or [], other.get("samples_ms") or []
                )
                for other in others
            }
            row["speedup_untrusted"] = sorted(
                name for name, interval in row["speedup_interval"].items() if not noise.trusted(interval)
            )
