"""Every entry of every tile table, run on the GPU (``gpu`` cases, CUDA only).

`make check-gpu` compiles each entry for sm_80 and sm_90, but compiling is not correctness: on an
H100 a dK/dV tile that compiled cleanly computed a wrong dK. Here each entry runs on the device,
forced one at a time, and the output and every gradient must stay within twice PyTorch's own error
in the same dtype against float64 (``tests.helpers.check_against_formula``). The cases are built
from the tables' values at import, so they follow the tables when entries change, and the ids name
the tile:

* attention: each forward tile of ``ATTENTION_FWD_TILES`` and each (dQ, dK/dV) pair of
  ``ATTENTION_BWD_TILES`` (the launchers' tile choice pinned to it) at L = 197, for each head dim
  among 16, 64, 80, 96, 128 and 256 that its (precision, padded head dim) key serves, in float32 or
  in float16 and bfloat16; dq, dk and dv are compared each on its own.
* GEMMs: each tile of ``GEMM_TILES_16BIT`` (float16, bfloat16) and ``GEMM_TILES_FP32`` (float32),
  pinned in the GEMM launcher, ops.gemm (linear, linear_gelu, mlp: forward and every backward GEMM, every
  epilogue, split-K included) and in patch_embed's forward; and the choice itself on CUDA: every
  candidate validated and timed, the fastest right one kept.
* layer_norm: each forward tile of ``fwd_candidates`` and each backward tile of ``bwd_candidates``
  (the launchers' choice pinned to it) at ViT's widths, 4096 and the widest the kernel takes.
"""

from __future__ import annotations

import math

import pytest
import torch

import vit_kernels as vk
from tests.helpers import (
    CUDA,
    DTYPE_NAMES,
    check_against_formula,
    cuda_param,
    device_reason,
    tiles_searched_first,
)
from tests.test_attention import check_attention_against_formula
from tests.test_layer_norm import check_layer_norm_against_formula
from tests.test_linear import check_mlp_against_formula, linear_formula, linear_gelu_formula
from tests.test_patch_embed import NAMES as PATCH_EMBED_NAMES
from tests.test_patch_embed import make_inputs, patch_embed_formula, run_patch_embed
from vit_kernels import _tiles
from vit_kernels._triton import HAS_TRITON, triton
from vit_kernels.ops import attention, attention_tiles, gemm, layer_norm, patch_embed

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

SKIP = device_reason("triton", CUDA)
HEAD_DIMS = (16, 64, 80, 96, 128, 256)
LENGTH = 197


def pin(monkeypatch, module, name: str, tile) -> list:
    """Replace the tile choice ``module.<name>`` for this test by one that always gives ``tile``.
    Returns the list of the tiles it gave, one per launch."""
    launched: list = []

    def choose(*args):
        launched.append(tile)
        return tile

    monkeypatch.setattr(module, name, choose)
    return launched


def tile_id(tile: tuple) -> str:
    """(blocks..., warps, stages) as text, and a GEMM tile's kernel where it is not the pointer one."""
    kernel = getattr(tile, "kernel", "pointer")
    *blocks, warps, stages = tile[:5] if hasattr(tile, "kernel") else tile
    return "x".join(map(str, blocks)) + f"-w{warps}s{stages}" + ("" if kernel == "pointer" else f"-{kernel}")


# ---- attention ----------------------------------------------------------------------------------


def attention_cases() -> list:
    """Per (precision, padded head dim) key, dtype and head dim it serves: each forward tile (with the
    default backward pair), then each further backward pair (with the default forward tile)."""
    cases = []
    for key, fwd_tiles in attention_tiles.ATTENTION_FWD_TILES.items():
        fp32, _ = key
        pairs = attention_tiles.ATTENTION_BWD_TILES[key]
        runs = [(tile, pairs[0]) for tile in fwd_tiles] + [(fwd_tiles[0], pair) for pair in pairs[1:]]
        for dtype in (torch.float32,) if fp32 else (torch.float16, torch.bfloat16):
            for head_dim in [d for d in HEAD_DIMS if attention_tiles.tile_key(dtype, d) == key]:
                for fwd, (dq, dkdv) in runs:
                    name = f"{DTYPE_NAMES[dtype]}-hd{head_dim}-fwd{tile_id(fwd)}-dq{tile_id(dq)}-dkdv{tile_id(dkdv)}"
                    cases.append(cuda_param(dtype, head_dim, fwd, (dq, dkdv), id=name, skip_reason=SKIP))
    return cases


@pytest.mark.parametrize("dtype,head_dim,fwd,pair", attention_cases())
def test_attention_tile(monkeypatch, dtype, head_dim, fwd, pair):
    """The launchers pinned to one forward tile and one backward pair (fitted to L as they would be)."""
    launched = []

    def pinned(tiles):
        def choose(*args):
            launched.append(tiles)
            return tiles

        return choose

    fitted = attention_tiles.fitted(fwd, LENGTH), tuple(attention_tiles.fitted(t, LENGTH) for t in pair)
    monkeypatch.setattr(attention, "fwd_tile", pinned(fitted[0]))
    monkeypatch.setattr(attention, "bwd_tiles", pinned(fitted[1]))
    heads = 2
    qkv = torch.randn(2, LENGTH, 3 * heads * head_dim)
    with vk.use_backend("triton", strict=True):
        # the comparison by its name here: tests/cuda_sim/test_tile_tests.py replaces it
        check_attention_against_formula(qkv, dtype, CUDA, heads, check=check_against_formula)
    assert set(launched) == set(fitted), "the launchers did not run the pinned tiles"


# ---- GEMMs: linear, linear_gelu, mlp, patch_embed's forward --------------------------------------


def gemm_cases(op: str) -> list:
    return [
        cuda_param(dtype, tile, id=f"{op}-{DTYPE_NAMES[dtype]}-{tile_id(tile)}", skip_reason=SKIP)
        for dtypes, tiles in (
            (
                (torch.float16, torch.bfloat16),
                gemm.GEMM_TILES_16BIT + (gemm.GEMM_TILES_TMA if op != "patch_embed" else ()),
            ),
            ((torch.float32,), gemm.GEMM_TILES_FP32),
        )
        for dtype in dtypes
        for tile in tiles
    ]


# 12 x 197 rows: the weight gradients' K (= rows) is deep enough for split-K on a GPU; widths that
# no tile divides, so every tile has masked edges, whose 16-bit rows are 16-byte aligned (400 and
# 608 bytes), so that TMA descriptors read every operand of the TMA kernel's tiles.
ROWS, K, N = (12, LENGTH), 200, 304


def linear_inputs(n_out: int = N) -> list:
    return [torch.randn(*ROWS, K), torch.randn(n_out, K) / math.sqrt(K), torch.randn(n_out)]


@pytest.mark.parametrize("dtype,tile", gemm_cases("linear"))
def test_linear_tile(monkeypatch, dtype, tile):
    launched = pin(monkeypatch, gemm, "_matmul_tile", tile)
    assert gemm.split_k_slices(N, K, math.prod(ROWS), CUDA) > 1, (
        "the weight gradient must take the split-K path"
    )
    inputs = linear_inputs() + [torch.randn(*ROWS, N)]
    with vk.use_backend("triton", strict=True):
        check_against_formula(
            lambda x, w, b, r: vk.linear(x, w, b, residual=r),
            linear_formula,
            inputs,
            dtype,
            ["x", "weight", "bias", "residual"],
            CUDA,
        )
    assert launched, "the GEMMs did not run the pinned tile"


@pytest.mark.parametrize("dtype,tile", gemm_cases("linear_gelu"))
def test_linear_gelu_tile(monkeypatch, dtype, tile):
    launched = pin(monkeypatch, gemm, "_matmul_tile", tile)
    with vk.use_backend("triton", strict=True):
        check_against_formula(
            lambda x, w, b: vk.linear_gelu(x, w, b, approximate="tanh"),
            lambda x, w, b: linear_gelu_formula(x, w, b, "tanh"),
            linear_inputs(),
            dtype,
            ["x", "weight", "bias"],
            CUDA,
        )
    assert launched, "the GEMMs did not run the pinned tile"


@pytest.mark.parametrize("dtype,tile", gemm_cases("mlp"))
def test_mlp_tile(monkeypatch, dtype, tile):
    """Every epilogue: bias + exact GELU saving the pre-activation, bias + residual, GELU' (dZ) and
    the split-K weight gradients."""
    launched = pin(monkeypatch, gemm, "_matmul_tile", tile)
    x, w1, b1 = linear_inputs()
    inputs = [x, w1, b1, torch.randn(K, N) / math.sqrt(N), torch.randn(K), torch.randn(*ROWS, K)]
    with vk.use_backend("triton", strict=True):
        # the comparison by its name here: tests/cuda_sim/test_tile_tests.py replaces it
        check_mlp_against_formula(inputs, dtype, CUDA, check=check_against_formula)
    assert launched, "the GEMMs did not run the pinned tile"


@pytest.mark.parametrize("dtype,tile", gemm_cases("patch_embed"))
def test_patch_embed_tile(monkeypatch, dtype, tile):
    """The forward's tile pinned; the backward's fixed tiles run in every case."""
    launched = pin(monkeypatch, patch_embed, "fwd_tile", tile)
    inputs = make_inputs(6, 3, 96, 96, 16, N)
    with vk.use_backend("triton", strict=True):
        check_against_formula(
            run_patch_embed, patch_embed_formula, inputs, dtype, PATCH_EMBED_NAMES, CUDA, patch_size=16
        )
    assert launched, "the forward did not run the pinned tile"


@pytest.mark.parametrize("searched", [False, True], ids=["default", "searched"])
@pytest.mark.parametrize(
    "dtype",
    [
        cuda_param(torch.bfloat16, id="bf16", skip_reason=SKIP),
        cuda_param(torch.float32, id="fp32", skip_reason=SKIP),
    ],
)
def test_gemm_tile_choice_on_the_gpu(dtype, searched, monkeypatch):
    """The choice of the fused bias + GELU GEMM of a ViT-B fc1 at batch 24, the output right either
    way. By default, as a user's first call makes it: the table's first entry, nothing else run and
    nothing kept. Searched (``vk.tune``'s tile search): every candidate validated and timed, the
    fastest right one kept."""
    _tiles.forget()
    try:
        x = torch.randn(24, LENGTH, 768, device=CUDA, dtype=dtype)
        w = (torch.randn(3072, 768, device=CUDA) / math.sqrt(768)).to(dtype)
        b = torch.randn(3072, device=CUDA, dtype=dtype)
        if searched:
            tiles_searched_first(monkeypatch, "linear_gelu")
        with vk.use_backend("triton", strict=True):
            y = vk.linear_gelu(x, w, b)
        rows = gemm.tile_report()
        candidates = gemm.gemm_candidates(
            dtype, 24 * LENGTH, 3072, gemm.tma_layout(x.reshape(-1, 768), w.t()) is not None
        )
        if searched:
            (row,) = rows
            assert set(row["candidates"]) == {repr(tile) for tile in candidates}
            times = {tile: trial for tile, trial in row["candidates"].items() if isinstance(trial, float)}
            assert times, row
            assert row["chosen"] == min(times, key=times.get)
        else:
            assert rows == []
        exact = linear_gelu_formula(x.double(), w.double(), b.double(), "none")
        own = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
        error = (y.double() - exact).abs().max() / exact.abs().max()
        assert error <= max(2 * ((own.double() - exact).abs().max() / exact.abs().max()), 1e-5)
    finally:
        _tiles.forget()


# ---- layer_norm ---------------------------------------------------------------------------------


def layer_norm_cases() -> list:
    """Per padded width (ViT's 192, 384, 768, 1024, then 4096 and the widest the kernel takes), each
    forward tile (with the default backward tile), then each further backward tile (with the
    default forward tile)."""
    cases = []
    for dim in (192, 384, 768, 1024, 4096, layer_norm.MAX_TRITON_COLS):
        block_d = triton.next_power_of_2(dim)
        fwd, bwd = layer_norm.fwd_candidates(block_d), layer_norm.bwd_candidates(block_d)
        pairs = [(tile, bwd[0]) for tile in fwd] + [(fwd[0], tile) for tile in bwd[1:]]
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for fwd_tile, bwd_tile in pairs:
                name = f"{DTYPE_NAMES[dtype]}-D{dim}-fwd{'x'.join(map(str, fwd_tile))}-bwd{'x'.join(map(str, bwd_tile))}"
                cases.append(cuda_param(dtype, dim, fwd_tile, bwd_tile, id=name, skip_reason=SKIP))
    return cases


@pytest.mark.parametrize("dtype,dim,fwd_tile,bwd_tile", layer_norm_cases())
def test_layer_norm_tile(monkeypatch, dtype, dim, fwd_tile, bwd_tile):
    """The launchers pinned to one forward and one backward tile."""
    launched = []

    def pinned(chooser, *args):
        tile = fwd_tile if chooser is layer_norm.FWD_CHOOSER else bwd_tile
        launched.append(tile)
        return tile

    monkeypatch.setattr(layer_norm, "_tile", pinned)
    rows = max(3, 2**16 // dim)  # several programs, and rows left over in the last one
    inputs = [torch.randn(rows, dim) * 3 + 1, torch.randn(dim), torch.randn(dim), torch.randn(rows, dim)]
    with vk.use_backend("triton", strict=True):
        # the comparison by its name here: tests/cuda_sim/test_tile_tests.py replaces it
        check_layer_norm_against_formula(inputs, dtype, CUDA, eps=1e-5, check=check_against_formula)
    assert set(launched) == {fwd_tile, bwd_tile}, "the launchers did not run the pinned tiles"
