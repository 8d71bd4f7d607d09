"""Tile choice on the user's GPU: every candidate validated against a reference, then timed.

A kernel's launch configurations (tiles, warps, stages) are a candidate list, not a guess frozen in
code: a configuration that compiles cleanly can still compute a wrong answer on real hardware (on
an H100 a 16-bit attention tile gave a wrong dK), and the fastest one differs between GPUs. The
first time a launcher meets a key (dtype, head dim, length, ...) on CUDA, each candidate is first
proven in a child process (``vit_kernels._proof``: one that faults there is excluded and never runs
here), then run on the call's own inputs; those whose outputs pass the launcher's check (at most
twice PyTorch's own error in the same dtype, against a float32 reference) are timed together by
the one timer (``_timer``) and the fastest is kept for that key, in memory and on disk. Nothing is
run or timed while tracing (torch.compile, fake tensors) or capturing a CUDA graph: there the key's
choice made earlier is used, else the first candidate (the default). With the interpreter (CPU
tensors) the launcher runs its fixed small tile instead.

``TileChooser.report()`` lists per key every candidate's time or why it was excluded;
``report_rows`` makes that JSON-able. ``tile_to_launch`` is the whole decision a launcher makes for
a call (interpreter, chosen tile); ``decided`` and ``keep`` hold what a launcher works out from
that tile (its grid and constants) per call signature, so that a decided call is one lookup.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _autograd, _proof, _signature, _timer
from vit_kernels._triton import LAUNCH_CONFIGS, interpreted, recording
from vit_kernels._tune_cache import DiskCache, default_folder

Tile = tuple  # a NamedTuple of one kernel's launch parameters, or a tuple of them (attention's pairs)


def plain_repr(tile: tuple) -> str:
    """A tile NamedTuple's ``__repr__``: the plain tuple, as reports, the caches and proofs key it."""
    return repr(tuple(tile))


@dataclass(frozen=True)
class Choice:
    tile: Tile
    trials: dict  # tile -> milliseconds, or the reason it was excluded


def relative_error(actual: torch.Tensor, reference: torch.Tensor, scale: float = 0.0) -> float:
    """max |actual - reference| / max(max |reference|, ``scale``, tiny), in float64 (inf where NaN
    appears; 0 for empty tensors)."""
    if reference.numel() == 0:
        return 0.0
    difference = (actual.double() - reference.double()).abs()
    if difference.isnan().any():
        return math.inf
    return difference.max().item() / max(reference.double().abs().max().item(), scale, 1e-30)


# A part's error is measured against at least this share of the largest reference among the parts
# checked together: a part that is zero in exact arithmetic (attention's dQ and dK at length 1, a
# width-1 LayerNorm's input gradient) is then judged by the scale of its siblings instead of by its
# own rounding residue of 1e-17, against which PyTorch's own answer and an exact zero both fail.
SIBLING_SCALE = 1e-3


def sibling_scale(references: Sequence[Optional[torch.Tensor]]) -> float:
    """SIBLING_SCALE x the largest max |reference| among ``references`` (None and empty ones left
    out): the least scale each of them is measured against; 0 where any is not finite."""
    largest = max(
        (float(r.double().abs().max()) for r in references if r is not None and r.numel()), default=0.0
    )
    return SIBLING_SCALE * largest if math.isfinite(largest) else 0.0


# The rule: a result is right when its error is at most ERROR_RATIO x PyTorch's own in the same dtype
# (or below the dtype's floor, FLOORS below).
ERROR_RATIO = 2.0


def first_problem(
    parts: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], floor: float
) -> Optional[str]:
    """None when every ``(name, actual, pytorch, reference)`` part is right, else the first failure:
    ``actual``'s error against ``reference`` at most twice ``pytorch``'s (the same computation by
    PyTorch in the same dtype) or below ``floor``, both relative to max(max |reference|,
    SIBLING_SCALE x the largest max |reference| of the parts)."""
    parts = list(parts)
    scale = sibling_scale([reference for *_, reference in parts])
    for name, actual, pytorch, reference in parts:
        error, own = relative_error(actual, reference, scale), relative_error(pytorch, reference, scale)
        if error > max(ERROR_RATIO * own, floor):
            return f"{name}: relative error {error:.2e} > {ERROR_RATIO:g} x PyTorch's {own:.2e} (floor {floor:.0e})"
    return None


def check_against(
    names: Sequence[str],
    references: Callable[[], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    dtype: torch.dtype,
    parts_of: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] = list,
) -> Callable[[Sequence[torch.Tensor]], Optional[str]]:
    """A check for the TileChooser, by ``first_problem``'s rule with ``dtype``'s floor: the named
    parts of a candidate's outputs (``parts_of(outputs)``: all of them by default) against
    ``references() -> (exact, PyTorch's own in the same dtype)``, made once, at the first check."""
    made: list = []

    def check(outputs: Sequence[torch.Tensor]) -> Optional[str]:
        if not made:
            made.extend(references())
        exact, own = made
        return first_problem(list(zip(names, parts_of(outputs), own, exact, strict=True)), FLOORS[dtype])

    return check


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a candidate's exact reference is computed in: float64 for float32 (and float64)
    inputs, float32 for 16-bit ones."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


# The rule's floor per dtype: a relative error (of the largest reference magnitude) below which any
# result passes, so that results PyTorch happens to get (nearly) exact do not fail every candidate.
# In units of the dtype's eps (2^-10 float16, 2^-7 bfloat16, 2^-23 float32, 2^-52 float64):
# - float16 and bfloat16, one unit (9.8e-4, 7.8e-3): an output rounded once to the dtype passes, and
#   the H100's wrong dK (off by 1.3e-2 to 8.4e-2 where PyTorch's own error was 5e-4 in float16 and
#   4e-3 in bfloat16, benchmarks/results/h100-2026-11-22.md) fails;
# - float32, four units (4.8e-7): PyTorch's own error is itself one or two units (cuBLAS, SDPA), and
#   another summation order as exact differs by as much (an H200 measured the Triton GEMMs and
#   attention at 1.3 to 4.5 units, PyTorch at 0.5 to 2);
# - float64, 4096 units (9.1e-13): the same exact sums in other orders.
# One table for the tile choosers, auto, the selftest, the benchmarks and the GPU tests
# (tests/helpers.error_bound).
FLOOR_ULPS = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 4, torch.float64: 4096}
FLOORS = {dtype: units * torch.finfo(dtype).eps for dtype, units in FLOOR_ULPS.items()}


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off on every device type: validation compares against a float64 / float32 reference
    that autocast would otherwise compute in 16 bits (then PyTorch's own error reads 0 and the rule
    proves nothing), and candidates run as the kernels' launchers call them."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield


def can_measure(device: torch.device) -> bool:
    """Whether candidates may be run and timed now: on CUDA, outside tracing and graph capture."""
    return device.type == "cuda" and not _autograd.tracing() and not _signature.capturing_cuda_graph()


# Valid candidates are timed by ``_timer.time_runs`` after one untimed round, each run from an idle
# device, in interleaved rounds until TIMED_ROUNDS or TIMING_BUDGET_S seconds; the median counts.
TIMED_ROUNDS, TIMING_BUDGET_S = 25, 0.3

_disk = DiskCache(default_folder(), "tiles")


def set_cache_folder(folder) -> None:
    """Where tile choices persist (``vk.set_autotune(cache_dir=...)``; None: memory only)."""
    global _disk
    _disk = DiskCache(folder, "tiles")
    _proof.set_cache_folder(folder)


def _as_tile(value):
    """A tile read back from JSON: lists become tuples again, nested (the attention pairs) too."""
    return tuple(_as_tile(v) for v in value) if isinstance(value, list) else value


class TileChooser:
    """The chosen tile per key of one launcher: in memory, and on disk beside ``auto``'s decisions
    (keyed by the GPU's name and the software versions), so a second process measures nothing again."""

    instances: list["TileChooser"] = []  # every chooser, for forget_all and the reports
    # Counts every change of any chooser's choices (a choice made or read from disk, pinned,
    # forgotten): a launch plan made under another generation is stale (``decided``).
    generation = 0

    def __init__(self, name: str):
        self.name = name
        self._chosen: dict[tuple, Choice] = {}
        self._lock = threading.Lock()
        TileChooser.instances.append(self)

    def choose(
        self,
        key: tuple,
        device: torch.device,
        candidates: Sequence[Tile],
        run: Callable[[Tile], Sequence[torch.Tensor]],
        check: Callable[[Sequence[torch.Tensor]], Optional[str]],
    ) -> Tile:
        """The tile to launch for ``key``. ``run(tile)`` launches with ``tile`` on the call's inputs and
        returns its outputs (fresh tensors); ``check(outputs)`` returns None when they are right,
        else why not. Raises RuntimeError when no candidate is right (never a silent wrong answer)."""
        hit = self._chosen.get(key)
        if hit is not None:
            return hit.tile
        disk_key = None if _disk.path is None else f"{self.name} | {_signature.device_name(device)} | {key!r}"
        stored = None if disk_key is None else _disk.get(disk_key)
        # the candidate equal to the stored tile (JSON keeps its values, not its NamedTuple type)
        stored_tile = None if stored is None else _as_tile(stored["tile"])
        cached = next((c for c in candidates if c == stored_tile), None)
        if cached is not None:
            return self._keep(key, Choice(cached, {"from the tile cache": stored.get("trials")})).tile
        if not can_measure(device) or recording():  # recording: an outer chooser's proof, see _proof
            return candidates[0]
        with self._lock, without_autocast():
            hit = self._chosen.get(key)
            if hit is None:
                hit = self._measure(key, device, candidates, run, check)
                if hit is None:  # an empty problem: nothing to validate or time, nothing decided
                    return candidates[0]
                self._keep(key, hit)
                if disk_key is not None:
                    _disk.put(
                        disk_key, {"tile": hit.tile, "trials": {repr(t): v for t, v in hit.trials.items()}}
                    )
        return hit.tile

    def _measure(self, key, device, candidates, run, check) -> Optional[Choice]:
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
                problem = f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            trials[tile] = None if problem is None else f"invalid: {problem}"
        valid = {tile: (lambda tile=tile: run(tile)) for tile, trial in trials.items() if trial is None}
        if not valid:
            raise RuntimeError(
                f"vit_kernels: no {self.name} tile computes the right answer on this GPU for {key}: {trials}"
            )
        times = _timer.time_runs(valid, device, rounds=TIMED_ROUNDS, budget_s=TIMING_BUDGET_S, warmup=1)
        timed = {tile: statistics.median(samples) for tile, samples in times.items()}
        trials.update(timed)
        return Choice(min(timed, key=timed.get), trials)

    def pin(self, key: tuple, tile: Tile) -> None:
        """Launch ``tile`` for ``key`` from now on in this process, unmeasured (tooling: the compile
        gate runs each candidate with the flags its trial leaves out, such as dropout)."""
        self._keep(key, Choice(tile, {"pinned": tile}))

    def _keep(self, key: tuple, choice: Choice) -> Choice:
        self._chosen[key] = choice
        TileChooser.generation += 1
        return choice

    def chosen(self, key: tuple) -> Optional[Tile]:
        hit = self._chosen.get(key)
        return None if hit is None else hit.tile

    def report(self) -> dict[tuple, Choice]:
        """Every key measured in this process: the tile chosen and each candidate's trial."""
        return dict(self._chosen)

    def forget(self) -> None:
        self._chosen.clear()
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


def report_rows(kernel: str, chooser: TileChooser) -> list[dict]:
    """``chooser``'s choices as JSON-able rows: kernel, key (dtypes and devices as text), the tile
    chosen and each candidate's time in ms or why it was excluded."""
    return [
        {
            "kernel": kernel,
            "key": [_plain(part) for part in key],
            "chosen": repr(choice.tile),
            "candidates": {repr(tile): trial for tile, trial in choice.trials.items()},
        }
        for key, choice in chooser.report().items()
    ]
