"""The benchmark harness: a small real run writes valid rows (with their samples), the file-vs-file
gate flags a slowdown past the threshold, passes otherwise and says when the samples cannot tell;
the statistics behind it; fractions of peak; plots. (No timing assertions: only the plumbing.)"""

import copy
import json

import numpy as np
import pytest

from benchmarks import cases, peaks, report, stats
from benchmarks.__main__ import main


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    code = main(
        [
            "--quick",
            "--device",
            "cpu",
            "--ops",
            "layer_norm,bias_gelu",
            "--modes",
            "forward,backward",
            "--no-compile",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_rows_carry_every_field(results):
    data = json.loads(results.read_text())
    timed = [r for r in data["rows"] if "median_ms" in r]
    assert timed, data["rows"]
    for row in timed:
        for field in (
            "op",
            "shape",
            "dtype",
            "backend",
            "mode",
            "median_ms",
            "q20_ms",
            "q80_ms",
            "samples_ms",
            "throughput",
            "device",
            "torch",
            "triton",
            "git_sha",
        ):
            assert field in row, f"{field} missing from {row}"
        assert row["q20_ms"] <= row["median_ms"] <= row["q80_ms"]
        assert len(row["samples_ms"]) >= 3 and min(row["samples_ms"]) <= row["median_ms"] <= max(
            row["samples_ms"]
        )
        assert row["fraction_of_peak"] is None or 0 < row["fraction_of_peak"] <= 1
    assert data["peaks"]["copy_gbps"] > 0
    backends = {r["backend"] for r in timed if r["op"] == "layer_norm"}
    assert {"torch"} <= backends
    assert any(r.get("speedup") for r in timed) or len(backends) == 1


def _slowed(data, factor):
    slowed = copy.deepcopy(data)
    for row in slowed["rows"]:
        if "median_ms" in row:
            row["median_ms"] *= factor
            row["throughput"] /= factor
            row["samples_ms"] = [t * factor for t in row["samples_ms"]]
    return slowed


@pytest.fixture
def quiet_results(results, tmp_path):
    """The run's rows with samples spread by +-1% around their median: a run on a quiet machine."""
    data = json.loads(results.read_text())
    rng = np.random.default_rng(1)
    for row in data["rows"]:
        if "median_ms" in row:
            row["samples_ms"] = list(row["median_ms"] * rng.uniform(0.99, 1.01, size=20))
            row["q20_ms"], row["q80_ms"] = np.quantile(row["samples_ms"], [0.2, 0.8]).tolist()
    path = tmp_path / "quiet.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("factor,expected", [(1.0, 0), (1.03, 0), (1.2, 1), (0.5, 0)])
def test_compare_gate(quiet_results, tmp_path, capsys, factor, expected):
    current = tmp_path / "current.json"
    current.write_text(json.dumps(_slowed(json.loads(quiet_results.read_text()), factor)))
    assert (
        main(["--compare", str(quiet_results), "--results", str(current), "--threshold", "0.05"]) == expected
    )
    printed = capsys.readouterr().out
    assert ("REGRESSION" in printed) == bool(expected)
    assert "shared cases" in printed


def test_compare_says_inconclusive_when_the_samples_cannot_tell(quiet_results, tmp_path, capsys):
    data = json.loads(quiet_results.read_text())
    rng = np.random.default_rng(0)
    for row in data["rows"]:
        if "median_ms" in row:  # the baseline's own samples, each scattered by ~30%: far past 5%
            row["samples_ms"] = [t * rng.lognormal(0.0, 0.3) for t in row["samples_ms"]]
    current = tmp_path / "current.json"
    current.write_text(json.dumps(data))
    assert main(["--compare", str(quiet_results), "--results", str(current)]) == 3
    assert "inconclusive: noise too high" in capsys.readouterr().out


def test_compare_files_without_samples_use_the_medians(quiet_results, tmp_path, capsys):
    data = json.loads(quiet_results.read_text())
    for row in data["rows"]:
        row.pop("samples_ms", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    current = tmp_path / "current.json"
    current.write_text(json.dumps(_slowed(json.loads(quiet_results.read_text()), 1.2)))
    assert main(["--compare", str(old), "--results", str(current)]) == 1
    assert "without samples, compared on medians alone" in capsys.readouterr().out


def test_paired_ratio_interval_holds_the_true_ratio():
    rng = np.random.default_rng(3)
    drift = rng.lognormal(0, 0.5, size=40)  # load that changes from round to round, the same for both
    baseline = drift * rng.lognormal(0, 0.05, size=40)
    candidate = 1.25 * drift * rng.lognormal(0, 0.05, size=40)
    ratio = stats.paired_ratio(baseline, candidate)
    assert ratio.low < 1.25 < ratio.high and ratio.high - ratio.low < 0.1
    assert ratio.verdict(0.05) == stats.REGRESSION and ratio.verdict(0.5) == stats.WITHIN
    unpaired = stats.unpaired_ratio(baseline, candidate)  # the drift is noise to an unpaired comparison
    assert unpaired.high - unpaired.low > ratio.high - ratio.low


def test_ratio_refuses_bad_samples():
    with pytest.raises(ValueError, match="baseline must be"):
        stats.paired_ratio([1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="one baseline and one candidate time per round"):
        stats.paired_ratio([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        stats.unpaired_ratio([1.0], [1.0], confidence=1.0)


def test_fraction_of_peak_is_never_above_one():
    assert peaks.fraction_of(50.0, 100.0) == 0.5
    assert peaks.fraction_of(150.0, 100.0) is None  # the op beat the measured peak: no trustworthy peak
    assert peaks.fraction_of(1.0, None) is None
    assert report._percent(None) == "n/a" and report._percent(0.5) == "50%"


def test_compare_rejects_a_file_that_is_not_results(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a benchmark results file"):
        main(["--compare", str(bad), "--results", str(bad)])


def test_unknown_op_is_refused():
    with pytest.raises(SystemExit, match="unknown op"):
        main(["--quick", "--ops", "convolution"])


def test_work_counts():
    shape = cases.shape_of("vit_base_patch16_224", 2)
    assert (shape.tokens, shape.dim, shape.heads, shape.hidden) == (197, 768, 12, 3072)
    mlp = cases.build_case("mlp", shape)
    assert mlp.work("forward", 4) == (4.0 * 2 * 197 * 768 * 3072, "TFLOP/s")
    assert mlp.work("full", 4)[0] == 3 * mlp.work("forward", 4)[0]
    norm = cases.build_case("layer_norm", shape)
    assert norm.work("forward", 2) == (4 * 2 * 197 * 768 * 2, "GB/s")


def test_plots_have_a_panel_per_shape_and_log_axes_for_wide_ranges(results, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(results.read_text())["rows"]
    written = report.plot(rows, tmp_path)
    assert {p.name for p in written} >= {"speedup_layer_norm.png", "speedup_bias_gelu.png"}
    assert all(p.stat().st_size > 10_000 for p in written)
    fig = report._speedup_figure(
        plt,
        "layer_norm",
        [r for r in rows if r.get("op") == "layer_norm" and "median_ms" in r and r["backend"] != "torch"],
    )
    assert len(fig.axes) == len({r["shape"] for r in rows if r.get("op") == "layer_norm"})
    plt.close(fig)
    fig, (narrow, wide) = plt.subplots(1, 2)
    report._log_if_wide(narrow, [17.0, 55.0], "x")
    report._log_if_wide(wide, [17.0, 55.0, 41_000.0], "x")
    assert (narrow.get_xscale(), wide.get_xscale()) == ("linear", "log")
    plt.close(fig)
