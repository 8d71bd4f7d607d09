"""Where a benchmark ran: device name, library versions and the git commit, stamped on every row."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=10, check=True,
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
