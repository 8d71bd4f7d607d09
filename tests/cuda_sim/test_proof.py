"""Proving tile candidates on the simulated device: a search's every candidate is recorded, pickled
and replayed (in this process, where a GPU user's would be a child) before any of them runs for its
choice, and a candidate whose replay fails is never run for the choice."""

from __future__ import annotations

import pickle

import torch

from tools.cuda_sim import replay_in_this_process
from vit_kernels import _proof, _tiles
from vit_kernels._tune_cache import store
from vit_kernels.ops import attention, attention_tiles


def test_every_candidate_of_a_search_is_proven_before_it_runs(sim, monkeypatch):
    monkeypatch.setitem(_tiles.SEARCH, "enabled", True)
    qkv = torch.randn(4, 197, 3 * 2 * 64, dtype=torch.bfloat16, device="cuda")
    seed = torch.empty(1, dtype=torch.int64, device="cuda")
    attention.attention_fwd(qkv, 2, 0.125, 0.0, seed)
    candidates = attention_tiles.fwd_candidates(torch.bfloat16, 64, 197)
    proven = {
        key.rsplit(" | ", 1)[1]: verdict
        for key, verdict in ((k, e["verdict"]) for k, e in store().items("proofs"))
        if key.startswith("attention forward |")
    }
    assert proven == {repr(tile): _proof.OK for tile in candidates}


def test_a_candidate_that_fails_its_replay_is_not_run(sim, monkeypatch):
    monkeypatch.setitem(_tiles.SEARCH, "enabled", True)
    qkv = torch.randn(4, 197, 3 * 2 * 32, dtype=torch.float16, device="cuda")
    seed = torch.empty(1, dtype=torch.int64, device="cuda")
    candidates = attention_tiles.fwd_candidates(torch.float16, 32, 197)
    faulty = candidates[0]

    def child(spec):  # what a child reports where the first candidate faulted
        if repr(faulty) == pickle.loads(spec).candidates[0][0]:
            return f"{_proof.PREFIX}ready\n{_proof.PREFIX}start 0\n", "killed by SIGSEGV"
        return replay_in_this_process(spec)

    monkeypatch.setattr(_proof, "run_child", child)
    before = len(sim.launches)
    attention.attention_fwd(qkv, 2, 32**-0.5, 0.0, seed)
    chosen = attention_tiles.FWD_CHOOSER.report()[attention._chooser_key(qkv, 2)]
    assert chosen.trials[faulty] == "invalid: faulted in a child process (killed by SIGSEGV)"
    assert chosen.tile != faulty
    launched = {
        (l.kwargs["BLOCK_M"], l.kwargs["BLOCK_N"], l.kwargs["num_warps"], l.kwargs["num_stages"])
        for l in sim.launches[before:]
        if l.kernel.fn.__name__ == "_attention_fwd_kernel"
    }
    assert faulty not in launched and launched == set(candidates[1:])


def test_children_at_once_on_cuda_are_bounded_by_the_free_memory(sim, monkeypatch):
    """Each child allocates the call's storages and a context: on CUDA no more children start at
    once than the free memory holds (the driver's answer stood in by a patched mem_get_info)."""
    gib = 1 << 30
    spans = {0: (0, gib // 4), 1: (gib, gib + gib // 4)}  # half a GiB of storages: 1.5 GiB a child
    monkeypatch.setitem(_proof._settings, "children", 4)
    cuda = torch.device("cuda")
    for free, expected in ((100 * gib, 4), (int(3.2 * gib), 2), (gib, 1)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 80 * gib))
        assert _proof._children(cuda, 6, spans) == expected
    assert _proof._children(cuda, 3, spans) == 1  # still at most what the memory holds
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 80 * gib))
    assert _proof._children(cuda, 3, spans) == 3  # at most one per candidate
