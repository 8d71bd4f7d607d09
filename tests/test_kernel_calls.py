"""``make lint``'s check of the kernels' shape (``tools.kernel_calls``): a call of a ``@triton.jit``
function with more than 8 positional arguments is reported, keywords past the eighth pass; a
``@triton.jit`` function over 100 lines is reported, one of 100 passes."""

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


def _kernel_of(lines: int) -> str:
    """A jit function of ``lines`` lines, decorator excluded."""
    body = "".join(f"    x = x + {i}\n" for i in range(lines - 2))
    return f"import triton\n\n\n@triton.jit\ndef kernel_{lines}(x):\n{body}    return x\n"


def test_a_jit_function_over_100_lines_is_reported(tmp_path):
    (tmp_path / "long.py").write_text(_kernel_of(101))
    (tmp_path / "short.py").write_text(_kernel_of(100))
    found = violations(tmp_path)
    assert len(found) == 1 and "long.py:5: kernel_101 is 101 lines, at most 100" in found[0], found


def test_the_kernels_pass():
    assert violations() == []
