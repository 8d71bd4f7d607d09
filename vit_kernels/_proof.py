"""Candidate tiles proven in a child process before they run in the user's.

A launch configuration that compiles can still make an illegal memory access on real hardware, and
a CUDA fault leaves the process's context unusable: no ``try/except`` recovers it, so one bad
candidate would kill the user's first call. So before a tile chooser runs candidates it has not
proven on this GPU and software, each candidate's launches are recorded (not run) on the call's own
tensors and replayed in a child process, on fresh tensors of the same shapes, strides, dtypes,
16-byte alignment and storage sharing, filled with small finite values (the kernels' addresses do
not depend on data); a storage is allocated only as far as the views reach.
A candidate whose replay faults, raises or hangs there is excluded, with why; a child that dies
takes only the candidate it was running, and a fresh child goes on with the rest. Verdicts persist
beside the tile choices (keyed by the GPU's name and the software versions), so each candidate is
proven once per machine; the child's compiles fill Triton's cache that the parent then reuses. A
child imports the kernels, not the public API (``_env.PROOF_CHILD``): a second less per start.

``VIT_KERNELS_PROVE_TILES=0`` (read at import) or ``vk.set_autotune(prove_tiles=False)`` turns
proving off: candidates then run in the user's process directly.

A key's candidates are shared out among up to ``VIT_KERNELS_PROOF_CHILDREN`` children running at
once (default: half the CPU cores, at most 4; fewer where the GPU's free memory would not hold each
child's tensors and context): the children's compiles are most of a first call's cost, and each
compiles one candidate at a time.

The child (``CHILD``) reads the pickled launches from a file and writes one protocol line per step
to stdout (``PREFIX`` then ``ready``, ``start i``, ``ok i`` or ``raised i <why>``), and exits after
the first candidate that raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TextIO

import torch

from vit_kernels import _env, _signature, _triton
from vit_kernels._tune_cache import store

PREFIX = "vit_kernels-proof:"
STARTUP_SECONDS = 300  # for a child to import torch, triton and vit_kernels
SECONDS_PER_CANDIDATE = 120  # for one candidate's launches, compiling included
OK = "ok"
RECORDING_RAISED = "raised while recording its launches: "  # this process's own launcher refused it
CHILD = "from vit_kernels._proof import child_main; child_main()"


CHILD_CONTEXT_BYTES = 1 << 30  # a child's CUDA context and Triton's modules, besides its tensors


def _children_from_environment() -> int:
    text = os.environ.get("VIT_KERNELS_PROOF_CHILDREN", "").strip()
    if not text:
        return max(1, min(4, (os.cpu_count() or 1) // 2))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"VIT_KERNELS_PROOF_CHILDREN must be a positive integer, got {text!r}")
    return int(text)


_settings = {
    "enabled": _env.flag("VIT_KERNELS_PROVE_TILES", default=True),
    "children": _children_from_environment(),
}


def enabled() -> bool:
    return _settings["enabled"]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument: a view (shape, stride, dtype) of storage ``storage`` at byte ``start``."""

    storage: int
    shape: tuple
    stride: tuple
    start: int
    dtype: torch.dtype


@dataclass(frozen=True)
class DescriptorSpec:
    """A TMA descriptor argument: its base tensor and its other fields, as its class defines them."""

    cls: type
    base: TensorSpec
    fields: dict


@dataclass(frozen=True)
class LaunchSpec:
    kernel: tuple  # (module, name) of the @triton.jit function
    grid: tuple
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class ProofSpec:
    """What a child replays: the storages (index -> the byte span [first, end) the views reach, the
    first a multiple of 16 so that every view keeps its alignment) and each candidate's launches."""

    device: str
    storages: dict
    candidates: list  # [(repr(tile), [LaunchSpec, ...]), ...]


class _Describer:
    """Launch arguments as picklable specs; tensors sharing a storage share it in the replay too."""

    def __init__(self):
        self.storages: dict[object, int] = {}
        self.spans: dict[int, tuple[int, int]] = {}

    def tensor(self, t: torch.Tensor) -> TensorSpec:
        pointer = t.untyped_storage().data_ptr()
        identity = ("pointer", pointer) if pointer else ("tensor", id(t))  # meta storages have no address
        index = self.storages.setdefault(identity, len(self.storages))
        start = t.storage_offset() * t.element_size()
        end = start + _extent(t) * t.element_size()
        first, last = self.spans.get(index, (start, end))
        self.spans[index] = (min(first, start // 16 * 16), max(last, end))
        return TensorSpec(index, tuple(t.shape), tuple(t.stride()), start, t.dtype)

    def value(self, value):
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if _triton.TensorDescriptor is not None and isinstance(value, _triton.TensorDescriptor):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name != "base"}
            return DescriptorSpec(type(value), self.tensor(value.base), fields)
        if isinstance(value, (tuple, list)):
            return type(value)(self.value(v) for v in value)
        return value

    def launch(self, kernel, grid, args: tuple, kwargs: dict) -> LaunchSpec:
        function = getattr(kernel, "fn", kernel)
        grid = tuple(grid(kwargs) if callable(grid) else grid)
        return LaunchSpec(
            (function.__module__, function.__name__),
            grid,
            tuple(self.value(a) for a in args),
            {name: self.value(v) for name, v in kwargs.items()},
        )


def _extent(t: torch.Tensor) -> int:
    """Elements from a view's first to one past its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def all_empty(outputs) -> bool:
    """Whether a candidate's outputs are all empty (or absent): an empty problem, nothing to decide."""
    return bool(outputs) and all(o is None or o.numel() == 0 for o in outputs)


def verdicts(
    chooser: str,
    key: tuple,
    device: torch.device,
    candidates: Sequence,
    run: Callable[[object], Sequence[torch.Tensor]],
) -> dict:
    """tile -> None (ran cleanly in a child) or why it is excluded, for every candidate of
    ``chooser``'s ``key`` on ``device``; unproven candidates are proven now, in child processes.
    {} for an empty problem (nothing launches). Raises RuntimeError where no child can start."""
    device_name = _signature.device_name(device)
    keys = {tile: f"{chooser} | {device_name} | {key!r} | {tile!r}" for tile in candidates}
    found = {tile: _known(disk_key) for tile, disk_key in keys.items()}
    unproven = [tile for tile, verdict in found.items() if verdict is None]
    if unproven:
        recorded = _record(unproven, run)
        if recorded is None:
            return {}
        kept = {}
        for tile, verdict in _prove(device, recorded).items():
            found[tile] = verdict
            # this process's refusal (out of memory...) is not kept
            if not verdict.startswith(RECORDING_RAISED):
                kept[keys[tile]] = {"verdict": verdict}
        store().put_all("proofs", kept)
    return {tile: None if verdict == OK else verdict for tile, verdict in found.items()}


def _known(disk_key: str) -> Optional[str]:
    verdict = (store().get("proofs", disk_key) or {}).get("verdict")
    return verdict if isinstance(verdict, str) else None


def _record(tiles: Sequence, run) -> Optional[tuple[dict, dict]]:
    """(tile -> [LaunchSpec] or why recording raised, storage spans); None for an empty problem."""
    describer, recorded = _Describer(), {}
    for tile in tiles:
        try:
            with _triton.recorded_launches() as launches:
                outputs = run(tile)
            if all_empty(outputs):
                return None
            recorded[tile] = [describer.launch(*launch) for launch in launches]
        except Exception as error:  # the candidate's own launcher refuses it: excluded, as in-process
            recorded[tile] = RECORDING_RAISED + error_line(error)
    return recorded, describer.spans


def error_line(error: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _prove(device: torch.device, recorded: tuple[dict, dict]) -> dict:
    """tile -> OK or why not, replaying each tile's launches in child processes, the tiles shared out
    among ``_children`` of them running at once."""
    launches_of, spans = recorded
    verdicts = {tile: why for tile, why in launches_of.items() if isinstance(why, str)}
    remaining = [tile for tile in launches_of if tile not in verdicts]
    children = _children(device, len(remaining), spans)
    if children <= 1:
        return {**verdicts, **_prove_in_turn(device, launches_of, spans, remaining)}
    with ThreadPoolExecutor(children) as pool:  # each thread waits on its own child processes
        for found in pool.map(
            lambda share: _prove_in_turn(device, launches_of, spans, share),
            [remaining[i::children] for i in range(children)],
        ):
            verdicts.update(found)
    return verdicts


def _children(device: torch.device, candidates: int, spans: dict) -> int:
    """How many children prove ``candidates`` at once: the setting (1 wherever
    ``tools.cuda_sim.replay_in_this_process`` stands in for the child: it is not thread-safe), at
    most one per candidate, and on CUDA no more than the free memory holds (each child allocates the
    call's storages)."""
    children = min(_settings["children"], candidates)
    if device.type == "cuda" and children > 1:
        free, _ = torch.cuda.mem_get_info(device)
        need = sum(end - first for first, end in spans.values()) + CHILD_CONTEXT_BYTES
        children = min(children, free // need)
    return max(1, children)


def _prove_in_turn(device: torch.device, launches_of: dict, spans: dict, remaining: list) -> dict:
    """tile -> OK or why not for ``remaining``, replayed one after another in a child (a fresh child
    after each one that dies or raises)."""
    verdicts = {}
    while remaining:
        spec = ProofSpec(str(device), spans, [(repr(tile), launches_of[tile]) for tile in remaining])
        output, ending = run_child(pickle.dumps(spec))
        steps = [line[len(PREFIX) :].split(" ", 2) for line in output.splitlines() if line.startswith(PREFIX)]
        if not any(step[0] == "start" for step in steps):  # it could not import, or allocate the tensors
            raise RuntimeError(
                f"vit_kernels: the child process that proves tile candidates did not start "
                f"({ending}); set VIT_KERNELS_PROVE_TILES=0 to run candidates in this process"
            )
        started = None
        for step in steps:
            if step[0] == "start":
                started = int(step[1])
            elif step[0] == "ok":
                verdicts[remaining[int(step[1])]], started = OK, None
            elif step[0] == "raised":
                verdicts[remaining[int(step[1])]], started = f"raised in a child process: {step[2]}", None
        if started is not None:
            verdicts[remaining[started]] = f"faulted in a child process ({ending})"
        remaining = [tile for tile in remaining if tile not in verdicts]
    return verdicts


def _spawn(spec: bytes) -> tuple[str, str]:
    """Run the child on ``spec``: (its stdout, how it ended). It is killed when a step takes longer
    than its limit (``STARTUP_SECONDS`` to start, ``SECONDS_PER_CANDIDATE`` per candidate)."""
    with tempfile.TemporaryDirectory(prefix="vit_kernels-proof-") as folder:
        spec_path, stderr_path = os.path.join(folder, "spec.pkl"), os.path.join(folder, "stderr.txt")
        with open(spec_path, "wb") as out:
            out.write(spec)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env[_env.PROOF_CHILD] = "1"
        with open(stderr_path, "w+") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, spec_path],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )
            lines: queue.Queue = queue.Queue()
            reader = threading.Thread(target=_read_lines, args=(child.stdout, lines), daemon=True)
            reader.start()
            output, ending, limit = [], None, STARTUP_SECONDS
            while True:
                try:
                    line = lines.get(timeout=limit)
                except queue.Empty:
                    child.kill()
                    ending = f"no progress for {limit} s, killed"
                    break
                if line is None:
                    break
                output.append(line)
                if line.startswith(PREFIX):
                    limit = SECONDS_PER_CANDIDATE
            returncode = child.wait()
            reader.join(timeout=5)
            stderr.seek(0)
            tail = " | ".join(stderr.read().strip().splitlines()[-3:])
    ending = ending or _ending(returncode)
    return "".join(output), ending + (f"; stderr: {tail}" if tail else "")


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


run_child = _spawn  # the simulated CUDA device replays in its own process instead


def _ending(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _materialize(spec: ProofSpec) -> Callable:
    """The replay's arguments: each storage's span allocated, its views at their recorded places."""
    device = torch.device(spec.device)
    storages = {}
    for index, (first, end) in spec.storages.items():
        # bytes 0..63: every float dtype reads them as small finite values, integers as small ones
        storages[index] = torch.empty(
            -(-max(end - first, 1) // 16) * 16, dtype=torch.uint8, device=device
        ).random_(0, 64)

    def value(v):
        if isinstance(v, TensorSpec):
            first = spec.storages[v.storage][0]
            return (
                storages[v.storage]
                .view(v.dtype)
                .as_strided(v.shape, v.stride, (v.start - first) // v.dtype.itemsize)
            )
        if isinstance(v, DescriptorSpec):
            return v.cls(base=value(v.base), **v.fields)
        if isinstance(v, (tuple, list)):
            return type(v)(value(x) for x in v)
        return v

    return value


def replay(spec: ProofSpec, out: TextIO) -> int:
    """The child's work: each candidate's launches, then a device synchronisation; the exit status."""

    def say(*words) -> None:
        out.write(PREFIX + " ".join(str(w) for w in words) + "\n")
        out.flush()

    value = _materialize(spec)
    say("ready")
    for i, (_, launches) in enumerate(spec.candidates):
        say("start", i)
        try:
            for launch in launches:
                module, name = launch.kernel
                kernel = getattr(importlib.import_module(module), name)
                kernel[launch.grid](*value(launch.args), **{k: value(v) for k, v in launch.kwargs.items()})
            if launches and torch.device(spec.device).type == "cuda":  # a fault shows at the latest here
                torch.cuda.synchronize()
        except Exception as error:  # reported to the parent, which excludes the candidate
            why = error_line(error).replace("\n", " ")
            say("raised", i, why)
            return 3
        say("ok", i)
    return 0


def child_main() -> None:
    """The child process: ``python -c "...child_main()" SPEC``."""
    with open(sys.argv[1], "rb") as spec_file:
        sys.exit(replay(pickle.load(spec_file), sys.stdout))
