"""Every Triton launch the simulated devices recorded, compiled for that device's architecture by
the compile gate's own binder and compiler (tools.gpu_check), one launch per kernel variant:
the launch a GPU user's call makes compiles, fits the SM, does not spill and has no transpose of a
computed tile feeding a dot, and it states FP fusion (``_triton.FP_FUSION``). Runs after every
other test of the stage (conftest orders it last), on the launches they recorded. A variant the
compile gate (or an earlier run) already compiled, in a launch of the same kind, is read from its
folder (``tools.gpu_check.compile.Compiled``, outside the clone), whoever compiled it: the gate, an
earlier run, or the other of a float16/bfloat16 twin (the bfloat16 one is compiled, as the gate's
quick sweep takes it)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.cuda_sim.conftest import ARCHS, LAUNCHES
from tools.gpu_check.__main__ import variant_failures
from tools.gpu_check.compile import Compiled, bind, count_line, expand

_JOBS: list = []  # (variant, capability, bound), shared with forked workers
_COMPILED = Compiled()


def _compile(index: int):
    variant, capability, bound = _JOBS[index]
    return _COMPILED.compile(variant, capability, bound, any_of_kind=True)


def signature_of(bound) -> str:
    return repr(sorted(bound.signature.items()))


@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: f"sm{arch}")
def test_every_recorded_launch_compiles_for_its_device(arch, capsys):
    launches = LAUNCHES[arch]
    if not launches:
        pytest.fail("no launch was recorded on this architecture: run the whole stage (make test-cuda-sim)")
    unstated = {
        str(launch.kernel) for launch in launches if launch.kwargs.get("enable_fp_fusion") is not True
    }
    assert not unstated, f"launches that leave FP fusion to Triton's default: {sorted(unstated)}"
    jobs, duplicates = {}, 0
    for launch in launches:
        for variant in expand(launch):
            if arch < getattr(variant.kernel, "min_capability", 0):
                continue
            bound = bind(variant, arch)
            # one compile per kernel variant: its constexprs (tiles, warps, stages, flags) and argument
            # types; launches that differ only in which sizes are multiples of 16 share it, and so do
            # float16 and bfloat16 twins (the same code in the other 16-bit element type, as the compile
            # gate's quick sweep takes them; make check-gpu-all compiles both)
            signature = signature_of(bound).replace("fp16", "bf16")
            kind = (
                variant.name,
                repr(sorted(bound.constexprs.items(), key=str)),
                signature,
                variant.kwargs.get("num_warps"),
                variant.kwargs.get("num_stages"),
            )
            held = jobs.get(kind)
            if held is not None:
                duplicates += 1
            if held is None or ("fp16" in signature_of(held[2]) and "bf16" in signature_of(bound)):
                jobs[kind] = (variant, arch, bound)  # the bfloat16 twin where both were recorded
    _JOBS[:] = list(jobs.values())
    workers = max(1, min(len(_JOBS), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        found = list(pool.map(_compile, range(len(_JOBS)), chunksize=2))
    results = [resources for resources, _ in found]
    with capsys.disabled():
        print(f"\nsm_{arch}: {len(launches)} launches recorded: {count_line(found, duplicates, _COMPILED)}")
    failures = [
        failure
        for (variant, capability, bound), resources in zip(_JOBS, results)
        for failure in variant_failures(variant, capability, bound, resources)
    ]
    assert not failures, (
        f"{len(failures)} of {len(_JOBS)} recorded variants fail on sm_{arch}:\n" + "\n".join(failures)
    )
