"""Shared fixtures: a per-test seed, the backend restored after each test, device helpers."""

import zlib

import pytest
import torch

import vit_kernels as vk


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seed torch from the test's id: every test is reproducible, and no two share their data."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def restore_backend():
    previous = vk.get_backend()
    yield
    vk.set_backend(previous)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
