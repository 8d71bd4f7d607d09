"""``torch.library.opcheck`` on every Triton op that autograd sees (schema, autograd registration),
under the interpreter; fake-tensor and AOT checks trace the kernels, which needs a GPU (see
test_attention.py::test_opcheck_full_on_cuda)."""

import pytest
import torch

from tests.helpers import CPU_BACKENDS

pytestmark = pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
UTILS = ("test_schema", "test_autograd_registration")


def _grad(*shape):
    return torch.randn(*shape, requires_grad=True)


def cases():
    ops = torch.ops.vit_kernels
    x = _grad(2, 5, 12)
    return {
        "layer_norm_fwd": (lambda: ops.layer_norm_fwd, (x, _grad(12), _grad(12), 1e-5, _grad(2, 5, 12))),
        "linear_fwd": (lambda: ops.linear_fwd, (x, _grad(8, 12), _grad(8), _grad(2, 5, 8), "none")),
        "linear_fwd_gelu": (lambda: ops.linear_fwd, (x, _grad(8, 12), _grad(8), None, "gelu_tanh")),
        "mlp_fwd": (lambda: ops.mlp_fwd, (x, _grad(16, 12), _grad(16), _grad(12, 16), _grad(12), _grad(2, 5, 12), "gelu")),
        "patch_embed_fwd": (lambda: ops.patch_embed_fwd,
                            (_grad(2, 3, 8, 8), _grad(12, 3, 4, 4), _grad(12), _grad(1, 1, 12), _grad(1, 5, 12), 4)),
    }


@pytest.mark.parametrize("name", sorted(cases()))
def test_triton_op_passes_opcheck(name):
    op, args = cases()[name]
    torch.library.opcheck(op(), args, test_utils=UTILS)
