"""``vk.selftest``: its rule (a backend's error at most 2x PyTorch's own, per output and gradient,
against float64) is not vacuous: a wrong implementation fails, an exact one passes, at the specs'
shapes and at the shapes a model's own calls meet; the command line's report says so."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import vit_kernels as vk
from vit.model import create_model
from vit_kernels import _accuracy, backend, selftest
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
    row = selftest.check_op("layer_norm", "broken", torch.float32, CPU)
    assert not row["passed"], row
    assert row["error_ratio"] > _accuracy.ERROR_RATIO and row["max_error"] > row["bound"]
    failing = {t["tensor"] for t in row["tensors"] if not t["passed"]}
    assert failing & ({"output 0"} if fn is _wrong_output else {"dx", "dresidual"}), row["tensors"]
    assert selftest.describe_row(row).startswith("FAIL layer_norm")


def test_exact_implementation_passes(registered):
    registered("exact", _exact)
    row = selftest.check_op("layer_norm", "exact", torch.float32, CPU)
    assert row["passed"], row
    assert {t["tensor"] for t in row["tensors"]} == {
        "output 0",
        "output 1",
        "dx",
        "dweight",
        "dbias",
        "dresidual",
    }


def test_torch_backend_is_pytorchs_own_error():
    row = selftest.check_op("linear_gelu", "torch", torch.float32, CPU)
    assert row["passed"], row
    assert row["error_ratio"] == pytest.approx(1.0) and row["pytorch_error"] > 0
    assert {t["tensor"] for t in row["tensors"]} == {"output 0", "dx", "dweight", "dbias"}


def test_an_implementation_that_raises_is_a_failure_with_its_reason(registered):
    def raising(*args):
        raise RuntimeError("no kernel for this")

    registered("raising", raising)
    row = selftest.check_op("layer_norm", "raising", torch.float32, CPU)
    assert not row["passed"] and row["error"] == "RuntimeError: no kernel for this"


def test_floor_spares_exact_cases_only():
    floor32, floor16 = _accuracy.FLOORS[torch.float32], _accuracy.FLOORS[torch.float16]
    judged = _accuracy.judge(["a", "b"], [0.0, 1e-7], [0.0, 0.0], floor32)
    assert judged["passed"] and judged["tensors"][0]["ratio"] == 0.0
    assert not _accuracy.judge(["a"], [1e-3], [0.0], floor32)["passed"]
    assert not _accuracy.judge(["a"], [3e-3], [1e-3], floor16)["passed"]
    assert _accuracy.judge(["a"], [2e-3], [1e-3], floor16)["passed"]


def _digits(training: bool):
    torch.manual_seed(0)
    model = create_model("vit_digits").train(training)
    return model, (torch.randn(3, 1, 8, 8),)


def test_a_models_calls_are_checked_at_their_shapes_on_every_backend(capsys):
    model, inputs = _digits(training=True)
    report = vk.selftest(model, inputs)
    rows = report["checks"]
    assert report["passed"], [r for r in rows if not r["passed"]]
    assert {r["op"] for r in rows} == {"patch_embed", "layer_norm", "linear", "attention", "mlp"}
    assert {r["backend"] for r in rows} >= {"torch", "triton"}
    # each distinct signature once, at the model's own sizes (3 images of 4 + 1 tokens, width 64)
    attention = [r for r in rows if r["op"] == "attention" and r["backend"] == "torch"]
    assert len(attention) == 1 and "(4,5,192)" in attention[0]["shapes"]
    assert all(len(r["tensors"]) > 1 for r in rows)  # outputs and the gradients of a training step
    assert len(capsys.readouterr().out.splitlines()) == len(rows) + 1  # the no-GPU line, then a row each
    assert backend._registry["layer_norm"]["torch"].fn is layer_norm_ref  # the recorder is gone


def test_an_inference_pass_under_autocast_checks_outputs_in_its_dtype():
    model, inputs = _digits(training=False)
    report = selftest.selftest(model, inputs, autocast=torch.bfloat16, ops=("attention", "mlp"))
    assert report["passed"] and {r["op"] for r in report["checks"]} == {"attention", "mlp"}
    for row in report["checks"]:
        assert row["dtype"] == "bfloat16" and [t["tensor"] for t in row["tensors"]] == ["output 0"], row


def test_a_wrong_kernel_at_the_models_shapes_fails(monkeypatch):
    triton = backend._registry["layer_norm"]["triton"]
    monkeypatch.setitem(
        backend._registry["layer_norm"], "triton", dataclasses.replace(triton, fn=_wrong_gradient)
    )
    model, inputs = _digits(training=True)
    report = selftest.selftest(model, inputs, ops=("layer_norm",))
    verdicts = {r["backend"]: r["passed"] for r in report["checks"]}
    assert not report["passed"] and verdicts["triton"] is False and verdicts["torch"] is True


def test_the_recorder_is_removed_when_the_model_raises():
    class Broken(torch.nn.Module):
        def forward(self, x):
            vk.layer_norm(x, torch.ones(4), torch.zeros(4), 1e-5)
            raise ValueError("the model's own error")

    original = backend._registry["layer_norm"]["torch"]
    with pytest.raises(ValueError, match="the model's own error"):
        selftest.selftest(Broken(), (torch.randn(2, 4),))
    assert backend._registry["layer_norm"]["torch"] is original


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        selftest.selftest(ops=("convolution",))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        selftest.selftest(object(), ())
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        selftest.selftest(torch.nn.Identity(), torch.randn(2))


def test_the_command_line_writes_the_report_and_fails_on_a_failed_check(registered, monkeypatch, tmp_path):
    registered("broken", _wrong_output)
    monkeypatch.setattr(selftest, "cases", lambda ops: iter([("layer_norm", "broken", torch.float32, CPU)]))
    out = tmp_path / "reports" / "selftest.json"
    assert selftest.main(["--out", str(out), "--ops", "layer_norm"]) == 1
    report = json.loads(out.read_text())
    assert not report["passed"] and [r["backend"] for r in report["checks"]] == ["broken"]
    assert report["versions"]["torch"] == torch.__version__ and "rule" in report
    assert list(tmp_path.joinpath("reports").iterdir()) == [out]  # no temporary file left beside it


def test_vk_selftest_is_the_function_and_the_module():
    assert "selftest" in vk.__all__ and callable(vk.selftest) and vk.selftest.main is selftest.main
