"""The simulated device's clock of our Python per call (``Recorder.our_seconds``), and the
host-overhead benchmark built on it."""

import time

import torch

from benchmarks import host_overhead
from tools.cuda_sim import simulated_cuda


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


BUSY_S = 10e-3  # our Python in the second loop


def test_our_seconds_counts_our_python_and_not_pytorchs_calls():
    """Bounds relative to the same run's wall times, so that a loaded machine (coverage, a test run
    beside it) moves both sides: PyTorch's 80 simulated calls are mostly taken out, our busy loop is
    counted whole."""
    with simulated_cuda(90) as recorder:
        t = torch.randn(64, 64, device="cuda")

        def only_pytorch():
            for _ in range(20):
                torch.empty_like(t).add_(t).stride(0)
                t.device  # noqa: B018 - PyTorch's getter on a GPU

        def ours_too():
            only_pytorch()
            _busy(BUSY_S)

        best = {}
        for name, fn in (("pytorch", only_pytorch), ("ours", ours_too)):
            samples = []
            for _ in range(7):
                mark, started = recorder.mark(), time.perf_counter()
                fn()
                wall = time.perf_counter() - started
                samples.append((recorder.our_seconds(wall, mark), wall))
            best[name] = min(samples)
    (pytorch_ours, pytorch_wall), (ours, _) = best["pytorch"], best["ours"]
    assert pytorch_ours < 0.25 * pytorch_wall, best
    assert 0.95 * BUSY_S < ours < 1.1 * BUSY_S + 0.25 * pytorch_wall, best


def test_host_overhead_on_the_simulated_device_has_a_row_per_op():
    rows = host_overhead.measure_simulated(("layer_norm", "attention"), calls=3, rounds=1)
    assert [row["op"] for row in rows] == ["layer_norm", "attention"]
    for row in rows:
        for column in host_overhead.SIMULATED_BACKENDS:
            assert isinstance(row[column], float) and 0.0 <= row[column] < 10_000, row
        assert isinstance(row["frames"], int) and isinstance(row["torch calls"], int), row
    assert "triton" in host_overhead.table(rows, columns=host_overhead.SIMULATED_COLUMNS)


# What one warm forward call on the triton backend may cost the host at most, per op, at ViT-B/16
# shapes in bfloat16 (inputs requiring grad): (vit_kernels frames entered, PyTorch calls made).
# Exact counts, the same on every machine: a change that adds to a warm call fails here, and lowers
# or raises the budget knowingly (python -m benchmarks.host_overhead --simulated-gpu prints them).
WARM_CALL_BUDGETS = {
    "patch_embed": (25, 51),
    "attention": (34, 27),
    "linear_gelu": (26, 47),
    "linear": (23, 53),
    "mlp": (40, 85),
    "layer_norm": (24, 51),
    "swiglu": (27, 64),
    "swiglu_mlp": (41, 102),
}


def test_a_warm_triton_call_stays_within_its_frame_and_pytorch_call_budget():
    rows = host_overhead.measure_simulated(tuple(WARM_CALL_BUDGETS), calls=1, rounds=1)
    over = {
        row["op"]: (row["frames"], row["torch calls"])
        for row in rows
        if row["frames"] > WARM_CALL_BUDGETS[row["op"]][0]
        or row["torch calls"] > WARM_CALL_BUDGETS[row["op"]][1]
    }
    assert not over, f"warm calls over their (frames, PyTorch calls) budgets {WARM_CALL_BUDGETS}: {over}"
    assert all(row["frames"] > 0 and row["torch calls"] > 0 for row in rows), rows
