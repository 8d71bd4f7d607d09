"""``vk.explain()``: every op signature this process has run, what ran for it and why.

A record is kept per (signature, requested backend): the op, device, dtype, argument shapes, whether
gradients were needed, the implementation that ran, where the decision came from (``table``,
``tuned``, ``measured``, ``requested``, ``fallback``, ``only candidate``), the reason in words, and
per candidate its measured time, validation result or the capability / limit that excluded it.
Below them, per Triton kernel and key, the tile launched and how: ``checked``, ``tuned``, or
``table, unchecked`` (launched only while traced or captured).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass
class Record:
    """One signature as ``explain`` shows it. ``candidates`` maps backend -> what was found:
    ``"0.123 ms"``, ``"invalid: <why>"`` or ``"excluded: <capability or limit>"``."""

    op: str
    device: str
    dtype: str
    shapes: str
    grad: bool
    requested: str
    backend: str
    source: str
    reason: str
    candidates: dict[str, str] = field(default_factory=dict)
    calls: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__, candidates=dict(self.candidates))


class Explanation:
    """The table ``vk.explain()`` returns: ``print(vk.explain())``, or ``.rows`` / ``.as_dicts()``
    for the data."""

    COLUMNS = ("op", "device", "dtype", "shapes", "grad", "ran", "source", "candidates")

    def __init__(self, rows: list[Record], tiles: Optional[list[dict]] = None):
        self.rows = rows
        self.tiles = tiles or []  # per kernel and key: the tile launched and how it was chosen

    def __iter__(self) -> Iterator[Record]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def as_dicts(self) -> list[dict]:
        return [r.as_dict() for r in self.rows]

    def ran(self, op: Optional[str] = None) -> set[str]:
        """The backends that ran (for ``op``, or for any op)."""
        return {r.backend for r in self.rows if op is None or r.op == op}

    def __str__(self) -> str:
        if not self.rows:
            return "\n".join(["vit_kernels.explain(): no op has run yet", *self._tile_lines()])
        cells = [
            (
                r.op,
                r.device,
                r.dtype.replace("torch.", ""),
                r.shapes,
                "yes" if r.grad else "no",
                r.backend,
                r.source,
            )
            for r in self.rows
        ]
        widths = [
            min(48, max(len(c), *(len(row[i]) for row in cells))) for i, c in enumerate(self.COLUMNS[:-1])
        ]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.COLUMNS, widths)) + "  candidates"]
        for r, row in zip(self.rows, cells):
            candidates = "; ".join(f"{b}: {v}" for b, v in r.candidates.items())
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)) + "  " + candidates)
            lines.append(
                f"    why: {r.reason} ({r.calls} call{'s' if r.calls != 1 else ''}, asked: {r.requested})"
            )
        return "\n".join(lines + self._tile_lines())

    def _tile_lines(self) -> list[str]:
        if not self.tiles:
            return []
        return ["tiles (kernel, key: tile, how):"] + [
            f"  {t['kernel']}, {t['key']}: {t['tile']!r}, {t['how']}" for t in self.tiles
        ]

    __repr__ = __str__


class Journal:
    """The records, by key; thread-safe insertion, cheap per-call counting."""

    def __init__(self):
        self._records: dict[tuple, Record] = {}
        self._lock = threading.Lock()

    def add(self, key: tuple, record: Record) -> Record:
        """Store ``record`` under ``key`` (a newer decision replaces an older one; calls carry over)."""
        with self._lock:
            old = self._records.get(key)
            if old is not None:
                if (old.backend, old.source, old.reason) == (record.backend, record.source, record.reason):
                    return old
                record.calls = old.calls
            self._records[key] = record
            return record

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def snapshot(self, tiles: Optional[list[dict]] = None) -> Explanation:
        with self._lock:
            return Explanation([Record(**r.as_dict()) for r in self._records.values()], tiles)
