"""``make lint``'s check of the kernels' calls (``tools.kernel_calls``): a call of a ``@triton.jit``
function with more than 8 positional arguments is reported; keywords past the eighth pass."""

from tools.kernel_calls import violations

KERNEL = """
import triton


@triton.jit
def helper(a, b, c, d, e, f, g, h, i):
    return a


@triton.jit
def kernel(x):
    helper(x, x, x, x, x, x, x, x, i=x)
    helper(x, x, x, x, x, x, x, x, x)
    len([x, x, x, x, x, x, x, x, x])
"""


def test_a_call_with_nine_positional_arguments_is_reported(tmp_path):
    (tmp_path / "kernel.py").write_text(KERNEL)
    found = violations(tmp_path)
    assert len(found) == 1 and ":13: helper(...) passes 9 arguments by position" in found[0], found


def test_the_kernels_pass():
    assert violations() == []
