"""The op specs the benchmarks time (``vit_kernels.ops.specs``) are the tests' too: for every op, its
inputs, run on every backend, match its float64 formula, output and every input gradient; its eager
reference matches the formula as well."""

import pytest
import torch

from tests.helpers import TOLERANCES, check_against_formula
from vit_kernels.ops.specs import KERNELS, OPS, SPECS, Shape
from vit_kernels import _ext, backend

# A small ViT: 8x8 images in 4x4 patches (4 patches + the class token), D = 12 in 3 heads of 4.
SMALL = Shape("small", batch=2, tokens=5, dim=12, heads=3, hidden=24, channels=3, image=8, patch=4)
DTYPE = torch.float32


def _check(spec, call) -> None:
    """On the default device: the CPU, or CUDA in the ``gpu`` cases of the on_backend fixture."""
    inputs = spec.make_inputs(SMALL, torch.get_default_device(), DTYPE)
    names = list(inputs)

    def fn(*tensors):
        return call(SMALL, **dict(zip(names, tensors)))

    def formula(*tensors):
        return spec.formula(SMALL, **dict(zip(names, tensors)))

    check_against_formula(fn, formula, list(inputs.values()), DTYPE, names)


def test_every_op_has_a_spec_and_tolerances_cover_its_dtype():
    assert set(SPECS) == set(OPS) | set(KERNELS)
    assert DTYPE in TOLERANCES


@pytest.mark.parametrize("op", OPS)
def test_op_matches_its_formula(on_backend, op):
    reason = backend.unsupported_reason(op, on_backend, torch.get_default_device(), DTYPE)
    if reason is not None:  # the backend's table declares it does not take the op (the extension's SwiGLU)
        pytest.skip(f"{on_backend} does not run {op}: {reason}")
    _check(SPECS[op], SPECS[op].run)


@pytest.mark.parametrize("op", OPS + KERNELS)
def test_reference_matches_the_formula(op):
    _check(SPECS[op], SPECS[op].reference)


@pytest.mark.skipif(
    _ext.supports(torch.device("cpu"), DTYPE) is not None, reason="the C++ extension is not built"
)
@pytest.mark.parametrize("op", KERNELS)
def test_kernel_matches_its_formula(op):
    _check(SPECS[op], SPECS[op].run)


def test_work_is_counted_from_the_shape():
    assert SPECS["attention"].flops(SMALL) == 4.0 * 2 * 5**2 * 12
    assert SPECS["patch_embed"].flops(SMALL) == 2.0 * 2 * 4 * 12 * 3 * 4**2
    assert SPECS["layer_norm"].bytes_per_element(SMALL) == 4 and SPECS["layer_norm"].flops(SMALL) == 0
    assert SPECS["bias_gelu"].bytes_per_element(SMALL) == 2 * 24 // 12
    assert SPECS["attention"].backward_factor == 2.5
