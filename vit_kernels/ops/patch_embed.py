"""Patch embedding: patchify + projection (+ class token + position embedding).

X (N, C, H, W) -> patches (N, L, C*P*P), L = (H/P) * (W/P)
E = patches @ W^T + b                     W in nn.Conv2d layout (D, C, P, P)
T = [cls ; E] + pos                       (N, L [+1], D)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from vit_kernels import _ext, backend
from vit_kernels._autograd import differentiable, direct
from vit_kernels._signature import bucket
from vit_kernels._tiles import (
    TileChooser,
    decided,
    keep,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import (
    capability,
    LAUNCH_CONFIGS,
    cached_call,
    cdiv,
    dot_precision,
    interpreted,
    launch,
)
from vit_kernels.kernels.patch_embed import (
    _patch_embed_bwd_input_kernel,
    _patch_embed_bwd_weight_kernel,
    _patch_embed_fwd_kernel,
)
from vit_kernels.ops.gemm import GEMM_INTERPRETER_TILE, GemmTile, gemm_candidates, gemm_config, split_k_slices


def _geometry(images: torch.Tensor, weight: torch.Tensor, patch_size: int, has_cls: bool) -> tuple[int, ...]:
    """-> (N, D, K = C*P*P, L, T, grid width)."""
    n, _, height, width = images.shape
    dim, *patch_shape = weight.shape
    num_patches = (height // patch_size) * (width // patch_size)
    return n, dim, math.prod(patch_shape), num_patches, num_patches + int(has_cls), width // patch_size


# The forward's default on sm_90 in 16 bits, where both the H100 and the H200 chose it at ViT-B/16's
# shapes (B=128, bf16; benchmarks/results/gpu-report-h100-2026-11-26.json, gpu-report-h200-2026-11-27.json);
# elsewhere the GEMM table's order (``gemm_candidates``).
SM90_16BIT_FWD_TILE = GemmTile(128, 256, 64, 8, 3)


def fwd_candidates(dtype: torch.dtype, rows: int, dim: int, arch: int) -> tuple:
    """The forward's tiles, default first, for ``rows`` x ``dim`` outputs on a GPU of compute
    capability ``arch``."""
    tiles = gemm_candidates(dtype, rows, dim)
    if arch == 90 and SM90_16BIT_FWD_TILE in tiles:
        return (SM90_16BIT_FWD_TILE, *(t for t in tiles if t != SM90_16BIT_FWD_TILE))
    return tiles


SPLIT_ROWS = 64  # the weight gradient's row slices are multiples of its BLOCK_M on a GPU
FWD_CHOOSER = TileChooser("patch_embed forward")
_FWD_PLANS: dict[tuple, tuple] = {}  # per call signature, for _tiles.decided: ``_fwd_plan``


def tile_report() -> list[dict]:
    """Every forward tile choice made in this process: key (device, images' and output dtypes,
    HAS_BIAS, HAS_CLS, HAS_POS, row bucket, D, C*P*P, P, tokens per image, channels last), the tile
    chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("patch_embed forward", FWD_CHOOSER)


def _out_dtype(images: torch.Tensor, cls_token: Optional[torch.Tensor], pos_embed: Optional[torch.Tensor]):
    """The images' dtype promoted with the class token's and position embedding's (autocast: float32)."""
    out_dtype = images.dtype
    for extra in (cls_token, pos_embed):
        if extra is not None:
            out_dtype = torch.promote_types(out_dtype, extra.dtype)
    return out_dtype


class BackwardPlan(NamedTuple):
    """The backward's two launches over the patches, besides their tensors."""

    tile: tuple  # (BLOCK_D, BLOCK_K, BLOCK_M, warps), both kernels'
    slices: int  # of dW's reduction over the patches
    rows_per_split: int  # patches per slice
    weight_grid: tuple
    input_grid: tuple


class ForwardPlan(NamedTuple):
    """The forward launch of a decided call, besides its tensors (``_tiles.decided``)."""

    out_shape: tuple  # (N, T, D)
    out_dtype: torch.dtype
    sizes: tuple  # (D, K, T): the GEMM's columns and depth, the tokens per image
    args: tuple  # the kernel's arguments after the tensors
    grid: tuple
    constants: dict  # the constexprs and warps


@functools.lru_cache(maxsize=LAUNCH_CONFIGS)
def _bwd_plan(rows: int, dim: int, k_dim: int, device: torch.device) -> BackwardPlan:
    """The backward's launches over ``rows`` patches: dW's reduction over the rows split as
    ``split_k_slices`` says, in slices of whole SPLIT_ROWS. Made once per distinct call (a decided
    call looks it up)."""
    tile_d, tile_k, tile_m, warps = (32, 32, 32, 1) if interpreted(device) else (64, 64, 64, 4)
    slices = split_k_slices(dim, k_dim, rows, device)
    rows_per_split = max(1, cdiv(cdiv(rows, slices), SPLIT_ROWS)) * SPLIT_ROWS
    slices = max(1, cdiv(rows, rows_per_split))
    weight_grid = (cdiv(dim, tile_d), cdiv(k_dim, tile_k), slices)
    input_grid = (cdiv(rows, tile_m), cdiv(k_dim, tile_k))
    return BackwardPlan((tile_d, tile_k, tile_m, warps), slices, rows_per_split, weight_grid, input_grid)


def _fwd_plan(
    tile: GemmTile, images, weight, bias, cls_token, pos_embed, patch_size, out_dtype
) -> ForwardPlan:
    """The forward launch with ``tile``."""
    n, dim, k_dim, _, tokens, grid_w = _geometry(images, weight, patch_size, cls_token is not None)
    w2 = weight.reshape(dim, k_dim)  # a view, or a contiguous copy: its strides follow weight's
    config = gemm_config(tile)
    args = (
        n * tokens,
        dim,
        k_dim,
        tokens,
        grid_w,
        patch_size,
        *images.stride(),
        *w2.stride(),
        bias.stride(0) if bias is not None else 0,
    )
    constants = dict(
        HAS_BIAS=bias is not None,
        HAS_CLS=cls_token is not None,
        HAS_POS=pos_embed is not None,
        PRECISION=dot_precision(images.dtype),
        **config,
    )
    grid = (cdiv(n * tokens, config["BLOCK_M"]) * cdiv(dim, config["BLOCK_N"]),)
    return ForwardPlan((n, tokens, dim), out_dtype, (dim, k_dim, tokens), args, grid, constants)


def _launch_fwd(plan: ForwardPlan, images, weight, bias, cls_token, pos_embed) -> torch.Tensor:
    """The forward kernel launched by ``plan`` (``_fwd_plan``) -> tokens (N, T, D)."""
    out_shape, out_dtype, (dim, k_dim, tokens), args, grid, constants = plan
    out = torch.empty(out_shape, dtype=out_dtype, device=images.device)
    pos = pos_embed.reshape(tokens, dim).contiguous() if pos_embed is not None else out
    cls = cls_token.reshape(dim).contiguous() if cls_token is not None else out
    w2 = weight.reshape(dim, k_dim)
    bias = bias if bias is not None else out
    launch(_patch_embed_fwd_kernel, grid, images, w2, bias, cls, pos, out, *args, **constants)
    return out


def _chooser_key(images, weight, bias, cls_token, pos_embed, patch_size, out_dtype) -> tuple:
    """What a forward tile choice is kept for: dtypes, the optional inputs, the GEMM's rows
    (bucketed), columns and depth, the patch and the tokens, and whether the images are
    channels-last. Plain ints (SymInts made concrete)."""
    n, dim, k_dim, _, tokens, _ = _geometry(images, weight, patch_size, cls_token is not None)
    return (
        images.device,
        images.dtype,
        out_dtype,
        bias is not None,
        cls_token is not None,
        pos_embed is not None,
        bucket(int(n) * int(tokens)),
        int(dim),
        int(k_dim),
        patch_size,
        int(tokens),
        bool(images.stride(1) == 1),
    )


def fwd_tile(images, weight, bias, cls_token, pos_embed, patch_size, out_dtype) -> tuple:
    """The forward tile to launch for an output of ``out_dtype``: see ``_tiles.tile_to_launch``."""
    n, dim, _, _, tokens, _ = _geometry(images, weight, patch_size, cls_token is not None)
    return tile_to_launch(
        FWD_CHOOSER,
        images.device,
        lambda: _chooser_key(images, weight, bias, cls_token, pos_embed, patch_size, out_dtype),
        lambda: GEMM_INTERPRETER_TILE,
        lambda: fwd_candidates(images.dtype, int(n) * int(tokens), int(dim), capability(images.device)),
    )


def _patch_embed_fwd(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cls_token: Optional[torch.Tensor],
    pos_embed: Optional[torch.Tensor],
    patch_size: int,
) -> torch.Tensor:
    """images (N, C, H, W) -> tokens (N, T, D), the GEMM's tile from ``fwd_tile``."""
    plan_key = (
        images.shape,
        images.stride(),
        images.dtype,
        images.device,
        weight.shape,
        weight.stride(),
        None if bias is None else bias.stride(0),
        None if cls_token is None else cls_token.dtype,
        None if pos_embed is None else pos_embed.dtype,
        patch_size,
    )
    plan = decided(_FWD_PLANS, plan_key)
    if plan is None:
        out_dtype = _out_dtype(images, cls_token, pos_embed)
        tile = fwd_tile(images, weight, bias, cls_token, pos_embed, patch_size, out_dtype)
        plan = keep(
            _FWD_PLANS,
            plan_key,
            _fwd_plan(tile, images, weight, bias, cls_token, pos_embed, patch_size, out_dtype),
        )
    return _launch_fwd(plan, images, weight, bias, cls_token, pos_embed)


def _patch_embed_bwd(
    grad_out: torch.Tensor,
    images: torch.Tensor,
    weight: torch.Tensor,
    patch_size: int,
    has_cls: bool,
    needs_images: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> d(images) (empty unless ``needs_images``), d(weight) (D, C, P, P)."""
    n, dim, k_dim, num_patches, tokens, grid_w = _geometry(images, weight, patch_size, has_cls)
    grad_out = grad_out.to(images.dtype).contiguous()
    (tile_d, tile_k, tile_m, warps), slices, rows_per_split, grid, input_grid = cached_call(
        _bwd_plan, n * num_patches, dim, k_dim, images.device
    )
    partial = slices > 1
    dw = torch.empty(
        (slices, dim, k_dim) if partial else (dim, k_dim),
        dtype=torch.float32 if partial else weight.dtype,
        device=images.device,
    )
    sizes = (n * num_patches, dim, k_dim, tokens, grid_w, patch_size)
    config = dict(
        HAS_CLS=has_cls,
        PRECISION=dot_precision(images.dtype),
        BLOCK_D=tile_d,
        BLOCK_K=tile_k,
        BLOCK_M=tile_m,
        num_warps=warps,
    )
    split = (rows_per_split, *images.stride(), dim * k_dim if partial else 0)
    launch(_patch_embed_bwd_weight_kernel, grid, images, grad_out, dw, *sizes, *split, **config)
    if partial:
        dw = dw.sum(0).to(weight.dtype)
    if not needs_images:
        return images.new_empty(0), dw.view(weight.shape)
    dimages = torch.empty_like(images)
    w2 = weight.reshape(dim, k_dim)
    launch(
        _patch_embed_bwd_input_kernel,
        input_grid,
        grad_out,
        w2,
        dimages,
        *sizes,
        *dimages.stride(),
        *w2.stride(),
        **config,
    )
    return dimages, dw.view(weight.shape)


patch_embed_bwd = direct(_patch_embed_bwd)


def _setup_context(ctx, inputs, output):
    images, weight, bias, cls_token, pos_embed, patch_size = inputs
    ctx.save_for_backward(images, weight)
    ctx.patch_size = patch_size
    ctx.has = (bias is not None, cls_token is not None, pos_embed is not None)


def _backward(ctx, grad_out):
    images, weight = ctx.saved_tensors
    has_bias, has_cls, has_pos = ctx.has
    dimages, dweight = patch_embed_bwd(
        grad_out, images, weight, ctx.patch_size, has_cls, ctx.needs_input_grad[0]
    )
    per_token = grad_out.sum(0, keepdim=True, dtype=torch.float32)  # (1, T, D): one pass over dOut
    dbias = per_token[0, int(has_cls) :].sum(0).to(weight.dtype) if has_bias else None
    dcls = per_token[:, :1].to(grad_out.dtype) if has_cls else None
    dpos = per_token.to(grad_out.dtype) if has_pos else None
    return dimages if ctx.needs_input_grad[0] else None, dweight, dbias, dcls, dpos, None


patch_embed_fwd = differentiable(_patch_embed_fwd, _backward, _setup_context)


def patch_embed_triton(images, weight, bias, patch_size, cls_token=None, pos_embed=None):
    """The Triton implementation of ``vk.patch_embed`` (arguments already validated)."""
    return patch_embed_fwd(images, weight, bias, cls_token, pos_embed, patch_size)


def patch_embed_extension(images, weight, bias, patch_size, cls_token=None, pos_embed=None):
    """``vk.patch_embed`` for the extension backend: ``vit_kernels::patchify`` (im2col from NCHW or
    channels_last), one GEMM with the bias, then the class token and position embedding."""
    if not (images.is_contiguous() or images.is_contiguous(memory_format=torch.channels_last)):
        images = images.contiguous()
    patches = patchify(images, patch_size)  # (N, L, C*P*P)
    tokens = F.linear(patches, weight.reshape(weight.shape[0], -1), bias)
    return add_class_and_position(tokens, cls_token, pos_embed)


def add_class_and_position(
    tokens: torch.Tensor, cls_token: Optional[torch.Tensor], pos_embed: Optional[torch.Tensor]
) -> torch.Tensor:
    """tokens (N, L, D), cls_token (1, 1, D), pos_embed (1, L [+ 1], D) -> (N, L [+ 1], D)."""
    if cls_token is not None:
        tokens = torch.cat([cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
    if pos_embed is not None:
        tokens = tokens + pos_embed
    return tokens


def patch_embed_ref(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    patch_size: int,
    cls_token: Optional[torch.Tensor] = None,
    pos_embed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Eager reference: conv (stride = kernel = P), flatten, transpose, cat, add."""
    tokens = F.conv2d(images, weight, bias, stride=patch_size).flatten(2).transpose(1, 2)
    return add_class_and_position(tokens, cls_token, pos_embed)


if _ext.LOADED:
    patchify = torch.ops.vit_kernels.patchify.default


def _extension_default(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    """The table's default on CPU float32 (eager): the extension, whose backward is 3.5-3.7x
    conv2d's and its forward within 10% (benchmarks/results/cpu-epyc-2threads-2026-11-22-quick.md)."""
    return device.type == "cpu" and dtype == torch.float32


def _triton_default(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    """The table's default on CUDA in 16 bits, eager and under torch.compile: Triton, 4-10x conv2d's
    and torch.compile's forward and forward + backward (ViT-B/16, B=128, bf16, H100;
    benchmarks/results/h100-2026-11-26.md)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


# The implementations of vk.patch_embed: backend -> function, support by device / dtype, shape limits.
backend.implementations(
    "patch_embed",
    torch=backend.Impl(patch_embed_ref),
    triton=backend.Impl(
        patch_embed_triton,
        supports=backend.triton_supports_dot,
        preferred=_triton_default,
        compiled=_triton_default,
    ),
    extension=backend.Impl(patch_embed_extension, supports=_ext.supports, preferred=_extension_default),
)
