"""The runtime's small branches that neither the ops' tests nor the simulated CUDA device reach:
explanations, the extension's reasons, validation's mismatch messages, signatures of unusual
arguments, the fast path's limits, empty GEMMs with sums, patching's refusals."""

from __future__ import annotations

import argparse
import functools
import math

import pytest
import torch
from torch import nn

import vit_kernels as vk
from vit import cli as _cli
from vit_kernels import _accuracy, _ext, _signature, _tiles, _triton, backend, tuning
from vit_kernels.ops import gemm

META = torch.device("meta")


def test_the_help_names_each_default_unless_its_text_does():
    parser = argparse.ArgumentParser(formatter_class=_cli.DefaultsHelp)
    parser.add_argument("--steps", type=int, default=3, help="how many")
    parser.add_argument("--rate", type=float, default=0.5, help="the rate (default: half)")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("path", help="where")
    text = " ".join(parser.format_help().split())
    assert "how many (default: 3)" in text and "the rate (default: half)" in text
    assert "a switch (default" not in text and "where (default" not in text


def test_an_explanation_says_when_nothing_ran_and_what_ran():
    empty = backend.Explanation([])
    assert len(empty) == 0 and empty.ran() == set()
    assert str(empty) == "vit_kernels.explain(): no op has run yet"
    record = backend.Record("linear", "cpu", "torch.float32", "(x)", False, "auto", "torch", "table", "why")
    shown = backend.Explanation([record], [{"kernel": "k", "key": (1,), "tile": (2,), "how": "tuned"}])
    assert shown.ran("linear") == {"torch"} and shown.as_dicts()[0]["reason"] == "why"
    assert "linear cpu float32 (x) no grad: torch (table)" in str(
        shown
    ) and "tile k, (1,): (2,) (tuned)" in str(shown)


def test_the_extension_says_why_it_cannot_run(monkeypatch):
    assert _ext.supports(META, torch.float32) == "the extension has no kernels for meta tensors"
    monkeypatch.setattr(_ext.importlib.util, "find_spec", lambda name: None)
    module, why = _ext._load()
    assert module is None and why.startswith(f"the compiled extension {_ext.EXTENSION} is not built")
    monkeypatch.setattr(_ext, "_load_error", why)
    assert _ext.supports(torch.device("cpu"), torch.float32) == why == _ext.extension_unavailable_reason()


def test_validation_names_a_missing_or_misshapen_result():
    t = torch.ones(2, 3)
    exact = [t.double(), t.double()]
    assert (
        tuning._problem("layer_norm", [t], [t], exact, torch.float32)
        == "1 outputs and gradients, the reference gives 2"
    )
    assert tuning._problem("layer_norm", [t, None], [t, t], exact, torch.float32) == "result 1 is missing"
    assert tuning._problem("layer_norm", [t, None], [t, None], [t.double(), None], torch.float32) is None
    assert (
        tuning._problem("layer_norm", [t.t(), t], [t, t], exact, torch.float32)
        == "result 0 has shape (3, 2), the reference (2, 3)"
    )


def test_signatures_of_unusual_arguments_and_devices(monkeypatch):
    assert _signature.argument_key([torch.zeros(2), [1, 2]], torch.float32)[-1] == "list"
    assert _signature.device_name(META) == "meta"
    monkeypatch.setattr("builtins.open", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no /proc")))
    assert _signature._cpu_name.__wrapped__()  # the platform's name instead of /proc/cpuinfo's
    monkeypatch.undo()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert _signature.untimeable([])
    assert torch.func.vmap(lambda row: torch.tensor(_signature.untimeable([row])))(torch.zeros(2, 3)).all()
    assert _signature.traced_key((torch.zeros(1), None, 2, "s", [1])) == ("tensor", None, 2, "s", "list")


def test_a_relative_error_with_nan_is_infinite():
    assert _accuracy.relative_error(torch.tensor([math.nan, 1.0]), torch.ones(2)) == math.inf


def test_backend_reasons_and_the_fast_paths_limits(monkeypatch):
    assert backend.triton_device_reason(META) in (
        f"Triton kernels do not run on {META.type} tensors",
        "triton is not installed (pip install triton)",
    )
    monkeypatch.setitem(
        backend._registry,
        "layer_norm",
        {k: v for k, v in backend._registry["layer_norm"].items() if k != "extension"},
    )
    assert (
        backend.unsupported_reason("layer_norm", "extension", torch.device("cpu"), torch.float32)
        == "extension does not implement layer_norm"
    )
    monkeypatch.setattr(
        backend, "backend_unavailable_reason", lambda name: "gone" if name == "triton" else None
    )
    available = backend.available_backends()
    assert available["extension"]["layer_norm"] == "not implemented by this backend"
    assert available["triton"]["layer_norm"] == "gone"
    assert backend._cast_plan((1.0,), (2.0,)) is False  # a value normalised: not replayable
    with vk.use_backend("torch"):
        vk.set_backend("torch")
        assert vk.get_backend() == "torch"
    monkeypatch.setattr(backend, "FAST_PATH_ENTRIES", 1)
    for rows in (2, 3):
        vk.layer_norm(torch.randn(rows, 8), torch.ones(8), torch.zeros(8))
    assert len(backend._fast) == 1


def test_gemms_with_no_rows_or_columns_still_give_their_sums():
    a = torch.randn(3, 5)
    c, sums = gemm._matmul_and_sums(a, torch.randn(5, 0), torch.float32, sums=gemm.SUMS_OF_A_ROWS)
    assert c.shape == (3, 0) and torch.allclose(sums, a.sum(1))
    c, sums = gemm._matmul_and_sums(
        torch.randn(0, 5), torch.randn(5, 4), torch.float32, sums=gemm.SUMS_OF_C_COLUMNS
    )
    assert c.shape == (0, 4) and torch.equal(sums, torch.zeros(4))
    dz, bias_grad = gemm._gelu_backward(torch.randn(0, 4), torch.randn(0, 4), 0, True)
    assert dz.shape == (0, 4) and torch.equal(bias_grad, torch.zeros(4))


def test_layer_scale_and_its_weight_check():
    from vit_kernels import nn as vkn

    scale = vkn.LayerScale(4, init_values=0.5)
    x = torch.randn(2, 4)
    assert torch.equal(scale(x), x * 0.5)
    with pytest.raises((TypeError, ValueError), match="weight"):
        vk.linear(torch.randn(2, 4), "not a weight", None, layer_scale=torch.ones(3))


def test_patching_refuses_what_it_cannot_fuse():
    from vit_kernels import nn as vkn

    report = vk.patch_model(nn.Sequential(vkn.LayerScale(4)))
    assert report.replaced == [] and report.skipped == []  # ours already
    report = vk.patch_model(nn.LayerNorm(8))
    assert report.replaced == [] and report.skipped[0][1].startswith("is the model itself")
    silu = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, activation=nn.SiLU()))
    assert "is not ReLU or GELU" in vk.patch_model(silu).skipped[0][1]
    biased = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))
    biased[0].self_attn = nn.MultiheadAttention(16, 2, add_bias_kv=True)
    assert "uses bias_k/bias_v" in vk.patch_model(biased).skipped[0][1]
    odd_proj = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))
    odd_proj[0].self_attn.out_proj = nn.Identity()
    assert "out_proj is not a Linear" in vk.patch_model(odd_proj).skipped[0][1]
    odd_drop = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))
    odd_drop[0].dropout1 = nn.Identity()
    assert vk.patch_model(odd_drop).skipped[0][1] == "dropout layers are not nn.Dropout"
    odd_linear = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))
    odd_linear[0].linear1 = nn.Sequential(nn.Linear(16, 32))
    assert "linear1/linear2 are not nn.Linear" in vk.patch_model(odd_linear).skipped[0][1]


def test_a_patched_encoder_layer_takes_unbatched_input():
    layer = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)).eval()
    x = torch.randn(5, 16)  # (L, D), no batch
    expected = layer(x)
    vk.patch_model(layer)
    with vk.use_backend("torch"):
        out = layer(x)
    assert out.shape == (5, 16) and torch.allclose(out, expected, atol=1e-5)


def test_autocast_of_a_device_type_met_first_at_a_call():
    from vit_kernels._checks import _autocast_devices, autocast_dtype_of

    _autocast_devices.pop("xpu", None)
    assert autocast_dtype_of("xpu") is None and "xpu" in _autocast_devices


def test_quick_gelu_backward_is_the_derivative_of_z_sigmoid_1_702_z():
    from vit_kernels.activations import gelu_backward

    z, grad = torch.randn(64, dtype=torch.float64, requires_grad=True), torch.randn(64, dtype=torch.float64)
    (expected,) = torch.autograd.grad(z * torch.sigmoid(1.702 * z), z, grad)
    assert torch.allclose(gelu_backward(grad, z.detach(), "quick"), expected, rtol=1e-12, atol=1e-14)


def test_triton_says_it_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(backend, "TRITON_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    expected = "no CUDA device, and TRITON_INTERPRET=1 is not set for running Triton on the CPU"
    assert backend.triton_unavailable_reason() in (expected, "triton is not installed (pip install triton)")


def test_the_adapters_helpers_refuse_what_they_do_not_compute():
    from vit_kernels.integrations import _common

    module = nn.Linear(4, 4)
    module.extra = nn.ReLU()
    module.register_buffer("scale", torch.ones(1))
    assert (
        _common.unknown_parts(module, ["other"], ["weight", "bias"])
        == "has submodules ['extra'] and parameters/buffers ['scale'] the fused layer does not compute"
    )
    assert _common.dropout_p(nn.ReLU()) is None
    assert not _common.fusable_mask(torch.ones(2, 2, dtype=torch.int64), torch.device("cpu"), 1, 1, 2)
    assert not _common.fusable_mask([[True]], torch.device("cpu"), 1, 1, 1)


@pytest.mark.parametrize("with_residual", [False, True])
def test_a_projection_with_a_dropping_dropout_adds_the_residual_after_it(with_residual):
    from vit_kernels.integrations import _common

    linear, h = nn.Linear(8, 8), torch.randn(3, 8)
    residual = torch.randn(3, 8) if with_residual else None
    drop = nn.Dropout(0.5).train()
    torch.manual_seed(0)
    out = _common.project(linear, drop, h, residual)
    torch.manual_seed(0)
    expected = drop(linear(h))
    expected = expected + residual if with_residual else expected
    assert torch.allclose(out, expected, atol=1e-6)


def test_patching_refuses_unknown_forward_arguments_and_parts(monkeypatch):
    from vit_kernels.integrations import torch_nn

    # as under a torch whose MultiheadAttention.forward takes an argument the fused layer does not
    monkeypatch.setattr(torch_nn, "MHA_ARGS", [a for a in torch_nn.MHA_ARGS if a != "need_weights"])
    skipped = dict(
        vk.patch_model(nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))).skipped
    )
    assert "self_attn forward takes argument(s) ['need_weights']" in skipped["0"]
    monkeypatch.undo()
    extra_part = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32))
    extra_part[0].adapter = nn.Linear(16, 16)
    skipped = dict(vk.patch_model(extra_part).skipped)
    assert "submodules ['adapter']" in skipped["0"]


def test_a_launch_plan_of_symbolic_sizes_is_made_afresh_and_kept_nowhere():
    """A decided call looks its launch plan up by its sizes; symbolic ones (torch.compile's dynamic
    shapes) have no hash, so theirs is made afresh, the same as for the concrete sizes, and not kept.
    A kept plan is stale once any tile choice changes. An error of a configuration is not taken for
    a missing hash."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from vit_kernels.ops import attention, attention_tiles

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic_length = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]
    )
    symbolic = mode.from_tensor(torch.empty(2, 197, 3 * 12 * 96), symbolic_context=dynamic_length)
    concrete = torch.empty(2, 197, 3 * 12 * 96)
    assert isinstance(symbolic.shape[1], torch.SymInt)
    tile = attention_tiles.AttentionTile(64, 32, 4, 3)
    plans: dict = {}

    def plan_of(qkv):
        key = attention._plan_key(qkv, 12, 0.125, 0.0, None, None)
        assert _tiles.decided(plans, key) is None
        made = attention._launch_config(tile, True, qkv, 12, 0.0, None, None)
        return key, _tiles.keep(plans, key, made)

    _, (grid, config) = plan_of(symbolic)
    assert plans == {}
    key, (concrete_grid, concrete_config) = plan_of(concrete)  # the interpreter's: kept
    assert config == concrete_config and [int(g) for g in grid] == list(concrete_grid) == [7 * 24]
    assert concrete_config["BLOCK_TAIL"] == 16 and concrete_config["BLOCK_D"] == 128
    assert not concrete_config["EVEN_D"]
    assert _tiles.decided(plans, key) == (concrete_grid, concrete_config)
    attention_tiles.FWD_CHOOSER.pin(("another key",), tile)
    assert _tiles.decided(plans, key) is None

    def broken(size):
        raise TypeError("a bug of the configuration")

    with pytest.raises(TypeError, match="a bug of the configuration"):
        _triton.cached_call(functools.lru_cache(broken), 3)


def test_a_plan_made_while_tracing_is_kept_nowhere():
    """Under a dispatch mode that traces (fake tensors, make_fx, AOTAutograd) a plan's sizes and
    scalars may be symbolic, and a SymFloat hashes: even a settled tile's plan is not kept there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    plans: dict = {}
    with FakeTensorMode():
        assert _tiles.keep(plans, ("call",), "plan") == "plan"
    assert plans == {}
    assert _tiles.keep(plans, ("call",), "plan") == "plan"
    assert _tiles.decided(plans, ("call",)) == "plan"
    _tiles.forget()
    assert _tiles.decided(plans, ("call",)) is None


@pytest.mark.skipif(
    backend.triton_device_reason(torch.device("cpu")) is not None, reason="needs the interpreter"
)
def test_a_warm_call_with_another_scale_or_eps_launches_by_its_own_plan():
    """A plan holds the launch's scalars (attention's scale and dropout, LayerNorm's eps): calls that
    differ only in them, in turn and again, each compute by their own."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 9, 3 * 2 * 16)
    q, k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2).double() for t in qkv.chunk(3, dim=-1))
    x, weight, bias = torch.randn(3, 5, 24) * 3, torch.randn(24), torch.randn(24)
    with vk.use_backend("triton", strict=True):
        for scale in (0.1, 0.7, 0.1, 0.7):
            expected = torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v
            out = vk.attention(qkv, 2, scale=scale)
            torch.testing.assert_close(
                out.double(), expected.transpose(1, 2).flatten(2), atol=2e-5, rtol=2e-5
            )
        for eps in (1e-5, 10.0, 1e-5, 10.0):
            s = x.double()
            mean, var = s.mean(-1, keepdim=True), s.var(-1, unbiased=False, keepdim=True)
            expected = (s - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()
            torch.testing.assert_close(
                vk.layer_norm(x, weight, bias, eps).double(), expected, atol=2e-5, rtol=2e-5
            )


WITHOUT_TRITON = """
import sys, warnings
sys.modules["triton"] = None  # import triton raises ImportError, as where it is not installed
warnings.simplefilter("error")
import torch, vit, vit_kernels as vk
reasons = set(vk.available_backends()["triton"].values())
assert reasons == {"triton is not installed (pip install triton)"}, reasons
model = vit.create_model("vit_digits")
model(torch.randn(2, 1, 8, 8)).square().sum().backward()
assert vk.explain().ran() <= {"torch", "extension"}, vk.explain()
with vk.use_backend("triton"):
    pass
"""


def test_the_package_imports_and_trains_without_triton():
    """Where Triton is not installed the package imports without a word on stderr, a model trains
    on the other backends, and asking for Triton says why it cannot."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0 and "RuntimeError: backend 'triton' is not available" in result.stderr, (
        result.stderr
    )
    before_the_request = result.stderr.split("Traceback")[0]
    assert before_the_request == "", before_the_request


def test_write_atomically_replaces_the_file_whole_and_leaves_nothing_behind_on_failure(tmp_path, monkeypatch):
    from vit_kernels import _files

    path = tmp_path / "made" / "metrics.json"
    _files.write_atomically(path, "first")
    _files.write_atomically(path, "second")
    assert path.read_text() == "second" and sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _files.write_atomically(path, "third")
    assert path.read_text() == "second" and sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]
