"""pytest-benchmark suite for the per-op cases: ``pytest benchmarks/ --benchmark-only``.

Each op x implementation runs forward + backward at a small ViT shape on the CPU (or the GPU when
there is one, at ViT-S/16 batch 64), after validation against the reference. Compare runs with
pytest-benchmark's own ``--benchmark-autosave`` / ``--benchmark-compare``.
"""

import pytest
import torch

from benchmarks import cases, ops_bench

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPE = cases.shape_of("vit_small_patch16_224", 64 if DEVICE.type == "cuda" else 2)
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
NAMES = ("torch", "triton", "extension", "torch.compile", "eager_math")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", cases.OPS + cases.KERNELS)
def test_op(benchmark, op, name):
    case = cases.build_case(op, SHAPE)
    found = ops_bench.implementations(
        case, DEVICE, DTYPE, compile_reference=name == "torch.compile", interpreted_triton=False
    ).get(name, f"{name} does not apply to {op}")
    if isinstance(found, str):
        pytest.skip(found)
    inputs = case.make_inputs(DEVICE, DTYPE)
    problem = ops_bench.validate(case, found, inputs, DTYPE)
    assert problem is None, problem
    step = ops_bench.timed_call(found, [inputs], "full")

    def run():
        step(0)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"{op} {SHAPE.label} {str(DTYPE).removeprefix('torch.')}"
    benchmark(run)
