"""The benchmark suite's honesty about noise: the probe's record, the verdict on it, an interval on
every speed-up (wide ones marked), and the report's first line on a noisy run. Judged on constructed
samples and probes (the mathematics of the verdicts), never on this machine's timings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import noise, ops_bench, report
from benchmarks.__main__ import main

META = {"device": "CPU test", "torch": "t", "triton": "t", "git_sha": "abc"}


def _probe(spread: float, load: float | None = 0.0, cpus: int = 8) -> dict:
    return {
        "workload": "w",
        "samples": 50,
        "median_ms": 1.0,
        "q20_ms": 1.0,
        "q80_ms": 1.0 + spread,
        "spread": spread,
        "load_1min": load,
        "cpu_count": cpus,
        "usable_cores": cpus,
        "threads": cpus,
    }


def _rows(scatter: float, ratio: float = 2.0, n: int = 20, seed: int = 0) -> list[dict]:
    """Two implementations of one case; 'slow' takes ``ratio`` x 'fast', each sample scattered by a
    lognormal factor of sigma ``scatter``."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, scale in (("fast", 1.0), ("slow", ratio)):
        samples = list(scale * rng.lognormal(0.0, scatter, size=n))
        rows.append(
            {
                "kind": "op",
                "op": "layer_norm",
                "shape": "s",
                "dtype": "float32",
                "mode": "forward",
                "backend": name,
                "median_ms": float(np.median(samples)),
                "q20_ms": float(np.quantile(samples, 0.2)),
                "q80_ms": float(np.quantile(samples, 0.8)),
                "samples_ms": samples,
                "throughput": 1.0,
                "unit": "GB/s",
                "fraction_of_peak": None,
            }
        )
    ops_bench.add_speedups(rows, ("op", "shape", "dtype", "mode"))
    return rows


def test_a_tight_ratio_is_trusted_and_holds_the_true_ratio():
    fast, slow = _rows(0.01)
    low, high = fast["speedup_interval"]["slow"]
    assert low < 2.0 < high and high / low <= noise.RATIO_SPAN_LIMIT
    assert fast["speedup_untrusted"] == [] and slow["speedup_untrusted"] == []
    assert "?" not in report._speedups(fast) and report._speedups(fast).startswith("slow 2")


def test_a_scattered_ratio_is_marked_with_its_interval():
    fast, _ = _rows(0.6, n=5)
    low, high = fast["speedup_interval"]["slow"]
    assert high / low > noise.RATIO_SPAN_LIMIT
    assert fast["speedup_untrusted"] == ["slow"]
    text = report._speedups(fast)
    assert "x? (" in text and f"{low:.3g}-{high:.3g}" in text, text


def test_rows_without_samples_have_no_interval_and_are_not_trusted():
    rows = _rows(0.01)
    for row in rows:
        row["samples_ms"] = []
    ops_bench.add_speedups(rows, ("op", "shape", "dtype", "mode"))
    assert rows[0]["speedup_interval"] == {"slow": None} and rows[0]["speedup_untrusted"] == ["slow"]
    assert "no interval" in report._speedups(rows[0])


@pytest.mark.parametrize(
    "probes,noisy,phrase",
    [
        ([_probe(0.02, 0.5)], False, None),
        ([_probe(0.02), _probe(0.35)], True, "spread by 35%"),  # load that arrived during the run
        ([_probe(0.02, load=7.0, cpus=8)], True, "load average was 7.0 on 8 CPUs"),
        ([_probe(0.02, load=None)], False, None),  # no load average on this OS
    ],
)
def test_the_verdict_names_what_made_the_run_noisy(probes, noisy, phrase):
    found = noise.assess(probes, _rows(0.01))
    assert found["noisy"] is noisy
    assert (phrase is None and found["reasons"] == []) or any(phrase in r for r in found["reasons"]), found[
        "reasons"
    ]


def test_many_untrusted_speedups_make_the_run_noisy_even_with_a_quiet_probe():
    found = noise.assess([_probe(0.01)], _rows(0.6, n=5))
    assert found["noisy"] and found["untrusted_speedups"] == found["speedups"] == 2
    assert any("2 of 2 speed-ups" in r for r in found["reasons"])


def test_the_first_line_of_a_noisy_report_says_so():
    rows = _rows(0.6, n=5)
    noisy = report.markdown(rows, {}, META, noise.assess([_probe(0.5, load=9.0)], rows)).splitlines()
    assert (
        noisy[0].startswith("**Too noisy to trust:")
        and "spread by 50%" in noisy[0]
        and "9.0 on 8 CPUs" in noisy[0]
    )
    assert noisy[1].startswith("Device:")
    rows = _rows(0.01)
    quiet = report.markdown(rows, {}, META, noise.assess([_probe(0.02)], rows)).splitlines()
    assert quiet[0].startswith("Device:") and quiet[1].startswith(
        "Noise: a fixed workload's times spread by 2.0%"
    )
    assert report.markdown(rows, {}, META).splitlines()[0].startswith("Device:")  # no noise record: as before


def test_the_probe_records_its_samples_load_and_threads():
    found = noise.probe(torch.device("cpu"), seconds=0.2)
    assert found["samples"] >= 3 and found["q20_ms"] <= found["median_ms"] <= found["q80_ms"]
    assert found["spread"] == pytest.approx((found["q80_ms"] - found["q20_ms"]) / found["median_ms"])
    assert found["threads"] == torch.get_num_threads() and 1 <= found["usable_cores"] <= found["cpu_count"]


def test_the_suite_records_the_noise_and_leads_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(noise, "probe", lambda device, seconds=1.0, own_load=0.0: _probe(0.4, load=0.0))
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert (
        main(
            [
                "--quick",
                "--device",
                "cpu",
                "--ops",
                "layer_norm",
                "--modes",
                "forward",
                "--no-compile",
                "--out",
                str(out),
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    recorded = json.loads(out.read_text())["meta"]["noise"]
    assert recorded["noisy"] and len(recorded["probes"]) == 2, "probed before and after the run"
    assert (
        md.read_text()
        .splitlines()[0]
        .startswith("**Too noisy to trust: a fixed workload's times spread by 40%")
    )


def test_the_suites_own_threads_are_not_other_processes_load():
    """After a CPU run on all cores, the load average counts the suite's own threads: not noise."""
    after_own_run = {**_probe(0.02, load=8.3, cpus=8), "own_load": 8.0}
    assert not noise.assess([_probe(0.02), after_own_run], [])["noisy"]
    busy_too = {**_probe(0.02, load=14.0, cpus=8), "own_load": 8.0}
    found = noise.assess([_probe(0.02), busy_too], [])
    assert found["noisy"] and "8 of it this run's" in found["reasons"][0], found
