"""python -m tools.gpu_check.ptxas LOG [LOG ...]: the compile gate for the CUDA sources.

Reads the ``nvcc -Xptxas -v`` output of every csrc/cuda/*.cu file (compiled for sm_80 and sm_90 by
``make check-cuda``), prints registers, spills and static shared memory per kernel and target, and
exits 1 on any spill or shared memory over the target's per-block limit. (Dynamic shared memory is
sized at launch; the kernels that use it check it against the device's limit there.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

from tools.gpu_check.compile import TARGETS

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class KernelUsage:
    source: str
    kernel: str
    target: int
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_bytes: int = 0


def _demangle(names: list[str]) -> dict[str, str]:
    try:
        out = subprocess.run(
            ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
        ).stdout
        return dict(zip(names, (line.split("(")[0] for line in out.splitlines())))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def parse(source: str, text: str) -> list[KernelUsage]:
    """Every kernel of one ptxas -v log."""
    usages: list[KernelUsage] = []
    current = None
    for line in text.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = KernelUsage(source, entry.group(1), int(entry.group(2)))
            usages.append(current)
            continue
        if current is None:
            continue
        spills = _SPILLS.search(line)
        if spills:
            current.spill_stores, current.spill_loads = int(spills.group(2)), int(spills.group(3))
        if "Used" in line and "registers" in line:
            current.registers = int(re.search(r"Used (\d+) registers", line).group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current.shared_bytes = int(smem.group(1)) if smem else 0
    return usages


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    usages = [u for path in paths for u in parse(path, open(path).read())]
    if not usages:
        print("check-cuda: no ptxas -v output found (was nvcc run with -Xptxas -v?)")
        return 1
    names = _demangle(sorted({u.kernel for u in usages}))
    failures = []
    print(
        "| kernel | target | registers | spill stores/loads | static shared bytes |\n|---|---|---:|---:|---:|"
    )
    for u in sorted(usages, key=lambda u: (u.target, names[u.kernel])):
        print(
            f"| `{names[u.kernel]}` | sm_{u.target} | {u.registers} | {u.spill_stores}/{u.spill_loads} | {u.shared_bytes} |"
        )
        where = f"{names[u.kernel]} ({u.source}) sm_{u.target}"
        if u.spill_stores or u.spill_loads:
            failures.append(f"{where}: spills {u.spill_stores} bytes stored, {u.spill_loads} loaded")
        limit = TARGETS.get(u.target, TARGETS[80])["smem_block"]
        if u.shared_bytes > limit:
            failures.append(f"{where}: {u.shared_bytes} bytes of shared memory over the {limit}-byte limit")
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"check-cuda: {len(usages)} kernel builds across {len(paths)} sources, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
