"""Which implementation of each op runs: ``auto | triton | extension | torch`` (docs/dispatch.md).

Each op declares its table at the end of ``vit_kernels/ops/<op>.py`` (``implementations(...)``): per
backend the function, its support by device and dtype, its shape limits and where it is the default
(eager, and inside a torch.compile graph). ``auto`` runs what ``vk.tune`` decided for the call's
signature (``TUNED``), else the table's choice: an ordinary call times, checks and writes nothing.
``use_backend`` (context-local) and ``set_backend`` (process-wide, initially ``VIT_KERNELS_BACKEND``)
ask for a backend; a call it cannot take falls back to ``auto`` with one warning, or raises under
``strict=True``. ``_decide`` is the only place that chooses or falls back; ``call`` is the ops' entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from vit_kernels import _signature, _tiles
from vit_kernels._checks import autocast_dtype_of
from vit_kernels._triton import HAS_TRITON

BACKENDS = ("triton", "extension", "torch")  # the order candidates are listed and tried in
CHOICES = ("auto",) + BACKENDS
OPS = ("patch_embed", "attention", "linear_gelu", "linear", "mlp", "layer_norm", "swiglu", "swiglu_mlp")

# Read once: whether Triton kernels may run on CPU tensors (a test tool auto never picks).
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# ``supports(device, dtype)`` / ``limits(*args)``: None when the implementation can take it, else why
# not. ``preferred(device, dtype, grad)``: whether it is the table's default there.
SupportCheck = Callable[[torch.device, torch.dtype], Optional[str]]
LimitCheck = Callable[..., Optional[str]]
Preference = Callable[[torch.device, torch.dtype, bool], bool]


class CannotRunError(RuntimeError):
    """Raised under ``strict=True`` when the backend asked for cannot take a call (naming why)."""


@dataclass(frozen=True)
class Impl:
    """One row of an op's table: ``fn``, its support check, shape limits and the table's defaults."""

    fn: Callable
    supports: SupportCheck = lambda device, dtype: None
    limits: LimitCheck = lambda *args: None
    preferred: Preference = lambda device, dtype, grad: False
    # the default inside a torch.compile graph, where Inductor fuses the reference's ops with their
    # neighbours: only where the implementation was measured ahead of torch.compile
    compiled: Preference = lambda device, dtype, grad: False
    op: str = ""
    backend: str = ""


_registry: dict[str, dict[str, Impl]] = {op: {} for op in OPS}
validation_args: dict[str, Callable[[tuple], tuple]] = {}  # a call made deterministic (dropout off)
# ``parts(i, actual, pytorch, exact) -> [(name, actual, pytorch, exact), ...]``: result ``i`` judged in
# named parts (attention's dqkv as dq, dk and dv), each on its siblings' scale.
validation_parts: dict[str, Callable[..., list]] = {}
_backend_checks: dict[str, Callable[[], Optional[str]]] = {}
# The backends ``vk.tune`` searched per signature (``_Call.signature``): what ``vk.save_tuning`` writes.
TUNED: dict[str, dict] = {}
# Set by ``vk.tune`` while it runs: ``search(call, capable) -> entry`` validates and times the capable.
searcher: Optional[Callable[["_Call", list[str]], dict]] = None


def register(op: str, backend: str, fn: Callable, **checks: Callable) -> None:
    """Register ``fn`` as the ``backend`` implementation of ``op`` (another name: an extra candidate)."""
    if op not in _registry:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not isinstance(backend, str) or not backend.isidentifier() or backend == "auto":
        raise ValueError(f"backend must be one of {BACKENDS} or another identifier, got {backend!r}")
    _registry[op][backend] = Impl(fn, **checks, op=op, backend=backend)
    _fast.clear()


def unregister(op: str, backend: str) -> None:
    """Remove the ``backend`` implementation of ``op`` (for test-only implementations)."""
    _registry[op].pop(backend, None)
    _fast.clear()


def implementations(
    op: str,
    *,
    validation: Optional[Callable[[tuple], tuple]] = None,
    parts: Optional[Callable[..., list]] = None,
    **table: Impl,
) -> None:
    """Declare the table of ``op``: ``implementations("layer_norm", torch=Impl(...), triton=Impl(...))``."""
    if "torch" not in table:
        raise ValueError(f"the table of {op} must name its torch reference")
    for name, impl in table.items():
        if not isinstance(impl, Impl):
            raise TypeError(f"implementations({op!r}, {name}=...) must be an Impl, got {type(impl).__name__}")
        checks = {k: getattr(impl, k) for k in ("supports", "limits", "preferred", "compiled")}
        register(op, name, impl.fn, **checks)
    if validation is not None:
        validation_args[op] = validation
    if parts is not None:
        validation_parts[op] = parts


def register_backend_check(backend: str, check: Callable[[], Optional[str]]) -> None:
    """Register a whole-backend check: returns None when usable on this machine, else the reason."""
    _backend_checks[backend] = check


# ---- capability ------------------------------------------------------------------------------------


def triton_unavailable_reason() -> Optional[str]:
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not TRITON_INTERPRET:
        return "no CUDA device, and TRITON_INTERPRET=1 is not set for running Triton on the CPU"
    return None


def triton_device_reason(device: torch.device) -> Optional[str]:
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if device.type == "cpu" and not TRITON_INTERPRET:
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    return None if device.type in ("cuda", "cpu") else f"Triton kernels do not run on {device.type} tensors"


def triton_supports_elementwise(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    reason = triton_device_reason(device)
    if reason is None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"the Triton kernels take float32, float16 or bfloat16, not {dtype}"
    return reason


def triton_supports_dot(device: torch.device, dtype: torch.dtype) -> Optional[str]:
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
    """For each backend and op: ``True`` when it can run on this machine, else the reason why not."""
    report: dict[str, dict[str, object]] = {}
    for b in BACKENDS:
        machine = backend_unavailable_reason(b) or True
        report[b] = {op: machine if b in _registry[op] else "not implemented by this backend" for op in OPS}
    return report


def unsupported_reason(
    op: str, backend: str, device: torch.device, dtype: torch.dtype, args: Optional[Sequence[Any]] = None
) -> Optional[str]:
    """None when ``backend`` can run ``op`` on ``device`` in ``dtype`` (and ``args``' shapes), else why not."""
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
    """One (backend name, strict) pair, interned (``_choice``): identity is equality, cheap to hash."""

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
    """The choice in force when it last changed, where Dynamo guards on it (it cannot read a
    ContextVar): a compiled graph is traced again when the choice changes."""

    choice: _Choice = _process_choice


_trace_guard = _TraceGuard()


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
    """Prefer ``name`` for every op it implements, process-wide (``"auto"``: the tables). Raises for an
    unknown name, or (with the reason) one that cannot run here."""
    global _process_choice
    _process_choice = _check_choice(name, strict)
    if _context_choice.get() is not None:
        _context_choice.set(_process_choice)
    _trace_guard.choice = _active()


@contextlib.contextmanager
def use_backend(name: str, *, strict: bool = False) -> Iterator[None]:
    """``with use_backend("torch"): ...``: the choice for this thread / task only. A call ``name``
    cannot take falls back to ``auto`` with one warning, or raises CannotRunError with ``strict``."""
    token = _context_choice.set(_check_choice(name, strict))
    _trace_guard.choice = _active()
    try:
        yield
    finally:
        _context_choice.reset(token)
        _trace_guard.choice = _active()


def apply_environment() -> None:
    name = os.environ.get("VIT_KERNELS_BACKEND", "auto").strip() or "auto"
    if name not in CHOICES:
        raise ValueError(f"VIT_KERNELS_BACKEND must be one of {CHOICES}, got {name!r}")
    set_backend(name)


# ---- explain ---------------------------------------------------------------------------------------


@dataclass
class Record:
    """One signature as ``explain`` shows it; ``candidates``: backend -> its time, or why not."""

    op: str
    device: str
    dtype: str
    shapes: str
    grad: bool
    requested: str
    backend: str
    source: str  # "table", "tuned", "requested", "fallback", "only candidate"; "(traced)" appended
    reason: str
    candidates: dict[str, str] = field(default_factory=dict)
    calls: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__, candidates=dict(self.candidates))


class Explanation(list):
    """``vk.explain()``: the records (a list), printable; ``tiles`` lists the tuned or loaded tiles."""

    def __init__(self, rows: Sequence[Record], tiles: Optional[list[dict]] = None):
        super().__init__(rows)
        self.tiles = tiles or []

    @property
    def rows(self) -> list[Record]:
        return list(self)

    def as_dicts(self) -> list[dict]:
        return [r.as_dict() for r in self]

    def ran(self, op: Optional[str] = None) -> set[str]:
        """The backends that ran (for ``op``, or for any op)."""
        return {r.backend for r in self if op is None or r.op == op}

    def __str__(self) -> str:
        lines = [] if self else ["vit_kernels.explain(): no op has run yet"]
        for r in self:
            candidates = "; ".join(f"{b}: {v}" for b, v in r.candidates.items())
            grad = "grad" if r.grad else "no grad"
            lines.append(f"{r.op} {r.device} {r.dtype[6:]} {r.shapes} {grad}: {r.backend} ({r.source})")
            lines.append(f"    why: {r.reason} ({r.calls} calls, asked: {r.requested}); {candidates}")
        lines += [f"tile {t['kernel']}, {t['key']}: {t['tile']!r} ({t['how']})" for t in self.tiles]
        return "\n".join(lines)

    __repr__ = __str__


_journal: dict[tuple, Record] = {}
_warned: set[tuple] = set()
_lock = threading.RLock()


def explain() -> Explanation:
    """Every op signature run in this process: what ran and why; the tiles tuned or loaded."""
    with _lock:
        return Explanation([Record(**r.as_dict()) for r in _journal.values()], _tiles.decisions())


def clear_decisions() -> None:
    """Forget what ``explain`` shows, the warnings given and the fast path's entries."""
    with _lock:
        _fast.clear()
        _journal.clear()
        _warned.clear()


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=6)


# ---- the decision ----------------------------------------------------------------------------------


@dataclass
class _Call:
    """What a decision is made from (the arguments themselves outside tracing)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    arg_key: tuple
    grad: bool
    limits: dict  # backend -> the shape limit the call exceeds
    args: Optional[Sequence[Any]] = None  # None while tracing
    traced: bool = False

    def prefix(self) -> str:
        return f"{self.op}|{_signature.device_name(self.device)}|{str(self.dtype)[6:]}|grad={self.grad}|"

    def signature(self) -> str:
        return self.prefix() + repr(self.arg_key)

    def record(self, requested: str, backend: str, source: str, reason: str, candidates: dict) -> Record:
        shapes = _signature.describe_arguments(self.arg_key)
        device, dtype = _signature.device_name(self.device), str(self.dtype)
        return Record(
            self.op, device, dtype, shapes, self.grad, requested, backend, source, reason, candidates
        )


def _capability(call: _Call, backend: str) -> Optional[str]:
    return unsupported_reason(call.op, backend, call.device, call.dtype) or call.limits.get(backend)


def _limits(op: str, args: Sequence[Any]) -> dict[str, str]:
    if not args:  # resolve(op, device, dtype) without the call: device and dtype decide alone
        return {}
    return {b: reason for b, impl in _registry[op].items() if (reason := impl.limits(*args)) is not None}


def _tuned(call: _Call) -> Optional[dict]:
    """``vk.tune``'s decision; while tracing (no sizes), the one its signatures of the op agree on."""
    if call.args is not None:
        return TUNED.get(call.signature())
    entries = [e for k, e in TUNED.items() if k.startswith(call.prefix())]
    return entries[0] if entries and len({e["backend"] for e in entries}) == 1 else None


def _auto(call: _Call, requested: str, exclude: Optional[str]) -> tuple[Impl, Record]:
    impls = _registry[call.op]
    capable, excluded = [], {}
    for b in [b for b in impls if b != "torch"] + ["torch"]:
        reason = "asked for, but cannot take this call" if b == exclude else _capability(call, b)
        if reason is None and b == "triton" and call.device.type == "cpu":
            reason = "interpreted Triton (TRITON_INTERPRET=1) is a test tool, never auto's choice"
        if reason is None:
            capable.append(b)
        else:
            excluded[b] = f"excluded: {reason}"
    if capable == ["torch"]:
        reason = "no other implementation can take this call"
        return impls["torch"], call.record(requested, "torch", "only candidate", reason, excluded)
    entry = _tuned(call)
    if (
        entry is None
        and searcher is not None
        and call.args is not None
        and not _signature.untimeable(call.args)
    ):
        entry = TUNED[call.signature()] = searcher(call, capable)
    if entry is not None and entry["backend"] in capable:
        candidates = {**entry["candidates"], **excluded}
        return impls[entry["backend"]], call.record(
            requested, entry["backend"], "tuned", entry["reason"], candidates
        )
    chosen = next(
        (
            b
            for b in capable
            if b != "torch"
            and (impls[b].compiled if call.traced else impls[b].preferred)(call.device, call.dtype, call.grad)
        ),
        "torch",
    )
    why = "the op's table under torch.compile" if call.traced else "the op's table"
    return impls[chosen], call.record(requested, chosen, "table", why, excluded)


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
        why = f"use_backend / set_backend asked for {choice.name}"
        return impls[choice.name], call.record(choice.name, choice.name, "requested", why, {})
    where = f"{call.op} on {call.device.type} {call.dtype}"
    if choice.strict:
        shapes = _signature.describe_arguments(call.arg_key)
        raise CannotRunError(f"backend {choice.name!r} cannot run {where} {shapes}: {reason} (strict=True)")
    impl, record = _auto(call, choice.name, choice.name)
    _warn_once(
        (call.op, choice.name, reason),
        f"vit_kernels: backend {choice.name!r} cannot run {where}: {reason}; {impl.backend} runs it "
        "instead (use_backend(..., strict=True) raises instead)",
    )
    record.source, record.reason = (
        "fallback",
        f"{choice.name} cannot take this call: {reason}; {record.reason}",
    )
    return impl, record


@torch.compiler.assume_constant_result
def _traced_backend(op, device_type, device_index, dtype, arg_key, grad, limits, choice_name, choice_strict):
    """The decision while torch.compile traces, once, outside the graph, reading no size (none is
    specialised). ``choice_*`` from ``_trace_guard``: passed in, Dynamo guards the graph on them."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    call = _Call(op, device, dtype, arg_key, grad, dict(limits), traced=True)
    with _lock:
        impl, record = _decide(call, _choice(choice_name, choice_strict))
        record.source += " (traced)"
        _journal.setdefault(
            (record.requested, op, str(device), dtype, arg_key, grad, "traced"), record
        ).calls += 1
    return impl.backend


def resolve(op: str, device: torch.device, dtype: torch.dtype, args: Optional[Sequence[Any]] = None) -> Impl:
    """The implementation of ``op`` for a main input on ``device`` in ``dtype``; ``args`` (as the
    implementation takes them) let shape limits apply. Recorded for ``explain``."""
    if op not in _registry:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    args = () if args is None else args
    grad = _signature.needs_grad(args)
    if torch.compiler.is_compiling():
        index = -1 if device.index is None else device.index
        choice = _trace_guard.choice
        key, limits = _signature.traced_key(args), tuple(sorted(_limits(op, args).items()))
        name = _traced_backend(op, device.type, index, dtype, key, grad, limits, choice.name, choice.strict)
        return _registry[op][name]
    return _resolve(op, device, dtype, args, grad)[0]


def _resolve(op, device, dtype, args, grad) -> tuple[Impl, Record]:
    choice = _active()
    arg_key = _signature.argument_key(args, dtype)
    with _lock:
        impl, record = _decide(
            _Call(op, device, dtype, arg_key, grad, _limits(op, args), args or None), choice
        )
        key = (choice.name, op, str(device), dtype, arg_key, grad)
        old = _journal.get(key)
        if old is not None and (old.backend, old.source, old.reason) == (
            record.backend,
            record.source,
            record.reason,
        ):
            record = old
        elif old is not None:
            record.calls = old.calls
        _journal[key] = record
        record.calls += 1
    return impl, record


# ---- the per-call fast path ------------------------------------------------------------------------

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Whether autocast is on for any device: one C call (the main input's device is asked only then).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_PLAIN = _signature._PLAIN
_fast: dict[tuple, tuple[Impl, Record, Optional[tuple]]] = {}
FAST_PATH_ENTRIES = 4096  # cleared when full (many shapes), refilled as calls come


# The key read in C++ (csrc/fast_path_key.cpp), set when the extension loads: the same facts, packed,
# in a fraction of the loop's time (side by side on the CPU, docs/benchmarks.md#host-cost-per-call:
# without it a warm call read up to 9.4 us above PyTorch's own, with it at most 4.6).
_native_key: Optional[Callable[..., Any]] = None


def use_native_call_key(native: Optional[Callable[..., Any]]) -> None:
    """Read the fast path's key with ``native`` (None: in Python); the two kinds of key never meet."""
    global _native_key
    _native_key = native


def _call_key(op: str, args: Sequence[Any]) -> Optional[tuple]:
    """What validation, autocast's casts and the decision depend on, read cheaply: the op, the choice,
    grad mode, autocast, each tensor's shape, dtype, device, requires_grad and contiguity (and type,
    for a subclass), plain values by type and value; None for any other argument type."""
    if _native_key is not None:
        key = _native_key(args, torch.nn.Parameter, op, _context_choice, _process_choice)
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
        else:
            return None
    return tuple(parts)


def _cast_plan(raw: Sequence[Any], prepared: Sequence[Any]) -> Optional[tuple]:
    """How ``prepare`` turned ``raw`` into ``prepared``: None (unchanged), per-argument dtypes to cast
    to, or ``False`` for anything else (a value normalised), which the fast path cannot replay."""
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
    """Run public op ``op`` on ``args``. ``prepare(*args) -> args`` validates them and applies
    autocast's casts (the first is the main input). A later call with the same ``_call_key`` goes
    straight to the decided implementation; while torch.compile traces, every call is prepared."""
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
    prepared = prepare(*args)
    main = prepared[0]
    impl, record = _resolve(op, main.device, main.dtype, prepared, _signature.needs_grad(prepared))
    plan = _cast_plan(args, prepared) if key is not None else False
    if plan is not False:
        if len(_fast) >= FAST_PATH_ENTRIES:
            _fast.clear()
        _fast[key] = (impl, record, plan)
    return impl.fn(*prepared)
