"""python -m benchmarks.block_traffic: the kernels one ViT block launches and the bytes they move,
forward and backward, per backend, counted without a device.

The block (``vit_kernels.nn.Block``, pre-norm, as in ViT/timm) runs on the simulated CUDA device
(``tools.cuda_sim``, an H100) with its parameters, input and output gradient in one dtype. A kernel
is a Triton launch (recorded, not run, the default tile of each launcher: the device reports a graph
capture, so nothing is measured), an op of the extension, or an aten op
that computes (views, allocations and detaches excluded); nothing else reaches the device. Its bytes
are the distinct elements of every tensor it reads and writes, each counted once (an expanded
tensor by its stored elements): the least traffic the kernel can have. Real traffic is higher where
a GEMM re-reads operand tiles past L2 and for the float32 partial sums a reduction writes, so the
figures compare fusions (a pass that disappears takes its bytes with it), not kernels' speeds.

Columns per backend (``torch`` = eager PyTorch, the baseline; ``extension`` runs PyTorch's SDPA for
attention, as on a GPU): kernels and MB, forward and backward. ``--detail`` lists each kernel.

    python -m benchmarks.block_traffic [--model vit_base] [--batch 128] [--dtype bf16] [--detail] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Optional
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vit_kernels as vk
from tools.cuda_sim import simulated_cuda
from vit_kernels.nn import Block

MODELS = {
    "vit_tiny": (192, 3),
    "vit_small": (384, 6),
    "vit_base": (768, 12),
    "vit_large": (1024, 16),
    "vit_huge": (1280, 16),
}  # D, H
TOKENS = {"vit_huge": 257}  # /14 at 224 px; the others /16: 197
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("torch", "triton", "extension")


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t``: dimensions of stride 0 (expanded) count once."""
    if t.numel() == 0:
        return 0
    return math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()


def _is_view_or_allocation(func) -> bool:
    schema = func._schema
    if schema.name.split("::")[-1].startswith(("empty", "new_empty")) or schema.name in (
        "aten::detach",
        "aten::lift_fresh",
        "aten::_unsafe_view",
    ):
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


class OpCounter(TorchDispatchMode):
    """Records every aten / extension op that computes as [name, bytes] (reads and writes of distinct
    tensors, an argument written in place counted as a write only). Eager calls stay eager inside it
    (``sees_eager_calls``): vit_kernels' launchers run their bodies, whose launches are recorded."""

    sees_eager_calls = True

    def __init__(self, kernels: list[list]):
        super().__init__()
        self.kernels = kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_view_or_allocation(func):
            return out
        written = {
            id(a)
            for a, arg in zip(args, func._schema.arguments)
            if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write
        }
        written |= {id(v) for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)}
        tensors = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        read = sum(stored_bytes(t) for key, t in tensors.items() if key not in written)
        outputs = {id(t): t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        self.kernels.append(
            [str(func.overloadpacket.__name__), read + sum(stored_bytes(t) for t in outputs.values())]
        )
        return out


def _launch_kernels(launches) -> list[list]:
    """[kernel name, bytes of its distinct tensor arguments] per recorded launch."""
    kernels = []
    for launch in launches:
        tensors = {id(a): a for a in launch.args if isinstance(a, torch.Tensor)}
        kernels.append([launch.kernel.fn.__name__, sum(stored_bytes(t) for t in tensors.values())])
    return kernels


def _sdpa_as_on_a_gpu(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as a GPU runs it: one fused kernel (flash for 16-bit inputs,
    memory-efficient for float32) and its backward, where the simulated device's meta tensors would
    take the math path."""
    if attn_mask is not None or enable_gqa:
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[
            0
        ]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p, is_causal, scale=scale
    )[0]


_SDPA = torch.nn.functional.scaled_dot_product_attention


def count_block(backend: str, dim: int, heads: int, tokens: int, batch: int, dtype: torch.dtype) -> dict:
    """{"forward": [[kernel, bytes], ...], "backward": [...]} of one pre-norm block on ``backend``
    (strict except on the extension, whose fallbacks to PyTorch are by design here: see above)."""
    passes = {}
    with (
        warnings.catch_warnings(),
        simulated_cuda(90, measuring=False) as device,
        vk.use_backend(backend, strict=backend != "extension"),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _sdpa_as_on_a_gpu),
    ):
        warnings.simplefilter("ignore", RuntimeWarning)
        block = Block(dim, heads).to(device="cuda", dtype=dtype)
        x = torch.empty(batch, tokens, dim, device="cuda", dtype=dtype, requires_grad=True)
        grad = torch.empty(batch, tokens, dim, device="cuda", dtype=dtype)
        launches = device.launches
        for step in ("forward", "backward"):
            kernels: list[list] = []
            launches.clear()
            with OpCounter(kernels):
                if step == "forward":
                    out = block(x)
                else:
                    out.backward(grad)
            # op and launch order interleave on a GPU; kept apart here (ops first)
            passes[step] = kernels + _launch_kernels(launches)
    return passes


def measure(model: str, batch: int, dtype: torch.dtype, backends=BACKENDS) -> dict:
    """{model, batch, tokens, dim, heads, dtype, rows: {backend: {"forward": [[kernel, bytes], ...],
    "backward": [...]}}}: plain JSON."""
    dim, heads = MODELS[model]
    tokens = TOKENS.get(model, 197)
    rows = {name: count_block(name, dim, heads, tokens, batch, dtype) for name in backends}
    return {
        "model": model,
        "batch": batch,
        "tokens": tokens,
        "dim": dim,
        "heads": heads,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
    }


def title(result: dict) -> str:
    return (
        f"one pre-norm block of {result['model']} (D={result['dim']}, H={result['heads']}, L={result['tokens']}), "
        f"batch {result['batch']}, {result['dtype']}: kernels and least bytes moved"
    )


def table(result: dict, markdown: bool = False) -> str:
    """Per backend: kernels and MB forward and backward, total MB and its ratio to the first backend's."""
    header = ["backend", "fwd kernels", "fwd MB", "bwd kernels", "bwd MB", "total MB", "vs torch"]
    body = []
    base = None
    for name, row in result["rows"].items():
        mb = {step: sum(b for _, b in row[step]) / 1e6 for step in ("forward", "backward")}
        total = mb["forward"] + mb["backward"]
        base = base or total
        body.append(
            [
                name,
                str(len(row["forward"])),
                f"{mb['forward']:.0f}",
                str(len(row["backward"])),
                f"{mb['backward']:.0f}",
                f"{total:.0f}",
                f"{total / base:.2f}",
            ]
        )
    if markdown:
        return "\n".join(
            ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
            + ["| " + " | ".join(cells) + " |" for cells in body]
        )
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header] + body
    )


def detail(result: dict) -> str:
    lines = []
    for name, row in result["rows"].items():
        for step in ("forward", "backward"):
            lines.append(f"\n{name} {step}:")
            lines += [f"  {kernel:<40} {size / 1e6:>9.1f} MB" for kernel, size in row[step]]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.block_traffic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="vit_base", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--detail", action="store_true", help="list every kernel")
    parser.add_argument("--json", type=Path, default=None, help="also write the counts to this JSON file")
    args = parser.parse_args(argv)
    result = measure(args.model, args.batch, DTYPES[args.dtype])
    print(title(result) + ", MB")
    print(table(result))
    if args.detail:
        print(detail(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
