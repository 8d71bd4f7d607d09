"""The tables decide, and each entry is checked once (``vit_kernels._tiles.TileChooser._check``): the
first right entry runs, untimed and without a child process; a wrong one warns, naming the kernel,
the tile and the error, and the next entry is checked in its place; verdicts persist on disk per
kernel source; a key launched while nothing may run says it is unchecked."""

from __future__ import annotations

import warnings

import pytest
import torch

import vit_kernels as vk
from vit_kernels import _proof, _tiles, _timer, _tune_cache
from vit_kernels._tune_cache import Store
from vit_kernels.ops import attention, attention_reference

CPU = torch.device("cpu")


@pytest.fixture
def checkable(monkeypatch):
    """Entries may run (as on a GPU), and nothing may be timed or proven in a child."""

    def refuse(*args, **kwargs):
        raise AssertionError("searched without being asked")

    monkeypatch.setattr(_tiles, "can_measure", lambda device: True)
    monkeypatch.setattr(_timer, "time_runs", refuse)
    monkeypatch.setattr(_proof, "verdicts", refuse)


def _runs(wrong=()):
    """(run, check, runs): ``run(tile)`` records the tile and returns 1, or 0 for a ``wrong`` one."""
    runs = []

    def run(tile):
        runs.append(tile)
        return [torch.tensor([0.0 if tile in wrong else 1.0])]

    return run, (lambda outputs: None if outputs[0].item() == 1.0 else "off by one"), runs


def test_the_tables_first_right_entry_runs_checked_once(checkable):
    run, check, runs = _runs()
    chooser = _tiles.TileChooser("test")
    assert chooser.choose(("k",), CPU, ["a", "b"], run, check) == "a"
    assert runs == ["a"] and chooser.report()[("k",)].how == "checked"
    assert chooser.choose(("k",), CPU, ["a", "b"], run, check) == "a" and runs == ["a"]


def test_a_wrong_entry_warns_and_the_next_is_checked(checkable):
    run, check, runs = _runs(wrong=("a",))
    chooser = _tiles.TileChooser("test")
    with pytest.warns(RuntimeWarning, match=r"the test tile 'a' is wrong on cpu .*\('k',\): off by one"):
        assert chooser.choose(("k",), CPU, ["a", "b", "c"], run, check) == "b"
    assert runs == ["a", "b"]
    assert chooser.report()[("k",)].trials == {"a": "invalid: off by one", "b": "checked"}


def test_no_right_entry_is_an_error_not_a_wrong_answer(checkable):
    run, check, _ = _runs(wrong=("a", "b"))
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no test tile computes the right"):
        _tiles.TileChooser("test").choose(("k",), CPU, ["a", "b"], run, check)


def test_an_entry_that_raises_is_skipped_and_its_refusal_not_kept(checkable, tmp_path):
    _tune_cache._store = Store(tmp_path)

    def run(tile):
        if tile == "a":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [torch.ones(1)]

    with pytest.warns(RuntimeWarning, match="raised OutOfMemoryError"):
        assert _tiles.TileChooser("test").choose(("k",), CPU, ["a", "b"], run, lambda outputs: None) == "b"
    assert [entry["verdict"] for entry in _tune_cache.store().in_memory("checks").values()] == ["right"]


def _kernel_one():
    return 1


def _kernel_two():
    return 2


def test_verdicts_persist_per_kernel_source(checkable, tmp_path):
    """A second process (a fresh chooser on the same folder) runs no entry whose verdict it finds:
    not the wrong one, not the right one; a chooser whose kernels' source differs checks again."""
    _tune_cache._store = Store(tmp_path)
    run, check, runs = _runs(wrong=("a",))
    with pytest.warns(RuntimeWarning):
        assert (
            _tiles.TileChooser("test", lambda: (_kernel_one,)).choose(("k",), CPU, ["a", "b"], run, check)
            == "b"
        )
    _tune_cache._store = Store(tmp_path)  # a new process reads the file
    runs.clear()
    with pytest.warns(RuntimeWarning, match="tile 'a' is wrong"):
        assert (
            _tiles.TileChooser("test", lambda: (_kernel_one,)).choose(("k",), CPU, ["a", "b"], run, check)
            == "b"
        )
    assert runs == []
    with pytest.warns(RuntimeWarning):
        assert (
            _tiles.TileChooser("test", lambda: (_kernel_two,)).choose(("k",), CPU, ["a", "b"], run, check)
            == "b"
        )
    assert runs == ["a", "b"]


def test_a_kernel_source_digest_follows_its_text():
    from vit_kernels.kernels import attention as kernels

    one = _tiles.TileChooser("x", lambda: (kernels._attention_bwd_dq_kernel,))
    same = _tiles.TileChooser("x", lambda: (kernels._attention_bwd_dq_kernel,))
    other = _tiles.TileChooser("x", lambda: (kernels._attention_bwd_dkdv_kernel,))
    assert one.source() == same.source() != other.source()
    assert (
        _tiles.TileChooser("x", lambda: (_kernel_one,)).source()
        != _tiles.TileChooser("x", lambda: (_kernel_two,)).source()
    )


@pytest.mark.parametrize("relative_error", [1.3e-2, 8.4e-2])
def test_an_entry_with_the_wrong_dk_the_h100_found_falls_back_to_a_right_one(
    checkable, tmp_path, relative_error
):
    """A table entry whose dK is off by what an H100's wrong tile gave (1.3e-2 to 8.4e-2 of its largest
    magnitude): the first call warns naming dK, the next entry runs and its gradient is right; the
    verdict persists, so a second process never runs the wrong entry."""
    _tune_cache._store = Store(tmp_path)
    dtype, scale = torch.bfloat16, 64**-0.5
    qkv = (torch.randn(2, 50, 3 * 128, dtype=torch.float64) * 2).to(dtype)
    grad_out = torch.randn(2, 50, 128, dtype=torch.float64).to(dtype)
    exact = torch.cat(attention_reference.reference_attention(qkv, 2, scale, grad_out, torch.float64), dim=-1)
    dq, dk, dv = exact.chunk(3, dim=-1)
    wrong = torch.cat([dq, dk + relative_error * dk.abs().max() * torch.sign(torch.randn_like(dk)), dv], -1)
    bad, good = ((64, 64, 4, 3), (32, 64, 4, 2)), ((64, 64, 4, 3), (64, 64, 4, 2))
    runs = []

    def run(tiles):
        runs.append(tiles)
        return [(wrong if tiles == bad else exact).to(dtype)]

    def check():
        return attention_reference.check_against_pytorch(
            ["dq", "dk", "dv"], lambda outputs: list(outputs[0].chunk(3, dim=-1)), qkv, 2, scale, grad_out
        )

    key = attention._chooser_key(qkv, 2)
    with pytest.warns(RuntimeWarning, match=r"attention backward tile .* is wrong .*: dk: relative error"):
        chosen = _tiles.TileChooser("attention backward").choose(key, CPU, [bad, good], run, check())
    assert chosen == good and runs == [bad, good]
    (gradient,) = run(chosen)
    assert check()([gradient]) is None
    _tune_cache._store = Store(tmp_path)  # a second process
    runs.clear()
    with pytest.warns(RuntimeWarning, match="is wrong"):
        assert _tiles.TileChooser("attention backward").choose(key, CPU, [bad, good], run, check()) == good
    assert runs == []


def test_a_key_launched_while_nothing_may_run_is_explained_as_unchecked():
    """Under tracing or graph capture (no check may run) the table's entry launches, and
    ``vk.explain()`` lists it as unchecked until an eager call checks it."""
    chooser = _tiles.TileChooser("probe")
    run, check, runs = _runs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chooser.choose(("traced",), CPU, ["a", "b"], run, check) == "a"
    assert runs == []
    rows = [t for t in vk.explain().tiles if t["kernel"] == "probe"]
    assert rows == [{"kernel": "probe", "key": ("traced",), "tile": "a", "how": "table, unchecked"}]
    assert "  probe, ('traced',): 'a', table, unchecked" in str(vk.explain()).splitlines()
    _tiles.TileChooser.instances.remove(chooser)


def test_each_check_is_a_log_line_shown_only_when_asked(checkable, caplog):
    run, check, _ = _runs()
    with caplog.at_level("WARNING", logger="vit_kernels"):
        _tiles.TileChooser("quiet").choose(("k",), CPU, ["a"], run, check)
    assert not caplog.records
    with caplog.at_level("INFO", logger="vit_kernels"):
        _tiles.TileChooser("told").choose(("k",), CPU, ["a"], run, check)
    assert [r.getMessage() for r in caplog.records] == ["told ('k',): checked tile 'a'"]


def test_set_verbosity_takes_a_level_name_and_refuses_others():
    from vit_kernels._logging import LOGGER

    try:
        vk.set_verbosity("info")
        assert LOGGER.level == 20 and LOGGER.handlers
        with pytest.raises(ValueError, match="level must be a logging level"):
            vk.set_verbosity("chatty")
        with pytest.raises(TypeError, match="level must be a str or an int"):
            vk.set_verbosity(2.5)
    finally:
        vk.set_verbosity("warning")
