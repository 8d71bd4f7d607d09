"""python -m benchmarks e2e: the one end-to-end table users ask for, vit-kernels against what they run.

Per model, mode and batch, side by side in one run, bf16 autocast (float32 on a CPU), AdamW (fused on
CUDA) for training, these columns:

* ``eager``: PyTorch eager (our ViT on the ``torch`` backend; timm's model unpatched);
* ``compile``: ``torch.compile`` of the eager model;
* ``compile-cudagraphs``: the same under ``mode="reduce-overhead"`` (CUDA graphs; CUDA only);
* ``vk``: vit-kernels eager (our ViT on ``auto``; timm's model ``vk.patch_model``'d);
* ``vk+compile``: ``torch.compile`` of the vk model (our kernels where the table puts them under
  compile, Inductor around them);
* ``vk+compile-cudagraphs``: the same under ``mode="reduce-overhead"``;
* ``vk-tuned`` (with ``--tuned``, in the first model's training row): ``vk`` after ``vk.tune``
  under the step's autocast, in a new process (a search from nothing): what searching gains over
  the tables, and what the search costs (its seconds beside the figure).

Every ratio compares like with like (``OVER``): vk over eager, vk+compile over compile,
vk+compile-cudagraphs over compile-cudagraphs.

Rows (``FULL_MODELS``), in this order: timm's ``vit_base_patch16_224`` patched
(``timm:vit_base_patch16_224``), our ViT-B/16 (``vit_base_patch16_224``), then, in ``compile`` and
``vk+compile`` only, our ViT-S/16 and timm's ViT-L/16 at 384, SigLIP so400m/14 at 384 and DINOv2-L/14
at 518 (random init, no downloads). Each: training at batch 128 (halved until it fits), inference at
256 and, for the first two, at batch 1. Beside each figure the first step's seconds (for vk's
training row of the first model also the first step of a new process); for the first model's
compiled training steps (``PROFILED``) every kernel, its work and its fraction of the peaks measured
in the run (``benchmarks.profile``), and at batch 1, where the host sets the pace, the host's self
time per op, eager and vk.

The JSON and markdown are rewritten after every row (atomically): a run cut short by ``--budget``
keeps what ran, and ``--models`` runs the rows a window did not reach. Output:
``<out>/e2e-<device>-<date>.json`` and ``.md``.

    python -m benchmarks e2e [--quick] [--tuned] [--device cuda|cpu] [--out DIR] [--budget SECONDS]
                             [--models NAME,...]
"""

from __future__ import annotations

import contextlib
import copy
import datetime
from dataclasses import dataclass
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import vit_kernels as vk
from benchmarks import cli, environment, peaks, profile
from benchmarks import report as report_
from benchmarks.timing import time_call
from vit.model import ViT, get_config
from vit_kernels._files import write_atomically

VARIANTS = ("eager", "compile", "compile-cudagraphs", "vk", "vk+compile", "vk+compile-cudagraphs")
# Like with like: each vk variant over the plain PyTorch variant of the same mode.
OVER = {"vk": "eager", "vk+compile": "compile", "vk+compile-cudagraphs": "compile-cudagraphs"}
TOWER_VARIANTS = ("compile", "vk+compile")
TUNED = "vk-tuned"  # with --tuned, after the variants in the first model's training row
FULL_RUNS = (("train", 128), ("infer", 256), ("infer", 1))  # training, inference throughput, latency
TOWER_RUNS = (("train", 128), ("infer", 256))
QUICK_RUNS = (("train", 8), ("infer", 16), ("infer", 1))
SMALLEST_TRAIN_BATCH = 8  # a training batch that does not fit is halved down to this


@dataclass(frozen=True)
class Model:
    """A row of the table: ``name`` (``timm:<name>`` for timm's model, patched for the vk variants;
    our preset's name otherwise), how to build it, its variants and (mode, batch) runs."""

    name: str
    variants: tuple = VARIANTS
    runs: tuple = FULL_RUNS
    timm_kwargs: tuple = ()  # timm.create_model's keywords, as (key, value) pairs

    @property
    def source(self) -> str:
        return "timm" if self.name.startswith("timm:") else "vit"

    @property
    def base_name(self) -> str:
        return self.name.removeprefix("timm:")


FULL_MODELS = (
    Model("timm:vit_base_patch16_224"),
    Model("vit_base_patch16_224"),
    Model("vit_small_patch16_224", TOWER_VARIANTS, TOWER_RUNS),
    Model("timm:vit_large_patch16_384", TOWER_VARIANTS, TOWER_RUNS),
    Model("timm:vit_so400m_patch14_siglip_384", TOWER_VARIANTS, TOWER_RUNS),
    Model("timm:vit_large_patch14_dinov2", TOWER_VARIANTS, TOWER_RUNS),  # 518 x 518, 1,370 tokens
)
QUICK_MODELS = (
    Model("timm:vit_tiny_patch16_224", runs=QUICK_RUNS, timm_kwargs=(("img_size", 32), ("num_classes", 10))),
    Model("vit_digits", runs=QUICK_RUNS),
)
PROFILE_TOP = 8  # host ops listed per step at batch 1
PROFILED = ("compile", "vk+compile")  # the first model's training steps profiled kernel by kernel
# The targets: (mode, batch, variant, at least over its plain PyTorch twin ``OVER[variant]``)
TARGETS = (
    ("train", 128, "vk+compile", 1.10),
    ("train", 128, "vk", 1.05),
    ("infer", 256, "vk+compile", 1.05),
    ("infer", 1, "vk+compile-cudagraphs", 1.05),
)


def _model(spec: Model, device: torch.device) -> torch.nn.Module:
    if spec.source == "timm":
        import timm

        # random weights: no download
        return timm.create_model(spec.base_name, pretrained=False, **dict(spec.timm_kwargs)).to(device)
    return ViT(get_config(spec.name)).to(device)


def _batches(batch: int, channels: int, size: int, classes: int, device: torch.device) -> list:
    """Two random batches of images (batch, channels, size, size) and labels below ``classes``
    (timed runs alternate between them)."""
    return [
        (
            torch.randn(batch, channels, size, size, device=device),
            torch.randint(0, classes, (batch,), device=device),
        )
        for _ in range(2)
    ]


def _inputs(config, batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``_batches`` for a ``vit`` preset's config."""
    return _batches(batch, config.in_chans, config.img_size, config.num_classes, device)


def model_inputs(model: torch.nn.Module, spec: Model, batch: int, device: torch.device) -> list:
    """Two random batches of images and labels for ``model`` (its input size and classes)."""
    if spec.source == "vit":
        return _inputs(get_config(spec.name), batch, device)
    channels, size, _ = model.pretrained_cfg.get("input_size", (3, 224, 224))
    size = dict(spec.timm_kwargs).get("img_size", size)
    classes = max(int(getattr(model, "num_classes", 0)), 1)  # a tower without a head: its features
    return _batches(batch, channels, size, classes, device)


def spec_named(name: str) -> Model:
    """The table's row of ``name``, else a row of that name with every variant."""
    return next((m for m in FULL_MODELS + QUICK_MODELS if m.name == name), Model(name))


def variant_setup(
    variant: str, model: torch.nn.Module, source: str, device: torch.device
) -> tuple[torch.nn.Module, str, bool, Optional[str]] | str:
    """(module, backend, compiled?, compile mode) of ``variant``, or why it cannot run here."""
    if variant.endswith("cudagraphs") and device.type != "cuda":
        return "CUDA only"
    ours = variant.startswith("vk")
    module = model
    if ours and source == "timm":
        module = copy.deepcopy(model)
        vk.patch_model(module)
    backend = "auto" if ours else "torch"
    mode = "reduce-overhead" if variant.endswith("cudagraphs") else None
    return module, backend, "compile" in variant, mode


def _self_times(step: Callable[[int], object], device: torch.device, host: bool) -> dict[str, float]:
    """Each op's self time in one step, in us: on the device (``host`` False, the CPU's on a CPU),
    or in the host's calls (``host`` True: PyTorch's ops as the profiler records them)."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda" and not host
    with profile(activities=[ProfilerActivity.CUDA if on_device else ProfilerActivity.CPU]) as profiler:
        step(0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    attribute = "self_device_time_total" if on_device else "self_cpu_time_total"
    return {e.key: getattr(e, attribute, 0.0) for e in profiler.key_averages()}


def _host_profile(step: Callable[[int], object], device: torch.device) -> dict[str, float]:
    """The host's self time per op in one step, in us, the top ones, and the total under "all":
    where a step whose pace the host sets (batch 1) spends it."""
    times = _self_times(step, device, host=True)
    top = sorted(times.items(), key=lambda item: -item[1])[:PROFILE_TOP]
    return {"all": round(sum(times.values()), 1), **{name: round(t, 1) for name, t in top if t > 0}}


def measure(
    spec: Model,
    mode: str,
    batch: int,
    variant: str,
    device: torch.device,
    dtype: torch.dtype,
    model: torch.nn.Module,
    headline_row: bool,
    peaks: Optional[dict] = None,
) -> dict[str, object]:
    """One row: images/s, median ms, the first step's seconds, or why not. In the ``headline_row``
    (the first model's training row): the full profile of the ``PROFILED`` variants' step, against
    ``peaks`` (``benchmarks.peaks``), and vk's first step in a new process."""
    row: dict[str, object] = {"model": spec.name, "mode": mode, "batch": batch, "variant": variant}
    if variant == TUNED:
        return _tuned_row(row, spec.name, device, dtype, headline_row)
    setup = variant_setup(variant, model, spec.source, device)
    if isinstance(setup, str):
        return {**row, "skipped": setup}
    compiled = setup[2]
    if compiled:  # each compiled row from a clean slate: its first step compiles, and no cache limit is hit
        torch._dynamo.reset()
    inputs = model_inputs(model, spec, batch, device)
    try:
        step, first_step_s = _first_step(setup, mode, inputs, device, dtype)
        timing = time_call(step, device, 2, warmup=2, repeats=10, budget_s=5.0)
        if headline_row and variant in PROFILED:
            row["profile"] = profile.profile_step(step, device, dtype, peaks or {})
        if headline_row and variant == "vk":
            row["first_step_warm_s"] = first_step_in_a_new_process(spec.name, mode, batch, device, dtype)
        if batch == 1 and variant in ("eager", "vk"):
            row["host_profile"] = _host_profile(step, device)
    except torch.cuda.OutOfMemoryError as error:
        return {**row, "invalid": f"out of memory: {error}".splitlines()[0], "out_of_memory": True}
    except Exception as error:  # reported, not fatal: e.g. a compile failure
        return {**row, "invalid": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {
        **row,
        "images_per_second": batch / (timing.median_ms * 1e-3),
        "median_ms": timing.median_ms,
        "first_step_s": first_step_s,
    }


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _step(
    module: torch.nn.Module,
    backend: str,
    compiled: bool,
    device: torch.device,
    dtype: torch.dtype,
    mode: str,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    compile_mode: Optional[str] = None,
) -> Callable[[int], object]:
    """A step on batch ``i``: inference, else training (cross-entropy, AdamW), on ``backend``, under
    autocast to ``dtype`` (none for float32), ``torch.compile``'d if ``compiled``."""
    fn = torch.compile(module, mode=compile_mode) if compiled else module
    if mode == "inference":
        module.eval()

        def infer(i):
            with vk.use_backend(backend), torch.inference_mode(), _autocast(device, dtype):
                return fn(batches[i][0])

        return infer
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=device.type == "cuda")

    def train(i):
        images, labels = batches[i]
        with vk.use_backend(backend):
            with _autocast(device, dtype):
                loss = F.cross_entropy(fn(images), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train


def _first_call_s(step: Callable[[int], object], device: torch.device) -> float:
    """Seconds of the first call, to its end on the device: what a user waits before the first step
    (compiling, and choosing and proving tiles for every new shape, once per machine)."""
    started = time.perf_counter()
    step(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _first_step(setup: tuple, mode: str, inputs: list, device: torch.device, dtype: torch.dtype):
    """(step, the seconds of its first call) of ``variant_setup``'s ``setup`` on ``inputs``."""
    module, backend, compiled, compile_mode = setup
    mode = "inference" if mode == "infer" else mode
    step = _step(module, backend, compiled, device, dtype, mode, inputs, compile_mode)
    return step, _first_call_s(step, device)


CHILD_TIMEOUT_S = {"first step": 300, "tuned": 900}


def _in_a_new_process(
    what: str, entry: str, model_name: str, mode: str, batch: int, device: torch.device, dtype: torch.dtype
) -> str:
    """The last line ``benchmarks.headline.<entry>()`` prints in another Python process, given the
    row's model, mode, batch, device and dtype (``_row_of_argv``). Raises RuntimeError naming
    ``what`` and the child's last error line when it fails."""
    argv = [model_name, mode, str(batch), str(device), str(dtype).removeprefix("torch.")]
    done = subprocess.run(
        [sys.executable, "-c", f"from benchmarks.headline import {entry}; {entry}()", *argv],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S[what],
        cwd=Path(__file__).resolve().parent.parent,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"the {what} in a new process failed: {why}")
    return lines[-1]


def _row_of_argv() -> tuple:
    """A child's row from its argv: (mode, device, dtype, ``variant_setup`` of vk, the inputs)."""
    model_name, mode, batch, device_name, dtype_name = sys.argv[1:6]
    device, dtype, spec = torch.device(device_name), getattr(torch, dtype_name), spec_named(model_name)
    model = _model(spec, device)
    setup = variant_setup("vk", model, spec.source, device)
    return mode, device, dtype, setup, model_inputs(model, spec, int(batch), device)


def first_step_in_a_new_process(
    model_name: str, mode: str, batch: int, device: torch.device, dtype: torch.dtype
) -> float:
    """Seconds of the first ``vk`` step of another Python process, what a user's second run waits:
    Triton's and vit_kernels' caches on disk are warm from this process's run (its compiles, its
    tiles' verdicts), its memory is not. The step alone, the child's imports and model set-up not
    counted. Raises RuntimeError naming the child's last error line when it fails."""
    return float(_in_a_new_process("first step", "first_step_child", model_name, mode, batch, device, dtype))


def first_step_child() -> None:
    """``first_step_in_a_new_process``'s child: argv model, mode, batch, device, dtype;
    prints the first step's seconds."""
    mode, device, dtype, setup, inputs = _row_of_argv()
    print(_first_step(setup, mode, inputs, device, dtype)[1])


def tuned_in_a_new_process(
    model_name: str, mode: str, batch: int, device: torch.device, dtype: torch.dtype
) -> dict[str, float]:
    """``vk`` after ``vk.tune`` in another Python process, so that the search starts from nothing and
    this process's decisions stay the tables' (Triton's compile cache is shared): {"tune_s": the search's seconds, "signatures": the op
    signatures it met, "first_step_s": the first step's after it, "median_ms": a step's}. Raises
    RuntimeError naming the child's last error line when it fails."""
    line = _in_a_new_process("tuned", "tuned_child", model_name, mode, batch, device, dtype)
    return json.loads(line)


def tuned_child() -> None:
    """``tuned_in_a_new_process``'s child: argv as ``first_step_child``'s; prints one JSON line."""
    mode, device, dtype, setup, inputs = _row_of_argv()
    module = setup[0].train(mode == "train")
    started = time.perf_counter()
    explained = vk.tune(
        module,
        (inputs[0][0],),
        grad=mode == "train",
        autocast=dtype if dtype in (torch.float16, torch.bfloat16) else None,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    found = {"tune_s": time.perf_counter() - started, "signatures": len(explained)}
    step, found["first_step_s"] = _first_step(setup, mode, inputs, device, dtype)
    found["median_ms"] = time_call(step, device, 2, warmup=2, repeats=10, budget_s=5.0).median_ms
    print(json.dumps(found))


def _tuned_row(
    row: dict, model_name: str, device: torch.device, dtype: torch.dtype, headline_row: bool
) -> dict[str, object]:
    """The ``vk-tuned`` row: measured in the first model's training row only (the search takes
    minutes on a GPU), else why not."""
    if not headline_row:
        return {**row, "skipped": "measured in the first model's training row only"}
    try:
        found = tuned_in_a_new_process(model_name, row["mode"], row["batch"], device, dtype)
    except Exception as error:  # reported, not fatal
        return {**row, "invalid": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {**row, "images_per_second": row["batch"] / (found["median_ms"] * 1e-3), **found}


def device_slug(device: torch.device) -> str:
    """``h100``, ``h200``, ``a100`` from the GPU's name, else its name in lower case; ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    found = re.search(r"\b([a-z]\d{2,3})\b", name)
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def ratio(rows: list[dict], mode: str, batch: int, variant: str, over: str, model: str) -> Optional[float]:
    """images/s of ``variant`` over ``over`` for one model, mode and batch; None where either is absent."""
    found = {
        r["variant"]: r.get("images_per_second")
        for r in rows
        if (r["model"], r["mode"], r["batch"]) == (model, mode, batch)
    }
    a, b = found.get(variant), found.get(over)
    return a / b if a and b else None


def _cell(row: Optional[dict]) -> str:
    if row is None:
        return "not measured"
    if "images_per_second" not in row:
        return row.get("skipped") or f"failed: {row.get('invalid')}"
    warm, tune = row.get("first_step_warm_s"), row.get("tune_s")
    seconds = ("" if tune is None else f"tune {tune:.1f} s; ") + f"{row['first_step_s']:.1f} s"
    seconds += "" if warm is None else f"; {warm:.1f} s warm"
    return f"{row['images_per_second']:,.0f} ({seconds})"


def markdown(report: dict) -> str:
    rows = report["rows"]
    measured = [
        r["model"] for r in rows if r.get("images_per_second")
    ]  # the targets' model: the first measured
    head = measured[0] if measured else rows[0]["model"] if rows else ""
    variants = VARIANTS + ((TUNED,) if any(r["variant"] == TUNED for r in rows) else ())
    ratios = [f"{v} / {over}" for v, over in OVER.items()]
    lines = [
        f"# End to end on {report['device']}, {report['date']}, {report['commit']}",
        "",
        f"torch {report['versions']['torch']}, triton {report['versions']['triton']}; {report['dtype']}; "
        "images/s (the first step's seconds in parentheses; warm: another process's first step, with the "
        "caches on disk this run filled"
        + ("; tune: vk.tune's seconds before it, in a new process" if TUNED in variants else "")
        + "). Each row's variants ran side by side in one run; each ratio compares a vk variant with "
        "plain PyTorch in the same mode.",
        "",
        "| model | mode | batch | " + " | ".join(variants + tuple(ratios)) + " |",
        "|---|---|---:|" + "---:|" * (len(variants) + len(ratios)),
    ]
    for key in dict.fromkeys((r["model"], r["mode"], r["batch"]) for r in rows):
        by_variant = {r["variant"]: r for r in rows if (r["model"], r["mode"], r["batch"]) == key}
        cells = [_cell(by_variant.get(variant)) for variant in variants]
        for variant, over in OVER.items():
            found = ratio(rows, key[1], key[2], variant, over, key[0])
            cells.append("-" if found is None else f"{found:.3f}x")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    lines += ["", "| target | measured | met |", "|---|---:|---|"]
    for mode, batch, variant, least in TARGETS:
        found = ratio(rows, mode, batch, variant, OVER[variant], head)
        measured, met = (
            ("not measured", "not measured")
            if found is None
            else (f"{found:.3f}x", "yes" if found >= least else "no")
        )
        lines.append(
            f"| {head} {mode} B={batch}: {variant} >= {least:.2f}x {OVER[variant]} | {measured} | {met} |"
        )
    for r in rows:
        tuned = ratio(rows, r["mode"], r["batch"], TUNED, "vk", r["model"]) if r["variant"] == TUNED else None
        if tuned is not None:
            lines += [
                "",
                f"{r['model']} {r['mode']} B={r['batch']}: vk-tuned / vk = {tuned:.3f}x (what searching "
                f"gains over the tables), for a search of {r['tune_s']:.1f} s.",
            ]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines += ["", "## One step, kernel by kernel", ""]
        if report.get("peaks"):
            lines += [
                "Peaks measured in this run: "
                + ", ".join(f"{name} {value:,.1f}" for name, value in report["peaks"].items())
                + ".",
                "",
            ]
        for r in profiled:
            title = f"{r['model']} {r['mode']} B={r['batch']} {r['variant']} ({r['median_ms']:.1f} ms a step)"
            lines += profile.markdown(title, r["profile"])
    host_profiled = [r for r in rows if r.get("host_profile")]
    if host_profiled:
        lines += ["", "The host's self time per op in one step at batch 1, the top ones, us:", ""]
        for r in host_profiled:
            ops = ", ".join(f"{name} {us:,.0f}" for name, us in r["host_profile"].items() if name != "all")
            lines.append(
                f"- {r['model']} {r['mode']} B={r['batch']} {r['variant']} "
                f"(all ops {r['host_profile']['all']:,.0f}): {ops}"
            )
    return "\n".join(lines) + "\n"


def write_files(stem: Path, report: dict) -> None:
    """The JSON, the markdown and the chart of ``report``, each atomically."""
    write_atomically(stem.with_suffix(".json"), json.dumps(report, indent=1))
    write_atomically(stem.with_suffix(".md"), markdown(report))
    report_.e2e_chart(report, stem.with_suffix(".png"), VARIANTS + (TUNED,))


def run(
    device: torch.device,
    quick: bool,
    out: Path,
    budget_s: float,
    say: Callable[[str], None] = print,
    tuned: bool = False,
    models: Optional[list[str]] = None,
) -> dict:
    """Measure every row in order until ``budget_s`` is spent, writing the files after each row;
    ``tuned``: with the ``vk-tuned`` variant; ``models``: only the rows of these names. A training
    batch that does not fit is halved (down to SMALLEST_TRAIN_BATCH)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    date = datetime.date.today().isoformat()
    stem = out / f"e2e-{device_slug(device)}-{date}"
    versions = environment.versions(device)
    report = {
        "device": versions["device"],
        "date": date,
        "commit": versions["git_sha"],
        "versions": versions,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": [],
    }
    started = time.perf_counter()
    specs = [m for m in (QUICK_MODELS if quick else FULL_MODELS) if models is None or m.name in models]

    def keep(row: dict) -> None:
        report["rows"].append(row)
        shown = row.get("images_per_second")
        say(
            f"e2e: {row['model']} {row['mode']} B={row['batch']} {row['variant']}: "
            + (f"{shown:,.0f} images/s" if shown else str(row.get("skipped") or row.get("invalid")))
        )
        write_files(stem, report)

    first = True  # until the first model that builds: its training row is profiled (and tuned)
    for spec in specs:
        variants = spec.variants + ((TUNED,) if tuned and first else ())
        try:
            model = _model(spec, device)
        except ImportError as error:
            for mode, batch in spec.runs:
                for variant in variants:
                    keep(
                        {
                            "model": spec.name,
                            "mode": mode,
                            "batch": batch,
                            "variant": variant,
                            "skipped": str(error),
                        }
                    )
            continue
        for mode, batch in spec.runs:
            for variant in variants:
                size = batch
                while True:
                    if time.perf_counter() - started > budget_s:
                        say(f"e2e: budget of {budget_s:.0f} s spent; {stem}.json holds what ran")
                        return report
                    headline_row = first and mode == "train"
                    if headline_row and variant in PROFILED and "peaks" not in report:
                        report["peaks"] = peaks.measure_peaks(device, [dtype], quick=quick)
                    row = measure(
                        spec, mode, size, variant, device, dtype, model, headline_row, report.get("peaks")
                    )
                    keep(row)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if not (
                        row.get("out_of_memory") and mode == "train" and size // 2 >= SMALLEST_TRAIN_BATCH
                    ):
                        break
                    size //= 2
        first = False
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = cli.Parser(prog="python -m benchmarks e2e", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the smallest preset at small batches (a CPU)")
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="also vk after vk.tune (a search of minutes on a GPU), in the first model's training row",
    )
    parser.add_argument(
        "--device", type=cli.device_name, default=None, help="cuda or cpu (default: cuda when available)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder of the JSON and markdown"
    )
    parser.add_argument(
        "--budget", type=float, default=300.0, help="seconds; rows not started by then are left out"
    )
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated rows to run, in the table's order (continue where a window stopped): "
        + ", ".join(m.name for m in FULL_MODELS),
    )
    args = parser.parse_args(argv)
    known = [m.name for m in (QUICK_MODELS if args.quick else FULL_MODELS)]
    models = (
        None if args.models is None else [name.strip() for name in args.models.split(",") if name.strip()]
    )
    unknown = [name for name in models or () if name not in known]
    if unknown or models == []:
        raise SystemExit(f"--models must name rows of {', '.join(known)}; got {args.models!r}")
    device = cli.check_device("--device", args.device)
    cli.check_output("--out", args.out, folder=True)
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    run(device, args.quick, args.out, args.budget, tuned=args.tuned, models=models)
    return 0
