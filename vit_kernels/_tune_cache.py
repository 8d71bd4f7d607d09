"""The one on-disk cache: ``auto``'s tuned decisions, the tuned tiles, the table entries' checks and
the tile candidates' proofs.

One JSON file per software environment (``tuning-<digest>.json``), where the digest covers the
torch, CUDA runtime, CUDA driver, triton and vit_kernels versions (a new version measures afresh);
inside, one section per kind (``Store.FIELDS``) and one entry per key, which names the device it
was measured on. The folder is ``VIT_KERNELS_CACHE_DIR`` (read once, at import), else
``$XDG_CACHE_HOME/vit_kernels``, else ``~/.cache/vit_kernels``; ``vk.set_autotune(cache_dir=...)``
moves it (``set_folder``), and ``cache_dir=False`` keeps everything in memory only.

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

FORMAT = 2


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


class Store:
    """Entries by kind and key (a string), loaded lazily from one JSON file. Every entry of a kind
    has that kind's field (``FIELDS``)."""

    FIELDS = {"dispatch": "backend", "tiles": "tile", "checks": "verdict", "proofs": "verdict"}

    def __init__(self, folder: Optional[Path]):
        self.folder = folder
        self._sections: Optional[dict[str, dict[str, dict]]] = None
        self._env = environment()
        digest = hashlib.sha256(json.dumps(self._env, sort_keys=True).encode()).hexdigest()[:16]
        self.path = None if folder is None else folder / f"tuning-{digest}.json"

    def _read(self) -> dict[str, dict[str, dict]]:
        empty = {kind: {} for kind in self.FIELDS}
        if self.path is None or not self.path.exists():
            return empty
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a vit_kernels cache of format {FORMAT}")
            for kind, field in self.FIELDS.items():
                section = data.get(kind)
                if not isinstance(section, dict):
                    raise ValueError(f"its {kind!r} section is not a mapping")
                empty[kind] = {
                    k: v for k, v in section.items() if isinstance(v, dict) and v.get(field) is not None
                }
            return empty
        except (OSError, ValueError) as error:
            warnings.warn(
                f"vit_kernels: ignoring the unreadable cache {self.path} ({error}); what it held is "
                f"measured afresh and written again",
                RuntimeWarning,
                stacklevel=4,
            )
            return {kind: {} for kind in self.FIELDS}

    def _section(self, kind: str) -> dict[str, dict]:
        if self._sections is None:
            self._sections = self._read()
        return self._sections[kind]

    def get(self, kind: str, key: str) -> Optional[dict]:
        return self._section(kind).get(key)

    def items(self, kind: str) -> list[tuple[str, dict]]:
        return list(self._section(kind).items())

    def put(self, kind: str, key: str, entry: dict) -> None:
        """Store ``entry`` and write the file (merged with the one on disk, atomically)."""
        self.put_all(kind, {key: entry})

    def put_all(self, kind: str, entries: dict[str, dict]) -> None:
        """Store every entry of ``entries`` and write the file once (merged, atomically); nothing to
        write for none."""
        self.hold(kind, entries)
        if self.path is None or not entries:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                on_disk = self._read()
            merged = {name: {**on_disk[name], **self._sections[name]} for name in self.FIELDS}
            payload = json.dumps(
                {"format": FORMAT, "environment": self._env, **merged}, indent=1, sort_keys=True
            )
            write_atomically(str(self.path), payload)
        except OSError as error:
            warnings.warn(
                f"vit_kernels: could not write the cache {self.path} ({error})", RuntimeWarning, stacklevel=4
            )

    def in_memory(self, kind: str) -> dict[str, dict]:
        """The entries of ``kind`` loaded or stored by this process so far (the file is not read)."""
        return dict((self._sections or {}).get(kind, {}))

    def hold(self, kind: str, entries: dict[str, dict]) -> None:
        """Keep ``entries`` in memory (beside the file's, ahead of them), written with the next put."""
        self._section(kind).update(entries)

    def clear(self) -> None:
        """Forget every loaded entry (the file is read again on next use)."""
        self._sections = None


_store = Store(default_folder())


def store() -> Store:
    """The cache in use (every reader asks here, so that moving the folder moves every kind)."""
    return _store


def set_folder(folder: Optional[Path]) -> None:
    """Keep the cache in ``folder`` from now on (None: in memory only); what this process decided
    stays decided there."""
    global _store
    known = {kind: _store.in_memory(kind) for kind in Store.FIELDS}
    _store = Store(folder)
    for kind, entries in known.items():
        if entries:
            _store.hold(kind, entries)
