"""The simulated CUDA device's fixtures: every test runs on an sm_90 (H100) and an sm_80 (A100)
device, with the tables deciding (as a user's first call does; the tests of ``vk.tune`` search), and
fails on any exception that the runtime caught: a candidate ``vk.tune`` excluded because it raised."""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # launchers must take their GPU paths

import pytest  # noqa: E402

import vit_kernels as vk  # noqa: E402
from tools.cuda_sim import exceptions_caught, simulated_cuda  # noqa: E402
from vit_kernels import _tiles, backend  # noqa: E402

ARCHS = (90, 80)
LAUNCHES: dict[int, list] = {arch: [] for arch in ARCHS}  # every launch of the session, per architecture


@pytest.fixture(params=ARCHS, ids=lambda arch: f"sm{arch}")
def sim(request):
    """A fresh simulated device of the parametrised architecture, deciding from scratch."""
    backend.clear_decisions()
    _tiles.forget()
    with simulated_cuda(request.param) as recorder:
        yield recorder
        caught = exceptions_caught()
    LAUNCHES[request.param].extend(recorder.launches)
    vk.set_backend("auto")
    assert not caught, "exceptions caught on the simulated CUDA device:\n" + "\n".join(caught)


def pytest_collection_modifyitems(items):
    """The compile test reads what every other test recorded: it runs last."""
    items.sort(key=lambda item: item.module.__name__.endswith("test_recorded_launches"))
