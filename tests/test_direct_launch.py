"""``_triton.launch`` with a plan: the plan's first call goes through ``kernel[grid]``, later calls of
the same specialisation launch the compiled kernel directly with the argument list ``kernel[grid]``
gives it (every parameter in order, keywords and defaults after the positional arguments), and any
other call (a tensor of another dtype or 16-byte alignment, None for a tensor, another scalar) goes
through ``kernel[grid]`` again. A stand-in kernel records both ways of launching. On a GPU (``gpu``
cases), every op's warm call gives the same bits launched either way."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from benchmarks.host_overhead import VIT_B, forward_then_backward, pointer_tiles
from tests.helpers import CUDA, cuda_param, device_reason, spy_direct_launches
from tools.op_specs import OPS, SPECS

from vit_kernels._triton import FP_FUSION, HAS_TRITON, direct_launch, launch, recorded_launches, triton

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)


def _kernel_source(X, Y, n, scale, BLOCK, EVEN=True):
    """The stand-in kernel's parameters (BLOCK and EVEN its constants)."""


class _Compiled(triton.compiler.CompiledKernel):
    module = None  # nothing loaded

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *values: self.calls.append(("direct", grid, values))


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the call and returns a
    compiled kernel whose direct launches record theirs."""

    def __init__(self):
        self.fn = _kernel_source  # the Python function, as a JITFunction holds it
        self.calls: list = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return _Compiled(self.calls)

        return run


@pytest.fixture(autouse=True)
def _direct_on(request, monkeypatch):
    if "cuda" not in request.node.name:  # the stand-in kernel's launches, on device 0 of no GPU
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with direct_launch(True):
        yield


def test_a_change_of_the_current_device_goes_through_kernel_grid(monkeypatch):
    kernel, plan, x, y = _Kernel(), ["a plan"], torch.randn(64), torch.randn(64)
    for device in (0, 1, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda device=device: device)
        launch(kernel, (1,), x, y, 64, 0.5, plan=plan, BLOCK=32)
    assert [call[0] for call in kernel.calls] == ["jit", "jit", "direct"]


def test_a_plans_later_calls_launch_directly_with_every_parameter_in_order():
    kernel, plan, grid = _Kernel(), ("a plan",), (3, 1, 1)
    x, y = torch.randn(64), torch.randn(64)
    launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32, num_warps=4)
    launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32, num_warps=4)
    other_x = torch.randn(64)
    launch(kernel, grid, other_x, y, 64, 0.5, plan=plan, BLOCK=32, num_warps=4)
    assert [call[0] for call in kernel.calls] == ["jit", "direct", "direct"]
    assert kernel.calls[1] == ("direct", grid, (x, y, 64, 0.5, 32, True))
    assert kernel.calls[2][2][0] is other_x


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x, y: (x.double(), y, 64, 0.5), id="another dtype"),
        pytest.param(lambda x, y: (torch.randn(65)[1:], y, 64, 0.5), id="not 16-byte aligned"),
        pytest.param(lambda x, y: (x, None, 64, 0.5), id="None for a tensor"),
        pytest.param(lambda x, y: (x, y, 48, 0.5), id="another integer"),
        pytest.param(lambda x, y: (x, y, 64, 0.25), id="another float"),
    ],
)
def test_another_specialisation_goes_through_kernel_grid_and_becomes_the_direct_launch(change):
    kernel, plan, grid = _Kernel(), ("a plan",), (3,)
    x, y = torch.randn(64), torch.randn(64)
    launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32)
    changed = change(x, y)
    launch(kernel, grid, *changed, plan=plan, BLOCK=32)
    launch(kernel, grid, *changed, plan=plan, BLOCK=32)
    assert [call[0] for call in kernel.calls] == ["jit", "jit", "direct"]
    assert kernel.calls[1][2] == changed and kernel.calls[2][2][:4] == changed


def test_every_launch_through_kernel_grid_states_fp_fusion():
    kernel, plan, grid = _Kernel(), ("a plan",), (1,)
    x, y = torch.randn(64), torch.randn(64)
    launch(kernel, grid, x, y, 64, 0.5, BLOCK=32)
    launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32, num_warps=4)
    with direct_launch(False):
        launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32)
    with recorded_launches() as recorded:
        launch(kernel, grid, x, y, 64, 0.5, plan=plan, BLOCK=32)
    stated = [call[3] for call in kernel.calls] + [kwargs for _, _, _, kwargs in recorded]
    assert len(stated) == 4 and all(kwargs["enable_fp_fusion"] is FP_FUSION is True for kwargs in stated)


def test_without_a_plan_or_turned_off_every_launch_goes_through_kernel_grid():
    kernel, grid = _Kernel(), (1,)
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        launch(kernel, grid, x, y, 64, 0.5, BLOCK=32)
    with direct_launch(False):
        for _ in range(2):
            launch(kernel, grid, x, y, 64, 0.5, plan=("a plan",), BLOCK=32)
    assert [call[0] for call in kernel.calls] == ["jit"] * 4


def test_another_plan_object_is_another_direct_launch():
    kernel, grid = _Kernel(), (1,)
    x, y = torch.randn(64), torch.randn(64)
    first, second = ["a plan"], ["a plan"]  # equal, not the same object
    launch(kernel, grid, x, y, 64, 0.5, plan=first, BLOCK=32)
    launch(kernel, grid, x, y, 64, 0.5, plan=second, BLOCK=32)
    launch(kernel, grid, x, y, 64, 0.5, plan=second, BLOCK=32)
    assert [call[0] for call in kernel.calls] == ["jit", "jit", "direct"]


def test_a_kernel_grid_that_returns_no_compiled_kernel_is_never_launched_directly():
    """The interpreter's ``kernel[grid]`` returns None."""
    calls = []

    class Interpreted(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(args)

    kernel, plan = Interpreted(), ("a plan",)
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(3):
        launch(kernel, (1,), x, y, 64, 0.5, plan=plan, BLOCK=32)
    assert len(calls) == 3


@pytest.mark.parametrize(
    "op", [cuda_param(op, id=op, skip_reason=device_reason("triton", CUDA)) for op in OPS]
)
def test_a_warm_call_launched_directly_gives_the_same_bits_on_the_gpu(monkeypatch, op):
    """Forward and backward of ``op`` at ViT-B/16 shapes (batch 2) in bfloat16 on the triton backend:
    the third call with direct launches (the first decides, the second makes the direct launches)
    against a call through ``kernel[grid]`` on the same inputs and output gradients: outputs and
    gradients bit for bit. The GEMMs by the pointer kernel's tiles: on Hopper the 16-bit GEMMs of these
    shapes run the TMA kernel, whose descriptors are made per call, with no plan to launch directly."""
    torch.manual_seed(0)
    inputs = {k: v.requires_grad_() for k, v in SPECS[op].make_inputs(VIT_B, CUDA, torch.bfloat16).items()}
    forward, backward = forward_then_backward(lambda: SPECS[op].run(VIT_B, **inputs))

    def run() -> list:
        outputs = [o.detach().clone() for o in forward()]
        backward()
        grads = [t.grad.clone() for t in inputs.values() if t.grad is not None]
        for t in inputs.values():
            t.grad = None
        return outputs + grads

    launched = spy_direct_launches(monkeypatch)
    with vk.use_backend("triton", strict=True), pointer_tiles():
        with direct_launch(False):
            through_jit = run()
        with direct_launch(True):
            run()
            direct = run()
        torch.cuda.synchronize()
    assert any(launched), "no launch of the warm call was direct"
    assert len(direct) == len(through_jit)
    for i, (a, b) in enumerate(zip(direct, through_jit)):
        assert torch.equal(a, b), f"{op}: result {i} differs launched directly"
