"""Time boxes: a budget of seconds per section of a long run. Work is admitted item by item while
the time left covers the item's expected duration (the mean of the items admitted so far, or a
caller's larger estimate); what is not admitted is recorded as skipped (and reported), never
started. An item already started runs to its end, so a section overruns only by a misestimate.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


class Budget:
    """``seconds`` from construction. ``admit(label)`` says whether to start the next item (and
    records ``label`` as skipped when not); ``take(items)`` yields the items admitted."""

    def __init__(
        self,
        seconds: float,
        clock: Callable[[], float] = time.perf_counter,
        on_admit: Callable[[str], None] = lambda label: None,
    ):
        self.seconds = float(seconds)
        self._clock = clock
        self._on_admit = on_admit  # told each item as it starts: a run killed mid-item shows which
        self._started = clock()
        self._admitted: list[float] = []  # when each admitted item started
        self.skipped: list[str] = []

    def used(self) -> float:
        return self._clock() - self._started

    def left(self) -> float:
        return max(0.0, self.seconds - self.used())

    def expected(self) -> float:
        """Seconds the next item is expected to take: the mean of the admitted items so far (an item
        ends when the next is asked for), 0 before the first."""
        if not self._admitted:
            return 0.0
        return (self._clock() - self._admitted[0]) / len(self._admitted)

    def admit(self, label: str, need_s: float = 0.0) -> bool:
        """Start the item ``label`` when the time left covers ``max(need_s, expected())``."""
        if self.left() > 0 and self.left() >= max(need_s, self.expected()):
            self._admitted.append(self._clock())
            self._on_admit(label)
            return True
        self.skipped.append(label)
        return False

    def take(self, items: Iterable[T], label: Callable[[T], str] = str) -> Iterator[T]:
        for item in items:
            if self.admit(label(item)):
                yield item

    def summary(self) -> dict[str, object]:
        """{"budget_s", "used_s", "skipped": [labels]} for the report."""
        return {
            "budget_s": round(self.seconds, 1),
            "used_s": round(self.used(), 1),
            "skipped": list(self.skipped),
        }


def shares(budgets: dict[str, float], total_left: float) -> dict[str, float]:
    """Each remaining section's budget, scaled down in proportion when the time left overall is less
    than their sum (an earlier section overran), never up."""
    wanted = sum(budgets.values())
    scale = min(1.0, total_left / wanted) if wanted > 0 else 1.0
    return {name: seconds * scale for name, seconds in budgets.items()}
