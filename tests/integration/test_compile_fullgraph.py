"""``vk.patch_model`` then ``torch.compile(fullgraph=True)``: timm's, Hugging Face's and torchvision's
ViTs compile without a graph break, forward and backward, with our ops in both graphs (the extension
backend's registered ops stand for the kernels on the CPU) and the output and every parameter
gradient equal to the eager patched model's; under Inductor, our ops are called among Inductor's own
fused kernels."""

import sys
from pathlib import Path

import pytest
import timm
import torch
from exactness import patched_copy, tiny_transformers_model
from torchvision.models import VisionTransformer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ lives beside the package, not in it
import vit_kernels as vk  # noqa: E402
from tools.graph_capture import JointCapture, kernel_ops  # noqa: E402


def _timm(name, **overrides):
    return timm.create_model(name, pretrained=False, img_size=32, num_classes=5, **overrides)


MODELS = {
    "timm vit": lambda: _timm("vit_tiny_patch16_224", depth=2, patch_size=8),
    "timm registers + layer scale": lambda: _timm(
        "vit_tiny_patch16_224", depth=2, patch_size=8, reg_tokens=4, init_values=0.1
    ),
    "huggingface vit": lambda: tiny_transformers_model(
        "ViTConfig", "ViTForImageClassification", num_labels=5
    ),
    "huggingface siglip": lambda: tiny_transformers_model("SiglipVisionConfig", "SiglipVisionModel"),
    "huggingface dinov2": lambda: tiny_transformers_model(
        "Dinov2Config", "Dinov2Model", layerscale_value=0.5
    ),
    "torchvision vit": lambda: VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=5
    ),
}


def _output(out):
    """The tensor a model returns: timm's and torchvision's logits, Hugging Face's pooled output, else
    its last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "pooler_output", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    raise TypeError(f"no output tensor in {type(out).__name__}")


def _step(model, images, run=None):
    """One training step's forward and backward through ``run`` (``model`` itself, or its compiled
    form): the output and every parameter's gradient."""
    model.zero_grad()
    out = _output((model if run is None else run)(images))
    out.square().sum().backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_patched_model_compiles_fullgraph_with_our_ops_forward_and_backward(family):
    torch._dynamo.reset()
    model, report = patched_copy(MODELS[family]().train())
    assert report.replaced, report
    images = torch.randn(2, 3, 32, 32)
    capture = JointCapture()
    with vk.use_backend("extension"):
        expected, expected_grads = _step(model, images)
        actual, actual_grads = _step(
            model, images, torch.compile(model, backend=capture.backend, fullgraph=True)
        )
    forward, backward = kernel_ops(capture.forward), kernel_ops(capture.backward)
    # every family's LayerNorms and attention (its softmax) run our ops, forward and backward
    assert {"fused_layer_norm", "softmax"} <= forward, forward
    assert {"fused_layer_norm_backward", "softmax_backward"} <= backward, backward
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert actual_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def test_a_patched_timm_vit_compiled_by_inductor_calls_our_ops_among_its_kernels():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, _ = patched_copy(MODELS["timm vit"]().train())
    images = torch.randn(2, 3, 32, 32)
    with vk.use_backend("extension"):
        expected, expected_grads = _step(model, images)
        compiled = torch.compile(model, fullgraph=True)
        (actual, actual_grads), code = run_and_get_code(lambda: _step(model, images, compiled))
    text = "\n".join(code)
    assert "torch.ops.vit_kernels." in text, "no vit_kernels op called from Inductor's code"
    assert "cpp_fused" in text, "no kernel of Inductor's own around our ops"
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)
