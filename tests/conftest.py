"""Shared fixtures: a per-test seed, the backend restored after each test, dispatch kept
deterministic and off the user's cache, device helpers."""

import os
import tempfile
import zlib

# Measuring is off in the test suite (auto takes its static defaults, so tests know what runs) and
# decisions go to a folder of this run only; subprocesses (CLI tests) inherit both. Tests of the
# measured auto turn it on for themselves (tests/test_dispatch.py).
os.environ["VIT_KERNELS_AUTOTUNE"] = "0"
os.environ["VIT_KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="vit-kernels-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

import vit_kernels as vk  # noqa: E402
from vit_kernels import backend  # noqa: E402


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seed torch from the test's id: every test is reproducible, and no two share their data."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def restore_backend():
    previous = vk.get_backend()
    settings = backend.autotune_settings()
    yield
    vk.set_backend(previous)
    vk.set_autotune(settings["enabled"], margin=settings["margin"])


@pytest.fixture
def use_backend():
    """``use_backend(name)``: run the test body's ops on ``name`` (strictly: a call it cannot take
    raises) and, on leaving, assert through ``vk.explain()`` that ``name`` actually ran.

        def test_x(use_backend):
            with use_backend("triton"):
                vk.layer_norm(...)
    """
    import contextlib

    @contextlib.contextmanager
    def scope(name: str, *, strict: bool = True):
        backend.clear_decisions()
        with vk.use_backend(name, strict=strict):
            yield
        ran = vk.explain().ran()
        assert name in ran, f"asked for {name}, but explain() shows {sorted(ran)} ran:\n{vk.explain()}"

    return scope


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
