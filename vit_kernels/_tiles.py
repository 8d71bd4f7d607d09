"""Which tile each kernel launches: the op's table, checked once in process; searched on request.

A kernel's launch configurations (tiles, warps, stages) are a list per key (dtype, head dim,
length, ...), ordered per architecture: its first entry is the default, the tile measured fastest
on that architecture where one was (benchmarks/results/, cited beside each table), else the generic
entry. A configuration that compiles cleanly can still compute a wrong answer on real hardware (on
an H100 a 16-bit attention tile gave a wrong dK), so:

* **Checked once** (the default): the first eager call of a key on CUDA runs its table entry on
  the call's own inputs and compares the outputs (on a slice: a few images, or a few thousand
  rows) with the reference by the one accuracy rule (``vit_kernels._accuracy``). A wrong entry
  warns, naming the kernel, the tile and the error, and the next entry is checked in its place;
  no entry right raises (never a silent wrong answer). Verdicts persist on disk, keyed by the
  GPU's name, the software versions and the kernels' source, so an edited kernel is checked
  again. Nothing is timed and no child process starts.
* **Searched** (``vk.tune``, ``VIT_KERNELS_TUNE=1``, ``vk.set_autotune(True)``): every entry is
  proven in a child process (``vit_kernels._proof``: one that faults there never runs here), then
  checked, and the right ones are timed together by the one timer (``_timer``); the fastest is
  kept for the key, in memory and on disk (``vk.save_tuning`` writes it to a file to ship).

Nothing is run or timed while tracing (torch.compile, fake tensors) or capturing a CUDA graph: there
the key's tuned or checked tile is used, else the table's entry, unchecked. With the interpreter
(CPU tensors) the launcher runs its fixed small tile instead.

``TileChooser.report()`` lists per key the tile chosen and how (checked, tuned with each
candidate's time, or why an entry was excluded); ``report_rows`` makes that JSON-able.
``tile_to_launch`` is the whole decision a launcher makes for a call (interpreter, chosen tile);
``decided`` and ``keep`` hold what a launcher works out from that tile (its grid and constants) per
call signature, so that a decided call is one lookup.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import statistics
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _autograd, _env, _proof, _signature, _timer
from vit_kernels._accuracy import without_autocast
from vit_kernels._logging import LOGGER
from vit_kernels._triton import LAUNCH_CONFIGS, interpreted, recording
from vit_kernels._tune_cache import store

Tile = tuple  # a NamedTuple of one kernel's launch parameters, or a tuple of them (attention's pairs)


def plain_repr(tile: tuple) -> str:
    """A tile NamedTuple's ``__repr__``: the plain tuple, as reports, the caches and proofs key it."""
    return repr(tuple(tile))


@dataclass(frozen=True)
class Choice:
    tile: Tile
    how: str  # "checked", "tuned", "tuned (cache)" or "pinned"
    trials: dict  # tile -> milliseconds, "checked", or the reason it was excluded


# Searching happens only when asked: ``vk.tune``, or for ordinary calls this switch
# (``VIT_KERNELS_TUNE=1``, read at import; ``vk.set_autotune(True)``), which covers auto's backend
# choice too.
SEARCH = {"enabled": _env.flag("VIT_KERNELS_TUNE", default=False)}


def searching() -> bool:
    return SEARCH["enabled"]


@contextlib.contextmanager
def search(enabled: bool = True) -> Iterator[None]:
    """Inside the block, whether new keys are searched (``vk.tune``'s switch; process-wide)."""
    before, SEARCH["enabled"] = SEARCH["enabled"], enabled
    try:
        yield
    finally:
        SEARCH["enabled"] = before


def can_measure(device: torch.device) -> bool:
    """Whether candidates may be run and timed now: on CUDA, outside tracing and graph capture."""
    return device.type == "cuda" and not _autograd.tracing() and not _signature.capturing_cuda_graph()


# In the cache (``_tune_cache``): "tiles", the tile searched per key; "checks", each table entry's
# verdict, "right" or what was wrong.
RIGHT = "right"


def _as_tile(value):
    """A tile read back from JSON: lists become tuples again, nested (the attention pairs) too."""
    return tuple(_as_tile(v) for v in value) if isinstance(value, list) else value


def _raised(error: Exception) -> str:
    """What an entry that raised is excluded for: the exception's type and first line."""
    return f"raised {_proof.error_line(error)}"


class TileChooser:
    """The tile each key of one launcher launches: the table's first right entry (checked once) or
    the tile searched for it (tuned), in memory and on disk (keyed by the GPU's name and the software
    versions), so a second process checks and searches nothing again. ``kernels()`` returns the
    @triton.jit functions the launcher's tiles run: their source is part of each verdict's key."""

    instances: list["TileChooser"] = []  # every chooser, for forget_all and the reports
    # Counts every change of any chooser's choices (a choice made or read from disk, pinned,
    # forgotten): a launch plan made under another generation is stale (``decided``).
    generation = 0

    def __init__(self, name: str, kernels: Callable[[], Sequence] = tuple):
        self.name = name
        self._kernels = kernels
        self._source: Optional[str] = None
        self._chosen: dict[tuple, Choice] = {}
        self._unchecked: dict[tuple, Tile] = {}  # keys launched while nothing could run a check
        self._lock = threading.Lock()
        TileChooser.instances.append(self)

    def source(self) -> str:
        """A digest of the kernels' source (with the jit functions each calls, where Triton keys
        them): a verdict is kept per source, so an edited kernel is checked again."""
        if self._source is None:
            texts = [
                getattr(kernel, "cache_key", None) or inspect.getsource(getattr(kernel, "fn", kernel))
                for kernel in self._kernels()
            ]
            self._source = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
        return self._source

    def choose(
        self,
        key: tuple,
        device: torch.device,
        candidates: Sequence[Tile],
        run: Callable[[Tile], Sequence[torch.Tensor]],
        check: Callable[[Sequence[torch.Tensor]], Optional[str]],
    ) -> Tile:
        """The tile to launch for ``key``; ``candidates`` is the table's list, default first.
        ``run(tile)`` launches with ``tile`` on the call's inputs and returns its outputs (fresh
        tensors); ``check(outputs)`` returns None when they are right, else why not. Raises
        RuntimeError when no candidate is right (never a silent wrong answer)."""
        hit = self._chosen.get(key)
        if hit is not None:
            return hit.tile
        disk_key = f"{self.name} | {_signature.device_name(device)} | {key!r}"
        stored = store().get("tiles", disk_key)
        # the candidate equal to the stored tile (JSON keeps its values, not its NamedTuple type)
        stored_tile = None if stored is None else _as_tile(stored["tile"])
        cached = next((c for c in candidates if c == stored_tile), None)
        if cached is not None:
            return self._keep(key, Choice(cached, "tuned (cache)", stored.get("trials") or {})).tile
        if recording():  # an outer chooser's proof, see _proof
            return candidates[0]
        if not can_measure(device):  # tracing or capturing: the table's entry, checked later
            self._unchecked[key] = candidates[0]
            return candidates[0]
        with self._lock, without_autocast():
            hit = self._chosen.get(key)
            if hit is None:
                hit = (self._search if searching() else self._check)(key, device, candidates, run, check)
                if hit is None:  # an empty problem: nothing to check or time, nothing decided
                    return candidates[0]
                self._keep(key, hit)
                LOGGER.info("%s %s: %s tile %r", self.name, key, hit.how, hit.tile)
                if hit.how == "tuned":
                    store().put(
                        "tiles",
                        disk_key,
                        {"tile": hit.tile, "trials": {repr(t): v for t, v in hit.trials.items()}},
                    )
        return hit.tile

    def _check(self, key, device, candidates, run, check) -> Optional[Choice]:
        """The first entry of the table that computes the right answer on the call's inputs: each
        entry's verdict read from disk, or made now by one run and ``check``. A wrong entry warns and
        the next one is checked; none right raises."""
        trials: dict = {}
        device_name = _signature.device_name(device)
        for tile in candidates:
            verdict_key = f"{self.name} | {device_name} | {self.source()} | {key!r} | {tile!r}"
            verdict = (store().get("checks", verdict_key) or {}).get("verdict")
            if verdict is None:
                try:
                    outputs = run(tile)
                    if _proof.all_empty(outputs):
                        return None
                    problem = check(outputs)
                    verdict = RIGHT if problem is None else problem
                    store().put("checks", verdict_key, {"verdict": verdict})
                except Exception as error:  # this process's refusal (out of memory...): not kept
                    verdict = _raised(error)
            if verdict == RIGHT:
                trials[tile] = "checked"
                return Choice(tile, "checked", trials)
            trials[tile] = f"invalid: {verdict}"
            warnings.warn(
                f"vit_kernels: the {self.name} tile {tile!r} is wrong on {device_name} for {key}: {verdict}; "
                "the table's next entry is checked in its place",
                RuntimeWarning,
                stacklevel=2,
            )
        raise self._none_right(key, trials)

    def _search(self, key, device, candidates, run, check) -> Optional[Choice]:
        """Every candidate proven in a child (unless proving is off), checked, and the right ones
        timed together: the fastest."""
        proven = _proof.verdicts(self.name, key, device, candidates, run) if _proof.enabled() else {}
        trials: dict = {}
        for tile in candidates:
            if proven.get(tile) is not None:  # never run here: it faulted, raised or hung in a child
                trials[tile] = f"invalid: {proven[tile]}"
                continue
            try:
                outputs = run(tile)
                if _proof.all_empty(outputs):
                    return None
                problem = check(outputs)
            except Exception as error:  # a candidate that cannot run is excluded, not fatal
                problem = _raised(error)
            trials[tile] = None if problem is None else f"invalid: {problem}"
        valid = {tile: (lambda tile=tile: run(tile)) for tile, trial in trials.items() if trial is None}
        if not valid:
            raise self._none_right(key, trials)
        times = _timer.search_times(valid, device, warmup=1)  # after one untimed round; the median counts
        timed = {tile: statistics.median(samples) for tile, samples in times.items()}
        trials.update(timed)
        return Choice(min(timed, key=timed.get), "tuned", trials)

    def _none_right(self, key: tuple, trials: dict) -> RuntimeError:
        return RuntimeError(
            f"vit_kernels: no {self.name} tile computes the right answer on this GPU for {key}: {trials}"
        )

    def pin(self, key: tuple, tile: Tile) -> None:
        """Launch ``tile`` for ``key`` from now on in this process, unmeasured (tooling: the compile
        gate runs each candidate with the flags its trial leaves out, such as dropout)."""
        self._keep(key, Choice(tile, "pinned", {}))

    def _keep(self, key: tuple, choice: Choice) -> Choice:
        self._chosen[key] = choice
        TileChooser.generation += 1
        return choice

    def chosen(self, key: tuple) -> Optional[Tile]:
        hit = self._chosen.get(key)
        return None if hit is None else hit.tile

    def report(self) -> dict[tuple, Choice]:
        """Every key decided in this process: the tile chosen, how, and each candidate's trial."""
        return dict(self._chosen)

    def forget(self) -> None:
        self._chosen.clear()
        self._unchecked.clear()
        TileChooser.generation += 1

    @classmethod
    def forget_all(cls) -> None:
        """Every chooser forgets its choices (the disk keeps them)."""
        for chooser in cls.instances:
            chooser.forget()


def tile_to_launch(
    chooser: TileChooser,
    device: torch.device,
    key: Callable[[], tuple],
    interpreter_tile: Callable[[], Tile],
    candidates: Callable[[], Sequence[Tile]],
    trial: Callable[[], tuple[Callable, Callable]],
) -> Tile:
    """The tile a launcher launches on tensors of ``device``: the interpreter's fixed tile (CPU
    tensors), else the tile ``chooser`` keeps for ``key()``, choosing it first where there is none
    (``trial() -> (run, check)`` is built only then: a decided call does no more than the key's
    lookup)."""
    if interpreted(device):
        return interpreter_tile()
    chosen_key = key()
    tile = chooser.chosen(chosen_key)
    if tile is None:
        run, check = trial()
        tile = chooser.choose(chosen_key, device, candidates(), run, check)
    return tile


def decided(plans: dict, key: tuple):
    """The launch plan ``keep`` stored in ``plans`` for a call signature ``key``, if made under the
    current generation of tile choices (a choice made, pinned or forgotten since makes it stale),
    else None. A key of symbolic sizes (traced with dynamic shapes) has no hash: None."""
    try:
        hit = plans.get(key)
    except TypeError:
        return None
    return hit[1] if hit is not None and hit[0] == TileChooser.generation else None


def keep(plans: dict, key: tuple, plan, chooser: TileChooser, device: torch.device, chooser_key: Callable):
    """``plan`` (what a launcher works out from the tile ``tile_to_launch`` gave it: grid, constants,
    output shapes, the arguments after the tensors), stored for ``decided`` when its tile is settled:
    the interpreter's, or the one ``chooser`` keeps for ``chooser_key()``; not a default launched
    while nothing could be measured (graph capture), whose key chooses later. Nothing made while
    tracing is kept: its sizes and scalars may be symbolic (a SymFloat hashes). Cleared when full; a
    key without a hash is kept nowhere."""
    if _autograd.tracing():
        return plan
    if interpreted(device) or chooser.chosen(chooser_key()) is not None:
        try:
            if len(plans) >= LAUNCH_CONFIGS:
                plans.clear()
            plans[key] = (TileChooser.generation, plan)
        except TypeError:
            pass
    return plan


def _plain(part):
    return str(part) if isinstance(part, (torch.dtype, torch.device)) else part


def decisions() -> list[dict]:
    """Every key of every chooser decided or launched in this process, for ``vk.explain()``: the
    chooser, the key, the tile and how it was chosen ("checked", "tuned", "tuned (cache)",
    "pinned", or "table, unchecked" where it ran only while traced or captured)."""
    rows = []
    for chooser in TileChooser.instances:
        for key, choice in chooser.report().items():
            rows.append({"kernel": chooser.name, "key": key, "tile": choice.tile, "how": choice.how})
        for key, tile in chooser._unchecked.items():
            if key not in chooser._chosen:
                rows.append({"kernel": chooser.name, "key": key, "tile": tile, "how": "table, unchecked"})
    return rows


def report_rows(kernel: str, chooser: TileChooser) -> list[dict]:
    """``chooser``'s choices as JSON-able rows: kernel, key (dtypes and devices as text), the tile
    chosen, how (checked, tuned, ...) and each candidate's trial: its time in ms, "checked", or why
    it was excluded."""
    return [
        {
            "kernel": kernel,
            "key": [_plain(part) for part in key],
            "chosen": repr(choice.tile),
            "how": choice.how,
            "candidates": {repr(tile): trial for tile, trial in choice.trials.items()},
        }
        for key, choice in chooser.report().items()
    ]
