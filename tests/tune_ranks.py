"""One rank of tests/test_dispatch.py's two-rank run (torchrun, gloo, CPU): ``vk.tune`` a small ViT,
take a training step, then write what each op signature ran, where its decision came from, and how
many candidates this rank timed, to ``<folder>/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import vit
import vit_kernels as vk
from vit_kernels import tuning


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timed = []
    time_runs = tuning.time_runs
    tuning.time_runs = lambda runs: timed.extend(runs) or time_runs(runs)
    torch.manual_seed(rank)  # ranks hold different data, as in training
    model = vit.create_model("vit_digits")
    images = torch.randn(8, 1, 8, 8)
    vk.tune(model, (images,))
    model(images).sum().backward()  # a training step after tuning
    runs = {f"{r.op} {r.shapes} grad={r.grad}": r.backend for r in vk.explain() if r.calls}
    sources = sorted({r.source for r in vk.explain()})
    (folder / f"rank{rank}.json").write_text(
        json.dumps({"runs": runs, "sources": sources, "timed": len(timed)})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
