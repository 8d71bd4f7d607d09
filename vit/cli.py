"""What the command-line tools of ``vit`` share: one-line errors, defaults in ``--help`` and
intra-op threads that fit the cores this process may use.

An ordinary mistake (a bad option, a missing or damaged file, a data set that does not fit) ends
with one line on stderr, ``<prog>: error: <what and what was expected>``, and exit code 2; ``--debug``
adds the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, NoReturn, TypeVar

from vit_kernels._cli import OneLineErrors, positive_int, set_threads  # noqa: F401 - re-exported for the CLIs

T = TypeVar("T")


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
