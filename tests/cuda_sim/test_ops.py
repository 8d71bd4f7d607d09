"""Every public op x backend x dtype, with and without autocast, forward and every gradient, on the
simulated sm_90 and sm_80 devices: the host code of a GPU call runs to the launch, and fails here on
any exception (see conftest)."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from vit_kernels.backend import CannotRunError

BACKENDS = ("triton", "extension", "torch", "auto")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# ViT-Ti/16 at batch 16, the compile gate's widths where it has them (their variants are then read
# from what make check-gpu compiled, tools.gpu_check.compile.compiled_folder())
B, L, D, HEADS, HIDDEN = 16, 197, 192, 3, 768


def _p(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def _inputs(op: str, dtype: torch.dtype, variant: str):
    """(function, leaves that need gradients) for ``op``; ``variant`` picks the optional parts."""
    x = _p(B, L, D, dtype=dtype)
    if op == "patch_embed":
        images = _p(B, 3, 224, 224, dtype=dtype)
        if variant == "channels_last":
            images = images.detach().to(memory_format=torch.channels_last).requires_grad_()
        w, b, cls, pos = (
            _p(D, 3, 16, 16, dtype=dtype),
            _p(D, dtype=dtype),
            _p(1, 1, D, dtype=dtype),
            _p(1, L, D, dtype=dtype),
        )
        return (lambda: vk.patch_embed(images, w, b, patch_size=16, cls_token=cls, pos_embed=pos)), [
            images,
            w,
            b,
            cls,
            pos,
        ]
    if op == "attention":
        heads, head_dim = {"dh80": (4, 80), "dh128": (4, 128), "dh15": (3, 15)}.get(
            variant, (HEADS, D // HEADS)
        )
        qkv = _p(B, L, 3 * heads * head_dim, dtype=dtype)
        if variant == "probs":
            return (lambda: vk.attention(qkv, heads, return_probs=True)), [qkv]
        if variant == "dropout":
            return (lambda: vk.attention(qkv, heads, dropout_p=0.1)), [qkv]
        if variant.startswith("rope"):  # float32 tables of the patch tokens (the class token is not rotated)
            cos, sin = (torch.randn(L - 1, head_dim, device="cuda") for _ in range(2))
            if variant == "rope":
                return (lambda: vk.attention(qkv, heads, rope=(cos, sin))), [qkv]
            # the half layout, per-head tables, dropout and the probabilities (PyTorch's, of the rotated q, k)
            cos, sin = (t.expand(heads, L - 1, head_dim) for t in (cos, sin))
            return (
                lambda: vk.attention(
                    qkv, heads, dropout_p=0.1, return_probs=True, rope=(cos, sin), rope_layout="half"
                )
            ), [qkv]
        if variant == "key_padding":  # a boolean (B, 1, 1, L) key-padding mask (a NaFlex batch)
            mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device="cuda")
            return (lambda: vk.attention(qkv, heads, attn_mask=mask)), [qkv]
        if variant == "additive_mask_rope_dropout_probs":  # timm's float (B, 1, L, L) mask with rope, dropout
            mask = torch.zeros(B, 1, L, L, device="cuda")
            cos, sin = (torch.randn(L - 1, head_dim, device="cuda") for _ in range(2))
            return (
                lambda: vk.attention(
                    qkv, heads, dropout_p=0.1, return_probs=True, rope=(cos, sin), attn_mask=mask
                )
            ), [qkv]
        return (lambda: vk.attention(qkv, heads)), [qkv]
    if op == "linear":
        if variant == "tall":  # more rows than a GEMM candidate is validated on
            x = _p(4 * B, L, D, dtype=dtype)
        if variant == "empty":  # no rows: nothing to launch or validate
            x = _p(0, D, dtype=dtype)
        w, b = _p(D, D, dtype=dtype), _p(D, dtype=dtype)
        if (
            variant == "layer_scale"
        ):  # gamma folded into the GEMM's weight and bias, the residual in its epilogue
            residual, gamma = _p(B, L, D, dtype=dtype), _p(D, dtype=dtype)
            return (lambda: vk.linear(x, w, b, residual=residual, layer_scale=gamma)), [
                x,
                w,
                b,
                residual,
                gamma,
            ]
        residual = _p(B, L, D, dtype=dtype) if variant == "residual" else None
        return (lambda: vk.linear(x, w, b, residual=residual)), [x, w, b] + (
            [residual] if residual is not None else []
        )
    if op == "linear_gelu":
        w, b = _p(HIDDEN, D, dtype=dtype), _p(HIDDEN, dtype=dtype)
        approximate = {"erf": "none", "tanh": "tanh", "quick": "quick"}[variant]
        return (lambda: vk.linear_gelu(x, w, b, approximate=approximate)), [x, w, b]
    if op == "mlp":
        w1, b1, w2, b2 = (
            _p(HIDDEN, D, dtype=dtype),
            _p(HIDDEN, dtype=dtype),
            _p(D, HIDDEN, dtype=dtype),
            _p(D, dtype=dtype),
        )
        residual = _p(B, L, D, dtype=dtype) if variant in ("residual", "layer_scale") else None
        gamma = _p(D, dtype=dtype) if variant == "layer_scale" else None
        leaves = (
            [x, w1, b1, w2, b2]
            + ([residual] if residual is not None else [])
            + ([gamma] if gamma is not None else [])
        )
        return (lambda: vk.mlp(x, w1, b1, w2, b2, residual=residual, layer_scale=gamma)), leaves
    if op in ("swiglu", "swiglu_mlp"):
        wg, bg, wu, bu = (
            _p(HIDDEN, D, dtype=dtype),
            _p(HIDDEN, dtype=dtype),
            _p(HIDDEN, D, dtype=dtype),
            _p(HIDDEN, dtype=dtype),
        )
        if op == "swiglu":
            return (lambda: vk.swiglu(x, wg, bg, wu, bu)), [x, wg, bg, wu, bu]
        wd, bd = _p(D, HIDDEN, dtype=dtype), _p(D, dtype=dtype)
        residual = _p(B, L, D, dtype=dtype) if variant == "residual" else None
        leaves = [x, wg, bg, wu, bu, wd, bd] + ([residual] if residual is not None else [])
        return (lambda: vk.swiglu_mlp(x, wg, bg, wu, bu, wd, bd, residual=residual)), leaves
    if op == "layer_norm":
        if variant == "wide":  # past the CUDA extension's row limit
            x = _p(2, 4, 16384, dtype=dtype)
            w, b = _p(16384, dtype=dtype), _p(16384, dtype=dtype)
            return (lambda: vk.layer_norm(x, w, b, 1e-6)), [x, w, b]
        if variant == "empty":
            x = _p(0, D, dtype=dtype)
        w, b = _p(D, dtype=dtype), _p(D, dtype=dtype)
        residual = _p(B, L, D, dtype=dtype) if variant == "residual" else None
        return (lambda: vk.layer_norm(x, w, b, 1e-6, residual=residual)), [x, w, b] + (
            [residual] if residual is not None else []
        )
    raise AssertionError(op)


CASES = [
    ("patch_embed", "nchw"),
    ("patch_embed", "channels_last"),
    ("attention", "dh64"),
    ("attention", "dh80"),
    ("attention", "dh128"),
    ("attention", "probs"),
    ("attention", "dropout"),
    ("attention", "dh15"),
    ("attention", "rope"),
    ("attention", "rope_half_dropout_probs"),
    ("attention", "key_padding"),
    ("attention", "additive_mask_rope_dropout_probs"),
    ("linear", "tall"),
    ("layer_norm", "wide"),
    ("linear", "empty"),
    ("layer_norm", "empty"),
    ("linear", "plain"),
    ("linear", "residual"),
    ("linear", "layer_scale"),
    ("linear_gelu", "erf"),
    ("linear_gelu", "tanh"),
    ("linear_gelu", "quick"),
    ("mlp", "plain"),
    ("mlp", "residual"),
    ("mlp", "layer_scale"),
    ("swiglu", "plain"),
    ("swiglu_mlp", "plain"),
    ("swiglu_mlp", "residual"),
    ("layer_norm", "plain"),
    ("layer_norm", "residual"),
]


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


# Under bfloat16 autocast an input is either cast (float32, float16: one path, taken by float32) or
# not (bfloat16): each path once, beside every dtype without autocast.
DTYPE_AUTOCAST = [(dtype, False) for dtype in DTYPES] + [(torch.float32, True), (torch.bfloat16, True)]


@pytest.mark.parametrize(
    "dtype,autocast",
    DTYPE_AUTOCAST,
    ids=[f"{d}-{'autocast_bf16' if a else 'eager'}" for d, a in DTYPE_AUTOCAST],
)
@pytest.mark.parametrize("backend_choice", BACKENDS)
@pytest.mark.parametrize("op,variant", CASES, ids=[f"{op}-{variant}" for op, variant in CASES])
def test_op_forward_and_backward(sim, op, variant, backend_choice, dtype, autocast):
    fn, leaves = _inputs(op, dtype, variant)
    try:
        with (
            vk.use_backend(backend_choice, strict=backend_choice != "auto"),
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast),
        ):
            outputs = _outputs(fn())
            upstream = [torch.randn(o.shape, device="cuda", dtype=o.dtype) for o in outputs]
            grads = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
    except CannotRunError as declared:  # the backend's own table says it does not take this call
        assert backend_choice in ("extension", "triton"), declared
        assert "raised" not in str(declared)
        return
    for out in outputs:
        assert out.device.type == "cuda"
    for leaf, grad in zip(leaves, grads):
        assert grad is not None and grad.shape == leaf.shape and grad.device.type == "cuda"
    if backend_choice == "triton":
        assert sim.launches, "the triton backend launched no kernel"


@pytest.mark.parametrize("backend_choice", BACKENDS)
@pytest.mark.parametrize("op,variant", CASES, ids=[f"{op}-{variant}" for op, variant in CASES])
def test_op_inference(sim, op, variant, backend_choice):
    """Without gradients (serving): the inference launchers (no saved pre-activation, no statistics
    for backward), bfloat16."""
    fn, _ = _inputs(op, torch.bfloat16, variant)
    try:
        with torch.no_grad(), vk.use_backend(backend_choice, strict=backend_choice != "auto"):
            outputs = _outputs(fn())
    except CannotRunError as declared:
        assert backend_choice in ("extension", "triton"), declared
        return
    assert all(
        out.device.type == "cuda" and out.dtype == torch.bfloat16
        for out in outputs
        if out.is_floating_point()
    )
