"""The sweep: every op's Triton launchers driven on the simulated CUDA device over dtypes, flags, head dims,
ViT shapes and batch sizes, recording the launches they would issue on a GPU.

Each case calls the same launcher code a CUDA call runs (the ``*_triton`` forward entry points
and the registered backward ops), so the variants compiled are the launchers' own choices, not a
second list kept by hand.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tools.cuda_sim import Launch, every_candidate, simulated_cuda
from vit_kernels import _tiles
from vit_kernels.activations import GELU, GELU_TANH, NONE, QUICK_GELU
from vit_kernels.ops import attention, layer_norm, linear, patch_embed, swiglu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# name -> (GEMM and attention dtype, dtype of the residual stream, class token and position embedding)
PRECISIONS = {
    "fp32": (F32, F32),
    "fp16": (F16, F16),
    "bf16": (BF16, BF16),
    "bf16-autocast": (BF16, F32),
    "fp16-autocast": (F16, F32),
}
MODELS = {"vit_tiny": (192, 3), "vit_small": (384, 6), "vit_base": (768, 12), "vit_large": (1024, 16)}  # D, H
HEAD_DIMS = (4, 8, 12, 15, 64, 80, 128, 256)
IMAGE, PATCH, CHANNELS = 224, 16, 3
TOKENS = (IMAGE // PATCH) ** 2 + 1


@dataclass(frozen=True)
class Case:
    """One call of one op's launchers: forward and backward, with its description."""

    op: str
    precision: str
    shape: str
    flags: str
    batch: int
    run: Callable[[], None]


@dataclass(frozen=True)
class Sweep:
    precisions: tuple[str, ...]
    batches: tuple[int, ...]
    seq_lens: tuple[int, ...]
    all_flags: bool  # every flag combination, not only those a ViT block uses plus the flags off


# The quick sweep (make check-gpu, in CI): float32, bfloat16 and bfloat16 autocast (fp16 differs from
# bf16 only in the element type), the flags a ViT block uses and each flag off, every head dim, the
# four ViT/16 widths at batch 16,384 (batch 256 adds no variant to it: 2,438 either way, and half the
# recording time). The full sweep (make check-gpu-all) adds float16 and float16 autocast, every flag
# combination, batch 1, 7 (unaligned row counts) and 256, and L = 50, 577.
QUICK = Sweep(("fp32", "bf16", "bf16-autocast"), (16384,), (TOKENS,), False)
FULL = Sweep(tuple(PRECISIONS), (1, 7, 256, 16384), (TOKENS, 50, 577), True)


def _t(dtype, *shape) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def _patch_embed_cases(sweep: Sweep) -> Iterator[Case]:
    combos = (
        list(itertools.product((True, False), repeat=3))
        if sweep.all_flags
        else [(True, True, True), (True, False, True), (False, False, False)]
    )
    for precision, (model, (dim, _)), batch in itertools.product(
        sweep.precisions, MODELS.items(), sweep.batches
    ):
        dt, rdt = PRECISIONS[precision]
        for (has_bias, has_cls, has_pos), channels_last in itertools.product(combos, (False, True)):
            if channels_last and not (has_bias and has_cls and has_pos):
                continue

            def run(
                dt=dt,
                rdt=rdt,
                dim=dim,
                batch=batch,
                has_bias=has_bias,
                has_cls=has_cls,
                has_pos=has_pos,
                channels_last=channels_last,
            ):
                images = _t(dt, batch, CHANNELS, IMAGE, IMAGE)
                if channels_last:
                    images = images.to(memory_format=torch.channels_last)
                weight = _t(dt, dim, CHANNELS, PATCH, PATCH)
                tokens = TOKENS - 1 + has_cls
                out = patch_embed.patch_embed_triton(
                    images,
                    weight,
                    _t(dt, dim) if has_bias else None,
                    PATCH,
                    _t(rdt, 1, 1, dim) if has_cls else None,
                    _t(rdt, 1, tokens, dim) if has_pos else None,
                )
                for needs_images in (False, True):
                    patch_embed.patch_embed_bwd(
                        torch.empty_like(out), images, weight, PATCH, has_cls, needs_images
                    )

            flags = f"bias={has_bias} cls={has_cls} pos={has_pos}" + (
                " channels_last" if channels_last else ""
            )
            yield Case("patch_embed", precision, model, flags, batch, run)


def _linear_cases(sweep: Sweep) -> Iterator[Case]:
    for precision, (model, (dim, _)), batch in itertools.product(
        sweep.precisions, MODELS.items(), sweep.batches
    ):
        dt, rdt = PRECISIONS[precision]
        x = (batch, TOKENS, dim)
        pairs = (
            list(itertools.product((True, False), repeat=2))
            if sweep.all_flags
            else [(True, True), (True, False), (False, False)]
        )
        for has_bias, has_residual in pairs:

            def run_linear(dt=dt, rdt=rdt, x=x, dim=dim, has_bias=has_bias, has_residual=has_residual):
                inp, weight = _t(dt, *x), _t(dt, dim, dim)
                out, _ = linear.linear_fwd(
                    inp,
                    weight,
                    _t(dt, dim) if has_bias else None,
                    _t(rdt, *x) if has_residual else None,
                    NONE,
                    False,
                )
                linear.linear_bwd(torch.empty_like(out), inp, weight, _t(dt, 0), NONE, has_bias)

            yield Case(
                "linear", precision, model, f"bias={has_bias} residual={has_residual}", batch, run_linear
            )
        gelu_flags = (
            list(itertools.product((True, False), (GELU, GELU_TANH, QUICK_GELU)))
            if sweep.all_flags
            else [(True, GELU), (True, GELU_TANH), (True, QUICK_GELU), (False, GELU)]
        )
        for has_bias, activation in gelu_flags:

            def run_gelu(dt=dt, x=x, dim=dim, has_bias=has_bias, activation=activation):
                inp, weight = _t(dt, *x), _t(dt, 4 * dim, dim)
                bias = _t(dt, 4 * dim) if has_bias else None
                out, preact = linear.linear_fwd(inp, weight, bias, None, activation, True)
                linear.linear_bwd(torch.empty_like(out), inp, weight, preact, activation, has_bias)
                linear.linear_fwd(inp, weight, bias, None, activation, False)

            yield Case("linear_gelu", precision, model, f"bias={has_bias} {activation}", batch, run_gelu)
        if dt != F32 and model == "vit_base":

            def run_unaligned(dt=dt, x=x, dim=dim):
                # rows dim + 1 elements apart: no TMA descriptor reads them, so on Hopper too every
                # tile of the pointer kernel's table is a candidate
                inp = _t(dt, *x[:-1], dim + 1)[..., :dim]
                weight, bias = _t(dt, 4 * dim, dim), _t(dt, 4 * dim)
                out, preact = linear.linear_fwd(inp, weight, bias, None, GELU, True)
                linear.linear_bwd(torch.empty_like(out), inp, weight, preact, GELU, True)

            yield Case("linear_gelu", precision, model, "rows not 16-byte aligned", batch, run_unaligned)
        mlp_flags = (
            list(
                itertools.product(
                    ((True, True), (False, False), (True, False)),
                    (GELU, GELU_TANH, QUICK_GELU),
                    (True, False),
                )
            )
            if sweep.all_flags
            else [
                ((True, True), GELU, True),
                ((True, True), GELU_TANH, True),
                ((True, True), QUICK_GELU, True),
                ((False, False), GELU, False),
            ]
        )
        for (bias1, bias2), activation, has_residual in mlp_flags:

            def run_mlp(
                dt=dt,
                rdt=rdt,
                x=x,
                dim=dim,
                bias1=bias1,
                bias2=bias2,
                activation=activation,
                has_residual=has_residual,
            ):
                inp, w1, w2 = _t(dt, *x), _t(dt, 4 * dim, dim), _t(dt, dim, 4 * dim)
                args = (
                    inp,
                    w1,
                    _t(dt, 4 * dim) if bias1 else None,
                    w2,
                    _t(dt, dim) if bias2 else None,
                    _t(rdt, *x) if has_residual else None,
                    activation,
                )
                out, hidden, preact = linear.mlp_fwd(*args, True)
                linear.mlp_bwd(torch.empty_like(out), inp, w1, w2, hidden, preact, activation, bias1, bias2)
                linear.mlp_fwd(*args, False)

            yield Case(
                "mlp",
                precision,
                model,
                f"bias={bias1},{bias2} {activation} residual={has_residual}",
                batch,
                run_mlp,
            )


# (dropout_p, return_probs, rope layout, mask kind): without rope or mask, dropout and the
# probabilities; with rope (its kernel variants: ROPE = 1, 2), each layout with and without dropout
# in the full sweep, each layout once without dropout in the quick one (dropout enters the rotating
# kernels as it enters the plain ones, which the quick sweep compiles with it); with a mask (MASK =
# 1 additive: timm's float (B, 1, L, L); 2 boolean: a (B, 1, 1, L) key-padding mask), each kind alone,
# with rope and with dropout in the full sweep, the boolean one alone and the additive one with rope
# in the quick one (the probabilities of a rotating or masked call are PyTorch's, no kernel of their own).
_ATTENTION_FLAGS = (
    (0.0, False, None, None),
    (0.1, False, None, None),
    (0.0, True, None, None),
    (0.0, False, "interleaved", None),
    (0.0, False, "half", None),
    (0.0, False, None, "boolean"),
    (0.0, False, "interleaved", "additive"),
)
_ATTENTION_FLAGS_ALL = _ATTENTION_FLAGS + (
    (0.1, False, "interleaved", None),
    (0.1, False, "half", None),
    (0.0, False, None, "additive"),
    (0.1, False, "half", "boolean"),
    (0.1, False, "interleaved", "additive"),
)
# The head dims whose rope variants the quick sweep compiles (every even one in the full sweep): the
# ViTs' 64 (BLOCK_D exact) and 80 (BLOCK_D 128, padded: the partner columns' masked loads); each
# costs about 2 s of compile. Its mask variants: at head dim 64 only (the mask's loads do not depend
# on the head dim).
ROPE_QUICK_HEAD_DIMS = (64, 80)
MASK_QUICK_HEAD_DIMS = (64,)


def _mask(kind, batch: int, seq_len: int):
    """The mask of a gate case: None, a boolean (B, 1, 1, L) key-padding mask or timm's float32
    (B, 1, L, L) one."""
    if kind is None:
        return None
    if kind == "boolean":
        return torch.ones(batch, 1, 1, seq_len, dtype=torch.bool, device="cuda")
    return _t(F32, batch, 1, seq_len, seq_len)


def _attention_cases(sweep: Sweep) -> Iterator[Case]:
    shapes = [(model, heads, dim // heads) for model, (dim, heads) in MODELS.items()]
    shapes += [(f"head_dim={d}", 4, d) for d in HEAD_DIMS]
    for precision, (shape, heads, head_dim), batch, seq_len in itertools.product(
        sweep.precisions, shapes, sweep.batches, sweep.seq_lens
    ):
        dt, _ = PRECISIONS[precision]
        if precision.endswith("autocast"):
            continue  # attention takes the 16-bit qkv of the autocast GEMM: the plain 16-bit variants
        for dropout_p, return_probs, rope, mask_kind in (
            _ATTENTION_FLAGS_ALL if sweep.all_flags else _ATTENTION_FLAGS
        ):
            if rope is not None and head_dim % 2:
                continue  # rope rotates pairs of columns: even head dims only
            extra = rope is not None or mask_kind is not None
            quick_dims = ROPE_QUICK_HEAD_DIMS if mask_kind is None else MASK_QUICK_HEAD_DIMS
            if extra and not sweep.all_flags and head_dim not in quick_dims:
                continue

            def run(
                dt=dt,
                heads=heads,
                head_dim=head_dim,
                batch=batch,
                seq_len=seq_len,
                dropout_p=dropout_p,
                return_probs=return_probs,
                rope=rope,
                mask_kind=mask_kind,
                extra=extra,
            ):
                qkv = _t(dt, batch, seq_len, 3 * heads * head_dim)
                seed = torch.empty(1, dtype=torch.int64, device="cuda")
                scale = head_dim**-0.5
                # rope: float32 tables (timm's buffers) of the patch tokens, the class token left unrotated
                tables = (
                    (None, None) if rope is None else tuple(_t(F32, seq_len - 1, head_dim) for _ in range(2))
                )
                mask = _mask(mask_kind, batch, seq_len)
                more = (*tables, rope or "interleaved", mask) if extra else ()
                out, lse = attention.attention_fwd(qkv, heads, scale, dropout_p, seed, *more)
                if return_probs:
                    attention.attention_probs(qkv, lse, heads, scale)
                attention.attention_bwd(torch.empty_like(out), qkv, lse, seed, heads, scale, dropout_p, *more)

            flags = (
                f"L={seq_len} dropout={dropout_p} probs={return_probs}"
                + ("" if rope is None else f" rope={rope}")
                + ("" if mask_kind is None else f" mask={mask_kind}")
            )
            yield Case("attention", precision, shape, flags, batch, run)


def _layer_norm_cases(sweep: Sweep) -> Iterator[Case]:
    dims = {model: dim for model, (dim, _) in MODELS.items()}
    if sweep.all_flags:
        dims.update({"dim=1280": 1280, "dim=4096": 4096})
    for precision, (shape, dim), batch in itertools.product(sweep.precisions, dims.items(), sweep.batches):
        _, rdt = PRECISIONS[precision]  # layer_norm runs in the residual stream's dtype (fp32 under autocast)
        ln_flags = (
            list(itertools.product((True, False), repeat=2))
            if sweep.all_flags
            else [(True, True), (True, False), (False, False)]
        )
        for affine, has_residual in ln_flags:

            def run(rdt=rdt, dim=dim, batch=batch, affine=affine, has_residual=has_residual):
                x = _t(rdt, batch, TOKENS, dim)
                weight = _t(rdt, dim) if affine else None
                y, summed, mean, rstd = layer_norm.layer_norm_fwd(
                    x, weight, weight, 1e-6, _t(rdt, *x.shape) if has_residual else None
                )
                layer_norm.layer_norm_bwd(
                    torch.empty_like(y),
                    torch.empty_like(y) if has_residual else None,
                    summed if has_residual else x,
                    weight,
                    mean,
                    rstd,
                    affine,
                )

            yield Case("layer_norm", precision, shape, f"affine={affine} residual={has_residual}", batch, run)


def _swiglu_cases(sweep: Sweep) -> Iterator[Case]:
    """SwiGLU MLPs at EVA02's hidden width (8/3 of D, 2730 for ViT-L: not a multiple of 16): the dual
    GEMM with and without the pre-activations, the gating backward with and without bias sums, and
    the engine's GEMMs around them (the down projection with its residual, dH, dX, the weight gradients)."""
    flags = (
        list(itertools.product((True, False), (True, False)))
        if sweep.all_flags
        else [(True, True), (False, False)]
    )
    for precision, (model, (dim, _)), batch in itertools.product(
        sweep.precisions, MODELS.items(), sweep.batches
    ):
        dt, rdt = PRECISIONS[precision]
        hidden = dim * 8 // 3
        for has_bias, has_residual in flags:

            def run(
                dt=dt,
                rdt=rdt,
                dim=dim,
                hidden=hidden,
                batch=batch,
                has_bias=has_bias,
                has_residual=has_residual,
            ):
                x, wg, wu = _t(dt, batch, TOKENS, dim), _t(dt, hidden, dim), _t(dt, hidden, dim)
                wd = _t(dt, dim, hidden)
                bg, bu, bd = (_t(dt, hidden), _t(dt, hidden), _t(dt, dim)) if has_bias else (None, None, None)
                residual = _t(rdt, batch, TOKENS, dim) if has_residual else None
                out, h, g, u = swiglu.swiglu_fwd(x, wg, bg, wu, bu, wd, bd, residual, True)
                swiglu.swiglu_bwd(torch.empty_like(out), x, wg, wu, wd, h, g, u, has_bias, has_bias, has_bias)
                swiglu.swiglu_fwd(x, wg, bg, wu, bu, wd, bd, residual, False)

            yield Case("swiglu_mlp", precision, model, f"bias={has_bias} residual={has_residual}", batch, run)
            if (
                not has_residual
            ):  # swiglu alone (EVA02's scale_mlp: a norm between it and the down projection)

                def run_swiglu(dt=dt, dim=dim, hidden=hidden, batch=batch, has_bias=has_bias):
                    x, wg, wu = _t(dt, batch, TOKENS, dim), _t(dt, hidden, dim), _t(dt, hidden, dim)
                    bg, bu = (_t(dt, hidden), _t(dt, hidden)) if has_bias else (None, None)
                    h, empty, g, u = swiglu.swiglu_fwd(x, wg, bg, wu, bu, None, None, None, True)
                    swiglu.swiglu_bwd(
                        torch.empty_like(h), x, wg, wu, None, empty, g, u, has_bias, has_bias, False
                    )
                    swiglu.swiglu_fwd(x, wg, bg, wu, bu, None, None, None, False)

                yield Case("swiglu", precision, model, f"bias={has_bias}", batch, run_swiglu)


def cases(sweep: Sweep) -> Iterator[Case]:
    yield from _patch_embed_cases(sweep)
    yield from _linear_cases(sweep)
    yield from _attention_cases(sweep)
    yield from _layer_norm_cases(sweep)
    yield from _swiglu_cases(sweep)


def record(case: Case, every_tile: bool = False) -> list[Launch]:
    """The launches ``case`` issues on the simulated H100, recorded instead of run: the tables'
    tiles, as a first call launches them (the choosers start afresh for each case, as in a new
    process); ``every_tile``: the case again with each other candidate of every key it met, as
    ``vk.tune``'s search launches them."""
    _tiles.forget()
    with simulated_cuda(90) as device:
        every_candidate(case.run) if every_tile else case.run()
    return device.launches
