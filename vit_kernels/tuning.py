"""Searching, when a user asks for it: ``vk.tune(model, example_inputs)``, and the file it leaves.

By default the tables decide (``vit_kernels.backend``, ``vit_kernels._tiles``). ``tune`` runs the
model once with searching on: ``auto`` validates and times every capable implementation of each
signature (``search_backends``), first searching the tiles of each Triton launch it makes, through
the whole op. Every candidate is compared with the reference (``_accuracy``'s rule, output and every
gradient) before it is timed, and one timer times them all.
The decisions stay in this process; ``save_tuning(path)`` writes them to a file stamped with the
device, driver and versions, which ``load_tuning(path)`` reads on every rank of a job (and refuses,
in one line, where the stamp differs). Under ``torch.distributed`` rank 0 searches and every rank
runs its decisions. Tune before ``torch.compile``: a graph compiled earlier keeps what it traced.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import math
import os
from typing import Any, Callable, Optional, Sequence, Union

import torch

from vit_kernels import _accuracy, _signature, _tiles, backend
from vit_kernels._files import write_atomically

FORMAT = 2


MIN_RUN_S = 0.05  # each candidate's timing: blocks of runs for at least this long


def time_runs(runs: dict) -> dict:
    """Median milliseconds of each of ``runs`` (name -> callable, run once already), by
    ``torch.utils.benchmark`` (which synchronises CUDA around its blocks)."""
    from torch.utils.benchmark import Timer

    timers = {name: Timer("run()", globals={"run": run}) for name, run in runs.items()}
    return {name: t.blocked_autorange(min_run_time=MIN_RUN_S).median * 1e3 for name, t in timers.items()}


def tune(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    grad: Optional[bool] = None,
    autocast: Optional[torch.dtype] = None,
) -> backend.Explanation:
    """Run ``model(*example_inputs)`` once, searching every signature and tile it meets.

    model: a module built from vit_kernels ops (vit models, vit_kernels.nn layers, patched models).
    example_inputs: a tuple of the model's positional inputs, e.g. ``(images,)`` with images
    (N, C, H, W), of the shapes training or serving will see. grad: tune the training signatures
    (forward + backward), default: when the model is in training mode with parameters that require
    grad. autocast: the dtype training runs autocast in (e.g. ``torch.bfloat16``). Under
    ``torch.distributed`` every rank calls it: rank 0 searches, the others run its decisions.
    Returns ``explain()`` of this run."""
    grad, device_type = run_options(model, example_inputs, grad, autocast)
    rank, shared = _rank()
    _forget()  # what earlier calls took from the tables is decided again, by a search
    backend.searcher = search_backends if rank == 0 else None
    try:
        with (
            backend.use_backend("auto"),
            torch.set_grad_enabled(grad),
            torch.autocast(device_type, dtype=autocast, enabled=autocast is not None),
        ):
            output = model(*example_inputs)
            outputs = output if isinstance(output, (tuple, list)) else [output]
            roots = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            weights = [p for p in model.parameters() if p.requires_grad]
            if roots and weights:  # the backward's kernels too; no parameter's .grad is touched
                torch.autograd.grad(roots, weights, [torch.randn_like(o) for o in roots], allow_unused=True)
    finally:
        backend.searcher = None
    if shared:
        decisions = [tuning() if rank == 0 else None]
        torch.distributed.broadcast_object_list(decisions, src=0)
        if rank != 0:
            _hold(decisions[0])
    return backend.explain()


def run_options(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    grad: Optional[bool],
    autocast: Optional[torch.dtype],
) -> tuple[bool, str]:
    """(grad, the inputs' device type) of a run of ``model(*example_inputs)``, each argument checked."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, e.g. (images,)")
    if grad is None:
        grad = model.training and any(p.requires_grad for p in model.parameters())
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool or None, got {type(grad).__name__}")
    if autocast is not None and autocast not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast must be torch.float16, torch.bfloat16 or None, got {autocast!r}")
    return grad, next((a.device.type for a in example_inputs if isinstance(a, torch.Tensor)), "cpu")


def _rank() -> tuple[int, bool]:
    """(this process's rank, whether decisions are shared among several ranks)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, False
    if torch.distributed.get_world_size() == 1:
        return 0, False
    return torch.distributed.get_rank(), True


def _forget() -> None:
    backend.clear_decisions()
    _tiles.forget()


# ---- the backend search ----------------------------------------------------------------------------


def _clone(a: Any, dtype: Optional[torch.dtype], grad: bool) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    c = a.detach().clone()
    if dtype is not None and c.is_floating_point() and c.dtype != torch.float64:
        c = c.to(dtype)
    return c.requires_grad_(grad and a.requires_grad and c.is_floating_point())


def _runner(fn: Callable, args: Sequence[Any], grad: bool, upstream: list, dtype=None) -> Callable:
    """A run of ``fn`` on its own clones of ``args`` -> [outputs..., input gradients...] (the
    gradients for ``upstream``, a fixed random cotangent per output, made on the first run)."""
    args = [_clone(a, dtype, grad) for a in args]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def run() -> list:
        with torch.set_grad_enabled(grad):
            result = fn(*args)
            outs = list(result) if isinstance(result, (tuple, list)) else [result]
            if not grad or not leaves:
                return [o.detach() for o in outs]
            if not upstream:
                generator = torch.Generator().manual_seed(0)
                upstream.extend(torch.randn(o.shape, generator=generator).to(o.device) for o in outs)
            pairs = [(o, u.to(o.dtype)) for o, u in zip(outs, upstream) if o.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], leaves, [u for _, u in pairs], allow_unused=True
            )
            return [o.detach() for o in outs] + list(grads)

    return run


def _problem(op: str, actual: list, own: list, exact: list, dtype: torch.dtype) -> Optional[str]:
    if len(actual) != len(exact):
        return f"{len(actual)} outputs and gradients, the reference gives {len(exact)}"
    parts = []
    for i, (a, p, r) in enumerate(zip(actual, own, exact)):
        if a is None or r is None:
            if (r is None) != (a is None) and (r if a is None else a).abs().max() > 0:
                return f"result {i} is missing"
        elif a.shape != r.shape:
            return f"result {i} has shape {tuple(a.shape)}, the reference {tuple(r.shape)}"
        else:
            parts += backend.validation_parts.get(op, _whole)(i, a, p, r)
    return _accuracy.first_problem(parts, _accuracy.FLOORS.get(dtype, _accuracy.FLOORS[torch.float32]))


def _whole(i: int, *tensors: torch.Tensor) -> list[tuple]:
    return [(f"result {i}", *tensors)]


def _outcome(check: Callable[..., Optional[str]], *args) -> Optional[str]:
    """``check(*args)``'s problem, or the exception it raised as one: a candidate that cannot run is
    excluded, not fatal."""
    try:
        return check(*args)
    except Exception as error:
        return f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def search_tiles(call: "backend._Call", fn: Callable, checked: tuple, upstream: list, own, exact) -> None:
    """The tiles of the Triton launches ``fn`` makes on the call: for each key met, every candidate
    launched through the whole op on ``checked`` and validated, the valid ones timed on the call's
    own arguments, the fastest kept (a key with no valid candidate keeps its default, and the op is
    then judged invalid as a whole). Keys first met while a candidate runs are searched next."""
    with contextlib.closing(_tiles.keys_met(_runner(fn, checked, call.grad, upstream))) as keys:
        for met in keys:
            trials: dict = {}
            for tile in met.candidates:
                with _tiles.trying(met, tile):
                    problem = _outcome(_run_and_judge, call, fn, checked, upstream, own, exact)
                trials[tile] = None if problem is None else f"invalid: {problem}"
            valid = [tile for tile, problem in trials.items() if problem is None]
            for tile in valid:
                with _tiles.trying(met, tile):
                    trials.update(time_runs({tile: _runner(fn, call.args, call.grad, upstream)}))
            if valid:
                best = min(valid, key=trials.get)
                met.chooser.keep(met.key, _tiles.Choice(best, "tuned", trials), met.device)


def references(call: "backend._Call", checked: tuple, upstream: list) -> tuple[list, list]:
    """(exact, PyTorch's own): the op's reference on ``checked`` in the reference dtype, and in the
    call's own dtype: outputs, then input gradients for ``upstream`` (made here when empty)."""
    reference = backend._registry[call.op]["torch"].fn
    exact = _runner(reference, checked, call.grad, upstream, _accuracy.reference_dtype(call.dtype))()
    return exact, _runner(reference, checked, call.grad, upstream)()


def _run_and_judge(call: "backend._Call", fn: Callable, checked: tuple, upstream: list, own, exact):
    return _problem(call.op, _runner(fn, checked, call.grad, upstream)(), own, exact, call.dtype)


def _validated(call: "backend._Call", fn: Callable, checked: tuple, upstream: list, own, exact):
    """Why ``fn`` (its tiles searched first) is wrong on the call, or None."""
    search_tiles(call, fn, checked, upstream, own, exact)
    return _run_and_judge(call, fn, checked, upstream, own, exact)


@_accuracy.without_autocast()
def search_backends(call: "backend._Call", capable: list[str]) -> dict:
    """``vk.tune``'s decision for one signature: each capable implementation run on clones of the
    call's arguments (the caller's graph untouched, the RNG state restored), its tiles searched,
    validated against the reference (dropout off), and the valid ones timed; the fastest is kept if
    it beats the reference."""
    impls = backend._registry[call.op]
    args = tuple(call.args)
    checked = backend.validation_args.get(call.op, lambda a: a)(args)
    upstream: list = []
    cuda = [call.device.index or 0] if call.device.type == "cuda" else []
    candidates: dict[str, object] = {}
    with torch.random.fork_rng(devices=cuda):
        exact, own = references(call, checked, upstream)
        runs = {}
        for name in capable:
            fn = impls[name].fn
            problem = (
                None if name == "torch" else _outcome(_validated, call, fn, checked, upstream, own, exact)
            )
            if problem is None:
                runs[name] = _runner(fn, args, call.grad, upstream)
            else:
                candidates[name] = f"invalid: {problem}"
        times = time_runs(runs)
    candidates.update({name: f"{ms:.3f} ms" for name, ms in times.items()})
    reference = times.get("torch", math.inf)
    fastest = min((t, n) for n, t in times.items() if n != "torch") if len(times) > 1 else (math.inf, "torch")
    chosen = fastest[1] if fastest[0] * 1.05 <= reference else "torch"
    reason = "no valid candidate beat the reference by 5%" if chosen == "torch" else "fastest valid"
    return {"backend": chosen, "reason": f"vk.tune: {reason}", "candidates": candidates}


# ---- the tuning file -------------------------------------------------------------------------------


def _driver_version() -> str:
    try:
        library = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if library.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except (OSError, AttributeError):
        pass
    return "none"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def stamp() -> dict[str, str]:
    """What the decisions depend on: the device, the driver and the software versions."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return {
        "device": _signature.device_name(device),
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "vit_kernels": _version("vit-kernels"),
    }


def tuning() -> dict:
    """Every decision this process tuned or loaded, as the JSON-able dict ``save_tuning`` writes."""
    return {"format": FORMAT, "stamp": stamp(), "dispatch": dict(backend.TUNED), "tiles": dict(_tiles.TUNED)}


def save_tuning(path: Union[str, os.PathLike]) -> None:
    """Write ``tuning()`` to ``path`` (JSON, atomically): ``load_tuning(path)`` runs it elsewhere."""
    write_atomically(os.fspath(path), json.dumps(tuning(), indent=1, sort_keys=True))


def load_tuning(path: Union[str, os.PathLike]) -> None:
    """Run the decisions of a ``save_tuning`` file from now on in this process. Raises ValueError,
    in one line, for a file that is not one or whose stamp (device, driver, versions) differs."""
    with open(path, encoding="utf-8") as source:
        try:
            data = json.load(source)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a vit_kernels tuning file: {error}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not all(isinstance(data.get(kind), dict) for kind in ("stamp", "dispatch", "tiles"))
    ):
        raise ValueError(f"{path} is not a vit_kernels tuning file of format {FORMAT}")
    here = stamp()
    differ = [
        f"{k} {data['stamp'].get(k)!r} (here {v!r})" for k, v in here.items() if data["stamp"].get(k) != v
    ]
    if differ:
        raise ValueError(f"{path} was tuned elsewhere, refused: {'; '.join(differ)}")
    _hold(data)


def _hold(data: dict) -> None:
    _forget()
    backend.TUNED.update(data["dispatch"])
    _tiles.TUNED.update(data["tiles"])
