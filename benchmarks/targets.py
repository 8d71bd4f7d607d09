"""The performance targets of the project's issues, and the measured figures beside them.

Source: the project's performance issues, which set these for ViT-B/16 in bfloat16 on one H100
(per op: B=128, L=197, D=768, 12 heads, MLP 3072; training: B=128, bf16 autocast, fused AdamW;
inference: B=256), against the first H100 measurements (``benchmarks/results/h100-2026-11-22.md``).
Op targets are met when some vit_kernels backend (torch, triton, extension, auto) reaches them;
model targets when some variant of this project's model (eager, or compiled) does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SOURCE = "the project's performance issues (ViT-B/16, bfloat16, one H100)"
VK_BACKENDS = ("torch", "triton", "extension", "auto")


@dataclass(frozen=True)
class Target:
    what: str
    kind: str  # "op" (median ms, at most) or "model" (images/s, at least)
    name: str  # the op, or the model preset
    mode: str  # op: forward | full; model: train | inference
    batch: int
    bound: float
    compiled: bool = False  # model targets: the torch.compile variants, else the eager ones


VIT_B = "vit_base_patch16_224"
TARGETS = (
    Target("attention fwd", "op", "attention", "forward", 128, 0.09),
    Target("attention fwd+bwd", "op", "attention", "full", 128, 0.45),
    Target("linear_gelu fwd", "op", "linear_gelu", "forward", 128, 0.21),
    Target("linear_gelu fwd+bwd", "op", "linear_gelu", "full", 128, 0.66),
    Target("mlp fwd+bwd", "op", "mlp", "full", 128, 1.25),
    Target("training ViT-B/16 eager", "model", VIT_B, "train", 128, 3400),
    Target("training ViT-B/16 compiled", "model", VIT_B, "train", 128, 3650, compiled=True),
    Target("inference ViT-B/16 eager", "model", VIT_B, "inference", 256, 11000),
    Target("inference ViT-B/16 compiled", "model", VIT_B, "inference", 256, 12000, compiled=True),
)


def _candidates(target: Target, rows: list[dict]) -> list[dict]:
    timed = [
        r for r in rows if "median_ms" in r and r.get("mode") == target.mode and r.get("dtype") == "bfloat16"
    ]
    if target.kind == "op":
        return [
            r
            for r in timed
            if r.get("kind") == "op"
            and r["op"] == target.name
            and r["backend"] in VK_BACKENDS
            and r["shape"].startswith(f"{VIT_B} B={target.batch} ")
        ]
    return [
        r
        for r in timed
        if r.get("kind") == "model"
        and r["model"] == target.name
        and r["shape"] == f"B={target.batch}"
        and "timm" not in r["backend"]
        and ("torch.compile" in r["backend"]) == target.compiled
    ]


def compare(rows: list[dict]) -> list[dict]:
    """Per target: the bound, the best measured figure (and which backend or variant), whether it
    is met; ``measured`` is None where nothing was measured (skipped, failed or out of budget)."""
    out = []
    for target in TARGETS:
        found = _candidates(target, rows)
        lower_is_better = target.kind == "op"
        best: Optional[dict] = None
        if found:
            best = (min if lower_is_better else max)(
                found, key=lambda r: r["median_ms" if lower_is_better else "throughput"]
            )
        value = None if best is None else best["median_ms" if lower_is_better else "throughput"]
        out.append(
            {
                "target": target.what,
                "bound": target.bound,
                "unit": "ms" if lower_is_better else "img/s",
                "at": "at most" if lower_is_better else "at least",
                "measured": value,
                "by": None if best is None else best["backend"],
                "met": None
                if value is None
                else (value <= target.bound if lower_is_better else value >= target.bound),
            }
        )
    return out
