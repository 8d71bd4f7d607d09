"""Comparison helpers: outputs and every gradient against a float64 formula."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vit_kernels import _ext, backend

# Backends that can run CPU tensors here: the reference, Triton through the interpreter under
# TRITON_INTERPRET=1, and the C++ kernels when vit_kernels._C is built.
CPU_BACKENDS = (
    ["torch"]
    + (["triton"] if backend.triton_device_reason(torch.device("cpu")) is None else [])
    + (["extension"] if _ext.supports(torch.device("cpu"), torch.float32) is None else [])
)


def backend_dtypes(kernel_dtypes: Sequence[torch.dtype]) -> list[tuple[str, torch.dtype]]:
    """(backend, dtype) pairs: the reference in float64 and float32, each kernel backend in ``kernel_dtypes``."""
    pairs = [("torch", torch.float64), ("torch", torch.float32)]
    return pairs + [(name, dtype) for name in CPU_BACKENDS[1:] for dtype in kernel_dtypes]

# (atol, rtol) per dtype, for element-wise comparison with a float64 reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (8e-2, 5e-2),
}


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
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(upstream, outs)])
    grads = [None if t is None else t.grad for t in inputs]
    return [o.detach() for o in outs], grads, list(upstream)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_against_formula(
    fn, formula, inputs, dtype: torch.dtype, names: Sequence[str], device: str = "cpu",
    skip_grads: Sequence[str] = (), **kwargs
) -> None:
    """``fn`` in ``dtype`` on ``device`` against ``formula`` in float64 on the CPU: every output and
    every input gradient but those named in ``skip_grads`` (checked elsewhere, by another measure)."""
    cast = [None if t is None else t.to(device, dtype) for t in inputs]
    wide = [None if t is None else t.double() for t in inputs]
    outs, grads, upstream = outputs_and_grads(fn, cast, **kwargs)
    ref_outs, ref_grads, _ = outputs_and_grads(formula, wide, [g.double().cpu() for g in upstream], **kwargs)
    assert len(outs) == len(ref_outs)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype, f"output {i} has dtype {o.dtype}, expected {dtype}"
        assert o.shape == r.shape, f"output {i} shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert_close(o.cpu(), r, dtype, f"output {i}")
    for name, g, r in zip(names, grads, ref_grads):
        if r is None or name in skip_grads:
            continue
        assert g is not None, f"no gradient for {name}"
        assert_close(g.cpu(), r, dtype, f"d{name}")
