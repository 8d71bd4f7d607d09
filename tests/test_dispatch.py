"""auto, searching (asked for) and not: which implementation a search picks, the margin, the warning
for an invalid one, the caches (memory, disk, a second process, a corrupt file), the table without
a search, no timing under torch.compile, context-local choice across threads, strict mode, and
explain."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import vit_kernels as vk
from tests import dispatch_impls
from tests.helpers import CPU_BACKENDS
from vit_kernels import _measure, backend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def measured(tmp_path):
    """auto searching, decisions in a fresh cache folder, the test implementations of linear installed."""
    vk.set_autotune(True, margin=0.05, cache_dir=tmp_path)
    backend.clear_decisions()
    saved = dispatch_impls.install()
    yield tmp_path
    dispatch_impls.uninstall(saved)
    vk.set_autotune(cache_dir=os.environ["VIT_KERNELS_CACHE_DIR"])


def _linear_call(k: int = 8):
    return vk.linear(torch.randn(4, k), torch.randn(3, k))


def _row(op="linear"):
    rows = [r for r in vk.explain() if r.op == op]
    assert len(rows) == 1, vk.explain()
    return rows[0]


def test_auto_picks_the_fastest_valid_and_rejects_the_wrong_one_with_one_warning(measured):
    with pytest.warns(RuntimeWarning, match="the wrong implementation of linear failed validation") as caught:
        out = _linear_call()
        _linear_call()
    assert sum("failed validation" in str(w.message) for w in caught) == 1
    row = _row()
    assert (row.backend, row.source, row.calls) == ("fast", "measured", 2)
    for name in ("torch", "slow", "fast"):
        assert row.candidates[name].endswith(" ms"), row.candidates
    assert row.candidates["wrong"].startswith("invalid: output 0: relative error")
    assert row.candidates["limited"].startswith("excluded: K = 8 > 4")
    assert out.shape == (4, 3)
    assert json.loads(next(measured.glob("tuning-*.json")).read_text())["dispatch"]


def test_the_margin_keeps_the_reference_unless_beaten_by_it(measured):
    dispatch_impls.install(fast_s=dispatch_impls.REFERENCE_S / 2)  # twice as fast as the reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vk.set_autotune(margin=2.0)  # must be 3x faster
        _linear_call()
        assert _row().backend == "torch"
        assert "margin" in _row().reason
        backend.clear_decisions()
        vk.set_autotune(margin=0.5, cache_dir=False)  # must be 1.5x faster
        _linear_call()
        assert _row().backend == "fast"


def test_batch_sizes_in_one_bucket_share_a_decision(measured, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vk.linear(torch.randn(5, 8), torch.randn(3, 8))
        monkeypatch.setattr(_measure, "measure", lambda *a, **k: pytest.fail("measured twice"))
        vk.linear(torch.randn(7, 8), torch.randn(3, 8))
    row = _row()
    assert (row.source, row.calls) == ("measured", 2)
    assert row.shapes.startswith("(8,8)")


def test_a_new_cache_folder_keeps_what_this_process_decided(measured, tmp_path):
    """``set_autotune(cache_dir=...)`` after ``vk.tune`` or a measured call: the decision stands
    (from the cache, not measured again), also for a cache in memory only, and the new folder's file
    gets it with its next write."""
    with pytest.warns(RuntimeWarning, match="failed validation"):
        _linear_call()
    assert _row().source == "measured"
    for folder in (False, tmp_path / "elsewhere"):
        vk.set_autotune(cache_dir=folder)
        backend._journal.clear()
        _linear_call()
        assert (_row().backend, _row().source) == ("fast", "tuned"), folder
    assert not (tmp_path / "elsewhere").exists()  # held in memory, not written by the switch itself


def _second_process(cache: Path, **env) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.dispatch_impls"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "VIT_KERNELS_TUNE": "1", "VIT_KERNELS_CACHE_DIR": str(cache), **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_disk_cache_and_a_corrupt_file_only_warns(tmp_path):
    first = _second_process(tmp_path)
    assert (first["backend"], first["source"]) == ("fast", "measured")
    second = _second_process(tmp_path)
    assert (second["backend"], second["source"]) == ("fast", "tuned")
    assert not any("failed validation" in w for w in second["warnings"])
    (cache_file,) = tmp_path.glob("tuning-*.json")
    cache_file.write_text("{ not json")
    third = _second_process(tmp_path)
    assert (third["backend"], third["source"]) == ("fast", "measured")
    assert any("ignoring the unreadable cache" in w for w in third["warnings"])
    assert json.loads(cache_file.read_text())["format"] == 2  # rewritten


def test_nothing_is_timed_under_torch_compile(measured, monkeypatch):
    monkeypatch.setattr(_measure, "measure", lambda *a, **k: pytest.fail("timed while tracing"))
    compiled = torch.compile(lambda x, w: vk.linear(x, w), fullgraph=True, backend="eager")
    out = compiled(torch.randn(4, 8), torch.randn(3, 8))
    assert out.shape == (4, 3)
    row = _row()
    assert row.source == "table (traced)" and row.backend == "torch"


def test_compile_uses_a_decision_measured_before(measured):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _linear_call()  # what vk.tune does for a model
    compiled = torch.compile(lambda x, w: vk.linear(x, w), fullgraph=True, backend="eager")
    compiled(torch.randn(4, 8), torch.randn(3, 8))
    traced = [r for r in vk.explain() if r.source.endswith("(traced)")]
    assert [(r.backend, r.source) for r in traced] == [("fast", "tuned (traced)")]


def test_without_a_search_the_table_decides(measured, monkeypatch):
    monkeypatch.setattr(_measure, "measure", lambda *a, **k: pytest.fail("timed without a search"))
    vk.set_autotune(False)
    _linear_call()
    row = _row()
    assert (row.backend, row.source) == ("torch", "table")
    assert "the op's table" in row.reason


@pytest.mark.parametrize("value,searching", [(None, "False"), ("1", "True"), ("0", "False")])
def test_searching_is_off_unless_the_environment_turns_it_on(value, searching):
    code = "import vit_kernels as vk; print(vk.autotune_settings()['enabled'])"
    env = {k: v for k, v in os.environ.items() if k != "VIT_KERNELS_TUNE"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env if value is None else {**env, "VIT_KERNELS_TUNE": value},
    )
    assert done.stdout.strip() == searching, done.stderr


def test_two_threads_never_see_each_others_choice(measured):
    barrier = threading.Barrier(2)
    seen: dict[str, list] = {}

    def worker(name: str):
        with vk.use_backend(name):
            barrier.wait()
            for _ in range(20):
                seen.setdefault(name, []).append(vk.get_backend())
                backend.resolve(
                    "linear",
                    torch.device("cpu"),
                    torch.float32,
                    (torch.randn(2, 3), torch.randn(3, 3), None, None),
                )
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
    vk.set_backend("torch")
    seen = []
    t = threading.Thread(target=lambda: seen.append(vk.get_backend()))
    t.start()
    t.join()
    assert seen == ["torch"]


def test_strict_raises_naming_the_op_and_the_limit(measured):
    with vk.use_backend("limited", strict=True):
        with pytest.raises(
            RuntimeError, match=r"backend 'limited' cannot run linear .*: K = 8 > 4 \(strict=True\)"
        ):
            _linear_call(8)
        _linear_call(4)  # within the limit
    assert _row().backend == "limited"


def test_without_strict_the_fallback_warns_once_and_is_recorded(measured):
    vk.set_autotune(False)
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


def test_explain_is_printable_and_data(measured):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _linear_call()
    text = str(vk.explain())
    assert "linear" in text and "fast" in text and "measured" in text
    (data,) = vk.explain().as_dicts()
    assert data["op"] == "linear" and data["backend"] == "fast" and data["dtype"] == "torch.float32"
    json.dumps(data)


def test_tune_measures_every_signature_of_a_model(tmp_path):
    vk.set_autotune(False, cache_dir=tmp_path)
    backend.clear_decisions()
    model = vk.nn.Block(16, num_heads=2) if hasattr(vk, "nn") else None
    if model is None:
        from vit_kernels.nn import Block

        model = Block(16, num_heads=2)
    rows = vk.tune(model, (torch.randn(2, 5, 16),))
    assert {r.op for r in rows} >= {"layer_norm", "attention", "mlp"}
    assert all(r.source in ("measured", "tuned", "only candidate") for r in rows), rows
    assert backend.autotune_settings()["enabled"] is False
    vk.set_autotune(cache_dir=os.environ["VIT_KERNELS_CACHE_DIR"])


@pytest.mark.parametrize("bad,error", [("fastest", ValueError), (3, TypeError)])
def test_bad_arguments_name_themselves(bad, error):
    with pytest.raises(error, match="backend must be"):
        vk.set_backend(bad)
    with pytest.raises(TypeError, match="strict must be a bool"):
        vk.use_backend("torch", strict="yes").__enter__()
    with pytest.raises(ValueError, match="margin must be"):
        vk.set_autotune(margin=-1)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        vk.set_autotune(enabled="no")


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


def test_a_decision_stored_after_the_cache_was_cleared_is_dropped(monkeypatch):
    """A call decided before clear_decisions()/register() and finishing after it does not leave its
    (possibly stale) decision in the fast path."""
    backend.clear_decisions()
    real_resolve = backend._resolve

    def resolve_then_clear(*args):
        result = real_resolve(*args)
        backend.clear_decisions()  # as another thread would, between the decision and its storing
        return result

    monkeypatch.setattr(backend, "_resolve", resolve_then_clear)
    vk.layer_norm(torch.randn(3, 8), None, None)
    assert backend._fast == {}


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
