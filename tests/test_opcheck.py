"""``torch.library.opcheck`` on every Triton op that autograd sees: schema and autograd registration
under the interpreter; on CUDA (``gpu`` cases) every check, fake tensors and AOT dispatch included,
which trace the kernels (attention's: test_attention.py::test_opcheck_full_on_cuda)."""

import pytest
import torch

from tests.helpers import CPU_BACKENDS, CUDA, device_reason, requires_cuda

UTILS = ("test_schema", "test_autograd_registration")


def cases(device: str = "cpu"):
    ops = torch.ops.vit_kernels

    def _grad(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    def _plain(*shape):
        return torch.randn(*shape, device=device)

    x = _grad(2, 5, 12)
    return {
        "layer_norm_fwd": (lambda: ops.layer_norm_fwd, (x, _grad(12), _grad(12), 1e-5, _grad(2, 5, 12))),
        "linear_fwd": (lambda: ops.linear_fwd, (x, _grad(8, 12), _grad(8), _grad(2, 5, 8), "none", True)),
        "linear_fwd_gelu": (lambda: ops.linear_fwd, (x, _grad(8, 12), _grad(8), None, "gelu_tanh", True)),
        "mlp_fwd": (
            lambda: ops.mlp_fwd,
            (x, _grad(16, 12), _grad(16), _grad(12, 16), _grad(12), _grad(2, 5, 12), "gelu", True),
        ),
        "swiglu_fwd": (
            lambda: ops.swiglu_fwd,
            (x, _grad(16, 12), _grad(16), _grad(16, 12), None, None, None, None, True),
        ),
        "swiglu_fwd_down": (
            lambda: ops.swiglu_fwd,
            (
                x,
                _grad(16, 12),
                None,
                _grad(16, 12),
                _grad(16),
                _grad(12, 16),
                _grad(12),
                _grad(2, 5, 12),
                True,
            ),
        ),
        # without the pre-activations (no gradient will be asked for: inputs that do not require it)
        "linear_fwd_gelu_inference": (
            lambda: ops.linear_fwd,
            (x.detach(), _plain(8, 12), None, None, "gelu", False),
        ),
        "mlp_fwd_inference": (
            lambda: ops.mlp_fwd,
            (x.detach(), _plain(16, 12), _plain(16), _plain(12, 16), None, x.detach(), "gelu_tanh", False),
        ),
        "swiglu_fwd_inference": (
            lambda: ops.swiglu_fwd,
            (x.detach(), _plain(16, 12), None, _plain(16, 12), _plain(16), None, None, None, False),
        ),
        "swiglu_fwd_down_inference": (
            lambda: ops.swiglu_fwd,
            (
                x.detach(),
                _plain(16, 12),
                _plain(16),
                _plain(16, 12),
                None,
                _plain(12, 16),
                None,
                x.detach(),
                False,
            ),
        ),
        "patch_embed_fwd": (
            lambda: ops.patch_embed_fwd,
            (_grad(2, 3, 8, 8), _grad(12, 3, 4, 4), _grad(12), _grad(1, 1, 12), _grad(1, 5, 12), 4),
        ),
    }


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="the Triton backend does not run here")
@pytest.mark.parametrize("name", sorted(cases()))
def test_triton_op_passes_opcheck(name):
    op, args = cases()[name]
    torch.library.opcheck(op(), args, test_utils=UTILS)


@requires_cuda
@pytest.mark.skipif(device_reason("triton", CUDA) is not None, reason=str(device_reason("triton", CUDA)))
@pytest.mark.parametrize("name", sorted(cases()))
def test_triton_op_passes_full_opcheck_on_cuda(name):
    op, args = cases("cuda")[name]
    torch.library.opcheck(op(), args)
