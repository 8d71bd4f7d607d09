"""Whether a model's training step (forward + backward, bfloat16 autocast) can be captured in a CUDA
graph on each backend, with ``torch.cuda.CUDAGraph``: captured, replayed, the replayed loss beside an
eager one on the same batch, and the replay time; or the error.

The pattern is PyTorch's whole-network capture: three warm-up steps on a side stream (Triton
autotuning and ``auto``'s first-call measurement happen there, outside the capture), gradients set to
None, then one step captured. A backend that synchronises, allocates from the host or measures during
the capture fails here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

import vit_kernels as vk
from benchmarks.timing import time_call
from vit.model import ViT, get_config

BACKENDS = ("torch", "triton", "extension", "auto")


def _step(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, name: str
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with vk.use_backend(name), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        return loss.detach()

    return step


def capture(model_name: str, name: str, device: torch.device, batch: int = 32) -> dict[str, object]:
    """One backend: {"backend", "captured": bool, "error" | ("replay_ms", "loss", "eager_loss")}."""
    torch.manual_seed(0)
    config = get_config(model_name)
    model = ViT(config).to(device).train()
    images = torch.randn(batch, config.in_chans, config.img_size, config.img_size, device=device)
    labels = torch.randint(0, config.num_classes, (batch,), device=device)
    step = _step(model, images, labels, name)
    row: dict[str, object] = {"model": model_name, "batch": batch, "backend": name}
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                eager_loss = step()
        torch.cuda.current_stream(device).wait_stream(side)
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
    except Exception as error:  # the point is the error, reported per backend
        return {**row, "captured": False, "error": f"{type(error).__name__}: {error}".splitlines()[0][:500]}
    try:
        graph.replay()
        torch.cuda.synchronize(device)
        timing = time_call(lambda i: graph.replay(), device)
    except Exception as error:
        return {
            **row,
            "captured": True,
            "replayed": False,
            "error": f"{type(error).__name__}: {error}".splitlines()[0][:500],
        }
    return {
        **row,
        "captured": True,
        "replayed": True,
        "replay_ms": timing.median_ms,
        "loss": loss.item(),
        "eager_loss": eager_loss.item(),
    }


def capture_all(
    model_name: str, device: torch.device, admit: Callable[[str], bool] = lambda label: True, batch: int = 32
) -> list[dict[str, object]]:
    """``capture`` on every backend admitted by ``admit`` (a time budget)."""
    if device.type != "cuda":
        return []
    return [capture(model_name, name, device, batch) for name in BACKENDS if admit(f"{model_name} {name}")]
