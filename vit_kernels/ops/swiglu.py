"""SwiGLU feed-forward layers (LLaMA, EVA02, timm's ``SwiGLU``).

    swiglu:      H = silu(X W_g^T + b_g) * (X W_u^T + b_u)          silu(z) = z sigmoid(z)
    swiglu_mlp:  Y = H W_d^T + b_d (+ R)

    with G = X W_g^T + b_g, U = X W_u^T + b_u, s = sigmoid(G):
        dH = dY W_d;  dG = dH U s (1 + G (1 - s));  dU = dH silu(G)
        dX = dG W_g + dU W_u;  dW_g = dG^T X;  dW_u = dU^T X;  db_g = sum_rows dG;  db_u = sum_rows dU
        dW_d = dY^T H;  db_d = sum_rows dY;  dR = dY

The gate and up projections are one launch of a dual-accumulator GEMM (each program reads its X
tile once for both weights), with the biases and the gating in its epilogue; it writes G and U
beside H only when a gradient will be asked for. The down projection (+ residual), dH, dX and the
weight gradients are the GEMM engine of ``vit_kernels.ops.gemm``; one elementwise pass makes dG,
dU and their column sums (the bias gradients). Both layers are one registered pair of ops,
``swiglu_fwd`` and ``swiglu_bwd``, whose down projection is optional.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vit_kernels import backend
from vit_kernels._autograd import differentiable, direct
from vit_kernels._signature import bucket, needs_grad
from vit_kernels._tiles import (
    TileChooser,
    decided,
    keep,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import (
    LaunchPlan,
    cdiv,
    dot_precision,
    launch,
)
from vit_kernels.kernels.swiglu import _swiglu_bwd_kernel, _swiglu_fwd_kernel
from vit_kernels.ops.gemm import (
    GemmTile,
    _matmul,
    _rows,
    _weight_and_bias_grads,
    gemm_config,
    column_sums_pass,
)

# The dual GEMM's launch configurations on a GPU, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages):
# per key (as the GEMM's, ``vit_kernels._tiles``), the first one the default (checked once on the
# user's GPU; ``vk.tune`` searches them all). Two fp32 accumulators
# live in registers, so the tiles hold half the elements of the single GEMM's (128 x 128 would spill):
# 128 x 64 and 64 x 128 with 8 warps for 16 bits (with 4 warps the compile gate found 255 registers
# and 300-450 bytes of stack per thread on sm_80 and sm_90), 64 x 64 with 4 warps; shared memory per
# stage is the A tile and two B tiles, 24-40 KB, within sm_80's 164 KB at 3-4 stages. Exact float32
# (ieee FMA) takes 32-wide tiles (64 x 32 used stack on sm_90). The default 128 x 64 x 64, 8 warps,
# is the single GEMM's default tile with its columns halved; no GPU has timed these tiles yet. Every
# entry is compiled for sm_80 and sm_90 by `make check-gpu GPU_CHECK_ARGS=--every-tile`.
SWIGLU_TILES_16BIT = tuple(
    GemmTile(*tile)
    for tile in ((128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (64, 64, 64, 4, 4), (64, 64, 64, 4, 3))
)
SWIGLU_TILES_FP32 = (GemmTile(32, 64, 32, 4, 3), GemmTile(32, 32, 32, 4, 3))
SWIGLU_INTERPRETER_TILE = GemmTile(32, 32, 32, 1, 1)  # fixed and small: the interpreter's cost is per tile op
SWIGLU_CHOOSER = TileChooser("SwiGLU dual GEMM")


def swiglu_candidates(dtype: torch.dtype, m: int, n: int) -> tuple:
    """The tiles a GPU tries for an (m x n) H with operands of ``dtype``: the dtype's table without
    tiles much larger than the problem (the table's smallest where none is left)."""
    tiles = SWIGLU_TILES_FP32 if dtype == torch.float32 else SWIGLU_TILES_16BIT
    fitting = tuple(t for t in tiles if t.block_m <= max(64, m) and t.block_n <= max(64, n))
    return fitting or tiles[-1:]


def tile_report() -> list[dict]:
    """Every dual-GEMM tile choice made in this process (see ``vit_kernels.ops.gemm.tile_report``)."""
    return report_rows("swiglu", SWIGLU_CHOOSER)


class _DualGemm:
    """One dual-GEMM call being planned: x2 (M, K), the gate and up weights (N, K), their biases, for
    the tile choice (``key``, ``trial``) and the launch plan of a tile (``plan``); a decided call
    builds none."""

    __slots__ = ("x2", "gate_weight", "gate_bias", "up_weight", "up_bias", "save_preact")

    def __init__(self, x2, gate_weight, gate_bias, up_weight, up_bias, save_preact: bool):
        self.x2, self.gate_weight, self.gate_bias = x2, gate_weight, gate_bias
        self.up_weight, self.up_bias, self.save_preact = up_weight, up_bias, save_preact

    def plan(self, tile: GemmTile) -> LaunchPlan:
        """The launch with ``tile``."""
        x2, wg, wu, bg, bu = self.x2, self.gate_weight, self.up_weight, self.gate_bias, self.up_bias
        (m, k), n = x2.shape, wg.shape[0]
        args = (
            m,
            n,
            k,
            *x2.stride(),
            *wg.stride()[::-1],  # W^T (K, N) by strides: B[k, n] = W[n, k]
            *wu.stride()[::-1],
            0 if bg is None else bg.stride(0),
            0 if bu is None else bu.stride(0),
        )
        return LaunchPlan(
            (cdiv(m, tile.block_m) * cdiv(n, tile.block_n),),
            args,
            dict(
                HAS_BIAS_G=bg is not None,
                HAS_BIAS_U=bu is not None,
                SAVE_PREACT=self.save_preact,
                PRECISION=dot_precision(x2.dtype),
                **gemm_config(tile),
            ),
            x2.dtype,
            x2.device,
        )

    def key(self) -> tuple:
        """Device, dtype, the bias and SAVE_PREACT flags, M and K bucketed, N exact, and which of x's
        and the weights' dimensions have unit stride (plain ints)."""
        x2, wg, wu = self.x2, self.gate_weight, self.up_weight
        (m, k), n = x2.shape, wg.shape[0]
        return (
            x2.device,
            x2.dtype,
            self.gate_bias is not None,
            self.up_bias is not None,
            self.save_preact,
            bucket(int(m)),
            int(n),
            bucket(int(k)),
            bool(x2.stride(0) == 1),
            bool(x2.stride(1) == 1),
            bool(wg.stride(1) == 1),
            bool(wu.stride(1) == 1),
        )


def _dual_tile(gemm: _DualGemm) -> GemmTile:
    """The tile the dual GEMM launches: see ``vit_kernels._tiles.tile_to_launch``."""
    m, n = int(gemm.x2.shape[0]), int(gemm.gate_weight.shape[0])
    return tile_to_launch(
        SWIGLU_CHOOSER,
        gemm.x2.device,
        gemm.key,
        lambda: SWIGLU_INTERPRETER_TILE,
        lambda: swiglu_candidates(gemm.x2.dtype, m, n),
    )


def _gate_and_up(x2, gate_weight, gate_bias, up_weight, up_bias, save_preact: bool):
    """(H, G, U) (M, Hd) of rows x2 (M, D), from one launch of the dual GEMM; G and U are empty (0,)
    unless ``save_preact``."""
    m, n = x2.shape[0], gate_weight.shape[0]
    if m == 0 or n == 0:
        return _outputs(m, n, x2.dtype, x2.device, save_preact)
    plan_key = (
        x2.shape,
        x2.stride(),
        gate_weight.shape,
        gate_weight.stride(),
        up_weight.stride(),
        x2.dtype,
        x2.device,
        None if gate_bias is None else gate_bias.stride(0),
        None if up_bias is None else up_bias.stride(0),
        save_preact,
    )
    plan = decided(_PLANS, plan_key)
    if plan is None:
        gemm = _DualGemm(x2, gate_weight, gate_bias, up_weight, up_bias, save_preact)
        plan = keep(_PLANS, plan_key, gemm.plan(_dual_tile(gemm)))
    return _launch(plan, x2, gate_weight, gate_bias, up_weight, up_bias, save_preact)


def _outputs(m: int, n: int, dtype: torch.dtype, device: torch.device, save_preact: bool) -> tuple:
    """Fresh (H, G, U) (M, N) in ``dtype``; G and U empty (0,) without SAVE_PREACT."""
    preact = (m, n) if save_preact else (0,)
    return (
        torch.empty((m, n), dtype=dtype, device=device),
        torch.empty(preact, dtype=dtype, device=device),
        torch.empty(preact, dtype=dtype, device=device),
    )


def _launch(plan: LaunchPlan, x2, gate_weight, gate_bias, up_weight, up_bias, save_preact: bool) -> tuple:
    """Launch ``plan`` (``_DualGemm.plan``) into fresh (H, G, U) (``_outputs``) and return them (an
    empty K still runs: H = silu(b_g) * b_u)."""
    grid, args, config, dtype, device = plan
    h, g, u = _outputs(args[0], args[1], dtype, device, save_preact)
    biases = (h if gate_bias is None else gate_bias, h if up_bias is None else up_bias)
    preacts = (g, u) if save_preact else (h, h)
    launch(_swiglu_fwd_kernel, grid, x2, gate_weight, up_weight, *biases, h, *preacts, *args, **config)
    return h, g, u


_PLANS: dict[tuple, tuple] = {}  # per call signature, for _tiles.decided: ``_DualGemm.plan``


# (rows per step, columns per program, warps): 16 elements per thread of each of the five tiles
# (32 rows took up to 255 registers and stack on sm_80 in the compile gate)
SWIGLU_BWD_BLOCK = (16, 128, 4)


def _swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, bias_grad: bool):
    """dG, dU (M, N) in G's dtype and, when ``bias_grad``, their column sums (N,) float32 (else None),
    from one pass over ``row_slices``."""
    dg, du = torch.empty_like(g), torch.empty_like(u)
    dbg, dbu = column_sums_pass(
        _swiglu_bwd_kernel, SWIGLU_BWD_BLOCK, (dh.contiguous(), g, u), (dg, du), bias_grad
    )
    return dg, du, dbg, dbu


def _gate_and_up_grads(dh2, x2, g, u, gate_weight, up_weight, needs_bias_g: bool, needs_bias_u: bool):
    """From dH (M, Hd) and the saved G, U: dX (M, D) = dG W_g + dU W_u (the second GEMM adding the
    first's float32 result in its epilogue), dW_g, dW_u, and db_g, db_u (float32 or None)."""
    dg, du, dbg, dbu = _swiglu_backward(dh2, g, u, needs_bias_g or needs_bias_u)
    dx = _matmul(dg, gate_weight, torch.float32)
    dx = _matmul(du, up_weight, x2.dtype, residual=dx)
    dwg, _ = _weight_and_bias_grads(dg, x2, gate_weight.dtype, False)
    dwu, _ = _weight_and_bias_grads(du, x2, up_weight.dtype, False)
    return dx, dwg, dwu, dbg if needs_bias_g else None, dbu if needs_bias_u else None


def _swiglu_fwd(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_weight: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu (no ``down_weight``): H (..., Hd); swiglu_mlp: Y = H W_d^T + b_d (+ residual)
    (..., D_out), the residual added in the down GEMM's epilogue. Then H (M, Hd) when there is a
    down projection (its weight gradient reads it; else empty), and the pre-activations G, U
    (M, Hd) that backward reads when ``save_preact`` (else empty: not written)."""
    h, g, u = _gate_and_up(_rows(x), gate_weight, gate_bias, up_weight, up_bias, save_preact)
    if down_weight is None:
        return h.view(*x.shape[:-1], gate_weight.shape[0]), h.new_empty(0), g, u
    out = _matmul(
        h,
        down_weight.t(),
        torch.result_type(x, residual) if residual is not None else x.dtype,
        bias=down_bias,
        residual=_rows(residual) if residual is not None else None,
    )
    return out.view(*x.shape[:-1], down_weight.shape[0]), h, g, u


def _swiglu_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: Optional[torch.Tensor],
    h: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    needs_bias_g: bool,
    needs_bias_u: bool,
    needs_bias_d: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx, dW_g, db_g, dW_u, db_u, dW_d, db_d (those of an absent bias or down projection
    empty): dW_d, db_d from dY and H (``_weight_and_bias_grads``) and dH = dY W_d where there is a
    down projection (else dH = dY), then the gate and up gradients."""
    dy2 = _rows(grad_out).to(x.dtype)
    empty = dy2.new_empty(0)
    if down_weight is None:
        dh2, dwd, dbd = dy2, empty, None
    else:
        dwd, dbd = _weight_and_bias_grads(dy2, h, down_weight.dtype, needs_bias_d)
        dh2 = _matmul(dy2, down_weight, x.dtype)
    dx, dwg, dwu, dbg, dbu = _gate_and_up_grads(
        dh2, _rows(x), g, u, gate_weight, up_weight, needs_bias_g, needs_bias_u
    )
    return (
        dx.view(x.shape),
        dwg,
        dbg.to(gate_weight.dtype) if needs_bias_g else empty,
        dwu,
        dbu.to(up_weight.dtype) if needs_bias_u else empty,
        dwd,
        dbd.to(down_weight.dtype) if needs_bias_d else empty,
    )


swiglu_bwd = direct(_swiglu_bwd)


def _swiglu_setup_context(ctx, inputs, output):
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual, _ = inputs
    ctx.save_for_backward(x, gate_weight, up_weight, down_weight, output[1], output[2], output[3])
    ctx.has = (gate_bias is not None, up_bias is not None, down_bias is not None, residual is not None)


def _swiglu_backward_op(ctx, grad_out, grad_h, grad_g, grad_u):
    if grad_out is None:
        return (None,) * 9
    x, gate_weight, up_weight, down_weight, h, g, u = ctx.saved_tensors
    has_bg, has_bu, has_bd, has_residual = ctx.has
    dx, dwg, dbg, dwu, dbu, dwd, dbd = swiglu_bwd(
        grad_out, x, gate_weight, up_weight, down_weight, h, g, u, has_bg, has_bu, has_bd
    )
    return (
        dx,
        dwg,
        dbg if has_bg else None,
        dwu,
        dbu if has_bu else None,
        None if down_weight is None else dwd,
        dbd if has_bd else None,
        grad_out if has_residual else None,
        None,
    )


swiglu_fwd = differentiable(_swiglu_fwd, _swiglu_backward_op, _swiglu_setup_context)


def swiglu_triton(x, gate_weight, gate_bias, up_weight, up_bias):
    """The Triton implementation of ``vk.swiglu`` (inference skips writing G and U)."""
    args = (x, gate_weight, gate_bias, up_weight, up_bias)
    return swiglu_fwd(*args, None, None, None, needs_grad(args))[0]


def swiglu_mlp_triton(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual=None):
    """The Triton implementation of ``vk.swiglu_mlp`` (inference skips writing G and U)."""
    args = (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, residual)
    return swiglu_fwd(*args, needs_grad(args))[0]


def swiglu_ref(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """x (..., D), gate_weight and up_weight (Hd, D), biases (Hd,) -> silu(x W_g^T + b_g) * (x W_u^T + b_u)."""
    return F.silu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)


def swiglu_mlp_ref(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (..., D), down_weight (D_out, Hd), down_bias (D_out,), residual (..., D_out) -> (..., D_out)."""
    out = F.linear(swiglu_ref(x, gate_weight, gate_bias, up_weight, up_bias), down_weight, down_bias)
    return out if residual is None else out + residual


def _no_extension_kernel(device: torch.device, dtype: torch.dtype) -> str:
    return (
        "the extension has no SwiGLU kernel (its GEMMs would be PyTorch's own): "
        "auto picks the Triton kernels or the reference"
    )


def _extension_unsupported(*args):
    raise NotImplementedError(_no_extension_kernel(torch.device("cpu"), torch.float32))


# The implementations of vk.swiglu and vk.swiglu_mlp: backend -> function, support by device / dtype.
backend.implementations(
    "swiglu",
    torch=backend.Impl(swiglu_ref),
    triton=backend.Impl(swiglu_triton, supports=backend.triton_supports_dot),
    extension=backend.Impl(_extension_unsupported, supports=_no_extension_kernel),
)
backend.implementations(
    "swiglu_mlp",
    torch=backend.Impl(swiglu_mlp_ref),
    triton=backend.Impl(swiglu_mlp_triton, supports=backend.triton_supports_dot),
    extension=backend.Impl(_extension_unsupported, supports=_no_extension_kernel),
)
