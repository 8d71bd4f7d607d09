"""python -m tools.gpu_check.compare BEFORE AFTER: what a kernel edit changed in the machine code, from
two compile-gate reports (``report.json`` of ``make check-gpu`` before and after).

Variants are matched by kernel, target, tile configuration, signature and constexprs. Per kernel and
target, the markdown table gives how many variants matched, how many changed their registers,
spills, stack frame or shared memory, the largest relative change of each, and the variants over
``--tolerance`` (5 % by default) by name. Exits 1 where a variant is over it or only one report has it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

RESOURCES = ("registers", "spill_bytes", "stack_bytes", "shared_bytes")


def _variants(report: Path) -> dict[tuple, dict]:
    """The report's compiled variants by (kernel, target, config, signature, constexprs)."""
    rows = json.loads(Path(report).read_text())["variants"]
    return {
        (
            r["kernel"],
            r["target"],
            r["config"],
            repr(sorted(r["signature"].items())),
            repr(sorted(r["constexprs"].items())),
        ): r
        for r in rows
        if not r["error"]
    }


def _change(before: int, after: int) -> float:
    """The relative change after / before - 1 (a change from 0 counts as 100 %)."""
    if before == after:
        return 0.0
    return abs(after - before) / before if before else 1.0


def compare(before: Path, after: Path, tolerance: float = 0.05) -> tuple[str, list[str]]:
    """-> (the markdown table, the variants over ``tolerance`` or in one report only)."""
    old, new = _variants(before), _variants(after)
    problems = [f"only in {before}: {' '.join(k[:3])}" for k in old.keys() - new.keys()]
    problems += [f"only in {after}: {' '.join(k[:3])}" for k in new.keys() - old.keys()]
    groups = defaultdict(list)
    for key in old.keys() & new.keys():
        groups[key[:2]].append((key, old[key], new[key]))
    lines = [
        "| kernel | target | variants | changed | "
        + " | ".join(f"largest {r} change" for r in RESOURCES)
        + " |",
        "|---|---|---:|---:|" + "---:|" * len(RESOURCES),
    ]
    for (kernel, target), group in sorted(groups.items()):
        changed = sum(any(b[r] != a[r] for r in RESOURCES) for _, b, a in group)
        largest = []
        for resource in RESOURCES:
            worst = max(group, key=lambda g: _change(g[1][resource], g[2][resource]))
            _, b, a = worst
            largest.append("0" if b[resource] == a[resource] else f"{b[resource]} -> {a[resource]}")
        lines.append(f"| `{kernel}` | {target} | {len(group)} | {changed} | " + " | ".join(largest) + " |")
        for key, b, a in group:
            over = [f"{r} {b[r]} -> {a[r]}" for r in RESOURCES if _change(b[r], a[r]) > tolerance]
            if over:
                problems.append(f"{kernel} {target} {key[2]} {key[4]}: " + ", ".join(over))
    return "\n".join(lines), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="report.json of the compile gate before the change")
    parser.add_argument("after", type=Path, help="report.json after it")
    parser.add_argument("--tolerance", type=float, default=0.05, help="relative change allowed (0.05)")
    args = parser.parse_args(argv)
    table, problems = compare(args.before, args.after, args.tolerance)
    print(table)
    for line in problems:
        print(f"- {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
