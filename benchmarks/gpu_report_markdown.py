"""The markdown of a GPU report (``benchmarks.gpu_report``): a summary of the sections and their time
budgets, the targets beside the measured figures, then one part per section. The per-op table is
``benchmarks.report.markdown``'s, the host-cost table ``benchmarks.host_overhead.table``'s.
"""

from __future__ import annotations

from benchmarks import block_traffic, host_overhead, report, targets


def _g(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return str(value)


def _cell(text: str, width: int = 80) -> str:
    """One table cell: first line only (a Triton CompilationError spans many), no pipes."""
    return (text.splitlines() or [""])[0][:width].replace("|", "/")


def _header(data: dict) -> list[str]:
    env = data["sections"].get("environment", {}).get("result") or {}
    lines = ["# vit-kernels GPU report", ""]
    if not data["gpu"]:
        lines += [f"**{data['note']}**", ""]
    if data.get("triton_interpret"):
        lines += [
            "**TRITON_INTERPRET was set: the Triton backend ran interpreted, so its figures are not the "
            "kernels' (make gpu-report unsets it).**",
            "",
        ]
    device = env.get("device", data.get("device", "?"))
    extra = ", ".join(f"{k} {env[k]}" for k in ("capability", "sms", "memory_gib") if env.get(k) is not None)
    lines += [
        f"- device: {device}{f' ({extra})' if extra else ''}; driver {_g(env.get('driver'))}",
        f"- torch {_g(env.get('torch'))}, triton {_g(env.get('triton'))}, CUDA {_g(env.get('cuda'))}, "
        f"Python {_g(env.get('python'))}, timm {_g(env.get('timm'))}, vit_kernels {_g(env.get('vit_kernels'))}",
        f"- commit {_g(env.get('git_sha'))}; started {data['started']}; took {data['seconds']:.0f} s "
        f"(budget {data['total_budget_s']:.0f} s); command `{data['command']}`",
        "",
    ]
    return lines


def _summary(data: dict) -> list[str]:
    lines = [
        "## Sections",
        "",
        "| section | status | budget s | used s | left out (time budget spent) |",
        "|---|---|---:|---:|---|",
    ]
    for name, section in data["sections"].items():
        skipped = section.get("skipped") or []
        left_out = (
            f"{len(skipped)}: " + "; ".join(skipped[:6]) + (" ..." if len(skipped) > 6 else "")
            if skipped
            else ""
        )
        lines.append(
            f"| {name} | {section['status']} | {_g(section.get('budget_s'))} | {_g(section.get('used_s'))} | "
            f"{left_out} |"
        )
    return lines + [""]


def _targets(data: dict) -> list[str]:
    lines = [
        "## Targets",
        "",
        f"Source: {targets.SOURCE}. Ops: the best vit_kernels backend (torch, triton, extension, auto).",
        "",
        "| target | bound | measured | by | met |",
        "|---|---|---:|---|---|",
    ]
    for t in data["targets"]:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(
            f"| {t['target']} | {t['at']} {_g(t['bound'])} {t['unit']} | {_g(t['measured'])} | {_g(t['by'])} | {met} |"
        )
    return lines + [""]


def _gpu_tests(result: dict) -> list[str]:
    lines = ["## GPU tests (`pytest -m gpu`)", ""]
    if not result.get("ran", False):
        return lines + [f"Not run: {result.get('why', '')}", ""]
    if result.get("timed_out"):
        n = result.get("counts_so_far") or {}
        ran = ", ".join(f"{n.get(kind, 0)} {kind}" for kind in ("passed", "failed", "errors", "skipped"))
        return lines + [
            f"**Stopped**: {result['why']}; by then {ran} (`make test-gpu` runs them all).",
            "",
            "```text",
            *result.get("tail", []),
            "```",
            "",
        ]
    if "collected" in result:
        return lines + [
            f"{result.get('note', '')}: {result['collected']} selected, {result['deselected']} deselected "
            f"(`{result.get('summary', '')}`). With 0 selected, a GPU run fails (pytest exit 5).",
            "",
        ]
    verdict = "passed" if result.get("passed") else "**FAILED**"
    n = result["counts"]
    lines += [
        f"{verdict} (exit code {result['exit_code']}, {result['seconds']:.0f} s): `{result.get('summary', '')}`",
        "",
        "| passed | failed | errors | skipped | deselected |",
        "|---:|---:|---:|---:|---:|",
        f"| {n['passed']} | {n['failed']} | {n['errors']} | {n['skipped']} | {n['deselected']} |",
        "",
    ]
    if result.get("why"):
        lines += [result["why"], ""]
    if not result.get("passed") and result.get("tail"):
        lines += ["```text", *result["tail"], "```", ""]
    return lines


def _selftest(result: dict) -> list[str]:
    lines = [
        "## Selftest",
        "",
        f"{result['passed']} passed, {result['failed']} failed. Rule: {result['rule']}.",
        "",
        "| op | backend | dtype | device | result | error | PyTorch's error | ratio | worst tensor |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in result["checks"]:
        verdict = "skipped" if "skipped" in r else ("pass" if r["passed"] else "**FAIL**")
        lines.append(
            f"| {r['op']} | {r['backend']} | {r['dtype']} | {r['device']} | {verdict} | {_g(r.get('max_error'), 2)} | "
            f"{_g(r.get('pytorch_error'), 2)} | {_g(r.get('error_ratio'), 3)} | "
            f"{r.get('worst_tensor') or _cell(r.get('error') or r.get('skipped', ''))} |"
        )
    return lines + [""]


def _host(result: dict) -> list[str]:
    return [
        "## Host cost per call",
        "",
        f"Tiny tensors, forward, inputs requiring grad; median over {result['rounds']} "
        f"loops of {result['calls']} calls, synchronised around each loop; microseconds per call.",
        "",
        host_overhead.table(result["rows"], markdown=True),
        "",
    ]


def _traffic(result: dict) -> list[str]:
    return [
        "## Kernels and bytes of one block",
        "",
        block_traffic.title(result) + " (`python -m benchmarks.block_traffic --detail` lists each kernel).",
        "",
        block_traffic.table(result, markdown=True),
        "",
    ]


def _graphs(result: dict) -> list[str]:
    lines = ["## CUDA graphs", ""]
    if "skipped" in result:
        return lines + [f"Not run: {result['skipped']}.", ""]
    lines += [
        f"A training step (forward + backward, bf16 autocast) of {result['model']} captured with "
        "`torch.cuda.CUDAGraph` per backend.",
        "",
        "| backend | captured | replayed | replay ms | loss graph / eager | error |",
        "|---|---|---|---:|---|---|",
    ]
    for r in result["rows"]:
        loss = f"{r['loss']:.4g} / {r['eager_loss']:.4g}" if "loss" in r else ""
        lines.append(
            f"| {r['backend']} | {'yes' if r['captured'] else '**no**'} | {_g(r.get('replayed'))} | "
            f"{_g(r.get('replay_ms'))} | {loss} | {r.get('error', '')} |"
        )
    return lines + [""]


def _tile_table(rows: list[dict], title: str, key_header: str) -> list[str]:
    if not rows:
        return []
    lines = [
        f"## {title}",
        "",
        "Each candidate validated (2x PyTorch's own error) then timed on the call's inputs; ms or the reason "
        "it was excluded.",
        "",
        f"| kernel | {key_header} | chosen | candidates |",
        "|---|---|---|---|",
    ]
    for r in rows:
        trials = "; ".join(
            f"{tile}: {_g(trial) if isinstance(trial, float) else trial}"
            for tile, trial in r["candidates"].items()
        )
        lines.append(f"| {r['kernel']} | {', '.join(map(str, r['key']))} | {r['chosen']} | {trials} |")
    return lines + [""]


def _tiles(result: dict) -> list[str]:
    """The attention, LayerNorm, GEMM and patch_embed tiles chosen on this GPU, and every candidate's
    time or why it was excluded."""
    gemm_tile = "(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)"
    return (
        _tile_table(
            result.get("attention_tiles") or [],
            "Attention tiles chosen on this device",
            "dtype, head dim, L, B*H",
        )
        + _tile_table(
            result.get("layer_norm_tiles") or [],
            "LayerNorm tiles chosen on this device (forward: rows, "
            "warps; backward: rows, programs per SM, warps)",
            "device, dtype, padded D, residual / dS, weight, bias / d(w, b), rows bucket",
        )
        + _tile_table(
            result.get("gemm_tiles") or [],
            f"GEMM tiles chosen on this device {gemm_tile}",
            "device, A dtype, out dtype, bias, epilogue, GELU form, aux, residual, M bucket, N, K bucket, "
            "K slices, unit strides of A (m, k) and B (k, n)",
        )
        + _tile_table(
            result.get("patch_embed_tiles") or [],
            f"patch_embed forward tiles chosen on this device {gemm_tile}",
            "device, dtype, out dtype, bias, cls, pos, rows bucket, D, C*P*P, P, T, channels last",
        )
    )


def _timings(data: dict) -> list[str]:
    ops = (data["sections"].get("ops") or {}).get("result") or {}
    rows = ops.get("rows", [])
    if not rows:
        return []
    env = data["sections"].get("environment", {}).get("result") or {}
    meta = {k: env.get(k) for k in ("device", "torch", "triton", "git_sha")}
    return ["## Per op", "", report.markdown(rows, ops.get("peaks", {}), meta), ""]


PARTS = {
    "gpu_tests": _gpu_tests,
    "selftest": _selftest,
    "host_overhead": _host,
    "block_traffic": _traffic,
    "cuda_graphs": _graphs,
}


def render(data: dict) -> str:
    """The whole report as markdown."""
    lines = _header(data) + _summary(data) + _targets(data)
    for name, part in PARTS.items():
        section = data["sections"].get(name)
        if section and section.get("result") is not None:
            lines += part(section["result"])
    lines += _tiles((data["sections"].get("ops") or {}).get("result") or {})
    lines += _timings(data)
    for name, section in data["sections"].items():
        if section["status"].startswith("error"):
            lines += [f"## {name}: error", "", "```text", section["error"], "```", ""]
    return "\n".join(lines)
