"""benchmarks.block_traffic: one ViT block's kernels and bytes per backend, counted on meta tensors
without a device (Triton launches recorded, not run)."""

import json

import pytest
import torch

from benchmarks import block_traffic
from vit_kernels._triton import HAS_TRITON


@pytest.fixture(scope="module")
def counts():
    return block_traffic.measure("vit_tiny", 2, torch.bfloat16)


def names(row, step):
    return [kernel for kernel, _ in row[step]]


def test_pytorch_runs_sdpa_as_one_fused_kernel_each_way(counts):
    torch_row = counts["rows"]["torch"]
    assert names(torch_row, "forward").count("_scaled_dot_product_flash_attention") == 1
    assert names(torch_row, "backward").count("_scaled_dot_product_flash_attention_backward") == 1
    assert "bmm" not in names(torch_row, "forward")  # not the math fallback of meta tensors


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_triton_block_is_its_kernels_and_makes_no_zero_gradients(counts):
    """Forward: two LayerNorms, four GEMMs (qkv, proj + residual, fc1 + GELU, fc2 + residual: the
    TMA kernel, sm_90's default where descriptors read the operands), the fused attention; backward:
    no tensor of zeros for outputs only backward reads (the saved pre-activation and hidden of the
    MLP), the attention backward's two kernels."""
    row = counts["rows"]["triton"]
    gemm = "_linear_tma_kernel"
    assert names(row, "forward") == [
        "_layer_norm_fwd_kernel",
        gemm,
        "_attention_fwd_kernel",
        gemm,
        "_layer_norm_fwd_kernel",
        gemm,
        gemm,
    ]
    backward = names(row, "backward")
    assert "zeros" not in backward
    assert backward.count("_attention_bwd_dq_kernel") == backward.count("_attention_bwd_dkdv_kernel") == 1
    assert backward.count("_gelu_bwd_kernel") == 0  # GELU' rides in mlp's dZ GEMM


def test_bytes_are_the_distinct_elements_each_kernel_touches(counts):
    expanded = torch.empty(5, device="meta", dtype=torch.bfloat16).expand(3, 5)
    assert block_traffic.stored_bytes(expanded) == 10
    assert block_traffic.stored_bytes(torch.empty(0, 4, device="meta")) == 0
    for row in counts["rows"].values():
        for step in ("forward", "backward"):
            assert row[step] and all(size >= 0 for _, size in row[step])
    # the layer norm forward reads x (bf16), weight and bias and writes y, and float32 mean and rstd
    rows, d = 2 * counts["tokens"], counts["dim"]
    name, size = counts["rows"]["torch"]["forward"][0]
    assert name == "native_layer_norm"
    assert size == 2 * (rows * d * 2) + 2 * (d * 2) + 2 * (rows * 4)


def test_the_table_names_every_backend(counts, capsys, tmp_path):
    assert (
        block_traffic.main(["--model", "vit_tiny", "--batch", "1", "--json", str(tmp_path / "counts.json")])
        == 0
    )
    out = capsys.readouterr().out
    assert all(f"\n{name} " in out for name in block_traffic.BACKENDS)
    assert json.loads((tmp_path / "counts.json").read_text())["rows"].keys() == set(block_traffic.BACKENDS)
    markdown = block_traffic.table(counts, markdown=True).splitlines()
    assert markdown[0].startswith("| backend | fwd kernels") and len(markdown) == 2 + len(
        block_traffic.BACKENDS
    )
