"""The on-disk caches: ``auto``'s tuned decisions, the tuned tiles, the table entries' checks and the
tile candidates' proofs.

One JSON file per kind and software environment (``dispatch-<digest>.json``, ``tiles-<digest>.json``,
``checks-<digest>.json``, ``proofs-<digest>.json``), where the digest covers the torch, CUDA runtime, CUDA driver, triton and
vit_kernels versions (a new version measures afresh); inside, one entry per key, which names the
device it was measured on. The folder is ``VIT_KERNELS_CACHE_DIR`` (read once, at import), else
``$XDG_CACHE_HOME/vit_kernels``, else ``~/.cache/vit_kernels``; ``vk.set_autotune(cache_dir=...)``
overrides it, and ``cache_dir=False`` keeps decisions in memory only.

Writes are atomic (a temporary file in the same folder, then ``os.replace``), and merge with what
another process wrote meanwhile. A file that cannot be read or parsed is ignored with one warning:
the cache can only ever save time, never break a run.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from vit_kernels._files import write_atomically

FORMAT = 1


def default_folder() -> Optional[Path]:
    """The cache folder from the environment (called once, at import)."""
    explicit = os.environ.get("VIT_KERNELS_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "vit_kernels"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``, e.g. "13000"), "none" without one."""
    try:
        library = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
        version = ctypes.c_int(0)
        if library.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except (OSError, AttributeError):
        pass
    return "none"


def environment() -> dict[str, str]:
    """The software a decision depends on: versions, and the CUDA driver (a new driver compiles and
    runs the kernels anew: a tile it faults on is proven afresh)."""
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "driver": driver_version(),
        "triton": _version("triton"),
        "vit_kernels": _version("vit-kernels"),
    }


class DiskCache:
    """Entries by key (a string), loaded lazily from one JSON file; ``kind`` names the file and the
    field every entry must have (``FIELDS``)."""

    FIELDS = {"dispatch": "backend", "tiles": "tile", "proofs": "verdict", "checks": "verdict"}

    def __init__(self, folder: Optional[Path], kind: str = "dispatch"):
        self.folder, self.kind = folder, kind
        self._entries: Optional[dict[str, dict]] = None
        self._env = environment()
        digest = hashlib.sha256(json.dumps(self._env, sort_keys=True).encode()).hexdigest()[:16]
        self.path = None if folder is None else folder / f"{kind}-{digest}.json"

    def _read(self) -> dict[str, dict]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if (
                not isinstance(data, dict)
                or data.get("format") != FORMAT
                or not isinstance(data.get("entries"), dict)
            ):
                raise ValueError(f"not a vit_kernels {self.kind} cache of format {FORMAT}")
            field = self.FIELDS[self.kind]
            return {
                k: v for k, v in data["entries"].items() if isinstance(v, dict) and v.get(field) is not None
            }
        except (OSError, ValueError) as error:
            warnings.warn(
                f"vit_kernels: ignoring the unreadable {self.kind} cache {self.path} ({error}); "
                f"auto measures afresh and rewrites it",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}

    def _loaded(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def get(self, key: str) -> Optional[dict]:
        return self._loaded().get(key)

    def items(self) -> list[tuple[str, dict]]:
        return list(self._loaded().items())

    def put(self, key: str, entry: dict) -> None:
        """Store ``entry`` and write the file (merged with the one on disk, atomically)."""
        self.put_all({key: entry})

    def put_all(self, entries: dict[str, dict]) -> None:
        """Store every entry of ``entries`` and write the file once (merged, atomically); nothing to
        write for none."""
        self.hold(entries)
        if self.path is None or not entries:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                merged = {**self._read(), **self._entries}
            payload = json.dumps(
                {"format": FORMAT, "environment": self._env, "entries": merged}, indent=1, sort_keys=True
            )
            write_atomically(str(self.path), payload)
        except OSError as error:
            warnings.warn(
                f"vit_kernels: could not write the {self.kind} cache {self.path} ({error})",
                RuntimeWarning,
                stacklevel=3,
            )

    def in_memory(self) -> dict[str, dict]:
        """The entries loaded or stored by this process so far (the file is not read)."""
        return dict(self._entries or {})

    def hold(self, entries: dict[str, dict]) -> None:
        """Keep ``entries`` in memory (beside the file's, ahead of them), written with the next put."""
        self._loaded().update(entries)

    def clear(self) -> None:
        """Forget the loaded entries (the file is read again on next use)."""
        self._entries = None
