"""LayerNorm's launch configurations are candidates the user's GPU validates and times
(``vit_kernels._tiles``), checked on the CPU: every candidate is recorded for the compile gate, the
whole choice (each candidate run in the interpreter, validated against PyTorch, timed) keeps the
fastest right tile, and the checks catch a wrong forward and a wrong backward."""

from __future__ import annotations

import pytest
import torch

import vit_kernels as vk
from tests.helpers import device_reason, fake_timer
from tools.cuda_sim import ARCHITECTURES, simulated_cuda
from vit_kernels import _accuracy, _tiles, tuning
from vit_kernels._triton import HAS_TRITON, triton
from vit_kernels.ops import layer_norm

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)


@pytest.mark.parametrize("dim", [192, 768, 1024, 4096])
def test_a_search_on_a_gpu_launches_every_candidate(dim):
    with simulated_cuda(90) as device, _tiles.search():
        x = torch.empty(4 * 197, dim, device="cuda")
        y, summed, mean, rstd = layer_norm.layer_norm_fwd(x, x[0], x[0], 1e-6, x)
        layer_norm.layer_norm_bwd(y, y, x, x[0], mean, rstd, True)
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
    """The launchers search as on a GPU, the candidates running in the interpreter; ``times[tile]``
    is what timing one returns (default 1 ms)."""
    reason = device_reason("triton", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    times: dict = {}
    monkeypatch.setitem(_tiles._search, "enabled", True)
    monkeypatch.setattr(_tiles, "interpreted", lambda device: False)
    monkeypatch.setattr(layer_norm, "multiprocessors", lambda device: 2)
    monkeypatch.setattr(_tiles, "can_measure", lambda device: True)
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda tile: times.get(tile, 1.0)))
    _tiles.forget()
    yield times
    _tiles.forget()


def test_every_candidate_is_validated_and_the_fastest_kept(choosing_on_the_cpu):
    dim = 48
    block_d = triton.next_power_of_2(dim)
    fastest_fwd, fastest_bwd = layer_norm.fwd_candidates(block_d)[-1], layer_norm.bwd_candidates(block_d)[-1]
    choosing_on_the_cpu.update({fastest_fwd: 0.1, fastest_bwd: 0.1})
    x, residual = torch.randn(37, dim, requires_grad=True), torch.randn(37, dim, requires_grad=True)
    weight, bias = torch.randn(dim, requires_grad=True), torch.randn(dim, requires_grad=True)
    with vk.use_backend("triton", strict=True):
        y, summed = vk.layer_norm(x, weight, bias, 1e-5, residual=residual)
    (y.square().sum() + summed.sum()).backward()
    report = {row["kernel"]: row for row in layer_norm.tile_report()}
    assert report["forward"]["chosen"] == repr(fastest_fwd)
    assert report["backward"]["chosen"] == repr(fastest_bwd)
    for row in report.values():  # float32 on the CPU: every candidate computes the right answer
        assert all(isinstance(trial, float) for trial in row["candidates"].values()), row["candidates"]
    expected_y = torch.nn.functional.layer_norm(x + residual, (dim,), weight, bias, 1e-5)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("part", ["y", "s"])
def test_the_forward_check_catches_a_wrong_output(part):
    x, residual = torch.randn(9, 40), torch.randn(9, 40)
    weight, bias = torch.randn(40), torch.randn(40)
    check = _accuracy.check_against(
        ("y", "s"),
        lambda: (
            layer_norm._pytorch_forward(x, residual, weight, bias, 1e-5, torch.float64),
            layer_norm._pytorch_forward(x, residual, weight, bias, 1e-5, torch.float32),
        ),
        torch.float32,
    )
    right = layer_norm._pytorch_forward(x, residual, weight, bias, 1e-5, torch.float32)
    assert check(right) is None
    wrong = [t.clone() for t in right]
    wrong[("y", "s").index(part)][3, 7] += 1e-3
    problem = check(wrong)
    assert problem is not None and problem.startswith(f"{part}:"), problem


@pytest.mark.parametrize("part", ["ds", "dweight", "dbias"])
def test_the_backward_check_catches_a_wrong_gradient(part):
    s, dy, dsum = torch.randn(9, 40) * 2 + 1, torch.randn(9, 40), torch.randn(9, 40)
    weight = torch.randn(40)
    mean, rstd = s.mean(-1), (s.var(-1, unbiased=False) + 1e-5).rsqrt()
    check = _accuracy.check_against(
        ("ds", "dweight", "dbias"),
        lambda: tuple(
            layer_norm._pytorch_backward(dy, dsum, s, weight, mean, rstd, True, dtype)
            for dtype in (torch.float64, torch.float32)
        ),
        torch.float32,
    )
    right = layer_norm._pytorch_backward(dy, dsum, s, weight, mean, rstd, True, torch.float32)
    leaf = s.double().requires_grad_()
    w = weight.double().requires_grad_()
    y = torch.nn.functional.layer_norm(leaf, (40,), w, None, 1e-5)
    ds, dw = torch.autograd.grad(y, [leaf, w], dy.double())
    torch.testing.assert_close(right[0].double(), ds + dsum.double(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(right[1].double(), dw, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(right[2].double(), dy.double().sum(0), atol=1e-4, rtol=1e-4)
    assert check(right) is None
    wrong = [t.clone() for t in right]
    wrong[("ds", "dweight", "dbias").index(part)][5] += 1e-2
    problem = check(wrong)
    assert problem is not None and problem.startswith(f"{part}:"), problem


def test_the_gpu_report_lists_the_tiles_chosen(choosing_on_the_cpu):
    from benchmarks import gpu_report_markdown

    with vk.use_backend("triton", strict=True):
        vk.layer_norm(torch.randn(5, 24), torch.randn(24), None, 1e-5)
    rows = layer_norm.tile_report()
    assert [row["kernel"] for row in rows] == ["forward"]
    text = "\n".join(gpu_report_markdown._tiles({"layer_norm_tiles": rows}))
    assert "## LayerNorm tiles chosen on this device" in text
    assert f"| forward | cpu, torch.float32, 32, False, True, False, 8 | {rows[0]['chosen']} |" in text
