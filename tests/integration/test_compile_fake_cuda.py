"""What torch.compile puts in a GPU user's graph, traced on fake CUDA tensors with an H100's (sm_90)
or an A100's (sm_80) answers (``tools.cuda_sim.fake_cuda``; the CUDA build of torch here has no GPU
to run on): ``fullgraph=True`` holds, and the graph holds our kernels exactly where the dispatch
tables' "under compile" rows put them (16 bits: the Triton patch embedding), while attention,
LayerNorm, the linears and the MLP stay PyTorch's, for Inductor to fuse (attention's cuDNN backward
beat the Triton one inside a compiled step on an H200, benchmarks/results/e2e-h200-2026-11-28.md)."""

import os
import sys
from pathlib import Path

import pytest
import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ lives beside the package, not in it
import vit  # noqa: E402
import vit_kernels as vk  # noqa: E402
from tools.cuda_sim import fake_cuda  # noqa: E402
from tools.graph_capture import GraphCapture, kernel_ops  # noqa: E402
from vit_kernels import backend  # noqa: E402

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise pytest.UsageError(
        "test_compile_fake_cuda.py traces Triton's compiled kernels: run it without TRITON_INTERPRET "
        "(make test-integration does)"
    )


def _traced(model, arch, dtype, grad):
    """The ops of ``model``'s compiled graph (one, or fullgraph fails) on fake CUDA tensors, ours among
    them (``kernel_ops``), and what dispatch decided while tracing, as {op: backend}."""
    torch._dynamo.reset()
    backend.clear_decisions()
    capture = GraphCapture()
    with fake_cuda(arch), vk.use_backend("auto"), torch.set_grad_enabled(grad):
        model = model.to("cuda", dtype)
        images = torch.randn(4, 3, 32, 32, device="cuda", dtype=dtype)
        torch.compile(model, backend=capture, fullgraph=True)(images)
    assert len(capture.graphs) == 1
    called = {str(node.target) for node in capture.graphs[0].graph.nodes if node.op == "call_function"}
    decided = {row.op: row.backend for row in vk.explain() if row.source.endswith("(traced)")}
    return called, kernel_ops(capture.graphs), decided


def _preset():
    return vit.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=5)


def _patched_timm():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, patch_size=8)
    assert vk.patch_model(model).replaced
    return model


@pytest.mark.parametrize("make", [_preset, _patched_timm], ids=["vit preset", "patched timm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_training_on_sm90_compiles_our_patch_embedding_and_leaves_attention_to_inductor(make, dtype):
    called, ours, decided = _traced(make(), 90, dtype, grad=True)
    assert ours == {"patch_embed_fwd"}, called
    assert any("scaled_dot_product" in name for name in called), called
    assert decided["patch_embed"] == "triton", decided
    assert {decided[op] for op in ("attention", "layer_norm", "linear", "mlp")} == {"torch"}, decided


def test_inference_on_sm90_keeps_sdpa_and_compiles_our_patch_embedding():
    called, ours, decided = _traced(_preset(), 90, torch.bfloat16, grad=False)
    assert ours == {"patch_embed_fwd"}, called
    assert any("scaled_dot_product" in name for name in called), called
    assert decided["attention"] == "torch", decided


def test_training_on_sm80_keeps_sdpa_where_our_attention_was_never_measured():
    called, ours, decided = _traced(_preset(), 80, torch.bfloat16, grad=True)
    assert ours == {"patch_embed_fwd"}, called
    assert decided["attention"] == "torch" and decided["patch_embed"] == "triton", decided


def test_float32_compiles_no_kernel_of_ours():
    called, ours, decided = _traced(_preset(), 90, torch.float32, grad=True)
    assert not ours, called
    assert set(decided.values()) == {"torch"}, decided
