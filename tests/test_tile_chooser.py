"""Tile choice on the user's GPU (``vit_kernels._tiles``), its parts on the CPU. By default the table's
first entry runs, unchecked and untimed; searching (``vk.tune``) validates candidates before they
are timed, excludes a wrong one with its reason and keeps the fastest right one; nothing runs where
nothing may (tracing, capture, no GPU), and the attention's check catches a dK as wrong as the one
an H100 computed."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.helpers import fake_timer
from tools.cuda_sim import simulated_cuda
from vit_kernels import _accuracy, _tiles, tuning
from vit_kernels.ops import attention, attention_reference, attention_tiles


@pytest.fixture
def measurable(monkeypatch):
    """Searching is on and candidates may run (as on a GPU); ``times[tile]`` is what timing one returns."""
    times: dict = {}
    monkeypatch.setitem(_tiles._search, "enabled", True)
    monkeypatch.setattr(_tiles, "can_measure", lambda device: True)
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda tile: times[tile]))
    return times


def test_the_fastest_right_tile_is_chosen_and_kept(measurable):
    measurable.update({"a": 3.0, "b": 1.0, "c": 2.0, "wrong": 0.5})
    runs = []
    chooser = _tiles.TileChooser("test")

    def run(tile):
        runs.append(tile)
        return [torch.tensor([0.0 if tile == "wrong" else 1.0])]

    def check(outputs):
        return None if outputs[0].item() == 1.0 else "off by one"

    device = torch.device("cpu")
    assert chooser.choose(("k",), device, ["a", "b", "c", "wrong"], lambda: (run, check)) == "b"
    trials = chooser.report()[("k",)].trials
    assert trials["wrong"] == "invalid: off by one" and trials["b"] == 1.0
    runs.clear()
    assert (
        chooser.choose(("k",), device, ["a", "b", "c", "wrong"], lambda: (run, check)) == "b" and runs == []
    )


def test_no_right_tile_is_an_error_not_a_wrong_answer(measurable):
    chooser = _tiles.TileChooser("test")
    with pytest.raises(RuntimeError, match="no test tile computes the right answer"):
        chooser.choose(
            ("k",), torch.device("cpu"), ["a"], lambda: (lambda t: [torch.zeros(1)], lambda outs: "wrong")
        )


def test_nothing_runs_where_nothing_may():
    chooser = _tiles.TileChooser("test")

    def run(tile):
        raise AssertionError("ran a candidate")

    assert (
        chooser.choose(("k",), torch.device("cpu"), ["first", "second"], lambda: (run, lambda outs: None))
        == "first"
    )
    assert chooser.chosen(("k",)) is None  # not kept: measured on first use where it may run


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64)])
def test_a_search_on_a_gpu_launches_every_candidate(dtype, head_dim):
    with simulated_cuda(90) as device, _tiles.search():
        _attention_fwd_and_bwd(dtype, head_dim)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_check_catches_a_wrong_dk(dtype):
    """Gradients within rounding of the exact ones pass; a dK off by 2% (the H100's wrong tile gave
    1e-2 to 8e-2) fails, named."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 17, 3 * 2 * 16).to(dtype)
    grad_out = torch.randn(2, 17, 2 * 16).to(dtype)
    scale = 16**-0.5
    exact = attention_reference.reference_attention(qkv, 2, scale, grad_out, torch.float64)
    right = torch.cat(exact, dim=-1).to(dtype)
    check = attention_reference.check_against_pytorch(
        ["dq", "dk", "dv"], lambda outs: list(outs[0].chunk(3, dim=-1)), qkv, 2, scale, grad_out
    )
    assert check([right]) is None
    dq, dk, dv = (t.double() for t in exact)
    noise = torch.randn_like(dk) * dk.abs().max() * 0.02
    wrong = torch.cat([dq, dk + noise, dv], dim=-1).to(dtype)
    problem = check([wrong])
    assert problem is not None and problem.startswith("dk:"), problem


def test_the_gpu_report_lists_the_tiles_chosen(measurable):
    from benchmarks import gpu_report_markdown

    measurable.update({(64, 64, 4, 3): 0.2, (128, 64, 8, 3): 0.1})
    _tiles.forget()
    try:
        attention_tiles.FWD_CHOOSER.choose(
            ("torch.bfloat16", 64, 197, 256),
            torch.device("cpu"),
            [(64, 64, 4, 3), (128, 64, 8, 3)],
            lambda: (lambda tile: [torch.zeros(1)], lambda outputs: None),
        )
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
    assert attention_reference.validation_images(qkv, 2) == 4
    tiles = attention_tiles.fwd_candidates(qkv.dtype, 64, qkv.shape[1])
    assert all(type(v) is int for tile in tiles for v in tile)


def test_a_decided_call_only_looks_its_tile_up(measurable):
    """Once a key is decided, a launch builds no trial (no closures, no references): one lookup."""
    measurable.update({"a": 1.0})
    chooser = _tiles.TileChooser("test")
    qkv = torch.empty(2, 17, 3 * 2 * 16, device="meta")
    chooser.choose(
        attention._chooser_key(qkv, 2),
        torch.device("cpu"),
        ["a"],
        lambda: (lambda t: [torch.zeros(1)], lambda outputs: None),
    )

    def trial():
        raise AssertionError("built the trial of a decided key")

    key = attention._chooser_key(qkv, 2)
    assert _tiles.tile_to_launch(chooser, qkv.device, lambda: key, None, lambda: ["a"], trial) == "a"


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relative_error", [1.3e-2, 8.4e-2])
def test_validation_rejects_the_wrong_dk_the_h100_found(dtype, relative_error):
    """The attention backward check refuses a dK off by the relative error the H100 measured (1.3e-2
    to 8.4e-2 of its largest magnitude), while the right dK, rounded to the dtype, passes."""
    qkv = (torch.randn(2, 50, 3 * 128, dtype=torch.float64) * 2).to(dtype)
    grad_out = torch.randn(2, 50, 128, dtype=torch.float64).to(dtype)
    scale = 64**-0.5
    check = attention_reference.check_against_pytorch(
        ["dq", "dk", "dv"], lambda outputs: list(outputs[0].chunk(3, dim=-1)), qkv, 2, scale, grad_out
    )
    exact = torch.cat(attention_reference.reference_attention(qkv, 2, scale, grad_out, torch.float64), dim=-1)
    assert check([exact.to(dtype)]) is None
    dq, dk, dv = exact.chunk(3, dim=-1)
    wrong_dk = dk + relative_error * dk.abs().max() * torch.sign(torch.randn_like(dk))
    problem = check([torch.cat([dq, wrong_dk, dv], dim=-1).to(dtype)])
    assert problem is not None and problem.startswith("dk"), problem


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_validation_passes_exact_zero_gradients_at_length_1(dtype):
    """At length 1 the softmax is constant: dQ and dK are zero in exact arithmetic, and the float64
    reference holds rounding residues of 1e-17 there. A kernel's exact zeros pass (on an H200 every
    candidate was refused against those residues), and a dQ as large as dV still fails."""
    qkv = torch.randn(4, 1, 3 * 32, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(4, 1, 32, dtype=torch.float64).to(dtype)
    check = attention_reference.check_against_pytorch(
        ["dq", "dk", "dv"], lambda outputs: list(outputs[0].chunk(3, dim=-1)), qkv, 2, 16**-0.5, grad_out
    )
    _, _, dv = torch.cat(
        attention_reference.reference_attention(qkv, 2, 16**-0.5, grad_out, torch.float64), -1
    ).chunk(3, -1)
    zeros = torch.zeros_like(dv)
    assert check([torch.cat([zeros, zeros, dv], dim=-1).to(dtype)]) is None
    problem = check([torch.cat([dv, zeros, dv], dim=-1).to(dtype)])
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


def test_an_empty_problem_decides_nothing(measurable):
    """Empty outputs validate no tile: the default is launched and no choice is kept for the key (the
    same key's first non-empty call chooses), instead of an error from reducing an empty tensor."""
    chooser = _tiles.TileChooser("test")
    checked = []

    def check(outputs):
        checked.append(outputs)
        return None

    device = torch.device("cpu")
    assert (
        chooser.choose(
            ("k",), device, ["a", "b"], lambda: (lambda t: [torch.zeros(0, 5), torch.zeros(5, 0)], check)
        )
        == "a"
    )
    assert chooser.chosen(("k",)) is None and checked == []
    assert (
        _accuracy.first_problem(
            [("dW", torch.zeros(5, 0), torch.zeros(5, 0), torch.zeros(5, 0, dtype=torch.float64))], 1e-5
        )
        is None
    )


def test_tile_validation_runs_without_autocast():
    """A chooser measures with autocast off: its float32 reference stays float32 inside a caller's
    bf16 autocast region (else PyTorch's own error reads 0 and every candidate passes on the floor)."""
    seen = []
    chooser = _tiles.TileChooser("probe")

    def run(tile):
        seen.append(torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))
        return []

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        _tiles.search(),
        mock.patch.object(_tiles, "can_measure", lambda device: True),
        mock.patch.object(tuning, "time_runs", fake_timer()),
    ):
        chooser.choose(("key",), torch.device("cpu"), [(1,)], lambda: (run, lambda outputs: None))
    assert seen and not any(seen)
