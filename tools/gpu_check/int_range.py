"""Integer range analysis of a kernel's Triton IR (TTIR) at one launch's argument values.

Walks the TTIR in program order with an interval per integer value: function arguments take the
launch's values, ``tt.get_program_id`` ranges over the grid, ``tt.make_range`` over its bounds,
loop induction variables over their bounds; add, sub, mul, div, rem, min, max, select, casts and
shape ops (splat, broadcast, expand_dims, ...) propagate intervals. Every i32 (or i64) result
whose interval leaves its type's range is reported: index arithmetic that would wrap at these
sizes. Values the walk cannot bound (loads, loop-carried values, reductions) are left unknown and
never reported, so a finding is a real overflow, while an unknown value is not proof of safety.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

Interval = tuple[int, int]
_LIMITS = {32: (-(2**31), 2**31 - 1), 64: (-(2**63), 2**63 - 1)}
_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_VALUE = re.compile(r"%[\w.$-]+")
_FOR = re.compile(r"scf\.for\s+(%[\w.$-]+)\s*=\s*(%[\w.$-]+)\s+to\s+(%[\w.$-]+)\s+step")
_ARG = re.compile(r"(%[\w.$-]+):\s*(i32|i64)\b")
_SAME = {
    "tt.splat",
    "tt.broadcast",
    "tt.expand_dims",
    "tt.reshape",
    "tt.trans",
    "arith.extsi",
    "arith.index_cast",
    "ttg.convert_layout",
}


@dataclass(frozen=True)
class Overflow:
    """One integer operation whose result leaves its type's range at this launch."""

    value: str  # the SSA name, e.g. %offsets_12 (its prefix is the source variable's name)
    op: str
    bits: int
    low: int
    high: int

    def __str__(self) -> str:
        name = self.value.lstrip("%").rsplit("_", 1)[0] if "_" in self.value else self.value.lstrip("%")
        return f"i{self.bits} {self.op.split('.')[-1]} computing '{name}' spans [{self.low}, {self.high}]"


def _bits(type_text: str) -> Optional[int]:
    if "!tt.ptr" in type_text:
        return None
    match = re.search(r"(?:^|x|<)i(32|64)\b", type_text.strip())
    return int(match.group(1)) if match else None


def _result_type(rest: str) -> str:
    rest = rest.split(" loc(")[0]
    return rest.rsplit(" : ", 1)[-1] if " : " in rest else ""


def _combine(op: str, a: Interval, b: Interval) -> Optional[Interval]:
    if op in ("arith.addi",):
        return a[0] + b[0], a[1] + b[1]
    if op == "arith.subi":
        return a[0] - b[1], a[1] - b[0]
    if op == "arith.muli":
        products = [x * y for x in a for y in b]
        return min(products), max(products)
    if op in ("arith.divsi", "arith.divui", "arith.ceildivsi"):
        if b[0] > 0:
            quotients = [x // y for x in a for y in b] + [-(-x // y) for x in a for y in b]
            return min(quotients), max(quotients)
        return None
    if op in ("arith.remsi", "arith.remui"):
        if b[0] > 0:
            return (0 if a[0] >= 0 else -(b[1] - 1)), b[1] - 1
        return None
    if op in ("arith.minsi", "arith.minui"):
        return min(a[0], b[0]), min(a[1], b[1])
    if op in ("arith.maxsi", "arith.maxui"):
        return max(a[0], b[0]), max(a[1], b[1])
    if op == "arith.andi" and a[0] >= 0 and b[0] >= 0:
        return 0, min(a[1], b[1])
    return None


def find_overflows(ttir: str, int_args: dict[str, int], grid: tuple[int, int, int]) -> list[Overflow]:
    """Integer results of ``ttir`` that overflow their type, given the kernel's integer arguments by
    name and the launch grid."""
    ranges: dict[str, Interval] = {}
    found: list[Overflow] = []
    header = ttir[ttir.index("tt.func") :].split("\n", 1)[0] if "tt.func" in ttir else ""
    for name, _ in _ARG.findall(header):
        if name[1:] in int_args:
            value = int_args[name[1:]]
            ranges[name] = (value, value)
    for line in ttir.splitlines():
        loop = _FOR.search(line)
        if loop:
            iv, lb, ub = loop.groups()
            if lb in ranges and ub in ranges:
                ranges[iv] = (ranges[lb][0], max(ranges[lb][0], ranges[ub][1] - 1))
        match = _DEF.match(line)
        if not match:
            continue
        result, op, rest = match.groups()
        bits = _bits(_result_type(rest))
        if bits is None:
            continue
        operands = [
            v for v in _VALUE.findall(rest.split(" : ")[0]) if not v.startswith("%cst") or v in ranges
        ]
        interval: Optional[Interval] = None
        if op == "arith.constant":
            numbers = re.findall(r"(?:dense<|^)\s*(-?\d+)\s*>?\s*:", rest)
            if numbers:
                interval = (int(numbers[0]), int(numbers[0]))
        elif op == "tt.get_program_id":
            axis = "xyz".index(rest.split()[0])
            interval = (0, grid[axis] - 1)
        elif op == "tt.get_num_programs":
            axis = "xyz".index(rest.split()[0])
            interval = (grid[axis], grid[axis])
        elif op == "tt.make_range":
            bounds = dict(re.findall(r"(start|end) = (-?\d+)", rest))
            interval = (int(bounds["start"]), int(bounds["end"]) - 1)
        elif op in _SAME or op == "arith.extui":
            if operands and operands[0] in ranges:
                interval = ranges[operands[0]]
        elif op == "arith.select" and len(operands) >= 3:
            if operands[1] in ranges and operands[2] in ranges:
                a, b = ranges[operands[1]], ranges[operands[2]]
                interval = (min(a[0], b[0]), max(a[1], b[1]))
        elif len(operands) >= 2 and operands[0] in ranges and operands[1] in ranges:
            interval = _combine(op, ranges[operands[0]], ranges[operands[1]])
            low, high = _LIMITS[bits]
            if interval is not None and (interval[0] < low or interval[1] > high):
                found.append(Overflow(result, op, bits, *interval))
                interval = None  # reported once, at its source
        if interval is not None:
            ranges[result] = interval
    return found
