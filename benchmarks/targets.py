"""The per-op performance targets of the project's issues, and the measured figures beside them.

Source: the project's performance issues, which set these for ViT-B/16 in bfloat16 on one H100
(per op: B=128, L=197, D=768, 12 heads, MLP 3072), against the first H100 measurements
(``benchmarks/results/h100-2026-11-22.md``). A target is met when some vit_kernels backend (torch,
triton, extension, auto) reaches it. The end-to-end targets are ``benchmarks.headline``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "the project's performance issues (ViT-B/16, bfloat16, one H100)"
VK_BACKENDS = ("torch", "triton", "extension", "auto")


@dataclass(frozen=True)
class Target:
    what: str
    op: str
    mode: str  # forward | full
    batch: int
    bound: float  # median ms, at most


VIT_B = "vit_base_patch16_224"
TARGETS = (
    Target("attention fwd", "attention", "forward", 128, 0.09),
    Target("attention fwd+bwd", "attention", "full", 128, 0.45),
    Target("linear_gelu fwd", "linear_gelu", "forward", 128, 0.21),
    Target("linear_gelu fwd+bwd", "linear_gelu", "full", 128, 0.66),
    Target("mlp fwd+bwd", "mlp", "full", 128, 1.25),
)


def _candidates(target: Target, rows: list[dict]) -> list[dict]:
    return [
        r
        for r in rows
        if "median_ms" in r
        and r.get("mode") == target.mode
        and r.get("dtype") == "bfloat16"
        and r.get("kind") == "op"
        and r["op"] == target.op
        and r["backend"] in VK_BACKENDS
        and r["shape"].startswith(f"{VIT_B} B={target.batch} ")
    ]


def compare(rows: list[dict]) -> list[dict]:
    """Per target: the bound, the best measured figure (and which backend), whether it is met;
    ``measured`` is None where nothing was measured (skipped, failed or out of budget)."""
    out = []
    for target in TARGETS:
        found = _candidates(target, rows)
        best = min(found, key=lambda r: r["median_ms"]) if found else None
        value = None if best is None else best["median_ms"]
        out.append(
            {
                "target": target.what,
                "bound": target.bound,
                "unit": "ms",
                "at": "at most",
                "measured": value,
                "by": None if best is None else best["backend"],
                "met": None if value is None else value <= target.bound,
            }
        )
    return out
