"""patch_model on plain PyTorch layers (the main environment has no timm/transformers/torchvision;
tests/integration checks those against the real libraries): swaps keep the parameters and the
outputs and gradients, unknown layers are reported, masks are refused clearly."""

import copy

import pytest
import torch
from torch import nn

import vit_kernels as vk
from vit_kernels import nn as vkn


def _assert_same_outputs_and_grads(model, reference, x):
    out, expected = model(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("training", [False, True])
def test_transformer_encoder_is_exact(batch_first, norm_first, activation, training):
    vk.set_backend("torch")
    dropout = 0.0 if training else 0.1  # dropout masks come from different random streams
    layer = nn.TransformerEncoderLayer(
        16, 4, 24, dropout=dropout, activation=activation, batch_first=batch_first, norm_first=norm_first
    )
    reference = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().train(training)
    model = copy.deepcopy(reference)
    params_before = dict(model.named_parameters())
    report = vk.patch_model(model)
    assert report.skipped == []
    assert [new.rsplit(".", 1)[-1] for _, _, new in report.replaced[:4]] == [
        "FusedTransformerEncoderLayer",
        "FusedMultiheadAttention",
        "LayerNorm",
        "LayerNorm",
    ]
    assert all(p is params_before[n] for n, p in model.named_parameters()), (
        "parameters must be the same tensors"
    )
    assert model.state_dict().keys() == reference.state_dict().keys()
    _assert_same_outputs_and_grads(model, reference, torch.randn(5, 3, 16, dtype=torch.float64))


@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_multihead_self_attention_is_exact(need_weights, average):
    vk.set_backend("torch")
    reference = nn.MultiheadAttention(12, 3, batch_first=True).double()
    model = copy.deepcopy(reference)
    assert len(vk.patch_model(model).replaced) == 1
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    out, weights = model(x, x, x, need_weights=need_weights, average_attn_weights=average)
    expected, expected_weights = reference(x, x, x, need_weights=need_weights, average_attn_weights=average)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-12)
    else:
        assert weights is None and expected_weights is None


def test_masks_and_cross_attention_run_as_unpatched():
    """What the fused ops cannot compute (masks, causal, cross-attention, as in SigLIP's pooling head)
    runs the layer's own forward: a patched model never raises where the original would not."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(8, 2, batch_first=True).double()
    model = copy.deepcopy(reference)
    assert len(vk.patch_model(model).replaced) == 1
    x, y = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    probe = torch.randn(2, 1, 8, dtype=torch.float64)
    padding = torch.tensor([[False, False, True, False], [False, False, False, True]])
    calls = [
        ((x, x, x), {"attn_mask": torch.randn(4, 4, dtype=torch.float64)}),
        ((x, x, x), {"key_padding_mask": padding}),
        ((x, x, x), {"attn_mask": torch.ones(4, 4, dtype=torch.bool).triu(1), "is_causal": True}),
        ((x, y, y), {}),
        ((probe, y, y), {"need_weights": False}),
    ]
    for args, kwargs in calls:
        out, weights = model(*args, **kwargs)
        expected, expected_weights = reference(*args, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        assert (weights is None) == (expected_weights is None)
    layer_reference = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0).double()
    layer = copy.deepcopy(layer_reference)
    vk.patch_model(layer)
    torch.testing.assert_close(
        layer(x, src_key_padding_mask=padding),
        layer_reference(x, src_key_padding_mask=padding),
        rtol=1e-12,
        atol=1e-12,
    )
    torch.testing.assert_close(layer(x), layer_reference(x), rtol=1e-12, atol=1e-12)


def test_layer_norms_are_swapped_with_their_tensors_and_unknown_layers_reported():
    class RMSNorm(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(
        nn.LayerNorm(8),
        nn.LayerNorm((4, 8)),
        RMSNorm(),
        nn.Conv2d(3, 8, 4, stride=4),
        nn.MultiheadAttention(8, 2, kdim=4, vdim=4),
    )
    weight = model[0].weight
    report = vk.patch_model(model)
    assert isinstance(model[0], vkn.LayerNorm) and model[0].weight is weight
    reasons = dict(report.skipped)
    assert set(reasons) == {"1", "2", "3", "4"}
    assert "last dimension" in reasons["1"] and "norm-like" in reasons["2"]
    assert "patch-embedding-like" in reasons["3"] and "kdim/vdim" in reasons["4"]
    assert "skipped 4 layer(s)" in str(report)


def test_patch_model_keeps_training_mode_and_rejects_non_modules():
    model = nn.Sequential(nn.LayerNorm(8)).train()
    vk.patch_model(model)
    assert model[0].training
    with pytest.raises(TypeError, match="torch.nn.Module"):
        vk.patch_model("not a model")


def test_a_nested_tensor_from_a_padded_batch_runs_the_layers_own_forward():
    """nn.TransformerEncoder packs a padded batch into a nested tensor in eval mode without grad and
    calls its layers without the mask: they must not take the fused path on it."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    reference = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    model = copy.deepcopy(reference)
    vk.patch_model(model)
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        expected, actual = reference(x, src_key_padding_mask=padding), model(x, src_key_padding_mask=padding)
    torch.testing.assert_close(actual, expected)
