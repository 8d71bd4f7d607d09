"""Tile candidates proven in a child process (``vit_kernels._proof``): a candidate whose launches
fault, raise or hang there is excluded with why and never runs in the caller's process; the others
are proven; the replay reproduces shapes, strides, offsets, storage sharing and grids; verdicts are
kept in memory and on disk; a real Triton kernel replays in the child (the interpreter, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import proof_kernels
from tests.helpers import CUDA, device_reason, fake_timer, requires_cuda
from vit_kernels import _env, _proof, _tiles, _timer, _tune_cache
from vit_kernels._triton import launch
from vit_kernels._tune_cache import Store, store

CPU = torch.device("cpu")
SKIP = device_reason("triton", CUDA)


@pytest.fixture
def children(monkeypatch, tmp_path):
    """Proofs on disk in a fresh folder; ``children`` counts the child processes started."""
    started = []

    def spawn(spec):
        started.append(spec)
        return _proof._spawn(spec)

    monkeypatch.setattr(_tune_cache, "_store", Store(tmp_path))
    monkeypatch.setattr(_proof, "run_child", spawn)
    return started


def fill_run(out):
    def run(tile):
        launch(proof_kernels.fill, (1,), out, 2.5, MODE=tile)
        return [out]

    return run


def test_a_faulting_raising_or_hanging_candidate_is_excluded_and_the_rest_proven(
    children, monkeypatch, tmp_path
):
    monkeypatch.setattr(_proof, "SECONDS_PER_CANDIDATE", 10)  # the hang's; others take well under a second
    out = torch.zeros(3)
    tiles = ["first", "abort", "second", "raise", "hang", "last"]
    verdicts = _proof.verdicts("test", ("k",), CPU, tiles, fill_run(out))
    assert verdicts["first"] is None and verdicts["second"] is None and verdicts["last"] is None
    assert verdicts["abort"].startswith("faulted in a child process (killed by SIGABRT")
    assert verdicts["raise"] == "raised in a child process: ValueError: tile raise refused"
    assert verdicts["hang"].startswith("faulted in a child process (no progress for 10 s, killed")
    assert len(children) == 4  # a fresh child after the fault, the refusal and the hang
    assert torch.equal(out, torch.zeros(3))  # recorded, not run, in this process
    # kept: in memory, then on disk for another process
    assert _proof.verdicts("test", ("k",), CPU, tiles, fill_run(out)) == verdicts
    store().clear()  # as another process: read from the file
    assert _proof.verdicts("test", ("k",), CPU, tiles, fill_run(out)) == verdicts
    assert len(children) == 4
    assert _proof.verdicts("test", ("other key",), CPU, ["first"], fill_run(out)) == {"first": None}
    assert len(children) == 5


def test_candidates_shared_among_children_at_once_get_the_same_verdicts(children, monkeypatch):
    """Three children at once (each running its share in turn): the same verdicts as one at a time,
    and a child that dies takes only its own share's candidate."""
    monkeypatch.setattr(_proof, "SECONDS_PER_CANDIDATE", 10)
    monkeypatch.setitem(_proof._settings, "children", 3)
    out = torch.zeros(3)
    tiles = ["first", "abort", "second", "raise", "hang", "last"]
    verdicts = _proof.verdicts("test", ("k",), CPU, tiles, fill_run(out))
    assert [tile for tile, verdict in verdicts.items() if verdict is None] == ["first", "second", "last"]
    assert verdicts["abort"].startswith("faulted in a child process (killed by SIGABRT")
    assert verdicts["raise"] == "raised in a child process: ValueError: tile raise refused"
    assert verdicts["hang"].startswith("faulted in a child process (no progress for 10 s, killed")
    # shares [first, raise], [abort, hang], [second, last]: 1 child, then 2 (after the abort), then 1
    assert len(children) == 4


def test_the_number_of_children_at_once_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("VIT_KERNELS_PROOF_CHILDREN", "3")
    assert _proof._children_from_environment() == 3
    monkeypatch.setenv("VIT_KERNELS_PROOF_CHILDREN", "0")
    with pytest.raises(ValueError, match="VIT_KERNELS_PROOF_CHILDREN must be a positive integer"):
        _proof._children_from_environment()
    monkeypatch.delenv("VIT_KERNELS_PROOF_CHILDREN")
    assert 1 <= _proof._children_from_environment() <= 4
    assert _proof._children(CPU, 2, {}) == 1  # the tests' stand-in replays in this process: one at a time


def test_the_replay_has_the_recorded_layout_storage_sharing_and_grid(children):
    packed = torch.randn(4, 7, 9)
    a = packed[1:, ::2, 3:5].transpose(0, 1)  # strided, offset by 264 bytes, transposed
    unshared = torch.randn(2)
    # the bytes a reaches: from its first element (rounded down to 16) to one past its last
    reached = (a.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))) * 4 - 256

    def run(tile):
        b = packed if tile == "shared" else unshared
        launch(
            proof_kernels.expect_layout,
            (3, 2),
            a,
            b,
            SHAPE=tuple(a.shape),
            STRIDE=a.stride(),
            ALIGNMENT=a.data_ptr() % 16,
            SHARED=tile == "shared",
            GRID=(3, 2),
            STORAGE_BYTES=packed.untyped_storage().nbytes() if tile == "shared" else -(-reached // 16) * 16,
        )
        return [a]

    # apart: the candidates of one key share one set of storages
    assert _proof.verdicts("test", ("shared",), CPU, ["shared"], run) == {"shared": None}
    assert _proof.verdicts("test", ("unshared",), CPU, ["unshared"], run) == {"unshared": None}
    assert len(children) == 2


def test_a_search_never_runs_a_candidate_that_failed_in_a_child(monkeypatch):
    monkeypatch.setitem(_tiles.SEARCH, "enabled", True)
    monkeypatch.setattr(_tiles, "can_measure", lambda device: True)  # proven in this process (conftest)
    monkeypatch.setattr(_timer, "time_runs", fake_timer())
    ran = []

    def run(tile):
        ran.append(tile)
        return fill_run(torch.zeros(2))(tile)

    chooser = _tiles.TileChooser("proof test")
    chosen = chooser.choose(("k",), CPU, ["raise", "fine"], run, lambda outputs: None)
    assert chosen == "fine"
    assert (
        chooser.report()[("k",)].trials["raise"]
        == "invalid: raised in a child process: ValueError: tile raise refused"
    )
    assert ran.count("raise") == 1  # recorded once for the proof, never run for real here


def test_a_child_that_cannot_start_is_an_error_naming_the_way_out(monkeypatch):
    monkeypatch.setattr(_proof, "run_child", lambda spec: ("", "exit status 1; stderr: ImportError: x"))
    with pytest.raises(RuntimeError, match="did not start .*ImportError: x.*VIT_KERNELS_PROVE_TILES=0"):
        _proof.verdicts("test", ("k",), CPU, ["first"], fill_run(torch.zeros(1)))


def test_an_empty_problem_proves_nothing(children):
    assert _proof.verdicts("test", ("empty",), CPU, ["first"], lambda tile: [torch.zeros(0)]) == {}
    assert children == []


@pytest.mark.skipif(device_reason("triton", CPU) is not None, reason=str(device_reason("triton", CPU)))
def test_a_real_gemm_replays_in_a_child(children):
    """The GEMM kernel's recorded launches (its JITFunction, constexprs, strided operands) run in a
    child under the interpreter, as on a GPU they run on the device."""
    from vit_kernels.ops import gemm

    a, b = torch.randn(13, 40), torch.randn(9, 40).t()
    call = gemm._Gemm(
        a,
        b,
        torch.float32,
        torch.randn(9),
        gemm.EPILOGUE_GELU,
        0,
        torch.empty(13, 9),
        None,
        gemm.SUMS_NONE,
        1,
        64,
    )
    run, _ = call.trial()
    tiles = [gemm.GEMM_INTERPRETER_TILE, gemm.GemmTile(16, 16, 32, 1, 1)]
    assert _proof.verdicts("GEMM", call.key(), CPU, tiles, run) == dict.fromkeys(tiles)
    assert len(children) == 1


@requires_cuda
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_attention_candidate_is_proven_in_a_child_on_the_gpu(children, dtype):
    """On a GPU: the attention forward's candidates recorded on a real call's tensors replay in a
    child on the device, and each one runs there cleanly."""
    from vit_kernels.ops import attention, attention_tiles

    qkv = torch.randn(2, 197, 3 * 2 * 64, dtype=dtype, device="cuda")
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    candidates = attention_tiles.fwd_candidates(dtype, 64, 197)

    def run(tile):
        attention_tiles.FWD_CHOOSER.pin(attention._chooser_key(qkv, 2), tile)
        try:
            return list(attention.attention_fwd(qkv, 2, 64**-0.5, 0.0, seed))
        finally:
            attention_tiles.FWD_CHOOSER.forget()

    assert _proof.verdicts(
        "attention forward", ("proof", dtype), qkv.device, candidates, run
    ) == dict.fromkeys(candidates)
    assert len(children) == 1


def test_verdicts_and_choices_are_kept_per_driver(monkeypatch, tmp_path):
    """The caches' digest covers the CUDA driver (cuDriverGetVersion): a new driver proves afresh."""
    import ctypes

    class Driver:
        @staticmethod
        def cuDriverGetVersion(pointer):
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents.value = 13000
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver())
    assert _tune_cache.environment()["driver"] == "13000"
    with_driver = Store(tmp_path).path

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert _tune_cache.environment()["driver"] == "none"
    assert Store(tmp_path).path != with_driver


def test_a_candidate_whose_own_launcher_raises_is_excluded_for_this_call_only(children):
    def run(tile):
        if tile == "refused":
            raise MemoryError("out of memory")
        return fill_run(torch.zeros(1))(tile)

    verdicts = _proof.verdicts("test", ("refusal",), CPU, ["refused", "first"], run)
    assert verdicts == {
        "refused": "raised while recording its launches: MemoryError: out of memory",
        "first": None,
    }
    assert not any(
        " | 'refused'" in key for key, _ in store().items("proofs")
    )  # not kept: may pass next time


def test_a_child_imports_the_kernels_without_the_api_and_its_registrations():
    """A child starts per key and candidate batch: its ``import vit_kernels`` skips the public API,
    whose op registrations import torch._dynamo and torch._inductor (a second or more each time)."""
    probe = (
        "import sys, vit_kernels, vit_kernels._proof, vit_kernels.kernels.attention, vit_kernels.kernels.gemm, "
        "vit_kernels.kernels.layer_norm, vit_kernels.kernels.patch_embed, vit_kernels.kernels.swiglu; "
        "print(hasattr(vit_kernels, 'attention'), vit_kernels.__version__, "
        "any(m.startswith(('torch._dynamo', 'torch._inductor')) for m in sys.modules))"
    )

    def run(**env):
        environment = {k: v for k, v in os.environ.items() if k != _env.PROOF_CHILD}
        result = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env={**environment, **env}
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    assert run(**{_env.PROOF_CHILD: "1"}) == ["False", "0.1.0", "False"]
    assert run() == ["True", "0.1.0", "True"]
