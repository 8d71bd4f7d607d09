"""The package's log: one line per kernel variant compiled, per kernel tile checked or tuned, per
backend decision searched.

Silent by default (``logging``'s ``vit_kernels`` logger, at WARNING); ``vk.set_verbosity("info")``
or ``VIT_KERNELS_LOG=info`` (read at import) shows it on stderr.
"""

from __future__ import annotations

import logging
import os
from typing import Union

LOGGER = logging.getLogger("vit_kernels")
_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter("vit_kernels: %(message)s"))


def set_verbosity(level: Union[str, int]) -> None:
    """Show the package's log from ``level`` on (``"info"``: every check and search; ``"warning"``:
    quiet again), on stderr."""
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"level must be a logging level such as 'info' or 'warning', got {level!r}")
        level = named
    if not isinstance(level, int) or isinstance(level, bool):
        raise TypeError(f"level must be a str or an int, got {type(level).__name__}")
    LOGGER.setLevel(level)
    if _handler not in LOGGER.handlers:
        LOGGER.addHandler(_handler)


if os.environ.get("VIT_KERNELS_LOG", "").strip():
    set_verbosity(os.environ["VIT_KERNELS_LOG"].strip())
