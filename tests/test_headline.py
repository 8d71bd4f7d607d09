"""python -m benchmarks e2e: the end-to-end table's rows (model, mode, batch, variant, images/s, the
first step's seconds, the profile's shares), its variants, its markdown with the targets, and the
files it keeps after every row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from benchmarks import headline, profile
from vit.model import ViT, get_config

CPU = torch.device("cpu")
CPU_OUT = Path("unwritten")  # where a run whose writes are stubbed out would write
DIGITS = headline.spec_named("vit_digits")


@pytest.mark.parametrize("variant,backend", [("eager", "torch"), ("vk", "auto")])
def test_an_eager_row_has_its_images_per_second_first_step_and_profile(variant, backend, monkeypatch):
    used = []
    monkeypatch.setattr(headline, "_step", _spy(headline._step, used))
    monkeypatch.setattr(
        headline, "PROFILED", (variant,)
    )  # the compiled variants, profiled, take minutes here
    model = ViT(get_config("vit_digits"))
    row = headline.measure(DIGITS, "infer", 2, variant, CPU, torch.float32, model, True)
    assert {"model", "mode", "batch", "variant", "images_per_second", "first_step_s", "median_ms"} <= set(row)
    assert (row["model"], row["mode"], row["batch"], row["variant"]) == ("vit_digits", "infer", 2, variant)
    assert row["images_per_second"] > 0 and row["first_step_s"] > 0
    kernels = row["profile"]
    assert (
        kernels
        and all(0 < k["share"] <= 1 for k in kernels)
        and sum(k["share"] for k in kernels) == pytest.approx(1)
    )
    assert {k["kind"] for k in kernels} >= {"GEMM", "attention", "normalization"}, kernels
    assert used == [(backend, False, None)]
    # vk's profiled row also times a new process's first step (its caches on disk warm), eager's not
    assert (row.get("first_step_warm_s", 0) > 0) == (variant == "vk"), row
    assert "host_profile" not in row  # batch 2


@pytest.mark.parametrize("variant", ["eager", "vk", "compile"])
def test_a_batch_1_row_of_eager_or_vk_has_the_hosts_time_per_op(variant):
    model = ViT(get_config("vit_digits"))
    row = headline.measure(DIGITS, "infer", 1, variant, CPU, torch.float32, model, False)
    assert row["images_per_second"] > 0, row
    if variant == "compile":
        assert "host_profile" not in row
        return
    ops = row["host_profile"]
    assert ops["all"] >= max(us for name, us in ops.items() if name != "all") > 0
    assert any(name.startswith("aten::") for name in ops), ops
    line = next(line for line in _markdown_of([row]).splitlines() if line.startswith("- "))
    assert line.startswith(f"- vit_digits infer B=1 {variant} (all ops "), line


def test_a_failed_first_step_in_a_new_process_names_its_error():
    with pytest.raises(RuntimeError, match="first step in a new process failed: .*no_such_model"):
        headline.first_step_in_a_new_process("no_such_model", "train", 2, CPU, torch.float32)


def _spy(step, used):
    def spied(module, backend, compiled, device, dtype, mode, batches, compile_mode=None):
        used.append((backend, compiled, compile_mode))
        return step(module, backend, compiled, device, dtype, mode, batches, compile_mode)

    return spied


def test_variants_are_the_six_and_cuda_graphs_need_cuda():
    model = ViT(get_config("vit_digits"))
    setups = {v: headline.variant_setup(v, model, "vit", CPU) for v in headline.VARIANTS}
    assert setups["compile-cudagraphs"] == setups["vk+compile-cudagraphs"] == "CUDA only"
    assert [(v, s[1], s[2], s[3]) for v, s in setups.items() if not isinstance(s, str)] == [
        ("eager", "torch", False, None),
        ("compile", "torch", True, None),
        ("vk", "auto", False, None),
        ("vk+compile", "auto", True, None),
    ]


def test_the_rows_users_run_come_in_order_with_unambiguous_names():
    names = [m.name for m in headline.FULL_MODELS]
    assert names == [
        "timm:vit_base_patch16_224",
        "vit_base_patch16_224",
        "vit_small_patch16_224",
        "timm:vit_large_patch16_384",
        "timm:vit_so400m_patch14_siglip_384",
        "timm:vit_large_patch14_dinov2",
    ]
    first, ours, *towers = headline.FULL_MODELS
    assert first.variants == ours.variants == headline.VARIANTS and first.source == "timm" != ours.source
    assert first.runs == ours.runs == (("train", 128), ("infer", 256), ("infer", 1))
    assert all(
        t.variants == ("compile", "vk+compile") and t.runs == (("train", 128), ("infer", 256)) for t in towers
    )
    assert headline.QUICK_MODELS[0].name.startswith("timm:")


def _markdown_of(rows: list[dict]) -> str:
    report = {
        "device": "x",
        "date": "d",
        "commit": "c",
        "versions": {"torch": "t", "triton": "r"},
        "dtype": "bfloat16",
        "rows": rows,
    }
    return headline.markdown(report)


def test_the_markdown_states_each_target_or_says_not_measured():
    rows = [
        {
            "model": "vit_base_patch16_224",
            "mode": "train",
            "batch": 128,
            "variant": v,
            "images_per_second": ips,
            "first_step_s": 1.0,
        }
        for v, ips in (("eager", 2457.0), ("vk", 2531.0), ("compile", 3180.0), ("vk+compile", 3600.0))
    ]
    rows[1]["first_step_warm_s"] = 0.4
    text = _markdown_of(rows)
    assert (
        "| vit_base_patch16_224 | train | 128 | 2,457 (1.0 s) | 3,180 (1.0 s) | not measured | "
        "2,531 (1.0 s; 0.4 s warm) | 3,600 (1.0 s) | not measured | 1.030x | 1.132x | - |" in text
    )
    assert "vk+compile >= 1.10x compile | 1.132x | yes |" in text
    assert "vk >= 1.05x eager | 1.030x | no |" in text
    assert "infer B=256: vk+compile >= 1.05x compile | not measured | not measured |" in text


def test_the_markdown_gives_the_profile_by_kind_its_gaps_to_roofline_and_every_kernel():
    cat = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>, 4>(int, unsigned)"
    kernels = [
        {"kernel": "nvjet_sm90_tst_192x192", "kind": "GEMM", "ms": 6.0, "share": 0.6, "calls": 36},
        {"kernel": cat, "kind": "copies", "ms": 3.0, "share": 0.3, "calls": 12},
        {"kernel": "triton_poi_fused_gelu_0", "kind": "element-wise", "ms": 1.0, "share": 0.1, "calls": 12},
    ]
    work = [(119e9 * 3, "FLOP", 595.0, 0.85), (2.9e8, "B", 96.7, 0.02), (None, "", None, None)]
    for k, (amount, unit, achieved, fraction) in zip(kernels, work):
        k.update(work=amount, work_unit=unit, achieved=achieved, fraction_of_peak=fraction)
    row = {
        "model": "vit_base_patch16_224",
        "mode": "train",
        "batch": 128,
        "variant": "compile",
        "images_per_second": 2642.0,
        "first_step_s": 2.4,
        "median_ms": 10.0,
        "profile": kernels,
    }
    text = _markdown_of([row])
    assert "| GEMM | 6.00 | 60.0% |" in text and "| copies | 3.00 | 30.0% |" in text
    gaps = [line for line in text.splitlines() if line.startswith("- ") and "lost" in line]
    assert gaps[0].startswith(
        "- CatArrayBatchedCopy (copies): 3.00 ms at 96.7 GB/s (2% of peak), 2.94 ms lost"
    ), gaps
    assert (
        "| nvjet_sm90_tst_192x192 | GEMM | 36 | 6.000 | 60.0% | 357.00 GFLOP | 595.0 TFLOP/s (85% of peak) |"
        in text
    )
    assert "| triton_poi_fused_gelu_0 | element-wise | 12 | 1.000 | 10.0% | - | - |" in text
    assert profile.short_name("aten::addmm") == "aten::addmm"


def test_kinds_and_work_come_from_the_names_and_shapes():
    assert [
        profile.kind_of(n)
        for n in (
            "nvjet_sm90_tst",
            "_attention_bwd_dq_kernel",
            "triton_per_fused_native_layer_norm_3",
            "multi_tensor_apply_kernel",
            "triton_poi_fused_gelu_1",
            "aten::cat",
        )
    ] == ["GEMM", "attention", "normalization", "optimizer", "element-wise", "copies"]

    class Op:
        def __init__(self, name, shapes, flops=0):
            self.name, self.input_shapes, self.flops = name, shapes, flops

    assert profile.work_of(Op("aten::addmm", [[3072], [25216, 768], [768, 3072]], 1e11), 2) == (1e11, "FLOP")
    sdpa = profile.work_of(
        Op("aten::_scaled_dot_product_cudnn_attention", [[128, 12, 197, 64], [128, 12, 197, 64]]), 2
    )
    assert sdpa == (4.0 * 128 * 12 * 197 * 197 * 64, "FLOP")
    assert profile.work_of(Op("aten::gelu", [[25216, 3072], []]), 2) == (2 * 25216 * 3072 * 2.0, "B")
    assert profile.work_of(Op("aten::transpose", [[25216, 768], [], []]), 2) == (None, "")


def test_a_run_keeps_its_files_after_every_row(tmp_path, monkeypatch):
    """Rows are written as they finish: a run cut short (here by its budget) keeps the rows that ran."""
    spec = headline.Model("vit_digits", ("eager", "vk", "compile"), (("infer", 2),))
    monkeypatch.setattr(headline, "QUICK_MODELS", (spec,))
    seen = []

    def measured(*args, **kwargs):
        seen.append(args[3])
        if len(seen) == 2:
            monkeypatch.setattr(headline.time, "perf_counter", lambda: float("inf"))  # the budget is spent
        return {
            "model": "vit_digits",
            "mode": "infer",
            "batch": 2,
            "variant": args[3],
            "images_per_second": 1.0,
            "first_step_s": 0.5,
            "median_ms": 2.0,
        }

    monkeypatch.setattr(headline, "measure", measured)
    report = headline.run(CPU, True, tmp_path, 60.0, say=lambda text: None)
    (stem,) = {p.stem for p in tmp_path.iterdir()}
    assert stem.startswith("e2e-cpu-")
    written = json.loads((tmp_path / f"{stem}.json").read_text())
    assert [r["variant"] for r in written["rows"]] == seen == ["eager", "vk"] and written == report
    assert {"device", "date", "commit", "versions", "dtype", "rows"} <= set(written)
    assert "| vit_digits | infer | 2 |" in (tmp_path / f"{stem}.md").read_text()


def test_bad_arguments_name_the_option(tmp_path):
    with pytest.raises(SystemExit):
        headline.main(["--budget", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--out"):
        (tmp_path / "file").write_text("")
        headline.main(["--out", str(tmp_path / "file")])


def test_the_tuned_row_runs_vk_after_vk_tune_in_a_new_process_that_leaves_this_ones_decisions_alone():
    """``vk-tuned``: the search in a child, then its steps; this process's decisions are not touched
    by it. Elsewhere than the first model's training row it says why it was not measured."""
    from vit_kernels import _tiles, backend

    before = (dict(backend.TUNED), dict(_tiles.TUNED))
    model = ViT(get_config("vit_digits"))
    row = headline.measure(DIGITS, "train", 8, headline.TUNED, CPU, torch.float32, model, True)
    assert row["tune_s"] > 0 and row["signatures"] > 0 and row["first_step_s"] > 0, row
    assert row["images_per_second"] == pytest.approx(8 / (row["median_ms"] * 1e-3))
    assert (backend.TUNED, _tiles.TUNED) == before
    elsewhere = headline.measure(DIGITS, "infer", 8, headline.TUNED, CPU, torch.float32, model, False)
    assert elsewhere["skipped"] == "measured in the first model's training row only"


def test_the_tuned_variant_runs_only_when_asked_after_the_others_and_the_markdown_gives_its_gain():
    measured = []

    def measure(*args, **kwargs):
        measured.append(args[3])
        row = {"model": "vit_digits", "mode": "train", "batch": 8, "variant": args[3]}
        row.update(images_per_second=100.0, first_step_s=0.5, median_ms=80.0)
        return {**row, "tune_s": 9.0} if args[3] == headline.TUNED else row

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(headline, "QUICK_MODELS", (headline.Model("vit_digits", runs=(("train", 8),)),))
        patch.setattr(headline, "measure", measure)
        patch.setattr(headline, "write_files", lambda stem, report: None)
        headline.run(CPU, True, CPU_OUT, 60.0, say=lambda text: None)
        assert headline.TUNED not in measured
        measured.clear()
        headline.run(CPU, True, CPU_OUT, 60.0, say=lambda text: None, tuned=True)
    assert measured == [*headline.VARIANTS, headline.TUNED]
    rows = [
        {
            "model": "m",
            "mode": "train",
            "batch": 128,
            "variant": v,
            "images_per_second": ips,
            "first_step_s": 2.0,
        }
        for v, ips in (("vk", 3000.0), (headline.TUNED, 3150.0))
    ]
    rows[1]["tune_s"] = 95.0
    text = _markdown_of(rows)
    assert " | vk+compile-cudagraphs | vk-tuned |" in text and "tune: vk.tune's seconds" in text
    assert "| 3,000 (2.0 s) |" in text and "| 3,150 (tune 95.0 s; 2.0 s) |" in text
    assert (
        "m train B=128: vk-tuned / vk = 1.050x (what searching gains over the tables), for a search of 95.0 s."
        in text
    )
    assert "vk-tuned" not in _markdown_of(rows[:1])


def test_no_ratio_compares_different_modes():
    """Every ratio in the table and the targets is a vk variant over plain PyTorch in its mode."""
    rows = [
        {
            "model": "m",
            "mode": "infer",
            "batch": 1,
            "variant": v,
            "images_per_second": 1.0 + i,
            "first_step_s": 1.0,
        }
        for i, v in enumerate(headline.VARIANTS)
    ]
    text = _markdown_of(rows)
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    pairs = re.findall(r"([\w+-]+) / ([\w+-]+)", header) + re.findall(r"(\S+) >= [\d.]+x (\S+) \|", text)
    assert pairs and all(headline.OVER[a] == b for a, b in pairs), pairs
    assert "| m | infer | 1 |" in text and "6.000x" not in text
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for a, b in re.findall(r"`?(vk[\w+-]*)`? (?:over|against|/) `?([\w+-]+)`?", readme):
        assert headline.OVER.get(a.rstrip(",.")) == b.rstrip(",."), (a, b)


def test_a_training_batch_that_does_not_fit_is_halved(monkeypatch):
    spec = headline.Model("vit_digits", ("vk",), (("train", 8), ("infer", 8)))
    monkeypatch.setattr(headline, "QUICK_MODELS", (spec,))
    monkeypatch.setattr(headline, "SMALLEST_TRAIN_BATCH", 2)
    monkeypatch.setattr(headline, "write_files", lambda stem, report: None)
    tried = []

    def measure(spec, mode, batch, variant, *args):
        tried.append((mode, batch))
        row = {"model": spec.name, "mode": mode, "batch": batch, "variant": variant}
        return (
            {**row, "invalid": "out of memory", "out_of_memory": True}
            if batch > 2
            else {**row, "images_per_second": 1.0, "first_step_s": 1.0}
        )

    monkeypatch.setattr(headline, "measure", measure)
    headline.run(CPU, True, CPU_OUT, 60.0, say=lambda text: None)
    assert tried == [("train", 8), ("train", 4), ("train", 2), ("infer", 8)]  # inference is not halved


def test_models_runs_only_the_rows_named_and_a_wrong_name_is_refused(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(
        headline,
        "measure",
        lambda spec, *args: (
            ran.append(spec.name)
            or {"model": spec.name, "mode": args[0], "batch": args[1], "variant": args[2], "skipped": "x"}
        ),
    )
    monkeypatch.setattr(headline, "write_files", lambda stem, report: None)
    headline.run(CPU, True, CPU_OUT, 60.0, say=lambda text: None, models=["vit_digits"])
    assert set(ran) == {"vit_digits"}
    with pytest.raises(SystemExit, match="--models must name rows of"):
        headline.main(["--quick", "--models", "vit_nope", "--out", str(tmp_path)])
