"""The backend registry and switch: names, availability reasons, preference, auto's choice."""

import os
import subprocess
import sys

import pytest
import torch

import vit_kernels as vk
from vit_kernels import backend


def test_available_backends_reports_every_backend_and_op():
    report = vk.available_backends()
    assert set(report) == set(backend.BACKENDS)
    for per_op in report.values():
        assert set(per_op) == set(backend.OPS)
        assert all(v is True or (isinstance(v, str) and v) for v in per_op.values())
    assert all(v is True for v in report["torch"].values())


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="backend must be one of .*'auto'.*'triton'.*'extension'.*'torch'"):
        vk.set_backend("cudnn")


def test_unavailable_backend_raises_with_reason():
    reason = backend.backend_unavailable_reason("extension")
    if reason is None:
        pytest.skip("the extension is built here")
    with pytest.raises(RuntimeError, match="backend 'extension' is not available: .*vit_kernels._C"):
        vk.set_backend("extension")


def test_use_backend_restores_previous_choice():
    vk.set_backend("torch")
    with vk.use_backend("auto"):
        assert vk.get_backend() == "auto"
    assert vk.get_backend() == "torch"
    with pytest.raises(KeyError):
        with vk.use_backend("auto"):
            raise KeyError("boom")
    assert vk.get_backend() == "torch"


@pytest.fixture
def fake_triton_linear():
    """Temporarily register a 'triton' linear that tags its output, supported on float32 only."""
    calls = []

    def fake(x, weight, bias, residual):
        calls.append(x.dtype)
        return torch.nn.functional.linear(x, weight, bias) + (0 if residual is None else residual)

    saved = dict(backend._registry["linear"])
    saved_check = backend._backend_checks.get("triton")
    backend.register("linear", "triton", fake, supports=lambda d, t: None if t == torch.float32 else "float32 only")
    backend.register_backend_check("triton", lambda: None)
    yield calls
    backend._registry["linear"] = saved
    backend._backend_checks["triton"] = saved_check


def test_auto_prefers_registered_kernel_and_falls_back(fake_triton_linear):
    vk.set_backend("auto")
    vk.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert fake_triton_linear == [torch.float32]
    vk.linear(torch.randn(2, 4).double(), torch.randn(3, 4).double())  # unsupported dtype: torch runs
    assert fake_triton_linear == [torch.float32]
    assert backend.resolve("layer_norm", torch.device("cpu"), torch.float32).backend != "triton"


def test_explicit_backend_raises_where_it_cannot_run(fake_triton_linear):
    vk.set_backend("triton")
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run linear on cpu torch.float64: float32 only"):
        vk.linear(torch.randn(2, 4).double(), torch.randn(3, 4).double())
    # ops the backend does not implement use the automatic choice
    vk.layer_norm(torch.randn(2, 4), None, None)


def test_auto_skips_implementations_not_preferred(fake_triton_linear):
    backend.register("linear", "triton", backend._registry["linear"]["triton"].fn, preferred=lambda d, t: False)
    vk.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert fake_triton_linear == []


def _run_with_env(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def test_environment_variable_sets_initial_backend():
    done = _run_with_env("import vit_kernels as vk; print(vk.get_backend())", VIT_KERNELS_BACKEND="torch")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch"
    bad = _run_with_env("import vit_kernels", VIT_KERNELS_BACKEND="fastest")
    assert bad.returncode != 0 and "VIT_KERNELS_BACKEND must be one of" in bad.stderr
