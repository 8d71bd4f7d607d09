"""Tile choice on the user's GPU (``vit_kernels._tiles``), its parts on the CPU. By default the table's
first entry runs, unchecked and untimed; ``vk.tune`` launches each candidate of every key a call
meets through the whole op, excludes a wrong one with its reason and keeps the fastest right one,
and judges attention's dqkv as dq, dk and dv: a dK as wrong as the one an H100 computed fails."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from tests.helpers import fake_timer
from tests.test_tuning import Norm, _forget_tuning
from tools.cuda_sim import simulated_cuda
from vit_kernels import _accuracy, _signature, _tiles, backend, tuning
from vit_kernels.ops import attention, attention_reference, attention_tiles

TILES = ("a", "b", "c", "wrong")
CHOOSER = _tiles.TileChooser("test")
GPU = torch.device("cuda")  # a launcher's device: the tensors stay on the CPU


def _tiled(*args):
    """A layer_norm whose launch takes a tile from ``CHOOSER``: the reference's result, 1.5 times
    it with the tile "wrong"."""
    tile = _tiles.tile_to_launch(CHOOSER, GPU, lambda: ("k",), None, lambda: _tiled.tiles)
    _tiled.launched.append(tile)
    y = backend._registry["layer_norm"]["torch"].fn(*args)
    return y * 1.5 if tile.startswith("wrong") else y


@pytest.fixture
def tiled(monkeypatch):
    """``_tiled`` registered as a layer_norm implementation, ``times[key]`` what timing a backend or
    a tile returns (default 1 ms); removed, with every decision, afterwards."""
    times: dict = {}
    _tiled.launched, _tiled.tiles = [], TILES
    backend.register("layer_norm", "tiled", _tiled)
    monkeypatch.setattr(_signature, "device_name", lambda device: str(device))
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda key: times.get(key, 1.0)))
    _forget_tuning()
    yield times
    backend.unregister("layer_norm", "tiled")
    _forget_tuning()


def test_tune_keeps_the_fastest_right_tile_and_later_calls_launch_it_unchecked(tiled, monkeypatch):
    tiled.update({"a": 3.0, "b": 1.0, "c": 2.0, "wrong": 0.5, "tiled": 0.5})
    (row,) = [r for r in vk.tune(Norm(), (torch.randn(3, 7, 24),)) if r.op == "layer_norm"]
    assert row.backend == "tiled", row
    choice = CHOOSER.report()[("k",)]
    assert (choice.tile, choice.how) == ("b", "tuned")
    assert (
        choice.trials["wrong"].startswith("invalid: result 0: relative error") and choice.trials["b"] == 1.0
    )
    assert _tiles.TUNED["test | cuda | ('k',)"]["tile"] == "b"
    monkeypatch.setattr(tuning, "time_runs", lambda runs: pytest.fail(f"timed {runs}"))
    _tiled.launched.clear()
    with vk.use_backend("auto"):
        Norm()(torch.randn(3, 7, 24))
    assert _tiled.launched == ["b"]


@pytest.mark.parametrize("tiles", [("wrong",), ("wrong", "wrong as well")])
def test_no_right_tile_excludes_the_implementation_not_a_wrong_answer(tiled, tiles):
    _tiled.tiles = tiles
    (row,) = [r for r in vk.tune(Norm(), (torch.randn(3, 7, 24),)) if r.op == "layer_norm"]
    assert row.backend == "torch" and row.candidates["tiled"].startswith("invalid:"), row
    assert CHOOSER.chosen(("k",)) is None


def test_a_candidate_that_raises_is_excluded_with_its_reason(tiled):
    def launch(*args):
        if _tiles._trying.get((CHOOSER, ("k",))) == "c":
            raise ValueError("c does not fit")
        return _tiled(*args)

    backend.register("layer_norm", "tiled", launch)
    vk.tune(Norm(), (torch.randn(3, 7, 24),))
    assert CHOOSER.report()[("k",)].trials["c"] == "invalid: raised ValueError: c does not fit"


def test_an_ordinary_call_launches_the_default_and_keeps_nothing(tiled, monkeypatch):
    monkeypatch.setattr(tuning, "time_runs", lambda runs: pytest.fail(f"timed {runs}"))
    with vk.use_backend("tiled"):
        Norm()(torch.randn(3, 7, 24))
    assert _tiled.launched == ["a"] and CHOOSER.chosen(("k",)) is None


def test_tile_validation_runs_without_autocast(tiled):
    """The search runs with autocast off: the float32 reference stays float32 inside a caller's bf16
    autocast region (else PyTorch's own error reads 0 and every candidate passes on the floor)."""
    seen = []

    def probe(*args):
        seen.append(torch.is_autocast_enabled("cpu"))
        return _tiled(*args)

    backend.register("layer_norm", "tiled", probe)
    vk.tune(Norm(), (torch.randn(3, 7, 24),), autocast=torch.bfloat16)
    assert len(seen) > len(TILES) and not any(seen)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64)])
def test_tune_on_a_gpu_launches_every_candidate(dtype, head_dim):
    class Attend(torch.nn.Module):
        def forward(self, qkv):
            return vk.attention(qkv, 2)

    with simulated_cuda(90) as device:
        qkv = torch.empty(4, 197, 3 * 2 * head_dim, dtype=dtype, device="cuda", requires_grad=True)
        vk.tune(Attend(), (qkv,), grad=True)
    pairs = attention_tiles.bwd_candidates(dtype, head_dim, 197, arch=90)
    assert _launched_tiles(device.launches, "_attention_fwd_kernel") == set(
        attention_tiles.fwd_candidates(dtype, head_dim, 197)
    )
    assert _launched_tiles(device.launches, "_attention_bwd_dq_kernel") == {dq for dq, _ in pairs}
    assert _launched_tiles(device.launches, "_attention_bwd_dkdv_kernel") == {dkdv for _, dkdv in pairs}


@pytest.mark.parametrize("arch", [90, 80])
def test_a_first_call_on_a_gpu_launches_the_tables_entry_only(arch):
    """Without a search a first call launches the table's entry for its architecture, unchecked:
    nothing else is compiled or run."""
    with simulated_cuda(arch) as device:
        _attention_fwd_and_bwd(torch.bfloat16, 64)
    dq, dkdv = attention_tiles.bwd_candidates(torch.bfloat16, 64, 197, arch=arch)[0]
    assert _launched_tiles(device.launches, "_attention_fwd_kernel") == {
        attention_tiles.fwd_candidates(torch.bfloat16, 64, 197)[0]
    }
    assert _launched_tiles(device.launches, "_attention_bwd_dq_kernel") == {dq}
    assert _launched_tiles(device.launches, "_attention_bwd_dkdv_kernel") == {dkdv}
    assert len(device.launches) == 3  # the forward, dQ and dK/dV kernels, once each


def _attention_fwd_and_bwd(dtype, head_dim):
    qkv = torch.empty(4, 197, 3 * 2 * head_dim, dtype=dtype, device="cuda")
    seed = torch.empty(1, dtype=torch.int64, device="cuda")
    out, stats = attention.attention_fwd(qkv, 2, head_dim**-0.5, 0.0, seed)
    attention.attention_bwd(torch.empty_like(out), qkv, stats, seed, 2, head_dim**-0.5, 0.0)


def _launched_tiles(launches, name):
    return {
        (l.kwargs["BLOCK_M"], l.kwargs["BLOCK_N"], l.kwargs["num_warps"], l.kwargs["num_stages"])
        for l in launches
        if l.kernel.fn.__name__ == name
    }


def test_no_listed_tile_is_one_the_h100_found_wrong():
    """(32, 64, 8, 2) and (32, 64, 4, 2) computed a wrong dK at 16-bit head dims 80-128 on an H100."""
    for _dq, dkdv in attention_tiles.ATTENTION_BWD_TILES[(False, 128)]:
        assert dkdv not in ((32, 64, 8, 2), (32, 64, 4, 2)), dkdv


def _attention_results(qkv, grad_out, dtype):
    """[out, dqkv] of attention_ref in ``dtype``: what the search judges a candidate's results by."""
    leaf = qkv.detach().to(dtype).requires_grad_()
    out = attention_reference.attention_ref(leaf, 2, (qkv.shape[-1] // 6) ** -0.5)
    (dqkv,) = torch.autograd.grad(out, leaf, grad_out.to(dtype))
    return [out.detach(), dqkv]


def _judged(qkv, grad_out, dq, dk, dv, dtype):
    exact = _attention_results(qkv, grad_out, torch.float64 if dtype == torch.float32 else torch.float32)
    own = _attention_results(qkv, grad_out, dtype)
    actual = [own[0], torch.cat([dq, dk, dv], dim=-1).to(dtype)]
    return tuning._problem("attention", actual, own, exact, dtype), exact[1].double().chunk(3, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relative_error", [1.3e-2, 8.4e-2])
def test_validation_rejects_the_wrong_dk_the_h100_found(dtype, relative_error):
    """dqkv is judged as dq, dk and dv: a dK off by the relative error the H100 measured (1.3e-2 to
    8.4e-2 of its largest magnitude) fails, named, while the right one, rounded to the dtype, passes."""
    torch.manual_seed(0)
    qkv = (torch.randn(2, 50, 3 * 128, dtype=torch.float64) * 2).to(dtype)
    grad_out = torch.randn(2, 50, 128, dtype=torch.float64).to(dtype)
    _, (dq, dk, dv) = _judged(qkv, grad_out, *(torch.zeros(2, 50, 128),) * 3, dtype)
    problem, _ = _judged(qkv, grad_out, dq, dk, dv, dtype)
    assert problem is None, problem
    wrong_dk = dk + relative_error * dk.abs().max() * torch.sign(torch.randn_like(dk))
    problem, _ = _judged(qkv, grad_out, dq, wrong_dk, dv, dtype)
    assert problem is not None and problem.startswith("dk:"), problem


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_validation_passes_exact_zero_gradients_at_length_1(dtype):
    """At length 1 the softmax is constant: dQ and dK are zero in exact arithmetic, and the float64
    reference holds rounding residues of 1e-17 there. A kernel's exact zeros pass (on an H200 every
    candidate was refused against those residues), and a dQ as large as dV still fails."""
    torch.manual_seed(0)
    qkv = torch.randn(4, 1, 3 * 32, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(4, 1, 32, dtype=torch.float64).to(dtype)
    _, (_, _, dv) = _judged(qkv, grad_out, *(torch.zeros(4, 1, 32),) * 3, dtype)
    zeros = torch.zeros_like(dv)
    problem, _ = _judged(qkv, grad_out, zeros, zeros, dv, dtype)
    assert problem is None, problem
    problem, _ = _judged(qkv, grad_out, dv, zeros, dv, dtype)
    assert problem is not None and problem.startswith("dq"), problem


def test_a_part_is_judged_against_at_least_a_share_of_its_siblings_scale():
    exact = torch.tensor([1e-17, -1e-17], dtype=torch.float64)
    big = torch.full((2,), 3.0, dtype=torch.float64)
    residue = torch.tensor([2e-9, 0.0])  # 2e-9 / (1e-3 x 3) = 6.7e-7 relative: below float32's floor
    assert (
        _accuracy.first_problem(
            [("small", residue, torch.zeros(2), exact), ("big", big.float(), big.float(), big)], 1e-5
        )
        is None
    )
    assert _accuracy.first_problem([("small", residue, torch.zeros(2), exact)], 1e-5).startswith("small")
    wrong = torch.tensor([1e-4, 0.0])  # 3.3e-2 relative to the siblings' scale
    assert _accuracy.first_problem(
        [("small", wrong, torch.zeros(2), exact), ("big", big.float(), big.float(), big)], 1e-5
    ).startswith("small")
    empty = torch.zeros(5, 0)
    assert _accuracy.first_problem([("dW", empty, empty, empty.double())], 1e-5) is None


def test_the_gpu_report_lists_the_tiles_chosen(monkeypatch):
    from benchmarks import gpu_report_markdown

    monkeypatch.setattr(_signature, "device_name", lambda device: str(device))
    _tiles.forget()
    try:
        trials = {(64, 64, 4, 3): 0.2, (128, 64, 8, 3): 0.1}
        key = ("torch.bfloat16", 64, 197, 256)
        attention_tiles.FWD_CHOOSER.keep(key, _tiles.Choice((128, 64, 8, 3), "tuned", trials), GPU)
        rows = attention_tiles.tile_report()
        assert rows == [
            {
                "kernel": "forward",
                "key": ["torch.bfloat16", 64, 197, 256],
                "chosen": "(128, 64, 8, 3)",
                "how": "tuned",
                "candidates": {"(64, 64, 4, 3)": 0.2, "(128, 64, 8, 3)": 0.1},
            }
        ]
        text = "\n".join(gpu_report_markdown._tiles({"attention_tiles": rows}))
        assert "| forward | torch.bfloat16, 64, 197, 256 | (128, 64, 8, 3) |" in text
    finally:
        _tiles.forget()
        _tiles.TUNED.clear()


def test_keys_and_tiles_are_concrete_under_dynamic_shapes():
    """Under torch.compile with dynamic shapes the sizes reach the launcher as SymInts: the choice's
    key and the tiles must be plain ints (a SymInt cannot be hashed, and a tile is a constexpr)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 3)
    qkv = mode.from_tensor(torch.empty(8, 197, 3 * 2 * 64, dtype=torch.bfloat16), symbolic_context=context)
    assert isinstance(qkv.shape[1], torch.SymInt)
    key = attention._chooser_key(qkv, 2)
    assert key == ("cpu", "torch.bfloat16", 64, 197, 16) and all(type(part) in (str, int) for part in key)
    hash(key)
    tiles = attention_tiles.fwd_candidates(qkv.dtype, 64, qkv.shape[1])
    assert all(type(v) is int for tile in tiles for v in tile)


def test_a_decided_key_only_looks_its_tile_up():
    """Once a key holds a tile, a launch lists no candidates: one lookup."""
    chooser = _tiles.TileChooser("decided")
    chooser.pin(("k",), "a")

    def candidates():
        raise AssertionError("listed the candidates of a decided key")

    assert _tiles.tile_to_launch(chooser, GPU, lambda: ("k",), None, candidates) == "a"


def test_the_pair_measured_fastest_on_sm90_is_its_default():
    """dQ (64, 64, 4, 3) + dK/dV (32, 64, 4, 2): the pair the H100 and the H200 chose at ViT-B/16's
    shapes in bfloat16 runs first on sm_90; elsewhere the table's first pair."""
    measured = ((64, 64, 4, 3), (32, 64, 4, 2))
    assert attention_tiles.bwd_candidates(torch.bfloat16, 64, 197, arch=90)[0] == measured
    assert attention_tiles.bwd_candidates(torch.float16, 64, 197, arch=90)[0] == measured
    generic = attention_tiles.ATTENTION_BWD_TILES[(False, 64)][0]
    assert attention_tiles.bwd_candidates(torch.bfloat16, 64, 197, arch=80)[0] == generic != measured
    assert (
        attention_tiles.bwd_candidates(torch.float32, 64, 197, arch=90)[0]
        == attention_tiles.ATTENTION_BWD_TILES[(True, 64)][0]
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_16bit_forward_candidates_include_128_rows_on_8_warps_at_2_to_4_stages(head_dim):
    tiles = attention_tiles.ATTENTION_FWD_TILES[(False, head_dim)]
    stages = {stages for bm, _, warps, stages in tiles if (bm, warps) == (128, 8)}
    assert {2, 3} <= stages, tiles
