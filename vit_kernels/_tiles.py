"""Which tile each Triton kernel launches: the op's table, or what ``vk.tune`` searched.

A kernel's launch configurations are a list per key (dtype, head dim, a size class, ...), ordered per
architecture: the first is the table's default, the tile measured fastest there (each table cites
its results file). A call launches the tile ``vk.tune`` searched or ``vk.load_tuning`` loaded for its
key, else the default; CPU tensors (the interpreter) a fixed small tile. An ordinary call checks and
times nothing: the GPU tests and ``vk.selftest()`` run every table entry against float64.

Searching (inside ``vk.tune`` only, on CUDA, outside tracing and graph capture): each candidate runs
on the call's own inputs and is compared with the reference (``_accuracy``); the right ones are
timed together and the fastest is kept for the key.

A launcher keeps what it works out from a tile (grid, constants) per call signature in a plan table
(``decided`` / ``keep``): a warm call is one lookup. ``forget`` empties them when tiles change.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _autograd, _signature
from vit_kernels._accuracy import without_autocast
from vit_kernels._triton import LAUNCH_CONFIGS, interpreted

Tile = tuple  # a NamedTuple of one kernel's launch parameters, or a tuple of them (attention's pairs)


def plain_repr(tile: tuple) -> str:
    """A tile NamedTuple's ``__repr__``: the plain tuple, as reports and the tuning file key it."""
    return repr(tuple(tile))


@dataclass(frozen=True)
class Choice:
    tile: Tile
    how: str  # "tuned", "loaded" or "pinned"
    trials: dict  # tile -> milliseconds, or why it was excluded


# The tiles searched or loaded, by "<kernel> | <device name> | <key>": what ``vk.save_tuning`` writes.
TUNED: dict[str, dict] = {}
_search = {"enabled": False}
_plan_tables: list[dict] = []
_lock = threading.RLock()  # a candidate run may choose the tile of a kernel it calls


@contextlib.contextmanager
def search(enabled: bool = True) -> Iterator[None]:
    """Inside the block, whether keys met on CUDA are searched (``vk.tune``'s switch)."""
    before, _search["enabled"] = _search["enabled"], enabled
    try:
        yield
    finally:
        _search["enabled"] = before


def searching() -> bool:
    return _search["enabled"]


def _as_tile(value):
    """A tile read back from JSON: lists become tuples again, nested (the attention pairs) too."""
    return tuple(_as_tile(v) for v in value) if isinstance(value, list) else value


class TileChooser:
    """The tiles of one launcher's kernels chosen by ``vk.tune`` or loaded, per key."""

    instances: list["TileChooser"] = []

    def __init__(self, name: str):
        self.name = name
        self._chosen: dict[tuple, Choice] = {}
        TileChooser.instances.append(self)

    def chosen(self, key: tuple) -> Optional[Tile]:
        hit = self._chosen.get(key)
        return None if hit is None else hit.tile

    def pin(self, key: tuple, tile: Tile) -> None:
        """Launch ``tile`` for ``key`` from now on in this process (the compile gate's candidates)."""
        self._keep(key, Choice(tile, "pinned", {}))

    def report(self) -> dict[tuple, Choice]:
        return dict(self._chosen)

    def _keep(self, key: tuple, choice: Choice) -> Tile:
        self._chosen[key] = choice
        forget_plans()
        return choice.tile

    def choose(self, key, device, candidates, trial) -> Tile:
        """The tile for a key this chooser holds nothing for: a loaded or searched one, else the
        table's default (``candidates[0]``)."""
        text = f"{self.name} | {_signature.device_name(device)} | {key!r}"
        stored = TUNED.get(text)
        wanted = None if stored is None else _as_tile(stored["tile"])
        tile = next((c for c in candidates if c == wanted), None)  # the table's own (NamedTuple) tile
        if tile is not None:  # a stored tile the table no longer lists is not launched
            return self._keep(key, Choice(tile, "loaded", stored.get("trials") or {}))
        if not (searching() and can_measure(device)):
            return candidates[0]
        with _lock, without_autocast():
            choice = self._search(key, candidates, *trial())
        if choice is None:  # an empty problem: nothing to compare or time
            return candidates[0]
        TUNED[text] = {"tile": choice.tile, "trials": {repr(t): v for t, v in choice.trials.items()}}
        return self._keep(key, choice)

    def _search(self, key, candidates, run, check) -> Optional[Choice]:
        from vit_kernels.tuning import time_runs  # the one timer, beside the backend search

        trials: dict = {}
        for tile in candidates:
            try:
                outputs = run(tile)
                if all(o.numel() == 0 for o in outputs):
                    return None
                problem = check(outputs)
            except Exception as error:  # a candidate that cannot run is excluded, not fatal
                problem = f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            trials[tile] = None if problem is None else f"invalid: {problem}"
        valid = {tile: (lambda tile=tile: run(tile)) for tile, trial in trials.items() if trial is None}
        if not valid:
            raise RuntimeError(
                f"vit_kernels: no {self.name} tile computes the right answer for {key}: {trials}"
            )
        trials.update(time_runs(valid))
        return Choice(min(valid, key=trials.get), "tuned", trials)


def can_measure(device: torch.device) -> bool:
    """Whether candidates may run and be timed now: on CUDA, outside tracing and graph capture."""
    return device.type == "cuda" and not _autograd.tracing() and not _signature.capturing_cuda_graph()


def tile_to_launch(
    chooser: TileChooser,
    device: torch.device,
    key: Callable[[], tuple],
    interpreter_tile: Callable[[], Tile],
    candidates: Callable[[], Sequence[Tile]],
    trial: Callable[[], tuple[Callable, Callable]],
) -> Tile:
    """The tile a launcher launches on tensors of ``device``: the interpreter's (CPU tensors), the
    one ``chooser`` holds for ``key()``, else ``TileChooser.choose``'s. ``trial() -> (run, check)``
    is built only where a search runs: ``run(tile)`` launches into fresh outputs and returns them,
    ``check(outputs)`` returns None when they are right, else why not."""
    if interpreted(device):
        return interpreter_tile()
    chosen_key = key()
    return chooser.chosen(chosen_key) or chooser.choose(chosen_key, device, candidates(), trial)


def decided(plans: dict, key: tuple):
    """The launch plan ``keep`` stored in ``plans`` for a call signature ``key``, else None (also for
    a key of symbolic sizes, which has no hash)."""
    try:
        return plans.get(key)
    except TypeError:
        return None


def keep(plans: dict, key: tuple, plan):
    """``plan`` (what a launcher works out from its tile: grid, constants, the arguments after the
    tensors), stored for ``decided``; nothing made while tracing (its sizes may be symbolic)."""
    if _autograd.tracing():
        return plan
    if not any(table is plans for table in _plan_tables):
        _plan_tables.append(plans)
    try:
        if len(plans) >= LAUNCH_CONFIGS:
            plans.clear()
        plans[key] = plan
    except TypeError:
        pass
    return plan


def forget_plans() -> None:
    for table in _plan_tables:
        table.clear()


def forget() -> None:
    """Every chooser forgets its tiles and every launch plan goes (``vk.tune``, ``vk.load_tuning``)."""
    for chooser in TileChooser.instances:
        chooser._chosen.clear()
    forget_plans()


def decisions() -> list[dict]:
    """Every key a chooser holds a tile for (tuned, loaded or pinned), for ``vk.explain()``."""
    return [
        {"kernel": c.name, "key": key, "tile": choice.tile, "how": choice.how}
        for c in TileChooser.instances
        for key, choice in c.report().items()
    ]


def report_rows(kernel: str, chooser: TileChooser) -> list[dict]:
    """``chooser``'s choices as JSON-able rows: kernel, key, the tile, how, each candidate's trial."""
    return [
        {
            "kernel": kernel,
            "key": [str(p) if isinstance(p, (torch.dtype, torch.device)) else p for p in key],
            "chosen": repr(choice.tile),
            "how": choice.how,
            "candidates": {repr(tile): trial for tile, trial in choice.trials.items()},
        }
        for key, choice in chooser.report().items()
    ]
