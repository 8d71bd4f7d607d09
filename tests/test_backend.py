"""The backend registry and switch: names, availability reasons, preference, auto's choice."""

import os
import subprocess
import sys

import pytest
import torch

import vit_kernels as vk
from tools.cuda_sim import simulated_cuda
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
def fake_kernel_linear():
    """Temporarily register a 'kernel' linear, supported on float32 only and the static default."""
    calls = []

    def fake(x, weight, bias, residual):
        calls.append(x.dtype)
        return torch.nn.functional.linear(x, weight, bias) + (0 if residual is None else residual)

    backend.register(
        "linear",
        "kernel",
        fake,
        supports=lambda d, t: None if t == torch.float32 else "float32 only",
        preferred=lambda d, t, g: True,
    )
    backend.clear_decisions()
    yield calls
    backend.unregister("linear", "kernel")
    backend.clear_decisions()


def test_auto_takes_the_static_default_and_falls_back(fake_kernel_linear):
    vk.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert fake_kernel_linear == [torch.float32]
    vk.linear(torch.randn(2, 4).double(), torch.randn(3, 4).double())  # unsupported dtype: torch runs
    assert fake_kernel_linear == [torch.float32]
    assert [r.backend for r in vk.explain()] == ["kernel", "torch"]
    assert backend.resolve("layer_norm", torch.device("cpu"), torch.float32).backend != "triton"


def test_explicit_backend_falls_back_with_a_warning_or_raises_when_strict(fake_kernel_linear):
    vk.set_backend("kernel")
    with pytest.warns(
        RuntimeWarning, match="backend 'kernel' cannot run linear on cpu torch.float64: float32 only"
    ):
        vk.linear(torch.randn(2, 4).double(), torch.randn(3, 4).double())
    assert vk.explain().rows[-1].source == "fallback"
    vk.set_backend("kernel", strict=True)
    with pytest.raises(
        RuntimeError, match="backend 'kernel' cannot run linear on cpu torch.float64 .*: float32 only"
    ):
        vk.linear(torch.randn(2, 4).double(), torch.randn(3, 4).double())
    # ops the backend does not implement use the automatic choice, strict or not
    with pytest.raises(RuntimeError, match="backend 'kernel' does not implement layer_norm"):
        vk.layer_norm(torch.randn(2, 4), None, None)
    vk.set_backend("kernel")
    vk.layer_norm(torch.randn(2, 4), None, None)


def test_auto_skips_implementations_not_preferred(fake_kernel_linear):
    backend.register(
        "linear", "kernel", backend._registry["linear"]["kernel"].fn, preferred=lambda d, t, g: False
    )
    vk.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert fake_kernel_linear == []


@pytest.mark.parametrize("arch", [90, 80])
def test_the_tables_defaults_are_the_measured_winners_else_the_reference(arch):
    """The implementations the committed measurements found faster: the extension's patch_embed on
    CPU float32; on CUDA in 16 bits Triton's patch_embed and, without gradients, the extension's
    layer_norm forward; on sm_90 in 16 bits with gradients Triton's attention (measured on an H100
    and an H200, never on sm_80); PyTorch's everywhere else."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with simulated_cuda(arch):
        for op in backend.OPS:
            for name, impl in backend._registry[op].items():
                for grad in (False, True):
                    expected_cpu = op == "patch_embed" and name == "extension"
                    assert impl.preferred(cpu, torch.float32, grad) is expected_cpu, (op, name)
                    for dtype in (torch.float16, torch.bfloat16):
                        expected_cuda = (
                            (op, name) == ("patch_embed", "triton")
                            or ((op, name) == ("layer_norm", "extension") and not grad)
                            or ((op, name) == ("attention", "triton") and grad and arch == 90)
                        )
                        assert impl.preferred(cuda, dtype, grad) is expected_cuda, (op, name, dtype, grad)
                    assert not impl.preferred(cuda, torch.float32, grad), (op, name)


def test_shape_limits_are_in_the_tables_not_inside_implementations():
    qkv = torch.randn(1, 3, 3 * 300)
    assert (
        "head dim 300 > 256"
        in backend.unsupported_reason(
            "attention",
            "triton",
            torch.device("cpu"),
            torch.float32,
            (qkv, 1, None, 0.0, False, None, None, "interleaved", None),
        )
        or backend.triton_device_reason(torch.device("cpu")) is not None
    )
    x = torch.randn(2, 70000)
    reason = backend._registry["layer_norm"]["triton"].limits(x, None, None, 1e-6, None)
    assert reason is not None and "65536" in reason
    reason = backend._registry["linear"]["extension"].limits(x, None, None, None)
    assert reason is not None and "no residual" in reason


def _run_with_env(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )


def test_environment_variable_sets_initial_backend():
    done = _run_with_env("import vit_kernels as vk; print(vk.get_backend())", VIT_KERNELS_BACKEND="torch")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch"
    bad = _run_with_env("import vit_kernels", VIT_KERNELS_BACKEND="fastest")
    assert bad.returncode != 0 and "VIT_KERNELS_BACKEND must be one of" in bad.stderr


@pytest.mark.parametrize("arch", [90, 80])
def test_under_torch_compile_the_table_keeps_only_what_beat_inductor(arch):
    """Inside a compiled graph the table runs our kernels only where they were measured ahead of
    torch.compile (CUDA 16-bit: the patch embedding; attention's cuDNN backward won inside a compiled
    step); every other op stays PyTorch's for Inductor to fuse, the CPU's eager defaults included."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with simulated_cuda(arch):
        for op in backend.OPS:
            for name, impl in backend._registry[op].items():
                for grad in (False, True):
                    assert not impl.compiled(cpu, torch.float32, grad), (op, name)
                    for dtype in (torch.float16, torch.bfloat16):
                        expected = (op, name) == ("patch_embed", "triton")
                        assert impl.compiled(cuda, dtype, grad) is expected, (op, name, dtype, grad)
