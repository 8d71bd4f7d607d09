"""The simulated device's own checks can fail."""

from __future__ import annotations

from tools.cuda_sim import exceptions_caught, simulated_cuda
from vit_kernels import backend


def test_the_check_after_each_block_sees_the_tune_candidates_that_raised_in_it():
    """``exceptions_caught`` (asserted at the end of every ``sim`` block) reports a candidate that
    raised while ``vk.tune`` searched in the block."""
    with simulated_cuda(90):
        backend.TUNED["attention|signature"] = {
            "backend": "torch",
            "candidates": {"triton": "invalid: raised ValueError: refused"},
        }
        assert exceptions_caught() == [
            "auto, attention|signature, triton: invalid: raised ValueError: refused"
        ]
    assert "attention|signature" not in backend.TUNED  # what the block decided stays there
