"""The selftest's rule (a backend's error at most 2x PyTorch's own, per output and gradient) is not
vacuous: a wrong implementation fails, an exact one passes; and pytest's exit 5 (no tests collected)
fails the CUDA test run."""

from __future__ import annotations

import pytest
import torch

from tools import gpu_tests, selftest
from vit_kernels import backend
from vit_kernels.ops.layer_norm import layer_norm_ref

CPU = torch.device("cpu")


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward scales the incoming gradient (a backward-only bug)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _wrong_output(*args):
    y, s = layer_norm_ref(*args)
    return y * 1.001, s


def _wrong_gradient(*args):
    y, s = layer_norm_ref(*args)
    return _ScaleGradient.apply(y, 1.01), s


def _exact(*args):
    """The reference in float64, rounded once to float32: more accurate than PyTorch's float32."""
    wide = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    return tuple(t.float() for t in layer_norm_ref(*wide))


@pytest.fixture
def registered():
    """register(name, fn) as a layer_norm backend for the test; removed afterwards."""
    names = []

    def register(name, fn):
        backend.register("layer_norm", name, fn)
        names.append(name)

    yield register
    for name in names:
        backend.unregister("layer_norm", name)


@pytest.mark.parametrize("fn", [_wrong_output, _wrong_gradient], ids=["output", "gradient"])
def test_wrong_implementation_fails(registered, fn):
    registered("broken", fn)
    row = selftest.check_op("layer_norm", "broken", torch.float32, CPU, timed=False)
    assert not row["passed"], row
    assert row["error_ratio"] > selftest.ERROR_RATIO and row["max_error"] > row["bound"]
    failing = {t["tensor"] for t in row["tensors"] if not t["passed"]}
    assert failing & ({"output 0"} if fn is _wrong_output else {"dx", "dresidual"}), row["tensors"]
    assert "FAIL" in selftest.describe_row(row)


def test_exact_implementation_passes(registered):
    registered("exact", _exact)
    row = selftest.check_op("layer_norm", "exact", torch.float32, CPU, timed=False)
    assert row["passed"], row
    assert (
        row["max_error"] <= row["pytorch_error"] * selftest.ERROR_RATIO
        or row["max_error"] <= row["error_floor"]
    )


def test_torch_backend_is_pytorchs_own_error():
    row = selftest.check_op("linear_gelu", "torch", torch.float32, CPU, timed=False)
    assert row["passed"], row
    assert row["error_ratio"] == pytest.approx(1.0) and row["pytorch_error"] > 0
    assert {t["tensor"] for t in row["tensors"]} == {"output 0", "dx", "dweight", "dbias"}


def test_floor_spares_exact_cases_only():
    judged = selftest.judge(["a", "b"], [0.0, 1e-7], [0.0, 0.0], torch.float32)
    assert judged["passed"] and judged["tensors"][0]["ratio"] == 0.0
    assert not selftest.judge(["a"], [1e-3], [0.0], torch.float32)["passed"]
    assert not selftest.judge(["a"], [3e-3], [1e-3], torch.float16)["passed"]
    assert selftest.judge(["a"], [2e-3], [1e-3], torch.float16)["passed"]


def test_pytest_exit_5_is_a_failure():
    assert (
        gpu_tests.passed(0) and not gpu_tests.passed(gpu_tests.NO_TESTS_COLLECTED) and not gpu_tests.passed(1)
    )
    assert gpu_tests.counts("3 failed, 40 passed, 2 skipped, 1 error in 9.1s") == {
        "passed": 40,
        "failed": 3,
        "skipped": 2,
        "errors": 1,
        "deselected": 0,
    }


def test_main_fails_when_no_gpu_test_ran(monkeypatch, tmp_path):
    """On a GPU, a ``pytest -m gpu`` run that collects nothing fails the selftest."""
    monkeypatch.setattr(selftest, "header", lambda: {"gpu": True})
    monkeypatch.setattr(selftest, "cases", lambda: iter(()))
    monkeypatch.setattr(
        gpu_tests,
        "run_gpu_tests",
        lambda: {"ran": True, "exit_code": 5, "summary": "no tests ran", "passed": gpu_tests.passed(5)},
    )
    assert selftest.main(["--out", str(tmp_path / "r.json")]) == 1
