"""Stand-ins for @triton.jit kernels that the child process of ``vit_kernels._proof`` resolves by
module and name and launches as ``kernel[grid](*args, **kwargs)``: each does what its MODE says,
so a test can make one candidate fault (abort the process), raise or hang."""

from __future__ import annotations

import os
import time


# What a launch passes besides the kernel's parameters: Triton's launcher takes them apart.
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Kernel:
    def __init__(self, function):
        self.fn = function

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            return self.fn(grid, *args, **{k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})

        return run


def fill(grid, out, value, MODE):
    """out[:] = value, or: "abort" kills the process (as a CUDA fault does), "raise", "hang"."""
    if MODE == "abort":
        os.abort()
    if MODE == "raise":
        raise ValueError(f"tile {MODE} refused")
    if MODE == "hang":
        time.sleep(3600)
    out.fill_(value)


def expect_layout(grid, a, b, SHAPE, STRIDE, ALIGNMENT, SHARED, GRID, STORAGE_BYTES):
    """Raises unless the replayed ``a`` has the recorded shape, strides and alignment (its first
    byte's address modulo 16), shares ``b``'s storage as recorded, its storage has STORAGE_BYTES
    and the grid is the recorded one."""
    if a.untyped_storage().nbytes() != STORAGE_BYTES:
        raise AssertionError(f"storage of {a.untyped_storage().nbytes()} bytes")
    alignment = a.data_ptr() % 16
    if (tuple(a.shape), a.stride(), alignment) != (SHAPE, STRIDE, ALIGNMENT):
        raise AssertionError(f"layout {(tuple(a.shape), a.stride(), alignment)}")
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()) != SHARED:
        raise AssertionError("storage sharing differs")
    if tuple(grid) != GRID or not bool((a.abs() < 1e4).all()):
        raise AssertionError(f"grid {grid} or values not small and finite")


fill = _Kernel(fill)
expect_layout = _Kernel(expect_layout)
