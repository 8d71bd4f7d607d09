"""The compile gate's report: one JSON row per compiled variant and target, and a markdown table
per target summarising each kernel (variants, registers, spills, shared memory, CTAs per SM,
tensor cores, TMA copies, transposes of computed tiles feeding a dot)."""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from pathlib import Path

import torch
import triton


def _rows(jobs, results, launches) -> list[dict]:
    used_by = defaultdict(set)
    for case, _, keys in launches:
        for key in keys.values():
            used_by[key].add(f"{case.op} {case.precision}")
    rows = []
    for key, resources in results.items():
        variant, capability, bound = jobs[key]
        rows.append(
            {
                "kernel": variant.name,
                "config": variant.config,
                "target": f"sm_{capability}",
                "signature": {k: v for k, v in bound.signature.items() if v != "constexpr"},
                "constexprs": {variant.kernel.arg_names[k[0]]: str(v) for k, v in bound.constexprs.items()},
                "registers": resources.registers,
                "spill_bytes": resources.spill_bytes,
                "stack_bytes": resources.stack_bytes,
                "shared_bytes": resources.shared_bytes,
                "num_warps": resources.num_warps,
                "ctas_per_sm": resources.ctas_per_sm,
                "tensor_cores": resources.tensor_cores,
                "tma": resources.tma,
                "computed_transposes": resources.computed_transposes,
                "error": resources.error,
                "used_by": sorted(used_by[key]),
            }
        )
    return sorted(rows, key=lambda r: (r["target"], r["kernel"], r["config"]))


def summary_table(rows: list[dict], target: str) -> str:
    """Markdown: per kernel on ``target``, the range over its variants."""
    by_kernel = defaultdict(list)
    for row in rows:
        if row["target"] == target and not row["error"]:
            by_kernel[row["kernel"]].append(row)
    lines = [
        f"| kernel ({target}) | variants | registers | spill bytes | shared KB | CTAs/SM | tensor cores | TMA loads "
        "| computed-tile transposes |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for kernel, group in sorted(by_kernel.items()):
        regs = [r["registers"] for r in group]
        ctas = [r["ctas_per_sm"] for r in group]
        shared = max(r["shared_bytes"] for r in group) / 1024
        cores = ", ".join(sorted({r["tensor_cores"] for r in group}))
        tma = sum(bool(r.get("tma")) for r in group)
        tma = "every variant" if tma == len(group) else "none" if tma == 0 else f"{tma} of {len(group)}"
        transposes = sum(len(r.get("computed_transposes", ())) for r in group)
        lines.append(
            f"| `{kernel}` | {len(group)} | {min(regs)}-{max(regs)} | {max(r['spill_bytes'] for r in group)} "
            f"| {shared:.1f} | {min(ctas)}-{max(ctas)} | {cores} | {tma} | {transposes} |"
        )
    return "\n".join(lines)


def write_reports(out: Path, jobs, results, launches, failures, targets, seconds) -> str:
    """Write report.json and report.md under ``out``; returns the markdown summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(jobs, results, launches)
    environment = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "launches": len(launches),
        "variants": len(rows),
        "seconds": round(seconds, 1),
    }
    (out / "report.json").write_text(
        json.dumps({"environment": environment, "failures": failures, "variants": rows}, indent=1)
    )
    tables = "\n\n".join(summary_table(rows, f"sm_{t}") for t in sorted(targets, reverse=True))
    text = (
        f"# GPU compile gate\n\ntriton {triton.__version__}, {len(launches)} launches recorded, "
        f"{len(rows)} variants compiled, {len(failures)} failures.\n\n{tables}\n"
    )
    if failures:
        text += "\n## Failures\n\n" + "\n".join(f"- {f}" for f in failures) + "\n"
    (out / "report.md").write_text(text)
    return tables
