"""The simulated CUDA device's fixtures: every test runs on an sm_90 (H100) and an sm_80 (A100)
device, with the tables deciding and each kernel's tile checked (as a user's first call does; the
tests of ``vk.tune`` search), and fails on any exception that the runtime caught: a tile entry or a
candidate excluded because it raised, or the warning ``auto`` gives when it drops an
implementation."""

from __future__ import annotations

import os
import tempfile
import warnings

os.environ["VIT_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="vit-kernels-cuda-sim-cache-")
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
    _tiles.TileChooser.forget_all()
    vk.set_autotune(False, cache_dir=False)
    with warnings.catch_warnings():
        # auto's warning that it dropped an implementation (declared fallbacks only warn)
        warnings.filterwarnings(
            "error", message="vit_kernels: the .* failed validation", category=RuntimeWarning
        )
        with simulated_cuda(request.param) as recorder:
            yield recorder
    LAUNCHES[request.param].extend(recorder.launches)
    caught = exceptions_caught(recorder)
    vk.set_backend("auto")
    assert not caught, "exceptions caught on the simulated CUDA device:\n" + "\n".join(caught)


def pytest_collection_modifyitems(items):
    """The compile test reads what every other test recorded: it runs last."""
    items.sort(key=lambda item: item.module.__name__.endswith("test_recorded_launches"))
