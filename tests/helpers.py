"""Comparison helpers: outputs and every gradient against a float64 formula, and the device
parametrization every op test file shares (CPU cases, and CUDA cases marked ``gpu``)."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from typing import Callable, Iterator, Optional, Sequence, Union

import pytest
import torch

import vit_kernels as vk
from vit_kernels import _ext, backend
from vit_kernels._accuracy import ERROR_RATIO, FLOORS, sibling_scale

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# The quick fuzz tests' seed: the day's date (a new draw of cases each day), or VIT_KERNELS_FUZZ_SEED
# to replay one; printed at the end of a run that ran them (tests/conftest.py).
FUZZ_SEED = int(os.environ.get("VIT_KERNELS_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))
HAS_CUDA = torch.cuda.is_available()
GPU_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"))


# The GELU forms of vk.linear_gelu / vk.mlp (``approximate``), written out for float64 references.
GELU_APPROXIMATIONS = ["none", "tanh", "quick"]


def gelu_formula(z: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(z): z Phi(z) ("none"), its tanh approximation ("tanh") or QuickGELU z sigmoid(1.702 z) ("quick")."""
    if approximate == "tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    if approximate == "quick":
        return z / (1 + torch.exp(-1.702 * z))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def requires_cuda(test):
    """A CUDA-only test: marked ``gpu`` (``pytest -m gpu`` selects it) and skipped without a device."""
    for mark in GPU_MARKS:
        test = mark(test)
    return test


def device_reason(name: str, device: torch.device) -> Optional[str]:
    """Why backend ``name`` cannot run tensors of ``device`` here, or None when it can. Triton runs
    CPU tensors through its interpreter (TRITON_INTERPRET=1) and CUDA tensors compiled, never
    interpreted (``make test-gpu`` runs without TRITON_INTERPRET)."""
    if name == "triton":
        if device.type == "cuda" and backend.TRITON_INTERPRET:
            return "TRITON_INTERPRET=1 is set: Triton's CUDA cases run compiled (make test-gpu)"
        return backend.triton_device_reason(device)
    if name == "extension":
        return _ext.supports(device, torch.float32)
    return None


# Backends that can run CPU tensors here: the reference, Triton through the interpreter under
# TRITON_INTERPRET=1, and the C++ kernels when vit_kernels._C is built.
CPU_BACKENDS = [name for name in ("torch", "triton", "extension") if device_reason(name, CPU) is None]
# On CUDA every backend is collected; a case whose backend cannot run there skips, saying why.
CUDA_BACKENDS = ("torch", "triton", "extension")
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# The CPU cases keep the ids pytest gave them before the CUDA ones were added: each test's seed is
# drawn from its id (tests/conftest.py), so their data is unchanged. CUDA cases are ``cuda-<id>``.


def cuda_param(*values, id: str, skip_reason: Optional[str] = None):
    """``pytest.param(*values)`` of a CUDA case, id ``cuda-<id>``: marked ``gpu``, skipped without a
    CUDA device or with ``skip_reason``."""
    marks = [*GPU_MARKS, pytest.mark.skipif(skip_reason is not None, reason=str(skip_reason))]
    return pytest.param(*values, marks=marks, id=f"cuda-{id}")


def device_backends(cuda: bool = True) -> list:
    """(device, backend_name) parameters: every backend that runs CPU tensors here, then (unless not
    ``cuda``) on CUDA every backend (``gpu`` cases)."""
    cpu = [pytest.param("cpu", name, id=name) for name in CPU_BACKENDS]
    return cpu + [
        cuda_param("cuda", name, id=name, skip_reason=device_reason(name, CUDA))
        for name in CUDA_BACKENDS
        if cuda
    ]


def skip_unless_offered(op: str, backend_name: str, device: torch.device | str) -> None:
    """Skip a backend that does not offer ``op`` on ``device`` (the extension's attention on CUDA),
    with its reason: dispatch hands such a call to another backend, so there is nothing of it to check."""
    reason = backend.unsupported_reason(op, backend_name, torch.device(device), torch.float32)
    if reason is not None:
        pytest.skip(reason)


def backend_dtypes(kernel_dtypes: Sequence[torch.dtype]) -> list[tuple[str, torch.dtype]]:
    """(backend, dtype) pairs on the CPU: the reference in float64 and float32, each kernel backend
    in ``kernel_dtypes``."""
    pairs = [("torch", torch.float64), ("torch", torch.float32)]
    return pairs + [(name, dtype) for name in CPU_BACKENDS[1:] for dtype in kernel_dtypes]


def cuda_kernel_dtypes(op: str) -> list:
    """(device, backend_name, dtype) ``gpu`` parameters: triton and extension on CUDA in float32,
    float16 and bfloat16, each skipped where it cannot run ``op`` there."""
    return [
        cuda_param(
            "cuda",
            name,
            dt,
            id=f"{name}-{DTYPE_NAMES[dt]}",
            skip_reason=device_reason(name, CUDA) or backend.unsupported_reason(op, name, CUDA, dt),
        )
        for name in CUDA_BACKENDS[1:]
        for dt in CUDA_DTYPES
    ]


def device_backend_dtypes(op: str, cpu_pairs: Sequence[tuple[str, torch.dtype]]) -> list:
    """(device, backend_name, dtype) parameters of an op's formula test: on the CPU ``cpu_pairs``
    (see ``backend_dtypes``); on CUDA the reference in float64 and the kernel backends in float32,
    float16 and bfloat16. (In those three the reference on CUDA is the measure of PyTorch's own
    error that bounds the kernel backends: ``check_against_formula`` runs it in every one of their
    cases.)"""
    cpu = [pytest.param("cpu", name, dt, id=f"{name}-dtype{i}") for i, (name, dt) in enumerate(cpu_pairs)]
    return cpu + [cuda_param("cuda", "torch", torch.float64, id="torch-fp64")] + cuda_kernel_dtypes(op)


@contextlib.contextmanager
def exact_float32(device: torch.device | str) -> Iterator[None]:
    """On CUDA, float32 convolutions and matmuls without TF32 inside the block (cuDNN convolutions
    use TF32 by default): for tests that hold float32 to fixed tolerances. No-op on the CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# (atol, rtol) per dtype, for element-wise comparison with a float64 reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (8e-2, 5e-2),
}


def max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| (0 for empty tensors), in float64 on the reference's device."""
    if reference.numel() == 0:
        return 0.0
    return (actual.to(reference.device, torch.float64) - reference).abs().max().item()


def error_bound(
    reference: torch.Tensor,
    own_error: float,
    dtype: torch.dtype,
    device: torch.device,
    sibling_scale: float = 0.0,
) -> float:
    """The largest max-abs error allowed against ``reference`` (float64). On CUDA the runtime's rule
    (``vit_kernels._tiles``): ERROR_RATIO x PyTorch's own error ``own_error`` in the same dtype, with
    the floor FLOORS[dtype] relative to the largest reference value; on
    the CPU, where interpreted Triton rounds as numpy does, it is ``atol + rtol * max|reference|`` of
    TOLERANCES. ``sibling_scale``: the least scale taken (a tensor that is zero in exact arithmetic,
    attention's dq at length 1, is judged by the scale of the op's other results, as the tile
    choosers judge it: ``vit_kernels._accuracy.SIBLING_SCALE``)."""
    scale = max(reference.abs().max().item() if reference.numel() else 0.0, sibling_scale)
    if device.type == "cuda":
        floor = FLOORS[dtype] * scale
    else:
        atol, rtol = TOLERANCES[dtype]
        floor = atol + rtol * scale
    return max(floor, ERROR_RATIO * own_error)


def assert_within_pytorch_error(
    what: str,
    actual: torch.Tensor,
    own: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    sibling_scale: float = 0.0,
) -> None:
    """``actual`` errs against ``reference`` by at most ``error_bound``, PyTorch's own result being ``own``."""
    error, own_error = max_error(actual, reference), max_error(own, reference)
    bound = error_bound(reference, own_error, dtype, device, sibling_scale)
    assert error <= bound, (
        f"{what} ({dtype} on {device.type}): max error {error:.3g} > bound {bound:.3g} (PyTorch's own error "
        f"{own_error:.3g}, max |reference| {reference.abs().max().item() if reference.numel() else 0.0:.3g})"
    )


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Detached copies that require grad (None stays None)."""
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def outputs_and_grads(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor | None],
    upstream: Sequence[torch.Tensor] | None = None,
    **kwargs,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]]:
    """Run ``fn(*inputs, **kwargs)`` on fresh leaves and backpropagate random upstream gradients
    (or the given ones). Returns (outputs, grads of the inputs, upstream gradients used)."""
    inputs = leaves(*inputs)
    result = fn(*inputs, **kwargs)
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if upstream is None:
        upstream = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, [g.to(o.device, o.dtype) for g, o in zip(upstream, outs)])
    grads = [None if t is None else t.grad for t in inputs]
    return [o.detach() for o in outs], grads, list(upstream)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Element-wise within TOLERANCES[dtype]; in 16 bits the absolute tolerance is at least the
    runtime's floor, one unit of the dtype's precision at ``expected``'s largest magnitude
    (``vit_kernels._accuracy.FLOORS``): a sum over many rows (a weight's or a bias's gradient)
    carries the rounding of its 16-bit terms, which an element that nearly cancels cannot beat."""
    atol, rtol = TOLERANCES[dtype]
    if dtype in (torch.float16, torch.bfloat16) and expected.numel():
        atol = max(atol, FLOORS[dtype] * expected.abs().max().item())
    torch.testing.assert_close(
        actual.to(expected.device, expected.dtype),
        expected,
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{what}: {m}",
    )


def check_against_formula(
    fn,
    formula,
    inputs,
    dtype: torch.dtype,
    names: Sequence[str],
    device: torch.device | str | None = None,
    baseline: Optional[Callable] = None,
    grad_parts: Optional[dict[str, Sequence[str]]] = None,
    **kwargs,
) -> None:
    """``fn`` in ``dtype`` on ``device`` (by default the inputs' own) against ``formula`` in float64
    on the CPU: every output and every input gradient. On the CPU, and in float64, within TOLERANCES;
    on CUDA in a lower precision within ``error_bound``: twice PyTorch's own error, PyTorch's own
    being ``baseline`` (by default ``fn`` on the torch backend) on the same inputs and upstream
    gradients. ``grad_parts`` names the equal parts along the last dimension in which an input's
    gradient is compared, each on its own (``{"qkv": ("q", "k", "v")}``: dq, dk and dv)."""
    if device is None:
        device = next(t.device for t in inputs if t is not None)
    device = torch.device(device)
    cast = [None if t is None else t.to(device, dtype) for t in inputs]
    wide = [None if t is None else t.detach().cpu().double() for t in inputs]
    outs, grads, upstream = outputs_and_grads(fn, cast, **kwargs)
    ref_outs, ref_grads, _ = outputs_and_grads(formula, wide, [g.double().cpu() for g in upstream], **kwargs)
    own_outs = own_grads = None
    if device.type == "cuda" and dtype != torch.float64:
        with contextlib.nullcontext() if baseline is not None else vk.use_backend("torch"):
            own_outs, own_grads, _ = outputs_and_grads(baseline or fn, cast, upstream, **kwargs)
    assert len(outs) == len(ref_outs)
    least_scale = sibling_scale(ref_outs + ref_grads)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype, f"output {i} has dtype {o.dtype}, expected {dtype}"
        assert o.shape == r.shape, f"output {i} shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert o.device.type == device.type, f"output {i} is on {o.device}, expected {device}"
        if own_outs is None:
            assert_close(o, r, dtype, f"output {i}")
        else:
            assert_within_pytorch_error(f"output {i}", o, own_outs[i], r, dtype, device, least_scale)
    for i, (name, g, r) in enumerate(zip(names, grads, ref_grads)):
        if r is None:
            continue
        assert g is not None, f"no gradient for {name}"
        parts = (grad_parts or {}).get(name, (name,))

        def split(t, parts=parts):
            return t.chunk(len(parts), -1) if len(parts) > 1 else (t,)

        own = split(own_grads[i]) if own_grads is not None else [None] * len(parts)
        for part, g_part, r_part, own_part in zip(parts, split(g), split(r), own):
            if own_part is None:
                assert_close(g_part, r_part, dtype, f"d{part}")
            else:
                assert_within_pytorch_error(f"d{part}", g_part, own_part, r_part, dtype, device, least_scale)


def fake_timer(time_of: Callable[[object], float] = lambda key: 1.0) -> Callable:
    """A stand-in for ``vit_kernels.tuning.time_runs`` where nothing can be timed: each run once,
    its time ``time_of(key)`` milliseconds."""

    def time_runs(runs):
        return {key: (run(), time_of(key))[1] for key, run in runs.items()}

    return time_runs


def search_tiles(op: str, implementation: Union[str, Callable], *args) -> None:
    """``vk.tune``'s tile search for one call of ``op``'s ``implementation`` (a backend's name or its
    function) on ``args`` (as the implementation takes them): each candidate of every key its
    launches meet validated against the op's reference (output and every gradient), the valid ones
    timed (``tuning.time_runs``), the fastest kept. For the CPU, where ``auto`` never offers
    interpreted Triton to the search."""
    from vit_kernels import _signature, tuning

    device, dtype = args[0].device, args[0].dtype
    call = backend._Call(op, device, dtype, (), _signature.needs_grad(args), {}, args)
    upstream: list = []
    exact, own = tuning.references(call, args, upstream)
    fn = implementation if callable(implementation) else backend._registry[op][implementation].fn
    tuning.search_tiles(call, fn, args, upstream, own, exact)


def tiles_searched_first(monkeypatch, *ops: str) -> None:
    """Each op's Triton implementation runs ``search_tiles`` on its first call's arguments before it
    computes: a test calls the public op as a user does and gets vk.tune's tiles."""
    import dataclasses

    searched: set[str] = set()
    for op in ops:
        impl = backend._registry[op]["triton"]

        def first_searched(*args, op=op, fn=impl.fn):
            if op not in searched:
                searched.add(op)
                search_tiles(op, fn, *args)
            return fn(*args)

        monkeypatch.setitem(backend._registry[op], "triton", dataclasses.replace(impl, fn=first_searched))
    monkeypatch.setattr(backend, "_fast", {})
