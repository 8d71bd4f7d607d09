"""Which implementation of each op runs: ``auto | triton | extension | torch`` (docs/dispatch.md).

Every op declares its implementations in one table at the end of ``vit_kernels/ops/<op>.py``
(``implementations(op, torch=Impl(...), triton=Impl(...), ...)``): per backend the function, a
support check by device and dtype, limits by shape, and where it is the table's default (eager,
and inside a torch.compile graph), each default citing the measurement it rests on. ``torch`` is
the pure-PyTorch reference and the fallback; ``triton`` runs CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` (a test tool ``auto`` never picks); ``extension`` is ``vit_kernels._C``.

``auto`` runs the table's choice: a first call compiles what it runs and checks each kernel's tile
once (``_tiles``); nothing is timed and no child process starts. Searching happens only when asked
(``vk.tune``, ``VIT_KERNELS_TUNE=1`` / ``set_autotune(True)``): then a new signature (``_signature``)
has every capable implementation validated and timed on clones of its inputs (``_measure``), and
the fastest valid one that beats the reference by the margin is kept, in memory and on disk
(``_tune_cache``), where later processes find it. While tracing, the tuned decision or the table
decides; nothing is timed.

``use_backend`` (context-local, a ``ContextVar``) and ``set_backend`` (process-wide, initially
``VIT_KERNELS_BACKEND``) choose a backend; a call it cannot take falls back to ``auto`` with one
warning and a record in ``explain()``, or raises under ``strict=True``. ``resolve`` is the only
place that chooses or falls back; ``call`` is the public ops' entry, with its per-call fast path.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from vit_kernels import _measure, _proof, _signature, _tiles, _tune_cache
from vit_kernels._triton import HAS_TRITON
from vit_kernels._checks import autocast_dtype_of
from vit_kernels._explain import Explanation, Journal, Record
from vit_kernels._logging import LOGGER
from vit_kernels._tune_cache import store

BACKENDS = ("triton", "extension", "torch")  # the order candidates are listed and tried in
CHOICES = ("auto",) + BACKENDS
OPS = ("patch_embed", "attention", "linear_gelu", "linear", "mlp", "layer_norm", "swiglu", "swiglu_mlp")

# Read once, at import: the interpreter flag decides whether Triton kernels may run on CPU tensors.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# ``supports(device, dtype)`` returns None when the implementation can run there, else the reason.
SupportCheck = Callable[[torch.device, torch.dtype], Optional[str]]
# ``limits(*args)`` (the op's call arguments) returns None when the shapes are within the
# implementation's limits, else which limit they exceed.
LimitCheck = Callable[..., Optional[str]]
# ``preferred(device, dtype, grad)``: whether the implementation is the table's default there (for a
# call that will need gradients, or not).
Preference = Callable[[torch.device, torch.dtype, bool], bool]


class CannotRunError(RuntimeError):
    """Raised under ``strict=True`` when the backend asked for cannot take a call (the message names
    the op, the shapes and the capability or limit)."""


@dataclass(frozen=True)
class Impl:
    """One row of an op's table: ``fn`` and its support check, shape limits and static preference;
    registered, it also names its ``op`` and ``backend``."""

    fn: Callable
    supports: SupportCheck = lambda device, dtype: None
    limits: LimitCheck = lambda *args: None
    preferred: Preference = lambda device, dtype, grad: False
    # the table's default inside a torch.compile graph, where Inductor fuses the reference's ops with
    # their neighbours: only where the implementation was measured ahead of torch.compile
    compiled: Preference = lambda device, dtype, grad: False
    op: str = ""
    backend: str = ""


_registry: dict[str, dict[str, Impl]] = {op: {} for op in OPS}
_validation_args: dict[str, Callable[[tuple], tuple]] = {}
_backend_checks: dict[str, Callable[[], Optional[str]]] = {}


def register(op: str, backend: str, fn: Callable, **checks: Callable) -> None:
    """Register ``fn`` as the ``backend`` implementation of ``op`` (a name outside BACKENDS registers
    an extra candidate, e.g. a test-only implementation)."""
    if op not in _registry:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not isinstance(backend, str) or not backend.isidentifier() or backend == "auto":
        raise ValueError(f"backend must be one of {BACKENDS} or another identifier, got {backend!r}")
    _registry[op][backend] = Impl(fn, **checks, op=op, backend=backend)
    _forget_choices()


def unregister(op: str, backend: str) -> None:
    """Remove the ``backend`` implementation of ``op`` (for test-only implementations)."""
    _registry[op].pop(backend, None)
    _forget_choices()


def implementations(
    op: str, *, validation_args: Optional[Callable[[tuple], tuple]] = None, **table: Impl
) -> None:
    """Declare the table of ``op``: ``implementations("layer_norm", torch=Impl(...), triton=Impl(...))``.

    ``validation_args(args) -> args`` makes a call deterministic for validation (e.g. dropout off)."""
    if "torch" not in table:
        raise ValueError(f"the table of {op} must name its torch reference")
    for name, impl in table.items():
        if not isinstance(impl, Impl):
            raise TypeError(f"implementations({op!r}, {name}=...) must be an Impl, got {type(impl).__name__}")
        register(
            op,
            name,
            impl.fn,
            supports=impl.supports,
            preferred=impl.preferred,
            compiled=impl.compiled,
            limits=impl.limits,
        )
    if validation_args is not None:
        _validation_args[op] = validation_args


def register_backend_check(backend: str, check: Callable[[], Optional[str]]) -> None:
    """Register a whole-backend check: returns None when usable on this machine, else the reason."""
    _backend_checks[backend] = check


# ---- capability ------------------------------------------------------------------------------------


def triton_unavailable_reason() -> Optional[str]:
    """Why the Triton backend cannot run on this machine, or None when it can."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not TRITON_INTERPRET:
        return "no CUDA device, and TRITON_INTERPRET=1 is not set for running Triton on the CPU"
    return None


def triton_device_reason(device: torch.device) -> Optional[str]:
    """Why Triton kernels cannot run on tensors of ``device``, or None when they can."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if device.type == "cpu" and not TRITON_INTERPRET:
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    return None if device.type in ("cuda", "cpu") else f"Triton kernels do not run on {device.type} tensors"


def triton_supports_elementwise(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for Triton kernels without tl.dot: float32, float16, bfloat16 on CUDA or the interpreter."""
    reason = triton_device_reason(device)
    if reason is None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"the Triton kernels take float32, float16 or bfloat16, not {dtype}"
    return reason


def triton_supports_dot(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Support check for Triton kernels built on tl.dot, which the interpreter gets wrong in bfloat16."""
    reason = triton_supports_elementwise(device, dtype)
    if reason is None and dtype == torch.bfloat16 and device.type == "cpu":
        reason = "the Triton interpreter computes bfloat16 tl.dot wrongly; bfloat16 runs on CUDA only"
    return reason


register_backend_check("triton", triton_unavailable_reason)
register_backend_check("torch", lambda: None)


def backend_unavailable_reason(backend: str) -> Optional[str]:
    """Why ``backend`` cannot be used on this machine at all, or None when it can."""
    if backend not in BACKENDS and not any(backend in impls for impls in _registry.values()):
        raise ValueError(f"backend must be one of {CHOICES}, got {backend!r}")
    check = _backend_checks.get(backend)
    if check is None:
        return None if backend not in BACKENDS else f"the {backend} backend is not installed"
    return check()


def available_backends() -> dict[str, dict[str, object]]:
    """For each backend and op: ``True`` when it can run here, else the reason why not.

    Example: ``{"triton": {"attention": "triton is not installed ...", ...}, "torch": {...}}``.
    A backend's per-op entry only says whether it can run on this machine at all; whether it
    supports a given device, dtype and shape is decided per call (see ``explain``).
    """
    report: dict[str, dict[str, object]] = {}
    for b in BACKENDS:
        machine = backend_unavailable_reason(b) or True
        report[b] = {op: machine if b in _registry[op] else "not implemented by this backend" for op in OPS}
    return report


def unsupported_reason(
    op: str, backend: str, device: torch.device, dtype: torch.dtype, args: Optional[Sequence[Any]] = None
) -> Optional[str]:
    """None when ``backend`` implements ``op`` and can run it on ``device`` in ``dtype`` (and, given
    the call's ``args``, within its shape limits), else why not."""
    impl = _registry[op].get(backend)
    if impl is None:
        return f"{backend} does not implement {op}"
    reason = backend_unavailable_reason(backend) or impl.supports(device, dtype)
    if reason is None and args is not None:
        reason = impl.limits(*args)
    return reason


# ---- the context-local choice ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Choice:
    """One (backend name, strict) pair; interned (``_choice``), so identity is equality and hashing
    one in a per-call key costs nothing."""

    name: str
    strict: bool


_choices: dict[tuple[str, bool], _Choice] = {}


def _choice(name: str, strict: bool) -> _Choice:
    return _choices.setdefault((name, strict), _Choice(name, strict))


_process_choice = _choice("auto", False)
_context_choice: contextvars.ContextVar[Optional[_Choice]] = contextvars.ContextVar(
    "vit_kernels_backend", default=None
)


def _active() -> _Choice:
    choice = _context_choice.get()
    return _process_choice if choice is None else choice


class _TraceGuard:
    """What a torch.compile'd graph was traced under, in plain attributes that Dynamo guards on
    (it cannot read a ContextVar): the choice in force when it last changed (``use_backend`` entered
    or left, ``set_backend``) and the generation of the decisions, counting their every change (a
    measurement, the cache cleared, an implementation registered, the settings). A compiled graph
    is reused only while both are what they were at its trace; otherwise it is traced again, and
    decides again. The per-call fast path (``call``) keeps no entry decided under an older
    generation.
    Being one object, it follows the most recent change in any thread: compiled code run in threads
    with different ``use_backend`` choices at once recompiles (or, if it is already cached for the
    other choice, runs it): give each thread its own compiled module, or use ``set_backend``."""

    def __init__(self):
        self.choice: _Choice = _process_choice
        self.generation = 0


_trace_guard = _TraceGuard()


def _choice_changed() -> None:
    _trace_guard.choice = _active()


def _decisions_changed() -> None:
    """Decisions may have changed: graphs traced before retrace, fast-path entries decided before
    are not kept."""
    _trace_guard.generation += 1


def _check_choice(name: str, strict: bool) -> _Choice:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {CHOICES}, got {type(name).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if name != "auto":
        reason = backend_unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
    return _choice(name, strict)


def get_backend() -> str:
    """The choice in force in this thread / task: ``"auto"`` or a backend name."""
    return _active().name


def set_backend(name: str, *, strict: bool = False) -> None:
    """Prefer ``name`` for every op it implements, process-wide (``"auto"`` restores the automatic
    choice); a ``use_backend`` block in force in this context takes the new choice too, until it ends.

    Raises ValueError for an unknown name and RuntimeError, with the reason, for a backend that is
    not installed or cannot run on this machine. ``strict``: see ``use_backend``.
    """
    global _process_choice
    _process_choice = _check_choice(name, strict)
    if _context_choice.get() is not None:
        _context_choice.set(_process_choice)
    _choice_changed()


@contextlib.contextmanager
def use_backend(name: str, *, strict: bool = False) -> Iterator[None]:
    """``with use_backend("torch"): ...``: the choice for this thread / task only, restored on exit.

    With ``strict=True`` a call that ``name`` cannot take (device, dtype or a shape limit) raises
    RuntimeError naming the op and the limit; without it, the call falls back to ``auto``'s choice,
    which ``explain()`` records and one warning reports.
    """
    token = _context_choice.set(_check_choice(name, strict))
    _choice_changed()
    try:
        yield
    finally:
        _context_choice.reset(token)
        _choice_changed()


def apply_environment() -> None:
    """Take the initial preference from ``VIT_KERNELS_BACKEND`` (called once, after registration)."""
    name = os.environ.get("VIT_KERNELS_BACKEND", "auto").strip() or "auto"
    if name not in CHOICES:
        raise ValueError(f"VIT_KERNELS_BACKEND must be one of {CHOICES}, got {name!r}")
    set_backend(name)


# ---- autotune settings and state -------------------------------------------------------------------


@dataclass
class _Settings:
    margin: float = 0.05  # a candidate must be at least 5% faster than the reference to be chosen


_settings = _Settings()
_memo: dict[tuple, tuple[Impl, Record]] = {}  # per-call fast path
_fast: dict[tuple, tuple[Impl, Record, Optional[tuple]]] = {}  # see ``call``
FAST_PATH_ENTRIES = 4096  # the fast path's memory: cleared when full (many shapes), refilled as calls come
_journal = Journal()
_warned: set[tuple] = set()
_lock = threading.RLock()
_measuring = threading.local()


def _forget_choices() -> None:
    with _lock:
        _memo.clear()
        _fast.clear()
        _decisions_changed()


def set_autotune(
    enabled: Optional[bool] = None,
    *,
    margin: Optional[float] = None,
    cache_dir: Union[str, os.PathLike, bool, None] = None,
    prove_tiles: Optional[bool] = None,
) -> None:
    """Configure searching (each argument left None is unchanged).

    enabled: search every new signature's backends and every new key's tiles on ordinary calls
    (False, the default: the tables decide, and tuned decisions where there are; the initial value
    is ``VIT_KERNELS_TUNE``, read at import; ``vk.tune`` searches either way). margin: how much faster than the reference
    (0.05 = 5%) a kernel must be to be chosen. cache_dir: the folder of the on-disk cache, or False
    to keep decisions in memory only. prove_tiles: run each new tile candidate in a child process
    first, so that one that faults cannot take this process down (``vit_kernels._proof``; the
    initial value is ``VIT_KERNELS_PROVE_TILES``, default on).
    """
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        _tiles.SEARCH["enabled"] = enabled
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10:
            raise ValueError(f"margin must be a number in [0, 10), got {margin!r}")
        _settings.margin = float(margin)
    if cache_dir is not None:
        if cache_dir is True or not isinstance(cache_dir, (str, os.PathLike, bool)):
            raise TypeError(f"cache_dir must be a path or False, got {cache_dir!r}")
        _tune_cache.set_folder(None if cache_dir is False else Path(cache_dir).expanduser())
    if prove_tiles is not None:
        if not isinstance(prove_tiles, bool):
            raise TypeError(f"prove_tiles must be a bool, got {type(prove_tiles).__name__}")
        _proof._settings["enabled"] = prove_tiles
    _forget_choices()


def autotune_settings() -> dict[str, object]:
    """The measuring settings in force: ``{"enabled", "margin", "cache_file", "prove_tiles"}``."""
    return {
        "enabled": _tiles.searching(),
        "margin": _settings.margin,
        "cache_file": None if store().path is None else str(store().path),
        "prove_tiles": _proof.enabled(),
    }


def clear_decisions() -> None:
    """Forget the decisions measured in this process (and, by default, what ``explain`` shows);
    the on-disk cache is read again on next use."""
    with _lock:
        _forget_choices()
        _warned.clear()
        store().clear()
        _journal.clear()


def explain() -> Explanation:
    """Every op signature run in this process: what ran, why (the table, tuned, measured, a
    fallback), the measured times; then each Triton kernel's tiles, checked, tuned or unchecked."""
    return _journal.snapshot(_tiles.decisions())


# ---- resolve ---------------------------------------------------------------------------------------


def _warn_once(key: tuple, message: str, stacklevel: int) -> None:
    """Warn once per ``key``; ``stacklevel`` counts from here to the caller of the public op."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _candidate_order(op: str) -> list[str]:
    impls = _registry[op]
    return (
        [b for b in BACKENDS if b in impls and b != "torch"]
        + [b for b in impls if b not in BACKENDS]
        + ["torch"]
    )


@dataclass
class _Call:
    """What a decision is made from: the op, where it runs, its arguments' key, and (outside
    tracing) the arguments themselves."""

    op: str
    device: torch.device
    dtype: torch.dtype
    arg_key: tuple
    grad: bool
    limit_reasons: dict[str, str]
    args: Optional[Sequence[Any]] = None
    traced: bool = False  # inside a torch.compile graph

    def signature(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.op}|{_signature.device_name(self.device)}|{dtype}|grad={self.grad}|{self.arg_key!r}"

    def prefix(self) -> str:
        """The signature up to the arguments: op, device, dtype and grad mode."""
        return self.signature()[: -len(repr(self.arg_key))]

    def record(self, requested: str, backend: str, source: str, reason: str, candidates: dict) -> Record:
        return Record(
            self.op,
            _signature.device_name(self.device),
            str(self.dtype),
            _signature.describe_arguments(self.arg_key),
            self.grad,
            requested,
            backend,
            source,
            reason,
            candidates,
        )


def _capability(call: _Call, backend: str) -> Optional[str]:
    return unsupported_reason(call.op, backend, call.device, call.dtype) or call.limit_reasons.get(backend)


def _describe(entry: dict) -> dict[str, str]:
    return {b: v if isinstance(v, str) else f"{v:.3f} ms" for b, v in entry["candidates"].items()}


def _auto(call: _Call, requested: str, exclude: Optional[str]) -> tuple[Impl, Record]:
    impls = _registry[call.op]
    capable: list[str] = []
    excluded: dict[str, str] = {}
    for b in _candidate_order(call.op):
        reason = "asked for, but cannot take this call" if b == exclude else _capability(call, b)
        if reason is None and b == "triton" and call.device.type == "cpu":
            reason = "interpreted Triton (TRITON_INTERPRET=1) is a test tool, never a candidate for auto on the CPU"
        if reason is None:
            capable.append(b)
        else:
            excluded[b] = f"excluded: {reason}"
    if capable == ["torch"]:
        return impls["torch"], call.record(
            requested, "torch", "only candidate", "no other implementation can take this call", excluded
        )
    key = call.signature()
    entry = store().get("dispatch", key)
    if entry is None and call.args is None:
        entry = _unanimous(call.prefix())
    if entry is not None and entry["backend"] in capable:
        return impls[entry["backend"]], call.record(
            requested, entry["backend"], "tuned", entry["reason"], {**_describe(entry), **excluded}
        )
    measurable = call.args is not None and not _signature.untimeable(call.args)
    if not (_tiles.searching() and measurable) or getattr(_measuring, "active", False):
        chosen = next(
            (
                b
                for b in capable
                if b != "torch"
                and (impls[b].compiled if call.traced else impls[b].preferred)(
                    call.device, call.dtype, call.grad
                )
            ),
            "torch",
        )
        if call.traced:
            why = "the op's table under torch.compile (elsewhere Inductor fuses the reference's ops)"
        elif not _tiles.searching():
            why = "the op's table (vk.tune, or VIT_KERNELS_TUNE=1, searches)"
        else:
            why = "nothing is timed for fake, meta or captured tensors: the op's table"
        candidates = {b: "not measured" for b in capable}
        return impls[chosen], call.record(requested, chosen, "table", why, {**candidates, **excluded})
    entry = _measure_call(call, capable)
    LOGGER.info("%s: %s (%s)", key, entry["backend"], entry["reason"])
    store().put("dispatch", key, entry)
    _decisions_changed()
    return impls[entry["backend"]], call.record(
        requested, entry["backend"], "measured", entry["reason"], {**_describe(entry), **excluded}
    )


def _unanimous(prefix: str) -> Optional[dict]:
    """Under tracing, where sizes are not read: the measured decision for the op, device, dtype and
    grad mode when every cached signature of them chose the same backend (as after ``vk.tune`` at the
    shapes being compiled), else None (the table decides)."""
    entries = [e for k, e in store().items("dispatch") if k.startswith(prefix)]
    if entries and len({e["backend"] for e in entries}) == 1:
        entry = dict(entries[0])
        entry["reason"] = (
            f"the {len(entries)} measured signature(s) of this op, device, dtype agree: {entry['reason']}"
        )
        return entry
    return None


def _measure_call(call: _Call, capable: list[str]) -> dict:
    impls = _registry[call.op]
    validation = _validation_args.get(call.op, lambda args: args)(tuple(call.args))
    _measuring.active = True
    started = time.perf_counter()
    try:
        results = _measure.measure(
            {b: impls[b].fn for b in capable}, call.args, validation, call.device, call.dtype, call.grad
        )
    finally:
        _measuring.active = False
    cost_ms = (time.perf_counter() - started) * 1e3
    for b, result in results.items():
        if not result.valid and b != "torch":
            _warn_once(
                (call.op, b, call.signature()),
                f"vit_kernels: the {b} implementation of {call.op} failed validation on "
                f"{_signature.device_name(call.device)} {call.dtype} "
                f"{_signature.describe_arguments(call.arg_key)}: {result.error}; auto does not use it there",
                8,
            )
    reference = results["torch"].time_ms
    valid = {b: r.time_ms for b, r in results.items() if r.valid and r.time_ms is not None}
    margin = _settings.margin
    # A candidate must beat the reference by the margin on the ranking statistic and on the median,
    # so that a burst of load during some rounds cannot make the choice.
    ref_median = results["torch"].median_ms
    winners = {
        b: t
        for b, t in valid.items()
        if b != "torch"
        and (
            reference is None
            or (t * (1 + margin) <= reference and results[b].median_ms * (1 + margin) <= ref_median)
        )
    }
    chosen = min(winners, key=winners.get) if winners else "torch"
    if chosen == "torch":
        reason = f"no valid candidate beat the reference by the {margin:.0%} margin"
    else:
        reason = (
            f"fastest valid, {reference / valid[chosen]:.2f}x the reference (margin {margin:.0%})"
            if reference
            else "fastest valid"
        )
    candidates: dict[str, object] = {
        b: (r.time_ms if r.valid else f"invalid: {r.error}") for b, r in results.items()
    }
    return {
        "backend": chosen,
        "reason": f"measured in {cost_ms:.0f} ms: {reason}",
        "candidates": candidates,
        "margin": margin,
        "cost_ms": cost_ms,
    }


def _decide(call: _Call, choice: _Choice) -> tuple[Impl, Record]:
    impls = _registry[call.op]
    if choice.name == "auto":
        return _auto(call, "auto", None)
    if choice.name not in impls:
        if choice.strict:
            raise CannotRunError(f"backend {choice.name!r} does not implement {call.op} (strict=True)")
        impl, record = _auto(call, choice.name, None)
        record.reason = f"{choice.name} does not implement {call.op}; auto: {record.reason}"
        return impl, record
    reason = _capability(call, choice.name)
    if reason is None:
        return impls[choice.name], call.record(
            choice.name, choice.name, "requested", f"use_backend / set_backend asked for {choice.name}", {}
        )
    if choice.strict:
        raise CannotRunError(
            f"backend {choice.name!r} cannot run {call.op} on {call.device.type} {call.dtype} "
            f"{_signature.describe_arguments(call.arg_key)}: {reason} (strict=True)"
        )
    impl, record = _auto(call, choice.name, choice.name)
    _warn_once(
        (call.op, choice.name, reason),
        f"vit_kernels: backend {choice.name!r} cannot run {call.op} on {call.device.type} {call.dtype}: "
        f"{reason}; {impl.backend} runs it instead (use_backend(..., strict=True) raises instead)",
        6,
    )
    record.source = "fallback"
    record.reason = f"{choice.name} cannot take this call: {reason}; {record.reason}"
    return impl, record


def _limit_reasons(op: str, args: Sequence[Any]) -> dict[str, str]:
    if not args:  # resolve(op, device, dtype) without the call: device and dtype decide alone
        return {}
    return {b: reason for b, impl in _registry[op].items() if (reason := impl.limits(*args)) is not None}


@torch.compiler.assume_constant_result
def _traced_backend(
    op, device_type, device_index, dtype, arg_key, grad, limits, choice_name, choice_strict, generation
):
    """The decision while torch.compile traces (called once per trace, outside the graph, without
    reading sizes so that none is specialised): the tuned decision or the table's, never a
    measurement. ``choice_*`` and ``generation`` come from ``_trace_guard``: passed in, they make
    Dynamo guard the compiled graph on them."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    call = _Call(op, device, dtype, arg_key, grad, dict(limits), traced=True)
    with _lock:
        impl, record = _decide(call, _choice(choice_name, choice_strict))
        record.source += " (traced)"
        _journal.add((record.requested, op, str(device), dtype, arg_key, grad, "traced"), record).calls += 1
    return impl.backend


def resolve(op: str, device: torch.device, dtype: torch.dtype, args: Optional[Sequence[Any]] = None) -> Impl:
    """The implementation of ``op`` that runs for a main input on ``device`` with ``dtype``; ``args``
    (the call's arguments, as the implementation takes them) let shape limits and measuring apply.

    This is the only place that chooses or falls back; every decision is recorded for ``explain``."""
    return _resolve(op, device, dtype, args)[0]


def _resolve(
    op: str, device: torch.device, dtype: torch.dtype, args: Optional[Sequence[Any]]
) -> tuple[Impl, Optional[Record]]:
    """``resolve``, and the decision's record when the decision may be reused for the same
    signature (None while tracing, or for the table's choice taken for untimeable tensors)."""
    if op not in _registry:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    args = () if args is None else args
    if torch.compiler.is_compiling():
        index = -1 if device.index is None else device.index
        key, grad = _signature.traced_key(args), _signature.needs_grad(args)
        limits = tuple(sorted(_limit_reasons(op, args).items()))
        guard = (_trace_guard.choice.name, _trace_guard.choice.strict, _trace_guard.generation)
        name = _traced_backend(op, device.type, index, dtype, key, grad, limits, *guard)
        return _registry[op][name], None
    choice = _active()
    arg_key = _signature.argument_key(args, dtype)
    grad = _signature.needs_grad(args)
    memo_key = (choice, op, device, dtype, arg_key, grad)
    hit = _memo.get(memo_key)
    if hit is not None:
        hit[1].calls += 1
        return hit
    with _lock:
        call = _Call(op, device, dtype, arg_key, grad, _limit_reasons(op, args), args or None)
        impl, record = _decide(call, choice)
        record = _journal.add((choice.name, op, str(device), dtype, arg_key, grad), record)
        record.calls += 1
        if record.source != "table" or not _signature.untimeable(args):
            _memo[memo_key] = (impl, record)
            return impl, record
    return impl, None


# ---- the per-call fast path ------------------------------------------------------------------------

_PARAMETER = torch.nn.Parameter
_TENSOR_TYPES = (torch.Tensor, _PARAMETER)
# Whether autocast is on for any device: one C call, where reading the main input's device and its
# autocast state costs about a microsecond (asked per device only when some autocast is on).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_PLAIN = _signature._PLAIN


# The key read in C++ (csrc/fast_path_key.cpp), set when the extension loads (``use_native_call_key``):
# the same facts as the Python loop below, packed, in a fraction of its time: the loop's five
# attribute reads per tensor, and the three calls that read the choice, grad mode and autocast, are
# most of a warm call's cost.
_native_key: Optional[Callable[..., Any]] = None


def use_native_call_key(native: Optional[Callable[..., Any]]) -> None:
    """Read the fast path's key with ``native`` (the extension's ``fast_path_key``; None: in Python). The
    entries stored under the other kind of key stay valid: the two kinds never meet."""
    global _native_key
    _native_key = native


def _call_key(op: str, args: Sequence[Any]) -> Optional[tuple]:
    """Everything a public op's validation, autocast casts and backend decision depend on, read
    cheaply: the op, the choice in force, grad mode, autocast for the main input's device, and each
    argument (a plain tensor or parameter: its shape, dtype, device, requires_grad and contiguity
    (part of a decision's signature); another tensor type: the same and its type; None, bool, int,
    float or str: its type and value). None when the main input is not a plain tensor or another
    argument is of any other type (validation will say what was expected). ``_native_key`` reads it
    where it can (plain tensors and parameters only): its keys end in a bytes object, which no key of
    the Python loop holds, so the two never meet."""
    if _native_key is not None:
        key = _native_key(args, _PARAMETER, op, _context_choice, _process_choice)
        if key is not NotImplemented:
            return key
    first = args[0]
    if type(first) not in _TENSOR_TYPES:
        return None
    autocast = autocast_dtype_of(first.device.type) if _any_autocast() else None
    parts: list = [op, _context_choice.get() or _process_choice, _grad_enabled(), autocast]
    append = parts.append
    for a in args:
        kind = type(a)
        if kind in _TENSOR_TYPES:
            append((a.shape, a.dtype, a.device, a.requires_grad, a.is_contiguous()))
        elif kind in _PLAIN:  # its type, then its value (a type is never a value here: unambiguous)
            append(kind)
            append(a)
        elif isinstance(a, torch.Tensor):
            append((a.shape, a.dtype, a.device, a.requires_grad, a.is_contiguous(), kind))
        else:  # a list, an array, ...: validation will say what was expected
            return None
    return tuple(parts)


def _cast_plan(raw: Sequence[Any], prepared: Sequence[Any]) -> Optional[tuple]:
    """How ``prepare`` turned ``raw`` into ``prepared``, replayable without validating again: None
    (unchanged), a tuple of per-argument dtypes to cast to (None: unchanged), or ``False`` when it
    did anything else (a value normalised, a tensor replaced), which the fast path cannot replay."""
    plan, changed = [], False
    for r, p in zip(raw, prepared):
        if p is r:
            plan.append(None)
        elif (
            isinstance(r, torch.Tensor)
            and isinstance(p, torch.Tensor)
            and p.shape == r.shape
            and p.dtype != r.dtype
        ):
            plan.append(p.dtype)
            changed = True
        else:
            return False
    return tuple(plan) if changed else None


def call(op: str, args: tuple, prepare: Callable[..., tuple]) -> Any:
    """Run public op ``op`` on ``args`` (its arguments in order, keywords included).

    ``prepare(*args) -> args`` validates the arguments (raising a clear error) and applies autocast's
    casts; the first of them is the main input, whose device and dtype the decision is made for. The first call of a signature prepares, resolves and runs; later calls
    with the same ``_call_key`` skip straight to the decided implementation, replaying autocast's
    casts: a dictionary lookup and a few attribute reads per call instead of validation and the
    signature of ``resolve`` (what was valid for those shapes, dtypes, devices and values stays
    valid). While torch.compile traces, every call takes the full path (Dynamo guards what it reads)."""
    if _is_compiling():
        prepared = prepare(*args)
        return resolve(op, prepared[0].device, prepared[0].dtype, prepared).fn(*prepared)
    key = _call_key(op, args)
    hit = _fast.get(key) if key is not None else None
    if hit is not None:
        impl, record, plan = hit
        record.calls += 1
        if plan is not None:
            args = tuple(a if dtype is None else a.to(dtype) for a, dtype in zip(args, plan))
        return impl.fn(*args)
    generation = _trace_guard.generation
    prepared = prepare(*args)
    impl, record = _resolve(op, prepared[0].device, prepared[0].dtype, prepared)
    if record is not None and key is not None:
        plan = _cast_plan(args, prepared)
        with _lock:
            if plan is not False and generation == _trace_guard.generation:
                if len(_fast) >= FAST_PATH_ENTRIES:
                    _fast.clear()
                _fast[key] = (impl, record, plan)
    return impl.fn(*prepared)
