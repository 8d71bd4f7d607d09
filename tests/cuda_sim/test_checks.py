"""The simulated device's own checks can fail."""

from __future__ import annotations

from tools.cuda_sim import exceptions_caught, simulated_cuda
from vit_kernels._tune_cache import store


def test_the_check_after_each_block_sees_the_auto_candidates_that_raised_in_it():
    """``exceptions_caught`` (asserted after every ``sim`` block) reports an auto candidate that
    raised inside the block after the block has ended, read from the block's own decisions."""
    with simulated_cuda(90) as recorder:
        entry = {"backend": "torch", "candidates": {"triton": "invalid: raised ValueError: refused"}}
        store().put("dispatch", "attention|signature", entry)
    assert exceptions_caught(recorder) == [
        "auto, attention|signature, triton: invalid: raised ValueError: refused"
    ]
