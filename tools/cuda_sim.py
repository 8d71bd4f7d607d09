"""A simulated CUDA device: the host code a GPU user runs, down to the kernel launch, on this CPU.

Tensors made on device ``cuda`` inside ``simulated_cuda(arch)`` are ``SimulatedCudaTensor``s: meta
tensors to PyTorch's C++ core (shapes, strides and dtypes propagate through every aten op and the
autograd engine, with no memory and no driver) that report device ``cuda:0`` to Python code. So every
``device.type == "cuda"`` branch of ``vit_kernels`` runs, forward and backward, exactly as on a GPU.
Inside PyTorch's own ops (its Python meta kernels allocate outputs on their inputs' device) the tensors
report ``meta``.

What a GPU would do is intercepted at five points only:

* the driver's answers: ``torch.cuda`` says one device with the properties of ``ARCHITECTURES[arch]``
  (an H100's 132 SMs, or an A100's 108), no graph capture, and synchronises instantly; the
  extension, where it loaded, counts as built with its CUDA kernels, whose calls run through their
  fake implementations (shapes and dtypes, as under torch.compile);
* Triton launches: ``JITFunction.run`` (``InterpretedFunction.run`` under TRITON_INTERPRET=1)
  records each launch (kernel, grid, arguments) instead of compiling and running it; the compile
  gate (``tools.gpu_check``) compiles the recorded variants for the architecture;
* reading a value: ``.item()``, ``bool()``, ``float()``, ``tolist()`` of a simulated tensor give 0
  (there is no data), so validation code runs each comparison and finds every candidate right;
* timing: CUDA events report 1 ms (``vk.tune``'s timer measures the host's time); what ``vk.tune``
  decides in the block stays there;
* the autograd engine's entry points (``torch.autograd.grad``/``backward``) run the engine directly
  (clocked as PyTorch's from their first line), and a custom Function's backward gets its saved
  tensors and gradients as simulated tensors: PyTorch would otherwise run backward with tensor
  subclasses hidden, on plain meta tensors.

Nothing else is patched: dispatch, tile choosers, validation and the launchers run unchanged. What
the runtime cached of a device's answers (``functools`` caches in ``vit_kernels``) is cleared on entry
and exit, so an sm_80 block after an sm_90 one asks again.

The recorder also clocks the host time spent in PyTorch's own calls (and a simulated tensor's
``device``) and in the (recorded) launches, and counts those calls, so ``our_seconds`` tells how much
of a call is this project's Python: the host overhead a GPU user pays above PyTorch's and Triton's
(``benchmarks.host_overhead``). Simulated tensors make PyTorch's calls much slower than on a GPU,
but that time is not counted as ours. Entering each such call still costs the simulation up to a
few microseconds of Python outside the clock, depending on the call (its arguments, the mode that
turns ``cuda`` into simulated tensors): ``capture`` keeps the calls one warm call makes,
``entry_seconds`` makes exactly those again with nothing of ours around them, and what they cost
outside the clock is taken out of the call's time. An autograd Function's ``apply`` and the autograd
engine are clocked as PyTorch's too; the package's Functions' forward and backward, which they call,
are ours again inside them (``ours`` pauses the clock).

Dynamo cannot trace a tensor subclass, so what torch.compile puts in a GPU user's graph is traced
under ``fake_cuda(arch)`` instead: FakeTensorMode's CUDA tensors (a CUDA build of torch, no GPU)
with the same answers of the device.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Callable, Iterator, Optional
from unittest import mock

import torch
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from vit_kernels import _ext, _signature, _tiles, backend
from vit_kernels.ops import attention


def _gpu(name: str, major: int, sms: int, l2_mib: int, smem_per_block: int) -> dict:
    """What ``torch.cuda.get_device_properties`` says of a simulated 80 GB GPU of compute capability
    ``major``.0: ``sms`` multiprocessors, ``l2_mib`` MiB of L2 cache and ``smem_per_block`` bytes of
    shared memory that a block may opt in to."""
    return dict(
        name=f"{name} (simulated)",
        major=major,
        minor=0,
        multi_processor_count=sms,
        total_memory=80 * 2**30,
        L2_cache_size=l2_mib * 2**20,
        shared_memory_per_block_optin=smem_per_block,
        regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048,
        warp_size=32,
    )


ARCHITECTURES = {
    90: _gpu("NVIDIA H100 80GB HBM3", major=9, sms=132, l2_mib=50, smem_per_block=232448),
    80: _gpu("NVIDIA A100-SXM4-80GB", major=8, sms=108, l2_mib=40, smem_per_block=166912),
}

_inside_torch = threading.local()
_clock = threading.local()  # .depth: inside a clocked call; .recorder: where its seconds go
_NOTHING = functools.partial(int)  # a trivial C call: what a replay loop costs per call, less ours
CALL_KINDS = ("torch", "device", "launch")  # a torch-function call, a tensor's device, a Triton launch
_tensor_device = torch._C.TensorBase.device.__get__
_VALUE_READS = {
    torch.Tensor.item: 0,
    torch.Tensor.__bool__: False,
    torch.Tensor.__float__: 0.0,
    torch.Tensor.__int__: 0,
    torch.Tensor.__index__: 0,
}


_saved_tensors = torch._C._FunctionBase.saved_tensors.__get__


def _as_tuple(tensors) -> tuple:
    return (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)


def _seeds(outputs: tuple, grad_outputs) -> tuple:
    grad_outputs = (None,) * len(outputs) if grad_outputs is None else _as_tuple(grad_outputs)
    return tuple(torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs, strict=True))


def _grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    materialize_grads=False,
):
    """torch.autograd.grad, run by the engine directly: the backward functions it calls (our code)
    see simulated tensors, where the torch-function path would run them with subclasses disabled."""
    from torch.autograd.graph import _engine_run_backward

    outputs, inputs = _as_tuple(outputs), _as_tuple(inputs)
    grads = _engine_run_backward(
        outputs,
        _seeds(outputs, grad_outputs),
        create_graph if retain_graph is None else retain_graph,
        create_graph,
        inputs,
        bool(allow_unused or materialize_grads),
        accumulate_grad=False,
    )
    if materialize_grads:
        grads = tuple(torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True))
    return tuple(_simulated(g) for g in grads)


def _backward(
    tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None
):
    """torch.autograd.backward (and Tensor.backward), run by the engine directly, as ``_grad``."""
    from torch.autograd.graph import _engine_run_backward

    tensors = _as_tuple(tensors)
    _engine_run_backward(
        tensors,
        _seeds(tensors, grad_tensors),
        create_graph if retain_graph is None else retain_graph,
        create_graph,
        _as_tuple(inputs) if inputs is not None else (),
        True,
        accumulate_grad=True,
    )


def _tensor_backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    _backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)


# The engine's entry points run our backward functions: they are called here directly, not inside
# PyTorch's torch-function handling (which would hide the simulated device from them).
_RUNS_OUR_CODE = {
    torch.autograd.grad: _grad,
    torch.autograd.backward: _backward,
    torch.Tensor.backward: _tensor_backward,
}


def _clocked_from_entry(run: Callable) -> Callable:
    """An engine entry point run by ``run`` (``_grad``, ``_backward``) as a caller on a GPU enters it:
    clocked from its first line as PyTorch's (a GPU user's ``torch.autograd.backward`` is PyTorch's
    Python and the engine; the backward functions of ours inside it pause the clock). Entered through
    the torch-function path instead, its Python and two torch-function dispatches would run before
    the clock starts and read as ours: about 12 us per backward call."""

    def entry(*args, **kwargs):
        return _clocked(lambda: run(*args, **kwargs), "torch")

    return entry


def _depth() -> int:
    return getattr(_inside_torch, "depth", 0)


class SimulatedCudaTensor(torch.Tensor):
    """A meta tensor that Python code outside PyTorch's own ops sees on ``cuda:0``."""

    @property
    def device(self) -> torch.device:
        if _depth():
            return _tensor_device(self)
        # PyTorch's own getter on a GPU: not this project's time
        return _clocked(_cuda0, "device", getattr, (self, "device"))

    @property
    def is_cuda(self) -> bool:
        return not _depth()

    @property
    def is_meta(self) -> bool:
        return bool(_depth())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            return _VALUE_READS[func]
        if func is torch.Tensor.tolist:
            return tree_map(lambda _: 0, torch._C.TensorBase.tolist(torch.zeros(args[0].shape)))
        if func in _RUNS_OUR_CODE:  # the engine's Python and C++ are PyTorch's; our backward is paused
            return _clocked(lambda: _RUNS_OUR_CODE[func](*args, **(kwargs or {})), "torch")
        _inside_torch.depth = _depth() + 1
        try:
            out = super().__torch_function__(func, types, args, kwargs)
        finally:
            _inside_torch.depth -= 1
        return tree_map(_simulated, out)  # what the engine made in C++ (a .grad) is simulated too


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # tensor.to(0) / new_empty(device=0): a CUDA ordinal
    return isinstance(device, torch.device) and device.type == "cuda"


def _simulated(t):
    if (
        isinstance(t, torch.Tensor)
        and not isinstance(t, SimulatedCudaTensor)
        and _tensor_device(t).type == "meta"
    ):
        return t.as_subclass(SimulatedCudaTensor)
    return t


_MOVES = (
    torch.Tensor.to,
    torch.Tensor.cuda,
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
)


def _cuda0() -> torch.device:
    return torch.device("cuda", 0)


def _clocked(
    call, kind: str, entry: Optional[Callable] = None, args: tuple = (), kwargs: Optional[dict] = None
):
    """Run ``call()``; its seconds count as not ours unless an enclosing call already counts them
    (less what ``ours`` pauses inside it: our code that PyTorch calls back). ``kind``
    (``CALL_KINDS``): how it was entered, counted. ``entry(*args, **kwargs)`` is the call as our code
    made it, which enters the simulation again: ``Recorder.capture`` keeps it (None: a call that
    runs our code inside, not to be made again)."""
    recorder = getattr(_clock, "recorder", None)
    if recorder is None or getattr(_clock, "depth", 0):
        return call()
    if entry is not None and recorder.captured is not None:
        if not recorder.captured:  # a replay starts in the grad mode the calls were made in
            recorder.captured.append(functools.partial(torch._C._set_grad_enabled, torch.is_grad_enabled()))
        recorder.captured.append(functools.partial(entry, *args, **(kwargs or {})))
    _clock.depth, outer_paused, _clock.paused = 1, getattr(_clock, "paused", 0.0), 0.0
    started = time.perf_counter()
    try:
        return call()
    finally:
        recorder.not_ours += time.perf_counter() - started - _clock.paused
        recorder.calls[kind] += 1
        _clock.depth, _clock.paused = 0, outer_paused


def ours(fn: Callable) -> Callable:
    """``fn`` (our code that PyTorch calls: an autograd Function's forward or backward), whose time
    inside a clocked call (``Function.apply``, the autograd engine) is ours again, and whose own
    PyTorch calls are clocked one by one."""

    def run(*args, **kwargs):
        if not getattr(_clock, "depth", 0):
            return fn(*args, **kwargs)
        _clock.depth, started = 0, time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _clock.paused += time.perf_counter() - started
            _clock.depth = 1

    return run


def _our_backward(backward: Callable) -> Callable:
    """An autograd Function's backward with our part ``ours``: inside ``once_differentiable``
    (PyTorch's wrapper, rebuilt around it) where the backward has it."""
    inner = getattr(backward, "__wrapped__", None)
    return once_differentiable(ours(inner)) if inner is not None else ours(backward)


# a classmethod in Python (torch 2.13) or in C (2.14): bound to the class at each call
_function_apply = torch.autograd.Function.__dict__["apply"]


def _clocked_apply(cls, *args, **kwargs):
    """``torch.autograd.Function.apply``: PyTorch's Python and C++ around our forward (``ours``)."""
    return _clocked(lambda: _function_apply.__get__(None, cls)(*args, **kwargs), "torch")


def _our_functions() -> list:
    """The autograd Functions of ``vit_kernels`` (``_autograd.differentiable``'s)."""
    return [
        cls for cls in torch.autograd.Function.__subclasses__() if cls.__module__.startswith("vit_kernels")
    ]


class _CudaAsMeta(TorchFunctionMode):
    """Factory calls and moves to ``cuda`` make simulated tensors instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _RUNS_OUR_CODE:
            return func(*args, **(kwargs or {}))
        return _clocked(lambda: self._moved(func, types, args, kwargs), "torch", func, args, kwargs)

    def _moved(self, func, types, args, kwargs):
        kwargs = dict(kwargs or {})
        if func is torch._C._nn._parse_to:  # Module.to's parsing: the device stays as asked, for t.to below
            return func(*args, **kwargs)
        moved = False
        if _is_cuda(kwargs.get("device")):
            kwargs["device"], moved = "meta", True
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if func is torch.Tensor.cuda or any(_is_cuda(a) for a in args[1:]):
                moved = True
                args = (args[0], *("meta" if _is_cuda(a) else a for a in args[1:]))
                if func is torch.Tensor.cuda:
                    func, args = torch.Tensor.to, (args[0], "meta")
            elif isinstance(args[0], SimulatedCudaTensor) or any(
                isinstance(a, SimulatedCudaTensor) for a in args[1:]
            ):
                moved = True  # .to(dtype) / .to(other_tensor) of a simulated tensor stays simulated
        if not moved and func in _MOVES and isinstance(args[0], SimulatedCudaTensor):
            moved = True
        out = func(*args, **kwargs)
        return tree_map(_simulated, out) if moved else out


@dataclass(frozen=True)
class Launch:
    """One recorded Triton launch: the JITFunction, its grid as given, the arguments as passed."""

    kernel: object
    grid: object
    args: tuple
    kwargs: dict


class Recorder:
    """The launches made inside one ``simulated_cuda`` block, and the host seconds spent in PyTorch's
    calls and in launches there (``not_ours``)."""

    def __init__(self, arch: int):
        self.arch = arch
        self.launches: list[Launch] = []
        self.not_ours = 0.0
        self.calls = {kind: 0 for kind in CALL_KINDS}  # clocked calls by how they were entered
        self.captured: Optional[list[Callable[[], object]]] = None  # inside ``capture``

    def mark(self) -> tuple[float, dict[str, int]]:
        """Where the clocks stand: give it to ``our_seconds`` at the end of what is timed."""
        return self.not_ours, dict(self.calls)

    def our_seconds(self, wall: float, mark: tuple[float, dict[str, int]], entering: float = 0.0) -> float:
        """Of ``wall`` seconds that began at ``mark``: this project's Python, with PyTorch's calls and
        the launches (clocked) taken out, and ``entering``: the simulation's unclocked seconds of
        entering them (``entry_seconds`` per call, times the calls). Noise can make one call's
        figure negative: sum or take the least of many before reading it."""
        return wall - (self.not_ours - mark[0]) - entering

    def capture(self, call: Callable[[], object]) -> list[Callable[[], object]]:
        """Run ``call()`` once; return the clocked calls it made (PyTorch's calls, devices read,
        launches; the outermost only), each as a thunk that makes it again as our code made it."""
        self.captured = []
        try:
            call()
            return self.captured
        finally:
            self.captured = None

    def entry_seconds(
        self, captured: list[Callable[[], object]], rounds: int = 5, repeats: int = 20
    ) -> float:
        """What entering the ``captured`` calls costs the simulation outside its clock: they are made
        again with nothing of ours around them, and what is left of their time once the clocked
        seconds and the replay loop's own cost (a loop of as many trivial C calls) are taken out is
        the simulation's. The least over ``rounds`` (load only adds), per making of all of them.
        What the replay does is neither counted nor kept."""
        saved = self.not_ours, dict(self.calls), len(self.launches), torch.is_grad_enabled(), gc.isenabled()
        blanks = [_NOTHING] * len(captured)
        best = float("inf")
        gc.disable()  # a collection inside a loop would count as the simulation's
        try:
            for _ in range(rounds):
                not_ours, started = self.not_ours, time.perf_counter()
                for _ in range(repeats):
                    for again in captured:
                        again()
                replayed = time.perf_counter() - started - (self.not_ours - not_ours)
                started = time.perf_counter()
                for _ in range(repeats):
                    for again in blanks:
                        again()
                looped = time.perf_counter() - started
                best = min(best, (replayed - looped) / repeats)
        finally:
            if saved[4]:
                gc.enable()
            torch._C._set_grad_enabled(saved[3])
            self.not_ours, self.calls = saved[0], saved[1]
            del self.launches[saved[2] :]
        return max(0.0, best)

    def kernels(self) -> set[str]:
        return {launch.kernel.fn.__name__ for launch in self.launches}


def every_candidate(run: Callable[[], object]) -> None:
    """``run()``, then ``run()`` again with each other candidate tile of every key it met, and of the
    keys those runs met (the launches ``vk.tune``'s search makes, unvalidated and untimed): for
    recording every variant."""
    with contextlib.closing(_tiles.keys_met(run)) as keys:
        for met in keys:
            for tile in met.candidates[1:]:
                with _tiles.trying(met, tile):
                    run()


def exceptions_caught() -> list[str]:
    """Every candidate ``vk.tune`` excluded because it raised: on the simulated device every value
    reads 0 and every candidate validates, so any exclusion is an exception."""
    found = [
        f"auto, {signature}, {name}: {outcome}"
        for signature, entry in backend.TUNED.items()
        for name, outcome in entry["candidates"].items()
        if "raised" in outcome
    ]
    found += [
        f"{chooser.name}, {key}, {tile}: {trial}"
        for chooser in _tiles.TileChooser.instances
        for key, choice in chooser.report().items()
        for tile, trial in choice.trials.items()
        if isinstance(trial, str) and "raised" in trial
    ]
    return found


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 1.0


def _clear_device_caches() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("vit_kernels"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and hasattr(value, "__wrapped__"):
                    value.cache_clear()
    _tiles.forget_plans()  # the launch plans made for another device are stale


_untimeable = _signature.untimeable


def _untimeable_unless_simulated(args) -> bool:
    """``_signature.untimeable`` with each simulated tensor judged as the plain CUDA tensor it stands for."""
    plain = torch.zeros(())
    return _untimeable([plain if isinstance(a, SimulatedCudaTensor) else a for a in args])


def _backward_on_the_device(apply):
    """A custom Function's backward as the engine calls it, on the simulated device: the gradients
    the engine made in C++ (plain meta tensors) are simulated CUDA tensors, as the inputs were, and
    factory calls inside it make simulated tensors (the block's mode is not active in the engine)."""

    def backward(self, *args):
        with _CudaAsMeta():
            return apply(self, *tree_map(_simulated, args))

    return backward


def _device_answers(arch: int) -> list:
    """What the device says of itself (properties, capability, name) and of its random state, as a
    device of ``arch``: patches of ``torch.cuda``."""
    props = types.SimpleNamespace(**ARCHITECTURES[arch])
    cuda = torch.cuda
    return [
        mock.patch.object(cuda, "get_device_properties", lambda device=None: props),
        mock.patch.object(cuda, "get_device_capability", lambda device=None: (props.major, props.minor)),
        mock.patch.object(cuda, "get_device_name", lambda device=None: props.name),
        mock.patch.object(cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)),
        mock.patch.object(cuda, "set_rng_state", lambda state, device="cuda": None),
    ]


@contextlib.contextmanager
def fake_cuda(arch: int = 90) -> Iterator[None]:
    """torch.compile's tracing of a GPU user's model, with no GPU: inside the block, tensors are
    ``FakeTensorMode``'s (shapes and dtypes, no data), ``device="cuda"`` and ``.to("cuda")`` make fake
    CUDA tensors (this needs a CUDA build of torch, as the integration environment's), the device
    answers as one of ``arch`` and the Triton backend counts as available. Dynamo traces the graph,
    which dispatch fills from its tables under compile; nothing runs. Make the model outside the
    block (its initialisation reads values) and move it inside. The autograd engine opens a CUDA
    context to run a backward, so AOTAutograd's backward graph cannot be traced here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as stack:
        stack.callback(_clear_device_caches)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        for patch in _device_answers(arch):
            stack.enter_context(patch)
        stack.enter_context(mock.patch.dict(backend._backend_checks, triton=lambda: None))
        _clear_device_caches()
        yield


@contextlib.contextmanager
def simulated_cuda(arch: int = 90, measuring: bool = True) -> Iterator[Recorder]:
    """Inside the block, ``device="cuda"`` gives simulated tensors on a device of ``arch`` (90 or 80)
    and Triton launches are recorded in the yielded ``Recorder``. ``measuring=False``: the device
    reports a CUDA graph being captured, so nothing is measured and each launcher launches its
    default tile (what a captured or traced call runs)."""
    from torch.autograd.function import BackwardCFunction
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    recorder = Recorder(arch)

    def record(self, *args, grid, warmup, **kwargs):
        def launch():  # and return the compiled kernel, as Triton's: not our time
            launched = Launch(self, tuple(grid(kwargs) if callable(grid) else grid), args, kwargs)
            recorder.launches.append(launched)

        return _clocked(launch, "launch", self[grid], args, kwargs)

    cuda = torch.cuda
    patches = [
        mock.patch.object(cuda, "is_available", lambda: True),
        mock.patch.object(cuda, "device_count", lambda: 1),
        mock.patch.object(cuda, "current_device", lambda: 0),
        *_device_answers(arch),
        mock.patch.object(cuda, "synchronize", lambda device=None: None),
        mock.patch.object(cuda, "is_current_stream_capturing", lambda: not measuring),
        mock.patch.object(cuda, "manual_seed", lambda seed: None),
        mock.patch.object(cuda, "Event", _Event),
        mock.patch.object(BackwardCFunction, "apply", _backward_on_the_device(BackwardCFunction.apply)),
        mock.patch.object(
            BackwardCFunction,
            "saved_tensors",
            property(
                lambda ctx: _clocked(lambda: tuple(_simulated(t) for t in _saved_tensors(ctx)), "torch")
            ),
            create=True,
        ),
        mock.patch.object(torch.autograd.Function, "apply", classmethod(_clocked_apply)),
        mock.patch.object(torch.autograd, "grad", _clocked_from_entry(_grad)),
        mock.patch.object(torch.autograd, "backward", _clocked_from_entry(_backward)),
        mock.patch.object(torch.Tensor, "backward", _clocked_from_entry(_tensor_backward)),
        *(
            patch
            for cls in _our_functions()
            for patch in (
                mock.patch.object(cls, "forward", staticmethod(ours(cls.forward))),
                mock.patch.object(cls, "backward", staticmethod(_our_backward(cls.backward))),
            )
        ),
        mock.patch.object(JITFunction, "run", record),
        mock.patch.object(InterpretedFunction, "run", record),
        mock.patch.object(_ext, "HAS_CUDA_KERNELS", _ext.LOADED),
        mock.patch.dict(backend.TUNED, clear=True),  # what vk.tune decides in the block stays there
        mock.patch.dict(_tiles.TUNED, clear=True),
        mock.patch.dict(attention._UNUSED_SEEDS, clear=True),  # a simulated tensor must not outlive it
        # a simulated tensor stands for a plain CUDA tensor: it takes dispatch's per-call fast path
        # and is timed (dispatch never times other tensor subclasses)
        mock.patch.object(backend, "_TENSOR_TYPES", backend._TENSOR_TYPES + (SimulatedCudaTensor,)),
        mock.patch.object(_signature, "untimeable", _untimeable_unless_simulated),
    ]
    with contextlib.ExitStack() as stack:
        stack.callback(_clear_device_caches)
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(_CudaAsMeta())
        _clear_device_caches()
        _clock.recorder = recorder
        stack.callback(setattr, _clock, "recorder", None)
        yield recorder
