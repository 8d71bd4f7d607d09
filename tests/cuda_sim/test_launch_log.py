"""The compile log on the simulated device: with the package's log at INFO, every launch of a GPU
call goes through ``_triton._run_logged``, which counts the variants Triton keeps per device
(``JITFunction.device_caches``). The simulated launcher compiles nothing, so that count stays put:
the tile checks are logged and no launch is said to compile. With the count grown on each new
specialisation (a stand-in for Triton's compile, keyed by the launch's configuration and dtypes),
each new variant is one line and the warm call none."""

from __future__ import annotations

import logging

import pytest
import torch
from triton.runtime.jit import JITFunction

import vit_kernels as vk
from vit_kernels import _triton

COMPILED_LINE = "first launch in"


@pytest.fixture
def logged(caplog):
    """The package's log at INFO (its level restored after), captured."""
    with caplog.at_level(logging.INFO, logger="vit_kernels"):
        yield caplog


def _layer_norm_call():
    x = torch.randn(2, 197, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with vk.use_backend("triton", strict=True):
        vk.layer_norm(x, weight, bias, 1e-6).float().sum().backward()


def _counting(monkeypatch) -> list:
    calls: list = []
    run_logged = _triton._run_logged

    def counted(kernel, grid, args, kwargs):
        calls.append(kernel)
        return run_logged(kernel, grid, args, kwargs)

    monkeypatch.setattr(_triton, "_run_logged", counted)
    return calls


def test_a_gpu_call_at_info_logs_its_checks_and_no_compile_where_triton_compiled_nothing(
    sim, logged, monkeypatch
):
    calls = _counting(monkeypatch)
    _layer_norm_call()
    assert len(calls) == len(sim.launches) > 0  # every launch of the call took the logged path
    messages = [r.getMessage() for r in logged.records]
    assert any("checked tile" in m for m in messages), messages
    assert not any(COMPILED_LINE in m for m in messages), messages


def test_each_variant_triton_adds_is_one_line_and_a_warm_call_none(sim, logged, monkeypatch):
    recorded = JITFunction.run  # the simulated device's recording launcher
    grown: dict = {}

    def compiling(self, *args, grid, warmup, **kwargs):
        if 0 not in self.device_caches:  # Triton's own entry would need a driver: made here
            monkeypatch.setitem(self.device_caches, 0, ({}, None, None, None, None))
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        self.device_caches[0][0].setdefault((dtypes, repr(sorted(kwargs.items()))), "compiled")
        grown[self] = len(self.device_caches[0][0])
        return recorded(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(JITFunction, "run", compiling)
    _layer_norm_call()
    lines = [r.getMessage() for r in logged.records if COMPILED_LINE in r.getMessage()]
    assert len(lines) == sum(grown.values()) > 0, lines
    assert all("(compiled, or loaded from Triton's cache)" in line for line in lines), lines
    assert any(line.startswith("kernel _layer_norm_fwd_kernel ") for line in lines), lines
    logged.clear()
    _layer_norm_call()
    assert not [r for r in logged.records if COMPILED_LINE in r.getMessage()]
