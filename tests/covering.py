"""Grids that cover instead of multiplying: a test marked ``@pytest.mark.pairwise`` runs, in
``make test``, a subset of its parameter product in which every value of every ``parametrize``
axis, and every pair of values of two axes, appears in at least one case; the rest of the product
is marked ``slow`` (``make test-all`` and ``make test-gpu`` run it whole).

An axis is one ``parametrize`` decorator: ``"device,backend_name,dtype"`` is one axis whose values
are the (device, backend, dtype) triples, so every op x backend x dtype still runs, crossed with each
value of every other axis. CUDA cases (marker ``gpu``), cases already ``slow`` and cases whose
``skipif`` holds are left as they are and do not count as covering anything."""

from __future__ import annotations

from itertools import combinations
from typing import Hashable, Sequence

import pytest


def pairwise_cover(rows: Sequence[Sequence[Hashable]]) -> list[int]:
    """Indices of a subset of ``rows`` (each a tuple of axis values, all of one length) that holds
    every pair of values found together in any row, for every two axes; one axis: every value.
    Greedy (each step the row adding the most uncovered pairs, the first on a tie), so the subset
    depends only on ``rows`` and their order."""
    if not rows:
        return []
    width = len(rows[0])
    if width == 1:
        first: dict = {}
        for index, row in enumerate(rows):
            first.setdefault(row[0], index)
        return sorted(first.values())
    pairs_of = [{(i, j, row[i], row[j]) for i, j in combinations(range(width), 2)} for row in rows]
    uncovered = set().union(*pairs_of)
    chosen: list[int] = []
    while uncovered:
        gains = [len(pairs & uncovered) for pairs in pairs_of]
        best = max(range(len(rows)), key=lambda index: (gains[index], -index))
        chosen.append(best)
        uncovered -= pairs_of[best]
    return sorted(chosen)


def _axes(item: pytest.Item) -> list[tuple[str, ...]]:
    names = [mark.args[0] for mark in item.iter_markers("parametrize")]
    return [tuple(n.strip() for n in (a.split(",") if isinstance(a, str) else a)) for a in names]


def _skipped(item: pytest.Item) -> bool:
    return any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))


def mark_uncovered_slow(items: list[pytest.Item]) -> int:
    """Mark ``slow`` each CPU case of a ``pairwise`` test outside its covering subset. -> how many."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("pairwise") is None or not hasattr(item, "callspec"):
            continue
        if item.get_closest_marker("gpu") or item.get_closest_marker("slow") or _skipped(item):
            continue
        groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    marked = 0
    for group in groups.values():
        axes = _axes(group[0])
        rows = [tuple(repr([item.callspec.params[n] for n in axis]) for axis in axes) for item in group]
        keep = set(pairwise_cover(rows))
        for index, item in enumerate(group):
            if index not in keep:
                item.add_marker(pytest.mark.slow)
                marked += 1
    return marked
