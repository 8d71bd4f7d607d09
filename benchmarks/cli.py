"""What the command lines of ``python -m benchmarks`` share: one-line errors, defaults in ``--help``,
and checks of devices and output paths made before any work starts.

An ordinary mistake (a bad option value, a missing or unreadable results file, an unknown op) ends
with one line on stderr, ``<prog>: error: <what, and what was expected>``, and exit code 2. The
modules signal one by raising ``SystemExit`` with a one-line message (so that a caller of their
``main`` in Python sees the message too); ``run`` turns it into that line. A message of several lines
is a failure that carries its log (a benchmark process that died), printed whole with exit code 1.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from vit.cli import DefaultsHelp, OneLineErrors, positive_int  # noqa: F401 - the suite's options use it

EXIT_USAGE, EXIT_FAILURE = 2, 1


Help, Parser = DefaultsHelp, OneLineErrors


def one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).strip().splitlines() if part.strip())


def run(prog: str, main: Callable[[], int]) -> int:
    """``main()``'s exit code; an ordinary mistake as one line on stderr and exit code 2."""
    try:
        return main()
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        if "\n" in stop.code.strip():
            print(f"{prog}: {stop.code.strip()}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        print(f"{prog}: error: {stop.code.strip()}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``: cpu, cuda or cuda:N (``device_name``); None by default, which ``check_device``
    takes for cuda when available."""
    parser.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available)",
    )


def check_device(option: str, text: Optional[str]):
    """The torch device ``text`` names (None: cuda when available, else cpu), or a one-line
    SystemExit naming ``option`` when this machine has no such device."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{option} {text}: no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"{option} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _first_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(option: str, path: Optional[Path], folder: bool = False) -> None:
    """A one-line SystemExit naming ``option`` when ``path`` (a file, or a folder with ``folder``)
    cannot be written: so that a mistake in where to write is found before the run, not after it."""
    if path is None:
        return
    path = Path(path)
    if path.exists():
        if folder and not path.is_dir():
            raise SystemExit(f"{option} {path}: exists and is not a folder")
        if not folder and path.is_dir():
            raise SystemExit(f"{option} {path}: is a folder, expected a file name")
        target = path if folder else path.parent
    else:
        target = _first_existing(path.parent)
        if not target.is_dir():
            raise SystemExit(f"{option} {path}: {target} is a file, not a folder")
    if not os.access(target, os.W_OK | os.X_OK):
        raise SystemExit(f"{option} {path}: {target} is not writable")
