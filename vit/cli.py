"""What the command-line tools of ``vit`` share: one-line errors, defaults in ``--help`` and
intra-op threads that fit the cores this process may use.

An ordinary mistake (a bad option, a missing or damaged file, a data set that does not fit) ends
with one line on stderr, ``<prog>: error: <what and what was expected>``, and exit code 2; ``--debug``
adds the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, NoReturn, Optional, TypeVar

import torch

T = TypeVar("T")


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


class UsageError(ValueError):
    """Options that are each valid but do not fit together, with the data or with the files on disk."""


# Exceptions that describe the user's input or files, never a bug of ours: one line, exit 2.
ORDINARY = (UsageError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def fail(prog: str, message: str, debug: bool = False) -> NoReturn:
    if debug:
        traceback.print_exc()
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run(prog: str, work: Callable[[], T], debug: bool = False) -> T:
    """``work()``, with an ordinary mistake turned into one line on stderr and exit code 2."""
    try:
        return work()
    except ORDINARY as error:
        fail(prog, str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__, debug)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="PyTorch intra-op CPU threads (default: OMP_NUM_THREADS if set, else the cores this process may "
        "use, shared among torchrun's local processes; 1 is fastest for small models on a busy machine)",
    )
