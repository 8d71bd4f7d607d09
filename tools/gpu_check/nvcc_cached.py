"""python -m tools.gpu_check.nvcc_cached LOG -- nvcc ARGS...: ``make check-cuda``'s compile of one
CUDA source, whose ptxas report (stderr) goes to LOG, read from the compiled folder
(``compile.compiled_folder``, outside the clone) where the same compile ran before.

The key is what decides the report: nvcc's version, torch's (its headers), the arguments with the
include folders' paths left out (they name the checkout), and the text of the source and of every
header under csrc/. A compile that fails is not kept, and leaves no LOG. The object file is written only by a compile
that runs; the gate (``tools.gpu_check.ptxas``) reads the reports alone.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import torch

from tools.gpu_check.compile import compiled_folder
from vit_kernels._files import write_atomically

ROOT = Path(__file__).resolve().parents[2]


def cache_key(command: list[str]) -> str:
    """The digest of everything that decides ``command``'s ptxas report (the module docstring)."""
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(f"{version}\n{torch.__version__}\n".encode())
    for argument in command[1:]:
        digest.update(("-I" if argument.startswith("-I") else argument).encode() + b"\0")
        if argument.endswith(".cu"):
            digest.update(Path(argument).read_bytes())
    for header in sorted((ROOT / "csrc").rglob("*.h")) + sorted((ROOT / "csrc").rglob("*.cuh")):
        digest.update(header.relative_to(ROOT).as_posix().encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:24]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    log, command = Path(argv[0]), argv[2:]
    stored = compiled_folder() / "check-cuda" / f"{cache_key(command)}.ptxas.log"
    if stored.is_file():
        write_atomically(log, stored.read_text(encoding="utf-8"))
        print(f"check-cuda: {log.name} read from {stored.parent}")
        return 0
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:  # no report left at LOG: make compiles again next time, as for a lost .o
        log.unlink(missing_ok=True)
        print(done.stderr, file=sys.stderr)
        return done.returncode
    write_atomically(log, done.stderr)
    write_atomically(stored, done.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
