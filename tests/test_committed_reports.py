"""The committed GPU compile report is a passing one, and docs/gpu-readiness.md shows its sm_90 table as
it is (regenerate both with `make check-gpu` and copy build/check-gpu/report.* to benchmarks/results/)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "results" / "check-gpu-sm80-sm90"
PAGE = ROOT / "docs" / "gpu-readiness.md"  # the page that shows the sm_90 table; the README links it


def sm90_table(markdown: str) -> str:
    match = re.search(r"^\| kernel \(sm_90\).*?(?=\n\n|\n?\Z)", markdown, re.S | re.M)
    assert match, "no sm_90 table"
    return match.group(0)


def test_committed_gpu_report_has_no_failures_and_covers_both_targets():
    report = json.loads(REPORT.with_suffix(".json").read_text())
    assert report["failures"] == []
    variants = report["variants"]
    assert {v["target"] for v in variants} == {"sm_80", "sm_90"}
    assert all(v["error"] is None and v["spill_bytes"] == 0 for v in variants)
    header = REPORT.with_suffix(".md").read_text().splitlines()[2]
    assert header.endswith(f"{report['environment']['variants']} variants compiled, 0 failures."), header


def test_docs_show_the_committed_sm90_table():
    committed = sm90_table(REPORT.with_suffix(".md").read_text())
    page = PAGE.read_text()
    assert sm90_table(page) == committed, (
        f"{PAGE.relative_to(ROOT)}'s sm_90 table differs from the committed report"
    )
    assert f"]({PAGE.relative_to(ROOT)})" in (ROOT / "README.md").read_text(), "README does not link the page"
