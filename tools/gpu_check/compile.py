"""Ahead-of-time compilation of recorded launches for real GPU targets, and their resource usage.

A recorded ``Launch`` is bound the way Triton's JIT binds it at a real launch (its own binder:
integers equal to 1 become constants, integers and pointers divisible by 16 get the divisibility
attribute, large integers become i64), then compiled with ``triton.compile`` for a ``GPUTarget``.
Registers, spill (local) bytes and stack come from the cubin through the ``cuobjdump`` that ships
with Triton; shared memory from the compiled kernel's metadata; tensor-core use from the PTX;
transposes of computed tiles feeding a dot (triton-lang/triton#6124) from the TTGIR (``ttgir``).

What a compile found is kept on disk (``Compiled``) by the variant's exact key and by its kind
(the key without Triton's divisibility attributes): the compile gate reads exact keys only, so each
alignment of a GEMM (whose registers and shared memory differ with it) is compiled once; the
simulated device, which compiles one launch per kind, reads any launch of the kind the gate or an
earlier run compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

from tools.cuda_sim import Launch
from tools.gpu_check.ttgir import computed_transposes

# Per-SM limits of the targets: registers, threads, resident CTAs, shared memory per SM and the
# most one block may opt in to (CUDA C Programming Guide, compute capabilities 8.0 and 9.0).
TARGETS = {
    80: {"regs": 65536, "threads": 2048, "ctas": 32, "smem_sm": 167936, "smem_block": 166912},
    90: {"regs": 65536, "threads": 2048, "ctas": 32, "smem_sm": 233472, "smem_block": 232448},
}
GRID_LIMITS = (2**31 - 1, 65535, 65535)
CACHE_ENV = "VIT_KERNELS_COMPILED_CACHE"  # the folder in place of ~/.cache/vit_kernels (make ci-cold: empty)


def _ptxas_version() -> str:
    """The version of the ptxas Triton compiles sm_90 with ("13.0.88"), or "unknown"."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        try:
            text = get_ptxas_version(90)
        except TypeError:  # triton before 3.8 takes no architecture
            text = get_ptxas_version()
    except Exception:  # no ptxas: the compiles fail anyway, and say why
        return "unknown"
    found = re.search(r"release ([\d.]+), V([\d.]+)", text)
    return found.group(2) if found else "unknown"


def compiled_folder() -> Path:
    """Where the gate, the simulated device's recorded launches and the ``aot`` tests keep what
    their compiles found (``Compiled``): outside the clone, so that a fresh clone's CI reads what an
    earlier run compiled; one folder per Triton and ptxas version."""
    base = (
        os.environ.get(CACHE_ENV)
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vit_kernels"
    )
    return Path(base) / f"compiled-triton{triton.__version__}-ptxas{_ptxas_version()}"


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@dataclass
class Variant:
    """One launch after autotune expansion: a JITFunction with concrete meta-parameters."""

    kernel: JITFunction
    grid: tuple[int, int, int]
    args: tuple
    kwargs: dict
    config: str  # the meta-parameters that pick tiles, warps and stages, as text

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def int_args(self) -> dict[str, int]:
        """The kernel's integer (non-constexpr) arguments by name."""
        names = self.kernel.arg_names
        return {n: v for n, v in zip(names, self.args) if isinstance(v, int) and not isinstance(v, bool)}

    def tensor_extents(self) -> dict[str, int]:
        """Elements from each tensor argument's base pointer to its last element."""
        names = self.kernel.arg_names
        return {
            n: 1 + sum((size - 1) * abs(stride) for size, stride in zip(v.shape, v.stride()))
            for n, v in zip(names, self.args)
            if isinstance(v, torch.Tensor) and v.numel() > 0
        }


def expand(launch: Launch) -> list[Variant]:
    """The launch itself, or for an autotuned kernel one variant per config its pruning keeps for
    these arguments (every config the autotuner could pick at this shape)."""
    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    if not isinstance(kernel, Autotuner):
        grid = launch.grid
        config = _describe(kwargs)
        return [Variant(kernel, _grid3(grid), launch.args, kwargs, config)]
    named = dict(zip(kernel.arg_names, launch.args))
    configs = kernel.configs
    if kernel.early_config_prune is not None:
        configs = kernel.early_config_prune(configs, named, **kwargs)
    variants = []
    for config in configs:
        full = {**kwargs, **config.all_kwargs()}
        full = {
            k: v for k, v in full.items() if v is not None and k not in ("num_ctas", "maxnreg", "ir_override")
        }
        grid = launch.grid({**named, **full}) if callable(launch.grid) else launch.grid
        variants.append(Variant(kernel.fn, _grid3(grid), launch.args, full, _describe(full)))
    return variants


def _grid3(grid) -> tuple[int, int, int]:
    grid = tuple(int(g) for g in grid)
    return grid + (1,) * (3 - len(grid))


def _describe(kwargs: dict) -> str:
    keys = [k for k in kwargs if k.startswith("BLOCK") or k in ("ROWS", "TILES", "GROUP_M")]
    parts = [f"{k}={kwargs[k]}" for k in keys]
    parts.append(f"warps={kwargs.get('num_warps', 4)}")
    parts.append(f"stages={kwargs.get('num_stages', 3)}")
    return " ".join(parts)


@dataclass
class Bound:
    """A variant bound for one target: what ``triton.compile`` takes, and a key naming it."""

    signature: dict
    constexprs: dict
    attrs: dict
    options: Any
    key: str = field(default="")
    kind: str = field(default="")  # the key without the attributes (which arguments are multiples of 16)


@functools.cache
def _backend(capability: int):
    return make_backend(GPUTarget("cuda", capability, 32))


@functools.cache
def _binder(kernel: JITFunction, capability: int):
    return create_function_from_signature(kernel.signature, kernel.params, _backend(capability))


def bind(variant: Variant, capability: int) -> Bound:
    """Specialise the variant's arguments exactly as Triton's JIT does at launch."""
    backend = _backend(capability)
    kernel = variant.kernel
    binder = _binder(kernel, capability)
    kwargs = dict(variant.kwargs)
    bound_args, specialization, options = binder(*variant.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    parts = (
        kernel.cache_key,
        sorted(signature.items()),
        sorted(constexprs.items(), key=str),
        sorted(_key_options(options).items(), key=str),
        capability,
    )
    key, kind = (_digest(repr(parts + (sorted(attrs.items(), key=str),))), _digest(repr(parts)))
    return Bound(signature, constexprs, attrs, options, key, kind)


def _key_options(options) -> dict:
    """The compile options as a key reads them: each extern library by its file name, not its path,
    which names the checkout's environment (the folder's name carries Triton's version, which
    decides the library), so that clones of the repository share the compiled folder."""
    fields = dict(options.__dict__)
    if fields.get("extern_libs"):
        fields["extern_libs"] = tuple((name, os.path.basename(path)) for name, path in fields["extern_libs"])
    return fields


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class Resources:
    """What one compiled variant uses on its target."""

    registers: int = 0
    spill_bytes: int = 0  # local memory per thread (register spills)
    stack_bytes: int = 0
    shared_bytes: int = 0
    num_warps: int = 0
    ctas_per_sm: int = 0
    tensor_cores: str = "none"  # wgmma, mma, or none
    tma: bool = False  # tiles copied by the Tensor Memory Accelerator (cp.async.bulk.tensor)
    # register transposes of computed tiles that reach a dot operand, described (ttgir.Transpose)
    computed_transposes: list[str] = field(default_factory=list)
    error: Optional[str] = None
    ttir: str = ""


def compile_variant(variant: Variant, capability: int, bound: Bound) -> Resources:
    """Compile for ``sm_<capability>`` and read the resources; a compile error is returned, not raised."""
    target = GPUTarget("cuda", capability, 32)
    try:
        compiled = triton.compile(
            ASTSource(variant.kernel, bound.signature, bound.constexprs, bound.attrs),
            target=target,
            options=bound.options.__dict__,
        )
    except Exception as error:  # the gate reports every compile failure with its message
        message = str(error).strip().splitlines()
        return Resources(error=f"{type(error).__name__}: {message[-1] if message else ''}"[:400])
    usage = _cuobjdump(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    tensor_cores = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "none"
    warps = compiled.metadata.num_warps
    shared = compiled.metadata.shared
    return Resources(
        registers=usage["REG"],
        spill_bytes=usage["LOCAL"],
        stack_bytes=usage["STACK"],
        shared_bytes=shared,
        num_warps=warps,
        ctas_per_sm=ctas_per_sm(capability, usage["REG"], warps, shared),
        tensor_cores=tensor_cores,
        tma="cp.async.bulk.tensor" in ptx,
        computed_transposes=[str(t) for t in computed_transposes(compiled.asm["ttgir"])],
        ttir=compiled.asm["ttir"],
    )


class Compiled:
    """What compiles found (``Resources``), on disk under ``folder`` (default ``compiled_folder()``):
    one JSON file per exact key and one per kind. A key holds everything that decides the compiled
    code: the kernel's source key (Triton's ``cache_key``: its source, the jit functions it calls and
    the constexpr globals it reads), the signature, the constexprs, the options and the target; the
    folder's name carries Triton's and ptxas's versions, and a subfolder this module's and
    ``ttgir``'s sources, so a change to the compiler or to how resources are read starts afresh. A
    hit is as good as a compile. Files are written whole (a temporary file renamed), so parallel
    compiles and parallel runs share it."""

    def __init__(self, folder: Optional[Path] = None):
        here = Path(__file__).parent
        sources = (here / "compile.py").read_bytes() + (here / "ttgir.py").read_bytes()
        folder = compiled_folder() if folder is None else Path(folder)
        self.folder = folder / f"gate-{hashlib.sha256(sources).hexdigest()[:12]}"

    def _read(self, name: str) -> Optional[Resources]:
        try:
            return Resources(**json.loads((self.folder / f"{name}.json").read_text()))
        except (FileNotFoundError, ValueError, TypeError):  # absent, or not a whole record: compile again
            return None

    def exact(self, bound: Bound) -> Optional[Resources]:
        return self._read(bound.key)

    def of_kind(self, bound: Bound) -> Optional[Resources]:
        return self._read(f"kind-{bound.kind}")

    def compile(
        self, variant: Variant, capability: int, bound: Bound, *, any_of_kind: bool = False
    ) -> tuple[Resources, bool]:
        """(``compile_variant``'s answer, whether it was read rather than compiled): read from the
        folder where this key (with ``any_of_kind``: else any key of its kind) was compiled before,
        else compiled and kept. A compile error is not kept: it may have been the machine's (memory,
        disk), and is cheap to meet again."""
        found = self.exact(bound)
        if found is None and any_of_kind:
            found = self.of_kind(bound)
        if found is not None:
            return found, True
        resources = compile_variant(variant, capability, bound)
        if resources.error is not None:
            return resources, False
        self.folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(resources))
        for name in (bound.key, f"kind-{bound.kind}"):
            temporary = self.folder / f".{name}.{os.getpid()}.tmp"
            temporary.write_text(text)
            os.replace(temporary, self.folder / f"{name}.json")
        return resources, False


def count_line(found: list[tuple[Resources, bool]], duplicates: int, compiled: Optional[Compiled]) -> str:
    """What a compile stage did with its variants (``Compiled.compile``'s answers): compiled, read
    from the cache, skipped as duplicates of a variant held already."""
    read = sum(hit for _, hit in found)
    return (
        f"{len(found) - read} variants compiled, {read} found in the cache "
        f"({compiled.folder if compiled else 'none'}), {duplicates} skipped as duplicates"
    )


@functools.cache
def _shared() -> Compiled:
    return Compiled()


def compile_cached(variant: Variant, capability: int) -> Resources:
    """``compile_variant`` of the variant bound for ``sm_<capability>``, through the folder the gate
    and the simulated device share (``Compiled``): each exact variant compiled once."""
    return _shared().compile(variant, capability, bind(variant, capability))[0]


def _cuobjdump(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def ctas_per_sm(capability: int, registers: int, num_warps: int, shared: int) -> int:
    """Resident CTAs per SM, limited by registers (allocated per warp in units of 256), threads,
    the CTA slot count and shared memory (1 KB reserved per CTA)."""
    limits = TARGETS[capability]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = (limits["regs"] // per_warp) // num_warps
    by_threads = limits["threads"] // (32 * num_warps)
    by_shared = limits["smem_sm"] // (shared + 1024)
    return max(0, min(by_regs, by_threads, limits["ctas"], by_shared))
