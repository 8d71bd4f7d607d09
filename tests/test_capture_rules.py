"""What a CUDA graph (torch.cuda.graph, torch.compile's "reduce-overhead") demands of the launch path,
checked where it can be on the CPU: once a signature is decided, a call of every op, forward and
backward, reads nothing back to the host (no .item(), no tensor truth value or conversion to a Python
number: on a GPU each is a synchronisation, which breaks a capture), and nothing is measured while a
graph is being captured. The capture itself runs on CUDA (marked gpu)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import vit
import vit_kernels as vk
from tests.helpers import CPU_BACKENDS, requires_cuda
from vit_kernels.ops.specs import OPS, SPECS, Shape
from vit_kernels import _signature, backend

SMALL = Shape("small", batch=2, tokens=5, dim=12, heads=3, hidden=24, channels=3, image=8, patch=4)
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


@contextlib.contextmanager
def host_reads_forbidden(monkeypatch):
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}() in the launch path: a host synchronisation on a GPU")

        return method

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse(name))
        yield


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "name", [b for b in CPU_BACKENDS if b != "triton"]
)  # the interpreter reads the host itself
def test_decided_calls_read_nothing_back_to_the_host(monkeypatch, name, op):
    reason = backend.unsupported_reason(op, name, torch.device("cpu"), torch.float32)
    if reason is not None:  # the backend's table declares it does not take the op (the extension's SwiGLU)
        pytest.skip(f"{name} does not run {op}: {reason}")
    spec = SPECS[op]
    inputs = {
        k: v.requires_grad_() for k, v in spec.make_inputs(SMALL, torch.device("cpu"), torch.float32).items()
    }
    with vk.use_backend(name, strict=True):
        spec.run(SMALL, **inputs)  # the first call of a signature decides (and may validate)
        with host_reads_forbidden(monkeypatch):
            out = spec.run(SMALL, **inputs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert all(t.grad is not None for t in inputs.values())


def test_nothing_is_measured_while_a_graph_is_captured(monkeypatch):
    """Even inside ``vk.tune`` (its searcher set), a call made while a graph is captured is not timed."""
    backend.clear_decisions()
    measured = []
    monkeypatch.setattr(backend, "searcher", lambda *a: measured.append(a))
    monkeypatch.setattr(_signature, "capturing_cuda_graph", lambda: True)
    vk.layer_norm(torch.randn(3, 8), torch.randn(8), torch.randn(8))
    assert measured == []
    (row,) = [r for r in vk.explain() if r.op == "layer_norm"]
    assert row.source == "table"


@requires_cuda
@pytest.mark.parametrize("name", ["torch", "triton", "extension", "auto"])
def test_vit_forward_and_backward_capture_in_a_cuda_graph(name):
    """Warm up (decisions, autotuning), capture a training step's forward + backward, replay it:
    the replay's loss equals an eager step's on the same inputs."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_patch16_224", num_classes=10).cuda()
    images = torch.randn(4, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 10, (4,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        return loss

    with vk.use_backend(name):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model.zero_grad(set_to_none=False)
                eager = step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        model.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            captured = step()
        model.zero_grad(set_to_none=False)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(captured.float(), eager.float(), atol=1e-3, rtol=1e-3)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", [b for b in CPU_BACKENDS if b != "torch"])
def test_a_second_derivative_through_a_kernel_raises(name):
    """The kernels' backward is not itself differentiable: asking for a second derivative through it
    raises instead of silently treating the first derivative as a constant."""
    x = torch.randn(3, 8, requires_grad=True)
    with vk.use_backend(name, strict=True):
        y = vk.layer_norm(x, torch.randn(8), torch.randn(8))
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()


@pytest.mark.skipif("extension" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_a_second_derivative_goes_through_a_differentiable_backward():
    """patchify's backward is unpatchify, itself differentiable: a gradient penalty through the
    extension's patch_embed works, and agrees with PyTorch's conv2d."""
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    results = []
    for name in ("extension", "torch"):
        with vk.use_backend(name, strict=True):
            out = vk.patch_embed(images, weight, None, patch_size=4)
        (grad,) = torch.autograd.grad(out.square().sum(), images, create_graph=True)
        (second,) = torch.autograd.grad(grad.square().sum(), weight)
        results.append(second)
    torch.testing.assert_close(results[0], results[1])
