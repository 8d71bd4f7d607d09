"""``python -m benchmarks --compare``: a difference is judged only outside both runs' own noise (each
row's q20-q80 spread, and the machine's drift where both files recorded the noise probe), and the
report says how many cases were too noisy to judge. Results files built from drawn samples: the
verdicts follow from the mathematics, not from this machine's timings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import compare, gate, stats
from benchmarks.__main__ import main

CASES = 20


def _row(i: int, samples) -> dict:
    samples = [float(s) for s in samples]
    q20, median, q80 = np.quantile(samples, [0.2, 0.5, 0.8])
    return {
        "kind": "op",
        "op": f"op{i}",
        "shape": "B=8",
        "dtype": "float32",
        "backend": "torch",
        "mode": "forward",
        "median_ms": float(median),
        "q20_ms": float(q20),
        "q80_ms": float(q80),
        "samples_ms": samples,
    }


def _write(path, rows, probe_ms=None):
    meta = {} if probe_ms is None else {"noise": {"probes": [{"workload": "w", "median_ms": probe_ms}] * 2}}
    path.write_text(json.dumps({"meta": meta, "peaks": {}, "rows": rows}))
    return path


def _runs(tmp_path, factor, sigma, n=200, seed=0, probes=(None, None)):
    """Two runs of CASES cases: samples lognormal(0, sigma) per case, the current run's scaled by
    ``factor``; each run's own draws."""
    rng = np.random.default_rng(seed)
    base = [_row(i, rng.lognormal(0.0, sigma, n)) for i in range(CASES)]
    cand = [_row(i, factor * rng.lognormal(0.0, sigma, n)) for i in range(CASES)]
    return (
        _write(tmp_path / "a.json", base, probes[0]),
        _write(tmp_path / "b.json", cand, probes[1]),
        base,
        cand,
    )


def _verdicts(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith("op")]


def test_two_runs_apart_by_less_than_their_spread_report_nothing_faster(tmp_path, capsys):
    """The reported symptom: the same code run twice, the second 8% quicker throughout (less load),
    each run's times spread by about +-13%: 400 samples pin each median to about 1%, so the
    intervals alone call every case faster; the spread says the runs cannot tell."""
    a, b, base, cand = _runs(tmp_path, 0.92, 0.15, n=400)
    by_interval = [
        stats.unpaired_ratio(o["samples_ms"], n["samples_ms"]).verdict(0.05) for o, n in zip(base, cand)
    ]
    assert by_interval.count(stats.FASTER) >= CASES // 2, by_interval  # what the intervals alone would report
    assert main(["--compare", str(a), "--results", str(b)]) == gate.EXIT_OK
    printed = capsys.readouterr().out
    assert "0 faster by more than 5%" in printed and "0 regression(s)" in printed, printed
    noisy = sum("too noisy (faster, but within the runs' own spread)" in line for line in _verdicts(printed))
    assert noisy == by_interval.count(stats.FASTER)
    assert (
        f"{noisy} of {CASES} cases too noisy to judge: {noisy} with a difference inside either run's own"
        in printed
    )


def test_slower_within_the_spread_is_inconclusive_not_a_regression(tmp_path, capsys):
    a, b, _, _ = _runs(tmp_path, 1.08, 0.15, n=400)
    assert main(["--compare", str(a), "--results", str(b)]) == gate.EXIT_INCONCLUSIVE
    printed = capsys.readouterr().out
    assert "0 regression(s)" in printed and "too noisy (slower, but within the runs' own spread)" in printed
    assert "inconclusive: noise too high" in printed


@pytest.mark.parametrize(
    "factor,code,verdict", [(1.5, gate.EXIT_REGRESSION, stats.REGRESSION), (0.5, gate.EXIT_OK, stats.FASTER)]
)
def test_a_change_beyond_both_spreads_is_judged(tmp_path, capsys, factor, code, verdict):
    a, b, _, _ = _runs(tmp_path, factor, 0.1)
    assert main(["--compare", str(a), "--results", str(b)]) == code
    printed = capsys.readouterr().out
    assert all(line.rstrip().endswith(verdict) for line in _verdicts(printed)), printed
    assert f"0 of {CASES} cases too noisy to judge" in printed


@pytest.mark.parametrize(
    "probes,code",
    [
        ((None, None), gate.EXIT_REGRESSION),  # no probe: an 8% slowdown of quiet rows is a regression
        ((1.0, 1.10), gate.EXIT_INCONCLUSIVE),  # the machine itself ran 10% slower: its drift, not the code's
        ((1.10, 1.0), gate.EXIT_REGRESSION),  # the machine ran faster: the slowdown is the code's
    ],
)
def test_the_machines_drift_between_runs_is_not_blamed_on_the_code(tmp_path, capsys, probes, code):
    a, b, _, _ = _runs(tmp_path, 1.08, 0.005, n=30, probes=probes)
    assert main(["--compare", str(a), "--results", str(b)]) == code
    printed = capsys.readouterr().out
    assert ("machine's drift" in printed) == (probes[0] is not None)
    if probes[0] is not None:
        assert f"ran {probes[1] / probes[0]:.3f}x as long in the current run" in printed


def test_band_is_the_rows_own_q20_q80_spread():
    samples = list(np.linspace(1.0, 2.0, 11))
    low, high = compare.band({"samples_ms": samples, "median_ms": 1.5})
    assert (low, high) == pytest.approx((math.log(1.2 / 1.5), math.log(1.8 / 1.5)))
    assert compare.band({"median_ms": 2.0, "q20_ms": 1.0, "q80_ms": 4.0}) == pytest.approx(
        (-math.log(2), math.log(2))
    )
    assert compare.band({"median_ms": 2.0}) == (0.0, 0.0)
    quiet, noisy = (
        {"median_ms": 1.0, "q20_ms": 0.99, "q80_ms": 1.01},
        {"median_ms": 1.0, "q20_ms": 0.7, "q80_ms": 1.3},
    )
    assert compare.beyond_noise(quiet, quiet, 1.05) and compare.beyond_noise(quiet, quiet, 0.95)
    assert not compare.beyond_noise(noisy, quiet, 1.05) and not compare.beyond_noise(quiet, noisy, 1.05)
    assert not compare.beyond_noise(quiet, quiet, 1.05, drift=1.06) and compare.beyond_noise(
        quiet, quiet, 1.05, 0.9
    )


@pytest.mark.parametrize(
    "row,message",
    [
        (
            {"op": "x", "shape": "s", "dtype": "f", "backend": "b", "mode": "m", "median_ms": 1.0},
            "row 0 lacks kind",
        ),
        (
            {"kind": "op", "shape": "s", "dtype": "f", "backend": "b", "mode": "m", "median_ms": 1.0},
            "lacks op or model",
        ),
        ({**_row(0, [1, 2, 3]), "median_ms": -1.0}, "median_ms -1.0, expected a positive number"),
        ({**_row(0, [1, 2, 3]), "median_ms": "fast"}, "median_ms 'fast', expected a positive number"),
        (
            {**_row(0, [1, 2, 3]), "samples_ms": [1.0, 0.0]},
            "samples_ms that are not a list of positive numbers",
        ),
        ({**_row(0, [1, 2, 3]), "q80_ms": None, "q20_ms": -2}, "q20_ms -2, expected a positive number"),
        ("a row", "row 0 is not a JSON object"),
    ],
)
def test_a_malformed_row_is_refused_by_name(tmp_path, row, message):
    bad = _write(tmp_path / "bad.json", [row])
    good = _write(tmp_path / "good.json", [_row(0, [1, 2, 3])])
    with pytest.raises(
        SystemExit,
        match=str(bad).replace(".", r"\.")
        + ": .*"
        + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\."),
    ):
        compare.compare(good, bad, 0.05)


def test_a_broken_candidate_with_its_reason_fails_the_gate():
    """``ab`` writes the candidate's failure after the verdict: ``BROKEN (invalid: ...)``."""
    broken = gate.Comparison("case", None, None, None, gate.BROKEN + " (invalid: RuntimeError: boom)")
    assert gate.exit_code([broken]) == gate.EXIT_REGRESSION
    assert "1 broken" in gate.summary([broken], 0.05)
