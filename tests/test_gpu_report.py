"""make gpu-report's CPU path: the report files are written, whole and well-formed, say when there is
no GPU, and list what a spent time budget left out; the targets table; the host-cost table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_report, host_overhead, targets
from benchmarks.budget import Budget, shares
from benchmarks.gpu_report_sections import Context
from tools import gpu_tests
from vit_kernels import backend

ROOT = Path(__file__).resolve().parent.parent

CPU_PART = "environment,gpu_tests,selftest,host_overhead,block_traffic"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-report")
    assert gpu_report.main(["--out", str(out), "--quick", "--ops", "layer_norm", "--sections", CPU_PART]) == 0
    return out


def test_files_are_written_whole_and_well_formed(written):
    assert sorted(p.name for p in written.iterdir()) == [
        "gpu-report.json",
        "gpu-report.md",
    ]  # no partial file left
    data = json.loads((written / "gpu-report.json").read_text())
    assert list(data["sections"]) == CPU_PART.split(",")
    assert all(s["status"].startswith("ok") for s in data["sections"].values()), data["sections"]
    assert data["sections"]["environment"]["result"]["git_sha"]
    assert {t["target"] for t in data["targets"]} == {t.what for t in targets.TARGETS}
    checks = data["sections"]["selftest"]["result"]["checks"]
    assert checks and all(c["op"] == "layer_norm" for c in checks)
    assert all({"max_error", "pytorch_error", "error_ratio"} <= set(c) for c in checks if "skipped" not in c)
    tests = data["sections"]["gpu_tests"]["result"]
    assert isinstance(tests["collected"], int) and tests["collected"] + tests["deselected"] > 0
    (row,) = data["sections"]["host_overhead"]["result"]["rows"]
    assert row["op"] == "layer_norm" and isinstance(row["pytorch"], float) and row["triton"].startswith("n/a")
    markdown = (written / "gpu-report.md").read_text()
    traffic = data["sections"]["block_traffic"]["result"]
    assert traffic["model"] == "vit_tiny" and set(traffic["rows"]) == {"torch", "triton", "extension"}
    for heading in (
        "# vit-kernels GPU report",
        "## Sections",
        "## Targets",
        "## GPU tests",
        "## Selftest",
        "## Host cost per call",
        "## Kernels and bytes of one block",
    ):
        assert heading in markdown
    if not torch.cuda.is_available():
        assert not data["gpu"] and gpu_report.NO_GPU in markdown


def test_spent_budget_is_reported_not_run():
    sections = gpu_report.run_sections(
        Context(torch.device("cpu"), quick=True, ops=("layer_norm", "linear")), ["host_overhead"], total_s=0.0
    )
    section = sections["host_overhead"]
    assert section["result"]["rows"] == [] and section["skipped"] == ["layer_norm", "linear"]
    assert "budget spent" in section["status"]


def test_budget_admits_while_the_expected_item_fits():
    now = [0.0]
    budget = Budget(10.0, clock=lambda: now[0])
    assert budget.admit("a")
    now[0] = 4.0
    assert budget.admit("b")  # 6 s left, items take 4 s
    now[0] = 8.0
    assert not budget.admit("c") and not budget.admit("d", need_s=0.5)  # 2 s left < 4 s expected
    assert budget.summary()["skipped"] == ["c", "d"]
    assert shares({"x": 100.0, "y": 300.0}, 200.0) == {"x": 50.0, "y": 150.0}
    assert shares({"x": 100.0}, 500.0) == {"x": 100.0}


def test_targets_compare_measured_rows():
    shape = "vit_base_patch16_224 B=128 L=197 D=768"
    rows = [
        {
            "kind": "op",
            "op": "attention",
            "shape": shape,
            "dtype": "bfloat16",
            "mode": "forward",
            "backend": "triton",
            "median_ms": 0.08,
        },
        {
            "kind": "op",
            "op": "attention",
            "shape": shape,
            "dtype": "bfloat16",
            "mode": "forward",
            "backend": "sdpa_cudnn",
            "median_ms": 0.01,
        },
        {
            "kind": "op",
            "op": "linear_gelu",
            "shape": shape,
            "dtype": "bfloat16",
            "mode": "forward",
            "backend": "auto",
            "median_ms": 0.3,
        },
    ]
    found = {t["target"]: t for t in targets.compare(rows)}
    assert (
        found["attention fwd"]["measured"] == 0.08
        and found["attention fwd"]["met"]
        and found["attention fwd"]["by"] == "triton"
    )
    assert found["attention fwd"]["unit"] == "ms" and found["attention fwd"]["at"] == "at most"
    assert found["linear_gelu fwd"]["measured"] == 0.3 and found["linear_gelu fwd"]["met"] is False
    assert found["mlp fwd+bwd"]["measured"] is None and found["mlp fwd+bwd"]["met"] is None


def test_host_overhead_table():
    row = host_overhead.measure_op("linear", torch.device("cpu"), calls=5, rounds=2)
    assert list(row) == ["op", *host_overhead.COLUMNS]
    assert all(isinstance(row[c], float) and row[c] > 0 for c in ("pytorch", "torch", "auto"))
    assert row["triton"] == "n/a: Triton runs only interpreted on the CPU"
    text = host_overhead.table([row])
    header, line = text.splitlines()[:2]
    assert header.split() == ["op", "(us/call)", *host_overhead.COLUMNS]
    assert line.split()[0] == "linear" and line.split()[1 + host_overhead.COLUMNS.index("triton")] == "n/a"
    if backend._native_key is not None:  # the extension is built: the torch backend with the Python key
        assert isinstance(row["torch-pykey"], float) and row["torch-pykey"] > 0
    else:
        assert row["torch-pykey"].startswith("n/a: the extension is not built")
    assert "| linear |" in host_overhead.table([row], markdown=True)


def test_host_overhead_cli(tmp_path, capsys):
    assert (
        host_overhead.main(
            [
                "--device",
                "cpu",
                "--ops",
                "layer_norm",
                "--calls",
                "3",
                "--rounds",
                "1",
                "--json",
                str(tmp_path / "h.json"),
            ]
        )
        == 0
    )
    assert "layer_norm" in capsys.readouterr().out
    assert json.loads((tmp_path / "h.json").read_text())["rows"][0]["op"] == "layer_norm"


def test_a_gpu_test_run_stopped_by_its_budget_reports_what_ran():
    from benchmarks import gpu_report_markdown
    from tools import gpu_tests

    output = "....F.s.. [ 10%]\n.E........ [ 20%]\n"
    assert gpu_tests.progress(output) == {"passed": 16, "failed": 1, "errors": 1, "skipped": 1}
    text = "\n".join(
        gpu_report_markdown._gpu_tests(
            {
                "ran": True,
                "timed_out": True,
                "why": "stopped after 90 s",
                "counts_so_far": gpu_tests.progress(output),
                "tail": [],
            }
        )
    )
    assert "by then 16 passed, 1 failed, 1 errors, 1 skipped" in text
    assert gpu_tests.FIRST[:2] == ("test_table_defaults.py", "test_tiles.py")


def test_the_gpu_tests_run_the_first_files_first_and_every_file_once():
    """pytest orders a folder passed beside some of its own files by the folder: the ordered list
    must collect the FIRST files first, and exactly the tests the folder holds."""
    from tools import gpu_tests

    def collected(paths: list[str]) -> list[str]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--collect-only",
                "-m",
                "gpu",
                *paths,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if "::" in line]

    ordered = collected(gpu_tests.ordered_test_files())
    assert ordered[0].startswith("tests/" + gpu_tests.FIRST[0] + "::")
    files = list(dict.fromkeys(node.split("::")[0] for node in ordered))
    first = ["tests/" + name for name in gpu_tests.FIRST]
    assert files[: len(first)] == first
    assert sorted(ordered) == sorted(collected(["tests"]))
    halves = gpu_tests.ordered_test_files("headline") + gpu_tests.ordered_test_files("rest")
    assert halves == gpu_tests.ordered_test_files()
    assert [Path(f).name for f in gpu_tests.ordered_test_files("headline")] == list(gpu_tests.HEADLINE)
    with pytest.raises(ValueError, match="part must be"):
        gpu_tests.ordered_test_files("first")


def test_pytest_exit_5_is_a_failure():
    """``pytest -m gpu`` collecting nothing on a GPU (exit 5) fails the report's GPU-test section."""
    assert (
        gpu_tests.passed(0) and not gpu_tests.passed(gpu_tests.NO_TESTS_COLLECTED) and not gpu_tests.passed(1)
    )
    assert gpu_tests.counts("3 failed, 40 passed, 2 skipped, 1 error in 9.1s") == {
        "passed": 40,
        "failed": 3,
        "skipped": 2,
        "errors": 1,
        "deselected": 0,
    }


def test_the_per_op_table_has_one_schema_and_a_second_run_of_a_day_a_suffix(tmp_path):
    """The ops section's rows as ``ops-<gpu>-<date>.json``: a top-level device, rows of op, shape
    (the model, then B=<batch>), mode (fwd | fwd+bwd), variant and the three quantiles; a second run
    the same day gets ``-2``, while a run's own later writes keep its name."""
    from benchmarks import report

    timed = {
        "kind": "op",
        "op": "attention",
        "shape": "vit_base_patch16_224 B=128 L=197 D=768",
        "dtype": "bfloat16",
    }
    rows = [
        {**timed, "backend": "sdpa_cudnn", "mode": "full", "median_ms": 0.8, "q20_ms": 0.79, "q80_ms": 0.82},
        {**timed, "backend": "auto", "mode": "forward", "median_ms": 0.1, "q20_ms": 0.09, "q80_ms": 0.11},
        {**timed, "backend": "triton", "mode": "all", "skipped": "not here"},
    ]
    first = report.write_op_table(tmp_path, "NVIDIA H200", "h200", "2026-12-04", rows)
    assert first.name == "ops-h200-2026-12-04.json"
    assert report.write_op_table(tmp_path, "NVIDIA H200", "h200", "2026-12-04", rows, first) == first
    second = report.write_op_table(tmp_path, "NVIDIA H200", "h200", "2026-12-04", rows)
    assert second.name == "ops-h200-2026-12-04-2.json"
    table = json.loads(first.read_text())
    assert table["device"] == "NVIDIA H200" and table["rows"] == [
        {
            "op": "attention",
            "shape": "vit_base_patch16_224 B=128",
            "mode": "fwd+bwd",
            "variant": "cudnn",
            "dtype": "bfloat16",
            "median_ms": 0.8,
            "q20_ms": 0.79,
            "q80_ms": 0.82,
        },
        {
            "op": "attention",
            "shape": "vit_base_patch16_224 B=128",
            "mode": "fwd",
            "variant": "vk",
            "dtype": "bfloat16",
            "median_ms": 0.1,
            "q20_ms": 0.09,
            "q80_ms": 0.11,
        },
    ]
