"""The dispatch of the lean runtime: the choice is context-local across threads and the process's
default elsewhere; strict raises, a fallback warns once; interpreted Triton is never auto's; explain
is text and data, and records what torch.compile traced; ``vk.tune`` under two gloo ranks (rank 0
searches, both run its decisions) and a saved tuning file read by a fresh process; the warm call's
fast path, and its key read in C++ against the Python loop."""

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import vit_kernels as vk
from tests import dispatch_impls
from tests.helpers import CPU_BACKENDS, fake_timer
from vit_kernels import backend, tuning

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def linear_impls():
    """The test implementations of linear ("slow", "fast", "wrong", "limited") installed, no decision."""
    backend.clear_decisions()
    saved = dispatch_impls.install()
    yield
    dispatch_impls.uninstall(saved)


def _linear_call(k: int = 8):
    return vk.linear(torch.randn(4, k), torch.randn(3, k))


def _row(op="linear"):
    rows = [r for r in vk.explain() if r.op == op]
    assert len(rows) == 1, vk.explain()
    return rows[0]


def test_two_threads_never_see_each_others_choice(linear_impls):
    barrier = threading.Barrier(2)
    seen: dict[str, list] = {}

    def worker(name: str):
        with vk.use_backend(name):
            barrier.wait()
            for _ in range(20):
                seen.setdefault(name, []).append(vk.get_backend())
                args = (torch.randn(2, 3), torch.randn(3, 3), None, None)
                backend.resolve("linear", torch.device("cpu"), torch.float32, args)
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("slow", "fast")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"slow": ["slow"] * 20, "fast": ["fast"] * 20}
    assert vk.get_backend() == "auto"
    assert {(r.requested, r.backend) for r in vk.explain()} == {("slow", "slow"), ("fast", "fast")}


def test_set_backend_is_the_default_of_other_threads():
    before = vk.get_backend()
    vk.set_backend("torch")
    try:
        seen = []
        t = threading.Thread(target=lambda: seen.append(vk.get_backend()))
        t.start()
        t.join()
        assert seen == ["torch"]
    finally:
        vk.set_backend(before)


def test_strict_raises_naming_the_op_and_the_limit(linear_impls):
    with vk.use_backend("limited", strict=True):
        with pytest.raises(
            RuntimeError, match=r"backend 'limited' cannot run linear .*: K = 8 > 4 \(strict=True\)"
        ):
            _linear_call(8)
        _linear_call(4)  # within the limit
    assert _row().backend == "limited"


def test_without_strict_the_fallback_warns_once_and_is_recorded(linear_impls):
    with vk.use_backend("limited"):
        with pytest.warns(
            RuntimeWarning, match="backend 'limited' cannot run linear .*K = 8 > 4; torch runs it instead"
        ):
            _linear_call(8)
            _linear_call(8)
    row = _row()
    assert (row.requested, row.backend, row.source) == ("limited", "torch", "fallback")
    assert "K = 8 > 4" in row.reason


def test_interpreted_triton_is_never_a_candidate_for_auto():
    if backend.triton_device_reason(torch.device("cpu")) is not None:
        pytest.skip("Triton cannot run CPU tensors here (TRITON_INTERPRET=1 not set)")
    backend.clear_decisions()
    vk.layer_norm(torch.randn(3, 8), None, None)
    row = _row("layer_norm")
    assert row.backend != "triton"
    assert "interpreted Triton" in row.candidates["triton"]


def test_explain_is_printable_and_data(linear_impls):
    with vk.use_backend("fast"):
        _linear_call()
    text = str(vk.explain())
    assert "linear" in text and "fast (requested)" in text and "1 calls, asked: fast" in text
    (data,) = vk.explain().as_dicts()
    assert data["op"] == "linear" and data["backend"] == "fast" and data["dtype"] == "torch.float32"
    json.dumps(data)


def test_explain_records_what_torch_compile_traced():
    """A compiled call's decision is made once while tracing, recorded as traced, and the graph runs
    it without deciding again."""
    backend.clear_decisions()
    w, b = torch.randn(8), torch.randn(8)
    compiled = torch.compile(lambda x: vk.layer_norm(x, w, b), backend="eager", fullgraph=True)
    with vk.use_backend("torch"):
        for _ in range(3):
            compiled(torch.randn(3, 8))
    (row,) = [r for r in vk.explain() if r.op == "layer_norm"]
    assert (row.backend, row.source, row.calls) == ("torch", "requested (traced)", 1)
    assert "traced" in str(vk.explain())


def test_tune_searches_every_signature_of_a_block_and_the_runs_take_its_decisions(monkeypatch):
    from vit_kernels.nn import Block

    monkeypatch.setattr(tuning, "time_runs", fake_timer())
    block = Block(16, num_heads=2)
    rows = vk.tune(block, (torch.randn(2, 5, 16),))
    assert {r.op for r in rows} >= {"layer_norm", "attention", "mlp"}
    assert all(r.source in ("tuned", "only candidate") for r in rows), rows
    backend.clear_decisions()
    block(torch.randn(2, 5, 16)).sum().backward()  # the same signatures: the decisions stand
    assert all(r.source in ("tuned", "only candidate") for r in vk.explain()), vk.explain()
    tuning._forget()
    backend.TUNED.clear()


def _two_ranks_tuned(folder: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "-m", "tests.tune_ranks", str(folder)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_under_two_gloo_ranks_rank_0_searches_and_both_run_its_decisions(tmp_path):
    if backend.backend_unavailable_reason("extension") is not None:
        pytest.skip("on the CPU only the extension competes with the reference under auto: not built here")
    first, second = _two_ranks_tuned(tmp_path)
    assert first["timed"] > 0 and second["timed"] == 0, (first, second)
    assert first["runs"] == second["runs"] and first["runs"], (first, second)
    assert "tuned" in first["sources"] and first["sources"] == second["sources"]


def test_a_saved_tuning_file_runs_in_a_fresh_process(monkeypatch, tmp_path):
    """The decision ``vk.tune`` saved (a registered candidate, "fast") is what a new process that
    loads the file runs, untimed; the file is refused there once its stamp is not this machine's."""
    register = (
        'backend.register("layer_norm", "fast", lambda *a: backend._registry["layer_norm"]["torch"].fn(*a))'
    )
    exec(register, {"backend": backend})
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda name: 0.5 if name == "fast" else 1.0))
    try:
        norm = torch.nn.LayerNorm(24)
        model = torch.nn.Sequential()
        model.forward = lambda x: vk.layer_norm(x, norm.weight, norm.bias)
        vk.tune(model, (torch.randn(2, 3, 24),), grad=False)
        path = tmp_path / "tuning.json"
        vk.save_tuning(path)
    finally:
        backend.unregister("layer_norm", "fast")
        tuning._forget()
        backend.TUNED.clear()
    child = f"""
import json, torch, vit_kernels as vk
from vit_kernels import backend, tuning
{register}
tuning.time_runs = None  # nothing may be timed here
vk.load_tuning({str(path)!r})
with torch.no_grad():
    vk.layer_norm(torch.randn(2, 3, 24), torch.ones(24), torch.zeros(24))
print(json.dumps([(r.backend, r.source) for r in vk.explain()]))
"""
    done = subprocess.run(
        [sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [["fast", "tuned"]]


# ---- the per-call fast path -----------------------------------------------------------------------


def test_repeated_calls_skip_validation_but_not_for_new_arguments():
    """A signature seen before goes straight to its implementation; anything that changes what
    validation would say (a bool for an int, another shape, dtype or device) is prepared again."""
    backend.clear_decisions()
    qkv = torch.randn(2, 5, 24)
    vk.attention(qkv, 1)
    entries = len(backend._fast)
    assert entries >= 1
    out = vk.attention(qkv, 1)
    assert len(backend._fast) == entries and out.shape == (2, 5, 8)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        vk.attention(qkv, True)
    with pytest.raises(ValueError, match="must divide the width"):
        vk.attention(qkv, 3)
    w, b = torch.randn(8), torch.randn(8)
    vk.layer_norm(torch.randn(3, 8), w, b)
    with pytest.raises(ValueError, match="weight must have shape"):
        vk.layer_norm(torch.randn(3, 8), torch.randn(9), b)
    with pytest.raises(TypeError, match="bias has dtype torch.float64"):
        vk.layer_norm(torch.randn(3, 8), w, b.double())
    with pytest.raises(ValueError, match="bias is on meta"):
        vk.layer_norm(torch.randn(3, 8), w, b.to("meta"))


def test_fast_path_replays_autocast_casts():
    backend.clear_decisions()
    x, w, bias = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = vk.linear(x, w, bias)
        second = vk.linear(x, w, bias)
        normed = [vk.layer_norm(first, torch.ones(6), None) for _ in range(2)]
    assert first.dtype == second.dtype == torch.bfloat16 and torch.equal(first, second)
    assert normed[0].dtype == normed[1].dtype == torch.float32 and torch.equal(normed[0], normed[1])
    assert vk.linear(x, w, bias).dtype == torch.float32  # autocast off: another signature


def test_fast_path_follows_the_choice_and_counts_calls():
    backend.clear_decisions()
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    for name in ("torch", "extension", "torch"):
        if name in CPU_BACKENDS:
            with vk.use_backend(name, strict=True):
                for _ in range(3):
                    vk.layer_norm(x, w, b)
    ran = {row.backend: row.calls for row in vk.explain() if row.op == "layer_norm"}
    assert ran["torch"] == 6
    if "extension" in CPU_BACKENDS:
        assert ran["extension"] == 3


def test_fast_path_leaves_unhashable_arguments_to_validation():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        vk.linear(x, w, [0.0] * 5)
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        vk.patch_embed(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 4, 4), patch_size=[4])


def test_a_strided_call_is_its_own_signature():
    """Contiguity is part of a decision's signature (auto measures a strided layout on its own)."""
    backend.clear_decisions()
    w, b = torch.randn(8), torch.randn(8)
    vk.layer_norm(torch.randn(4, 3, 8), w, b)
    vk.layer_norm(torch.randn(4, 8, 3).transpose(1, 2), w, b)
    assert len(backend._fast) == 2
    assert len({row.shapes for row in vk.explain() if row.op == "layer_norm"}) == 2


def _keys(calls: list[tuple], native) -> list:
    """The key of each (args, state) of ``calls``, read with ``native`` (None: the Python loop);
    ``state()`` makes the context manager entered around the read (grad mode, autocast, a backend
    choice)."""
    saved = backend._native_key
    backend._native_key = native
    try:
        keys = []
        for args, state in calls:
            with state():
                keys.append(backend._call_key("linear", args))
        return keys
    finally:
        backend._native_key = saved


@pytest.mark.skipif(backend._native_key is None, reason="the extension (and its fast_path_key) is not built")
def test_the_native_call_key_tells_apart_exactly_what_the_python_key_does():
    """The C++ key (csrc/fast_path_key.cpp) and the Python loop agree on which calls share a key: any
    change of shape, dtype, device, requires_grad, contiguity, position, or of a plain argument's
    value or type (1, 1.0, True), or of the state the call runs in (grad mode, autocast and its
    dtype, the backend chosen in this context or for the process) makes another key; equal facts
    make the same one."""
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(6, 8))
    plain = contextlib.nullcontext
    args = [
        (x, w, None, 1),
        (torch.randn(4, 8), torch.nn.Parameter(torch.randn(6, 8)), None, 1),  # equal facts
        (x, w.detach().requires_grad_(), None, 1),  # a plain tensor where the parameter was: the same facts
        (x, w, None, 1.0),
        (x, w, None, True),
        (x, w, None, "1"),
        (x, w, None, None),
        (x.t().contiguous().t(), w, None, 1),  # strided
        (x.double(), w, None, 1),
        (x.to("meta"), w, None, 1),
        (x.clone().requires_grad_(), w, None, 1),
        (torch.randn(5, 8), w, None, 1),
        (torch.randn(4, 2, 4), w, None, 1),
        (x, None, w, 1),  # the same tensors at other places
        (torch.randn(4, 8, dtype=torch.float64).to(torch.float32), w, torch.randn(6), 1),
        (x, w, torch.randn(6), 1),
    ]
    states = [
        torch.no_grad,
        torch.inference_mode,  # grad mode off, as under no_grad: the same key
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: torch.autocast("cpu", dtype=torch.float16),
        lambda: torch.autocast("cuda", dtype=torch.float16, enabled=False),  # not this device's: the same key
        lambda: vk.use_backend("torch"),
        lambda: vk.use_backend("torch", strict=True),
    ]
    calls = [(a, plain) for a in args] + [(args[0], state) for state in states]
    # a meta tensor has no autocast: the same key as without it
    calls.append(((x.to("meta"), w, None, 1), lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
    native, python = _keys(calls, backend._native_key), _keys(calls, None)
    assert all(isinstance(key[-1], bytes) for key in native)
    same_native = [[a == b for b in native] for a in native]
    same_python = [[a == b for b in python] for a in python]
    assert same_native == same_python
    first_state = len(args)
    assert native[0] == native[1] == native[2] and native[14] == native[15]
    assert native[first_state] == native[first_state + 1] and native[first_state + 4] == native[0]
    assert native[-1] == native[9]
    assert len(set(native)) == len(calls) - 6

    # the process's choice when no use_backend block is in force
    before = vk.get_backend()
    vk.set_backend("torch")
    try:
        assert _keys([(args[0], plain)], backend._native_key) == [native[first_state + 5]]
    finally:
        vk.set_backend(before)

    # another tensor type: the Python key (which adds the type, and has none for a main input that
    # is not a plain tensor); another argument type: no key at all
    class Subclass(torch.Tensor):
        pass

    subclass = torch.randn(4, 8).as_subclass(Subclass)
    state = ("linear", backend._context_choice, backend._process_choice)
    assert backend._native_key((x, subclass), torch.nn.Parameter, *state) is NotImplemented
    assert backend._call_key("linear", (x, subclass))[-1][-1] is Subclass
    assert backend._native_key((x, [1]), torch.nn.Parameter, *state) is None
    assert backend._call_key("linear", (x, [1])) is None
    assert backend._native_key((subclass, x), torch.nn.Parameter, *state) is NotImplemented
    assert backend._call_key("linear", (subclass, x)) is None
