"""End-to-end benchmarks: images/second for a training step (forward, loss, backward, AdamW step)
and for inference, and peak memory on CUDA, for a ViT preset in several variants measured side by
side: our model on ``auto``, the same model on the ``torch`` backend (eager), ``torch.compile`` of
that (or our model on any backends asked for, eager and compiled), and timm's model of the same name
(eager and compiled) when timm is installed. Training uses AdamW (fused on CUDA).

Model FLOPs utilisation: the model's matmul FLOPs (forward; training = 3x forward) per second, as a
fraction of the matmul peak measured in the same run ("n/a" where the model beats that peak).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import vit_kernels as vk
from benchmarks.ops_bench import add_speedups
from benchmarks.peaks import fraction_of
from benchmarks.timing import time_call
from vit.model import ViT, get_config

TIMM_NAMES = {
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
    "vit_large_patch16_224",
    "vit_base_patch16_siglip_224",
    "vit_so400m_patch14_siglip_224",
}


def forward_flops(model: str, batch: int) -> float:
    """Matmul FLOPs of one forward pass: patch projection, per block qkv, attention (q k^T and P v),
    projection and MLP, attention pooling (SigLIP's MAP head: k and v of every token, one query's
    attention, its q, projection and MLP), and the head."""
    c = get_config(model)
    patches = (c.img_size // c.patch_size) ** 2
    tokens = patches + int(c.class_token)
    hidden = c.mlp_hidden_dim or int(c.embed_dim * c.mlp_ratio)
    d = c.embed_dim
    block = 2 * tokens * (3 * d * d + d * d + 2 * d * hidden) + 4 * tokens * tokens * d
    pool = (
        2 * tokens * 2 * d * d + 4 * tokens * d + 2 * (2 * d * d + 2 * d * hidden)
        if c.global_pool == "map"
        else 0
    )
    return batch * (
        2 * patches * d * c.in_chans * c.patch_size**2 + c.depth * block + pool + 2 * d * c.num_classes
    )


def _timm_model(model: str) -> Optional[torch.nn.Module]:
    try:
        import timm
    except ImportError:
        return None
    if model not in TIMM_NAMES:
        return None
    return timm.create_model(model, pretrained=False)  # random weights: no download


def variant_name(backend: str, compiled: bool) -> str:
    """The row name of our model on ``backend``, eager or under ``torch.compile``."""
    if compiled:
        return f"torch.compile ({backend} backend)"
    return "eager (torch backend)" if backend == "torch" else f"vit_kernels ({backend})"


def variants(
    model: str,
    device: torch.device,
    compile_models: bool,
    backends: Sequence[str] = ("auto", "torch"),
    compiled_backends: Sequence[str] = ("torch",),
) -> dict[str, tuple[torch.nn.Module, str, bool] | str]:
    """name -> (module, backend to run it under, compiled?) or the reason the variant is absent: our
    model eager on each of ``backends``, timm's, then the compiled ones (ours on each of
    ``compiled_backends``, timm's), so that a time budget spent early cuts the compiles first."""
    ours = ViT(get_config(model)).to(device)
    found: dict[str, tuple[torch.nn.Module, str, bool] | str] = {
        variant_name(b, False): (ours, b, False) for b in backends
    }
    timm_model = _timm_model(model)
    if timm_model is None:
        reason = "timm is not installed" if model in TIMM_NAMES else "timm has no model of this name"
        found["timm"] = reason
        if compile_models:
            found["timm + torch.compile"] = reason
    else:
        timm_model = timm_model.to(device)
        found["timm"] = (timm_model, "torch", False)
    if compile_models:
        found.update({variant_name(b, True): (ours, b, True) for b in compiled_backends})
        if timm_model is not None:
            found["timm + torch.compile"] = (timm_model, "torch", True)
    return found


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _step(
    module: torch.nn.Module,
    backend: str,
    compiled: bool,
    device: torch.device,
    dtype: torch.dtype,
    mode: str,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    compile_mode: Optional[str] = None,
) -> Callable[[int], object]:
    fn = torch.compile(module, mode=compile_mode) if compiled else module
    if mode == "inference":
        module.eval()

        def infer(i):
            with vk.use_backend(backend), torch.inference_mode(), _autocast(device, dtype):
                return fn(batches[i][0])

        return infer
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=device.type == "cuda")

    def train(i):
        images, labels = batches[i]
        with vk.use_backend(backend):
            with _autocast(device, dtype):
                loss = F.cross_entropy(fn(images), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train


def run_model(
    model: str,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    peaks: dict[str, float],
    compile_models: bool,
    meta: dict[str, object],
    *,
    batches: Optional[dict[str, int]] = None,
    backends: Sequence[str] = ("auto", "torch"),
    compiled_backends: Sequence[str] = ("torch",),
    admit: Callable[[str], bool] = lambda label: True,
) -> list[dict[str, object]]:
    """Rows for every variant x {train, inference} of one preset at one batch size; ``batches``
    ({mode: batch}) sets the modes and a batch size per mode instead. A variant x mode that
    ``admit`` (a time budget) refuses is left out."""
    config = get_config(model)
    dtype_name = str(dtype).removeprefix("torch.")
    peak = peaks.get(f"matmul_tflops_{dtype_name}")
    rows = []
    for name, found in variants(model, device, compile_models, backends, compiled_backends).items():
        for mode, size in (batches or {"train": batch, "inference": batch}).items():
            base = {
                "kind": "model",
                "model": model,
                "shape": f"B={size}",
                "dtype": dtype_name,
                "backend": name,
                **meta,
            }
            if isinstance(found, str):
                rows.append({**base, "mode": mode, "skipped": found})
                continue
            if not admit(f"{model} B={size} {mode} {name}"):
                continue
            rows.append(_timed_row(base, mode, found, device, dtype, peak, _inputs(config, size, device)))
    add_speedups(rows, ("model", "shape", "dtype", "mode"))
    return rows


def _inputs(config, batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two random batches of images and labels (timed runs alternate between them)."""
    return [
        (
            torch.randn(batch, config.in_chans, config.img_size, config.img_size, device=device),
            torch.randint(0, config.num_classes, (batch,), device=device),
        )
        for _ in range(2)
    ]


def _first_call_s(step: Callable[[int], object], device: torch.device) -> float:
    """Seconds of the first call, to its end on the device: what a user waits before the first step
    (compiling, and choosing and proving tiles for every new shape, once per machine)."""
    started = time.perf_counter()
    step(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _timed_row(
    base: dict[str, object],
    mode: str,
    found: tuple[torch.nn.Module, str, bool],
    device: torch.device,
    dtype: torch.dtype,
    peak: Optional[float],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, object]:
    """One variant in one mode: images/s, model TFLOP/s and peak memory, or why it failed."""
    module, backend_name, compiled = found
    batch = batches[0][0].shape[0]
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step = _step(module, backend_name, compiled, device, dtype, mode, batches)
        first_step_s = _first_call_s(step, device)
        timing = time_call(step, device, 2, warmup=2, repeats=10, budget_s=5.0)
    except Exception as error:  # reported, not fatal: e.g. a compile failure
        return {**base, "mode": mode, "invalid": f"{type(error).__name__}: {error}".splitlines()[0]}
    flops = forward_flops(base["model"], batch) * (3 if mode == "train" else 1)
    tflops = flops / (timing.median_ms * 1e-3) / 1e12
    return {
        **base,
        "mode": mode,
        "median_ms": timing.median_ms,
        "q20_ms": timing.q20_ms,
        "q80_ms": timing.q80_ms,
        "samples_ms": list(timing.samples_ms),
        "first_step_s": first_step_s,
        "throughput": batch / (timing.median_ms * 1e-3),
        "unit": "images/s",
        "model_tflops": tflops,
        "fraction_of_peak": fraction_of(tflops, peak),
        "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }
