"""LayerNorm over the last dimension, with an optional fused residual add.

s = x (+ r)
y = (s - mean(s)) * rstd * w + b,   rstd = 1 / sqrt(var(s) + eps)
returns y, or (y, s) when a residual is given (s is the new residual stream)
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from vit_kernels import _ext, _signature, backend
from vit_kernels._autograd import differentiable, direct
from vit_kernels._tiles import (
    TileChooser,
    decided,
    keep,
    plain_repr,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import LaunchPlan, cdiv, launch, multiprocessors, next_power_of_2
from vit_kernels.kernels.layer_norm import _layer_norm_bwd_kernel, _layer_norm_fwd_kernel

MAX_TRITON_COLS = 65536  # the Triton kernel holds a row in one tile
MAX_CUDA_COLS = 8192  # the extension's CUDA forward keeps a row in shared memory (32 KiB of fp32)


def _warps(elements: int, per_warp: int) -> int:
    """Warps for a program holding ``elements`` values of each live array, about ``per_warp`` of them
    per warp (so each thread keeps a few dozen in registers), between 1 and 16."""
    return max(1, min(16, elements // per_warp))


def _rows_per_program(block_d: int) -> int:
    """Forward rows per program of the default tile: several short rows share a program (ViT widths
    are 192 to 1024)."""
    return max(1, min(16, 4096 // block_d))


class ForwardTile(NamedTuple):
    """A forward launch configuration: rows per program, warps."""

    rows: int
    warps: int

    __repr__ = plain_repr


class BackwardTile(NamedTuple):
    """A backward launch configuration: rows per tile, programs per SM, warps."""

    rows: int
    programs_per_sm: int
    warps: int

    __repr__ = plain_repr


# Launch configurations per key (vit_kernels/_tiles.py: dtype, padded width, which of residual /
# weight / bias, rows bucket); the first of each list is the default (checked once on the user's
# GPU, and the interpreter's); ``vk.tune`` searches them all.
# Forward tile: (rows per program, warps). Backward tile: (rows per tile, programs per SM, warps): the
# grid is min(tiles, programs per SM x SMs), each program walking its share of tiles, so that a
# large batch neither launches a program per few rows nor leaves SMs idle.
BWD_PROGRAMS_PER_SM = (4, 2, 8)


def _per_thread_ok(elements: int, warps: int, low: int, high: int) -> bool:
    return low <= elements // (32 * warps) <= high


@functools.cache  # asked on every launch: a decided call looks the tile up, and the list stays
def fwd_candidates(block_d: int) -> tuple[ForwardTile, ...]:
    """(rows, warps) forward tiles for rows padded to ``block_d``: the default, then every tile of
    1-8 rows whose threads each hold 8-16 values of a row tile."""
    rows = _rows_per_program(block_d)
    tiles = [ForwardTile(rows, _warps(rows * block_d, 1024))]
    for rows in (1, 2, 4, 8):
        for warps in (1, 2, 4, 8, 16):
            if (
                rows * block_d <= 16384
                and _per_thread_ok(rows * block_d, warps, 8, 16)
                and (rows, warps) not in tiles
            ):
                tiles.append(ForwardTile(rows, warps))
    return tuple(tiles)


@functools.cache
def bwd_candidates(block_d: int) -> tuple[BackwardTile, ...]:
    """(rows, programs per SM, warps) backward tiles: the default, then tiles of 1-4 rows whose
    threads each hold 8-16 values of a row tile, each with every BWD_PROGRAMS_PER_SM."""
    rows = _rows_per_program(block_d)
    default = BackwardTile(rows, BWD_PROGRAMS_PER_SM[0], _warps(rows * block_d, 512))
    tiles = [default]
    for rows in (1, 2, 4):
        for warps in (1, 2, 4, 8, 16):
            if not (rows * block_d <= 8192 and _per_thread_ok(rows * block_d, warps, 8, 16)):
                continue
            for per_sm in BWD_PROGRAMS_PER_SM:
                if (rows, per_sm, warps) not in tiles:
                    tiles.append(BackwardTile(rows, per_sm, warps))
    return tuple(tiles)


FWD_CHOOSER = TileChooser("layer_norm forward")
BWD_CHOOSER = TileChooser("layer_norm backward")
# Per call signature (rows x D, row strides, dtype, device, the optional inputs, eps), for
# ``_tiles.decided``: the forward's ``_fwd_plan``, the backward's ``_bwd_plan``.
_FWD_PLANS: dict[tuple, tuple] = {}
_BWD_PLANS: dict[tuple, tuple] = {}


def tile_report() -> list[dict]:
    """Every LayerNorm tile choice made in this process: kernel, key, the tile chosen and each
    candidate's time in ms or why it was excluded."""
    return report_rows("forward", FWD_CHOOSER) + report_rows("backward", BWD_CHOOSER)


def _tile(
    chooser: TileChooser,
    rows2: torch.Tensor,
    present: tuple[bool, ...],
    candidates_for: Callable[[int], tuple],
) -> tuple:
    """The tile to launch on rows2 (rows, D) (``tile_to_launch``), the default for no rows (nothing
    to validate on). Keyed by rows2's device and dtype, D padded to a power of 2 (``block_d``),
    ``present`` (which of the optional inputs the call has) and the rows bucket; the candidates are
    ``candidates_for(block_d)``."""
    rows, dim = (int(n) for n in rows2.shape)  # SymInts made concrete (traced with dynamic shapes)
    block_d = next_power_of_2(dim)
    candidates = candidates_for(block_d)
    if rows == 0:
        return candidates[0]
    key = (str(rows2.device), str(rows2.dtype), block_d, *present, _signature.bucket(rows))
    return tile_to_launch(chooser, rows2.device, lambda: key, lambda: candidates[0], lambda: candidates)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (rows, D) with unit column stride, copying only when it must."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _fwd_plan(tile, x2, r2, weight, bias, eps) -> LaunchPlan:
    """The forward launch with ``tile`` on rows x2 (+ r2) (rows, D)."""
    rows, dim = x2.shape
    per_program, warps = tile
    args = (
        rows,
        dim,
        x2.stride(0),
        0 if r2 is None else r2.stride(0),
        dim,  # y's row stride (y is new, D > 0)
        dim,
        0 if weight is None else weight.stride(0),
        0 if bias is None else bias.stride(0),
        eps,
    )
    return LaunchPlan(
        (cdiv(rows, per_program),),
        args,
        dict(
            ROWS=per_program,
            BLOCK_D=next_power_of_2(dim),
            HAS_RESIDUAL=r2 is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            num_warps=warps,
        ),
        x2.dtype,
        x2.device,
    )


def _launch_fwd(plan: LaunchPlan, x2, r2, weight, bias) -> tuple[torch.Tensor, ...]:
    """The forward kernel launched by ``plan`` (``_fwd_plan``) -> y (rows, D), s = x + r (rows, D)
    (empty (0,) without r2), mean and rstd (rows,) float32."""
    rows, dim = plan.args[0], plan.args[1]
    dtype, device = plan.dtype, plan.device
    y = torch.empty((rows, dim), dtype=dtype, device=device)
    summed = torch.empty((rows, dim) if r2 is not None else (0,), dtype=dtype, device=device)
    mean = torch.empty(rows, dtype=torch.float32, device=device)
    rstd = torch.empty_like(mean)
    inputs = (
        x2,
        x2 if r2 is None else r2,
        x2 if weight is None else weight,
        x2 if bias is None else bias,
    )
    launch(
        _layer_norm_fwd_kernel,
        plan.grid,
        *inputs,
        y,
        summed,
        mean,
        rstd,
        *plan.args,
        **plan.config,
    )
    return y, summed, mean, rstd


def _layer_norm_fwd(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    residual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual (..., D) -> y (..., D), s = x + residual (..., D) (empty without a residual),
    mean and rstd (rows,) fp32."""
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    plan_key = (
        x2.shape,
        x2.stride(0),
        x.dtype,
        x.device,
        None if r2 is None else r2.stride(0),
        None if weight is None else weight.stride(0),
        None if bias is None else bias.stride(0),
        eps,
    )
    plan = decided(_FWD_PLANS, plan_key)
    if plan is None:
        present = (residual is not None, weight is not None, bias is not None)  # for the tile key

        tile = _tile(FWD_CHOOSER, x2, present, fwd_candidates)
        made = _fwd_plan(tile, x2, r2, weight, bias, eps)
        plan = keep(_FWD_PLANS, plan_key, made)
    y, summed, mean, rstd = _launch_fwd(plan, x2, r2, weight, bias)
    return y.view(x.shape), summed.view(x.shape) if residual is not None else summed, mean, rstd


class BackwardPlan(NamedTuple):
    """The backward launch of a decided call, besides its tensors."""

    launch: LaunchPlan  # its dtype and device: ds's
    partials: tuple  # the shape of the partial sums of d(weight) and d(bias)


def _bwd_plan(tile, s2, dy2, dsum2, weight, needs_weight_bias) -> BackwardPlan:
    """The backward launch with ``tile`` on rows (rows, D): one program per tile of rows, at most
    ``programs per SM`` x SMs; the partial sums of d(weight) and d(bias) per program ((1, D),
    unwritten, without them)."""
    rows, dim = s2.shape
    tile_rows, per_sm, warps = tile
    programs = max(1, min(cdiv(rows, tile_rows), per_sm * multiprocessors(s2.device)))
    args = (
        rows,
        dim,
        cdiv(cdiv(rows, tile_rows), programs),
        s2.stride(0),
        dy2.stride(0),
        0 if dsum2 is None else dsum2.stride(0),
        dim,  # ds's row stride (ds is new, D > 0)
        0 if weight is None else weight.stride(0),
    )
    config = dict(
        ROWS=tile_rows,
        BLOCK_D=next_power_of_2(dim),
        HAS_DSUM=dsum2 is not None,
        HAS_WEIGHT=weight is not None,
        NEEDS_WB=needs_weight_bias,
        num_warps=warps,
    )
    return BackwardPlan(
        LaunchPlan((programs,), args, config, s2.dtype, s2.device),
        (programs if needs_weight_bias else 1, dim),
    )


def _launch_bwd(plan: BackwardPlan, s2, dy2, dsum2, weight, mean, rstd) -> tuple[torch.Tensor, ...]:
    """The backward kernel launched by ``plan`` (``_bwd_plan``) -> ds like s2, the partial sums of
    d(weight) and d(bias) float32."""
    grid, args, config, dtype, device = plan.launch
    ds = torch.empty((args[0], args[1]), dtype=dtype, device=device)
    partial_w = torch.empty(plan.partials, dtype=torch.float32, device=device)
    partial_b = torch.empty_like(partial_w)
    inputs = (s2, dy2, dy2 if dsum2 is None else dsum2, s2 if weight is None else weight, mean, rstd)
    launch(_layer_norm_bwd_kernel, grid, *inputs, ds, partial_w, partial_b, *args, **config)
    return ds, partial_w, partial_b


def _layer_norm_bwd(
    grad_y: torch.Tensor,
    grad_sum: Optional[torch.Tensor],
    summed: torch.Tensor,
    weight: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    needs_weight_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> d(s) (..., D) (= dx = dresidual), d(weight) (D,) and d(bias) (D,) in fp32."""
    s2, dy2 = _rows(summed), _rows(grad_y)
    dsum2 = _rows(grad_sum) if grad_sum is not None else None
    plan_key = (
        s2.shape,
        s2.stride(0),
        dy2.stride(0),
        s2.dtype,
        s2.device,
        None if dsum2 is None else dsum2.stride(0),
        None if weight is None else weight.stride(0),
        needs_weight_bias,
    )
    plan = decided(_BWD_PLANS, plan_key)
    if plan is None:
        present = (grad_sum is not None, weight is not None, needs_weight_bias)  # for the tile key

        tile = _tile(BWD_CHOOSER, s2, present, bwd_candidates)
        made = _bwd_plan(tile, s2, dy2, dsum2, weight, needs_weight_bias)
        plan = keep(_BWD_PLANS, plan_key, made)
    ds, partial_w, partial_b = _launch_bwd(plan, s2, dy2, dsum2, weight, mean, rstd)
    return ds.view(summed.shape), partial_w.sum(0), partial_b.sum(0)


layer_norm_bwd = direct(_layer_norm_bwd)


def _fwd_setup_context(ctx, inputs, output):
    x, weight, bias, eps, residual = inputs
    y, summed, mean, rstd = output
    ctx.save_for_backward(summed if residual is not None else x, weight, mean, rstd)
    ctx.has = (weight is not None, bias is not None, residual is not None)


def _fwd_backward(ctx, grad_y, grad_sum, grad_mean, grad_rstd):
    summed, weight, mean, rstd = ctx.saved_tensors
    has_weight, has_bias, has_residual = ctx.has
    grad_sum = grad_sum if has_residual else None
    if grad_y is None and grad_sum is None:
        return (None,) * 5
    if grad_y is None:  # only the sum x + residual was used
        grad_y = torch.zeros_like(summed)
    ds, dw, db = layer_norm_bwd(grad_y, grad_sum, summed, weight, mean, rstd, has_weight or has_bias)
    return (
        ds,
        dw.to(ds.dtype) if has_weight else None,
        db.to(ds.dtype) if has_bias else None,
        None,
        ds if has_residual else None,
    )


layer_norm_fwd = differentiable(_layer_norm_fwd, _fwd_backward, _fwd_setup_context)


def layer_norm_triton(x, weight, bias, eps, residual):
    """The Triton implementation of ``vk.layer_norm`` (arguments already validated)."""
    y, summed, _, _ = layer_norm_fwd(x, weight, bias, eps, residual)
    return y if residual is None else (y, summed)


def layer_norm_extension(x, weight, bias, eps, residual):
    """The C++/CUDA implementation of ``vk.layer_norm``: one ``vit_kernels::fused_layer_norm`` call."""
    y, summed, _, _ = fused_layer_norm(
        x.contiguous(),
        None if residual is None else residual.contiguous(),
        None if weight is None else weight.contiguous(),
        None if bias is None else bias.contiguous(),
        eps,
    )
    return y if residual is None else (y, summed)


def layer_norm_ref(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-6,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x (..., D), weight (D,), bias (D,), residual (..., D) -> y (..., D) [, s (..., D)]."""
    summed = x if residual is None else x + residual
    y = F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, summed)


if _ext.LOADED:
    fused_layer_norm = torch.ops.vit_kernels.fused_layer_norm.default


def _triton_limits(x, weight=None, bias=None, eps=1e-6, residual=None) -> Optional[str]:
    """A row is one tile: at most MAX_TRITON_COLS columns."""
    if x.shape[-1] > MAX_TRITON_COLS:
        return f"D = {x.shape[-1]} > {MAX_TRITON_COLS} columns (a row is one tile)"
    return None


def _extension_limits(x, weight=None, bias=None, eps=1e-6, residual=None) -> Optional[str]:
    """The CUDA kernel keeps a row in shared memory: at most MAX_CUDA_COLS columns."""
    if x.device.type == "cuda" and x.shape[-1] > MAX_CUDA_COLS:
        return f"D = {x.shape[-1]} > {MAX_CUDA_COLS} columns on CUDA (a row is kept in shared memory)"
    return None


def _extension_default(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    """The table's default on CUDA in 16 bits without gradients (eager inference): the extension's
    forward, 1.7x PyTorch's with the residual add; forward + backward it is not faster (ViT-B/16,
    B=128, bf16, H100; benchmarks/results/h100-2026-11-22.md). Under torch.compile Inductor fuses
    PyTorch's LayerNorm with its neighbours."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not grad


# The implementations of vk.layer_norm: backend -> function, support by device / dtype, shape limits.
backend.implementations(
    "layer_norm",
    torch=backend.Impl(layer_norm_ref),
    triton=backend.Impl(
        layer_norm_triton, supports=backend.triton_supports_elementwise, limits=_triton_limits
    ),
    extension=backend.Impl(
        layer_norm_extension, supports=_ext.supports, limits=_extension_limits, preferred=_extension_default
    ),
)
