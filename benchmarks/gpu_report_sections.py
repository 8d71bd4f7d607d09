"""The sections of ``python -m benchmarks.gpu_report``: each takes the run's context and its time
budget and returns a JSON-able dict. They call the project's own machinery (the selftest's checks,
the per-op cases and timing of ``benchmarks``, ``benchmarks.host_overhead``,
``benchmarks.cuda_graphs``) rather than repeating it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks import block_traffic, cases, cuda_graphs, environment, host_overhead, ops_bench, peaks
from benchmarks.baselines import extra_implementations
from benchmarks.budget import Budget
from tools import gpu_tests
from vit_kernels import selftest
from vit_kernels.ops import attention_tiles, gemm, layer_norm, patch_embed

# Per-op shapes, ViT-B/16 first (the targets are set there): ViT-B/L/S/Ti/16 at batch 128/64/256/256, then
# SigLIP so400m/14 (head dim 72, width 1152, MLP 4304) at 64, EVA02-B/14 (RoPE, SwiGLU), DINOv3-B (half
# RoPE) and a padded NaFlex ViT-B/16 batch (key-padding mask) at 128.
OP_SHAPES = [
    ("vit_base_patch16_224", 128),
    ("vit_large_patch16_224", 64),
    ("vit_small_patch16_224", 256),
    ("vit_tiny_patch16_224", 256),
    ("vit_so400m_patch14_siglip_224", 64),
    ("eva02_base_patch14_224", 128),
    ("vit_base_patch16_dinov3", 128),
    ("naflexvit_base_patch16_gap", 128),
]
OP_MODES = ("forward", "full")
GRAPH_MODEL = "vit_small_patch16_224"
# --quick, for a CPU smoke run of the code paths: the smallest preset.
QUICK_OP_SHAPES = [("vit_digits", 2)]


@dataclass
class Context:
    device: torch.device
    quick: bool = False
    compile: bool = True
    ops: tuple[str, ...] = cases.OPS
    meta: dict = field(default_factory=dict)
    measured_peaks: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


def environment_section(ctx: Context, budget: Budget) -> dict:
    """Device, versions (torch, triton, CUDA, driver), git commit."""
    return environment.versions(ctx.device)


def gpu_tests_section(ctx: Context, budget: Budget) -> dict:
    """On CUDA: ``pytest -m gpu`` (stopped at the budget); else how many tests it would select."""
    if ctx.device.type == "cuda":
        return gpu_tests.run_gpu_tests(timeout_s=budget.left())
    result = gpu_tests.collect_gpu_tests(timeout_s=budget.left())
    result["note"] = "no GPU: the tests were only collected, not run"
    return result


def selftest_section(ctx: Context, budget: Budget) -> dict:
    """``vk.selftest``'s checks: every op, backend and dtype against float64, judged by PyTorch's own
    error."""
    rows = [
        selftest.check_op(op, name, dtype, device)
        for op, name, dtype, device in budget.take(selftest.cases(ctx.ops), lambda c: f"{c[0]} {c[1]} {c[2]}")
    ]
    header = selftest.header()
    header.pop("available_backends")
    failed = [r for r in rows if not r["passed"]]
    return {**header, "passed": len(rows) - len(failed), "failed": len(failed), "checks": rows}


def host_overhead_section(ctx: Context, budget: Budget) -> dict:
    """Host cost per call of every op and backend on tiny tensors, beside the plain PyTorch call."""
    calls, rounds = (30, 3) if ctx.quick else host_overhead.DEFAULT_LOOPS[ctx.device.type]
    rows = host_overhead.measure(ctx.device, ctx.ops, calls, rounds, admit=budget.admit)
    return {"calls": calls, "rounds": rounds, "columns": list(host_overhead.COLUMNS), "rows": rows}


def block_traffic_section(ctx: Context, budget: Budget) -> dict:
    """One ViT-B/16 block's kernels and least bytes, forward and backward, per backend (B=128, bf16;
    counted on meta tensors, so the same on every machine: what the timings of the ops section are
    made of)."""
    return block_traffic.measure(
        "vit_tiny" if ctx.quick else "vit_base", 8 if ctx.quick else 128, torch.bfloat16
    )


def cuda_graphs_section(ctx: Context, budget: Budget) -> dict:
    """A training step of ``GRAPH_MODEL`` captured in a CUDA graph on every backend."""
    if ctx.device.type != "cuda":
        return {"skipped": "needs CUDA"}
    return {"model": GRAPH_MODEL, "rows": cuda_graphs.capture_all(GRAPH_MODEL, ctx.device, budget.admit)}


def ops_section(ctx: Context, budget: Budget) -> dict:
    """Per op at ViT shapes: every vit_kernels backend, plain PyTorch, SDPA's backends, torch.compile
    of the reference, forward and forward + backward, validated before timing."""
    ctx.measured_peaks = peaks.measure_peaks(ctx.device, [ctx.dtype], ctx.quick)
    rows = []
    for model, batch in QUICK_OP_SHAPES if ctx.quick else OP_SHAPES:
        shape = cases.shape_of(model, batch)
        for op in budget.take(ctx.ops, lambda op, shape=shape: f"{op} {shape.label}"):
            case = cases.build_case(op, shape)
            rows += ops_bench.run_case(
                case,
                ctx.device,
                ctx.dtype,
                OP_MODES,
                ctx.measured_peaks,
                ctx.compile,
                interpreted_triton=False,
                meta=ctx.meta,
                extra=extra_implementations(case),
            )
    return {
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "modes": list(OP_MODES),
        "peaks": ctx.measured_peaks,
        "rows": rows,
        "attention_tiles": attention_tiles.tile_report(),
        "layer_norm_tiles": layer_norm.tile_report(),
        "gemm_tiles": gemm.tile_report(),
        "patch_embed_tiles": patch_embed.tile_report(),
    }


# name -> (function, budget in seconds on one H100); the order is the run's order.
SECTIONS = {
    "environment": (environment_section, 10.0),
    "gpu_tests": (gpu_tests_section, 90.0),
    "selftest": (selftest_section, 45.0),
    "host_overhead": (host_overhead_section, 15.0),
    "block_traffic": (block_traffic_section, 5.0),
    "ops": (ops_section, 150.0),
    "cuda_graphs": (cuda_graphs_section, 30.0),  # last: a failed capture must not disturb the timings
}
CPU_SECTIONS = ("environment", "gpu_tests", "selftest", "host_overhead", "block_traffic")
