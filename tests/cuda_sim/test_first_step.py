"""A user's first step costs a compile, nothing more: a ViT-B/16 bfloat16-autocast training step on
the simulated sm_90 device, under ``auto`` and under ``triton``, reads no timer, starts no child
process, writes no file of ours, and launches exactly what the same step launches warm (the same
kernels, the same count, no variant the warm step does not use); so does a ragged batch's first
step, and a first evaluation pass."""

from __future__ import annotations

import subprocess
from unittest import mock

import pytest
import torch

import vit
import vit_kernels as vk
from tools.cuda_sim import simulated_cuda
from tools.gpu_check.compile import bind, expand
from vit_kernels import _files, _tiles, backend, tuning


def _variants(launches) -> set:
    """The kernel variants ``launches`` compile: each kernel's constexprs, argument types, warps and
    stages (what Triton specialises a compile on, as the compile gate keys it)."""
    kinds = set()
    for launch in {(id(l.kernel), repr(sorted(l.kwargs.items(), key=str))): l for l in launches}.values():
        for variant in expand(launch):
            bound = bind(variant, 90)
            kinds.add(
                (
                    variant.name,
                    repr(sorted(bound.constexprs.items(), key=str)),
                    repr(sorted(bound.signature.items())),
                    variant.kwargs.get("num_warps"),
                    variant.kwargs.get("num_stages"),
                )
            )
    return kinds


@pytest.mark.parametrize("choice", ["auto", "triton"])
def test_a_first_step_launches_what_a_warm_step_launches_and_nothing_else(choice, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a first step timed, searched, wrote a file or started a process")

    backend.clear_decisions()
    _tiles.forget()
    for module, name in (
        (tuning, "time_runs"),
        (tuning, "search_backends"),
        (_files, "write_atomically"),
        (subprocess, "Popen"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    with (
        simulated_cuda(90) as device,
        mock.patch.object(torch.cuda, "Event", forbidden),  # a timer on the device
        mock.patch.object(torch.cuda, "synchronize", forbidden),
    ):
        model = vit.create_model("vit_base_patch16_224").to("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        def step(batch: int, train: bool = True) -> list:
            start = len(device.launches)
            images = torch.randn(batch, 3, 224, 224, device="cuda")
            with vk.use_backend(choice), torch.autocast("cuda", dtype=torch.bfloat16):
                if train:
                    loss = torch.nn.functional.cross_entropy(
                        model(images), torch.randint(0, 1000, (batch,), device="cuda")
                    )
                else:
                    with torch.no_grad():
                        model(images)
            if train:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            return device.launches[start:]

        for batch, train in ((8, True), (5, True), (16, False)):
            first, warm = step(batch, train), step(batch, train)
            assert warm, (choice, batch, train)
            names = [launch.kernel.fn.__name__ for launch in first]
            assert names == [launch.kernel.fn.__name__ for launch in warm], (choice, batch, train)
            assert _variants(first) == _variants(warm), (choice, batch, train)
    ran = {(r.op, r.backend, r.source) for r in vk.explain()}
    if choice == "auto":  # the table's sm_90 entries: Triton's attention and patch embedding
        assert {("attention", "triton", "table"), ("patch_embed", "triton", "table")} <= ran, ran
    assert vk.explain().tiles == []  # every tile the table's: none tuned, none loaded
