"""The benchmark harness: a small real run writes valid rows, and the regression gate flags a
slowdown past the threshold and passes otherwise. (No timing assertions: only the plumbing.)"""

import copy
import json

import pytest

from benchmarks import cases
from benchmarks.__main__ import main


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    code = main(["--quick", "--device", "cpu", "--ops", "layer_norm,bias_gelu", "--modes", "forward,backward",
                 "--no-models", "--no-compile", "--out", str(out)])
    assert code == 0
    return out


def test_rows_carry_every_field(results):
    data = json.loads(results.read_text())
    timed = [r for r in data["rows"] if "median_ms" in r]
    assert timed, data["rows"]
    for row in timed:
        for field in ("op", "shape", "dtype", "backend", "mode", "median_ms", "q20_ms", "q80_ms", "throughput",
                      "device", "torch", "triton", "git_sha"):
            assert field in row, f"{field} missing from {row}"
        assert row["q20_ms"] <= row["median_ms"] <= row["q80_ms"]
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
    return slowed


@pytest.mark.parametrize("factor,expected", [(1.0, 0), (1.03, 0), (1.2, 1), (0.5, 0)])
def test_compare_gate(results, tmp_path, capsys, factor, expected):
    current = tmp_path / "current.json"
    current.write_text(json.dumps(_slowed(json.loads(results.read_text()), factor)))
    assert main(["--compare", str(results), "--results", str(current), "--threshold", "0.05"]) == expected
    printed = capsys.readouterr().out
    assert ("REGRESSION" in printed) == bool(expected)
    assert "shared cases" in printed


def test_compare_rejects_a_file_that_is_not_results(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a benchmark results file"):
        main(["--compare", str(bad), "--results", str(bad)])


def test_unknown_op_is_refused():
    with pytest.raises(SystemExit, match="unknown op"):
        main(["--quick", "--ops", "convolution", "--no-models"])


def test_work_counts():
    shape = cases.shape_of("vit_base_patch16_224", 2)
    assert (shape.tokens, shape.dim, shape.heads, shape.hidden) == (197, 768, 12, 3072)
    mlp = cases.build_case("mlp", shape)
    assert mlp.work("forward", 4) == (4.0 * 2 * 197 * 768 * 3072, "TFLOP/s")
    assert mlp.work("full", 4)[0] == 3 * mlp.work("forward", 4)[0]
    norm = cases.build_case("layer_norm", shape)
    assert norm.work("forward", 2) == (4 * 2 * 197 * 768 * 2, "GB/s")
