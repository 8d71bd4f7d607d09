"""Transposes of computed register tiles feeding a dot, found in a compiled kernel's TTGIR.

Triton miscompiles ``tl.dot(tl.trans(x), y)`` on Hopper where ``x`` is a tile computed in registers
(a product or softmax in the MMA accumulator's layout): triton-lang/triton#6124, which gave our
attention backward a wrong dK on an H100. In TTGIR that is a ``tt.trans`` of a register tensor
whose result reaches an operand of ``tt.dot`` or ``ttng.warp_group_dot`` (directly, or through
``ttg.convert_layout`` and a round trip through shared memory). Kernels compute such products the
other way round (the transposed orientation, as Triton's fused-attention tutorial does) and
transpose only tiles as loaded.

What is allowed, as Triton 3.x lowers it:

* ``ttg.memdesc_trans``, a transpose of a shared-memory descriptor (``!ttg.memdesc``): how sm_90
  feeds a transposed loaded tile to wgmma, and how sm_80 lowers some transposes of computed tiles;
* a register ``tt.trans`` of a tile as loaded: on sm_80 ``tl.trans(k)`` of a loaded ``k`` stays a
  register ``tt.trans`` into the dot operand layout, its source a ``ttg.local_load`` of the buffer
  the pipeliner's async copies fill, or a ``ttg.convert_layout`` of a ``tt.load``. The source is
  followed back through layout-only ops (layout conversions, shared-memory round trips, views,
  loop-carried values) to what produced the data: loads and constants pass, anything computed fails.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

DOTS = ("tt.dot", "ttng.warp_group_dot", "tt.dot_scaled", "ttng.tc_gen5_mma")  # operands 0 and 1: A and B
LOADS = (
    "tt.load",
    "tt.descriptor_load",
    "tt.experimental_descriptor_load",
    "ttg.async_copy_global_to_local",
    "ttng.async_tma_copy_global_to_local",
    "ttng.async_tma_gather",
)
# ops that only move a value (layout, storage, view, shape), operand 0 -> result
MOVES = (
    "ttg.convert_layout",
    "ttg.local_load",
    "ttg.local_alloc",
    "ttg.memdesc_index",
    "ttg.memdesc_subslice",
    "ttg.memdesc_subview",
    "ttg.memdesc_trans",
    "ttg.memdesc_reshape",
    "ttg.memdesc_reinterpret",
    "tt.trans",
    "tt.reshape",
)
CASTS = ("arith.truncf", "arith.extf", "tt.fp_to_fp", "tt.bitcast")  # between a transpose and a dot operand
WRITERS = ("ttg.local_store",)  # value, destination buffer

_RESULTS = re.compile(r'^\s*((?:%[\w$.\-]+(?::\d+)?)(?:\s*,\s*%[\w$.\-]+(?::\d+)?)*)\s*=\s*"?([\w.]+)"?(.*)$')
_OP = re.compile(r'^\s*"?([a-z_]+\.[\w.]+)"?(.*)$')
_REF = re.compile(r"%[\w$.\-]+(?:#\d+)?")
_ITER_ARGS = re.compile(r"iter_args\((.*?)\)\s*->")
_LOC = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")


@dataclass
class _Op:
    name: str
    operands: list[str]
    text: str
    loc: Optional[str]
    results: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Transpose:
    """A register ``tt.trans`` whose result reaches a dot operand."""

    value: str  # the transpose's SSA result
    source_op: str  # the op defining the transposed value
    source_type: str  # the transposed tensor's type (its layout: #mma for an accumulator)
    dot: str  # the dot op it reaches
    where: str  # file:line of the tl.trans in the kernel source, where the TTGIR records it
    origins: tuple[str, ...]  # what produced the data: "load", "constant", or the computing ops

    @property
    def computed(self) -> bool:
        """Whether the transposed data was computed (not a tile as loaded, nor a constant)."""
        return bool(set(self.origins) - {"load", "constant"})

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"tt.trans{at} of {self.source_op} ({self.source_type}) -> {self.dot}"


def _first_top_level(text: str, stop) -> int:
    """The index of the first character outside every bracket at which ``stop(text, i)`` holds, else
    ``len(text)`` (``->`` is an arrow, not a closing bracket)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}" or (ch == ">" and text[i - 1] != "-"):
            depth -= 1
        elif depth == 0 and stop(text, i):
            return i
    return len(text)


def _strip_types(rest: str) -> str:
    """An op's text before its trailing type signature and location (operands and attributes)."""
    rest = _LOC.sub("", rest.rstrip())
    return rest[
        : _first_top_level(rest, lambda t, i: t[i] == ":" and t[i - 1] == " " and t[i + 1 : i + 2] == " ")
    ]


def _operand_type(text: str) -> str:
    """The first type of an op's signature (``: tensor<...> -> ...``): its first operand's."""
    rest = _LOC.sub("", text.rstrip())
    signature = rest[len(_strip_types(rest)) :].lstrip(" :")
    return signature[
        : _first_top_level(signature, lambda t, i: t[i] == "," or t.startswith(" ->", i))
    ].strip()


def _worklist(first: str):
    """(stack, values): a depth-first walk from ``first``; what is pushed onto ``stack`` while
    iterating ``values`` is visited too, each value once."""
    stack, seen = [first], set()

    def values():
        while stack:
            value = stack.pop()
            if value not in seen:
                seen.add(value)
                yield value

    return stack, values()


class _Module:
    """The SSA graph of one TTGIR module: each value's defining op, each value's uses, and the
    sources of block arguments and region results (scf.for iter_args and yields, scf.if yields)."""

    def __init__(self, text: str):
        self.defs: dict[str, _Op] = {}
        self.uses: dict[str, list[tuple[_Op, int]]] = {}
        self.sources: dict[str, list[str]] = {}  # loop-carried and region values -> what flows in
        self.locs: dict[str, str] = {}
        self.ops: list[_Op] = []
        stack: list[tuple[str, list[str], list[str]]] = []  # (kind, region results, iter args)
        for line in text.splitlines():
            stripped = line.strip()
            loc_def = _LOC_DEF.match(stripped)
            if loc_def:
                self.locs[loc_def.group(1)] = loc_def.group(2)
                continue
            if stripped.startswith("}"):
                if stack:
                    kind, results, iter_args = stack.pop()
                    if stripped.rstrip("{ ").endswith("else"):
                        stack.append(("if", results, []))
                continue
            op = self._parse(stripped)
            if op is not None:
                self.ops.append(op)
            if op is not None and op.name == "scf.yield" and stack:
                _, results, iter_args = stack[-1]
                for i, value in enumerate(op.operands):
                    for target in (
                        results[i] if i < len(results) else None,
                        iter_args[i] if i < len(iter_args) else None,
                    ):
                        if target is not None:
                            self.sources.setdefault(target, []).append(value)
            if stripped.endswith("{"):  # a region opens (scf.for, scf.if, tt.reduce's combiner, ...)
                iter_args: list[str] = []
                if op is not None and op.name == "scf.for":
                    match = _ITER_ARGS.search(op.text)
                    for pair in match.group(1).split(",") if match else []:
                        arg, _, init = pair.partition("=")
                        arg, init = arg.strip(), init.strip()
                        if arg.startswith("%") and init.startswith("%"):
                            iter_args.append(arg)
                            self.sources.setdefault(arg, []).append(init)
                    for i, result in enumerate(op.results):
                        if i < len(iter_args):
                            self.sources.setdefault(result, []).append(self.sources[iter_args[i]][0])
                kind = op.name if op is not None else "region"
                stack.append((kind, op.results if kind in ("scf.for", "scf.if") else [], iter_args))

    def _parse(self, line: str) -> Optional[_Op]:
        match = _RESULTS.match(line)
        if match:
            names, name, rest = match.group(1), match.group(2), match.group(3)
        else:
            plain = _OP.match(line)
            if not plain:
                return None
            names, name, rest = "", plain.group(1), plain.group(2)
        loc = _LOC.search(line)
        head = _strip_types(rest)
        if name == "scf.for":  # only the bounds are operands; iter_args are wired up as sources
            head = head.split("iter_args", 1)[0]
        operands = _REF.findall(head)
        op = _Op(name, operands, line, loc.group(1) if loc else None)
        for result in (n.strip() for n in names.split(",") if n.strip()):
            base, _, count = result.partition(":")
            op.results += [f"{base}#{i}" for i in range(int(count))] if count else [base]
        for i, result in enumerate(op.results):
            self.defs[result] = op
            if name == "ttng.warp_group_dot_wait" and i < len(operands):  # waits pass their operands through
                self.sources.setdefault(result, []).append(operands[i])
        for index, operand in enumerate(operands):
            self.uses.setdefault(operand, []).append((op, index))
        return op

    def where(self, op: _Op) -> str:
        """file:line of an op, through the module's location aliases (innermost call site)."""
        loc, seen = op.loc, set()
        while loc and loc not in seen:
            seen.add(loc)
            text = self.locs.get(loc, loc)
            file_line = re.match(r'^"([^"]+)":(\d+)', text)
            if file_line:
                return f"{os.path.basename(file_line.group(1))}:{file_line.group(2)}"
            inner = re.search(r"#loc\d*", text)
            loc = inner.group(0) if inner else None
        return ""

    def _buffer_writers(self) -> dict[str, list[tuple[_Op, int]]]:
        """Each shared-memory buffer allocated empty -> the ops writing it (and the written operand)."""
        writers: dict[str, list[tuple[_Op, int]]] = {}
        for op in self.ops:
            if op.name in LOADS or op.name in WRITERS:
                for index, operand in enumerate(op.operands):
                    root = self._root_buffer(operand)
                    if root is not None and not (op.name in WRITERS and index == 0):
                        writers.setdefault(root, []).append((op, index))
        return writers

    def _root_buffer(self, value: str) -> Optional[str]:
        seen = set()
        while value not in seen:
            seen.add(value)
            op = self.defs.get(value)
            if op is None:
                sources = self.sources.get(value)
                if not sources:
                    return None
                value = sources[0]
                continue
            if op.name == "ttg.local_alloc" and not op.operands:
                return value
            if op.name.startswith("ttg.memdesc_") and op.operands:
                value = op.operands[0]
                continue
            return None
        return None

    def origins(self, value: str, writers: dict) -> set[str]:
        """What produced the data of ``value``, through moves, buffers and loop-carried values:
        load op names, "constant", or the names of the ops that computed it."""
        found: set[str] = set()
        stack, values = _worklist(value)
        for value in values:
            if value in self.sources:
                stack.extend(self.sources[value])
                if value not in self.defs:
                    continue
            op = self.defs.get(value)
            if op is None:
                if value not in self.sources:
                    found.add("argument")
                continue
            if op.name in LOADS:
                found.add("load")
            elif op.name == "arith.constant":
                found.add("constant")
            elif op.name == "ttg.local_alloc" and not op.operands:
                for writer, _ in writers.get(value, []):
                    if writer.name in LOADS:
                        found.add("load")
                    else:
                        stack.append(writer.operands[0])
            elif op.name in MOVES and op.operands:
                stack.append(op.operands[0])
            elif op.name in ("scf.for", "scf.if", "ttng.warp_group_dot_wait"):
                pass  # results wired through self.sources above
            else:
                found.add(op.name)
        return found

    def reaches_dot(self, value: str) -> Optional[str]:
        """The dot op (name) whose A or B operand ``value`` becomes, through moves and casts."""
        stack, values = _worklist(value)
        for value in values:
            for op, index in self.uses.get(value, []):
                if op.name in DOTS and index in (0, 1):
                    return op.name
                if (op.name in MOVES or op.name in CASTS) and index == 0:
                    stack.extend(op.results)
                elif op.name in WRITERS and index == 0 and len(op.operands) > 1:
                    root = self._root_buffer(op.operands[1])
                    if root is not None:
                        stack.extend(self._views(root))
        return None

    def _views(self, root: str) -> list[str]:
        views, stack = [root], [root]
        while stack:
            for op, index in self.uses.get(stack.pop(), []):
                if op.name.startswith("ttg.memdesc_") and index == 0:
                    views.extend(op.results)
                    stack.extend(op.results)
        return views


def transposes_into_dots(ttgir: str) -> list[Transpose]:
    """Every register ``tt.trans`` in ``ttgir`` whose result reaches a dot operand (A or B), with
    what produced the transposed data."""
    module = _Module(ttgir)
    writers = module._buffer_writers()
    found = []
    for op in module.ops:
        if op.name != "tt.trans" or not op.operands or not op.results:
            continue
        source_type = _operand_type(op.text)
        if "memdesc" in source_type:
            continue  # a shared-memory view, as ttg.memdesc_trans
        dot = module.reaches_dot(op.results[0])
        if dot is None:
            continue
        origins = tuple(sorted(module.origins(op.operands[0], writers)))
        producer = module.defs.get(op.operands[0])
        source_op = producer.name if producer is not None else "a block argument"
        found.append(Transpose(op.results[0], source_op, source_type, dot, module.where(op), origins))
    return found


def computed_transposes(ttgir: str) -> list[Transpose]:
    """The triton-lang/triton#6124 pattern: register transposes of computed tiles (not data as
    loaded, nor constants) that reach a dot operand."""
    return [t for t in transposes_into_dots(ttgir) if t.computed]
