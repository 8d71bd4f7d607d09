"""A patch_model'd timm ViT's forward and backward on the simulated CUDA device (tools/cuda_sim.py):
the host code of a GPU user's training step, on sm_90 and sm_80, with auto choosing by the table,
every backend and bf16 autocast, failing on any exception auto or a tile chooser caught."""

import sys
from pathlib import Path

import pytest
import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ lives beside the package, not in it
import vit_kernels as vk  # noqa: E402
from tools.cuda_sim import exceptions_caught, simulated_cuda  # noqa: E402
from vit_kernels import _tiles, backend  # noqa: E402


@pytest.mark.parametrize("backend_name", ["auto", "triton", "torch"])
@pytest.mark.parametrize("arch", [90, 80], ids=lambda arch: f"sm{arch}")
def test_patched_timm_vit_trains_on_the_simulated_gpu(arch, backend_name):
    backend.clear_decisions()
    _tiles.forget()
    try:
        with simulated_cuda(arch) as device:
            model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, depth=2).to(
                "cuda"
            )
            report = vk.patch_model(model)
            assert report.replaced, report
            images = torch.randn(8, 3, 224, 224, device="cuda")
            with vk.use_backend(backend_name), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images).float().logsumexp(-1).mean()
            loss.backward()
            assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())
        if backend_name == "triton":
            assert device.launches
        caught = exceptions_caught()
        assert not caught, caught
    finally:
        backend.clear_decisions()
