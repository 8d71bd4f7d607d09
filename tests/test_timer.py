"""The one timer (``benchmarks._timer.time_runs``): interleaved rounds, warm-up, the round and
budget limits, and on CUDA events around each run with the device synchronised before each run (the
runtime) or once at the end (back to back, the benchmarks)."""

from __future__ import annotations

import time
from unittest import mock

import torch

from benchmarks import _timer

CPU = torch.device("cpu")


def test_runs_are_interleaved_after_the_warmup_and_each_round_gives_one_sample():
    order = []
    runs = {name: (lambda name=name: order.append(name)) for name in "abc"}
    samples = _timer.time_runs(runs, CPU, rounds=3, warmup=2)
    assert order == list("abc") * 5
    assert {name: len(s) for name, s in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(ms >= 0.0 for s in samples.values() for ms in s)


def test_a_sample_is_the_runs_own_time_in_milliseconds():
    samples = _timer.time_runs({"sleep": lambda: time.sleep(0.02), "none": lambda: None}, CPU, rounds=2)
    assert all(19.0 <= ms < 500.0 for ms in samples["sleep"])
    assert all(ms < 5.0 for ms in samples["none"])


def test_the_budget_ends_the_rounds_but_not_before_min_rounds():
    slow = {"slow": lambda: time.sleep(0.01)}
    assert len(_timer.time_runs(slow, CPU, rounds=100, budget_s=0.0)["slow"]) == 1
    assert len(_timer.time_runs(slow, CPU, rounds=100, budget_s=0.0, min_rounds=4)["slow"]) == 4
    assert len(_timer.time_runs(slow, CPU, rounds=5)["slow"]) == 5


class _Events:
    """torch.cuda.Event and synchronize stand-ins that log what happens, in order."""

    def __init__(self):
        self.log: list[str] = []
        self.clock = 0.0
        events = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self):
                events.clock += 1.0
                self.at = events.clock
                events.log.append("record")

            def elapsed_time(self, end):
                assert events.log[-1] == "sync", "an event read before the device was synchronised"
                return end.at - self.at

        self.Event = Event

    def synchronize(self, device=None):
        self.log.append("sync")

    def patches(self):
        return (
            mock.patch.object(torch.cuda, "Event", self.Event),
            mock.patch.object(torch.cuda, "synchronize", self.synchronize),
        )


def _on_cuda(back_to_back: bool):
    events = _Events()
    runs = {name: (lambda name=name: events.log.append(name)) for name in "ab"}
    patch_event, patch_sync = events.patches()
    with patch_event, patch_sync:
        samples = _timer.time_runs(runs, torch.device("cuda"), rounds=2, back_to_back=back_to_back)
    return samples, events.log


def test_on_cuda_each_run_starts_from_an_idle_device():
    samples, log = _on_cuda(back_to_back=False)
    one_run = ["sync", "record", "a", "record", "sync", "record", "b", "record"]
    assert log == ["sync"] + one_run * 2 + ["sync"]
    assert samples == {"a": [1.0, 1.0], "b": [1.0, 1.0]}  # the time between a run's two events


def test_on_cuda_back_to_back_runs_are_synchronised_once():
    samples, log = _on_cuda(back_to_back=True)
    assert log == ["sync"] + ["record", "a", "record", "record", "b", "record"] * 2 + ["sync"]
    assert samples == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
