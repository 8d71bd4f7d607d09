"""What every command line of the project shares (``vit.train``/``predict``/``plots``,
``python -m benchmarks``, the selftest): a mistake in the options as one line and exit code 2, every
default in ``--help``, and intra-op threads that fit the cores this process may use."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn, Optional

import torch


class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """The description as written (it holds example commands), and every option's default, unless
    its help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS, False)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class OneLineErrors(argparse.ArgumentParser):
    """Errors as one line (``prog: error: ...``, exit code 2), without the usage block."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under taskset or a container's
    cpuset), else all of them: more intra-op threads than that only queue behind each other."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """``OMP_NUM_THREADS`` where it is set (by the user, or by torchrun for each process), else the
    usable cores shared among the processes torchrun started on this machine (``LOCAL_WORLD_SIZE``)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return max(1, usable_cores() // (int(local) if local.isdigit() and int(local) > 0 else 1))


def set_threads(count: Optional[int] = None) -> int:
    """Set PyTorch's intra-op threads to ``count`` (None: ``default_threads()``); returns the count."""
    count = count or default_threads()
    torch.set_num_threads(count)
    return count
