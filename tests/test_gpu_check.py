"""The GPU compile gate's parts, on this CPU: recording launches on the simulated CUDA device, autotune
expansion, real ahead-of-time compiles for sm_80/sm_90 with resource usage, the int32 overflow
analysis on real Triton IR, and the ptxas log parser."""

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.aot,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="compiles for GPU targets: run without TRITON_INTERPRET (make test runs it so)",
    ),
]
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tools.cuda_sim import ARCHITECTURES, every_candidate, simulated_cuda  # noqa: E402
from tools.gpu_check import cases  # noqa: E402
from tools.gpu_check.compile import (  # noqa: E402
    Compiled,
    Variant,
    _backend,
    _key_options,
    bind,
    compile_cached,
    compile_variant,
    ctas_per_sm,
    expand,
)
from tools.gpu_check.int_range import find_overflows  # noqa: E402
from tools.gpu_check.ptxas import parse  # noqa: E402
from tools.gpu_check.report import summary_table  # noqa: E402
from tools.gpu_check.ttgir import transposes_into_dots  # noqa: E402
from vit_kernels import (
    _tiles,  # noqa: E402
    backend,  # noqa: E402
)
from vit_kernels.kernels import layer_norm as layer_norm_kernels  # noqa: E402
from vit_kernels.kernels.gemm import _linear_tma_kernel  # noqa: E402
from vit_kernels.ops import attention, gemm, layer_norm, linear  # noqa: E402

H100_MULTIPROCESSORS = ARCHITECTURES[90]["multi_processor_count"]


def meta(dtype, *shape):
    """A tensor on the simulated CUDA device (meta to PyTorch's core): make it inside ``recorded``."""
    return torch.empty(shape, dtype=dtype, device="cuda")


def on_meta(dtype, *shape):
    """A meta tensor: an argument of a variant built by hand (binding reads its dtype and alignment)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def recorded(call) -> list:
    """The launches ``call()`` makes searching on the simulated H100 (every candidate tile, the
    table's default first)."""
    _tiles.forget()
    with simulated_cuda(90) as device:
        every_candidate(call)
    return device.launches


def first_seen(items) -> list:
    return list(dict.fromkeys(items))


def test_launchers_record_gpu_configs_on_meta_tensors():
    """A linear forward searching on meta tensors records one launch per GEMM candidate tile (what a
    GPU would validate and time), each with its grid computed from its tile: the persistent TMA
    kernel's (one program per SM of an H100, at most one per tile), then the pointer kernel's default."""
    shapes = []
    launches = recorded(
        lambda: shapes.append(
            linear.linear_gelu_triton(
                meta(torch.bfloat16, 64, 197, 768),
                meta(torch.bfloat16, 3072, 768),
                meta(torch.bfloat16, 3072),
            ).shape
        )
    )
    assert set(shapes) == {(64, 197, 3072)}
    variants = [v for launch in launches for v in expand(launch)]
    tiles = first_seen(
        gemm.GemmTile(
            v.kwargs["BLOCK_M"],
            v.kwargs["BLOCK_N"],
            v.kwargs["BLOCK_K"],
            v.kwargs["num_warps"],
            v.kwargs["num_stages"],
            gemm.TMA if v.name == "_linear_tma_kernel" else "pointer",
        )
        for v in variants
    )
    assert tiles == list(gemm.gemm_candidates(torch.bfloat16, 64 * 197, 3072, tma=True))
    assert tiles == list(gemm.GEMM_TILES_TMA + gemm.GEMM_TILES_16BIT[:1])
    for v in variants:
        blocks = triton.cdiv(64 * 197, v.kwargs["BLOCK_M"]) * triton.cdiv(3072, v.kwargs["BLOCK_N"])
        persistent = v.name == "_linear_tma_kernel"
        assert v.grid == ((min(blocks, H100_MULTIPROCESSORS) if persistent else blocks), 1, 1)
    assert all(v.kwargs["BLOCK_K"] >= 64 for v in variants)  # 16-bit operands: the tensor-core tiles only


def test_attention_grid_stays_within_cuda_limits_at_large_batch():
    """ViT-L/16 at batch 16,384 (262,144 batch x heads): every attention grid fits axis x, y = z = 1."""

    def call():
        qkv = meta(torch.float16, 16384, 197, 3 * 1024)
        seed = torch.empty(1, dtype=torch.int64, device="cuda")
        out, lse = attention.attention_fwd(qkv, 16, 0.125, 0.1, seed)
        attention.attention_bwd(torch.empty_like(out), qkv, lse, seed, 16, 0.125, 0.1)

    launches = recorded(call)
    grids = [v.grid for launch in launches for v in expand(launch)]
    assert len(grids) >= 4
    assert all(g[0] < 2**31 and g[1] == 1 and g[2] == 1 for g in grids)


def test_sweep_covers_every_op_and_flag():
    quick = list(cases.cases(cases.QUICK))
    assert {c.op for c in quick} == set(backend.OPS)
    assert {c.batch for c in quick} >= {16384}
    assert any("dropout=0.1" in c.flags for c in quick) and any("probs=True" in c.flags for c in quick)
    assert {c.shape for c in quick if c.op == "attention"} >= {f"head_dim={d}" for d in cases.HEAD_DIMS}


@pytest.mark.parametrize("capability", [80, 90])
def test_a_recorded_launch_compiles_for_a_real_gpu(capability):
    """A layer_norm forward (fp16, ViT-B width) compiled for sm_80/sm_90: registers and shared memory
    read back from the cubin, no spills, and an occupancy figure."""

    def call():
        x, w = meta(torch.float16, 8, 197, 768), meta(torch.float16, 768)
        layer_norm.layer_norm_fwd(x, w, w, 1e-6, None)

    (variant,) = expand(recorded(call)[0])
    resources = compile_cached(variant, capability)
    assert resources.error is None
    assert 16 <= resources.registers <= 255 and resources.spill_bytes == 0
    assert resources.ctas_per_sm >= 1 and "tt.func" in resources.ttir


def test_the_tma_gemm_compiles_to_tma_copies_and_wgmma_on_sm90():
    """The persistent TMA GEMM's 128 x 128 x 64 tile (bf16, ViT-B fc1 with bias + GELU) compiled for
    sm_90: its A and B tiles arrive by bulk tensor copies (TMA) and feed wgmma, with no spills; the
    pointer kernel's same tile has no TMA copy. The gate compiles the TMA kernel for sm_90 only."""
    launches = recorded(
        lambda: linear.linear_gelu_triton(
            meta(torch.bfloat16, 64, 197, 768), meta(torch.bfloat16, 3072, 768), meta(torch.bfloat16, 3072)
        )
    )
    picked = {}
    for launch in launches:
        (variant,) = expand(launch)
        if (variant.kwargs["BLOCK_M"], variant.kwargs["BLOCK_N"], variant.kwargs["num_warps"]) == (
            128,
            128,
            8,
        ):
            picked.setdefault(variant.name, variant)
    tma, pointer = (compile_cached(v, 90) for v in (picked["_linear_tma_kernel"], picked["_linear_kernel"]))
    assert tma.error is None and tma.spill_bytes == 0 and tma.tma and tma.tensor_cores == "wgmma"
    assert pointer.error is None and not pointer.tma
    assert _linear_tma_kernel.min_capability == 90


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_gemms_sum_each_k_block_from_zero_on_sm90(dtype):
    """Triton folds acc + dot(a, b, 0) into dot(a, b, acc): in the compiled float32 GEMM each K
    block's dot must still start from a zero that is not a constant, its sum added after, so the
    rounding errors do not run through one K-long FMA chain; 16-bit dots accumulate in place."""
    launches = recorded(lambda: linear.linear_triton(meta(dtype, 34, 1023), meta(dtype, 64, 1023)))
    (variant, *_) = expand(launches[0])
    compiled = compile_cached(variant, 90)
    assert compiled.error is None
    loop = compiled.ttir[compiled.ttir.index("scf.for") :]
    dot = re.search(r"(%\S+) = tt\.dot \S+, \S+, (%\S+)", loop)
    assert dot is not None, loop[:3000]
    constant_zeros = set(re.findall(r"(%\S+) = arith\.constant dense<0\.0+e\+00>", compiled.ttir))
    added = re.search(rf"arith\.addf (%\S+, {re.escape(dot.group(1))}|{re.escape(dot.group(1))}, %\S+)", loop)
    if dtype == torch.float32:
        assert dot.group(2) not in constant_zeros and added is not None, loop[:3000]
    else:
        assert added is None


@triton.jit
def _offsets_kernel(X, stride, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        offset = pid.to(tl.int64) * stride
    else:
        offset = pid * stride
    tl.store(X + offset, 1.0)


@pytest.mark.parametrize("wide", [False, True])
def test_int32_index_overflow_is_found_in_real_triton_ir(wide):
    """pid * stride in int32 wraps for 70,000 programs with a stride of 40,000; in int64 it does not."""
    x = on_meta(torch.float32, 10)
    variant = Variant(_offsets_kernel, (70000, 1, 1), (x, 40000), {"WIDE": wide}, "")
    resources = compile_cached(variant, 90)
    assert resources.error is None
    overflows = find_overflows(resources.ttir, variant.int_args(), variant.grid)
    if wide:
        assert overflows == []
    else:
        assert len(overflows) == 1 and overflows[0].bits == 32 and overflows[0].high == 69999 * 40000
        assert find_overflows(resources.ttir, {"stride": 4}, variant.grid) == []


def test_what_a_compile_found_is_reused_by_exact_key_or_by_kind(tmp_path, monkeypatch):
    """The gate reads a variant back only under its exact key (an alignment of its own compiles
    anew); the simulated device reads any launch of the kind. A kept answer is returned as kept."""
    aligned = Variant(_offsets_kernel, (4, 1, 1), (on_meta(torch.float32, 64), 32), {"WIDE": True}, "")
    odd = Variant(_offsets_kernel, (4, 1, 1), (on_meta(torch.float32, 64), 33), {"WIDE": True}, "")
    bound, odd_bound = bind(aligned, 90), bind(odd, 90)
    assert bound.kind == odd_bound.kind and bound.key != odd_bound.key
    compiled = Compiled(tmp_path)
    first, read = compiled.compile(aligned, 90, bound)
    assert first.error is None and first.registers > 0 and not read
    assert compiled.exact(bound) == first and compiled.exact(odd_bound) is None
    assert compiled.of_kind(odd_bound) == first

    compiles = []
    monkeypatch.setattr("tools.gpu_check.compile.compile_variant", lambda *job: compiles.append(job) or first)
    assert compiled.compile(aligned, 90, bound) == (first, True) and compiled.compile(
        odd, 90, odd_bound, any_of_kind=True
    ) == (first, True)
    assert compiles == []
    assert compiled.compile(odd, 90, odd_bound) == (first, False)
    assert len(compiles) == 1

    # a file that is not a whole record is compiled again; a compile error is returned, not kept
    (compiled.folder / f"{bound.key}.json").write_text('{"registers": 3')
    failed = dataclasses.replace(first, error="ptxas killed")
    monkeypatch.setattr(
        "tools.gpu_check.compile.compile_variant", lambda *job: compiles.append(job) or failed
    )
    assert compiled.compile(aligned, 90, bound) == (failed, False) and len(compiles) == 2
    assert compiled.exact(bound) is None


def _kernel_copy(folder, edit=None):
    """vit_kernels/kernels/layer_norm.py imported again from a copy in ``folder``, with ``edit``
    (old, new) applied to its text."""
    text = Path(layer_norm_kernels.__file__).read_text()
    if edit is not None:
        assert text.count(edit[0]) == 1
        text = text.replace(*edit)
    path = folder / f"layer_norm_copy_{len(list(folder.iterdir()))}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_kernel_edit_changes_that_kernels_cache_keys_only(tmp_path):
    """The compile cache's key is the kernel's content: a verbatim copy of a kernels module (another
    file, another module) binds to the same keys, so a fresh clone reads what an earlier one compiled;
    an edit of one kernel's body changes that kernel's keys and no other kernel's."""

    def call():
        x, w, b = (meta(torch.float16, *shape).requires_grad_() for shape in ((8, 197, 768), (768,), (768,)))
        y = layer_norm.layer_norm_triton(x, w, b, 1e-6, None)
        torch.autograd.grad(y, (x, w, b), torch.empty_like(y))

    first = {}
    for launch in recorded(call):
        for variant in expand(launch):
            first.setdefault(variant.name, variant)
    assert set(first) == {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"}

    def keys(module=None):
        return {
            name: bind(
                variant if module is None else dataclasses.replace(variant, kernel=getattr(module, name)), 90
            ).key
            for name, variant in first.items()
        }

    original = keys()
    assert keys(_kernel_copy(tmp_path)) == original
    edited = keys(_kernel_copy(tmp_path, ("tl.maximum(var, 0.0)", "tl.maximum(var, 1e-30)")))
    assert edited["_layer_norm_fwd_kernel"] != original["_layer_norm_fwd_kernel"]
    assert edited["_layer_norm_bwd_kernel"] == original["_layer_norm_bwd_kernel"]


def test_cache_keys_do_not_name_the_checkout(tmp_path):
    """Triton's options name its libdevice by a path inside the checkout's environment: the key reads
    the file name only, so that two clones (two environments) share the compiled folder."""
    options = _backend(90).parse_options({})
    (name, path), *rest = options.extern_libs
    moved = dataclasses.replace(
        options, extern_libs=((name, str(tmp_path / "clone" / ".venv" / os.path.basename(path))), *rest)
    )
    assert moved.extern_libs != options.extern_libs
    assert _key_options(moved) == _key_options(options)


def test_a_compile_error_is_reported_not_raised():
    @triton.jit
    def broken(X):
        tl.store(X, undefined_name)  # noqa: F821

    x = on_meta(torch.float32, 4)
    variant = Variant(broken, (1, 1, 1), (x,), {}, "")
    resources = compile_variant(variant, 90, bind(variant, 90))
    assert resources.error is not None and "undefined_name" in resources.error


def test_occupancy_follows_registers_threads_and_shared_memory():
    assert ctas_per_sm(90, 32, 4, 0) == 16  # thread-limited: 2048 / 128
    assert ctas_per_sm(90, 255, 4, 0) == 2  # 256 registers x 128 threads = 32K of 64K
    assert ctas_per_sm(80, 64, 4, 100 * 1024) == 1  # shared memory: 164 KB per SM


def test_ptxas_log_is_parsed_per_kernel_and_target():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_80'
ptxas info    : Function properties for _Z6kernelPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 372 bytes cmem[0]
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 372 bytes cmem[0]
"""
    first, second = parse("kernel.cu", log)
    assert (first.target, first.registers, first.shared_bytes, first.spill_stores) == (80, 40, 4096, 0)
    assert (second.target, second.registers, second.shared_bytes, second.spill_loads) == (90, 255, 0, 12)


def test_every_tile_records_each_candidate_of_the_tables():
    """The sweep's recording launches the tables' first tiles; with ``every_tile`` every candidate of
    the GEMM table too (as vk.tune's search launches them), the first tile among them."""
    case = next(c for c in cases.cases(cases.QUICK) if c.op == "linear_gelu" and c.precision == "bf16")

    def tiles(launches):
        return {
            (l.kwargs["BLOCK_M"], l.kwargs["BLOCK_N"], l.kwargs["BLOCK_K"], l.kwargs["num_warps"])
            for l in launches
            if l.kernel.fn.__name__ in ("_linear_kernel", "_linear_tma_kernel")
        }

    first, every = tiles(cases.record(case)), tiles(cases.record(case, every_tile=True))
    tma = {(t.block_m, t.block_n, t.block_k, t.warps) for t in gemm.GEMM_TILES_TMA}
    assert first < every and tma <= every, (first, every)


def test_float_scalars_passed_as_fp64_stay_fp32_arithmetic():
    """torch.compile (Inductor) passes a kernel's float scalars (scale, dropout_p, eps) as fp64,
    where Triton's launcher passes fp32: every kernel taking one compiles that way for sm_90 (an fp64
    scale once turned the attention's loop-carried row sums fp64 and failed) and does its arithmetic
    in fp32 (the only fp64 operation in the IR is the conversion on entry)."""
    sweep = cases.Sweep(("bf16",), (2,), (33,), False)
    first: dict[tuple, Variant] = {}
    for case in cases.cases(sweep):
        for launch in cases.record(case):
            variant = expand(launch)[0]
            first.setdefault((variant.name, variant.kwargs.get("DROPOUT")), variant)
    checked = []
    for (name, _), variant in first.items():
        bound = bind(variant, 90)
        floats = [arg for arg, kind in bound.signature.items() if kind == "fp32"]
        if not floats:
            continue
        bound.signature.update({arg: "fp64" for arg in floats})
        resources = compile_variant(variant, 90, bound)
        assert resources.error is None, f"{name} with fp64 {floats}: {resources.error}"
        fp64_ops = {
            line.split("=", 1)[1].split()[0]
            for line in resources.ttir.splitlines()
            if "f64" in line and line.lstrip().startswith("%")
        }
        assert fp64_ops <= {"arith.truncf"}, f"{name} computes in fp64: {fp64_ops}"
        checked.append(name)
    assert {
        "_attention_fwd_kernel",
        "_attention_bwd_dq_kernel",
        "_attention_bwd_dkdv_kernel",
        "_attention_probs_kernel",
        "_layer_norm_fwd_kernel",
    } <= set(checked)


NONE, LOADED, COMPUTED = 0, 1, 2  # what _transpose_kernel transposes


@triton.jit
def _transpose_kernel(A, B, C, Out, n, SOURCE: tl.constexpr, B_SIDE: tl.constexpr):
    """Out = sum over n 64 x 64 blocks of x c (c x where B_SIDE), x being a block of A as loaded
    (NONE), its transpose as loaded (LOADED), or the transpose of the computed tile A_i B_i
    (COMPUTED, in the accumulator's layout: the triton-lang/triton#6124 pattern). The loop lets the
    pipeliner stage A's blocks through shared memory with async copies."""
    rows = tl.arange(0, 64)
    tile = rows[:, None] * 64 + rows[None, :]
    c = tl.load(C + tile)
    acc = tl.zeros([64, 64], dtype=tl.float32)
    for i in range(n):
        a = tl.load(A + i * 4096 + tile)
        if SOURCE == 2:
            x = tl.trans(tl.dot(a, tl.load(B + i * 4096 + tile)).to(tl.float16))
        elif SOURCE == 1:
            x = tl.trans(a)
        else:
            x = a
        if B_SIDE:
            acc += tl.dot(c, x)
        else:
            acc += tl.dot(x, c)
    tl.store(Out + tile, acc)


def _transpose_variant(source: int, b_side: bool) -> Variant:
    blocks = on_meta(torch.float16, 8, 64, 64)
    return Variant(
        _transpose_kernel,
        (1, 1, 1),
        (blocks, blocks, on_meta(torch.float16, 64, 64), on_meta(torch.float32, 64, 64), 8),
        {"SOURCE": source, "B_SIDE": b_side, "num_warps": 4, "num_stages": 3},
        "",
    )


def _compile_transpose_kernel(source: int, b_side: bool, capability: int):
    variant = _transpose_variant(source, b_side)
    resources = compile_cached(variant, capability)
    assert resources.error is None
    return resources


def test_a_transposed_computed_tile_feeding_a_dot_is_flagged():
    """tl.dot(tl.trans(computed), c) on sm_90: a register tt.trans of the truncated accumulator
    (#mma layout) into the warp_group_dot's A operand (through shared memory), found and described
    with its source line; it is what fails the gate."""
    resources = _compile_transpose_kernel(COMPUTED, False, 90)
    assert resources.tensor_cores == "wgmma"
    (found,) = resources.computed_transposes
    assert "arith.truncf" in found and "#mma" in found and "ttng.warp_group_dot" in found, found
    assert "test_gpu_check.py:" in found, found


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("b_side", [False, True])
@pytest.mark.parametrize("source", [NONE, LOADED])
def test_transposes_of_loaded_tiles_pass(source, b_side, capability):
    """No transpose, or tl.trans of a tile as loaded, on either side of the dot: nothing flagged. On
    sm_90 the loaded tile's transpose is a shared-memory view (ttg.memdesc_trans, not a register
    tt.trans); on sm_80 it stays a register tt.trans into the dot operand, of the tile the async
    copies loaded (or of the load itself), which the check follows back to its load."""
    resources = _compile_transpose_kernel(source, b_side, capability)
    assert resources.computed_transposes == []
    if source == LOADED and capability == 80:
        variant = _transpose_variant(source, b_side)
        bound = bind(variant, 80)
        compiled = triton.compile(
            ASTSource(variant.kernel, bound.signature, bound.constexprs, bound.attrs),
            target=GPUTarget("cuda", 80, 32),
            options=bound.options.__dict__,
        )
        (seen,) = transposes_into_dots(compiled.asm["ttgir"])
        assert seen.origins == ("load",) and not seen.computed and seen.dot == "tt.dot"


def test_the_attention_kernels_transpose_no_computed_tile():
    """Forward, dQ and dK/dV (16-bit, head dim 128 with its padding-free tiles, a tail, dropout) on
    sm_90 and sm_80: the dK/dV kernel computes dV = P~^T dO and dK = dS^T Q key-major, so no
    computed tile is transposed into a dot; the loaded tiles' transposes pass."""

    def call():
        qkv = meta(torch.float16, 2, 197, 3 * 2 * 128)
        seed = torch.empty(1, dtype=torch.int64, device="cuda")
        out, stats = attention.attention_fwd(qkv, 2, 128**-0.5, 0.1, seed)
        attention.attention_bwd(torch.empty_like(out), qkv, stats, seed, 2, 128**-0.5, 0.1)

    launches = recorded(call)
    first = {}
    for launch in launches:
        for variant in expand(launch):
            first.setdefault(variant.name, variant)
    assert {"_attention_fwd_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel"} <= set(first)
    for name, variant in first.items():
        for capability in (90, 80):
            resources = compile_cached(variant, capability)
            assert resources.error is None, (name, capability, resources.error)
            assert resources.computed_transposes == [], (name, capability, resources.computed_transposes)


def test_the_report_counts_computed_transposes_per_kernel():
    row = {
        "target": "sm_90",
        "error": None,
        "registers": 128,
        "spill_bytes": 0,
        "shared_bytes": 1024,
        "ctas_per_sm": 2,
        "tensor_cores": "wgmma",
        "tma": False,
    }
    rows = [
        {
            **row,
            "kernel": "_k",
            "computed_transposes": ["tt.trans of arith.truncf -> ttng.warp_group_dot"] * 2,
        },
        {**row, "kernel": "_k", "computed_transposes": []},
        {**row, "kernel": "_clean", "computed_transposes": []},
    ]
    table = summary_table(rows, "sm_90").splitlines()
    assert table[0].endswith("| computed-tile transposes |")
    assert table[2].startswith("| `_clean` |") and table[2].endswith("| 0 |")
    assert table[3].startswith("| `_k` | 2 |") and table[3].endswith("| 2 |")


def _report(path, registers: int, spills: int = 0, extra: bool = False):
    row = {
        "kernel": "_k",
        "target": "sm_90",
        "config": "BLOCK=64 warps=4",
        "signature": {"X": "*fp16"},
        "constexprs": {"BLOCK": "64"},
        "registers": registers,
        "spill_bytes": spills,
        "stack_bytes": 0,
        "shared_bytes": 1024,
        "error": None,
    }
    rows = [row, {**row, "config": "BLOCK=128 warps=4"}] if extra else [row]
    path.write_text(json.dumps({"variants": rows}))
    return path


def test_compare_reports_a_variant_whose_registers_or_spills_change_beyond_the_tolerance(tmp_path):
    from tools.gpu_check.compare import compare

    before = _report(tmp_path / "before.json", 100)
    table, problems = compare(before, _report(tmp_path / "same.json", 104))
    assert problems == [] and "| `_k` | sm_90 | 1 | 1 | 100 -> 104 | 0 | 0 | 0 |" in table, table
    _, problems = compare(before, _report(tmp_path / "more.json", 106))
    assert len(problems) == 1 and "registers 100 -> 106" in problems[0], problems
    _, problems = compare(before, _report(tmp_path / "spills.json", 100, spills=8))
    assert len(problems) == 1 and "spill_bytes 0 -> 8" in problems[0], problems
    _, problems = compare(before, _report(tmp_path / "extra.json", 100, extra=True))
    assert len(problems) == 1 and problems[0].startswith("only in") and "BLOCK=128" in problems[0], problems
