"""The GEMM tile choice (linear's ``_matmul`` and patch_embed's forward), its parts on the CPU: the
launchers take the GPU's path (vk.tune's search: candidates validated through the whole op, then
timed by a fake timer) while Triton's interpreter runs the candidate tiles, so the results are real.
A wrong candidate is excluded with its reason, the fastest right one is kept and a decided key only
looks it up; every epilogue and gradient gives the formula's answer through that path; the compile
gate records every candidate; nothing runs where nothing may; keys are concrete under dynamic
shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vit_kernels as vk
from tests.helpers import CPU_BACKENDS, check_against_formula, fake_timer, tiles_searched_first
from tests.test_linear import check_mlp_against_formula, mlp_inputs
from tests.test_patch_embed import NAMES as PATCH_EMBED_NAMES
from tests.test_patch_embed import make_inputs, patch_embed_formula, run_patch_embed
from tools.cuda_sim import every_candidate, simulated_cuda
from vit_kernels import _tiles, tuning
from vit_kernels.activations import GELU
from vit_kernels.ops import gemm, linear, patch_embed

if "triton" not in CPU_BACKENDS:
    pytest.skip("the Triton backend needs TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

FP32_FAST_TO_SLOW = tuple(
    gemm.GemmTile(*tile) for tile in ((32, 64, 32, 4, 3), (64, 32, 32, 4, 3), (64, 64, 32, 4, 3))
)


@pytest.fixture
def gpu_path(monkeypatch):
    """The tile launchers treat CPU tensors as they treat CUDA ones (the interpreter still runs the
    kernels), and each op's first Triton call searches its tiles as vk.tune does; ``times[tile]`` is
    what timing a candidate returns. The choices start and end empty."""
    times: dict = {}
    monkeypatch.setattr(_tiles, "interpreted", lambda device: False)
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda tile: times[tile]))
    tiles_searched_first(monkeypatch, "linear_gelu", "linear", "mlp", "patch_embed")
    _tiles.forget()
    yield times
    _tiles.forget()


def spy_launches(monkeypatch, wrong=None) -> list:
    """Record the tile of every GEMM launch; the ``wrong`` tile's output is scaled by 1.02 (a 2% error,
    as wrong as the H100's wrong attention tile)."""
    launched = []
    original = gemm._launch

    def launch(plan, *args):
        launched.append(plan.tile)
        c, partial = original(plan, *args)
        if plan.tile == wrong:
            c.mul_(1.02)
        return c, partial

    monkeypatch.setattr(gemm, "_launch", launch)
    return launched


def test_the_fastest_right_gemm_tile_is_chosen_kept_and_only_looked_up(gpu_path, monkeypatch):
    fast, middle, slow = FP32_FAST_TO_SLOW
    wrong = slow
    gpu_path.update({fast: 0.2, middle: 0.3, slow: 0.1})
    launched = spy_launches(monkeypatch, wrong=wrong)
    x, w, b = torch.randn(3, 17, 40), torch.randn(72, 40) / 6, torch.randn(72)
    with vk.use_backend("triton", strict=True):
        y = vk.linear_gelu(x, w, b)
    torch.testing.assert_close(y, F.gelu(F.linear(x, w, b)), atol=1e-5, rtol=1e-5)
    (row,) = gemm.tile_report()
    # no gradient asked for: the inference GEMM, which does not write the pre-activation (SAVE_PREACT off)
    assert row["key"] == [
        "cpu",
        "torch.float32",
        "torch.float32",
        True,
        gemm.EPILOGUE_GELU,
        False,
        False,
        False,
        False,
        64,
        72,
        64,
        1,
        False,
        True,
        True,
        False,
    ]
    assert row["chosen"] == repr(fast)
    assert row["candidates"][repr(fast)] == 0.2 and row["candidates"][repr(middle)] == 0.3
    assert row["candidates"][repr(wrong)].startswith("invalid: result 0: relative error")
    assert launched[-1] == fast  # the call itself runs the chosen tile, after every candidate's trial

    def no_candidates(*args):
        raise AssertionError("listed the candidates of a decided key")

    monkeypatch.setattr(gemm, "gemm_candidates", no_candidates)
    launched.clear()
    with vk.use_backend("triton", strict=True):
        again = vk.linear_gelu(torch.randn(3, 19, 40), w, b)  # 57 rows: the same bucket
    assert launched == [fast] and again.shape == (3, 19, 72)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_every_epilogue_and_gradient_through_the_choice(gpu_path, monkeypatch, dtype, approximate):
    """mlp forward and backward with bias and residual: the GEMMs with bias + GELU saving the
    pre-activation, bias + residual, GELU' (dZ), plain dX and split-K dW, each chosen (all
    candidates right) and right against float64. In float16 the TMA kernel's tiles are timed
    fastest: the GEMM whose operands descriptors can read (fc1's forward, rows of 24 halves = 48
    bytes) runs it; those reading a 130-wide operand (260-byte rows: the hidden activation, dZ, W2)
    cannot and keep the pointer kernel."""
    tiles = gemm.GEMM_TILES_FP32 if dtype == torch.float32 else gemm.GEMM_TILES_16BIT
    gpu_path.update({tile: 1.0 + i for i, tile in enumerate(tiles)})
    gpu_path.update({tile: 0.5 + i / 10 for i, tile in enumerate(gemm.GEMM_TILES_TMA)})
    gpu_path.update(
        {"separate": 2.0, "fused": 1.0}
    )  # fc2's bias gradient: the dW GEMM's row sums time faster
    _tiles.forget()
    spy_launches(monkeypatch)
    with vk.use_backend("triton", strict=True):
        check_mlp_against_formula(mlp_inputs((4, 33), 24, 130), dtype, approximate=approximate)
    rows = gemm.tile_report()
    # (bias, epilogue, tanh, aux, residual, sums, K slices) of each GEMM key
    kinds = {(*r["key"][3:9], r["key"][12] > 1) for r in rows}
    tanh = approximate == "tanh"
    none, c_columns, a_rows = gemm.SUMS_NONE, gemm.SUMS_OF_C_COLUMNS, gemm.SUMS_OF_A_ROWS
    assert (True, gemm.EPILOGUE_GELU, tanh, True, False, none, False) in kinds  # fc1 + bias + GELU, Z saved
    assert (True, gemm.EPILOGUE_NONE, False, False, True, none, False) in kinds  # fc2 + bias + residual
    # dZ = dY W2 * gelu'(Z), with its column sums (fc1's bias gradient)
    assert (False, gemm.EPILOGUE_GELU_GRAD, tanh, True, False, c_columns, False) in kinds
    assert (False, gemm.EPILOGUE_NONE, False, False, False, none, True) in kinds  # split-K weight gradients
    # fc2's weight gradient, split over K, with the row sums of dY^T (fc2's bias gradient)
    assert (False, gemm.EPILOGUE_NONE, False, False, False, a_rows, True) in kinds
    for r in rows:
        times = {tile: t for tile, t in r["candidates"].items() if isinstance(t, float)}
        assert times == r["candidates"], r  # every candidate of every key computed the right answer
        assert r["chosen"] == min(times, key=times.get)
    (bias_choice,) = gemm.BIAS_GRAD_CHOOSER.report().values()  # both ways validated (dW and db), then timed
    assert bias_choice.tile == "fused" and bias_choice.trials == {"separate": 2.0, "fused": 1.0}
    tma_chosen = {tuple(r["key"][3:9]) for r in rows if r["chosen"].endswith(f"'{gemm.TMA}')")}
    if dtype == torch.float32:
        assert not tma_chosen
    else:  # only fc1 + bias + GELU (X W1^T) has no operand 130 wide (hidden, dZ, W2)
        assert tma_chosen == {(True, gemm.EPILOGUE_GELU, tanh, True, False, none)}


TMA_TILE = gemm.GemmTile(32, 32, 32, 1, 1, gemm.TMA)  # walked by 2 persistent programs under the interpreter


def spy_kernels(monkeypatch) -> list:
    """The name of every GEMM kernel launched."""
    names = []
    original = gemm.launch

    def launch(kernel, *args, **kwargs):
        names.append(kernel.fn.__name__)
        return original(kernel, *args, **kwargs)

    monkeypatch.setattr(gemm, "launch", launch)
    return names


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_tma_kernel_runs_every_gemm_of_an_mlp_against_float64(monkeypatch, approximate):
    """Every GEMM of an mlp with bias and residual pinned to a TMA tile, in float16: descriptors over
    X and W1 (fc1 + bias + GELU, saving Z), over the hidden activation and W2^T's W2 (fc2 + bias +
    residual), dY and W2 (dZ = dY W2 * gelu'(Z) with its column sums), dY^T's dY (dW2 with the row
    sums of dY^T, split over K), dZ^T's dZ (dW1, split), dZ and W1 (dX); widths no tile divides."""
    monkeypatch.setattr(gemm, "_matmul_tile", lambda gemm: TMA_TILE)
    kernels = spy_kernels(monkeypatch)
    d, hidden, rows = 24, 40, (4, 33)
    assert gemm.split_k_slices(hidden, d, math.prod(rows), torch.device("cpu")) > 1
    with vk.use_backend("triton", strict=True):
        check_mlp_against_formula(mlp_inputs(rows, d, hidden), torch.float16, approximate=approximate)
    gemms = [name for name in kernels if "linear" in name]
    assert gemms == ["_linear_tma_kernel"] * 6, kernels


def test_the_tma_kernel_gives_the_pointer_kernels_bits(monkeypatch):
    """The same tile dimensions through descriptors and through pointers: the same float32 sums in
    the same order, so the same bits (linear + residual forward, both gradients)."""
    x, w, b, r = (
        torch.randn(70, 48).half(),
        (torch.randn(56, 48) / 7).half(),
        torch.randn(56).half(),
        torch.randn(70, 56).half(),
    )
    results = []
    for tile in (TMA_TILE, TMA_TILE._replace(kernel="pointer")):
        monkeypatch.setattr(gemm, "_matmul_tile", lambda gemm, tile=tile: tile)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with vk.use_backend("triton", strict=True):
            y = vk.linear(*leaves, residual=r)
            y.backward(torch.ones_like(y))
        results.append([y.detach()] + [leaf.grad for leaf in leaves])
    for tma, pointer in zip(*results):
        assert torch.equal(tma, pointer)


def test_a_plans_later_tma_launches_copy_its_first_descriptors_over_their_own_operands(monkeypatch):
    """A plan's first TMA launch builds A's and B's descriptors (``TensorDescriptor.from_tensor``);
    its later launches copy them with their own tensors as the bases: other data in the same layout
    gives its own right answer, and the copies kept between calls hold no tensor."""
    monkeypatch.setattr(gemm, "_matmul_tile", lambda gemm: TMA_TILE)
    monkeypatch.setattr(gemm, "_PLANS", {})
    built = []
    from_tensor = gemm.TensorDescriptor.from_tensor
    monkeypatch.setattr(
        gemm.TensorDescriptor, "from_tensor", lambda t, block: built.append(block) or from_tensor(t, block)
    )
    for call in range(3):
        x, w = torch.randn(50, 24).half(), (torch.randn(40, 24) / 5).half()
        with vk.use_backend("triton", strict=True):
            y = vk.linear(x, w)
        torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-3, rtol=2e-3)
        assert len(built) == 2, (call, built)
    (plan,) = gemm._PLANS.values()
    assert [descriptor.base for descriptor in plan.tma.kept] == [None, None]


def test_a_tma_tile_on_operands_descriptors_cannot_read_runs_the_pointer_kernel(monkeypatch):
    """Rows of 20 halves (40 bytes: not 16-byte aligned), a float32 operand, a column-strided view,
    data starting 2 bytes into a buffer and an expanded operand (a stride of 0): the TMA tile's
    dimensions run through the pointer kernel, with the right answer."""
    assert gemm.tma_transposed(torch.empty(8, 24, dtype=torch.half)) is False
    assert gemm.tma_transposed(torch.empty(24, 8, dtype=torch.half).t()) is True
    assert gemm.tma_transposed(torch.empty(8, 20, dtype=torch.half)) is None
    assert gemm.tma_transposed(torch.empty(8, 24)) is None
    assert gemm.tma_transposed(torch.empty(8, 48, dtype=torch.half)[:, ::2]) is None
    assert gemm.tma_transposed(torch.empty(8 * 24 + 1, dtype=torch.half)[1:].view(8, 24)) is None
    assert gemm.tma_transposed(torch.empty(1, 24, dtype=torch.half).expand(8, 24)) is None  # row stride 0
    assert gemm.tma_transposed(torch.empty(8, 1, dtype=torch.half).expand(8, 24).t()) is None
    monkeypatch.setattr(gemm, "_matmul_tile", lambda gemm: TMA_TILE)
    kernels = spy_kernels(monkeypatch)
    x, w, b = torch.randn(50, 20).half(), (torch.randn(36, 20) / 5).half(), torch.randn(36).half()
    with vk.use_backend("triton", strict=True):
        y = vk.linear_gelu(x, w, b)
    torch.testing.assert_close(
        y.float(), F.gelu(F.linear(x.float(), w.float(), b.float())), atol=2e-3, rtol=2e-3
    )
    x, w = torch.randn(50, 24).half(), (torch.randn(1, 24) / 5).half().expand(36, 24)  # one row, repeated
    with vk.use_backend("triton", strict=True):
        y = vk.linear(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-3, rtol=2e-3)
    assert kernels == ["_linear_kernel"] * 2


def test_no_tma_kernel_while_tracing():
    """Under fake tensors (torch.compile's tracing) a TMA tile runs the pointer kernel: the graph
    holds plain tensor arguments, and nothing asks a fake tensor for its address."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b = torch.empty(64, 32, dtype=torch.half), torch.empty(32, 48, dtype=torch.half)
    assert gemm.tma_layout(a, b) == (False, False)
    assert gemm.tma_layout(a, b.t().contiguous().t()) == (False, True)
    with FakeTensorMode() as mode:
        assert gemm.tma_layout(mode.from_tensor(a), mode.from_tensor(b)) is None


def test_nothing_is_run_or_kept_where_nothing_may(monkeypatch):
    """Tracing, graph capture, no GPU: the decided tile, else the first candidate, unmeasured."""
    monkeypatch.setattr(_tiles, "interpreted", lambda device: False)
    launched = spy_launches(monkeypatch)
    _tiles.forget()
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    with vk.use_backend("triton", strict=True):
        y = vk.linear(x, w)
    torch.testing.assert_close(y, x @ w.t(), atol=1e-5, rtol=1e-5)
    assert launched == [gemm.gemm_candidates(torch.float32, 5, 8)[0]] and gemm.tile_report() == []


def test_a_search_on_a_gpu_launches_every_candidate():
    """On an H100 (simulated) an mlp forward and backward searching tries, for each of its GEMMs,
    every candidate tile; small outputs leave the tiles much larger than them out."""
    dt = torch.bfloat16

    def run():
        x, w1, w2 = (
            torch.empty(s, dtype=dt, device="cuda") for s in ((64, 197, 768), (3072, 768), (768, 3072))
        )
        out, hidden, preact = linear.mlp_fwd(x, w1, None, w2, None, None, GELU, True)
        linear.mlp_bwd(torch.empty_like(out), x, w1, w2, hidden, preact, GELU, False, False)

    with simulated_cuda(90) as device:
        every_candidate(run)
    per_gemm: dict = {}  # the GEMM (its operand shapes and flags) -> the tiles it launched
    for launch in device.launches:
        if launch.kernel.fn.__name__ in ("_linear_kernel", "_linear_tma_kernel"):
            operands = (launch.args[-3:], launch.kwargs["EPILOGUE"], launch.kwargs["SUMS"])
            kernel = gemm.TMA if launch.kernel.fn.__name__ == "_linear_tma_kernel" else "pointer"
            per_gemm.setdefault(repr(operands), set()).add(
                gemm.GemmTile(
                    launch.kwargs["BLOCK_M"],
                    launch.kwargs["BLOCK_N"],
                    launch.kwargs["BLOCK_K"],
                    launch.kwargs["num_warps"],
                    launch.kwargs["num_stages"],
                    kernel,
                )
            )
    # the ViT's 16-bit operands are all readable by descriptors: the TMA kernel's tiles and the
    # pointer kernel's default, each GEMM
    assert per_gemm and all(
        tiles == set(gemm.GEMM_TILES_16BIT[:1] + gemm.GEMM_TILES_TMA) for tiles in per_gemm.values()
    )
    small = gemm.gemm_candidates(dt, 50, 3072)
    assert small and all(tile.block_m <= 64 for tile in small)
    # where no TMA tile fits (each is 128 x 128 or more), the pointer kernel's fitting tiles, as without TMA
    for m, n in ((50, 3072), (25216, 10)):
        assert gemm.gemm_candidates(dt, m, n, tma=True) == gemm.gemm_candidates(dt, m, n)
    assert gemm.gemm_candidates(torch.float32, 10_000, 10_000) == gemm.GEMM_TILES_FP32


def test_gemm_keys_are_concrete_under_dynamic_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    a = mode.from_tensor(torch.empty(1576, 768, dtype=torch.bfloat16), symbolic_context=context)
    b = mode.from_tensor(torch.empty(3072, 768, dtype=torch.bfloat16), symbolic_context=context).t()
    assert isinstance(a.shape[0], torch.SymInt)
    key = gemm._Gemm(a, b, torch.bfloat16, None, gemm.EPILOGUE_NONE, False, None, None, False, 1, 768).key()
    hash(key)
    assert key[9:] == (2048, 3072, 1024, 1, False, True, True, False)
    assert all(type(part) in (bool, int, torch.dtype, torch.device) for part in key)


def test_patch_embed_forward_tile_is_chosen(gpu_path):
    fast, middle, slow = FP32_FAST_TO_SLOW
    gpu_path.update({fast: 0.1, middle: 0.2, slow: 0.3})
    inputs = make_inputs(6, 3, 32, 32, 8, 20)
    with vk.use_backend("triton", strict=True):
        check_against_formula(
            run_patch_embed, patch_embed_formula, inputs, torch.float32, PATCH_EMBED_NAMES, patch_size=8
        )
    (row,) = patch_embed.tile_report()
    assert row["kernel"] == "patch_embed forward" and row["chosen"] == repr(fast)
    assert row["candidates"] == {repr(fast): 0.1, repr(middle): 0.2, repr(slow): 0.3}


def test_the_gpu_report_lists_the_gemm_tiles(gpu_path):
    from benchmarks import gpu_report_markdown

    gpu_path.update({tile: 0.5 for tile in gemm.GEMM_TILES_FP32})
    with vk.use_backend("triton", strict=True):
        vk.linear(torch.randn(6, 16), torch.randn(8, 16), residual=torch.randn(6, 8))
    text = "\n".join(gpu_report_markdown._tiles({"gemm_tiles": gemm.tile_report()}))
    assert "## GEMM tiles chosen on this device" in text
    assert "| gemm | cpu, torch.float32, torch.float32, False, 0, 0, False, True, 0, 8, 8, 16, 1," in text


def test_gemm_plans_are_kept_per_call_and_cleared_when_full(monkeypatch):
    """A call's plan (its K split and launch) is kept by its sizes, strides, dtypes and flags, at
    most LAUNCH_CONFIGS of them (cleared when full); the results are the formula's throughout."""
    monkeypatch.setattr(_tiles, "LAUNCH_CONFIGS", 2)
    gemm._PLANS.clear()
    sizes = []
    for rows in (3, 5, 7, 5):
        a, b = torch.randn(rows, 24), torch.randn(40, 24)
        c = gemm._matmul(a, b.t(), torch.float32)
        expected = a.double() @ b.double().t()
        assert (c.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), rows
        sizes.append(len(gemm._PLANS))
    assert sizes == [1, 2, 1, 2]  # the third shape found it full: cleared, then its own plan kept


def test_a_gemm_traced_with_symbolic_sizes_keeps_no_plan(monkeypatch):
    """Symbolic sizes (torch.compile's dynamic shapes) have no hash: such a call is planned afresh
    and kept nowhere, instead of failing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    a = mode.from_tensor(torch.empty(197, 64), symbolic_context=context)
    b = mode.from_tensor(torch.empty(96, 64), symbolic_context=context).t()
    assert isinstance(a.shape[0], torch.SymInt)
    launched = []
    monkeypatch.setattr(
        gemm, "_launch", lambda plan, *args: launched.append(plan.tile) or (torch.empty(plan.c_shape), None)
    )
    gemm._PLANS.clear()
    with mode:
        c, _ = gemm._matmul_and_sums(a, b, torch.float32)
    assert launched == [gemm.GEMM_INTERPRETER_TILE] and tuple(c.shape) == (197, 96)
    assert gemm._PLANS == {}
