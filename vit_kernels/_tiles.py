"""Which tile each Triton kernel launches: the op's table, or what ``vk.tune`` searched.

A kernel's launch configurations are a list per key (dtype, head dim, a size class, ...), ordered per
architecture: the first is the table's default, the tile measured fastest there (each table cites
its results file). A call launches the tile ``vk.tune`` searched or ``vk.load_tuning`` loaded for its
key, else the default; CPU tensors (the interpreter) a fixed small tile. An ordinary call checks and
times nothing: the GPU tests and ``vk.selftest()`` run every table entry against float64.

``vk.tune`` finds the keys a call meets (``keys_met``) and launches each candidate of one key
(``trying``) through the whole op, which it validates and times as it does the backends; keys first
met in those runs (a GEMM that one way of a choice launches) are searched after it.

A launcher keeps what it works out from a tile (grid, constants) per call signature in a plan table
(``decided`` / ``keep``): a warm call is one lookup. ``forget`` empties them when tiles change.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _autograd, _signature
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


@dataclass(frozen=True)
class Met:
    """A key a call's launches met with no tile chosen for it: what ``vk.tune`` searches."""

    chooser: "TileChooser"
    key: tuple
    device: torch.device
    candidates: tuple


# The tiles searched or loaded, by "<kernel> | <device name> | <key>": what ``vk.save_tuning`` writes.
TUNED: dict[str, dict] = {}
_met: list[Optional[list[Met]]] = [None]  # while ``keys_met`` runs: the keys met
_trying: dict[tuple, Tile] = {}  # (chooser, key) -> the tile ``trying`` launches
_plan_tables: list[dict] = []


def _as_tile(value):
    """A tile read back from JSON: lists become tuples again, nested (the attention pairs) too."""
    return tuple(_as_tile(v) for v in value) if isinstance(value, list) else value


class TileChooser:
    """The tiles of one launcher's kernels chosen by ``vk.tune``, loaded or pinned, per key."""

    instances: list["TileChooser"] = []

    def __init__(self, name: str):
        self.name = name
        self._chosen: dict[tuple, Choice] = {}
        TileChooser.instances.append(self)

    def chosen(self, key: tuple) -> Optional[Tile]:
        hit = self._chosen.get(key)
        return None if hit is None else hit.tile

    def pin(self, key: tuple, tile: Tile) -> None:
        """Launch ``tile`` for ``key`` from now on in this process."""
        self.keep(key, Choice(tile, "pinned", {}))

    def keep(self, key: tuple, choice: Choice, device: Optional[torch.device] = None) -> Tile:
        """Launch ``choice.tile`` for ``key`` from now on; a tuned one (on ``device``) is saved too."""
        self._chosen[key] = choice
        if choice.how == "tuned":
            trials = {repr(t): v for t, v in choice.trials.items()}
            TUNED[self._text(key, device)] = {"tile": choice.tile, "trials": trials}
        forget_plans()
        return choice.tile

    def report(self) -> dict[tuple, Choice]:
        return dict(self._chosen)

    def _text(self, key: tuple, device: torch.device) -> str:
        return f"{self.name} | {_signature.device_name(device)} | {key!r}"

    def _loaded(self, key: tuple, device: torch.device, candidates: Sequence[Tile]) -> Optional[Tile]:
        stored = TUNED.get(self._text(key, device))
        wanted = None if stored is None else _as_tile(stored["tile"])
        tile = next((c for c in candidates if c == wanted), None)  # the table's own (NamedTuple) tile
        if tile is None:  # a stored tile the table no longer lists is not launched
            return None
        return self.keep(key, Choice(tile, "loaded", stored.get("trials") or {}))


def tile_to_launch(
    chooser: TileChooser,
    device: torch.device,
    key: Callable[[], tuple],
    interpreter_tile: Callable[[], Tile],
    candidates: Callable[[], Sequence[Tile]],
) -> Tile:
    """The tile a launcher launches on tensors of ``device``: the interpreter's (CPU tensors), the
    one ``trying`` or ``chooser`` holds for ``key()``, a loaded one, else the table's default
    (``candidates()[0]``)."""
    if interpreted(device):
        return interpreter_tile()
    chosen_key = key()
    tile = _trying.get((chooser, chosen_key))
    if tile is None:
        tile = chooser.chosen(chosen_key)
    if tile is not None:
        return tile
    listed = tuple(candidates())
    loaded = chooser._loaded(chosen_key, device, listed)
    if loaded is not None:
        return loaded
    met = _met[0]
    if met is not None and len(listed) > 1 and all((m.chooser, m.key) != (chooser, chosen_key) for m in met):
        met.append(Met(chooser, chosen_key, device, listed))
    return listed[0]


def keys_met(run: Callable[[], object]) -> Iterator[Met]:
    """Each key ``run()``'s launches meet that has a choice to make and none made, then each key
    first met while the caller handles an earlier one (the GEMM that one way of a choice launches):
    a key is yielded once, and keys are gathered until the last one is handled (or the iterator is
    closed: callers hold it in ``contextlib.closing``)."""
    before, _met[0] = _met[0], []
    try:
        run()
        handled = 0
        while handled < len(_met[0]):
            yield _met[0][handled]
            handled += 1
    finally:
        _met[0] = before


@contextlib.contextmanager
def trying(met: Met, tile: Tile) -> Iterator[None]:
    """Inside the block, launches of ``met``'s key launch ``tile``."""
    _trying[(met.chooser, met.key)] = tile
    forget_plans()
    try:
        yield
    finally:
        del _trying[(met.chooser, met.key)]
        forget_plans()


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
