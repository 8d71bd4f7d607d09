"""One side of an A/B run: a long-lived process that imports one source tree's ``vit_kernels`` and
``vit`` and times benchmark cases on request. ``python -m benchmarks ab`` starts one per side, with
``sys.path`` = [the harness, that side's tree], and alternates requests between the two.

Protocol: one JSON object per line on stdin, one reply per line on stdout (anything the libraries
print goes to stderr).

* ``{"cmd": "setup", "device": "cpu", "threads": 1, "cpus": [1], "cases": [case, ...]}`` ->
  ``{"vit_kernels": path, "extension": null | why not, "status": ["ok" | "skipped: ..." | "invalid: ..."]}``
* ``{"cmd": "time", "case": index, "slice_ms": 20}`` -> ``{"ms": the fastest of the slice's calls}``
* ``{"cmd": "quit"}``

A case is ``{"kind": "op", "op", "model", "batch", "dtype", "backend", "mode"}`` (``mode`` forward |
backward | full) or ``{"kind": "model", "model", "batch", "dtype", "backend", "mode"}`` (``mode``
train | inference: a whole step of the ViT preset on that backend).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable, Optional

import torch

TimedCall = tuple[Callable[[int], object], int]  # call(i), number of input copies


def _op_call(
    spec: dict, device: torch.device, dtype: torch.dtype, interpreted_triton: bool
) -> TimedCall | str:
    from benchmarks import cases, ops_bench
    from benchmarks.timing import copies_to_rotate

    case = cases.build_case(spec["op"], cases.shape_of(spec["model"], spec["batch"]))
    found = ops_bench.implementations(case, device, dtype, False, interpreted_triton).get(spec["backend"])
    if found is None:
        return f"skipped: {spec['op']} has no implementation {spec['backend']!r}"
    if isinstance(found, str):
        return f"skipped: {found}"
    first = case.make_inputs(device, dtype)
    copies = copies_to_rotate(sum(t.numel() * t.element_size() for t in first.values()), device)
    input_sets = [first] + [case.make_inputs(device, dtype) for _ in range(copies - 1)]
    problem = ops_bench.validate(case, found, first, dtype)
    if problem is not None:
        return f"invalid: {problem}"
    return ops_bench.timed_call(found, input_sets, spec["mode"]), copies


def _model_call(spec: dict, device: torch.device, dtype: torch.dtype) -> TimedCall:
    from benchmarks import headline
    from vit.model import ViT, get_config

    config = get_config(spec["model"])
    module = ViT(config).to(device)
    batches = headline._inputs(config, spec["batch"], device)
    return headline._step(module, spec["backend"], False, device, dtype, spec["mode"], batches), 2


def prepare(spec: dict, device: torch.device, interpreted_triton: bool) -> TimedCall | str:
    """The timed call for one case, or why it cannot be timed on this side ("skipped: ..." or
    "invalid: ..."). Inputs come from a fixed seed, the same on both sides."""
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    try:
        if spec["kind"] == "model":
            return _model_call(spec, device, dtype)
        return _op_call(spec, device, dtype, interpreted_triton)
    except Exception as error:  # this side cannot run the case: reported, the others go on
        return f"invalid: {type(error).__name__}: {error}".splitlines()[0]


def serve(requests, replies) -> None:
    from benchmarks.timing import slice_min_ms

    prepared: list[TimedCall | str] = []
    device = torch.device("cpu")
    for line in requests:
        request = json.loads(line)
        if request["cmd"] == "quit":
            return
        if request["cmd"] == "setup":
            device = torch.device(request["device"])
            if request.get("threads"):
                torch.set_num_threads(int(request["threads"]))
            if request.get("cpus"):  # both sides on the same cores: the same neighbours' load
                os.sched_setaffinity(0, request["cpus"])
            import vit_kernels
            from vit_kernels import _ext, backend

            interpreted = device.type == "cpu" and backend.TRITON_INTERPRET
            prepared = [prepare(spec, device, interpreted) for spec in request["cases"]]
            reply = {
                "vit_kernels": os.path.dirname(vit_kernels.__file__),
                "extension": _ext._load_error,
                "status": [p if isinstance(p, str) else "ok" for p in prepared],
            }
        elif request["cmd"] == "time":
            found: Optional[TimedCall | str] = prepared[request["case"]]
            if isinstance(found, str):
                raise ValueError(f"case {request['case']} cannot be timed: {found}")
            call, copies = found
            reply = {"ms": slice_min_ms(call, device, copies, slice_ms=float(request["slice_ms"]))}
        else:
            raise ValueError(f"unknown command {request['cmd']!r}")
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library output must not corrupt the protocol
    try:
        serve(sys.stdin, replies)
    except Exception:
        traceback.print_exc()
        replies.write(json.dumps({"error": traceback.format_exc(limit=3)}) + "\n")
        replies.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
