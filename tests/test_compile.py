"""torch.compile honours the backend choice: a graph holds the implementation asked for when it was
traced, and a changed choice (or decision) traces again instead of reusing a graph made for another.
On the CPU the extension's registered ops stand for the kernels (the Triton interpreter cannot run
under fake tensors); the same checks with the Triton ops run on CUDA (marked gpu)."""

from __future__ import annotations

import warnings

import pytest
import torch

import vit
import vit_kernels as vk
from tests.helpers import CPU_BACKENDS, requires_cuda
from tools.graph_capture import GraphCapture, JointCapture, kernel_ops
from vit_kernels import _ext, backend

needs_extension = pytest.mark.skipif(
    _ext.supports(torch.device("cpu"), torch.float32) is not None, reason="vit_kernels._C is not built"
)


def block_ops(x, w, b, qkv):
    return vk.layer_norm(x, w, b), vk.attention(qkv, 2)


def _inputs():
    return torch.randn(2, 5, 16), torch.randn(16), torch.randn(16), torch.randn(2, 5, 48)


@needs_extension
def test_each_backend_is_the_one_in_the_compiled_graph():
    capture = GraphCapture()
    compiled = torch.compile(block_ops, backend=capture, fullgraph=True)
    inputs = _inputs()
    with vk.use_backend("torch"):
        reference = compiled(*inputs)
    assert not any(op.startswith("vit_kernels.") for op in capture.ops()), capture.ops()
    with vk.use_backend("extension"):
        fused = compiled(*inputs)
    assert len(capture.graphs) == 2, "a changed choice must trace again, not reuse the torch graph"
    # the extension's attention is one C++ composition (GEMMs around the softmax kernel), which
    # Dynamo keeps as one call; AOTAutograd decomposes it (test_compositions_decompose_into_the_kernels)
    assert {"vit_kernels.fused_layer_norm", "vit_kernels.attention_explicit"} <= capture.ops()
    for r, f in zip(reference, fused):
        torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)
    eager = block_ops(*inputs)
    for r, e in zip(reference, eager):
        torch.testing.assert_close(r, e, atol=1e-5, rtol=1e-5)
    with vk.use_backend("torch"):
        compiled(*inputs)  # back to the first choice: its graph is still cached and valid
    assert len(capture.graphs) == 2
    traced = {(row.op, row.backend) for row in vk.explain() if row.source.endswith("(traced)")}
    assert {("layer_norm", "torch"), ("layer_norm", "extension"), ("attention", "extension")} <= traced


@needs_extension
def test_set_backend_retraces():
    capture = GraphCapture()
    compiled = torch.compile(block_ops, backend=capture, fullgraph=True)
    inputs = _inputs()
    vk.set_backend("extension")
    compiled(*inputs)
    assert "vit_kernels.fused_layer_norm" in capture.ops()
    vk.set_backend("torch")
    compiled(*inputs)
    assert len(capture.graphs) == 2 and "vit_kernels.fused_layer_norm" not in capture.ops()


@requires_cuda
@pytest.mark.parametrize("name", ["triton", "extension", "torch"])
def test_vit_compiled_under_each_backend_runs_it_on_cuda(name):
    """A ViT compiled under use_backend(name) holds that backend's ops and agrees with eager."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_patch16_224", num_classes=10).cuda()
    images = torch.randn(4, 3, 224, 224, device="cuda")
    capture = GraphCapture()
    with vk.use_backend(name), torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(images)
        compiled = torch.compile(model, backend=capture, fullgraph=True)(images)
    ours = kernel_ops(capture.graphs[-1:])
    if name == "torch":
        assert not ours, ours
    else:
        assert ours, f"no vit_kernels op in the graph compiled under {name}"
    torch.testing.assert_close(compiled.float(), eager.float(), atol=5e-2, rtol=5e-2)
    with vk.use_backend(name), torch.autocast("cuda", dtype=torch.bfloat16):
        inductor = torch.compile(model, fullgraph=True)(images)
    torch.testing.assert_close(inductor.float(), eager.float(), atol=5e-2, rtol=5e-2)


@needs_extension
def test_eager_calls_between_compiled_ones_retrace_nothing():
    capture = GraphCapture()
    compiled = torch.compile(lambda x, w, b: vk.layer_norm(x, w, b), backend=capture, fullgraph=True)
    inputs = _inputs()[:3]
    compiled(*inputs)
    vk.layer_norm(*inputs)  # eager calls decide nothing new
    backend.clear_decisions()
    compiled(*inputs)
    assert len(capture.graphs) == 1


@pytest.mark.parametrize("name", [b for b in CPU_BACKENDS if b != "torch"])
def test_vmap_over_the_kernels_runs_them_per_sample(name):
    """Under a functorch transform the registered op is called (the dispatcher applies vmap to it),
    not the eager fast path, which would hand batched tensors to a kernel."""
    x, w, b = torch.randn(3, 4, 8), torch.randn(8), torch.randn(8)
    with vk.use_backend(name, strict=True):
        batched = torch.vmap(lambda row: vk.layer_norm(row, w, b))(x)
        looped = torch.stack([vk.layer_norm(row, w, b) for row in x])
    torch.testing.assert_close(batched, looped)


@needs_extension
def test_auto_under_compile_leaves_what_inductor_fuses_to_it():
    """On CPU float32 the table's eager default for the patch embedding is the extension; inside a
    compiled graph (not measured ahead of torch.compile) it is the reference's ops, for Inductor."""
    images, weight, bias = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 8, 8), torch.randn(8)
    eager = vk.patch_embed(images, weight, bias, patch_size=8)
    assert ("patch_embed", "extension", "table") in {(r.op, r.backend, r.source) for r in vk.explain()}
    capture = GraphCapture()
    compiled = torch.compile(lambda *a: vk.patch_embed(*a, patch_size=8), backend=capture, fullgraph=True)
    torch.testing.assert_close(compiled(images, weight, bias), eager, atol=1e-5, rtol=1e-5)
    assert not any(op.startswith("vit_kernels.") for op in capture.ops()), capture.ops()
    traced = [r for r in vk.explain() if r.source == "table (traced)" and r.op == "patch_embed"]
    assert traced and traced[0].backend == "torch" and "under torch.compile" in traced[0].reason


@needs_extension
def test_a_vit_compiled_by_inductor_holds_our_ops_among_inductors_kernels():
    """``torch.compile(fullgraph=True)`` of a ViT on the extension backend (on the CPU the registered
    ops stand for the kernels): no graph break forward or backward, our ops called from Inductor's
    code beside its own fused kernels, and outputs and every gradient equal to eager."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = vit.create_model("vit_digits")
    images = torch.randn(4, 1, 8, 8)
    with vk.use_backend("extension"):
        eager = model(images)
        eager.square().sum().backward()
        expected = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True)

        def step():
            out = compiled(images)
            out.square().sum().backward()
            return out

        out, code = run_and_get_code(step)
    text = "\n".join(code)
    assert "torch.ops.vit_kernels." in text, "no vit_kernels op called from Inductor's code"
    assert "cpp_fused" in text, "no kernel of Inductor's own around our ops"
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=1e-4, rtol=1e-4, msg=name)


@requires_cuda
@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_auto_compiles_fullgraph_in_every_mode_on_cuda(mode):
    """A ViT on ``auto`` (the table's kernels under compile: attention and the patch embedding on
    sm_90) compiles with ``fullgraph=True`` in each mode, CUDA graphs included, forward and
    backward, and agrees with eager."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_patch16_224", num_classes=10).cuda()
    images = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(images)
    eager.float().square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(2):  # CUDA graphs record on a later call
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(images)
        out.float().square().sum().backward()
    torch.testing.assert_close(out.float(), eager.float(), atol=5e-2, rtol=5e-2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.float(), expected[name].float(), atol=5e-2, rtol=5e-2, msg=name)


@needs_extension
@pytest.mark.parametrize("name", vit.list_models())
def test_every_preset_compiles_fullgraph_with_our_ops_forward_and_backward(name):
    """Each ``vit`` preset (one block, 4 x 4 patches, no dropout) on the extension backend compiles with
    ``fullgraph=True``: the forward graph holds the patch embedding and LayerNorm ops (and the
    attention softmax where the extension takes the preset's attention: not with RoPE), the backward
    graph their backward ops, and the output and every gradient equal eager's."""
    config = vit.get_config(name)
    size = 4 * config.patch_size
    torch._dynamo.reset()  # each preset is a new ViT.forward specialisation: no recompile limit
    torch.manual_seed(0)
    # dropout off (a compiled graph draws other random numbers than eager), training mode kept
    model = vit.create_model(name, depth=1, img_size=size, num_classes=3, drop_rate=0.0, attn_drop_rate=0.0)
    images = torch.randn(2, config.in_chans, size, size)
    capture = JointCapture()
    with vk.use_backend("extension"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # EVA02's SwiGLU: the extension has none
        eager = model(images)
        eager.square().sum().backward()
        expected = {key: p.grad.clone() for key, p in model.named_parameters()}
        model.zero_grad()
        out = torch.compile(model, backend=capture.backend, fullgraph=True)(images)
        out.square().sum().backward()
    forward, backward = kernel_ops(capture.forward), kernel_ops(capture.backward)
    assert {"patchify", "fused_layer_norm"} <= forward, forward
    assert "fused_layer_norm_backward" in backward, backward
    if not config.rope:
        assert "softmax" in forward and "softmax_backward" in backward, (forward, backward)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[key], atol=1e-4, rtol=1e-4, msg=key)
