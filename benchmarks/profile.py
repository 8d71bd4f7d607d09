"""A full profile of one step: every kernel with its milliseconds and share of the step's device
time (on a CPU, every op's self time), the work its launching op must do from the shapes (FLOPs for
GEMMs and attention, bytes moved for the rest, estimated from the shapes at the step's element
size), the rate it reached as a fraction of the peaks measured in the same run
(``benchmarks.peaks``), grouped by kind, and the largest gaps to roofline: the milliseconds a
kernel spends beyond its work at the peak rate.

Rows: ``kernel, kind, ms, share, calls, work, work_unit ("FLOP" | "B"), achieved (TFLOP/s | GB/s),
fraction_of_peak``; work is None where no op with shapes launched the kernel (Inductor's own
kernels carry none) and for views, the fraction None where the rate passes the measured peak.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Optional

import torch

from benchmarks.peaks import fraction_of

KINDS = ("GEMM", "attention", "normalization", "element-wise", "optimizer", "copies")
# The first pattern that matches a kernel's (or its op's) name, lower case, gives its kind; the rest
# are element-wise. Attention first: cuDNN's and FlashAttention's kernels name GEMMs inside them.
_KIND_PATTERNS = (
    ("attention", r"attention|flash|fmha|sdpa|scaled_dot_product"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|wgmma|aten::(?:mm|addmm|bmm|matmul|linear)\b|_linear_\w*kernel|conv"),
    ("normalization", r"norm"),
    ("optimizer", r"adam|foreach|multi_tensor|optimizer|_fused_sgd"),
    ("copies", r"copy|\bcat\b|catarray|clone|transpose|permute|contiguous|memcpy|memset|fill|gather|scatter"),
)
GAPS = 5  # the largest gaps to roofline named
# Ops that move no data (views): no work, and so no rate, whatever their shapes.
VIEWS = re.compile(
    r"aten::(?:view|_?reshape|as_strided|expand|transpose|permute|t|unsqueeze|squeeze|select|slice|detach|alias|unflatten|flatten|split|chunk|unbind|narrow|_unsafe_view)$"
)


def kind_of(*names: str) -> str:
    text = " ".join(names).lower()
    return next((kind for kind, pattern in _KIND_PATTERNS if re.search(pattern, text)), "element-wise")


def _numel(shape) -> int:
    return math.prod(shape) if isinstance(shape, (list, tuple)) and shape else 0


def attention_flops(name: str, shapes: list) -> float:
    """4 B H L S Dh for SDPA's forward (q k^T and P v), 2.5 times that for its backward (five
    GEMMs of that size), from q (B, H, L, Dh) and k (B, H, S, Dh); 0 where the shapes are not those."""
    q, k = (shapes + [[], []])[:2]
    if len(q) != 4 or len(k) != 4:
        return 0.0
    forward = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3]
    return forward * (2.5 if "backward" in name else 1.0)


def work_of(event, element_bytes: int) -> tuple[Optional[float], str]:
    """(FLOPs, "FLOP") of a GEMM or attention op, else (bytes, "B"): every input read once and an
    output the size of the largest written, at ``element_bytes`` each; (None, "") without shapes."""
    shapes = [s for s in (event.input_shapes or []) if isinstance(s, (list, tuple))]
    if VIEWS.match(event.name):
        return None, ""
    if getattr(event, "flops", 0):
        return float(event.flops), "FLOP"
    if kind_of(event.name) == "attention":
        flops = attention_flops(event.name, shapes)
        return (flops, "FLOP") if flops else (None, "")
    sizes = [_numel(s) for s in shapes]
    if not any(sizes):
        return None, ""
    return float((sum(sizes) + max(sizes)) * element_bytes), "B"


def _with_shapes(event):
    """The nearest op at or above ``event`` that recorded input shapes (a kernel's launching op)."""
    while event is not None and not any(event.input_shapes or []):
        event = event.cpu_parent
    return event


def _timed(events, on_device: bool) -> list[tuple[str, str, float, object]]:
    """(kernel, its op's name, microseconds, the op with shapes) of every kernel of one step (on
    the device), else of every op's self time on the CPU."""
    found = []
    for event in events:
        if on_device:
            op = _with_shapes(event)
            found += [(k.name, event.name if op is None else op.name, k.duration, op) for k in event.kernels]
        elif event.self_cpu_time_total > 0:
            found.append((event.name, event.name, event.self_cpu_time_total, event))
    return found


def profile_step(
    step: Callable[[int], object], device: torch.device, dtype: torch.dtype, peaks: dict[str, float]
) -> list[dict]:
    """Every kernel of one ``step(0)`` on ``device``, summed over its calls, longest first."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities, record_shapes=True, with_flops=True) as profiler:
        step(0)
        if on_device:
            torch.cuda.synchronize(device)
    element = torch.empty((), dtype=dtype).element_size()
    rows: dict[str, dict] = {}
    for kernel, op_name, us, op in _timed(profiler.events(), on_device):
        row = rows.setdefault(
            kernel, {"kernel": kernel, "kind": kind_of(kernel, op_name), "ms": 0.0, "calls": 0, "works": []}
        )
        row["ms"] += us / 1e3
        row["calls"] += 1
        row["works"].append((None, "") if op is None else work_of(op, element))
    for row in rows.values():  # a work only where every call's is known, in one unit
        works = row.pop("works")
        units = {unit for _, unit in works}
        known = len(units) == 1 and all(work is not None for work, _ in works)
        row["work"], row["work_unit"] = (sum(w for w, _ in works), units.pop()) if known else (None, "")
    total = sum(r["ms"] for r in rows.values()) or 1.0
    peak_flops = peaks.get(f"matmul_tflops_{str(dtype).removeprefix('torch.')}")
    for row in rows.values():
        row["share"] = row["ms"] / total
        row["achieved"] = row["fraction_of_peak"] = None
        if row["work"] and row["ms"] > 0:
            per_s = row["work"] / (row["ms"] * 1e-3)
            row["achieved"] = per_s / (1e12 if row["work_unit"] == "FLOP" else 1e9)
            peak = peak_flops if row["work_unit"] == "FLOP" else peaks.get("copy_gbps")
            row["fraction_of_peak"] = fraction_of(row["achieved"], peak)
    return sorted(rows.values(), key=lambda r: -r["ms"])


def by_kind(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(kind, ms, share) per kind, in ``KINDS``' order."""
    return [
        (
            kind,
            sum(r["ms"] for r in rows if r["kind"] == kind),
            sum(r["share"] for r in rows if r["kind"] == kind),
        )
        for kind in KINDS
        if any(r["kind"] == kind for r in rows)
    ]


def lost_ms(row: dict) -> float:
    """The milliseconds a kernel spends beyond its work at the peak rate: ms x (1 - fraction)."""
    return row["ms"] * (1 - min(row["fraction_of_peak"], 1.0))


def gaps(rows: list[dict]) -> list[dict]:
    """The kernels that lose the most milliseconds to their roofline (``lost_ms``)."""
    known = [r for r in rows if r["fraction_of_peak"] is not None]
    return sorted(known, key=lambda r: -lost_ms(r))[:GAPS]


def _rate(row: dict) -> str:
    if row["achieved"] is None:
        return "-"
    unit = "TFLOP/s" if row["work_unit"] == "FLOP" else "GB/s"
    fraction = "" if row["fraction_of_peak"] is None else f" ({row['fraction_of_peak']:.0%} of peak)"
    return f"{row['achieved']:,.1f} {unit}{fraction}"


def _work(row: dict) -> str:
    if row["work"] is None:
        return "-"
    return f"{row['work'] / 1e9:,.2f} GFLOP" if row["work_unit"] == "FLOP" else f"{row['work'] / 1e6:,.1f} MB"


def markdown(title: str, rows: list[dict]) -> list[str]:
    """The profile of one step: the kinds, the largest gaps to roofline, then every kernel."""
    lines = [f"### {title}", "", "| kind | ms | share |", "|---|---:|---:|"]
    lines += [f"| {kind} | {ms:.2f} | {share:.1%} |" for kind, ms, share in by_kind(rows)]
    lines += ["", "Largest gaps to roofline (ms beyond the work at the peak rate):", ""]
    lines += [
        f"- {short_name(r['kernel'])} ({r['kind']}): {r['ms']:.2f} ms at {_rate(r)}, {lost_ms(r):.2f} ms lost"
        for r in gaps(rows)
    ] or ["- none with a known work"]
    lines += ["", "<details><summary>every kernel</summary>", ""]
    lines += [
        "| kernel | kind | calls | ms | share | work | achieved |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {short_name(r['kernel'])} | {r['kind']} | {r['calls']} | {r['ms']:.3f} | {r['share']:.1%} "
        f"| {_work(r)} | {_rate(r)} |"
        for r in rows
    ]
    return lines + ["", "</details>", ""]


def short_name(name: str) -> str:
    """A C++ kernel's profiler key without its scope, template arguments and parameter list:
    ``void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)`` -> ``CatArrayBatchedCopy``.
    Other keys (Triton's and cuBLAS's kernels, ``aten::`` ops on a CPU) as they are."""
    if not name.startswith("void "):
        return name
    bare = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", bare, maxsplit=1)[0].rsplit("::", 1)[-1] or name
