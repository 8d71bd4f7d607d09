"""The GEMM engine that linear, linear_gelu, mlp, SwiGLU and patch_embed launch: C = A @ B (+ bias,
GELU or its gradient, residual, row or column sums) by the kernels of ``vit_kernels.kernels.gemm``,
with split-K for deep reductions, the tile tables (the default checked on the user's GPU, all
searched by ``vk.tune``), and
the bias gradient's two ways."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from vit_kernels._autograd import tracing
from vit_kernels._signature import bucket
from vit_kernels._tiles import (
    TileChooser,
    decided,
    keep,
    report_rows,
    tile_to_launch,
)
from vit_kernels._triton import (
    LAUNCH_CONFIGS,
    TensorDescriptor,
    cached_call,
    capability,
    cdiv,
    dot_precision,
    interpreted,
    launch,
    multiprocessors,
)
from vit_kernels.kernels.gemm import _gelu_bwd_kernel, _linear_kernel, _linear_tma_kernel

# Epilogues of the GEMM kernel.
EPILOGUE_NONE, EPILOGUE_GELU, EPILOGUE_GELU_GRAD = 0, 1, 2
# Sums the GEMM kernel can reduce on the way (a bias gradient without a second read of its input).
SUMS_NONE, SUMS_OF_C_COLUMNS, SUMS_OF_A_ROWS = 0, 1, 2


# GEMM launch configurations on a GPU, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), per key
# (``vit_kernels._tiles``: dtype, epilogue, size bucket, operand layout): the first one is the default
# (checked once on the user's GPU), for 16 bits 128 x 128 x 64 where TMA cannot read the operands;
# ``vk.tune`` searches them all. 16-bit inputs use tensor cores (mma on
# sm_80, wgmma on sm_90). The 128 x 256, 256 x 128 and
# 128 x 128 x 128 tiles are the Hopper ones (8 warps as two warpgroups, 3 stages: 144-192 KB of
# shared memory on sm_90, within its 227 KB, and 96-128 KB on sm_80, whose pipeline keeps one stage
# fewer); the 64-wide ones serve small problems and sm_80. float32 stays exact (ieee FMA, no tf32),
# where a 128 x 128 fp32 accumulator per CTA would spill, so its tiles are 64 wide at most. Every
# entry is compiled for sm_80 and sm_90 by `make check-gpu GPU_CHECK_ARGS=--every-tile`, which fails
# on spills and on shared memory over the limit, and run against float64 by the GPU tests
# (tests/test_tiles.py).
TMA = "tma"


class GemmTile(NamedTuple):
    """One launch configuration of a GEMM kernel: its blocks, warps and pipeline stages, and which
    kernel runs it (``"pointer"``, or ``TMA`` for the persistent TMA kernel). Shown as the plain
    tuple, without the kernel where it is the pointer one."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    kernel: str = "pointer"

    def __repr__(self) -> str:
        return repr(tuple(self) if self.kernel != "pointer" else tuple(self)[:5])


GEMM_TILES_16BIT = tuple(
    GemmTile(*tile)
    for tile in (
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
    )
)
GEMM_TILES_FP32 = tuple(
    GemmTile(*tile) for tile in ((64, 64, 32, 4, 3), (32, 64, 32, 4, 3), (64, 32, 32, 4, 3))
)
# The persistent TMA kernel's tiles (``_linear_tma_kernel``), offered beside the table above on
# sm_90+ for 16-bit operands that TMA can read (one unit stride, the other 16-byte aligned, 16-byte
# aligned data): the shapes of Triton's persistent Hopper matmul (128 x 256 and 128 x 128 with 8
# warps as two warpgroups, 3-4 stages of 32-48 KB). Where TMA reads the operands they come first
# (``gemm_candidates``: they won every 16-bit GEMM an H200 timed).
GEMM_TILES_TMA = tuple(
    GemmTile(*tile, TMA)
    for tile in (
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 128, 8, 3),
    )
)
GEMM_INTERPRETER_TILE = GemmTile(32, 32, 32, 1, 1)  # fixed and small: the interpreter's cost is per tile op
GEMM_GROUP_M = 8  # tile rows per group of the grouped launch order (B tiles shared in L2)
MAX_BLOCK_K = max(
    tile.block_k for tile in GEMM_TILES_16BIT + GEMM_TILES_FP32
)  # split-K slices are multiples of it
GEMM_CHOOSER = TileChooser("GEMM")


@functools.lru_cache(maxsize=None)
def gemm_config(tile: GemmTile) -> dict:
    """A tile as the GEMM kernels' launch keywords (one dict per tile, shared: read, never change it)."""
    return {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "GROUP_M": GEMM_GROUP_M,
        "num_warps": tile.warps,
        "num_stages": tile.stages,
    }


class GemmPlan(NamedTuple):
    """Everything one GEMM launch with a tile needs besides its tensors (``_Gemm.plan``): a decided
    call finds it in ``_PLANS`` and only allocates and launches (``_launch``)."""

    tile: GemmTile
    slices: int  # K slices: C is a float32 workspace (slices, M, N) summed after the launch when > 1
    c_shape: tuple
    partial_shape: Optional[tuple]  # of the float32 partial sums, None without sums
    grid: tuple  # of the pointer kernel: (tiles of C, K slices)
    args: tuple  # the pointer kernel's arguments after its tensors: sizes, then strides
    config: dict  # the kernels' keywords: the epilogue's flags and the tile's configuration
    device: torch.device  # where the outputs are allocated (a plan is kept per device)
    tma: Optional["TmaLaunch"]  # the launch by the TMA kernel, where the tile and the layout allow it


class TmaLaunch:
    """A plan's launch by the persistent TMA kernel, for a tile naming it and operands whose layout
    a descriptor reads (``tma_layout``; the data's 16-byte alignment is asked per call): which of A
    and B are read through their transposes, the grid (one program per multiprocessor at most), the
    arguments after the tensors and the keywords. The descriptors are built by the plan's first
    launch (``TensorDescriptor.from_tensor`` and its checks, host work on every call otherwise) and
    kept without a base; a later launch copies them over its own operands (the plan fixes their
    shapes and strides). No kept copy holds a tensor: no storage outlives its call."""

    __slots__ = ("a_t", "b_t", "grid", "args", "config", "blocks", "kept")

    def __init__(self, a_t: bool, b_t: bool, grid: tuple, args: tuple, config: dict, tile: GemmTile):
        self.a_t, self.b_t, self.grid, self.args, self.config = a_t, b_t, grid, args, config
        bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
        self.blocks = ([bk, bm] if a_t else [bm, bk], [bn, bk] if b_t else [bk, bn])
        self.kept: Optional[list] = None  # the descriptors without a base

    def descriptors(self, a: torch.Tensor, b: torch.Tensor) -> list:
        """A's and B's descriptors (over their transposes where ``a_t`` / ``b_t``)."""
        views = a.t() if self.a_t else a, b.t() if self.b_t else b
        if self.kept is None:
            self.kept = [TensorDescriptor.from_tensor(view, block) for view, block in zip(views, self.blocks)]
            for kept in self.kept:
                kept.base = None
        copies = []
        for kept, view in zip(self.kept, views):  # every field, whichever Triton defines, over the view
            copy = object.__new__(type(kept))
            copy.__dict__.update(kept.__dict__)
            copy.base = view
            copies.append(copy)
        return copies


def gemm_candidates(dtype: torch.dtype, m: int, n: int, tma: bool = False) -> tuple:
    """The tiles for an (m x n) output with operands of ``dtype``, default first: where ``tma`` (on
    sm_90+) the TMA kernel's tiles, then the pointer kernel's default, else (or where none of them
    fits) the dtype's table, without tiles much larger than the problem (at most max(64, m) rows and
    max(64, n) columns; the table's smallest tile where none is left). Where TMA reads the operands
    its tiles won each of the four 16-bit GEMMs timed on an H200, by 5 to 29% over the best pointer
    tile, 128 x 256 x 64 (8 warps, 3 stages) two of them (benchmarks/results/h200-2026-11-26.md)."""
    tiles = GEMM_TILES_FP32 if dtype == torch.float32 else GEMM_TILES_16BIT

    def fitting(tiles: tuple) -> tuple:
        return tuple(t for t in tiles if t.block_m <= max(64, m) and t.block_n <= max(64, n))

    return (tma and fitting(GEMM_TILES_TMA + tiles[:1])) or fitting(tiles) or tiles[-1:]


def tma_transposed(t: torch.Tensor) -> Optional[bool]:
    """How the TMA kernel reads a 2-D 16-bit operand: False by a descriptor over ``t`` (unit column
    stride), True by one over ``t.t()`` (unit row stride), None where a descriptor cannot (no unit
    stride, the other stride 0 or not 16-byte aligned, the data not 16-byte aligned, a dimension of
    size 0)."""
    return None if t.data_ptr() % 16 else _tma_strides(t)


def _tma_strides(t: torch.Tensor) -> Optional[bool]:
    """``tma_transposed`` but for the data's alignment, which a launch plan checks per call (its key
    fixes the rest: dtype, sizes and strides)."""
    if t.dtype not in (torch.float16, torch.bfloat16) or t.numel() == 0:
        return None
    rows, cols = t.stride()
    aligned = 16 // t.element_size()
    if cols == 1 and rows > 0 and rows % aligned == 0:  # a stride of 0 (an expanded operand): no TMA
        return False
    if rows == 1 and cols > 0 and cols % aligned == 0:
        return True
    return None


def tma_layout(a: torch.Tensor, b: torch.Tensor, aligned: bool = True) -> Optional[tuple[bool, bool]]:
    """How the TMA kernel reads a @ b, (``tma_transposed(a)``, ``tma_transposed(b)``), or None where
    it cannot: before Hopper (the interpreter counts as Hopper), an operand no descriptor can read,
    or while tracing (torch.compile). Where it cannot, a TMA tile runs the pointer kernel with its
    dimensions. ``aligned=False``: the data's alignment is not asked (a plan asks it per call)."""
    if TensorDescriptor is None or tracing():
        return None
    layout = tma_transposed if aligned else _tma_strides
    a_t, b_t = layout(a), layout(b)
    if a_t is None or b_t is None:
        return None
    # the tests run it under the interpreter where they pin its tiles
    hopper = interpreted(a.device) or capability(a.device) >= 90
    return (a_t, b_t) if hopper else None


def tile_report() -> list[dict]:
    """Every GEMM tile choice made in this process: key (device, operand and output dtypes, HAS_BIAS,
    EPILOGUE, GELU_FORM, SAVE_PREACT, HAS_RESIDUAL, M bucket, N, K bucket, K slices, unit strides of A's
    and B's two dimensions), the tile chosen and each candidate's time in ms or why it was excluded."""
    return report_rows("gemm", GEMM_CHOOSER)


def split_k_slices(m: int, n: int, k: int, device: torch.device) -> int:
    """How many K slices a GEMM without epilogue is split into so that it fills the GPU: the
    weight-gradient GEMMs (M, N = layer widths, K = batch x tokens) have few output tiles and a
    very deep K. Slices are at least 1024 deep on a GPU (64 under the interpreter, which is how the
    tests exercise the split path on small shapes)."""
    if interpreted(device):
        machine, min_depth, tile = 4, 64, GEMM_INTERPRETER_TILE.block_m
    else:
        machine = multiprocessors(device)
        min_depth, tile = 1024, 128
    tiles = cdiv(m, tile) * cdiv(n, tile)
    slices = min(cdiv(2 * machine, tiles), k // min_depth, 32)
    return max(1, slices)


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, **epilogue) -> torch.Tensor:
    """C of ``_matmul_and_sums`` (no sums)."""
    return _matmul_and_sums(a, b, out_dtype, **epilogue)[0]


def _matmul_and_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Optional[torch.Tensor] = None,
    epilogue: int = EPILOGUE_NONE,
    gelu_form: int = 0,
    aux: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    sums: int = SUMS_NONE,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """a (M, K) @ b (K, N) (+ bias, epilogue, residual) -> (C (M, N) contiguous, all read by strides;
    the sums in float32, or None for SUMS_NONE): SUMS_OF_C_COLUMNS, sum_rows C (N,) before C's
    rounding; SUMS_OF_A_ROWS, sum_k A (M,).
    ``aux`` (M, N), contiguous: written with the pre-activation under EPILOGUE_GELU, read under
    EPILOGUE_GELU_GRAD. Without bias, epilogue, residual or sums of C, a deep K is split into
    slices summed in float32. The tile is the one ``_matmul_tile`` gives (chosen on the GPU per key);
    a call seen before takes its split, tile and launch configuration from ``_PLANS``."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:  # nothing to compute (an empty K still runs: its result is the epilogue of 0)
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        if sums == SUMS_NONE:
            return c, None
        if sums == SUMS_OF_A_ROWS:  # A's rows still have their sums where B has no columns
            return c, a.sum(1, dtype=torch.float32)
        return c, torch.zeros(n, dtype=torch.float32, device=a.device)
    plan_key = (
        m,
        k,
        n,
        a.stride(),
        b.stride(),
        a.device,
        a.dtype,
        b.dtype,  # with the strides, whether descriptors can read the operands (the plan's ``tma``)
        out_dtype,
        None if bias is None else bias.stride(0),
        epilogue,
        gelu_form,
        None if aux is None else aux.stride(0),
        None if residual is None else residual.stride(),
        sums,
    )
    plan = decided(_PLANS, plan_key)
    if plan is None:
        plain = bias is None and epilogue == EPILOGUE_NONE and residual is None and sums != SUMS_OF_C_COLUMNS
        slices = split_k_slices(m, n, k, a.device) if plain else 1
        k_per_split = cdiv(cdiv(k, slices), MAX_BLOCK_K) * MAX_BLOCK_K
        slices = cdiv(k, k_per_split) if k > 0 else 1
        gemm = _Gemm(a, b, out_dtype, bias, epilogue, gelu_form, aux, residual, sums, slices, k_per_split)
        plan = keep(_PLANS, plan_key, gemm.plan(_matmul_tile(gemm)))
    c, partial = _launch(plan, a, b, out_dtype, bias, aux, residual)
    return c.sum(0).to(out_dtype) if plan.slices > 1 else c, None if partial is None else partial.sum(0)


def _launch(
    plan: GemmPlan,
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    aux: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch ``plan`` on its operands into fresh outputs -> (C: (M, N) in ``out_dtype``, or the
    float32 workspace (slices, M, N) of a split K; the float32 partial sums asked for: per tile row
    (cdiv(M, BLOCK_M), N) of C's columns, per K slice (slices, M) of A's rows, else None). ``aux``
    (M, N) is written with the pre-activation under EPILOGUE_GELU. A tile naming the TMA variant
    runs ``_linear_tma_kernel`` where the plan has its ``TmaLaunch`` and A's and B's data are
    16-byte aligned (and not while tracing), else ``_linear_kernel``."""
    device = plan.device
    c = torch.empty(plan.c_shape, dtype=torch.float32 if plan.slices > 1 else out_dtype, device=device)
    partial = None
    if plan.partial_shape is not None:
        partial = torch.empty(plan.partial_shape, dtype=torch.float32, device=device)
    outputs = (
        c,
        c if bias is None else bias,
        c if aux is None else aux,
        c if residual is None else residual,
        c if partial is None else partial,
    )
    tma = plan.tma
    if tma is not None and not (tracing() or a.data_ptr() % 16 or b.data_ptr() % 16):
        descriptors = tma.descriptors(a, b)
        launch(_linear_tma_kernel, tma.grid, *descriptors, *outputs, *tma.args, eager=True, **tma.config)
    else:
        launch(_linear_kernel, plan.grid, a, b, *outputs, *plan.args, **plan.config)
    return c, partial


# The launch (``GemmPlan``) of each GEMM call seen, by everything it is computed from (sizes, strides,
# device, dtypes, flags), for ``_tiles.decided``: a decided call skips computing it.
_PLANS: dict[tuple, tuple] = {}


class _Gemm:
    """One GEMM call being planned: its operands and split, for the tile choice (``key``, ``trial``)
    and the launch plan of a tile (``plan``); a decided call builds none."""

    __slots__ = (
        "a",
        "b",
        "out_dtype",
        "bias",
        "epilogue",
        "gelu_form",
        "aux",
        "residual",
        "sums",
        "slices",
        "k_per_split",
    )

    def __init__(self, a, b, out_dtype, bias, epilogue, gelu_form, aux, residual, sums, slices, k_per_split):
        self.a, self.b, self.out_dtype, self.bias, self.epilogue = a, b, out_dtype, bias, epilogue
        self.gelu_form = gelu_form
        self.aux, self.residual, self.sums = aux, residual, int(sums)
        self.slices, self.k_per_split = slices, k_per_split

    def plan(self, tile: GemmTile) -> GemmPlan:
        """The launch of this call with ``tile``."""
        a, b, bias, aux, residual = self.a, self.b, self.bias, self.aux, self.residual
        (m, k), n = a.shape, b.shape[1]
        tile_rows = cdiv(m, tile.block_m)
        partial_shape = {SUMS_NONE: None, SUMS_OF_C_COLUMNS: (tile_rows, n), SUMS_OF_A_ROWS: (self.slices, m)}
        flags = dict(
            HAS_BIAS=bias is not None,
            EPILOGUE=self.epilogue,
            GELU_FORM=self.gelu_form,
            SAVE_PREACT=aux is not None,
            HAS_RESIDUAL=residual is not None,
            SUMS=self.sums,
            PRECISION=dot_precision(a.dtype),
        )
        tiles = tile_rows * cdiv(n, tile.block_n)
        sizes = (m, n, k, self.k_per_split)
        strides = (  # of C's split and rows, the bias, the pre-activation and the residual
            m * n if self.slices > 1 else 0,
            n,
            0 if bias is None else bias.stride(0),
            0 if aux is None else aux.stride(0),
            *((0, 0) if residual is None else residual.stride()),
        )
        config = {**flags, **gemm_config(tile)}
        layout = tma_layout(a, b, aligned=False) if tile.kernel == TMA else None
        tma = None
        if layout is not None:
            grid = (min(tiles * self.slices, multiprocessors(a.device)),)
            config_tma = dict(config, A_T=layout[0], B_T=layout[1])
            tma = TmaLaunch(*layout, grid, (*sizes, self.slices, *strides), config_tma, tile)
        return GemmPlan(
            tile,
            self.slices,
            (self.slices, m, n) if self.slices > 1 else (m, n),
            partial_shape[self.sums],
            (tiles, self.slices),
            (*sizes, *a.stride(), *b.stride(), *strides),
            config,
            a.device,
            tma,
        )

    def key(self) -> tuple:
        """What a tile choice is kept for: device, operand and output dtypes, the epilogue flags, M
        and K bucketed to powers of two (the batch lives there: rows of the forward and of dX, the
        reduction of dW), N exact (a layer width), the K slices, and which of A's and B's dimensions
        have unit stride (W^T and dY^T are read transposed). Plain ints (SymInts made concrete)."""
        a, b = self.a, self.b
        (m, k), (_, n), (a_m, a_k), (b_k, b_n) = a.shape, b.shape, a.stride(), b.stride()
        return (
            a.device,
            a.dtype,
            self.out_dtype,
            self.bias is not None,
            self.epilogue,
            self.gelu_form,
            self.aux is not None,
            self.residual is not None,
            self.sums,
            bucket(int(m)),
            int(n),
            bucket(int(k)),
            self.slices,
            bool(a_m == 1),
            bool(a_k == 1),
            bool(b_k == 1),
            bool(b_n == 1),
        )


def _matmul_tile(gemm: _Gemm) -> tuple:
    """The tile ``_matmul`` launches: see ``vit_kernels._tiles.tile_to_launch``."""
    return tile_to_launch(
        GEMM_CHOOSER,
        gemm.a.device,
        gemm.key,
        lambda: GEMM_INTERPRETER_TILE,
        lambda: gemm_candidates(
            gemm.a.dtype, int(gemm.a.shape[0]), int(gemm.b.shape[1]), tma_layout(gemm.a, gemm.b) is not None
        ),
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K) by a view where strides allow (the kernel takes any 2-D strides); M or K
    may be 0."""
    *rows, k = t.shape
    return t.reshape(math.prod(rows), k)


GELU_BWD_BLOCK = (32, 128, 4)  # (rows per step, columns per program, warps): 16 elements per thread


@functools.lru_cache(maxsize=LAUNCH_CONFIGS)
def row_slices(rows: int, cols: int, block_m: int, block_n: int, machine: int) -> tuple[int, int, int]:
    """(column strips, row slices, rows per slice) of an elementwise pass over (rows, cols) that also
    sums its columns per slice (float32 partials): about four programs per multiprocessor of
    ``machine`` in all, each slice a whole number of ``block_m``-row steps."""
    strips = cdiv(cols, block_n)
    slices = max(1, min(cdiv(4 * machine, strips), cdiv(rows, block_m), 65535))
    rows_per_slice = cdiv(cdiv(rows, slices), block_m) * block_m
    return strips, cdiv(rows, rows_per_slice), rows_per_slice


def column_sums_pass(
    kernel, block: tuple, inputs: tuple, outputs: tuple, bias_grad: bool, **constants
) -> list:
    """Launch the elementwise ``kernel`` over ``row_slices`` of the (rows, cols) ``outputs``, read from
    ``inputs``; -> each output's column sums (N,) float32 when ``bias_grad``, else Nones. (Loops, not
    comprehensions: a comprehension is one more Python frame on every backward before Python 3.12.)"""
    first = outputs[0]
    rows, cols = first.shape
    device = first.device
    sums, partials = [], []
    if first.numel() == 0:
        for _ in outputs:
            sums.append(torch.zeros(cols, dtype=torch.float32, device=device) if bias_grad else None)
        return sums
    block_m, block_n, warps = (16, 16, 1) if interpreted(device) else block
    strips, slices, rows_per_slice = cached_call(
        row_slices, rows, cols, block_m, block_n, multiprocessors(device)
    )
    for _ in outputs:
        partials.append(
            torch.empty((slices, cols), dtype=torch.float32, device=device) if bias_grad else first
        )
    constants.update(BIAS_GRAD=bias_grad, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    launch(kernel, (strips, slices), *inputs, *outputs, *partials, rows, cols, rows_per_slice, **constants)
    for partial in partials:
        sums.append(partial.sum(0) if bias_grad else None)
    return sums


def _gelu_backward(grad: torch.Tensor, preact: torch.Tensor, gelu_form: int, bias_grad: bool):
    """dZ = grad * gelu'(preact) (M, N) and, when ``bias_grad``, its column sums (N,) in float32
    (else None), from one pass over ``row_slices``."""
    preact = preact.contiguous()
    dz = torch.empty_like(preact)
    (db,) = column_sums_pass(
        _gelu_bwd_kernel, GELU_BWD_BLOCK, (grad.contiguous(), preact), (dz,), bias_grad, GELU_FORM=gelu_form
    )
    return dz, db


# The bias gradient db = sum_rows dY beside dW = dY^T X: "separate" (the dW GEMM, then PyTorch's sum
# of dY, one more read of dY) or "fused" (the dW GEMM reduces the rows of the dY^T it reads,
# SUMS_OF_A_ROWS). The table's default is "separate" (a search times both per key), by occupancy in the compile report: the row sums raise the default 16-bit tile
# (128 x 128 x 64, 8 warps) from 114 to 152 registers per thread on sm_90, 2 -> 1 CTA per SM, and
# the compiler hoists the A-tile read out of the first tile column's branch, so every program pays
# it; the extra read it saves is 2 bytes per element of dY, against the dW GEMM's K-fold reuse of
# the same bytes.
BIAS_GRAD_WAYS = ("separate", "fused")
BIAS_GRAD_CHOOSER = TileChooser("bias gradient")
_BIAS_GRAD_PLANS: dict[tuple, tuple] = {}  # per call signature, for _tiles.decided: the way


def _weight_and_bias_grads_by(way: str, dy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype):
    """(dW = dY^T X in ``dtype``, db = sum_rows dY in float32) the ``way`` named."""
    if way == "fused":
        return _matmul_and_sums(dy2.t(), x2, dtype, sums=SUMS_OF_A_ROWS)
    return _matmul(dy2.t(), x2, dtype), dy2.sum(0, dtype=torch.float32)


def _input_and_weight_grads(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias_grad: bool):
    """For Y = X W^T + b: dX = dY W, dW = dY^T X and, when ``bias_grad``, db = sum_rows dY (float32;
    else None), db by the way BIAS_GRAD_CHOOSER keeps for the key."""
    return _matmul(dy2, weight, x2.dtype), *_weight_and_bias_grads(dy2, x2, weight.dtype, bias_grad)


def _weight_and_bias_grads(dy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype, bias_grad: bool):
    """dW = dY^T X (N, K) in ``dtype`` and, when ``bias_grad``, db = sum_rows dY (N,) float32, else None."""
    if not bias_grad:
        return _matmul(dy2.t(), x2, dtype), None
    plan_key = (dy2.shape, x2.shape[1], dy2.dtype, dtype, dy2.device)
    way = decided(_BIAS_GRAD_PLANS, plan_key)
    if way is None:
        m, n = dy2.shape

        def key():
            return dy2.device, dy2.dtype, bucket(int(m)), int(n), int(x2.shape[1])

        way = tile_to_launch(
            BIAS_GRAD_CHOOSER,
            dy2.device,
            key,
            lambda: BIAS_GRAD_WAYS[0],
            lambda: BIAS_GRAD_WAYS,
        )
        keep(_BIAS_GRAD_PLANS, plan_key, way)
    return _weight_and_bias_grads_by(way, dy2, x2, dtype)
