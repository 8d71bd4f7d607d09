"""With the package's log at INFO, each new variant of a kernel is a line: the kernel, its launch
configuration, its tensors' dtypes and the seconds its first launch took (a compile, or a load from
Triton's cache), so that a first step's wait is explained. Silent at the default level."""

from __future__ import annotations

import re

import pytest
import torch

import vit_kernels as vk
from vit_kernels import _triton

if not _triton.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)


def _source(X, n, BLOCK):
    """The stand-in kernel's parameters."""


class _Kernel:
    """Stands in for a JITFunction: a call of a specialisation not met before adds a variant to its
    per-device cache, as Triton's compile does."""

    def __init__(self):
        self.fn = _source
        self.device_caches = {0: ({}, "target", "backend", "binder")}
        self.launches = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.device_caches[0][0].setdefault((dtypes, tuple(sorted(kwargs.items()))), "compiled")
            return "compiled"

        return run


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vit_kernels"]


def test_each_new_variant_is_one_line_naming_kernel_configuration_dtypes_and_seconds(caplog):
    kernel, x = _Kernel(), torch.randn(8)
    with caplog.at_level("INFO", logger="vit_kernels"):
        for block in (16, 16, 32, 16):
            _triton.launch(kernel, (1,), x, 8, BLOCK=block, num_warps=4)
        _triton.launch(kernel, (1,), x.half(), 8, BLOCK=16, num_warps=4)
    assert kernel.launches == 5
    pattern = r"kernel _source BLOCK={} num_warps=4 for {}: first launch in \d+\.\d\d s \(compiled, or loaded from Triton's cache\)"
    lines = _messages(caplog)
    assert len(lines) == 3, lines
    for line, (block, dtype) in zip(lines, [(16, "float32"), (32, "float32"), (16, "float16")]):
        assert re.fullmatch(pattern.format(block, dtype), line), line


def test_a_plans_launch_with_direct_launches_on_is_logged_too(caplog):
    kernel, x, plan = _Kernel(), torch.randn(8), object()
    with _triton.direct_launch(True), caplog.at_level("INFO", logger="vit_kernels"):
        for _ in range(2):
            _triton.launch(kernel, (1,), x, 8, plan=plan, BLOCK=16, num_warps=4)
    assert kernel.launches == 2 and len(_messages(caplog)) == 1


def test_nothing_is_logged_at_the_default_level(caplog):
    kernel = _Kernel()
    with caplog.at_level("WARNING", logger="vit_kernels"):
        _triton.launch(kernel, (1,), torch.randn(8), 8, BLOCK=16, num_warps=4)
    assert kernel.launches == 1 and len(kernel.device_caches[0][0]) == 1
    assert not _messages(caplog)


@pytest.mark.skipif(
    vk.backend.triton_unavailable_reason() is not None, reason="the Triton backend cannot run here"
)
def test_an_interpreted_kernels_first_launch_is_one_line(caplog, monkeypatch):
    monkeypatch.setattr(_triton, "_first_launches", set())
    x, weight, bias = torch.randn(3, 40), torch.randn(40), torch.randn(40)
    with vk.use_backend("triton", strict=True), caplog.at_level("INFO", logger="vit_kernels"):
        vk.layer_norm(x, weight, bias)
        first = _messages(caplog)
        vk.layer_norm(x, weight, bias)
    assert len(first) == 1, first
    assert re.fullmatch(
        r"kernel _layer_norm_fwd_kernel \S.* for float32: first launch in \d+\.\d\d s \(interpreted\)",
        first[0],
    )
    assert _messages(caplog) == first
