"""``vk.tune`` on the CPU: it validates every capable implementation against the float64 reference,
keeps the fastest valid one, and later calls run that choice without timing anything; ordinary
calls never time; ``save_tuning`` / ``load_tuning`` carry the decisions, refusing a file tuned
elsewhere or not a tuning file, in one line. Timing is a stand-in (``tests.helpers.fake_timer``):
what is tested is the choice made from the times, not the clock."""

import json

import pytest
import torch

import vit_kernels as vk
from tests.helpers import fake_timer
from vit_kernels import _tiles, backend, tuning

TIMES_MS = {"torch": 1.0, "fast": 0.5, "wrong": 0.1}


class Norm(torch.nn.Module):
    """One vk.layer_norm over (N, T, 24) tokens."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(24) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(24))

    def forward(self, x):
        return vk.layer_norm(x, self.weight, self.bias)


def _forget_tuning():
    """No decision, tuned or loaded, is left in the process."""
    tuning._forget()
    backend.TUNED.clear()
    _tiles.TUNED.clear()


def _no_timing(runs):
    raise AssertionError(f"timed {sorted(runs)} outside vk.tune's search")


@pytest.fixture
def candidates(monkeypatch):
    """Two extra layer_norm implementations: "fast" (the reference's result) and "wrong" (scaled
    by 1.5, faster still by the fake clock); removed, with every decision, afterwards."""
    reference = backend._registry["layer_norm"]["torch"].fn
    backend.register("layer_norm", "fast", lambda *args: reference(*args))
    backend.register("layer_norm", "wrong", lambda *args: reference(*args) * 1.5)
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda name: TIMES_MS.get(name, 2.0)))
    _forget_tuning()
    yield
    for name in ("fast", "wrong"):
        backend.unregister("layer_norm", name)
    _forget_tuning()


def _layer_norm_rows():
    return [r for r in vk.explain() if r.op == "layer_norm"]


def test_tune_keeps_the_fastest_valid_candidate_and_later_calls_run_it_untimed(candidates, monkeypatch):
    model, x = Norm(), torch.randn(3, 7, 24)
    explanation = vk.tune(model, (x,))
    (row,) = [r for r in explanation if r.op == "layer_norm"]
    assert (row.backend, row.source, row.grad) == ("fast", "tuned", True), explanation
    assert row.candidates["wrong"].startswith("invalid:"), row.candidates
    assert row.candidates["fast"] == "0.500 ms" and row.candidates["torch"] == "1.000 ms"
    monkeypatch.setattr(tuning, "time_runs", _no_timing)
    expected = torch.nn.functional.layer_norm(
        x.double(), (24,), model.weight.double(), model.bias.double(), 1e-6
    )
    with vk.use_backend("auto"):
        got = model(x)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    (row,) = _layer_norm_rows()
    assert (row.backend, row.source) == ("fast", "tuned")


def test_a_signature_tune_did_not_meet_and_ordinary_calls_take_the_table_untimed(candidates, monkeypatch):
    vk.tune(Norm(), (torch.randn(3, 7, 24),))
    monkeypatch.setattr(tuning, "time_runs", _no_timing)
    backend.clear_decisions()
    with vk.use_backend("auto"):
        Norm()(torch.randn(2, 5, 24))  # another shape: not searched
    (row,) = _layer_norm_rows()
    assert row.source == "table" and row.backend == "torch", row


def test_nothing_beats_the_reference_by_five_percent_keeps_the_reference(candidates, monkeypatch):
    monkeypatch.setattr(tuning, "time_runs", fake_timer(lambda name: {"fast": 0.97}.get(name, 1.0)))
    (row,) = [r for r in vk.tune(Norm(), (torch.randn(3, 7, 24),)) if r.op == "layer_norm"]
    assert row.backend == "torch" and "5%" in row.reason, row


def test_saved_decisions_load_and_run_and_a_file_from_elsewhere_is_refused(candidates, monkeypatch, tmp_path):
    x = torch.randn(3, 7, 24)
    vk.tune(Norm(), (x,))
    path = tmp_path / "tuning.json"
    vk.save_tuning(path)
    saved = json.loads(path.read_text())
    assert saved["format"] == tuning.FORMAT and saved["stamp"] == tuning.stamp()
    _forget_tuning()
    monkeypatch.setattr(tuning, "time_runs", _no_timing)
    vk.load_tuning(path)
    with vk.use_backend("auto"):
        Norm()(x)
    (row,) = _layer_norm_rows()
    assert (row.backend, row.source) == ("fast", "tuned"), row

    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**saved, "stamp": {**saved["stamp"], "torch": "0.0.1"}}))
    with pytest.raises(ValueError, match=r"tuned elsewhere, refused: torch '0.0.1' \(here"):
        vk.load_tuning(elsewhere)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not a vit_kernels tuning file: "),
        ("[1, 2]", "is not a vit_kernels tuning file of format"),
        ('{"format": 1, "stamp": {}, "dispatch": {}, "tiles": {}}', "of format 2"),
        ('{"format": 2, "stamp": {}, "dispatch": [], "tiles": {}}', "of format 2"),
    ],
)
def test_a_file_that_is_not_a_tuning_file_is_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        vk.load_tuning(path)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: vk.tune(torch.nn.Identity, (torch.ones(1),)), "model must be a torch.nn.Module"),
        (lambda: vk.tune(Norm(), torch.ones(1)), "example_inputs must be a tuple"),
        (lambda: vk.tune(Norm(), (torch.ones(1, 24),), grad=1), "grad must be a bool"),
        (lambda: vk.tune(Norm(), (torch.ones(1, 24),), autocast=torch.float32), "autocast must be"),
    ],
)
def test_bad_arguments_to_tune_name_the_argument(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()
