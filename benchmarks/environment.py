"""Where a benchmark ran: device name, library versions and the git commit, stamped on every row."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

from vit.cli import set_threads, usable_cores  # noqa: F401 - where the suite reads them


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def describe(device: torch.device) -> dict[str, object]:
    """The fields every result row carries."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "git_sha": git_sha(),
    }


def driver_version() -> str | None:
    """The NVIDIA driver release (e.g. 580.159.04) from nvidia-smi, else the CUDA driver API version
    torch reports, else None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    try:
        version = torch._C._cuda_getDriverVersion()  # e.g. 13000 for CUDA 13.0
    except (AttributeError, RuntimeError):
        return None
    return f"CUDA driver API {version // 1000}.{version % 1000 // 10}" if version else None


def versions(device: torch.device) -> dict[str, object]:
    """``describe``'s fields and more: CUDA, driver, Python, timm, the device's properties."""
    import importlib.metadata as metadata

    import vit_kernels

    try:
        timm = metadata.version("timm")
    except metadata.PackageNotFoundError:
        timm = None
    found = {
        **describe(device),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "vit_kernels": vit_kernels.__version__,
        "timm": timm,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(
            driver=driver_version(),
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    return found
