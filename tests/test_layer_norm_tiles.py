"""LayerNorm's launch configurations are candidates the user's GPU validates and times
(``vit_kernels._tiles``), checked on the CPU: every candidate is recorded for the compile gate, the
whole choice (each candidate run in the interpreter, validated against PyTorch, timed) keeps the
fastest right tile."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from tests.helpers import device_reason, fake_timer, search_tiles
from tools.cuda_sim import ARCHITECTURES, every_candidate, simulated_cuda
from vit_kernels import _tiles, tuning
from vit_kernels._triton import HAS_TRITON, triton
from vit_kernels.ops import layer_norm

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)


@pytest.mark.parametrize("dim", [192, 768, 1024, 4096])
def test_a_search_on_a_gpu_launches_every_candidate(dim):
    def run():
        x = torch.empty(4 * 197, dim, device="cuda")
        y, summed, mean, rstd = layer_norm.layer_norm_fwd(x, x[0], x[0], 1e-6, x)
        layer_norm.layer_norm_bwd(y, y, x, x[0], mean, rstd, True)

    with simulated_cuda(90) as device:
        every_candidate(run)
    launches = device.launches

    def tiles(name):
        return {(l.kwargs["ROWS"], l.kwargs["num_warps"]) for l in launches if l.kernel.fn.__name__ == name}

    block_d = triton.next_power_of_2(dim)
    assert tiles("_layer_norm_fwd_kernel") == set(layer_norm.fwd_candidates(block_d))
    assert tiles("_layer_norm_bwd_kernel") == {
        (rows, warps) for rows, _, warps in layer_norm.bwd_candidates(block_d)
    }


def test_the_backward_grid_fits_the_gpu_and_covers_every_row():
    """A backward tile's programs: at most programs-per-SM x SMs, each walking enough tiles that all
    rows are covered."""
    rows, dim = 25216, 768
    with simulated_cuda(90) as device:
        x = torch.empty(rows, dim, device="cuda")
        y, summed, mean, rstd = layer_norm.layer_norm_fwd(x, x[0], x[0], 1e-6, x)
        layer_norm.layer_norm_bwd(y, y, x, x[0], mean, rstd, True)
    for launch in device.launches:
        if launch.kernel.fn.__name__ != "_layer_norm_bwd_kernel":
            continue
        (programs,), tiles_per_program = launch.grid, launch.args[11]
        assert programs <= max(layer_norm.BWD_PROGRAMS_PER_SM) * ARCHITECTURES[90]["multi_processor_count"]
        assert programs * tiles_per_program * launch.kwargs["ROWS"] >= rows


def test_the_default_tiles_come_first_and_every_list_is_distinct():
    for block_d in (16, 256, 1024, 8192, 65536):
        fwd, bwd = layer_norm.fwd_candidates(block_d), layer_norm.bwd_candidates(block_d)
        assert len(set(fwd)) == len(fwd) and len(set(bwd)) == len(bwd)
        assert fwd[0][0] == bwd[0][0] == layer_norm._rows_per_program(block_d)


@pytest.fixture
def choosing_on_the_cpu(monkeypatch):
    """The launchers choose as on a GPU, the candidates running in the interpreter; ``times[tile]``
    is what timing one returns (default 1 ms)."""
    reason = device_reason("triton", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    times: dict = {}
    monkeypatch.setattr(_tiles, "interpreted", lambda device: False)
    monkeypatch.setattr(layer_norm, "multiprocessors", lambda device: 2)
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda tile: times.get(tile, 1.0)))
    _tiles.forget()
    yield times
    _tiles.forget()


def test_every_candidate_is_validated_and_the_fastest_kept(choosing_on_the_cpu):
    """vk.tune's tile search with every candidate computed (the interpreter): each is right in
    float32, the fastest by the clock is kept, and the op then launches it."""
    dim = 48
    block_d = triton.next_power_of_2(dim)
    fastest_fwd, fastest_bwd = layer_norm.fwd_candidates(block_d)[-1], layer_norm.bwd_candidates(block_d)[-1]
    choosing_on_the_cpu.update({fastest_fwd: 0.1, fastest_bwd: 0.1})
    x, residual = torch.randn(37, dim, requires_grad=True), torch.randn(37, dim, requires_grad=True)
    weight, bias = torch.randn(dim, requires_grad=True), torch.randn(dim, requires_grad=True)
    search_tiles("layer_norm", "triton", x, weight, bias, 1e-5, residual)
    report = {row["kernel"]: row for row in layer_norm.tile_report()}
    assert report["forward"]["chosen"] == repr(fastest_fwd)
    assert report["backward"]["chosen"] == repr(fastest_bwd)
    for row in report.values():  # float32 on the CPU: every candidate computes the right answer
        assert all(isinstance(trial, float) for trial in row["candidates"].values()), row["candidates"]
    with vk.use_backend("triton", strict=True):
        y, summed = vk.layer_norm(x, weight, bias, 1e-5, residual=residual)
    expected_y = torch.nn.functional.layer_norm(x + residual, (dim,), weight, bias, 1e-5)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)
