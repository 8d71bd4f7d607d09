"""The device's measured peaks, in the same run as the benchmarks they scale: the matmul rate
(TFLOP/s, per dtype) and the copy bandwidth (GB/s, bytes read + written per second).

A peak is the best rate seen (the fastest sample), at sizes large enough to reach it: square GEMMs
of 4096 on a CPU and 8192 on a GPU, copies of 256 MiB on a CPU and 1 GiB on a GPU (well past any
cache). A peak that an op then beats is not trustworthy: ``fraction_of`` gives None ("n/a") there
instead of a fraction above 100%.
"""

from __future__ import annotations

from typing import Optional

import torch

from benchmarks.timing import time_call

MATMUL_SIZE = {"cpu": 4096, "cuda": 8192}
COPY_MIB = {"cpu": 256, "cuda": 1024}


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The best rate of a square GEMM (size^3), the practical peak for GEMM-like work."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = time_call(lambda i: a @ b, device, warmup=1, repeats=10, budget_s=4.0)
    return 2 * size**3 / (min(timing.samples_ms) * 1e-3) / 1e12


def copy_gbps(device: torch.device, megabytes: int) -> float:
    """The best rate of a device-to-device copy: 2 x size bytes moved per copy."""
    numel = megabytes * (1 << 20) // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    timing = time_call(lambda i: dst.copy_(src), device, warmup=2, repeats=10)
    return 2 * numel * 4 / (min(timing.samples_ms) * 1e-3) / 1e9


def measure_peaks(device: torch.device, dtypes: list[torch.dtype], quick: bool = False) -> dict[str, float]:
    """{"matmul_tflops_<dtype>": ..., "copy_gbps": ...}. ``quick`` halves the CPU GEMM (2048: still
    past the caches, a few seconds on 2 cores)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    size = MATMUL_SIZE[kind] // (2 if quick and kind == "cpu" else 1)
    peaks = {f"matmul_tflops_{str(d).removeprefix('torch.')}": matmul_tflops(device, d, size) for d in dtypes}
    peaks["copy_gbps"] = copy_gbps(device, COPY_MIB[kind])
    return peaks


def fraction_of(throughput: float, peak: Optional[float]) -> Optional[float]:
    """throughput / peak, or None ("n/a") when there is no peak or the throughput exceeds it (the
    peak was then not measured at its best, and a fraction above 1 would mean nothing)."""
    if not peak or throughput > peak:
        return None
    return throughput / peak
