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


def versions(device: torch.device) -> dict[str, object]:
    """``describe``'s fields and more: CUDA, the OS, Python, timm and, on a GPU, the driver
    (``torch.utils.collect_env``'s reading) and the device's properties."""
    import importlib.metadata as metadata

    from torch.utils import collect_env

    import vit_kernels

    try:
        timm = metadata.version("timm")
    except metadata.PackageNotFoundError:
        timm = None
    found = {
        **describe(device),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "os": collect_env.get_os(collect_env.run),
        "vit_kernels": vit_kernels.__version__,
        "timm": timm,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(
            driver=collect_env.get_nvidia_driver_version(collect_env.run),
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    return found
