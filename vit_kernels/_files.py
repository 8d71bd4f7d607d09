"""Files written whole: a kill at any moment leaves the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from typing import Union


def write_atomically(path: Union[str, os.PathLike], text: str) -> None:
    """Write ``text`` to ``path`` (its folder made if missing) through a temporary file beside it,
    flushed to disk, then ``os.replace``: a reader, or a run resumed after a kill, sees the old file
    or the new one, never a part."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
