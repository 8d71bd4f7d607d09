"""The device's measured peaks, in the same run as the benchmarks they scale: the matmul rate
(TFLOP/s, per dtype) and the copy bandwidth (GB/s, bytes read + written per second)."""

from __future__ import annotations

import torch

from benchmarks.timing import time_call


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The rate of a large square GEMM (size^3), the practical peak for GEMM-like work."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = time_call(lambda i: a @ b, device, warmup=2, repeats=10)
    return 2 * size**3 / (timing.median_ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, megabytes: int) -> float:
    """The rate of a large device-to-device copy: 2 x size bytes moved per copy."""
    numel = megabytes * (1 << 20) // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    timing = time_call(lambda i: dst.copy_(src), device, warmup=2, repeats=10)
    return 2 * numel * 4 / (timing.median_ms * 1e-3) / 1e9


def measure_peaks(device: torch.device, dtypes: list[torch.dtype], quick: bool) -> dict[str, float]:
    """{"matmul_tflops_<dtype>": ..., "copy_gbps": ...}."""
    size = 2048 if device.type == "cpu" else (4096 if quick else 8192)
    peaks = {f"matmul_tflops_{str(d).removeprefix('torch.')}": matmul_tflops(device, d, size) for d in dtypes}
    peaks["copy_gbps"] = copy_gbps(device, 64 if quick or device.type == "cpu" else 1024)
    return peaks
