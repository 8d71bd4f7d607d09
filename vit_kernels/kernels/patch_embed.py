"""Patch embedding's Triton kernels: the implicit-im2col forward GEMM and the two backward
kernels (launched by ``vit_kernels.ops.patch_embed``).
"""

from __future__ import annotations

from vit_kernels._triton import tl, triton
from vit_kernels.kernels.gemm import accumulate_dot, block_zero, grouped_tile


@triton.jit
def _pixel_offsets(image, patch_row, patch_col, offs_k, P, stride_n, stride_c, stride_h, stride_w):
    """Offsets of patch elements: rows are patches (image, patch_row, patch_col), columns k the
    flattened (channel, i, j) of nn.Conv2d's weight; pixel (c, patch_row * P + i, patch_col * P + j)."""
    channel = offs_k // (P * P)
    within = offs_k % (P * P)
    y = patch_row[:, None] * P + (within // P)[None, :]
    x = patch_col[:, None] * P + (within % P)[None, :]
    return (
        image[:, None].to(tl.int64) * stride_n
        + channel[None, :].to(tl.int64) * stride_c
        + y.to(tl.int64) * stride_h
        + x.to(tl.int64) * stride_w
    )


# Forward as an implicit-im2col GEMM over all T = L (+1) output rows of every image:
#   row m -> image n = m // T, token t = m % T; t = 0 is the class-token row when HAS_CLS
#   out[m, d] = sum_k patch[m, k] W[d, k] + b[d] + pos[t, d]      (patch rows)
#   out[m, d] = cls[d] + pos[0, d]                                  (class-token rows)
# Patches are gathered straight from the image by strides (NCHW or channels_last): one launch
# where eager PyTorch runs conv, flatten, transpose, cat and add.
@triton.jit
def _patch_embed_fwd_kernel(
    Images, W, Bias, Cls, Pos, Out, total_rows, dim, k_dim, tokens, grid_w, P, stride_n, stride_c, stride_h,
    stride_w, stride_wd, stride_wk, stride_bias,
    HAS_BIAS: tl.constexpr, HAS_CLS: tl.constexpr, HAS_POS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(total_rows, dim, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < total_rows
    mask_n = offs_n < dim
    image = offs_m // tokens
    token = offs_m % tokens
    is_patch = mask_m & (token >= HAS_CLS)
    patch = tl.maximum(token - HAS_CLS, 0)
    patch_row = patch // grid_w
    patch_col = patch % grid_w

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    zero = block_zero(BLOCK_M, BLOCK_N)
    for start_k in range(0, k_dim, BLOCK_K):
        ks = start_k + offs_k
        mask_k = ks < k_dim
        a = tl.load(
            Images
            + _pixel_offsets(
                image=image,
                patch_row=patch_row,
                patch_col=patch_col,
                offs_k=ks,
                P=P,
                stride_n=stride_n,
                stride_c=stride_c,
                stride_h=stride_h,
                stride_w=stride_w,
            ),
            mask=is_patch[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            W + ks[:, None].to(tl.int64) * stride_wk + offs_n[None, :].to(tl.int64) * stride_wd,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = accumulate_dot(acc, a, b, zero, PRECISION)

    if HAS_BIAS:
        bias = tl.load(Bias + offs_n.to(tl.int64) * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(is_patch[:, None], bias[None, :], 0.0)
    if HAS_CLS:
        cls = tl.load(Cls + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = tl.where((token == 0)[:, None], cls[None, :], acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_POS:
        acc += tl.load(Pos + token[:, None].to(tl.int64) * dim + offs_n[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(
        Out + offs_m[:, None].to(tl.int64) * dim + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=mask
    )


# d(weight)[d, k] = sum over patch rows m of dOut[m, d] * patch[m, k]: tiles of (D, K), the patches
# re-gathered from the image while reducing over the N * L patch rows, split into slices of
# rows_per_split rows (grid axis 2) whose float32 partial sums the host adds up when there are several.
@triton.jit
def _patch_embed_bwd_weight_kernel(
    Images, DOut, DW, num_patches, dim, k_dim, tokens, grid_w, P, rows_per_split, stride_n, stride_c,
    stride_h, stride_w, stride_dw_split,
    HAS_CLS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_d = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_s = tl.program_id(2)
    first_row = pid_s * rows_per_split
    last_row = tl.minimum(first_row + rows_per_split, num_patches)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_d = offs_d < dim
    mask_k = offs_k < k_dim
    patches_per_image = tokens - HAS_CLS
    acc = tl.zeros([BLOCK_D, BLOCK_K], dtype=tl.float32)
    zero = block_zero(BLOCK_D, BLOCK_K)
    for start_m in range(first_row, last_row, BLOCK_M):
        rows = start_m + offs_m
        mask_m = rows < last_row
        image = rows // patches_per_image
        patch = rows % patches_per_image
        out_rows = image.to(tl.int64) * tokens + HAS_CLS + patch
        dout_t = tl.load(
            DOut + out_rows[None, :] * dim + offs_d[:, None],
            mask=mask_d[:, None] & mask_m[None, :],
            other=0.0,
        )
        a = tl.load(
            Images
            + _pixel_offsets(
                image=image,
                patch_row=patch // grid_w,
                patch_col=patch % grid_w,
                offs_k=offs_k,
                P=P,
                stride_n=stride_n,
                stride_c=stride_c,
                stride_h=stride_h,
                stride_w=stride_w,
            ),
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc = accumulate_dot(acc, dout_t, a.to(dout_t.dtype), zero, PRECISION)
    tl.store(
        DW + pid_s.to(tl.int64) * stride_dw_split + offs_d[:, None].to(tl.int64) * k_dim + offs_k[None, :],
        acc.to(DW.dtype.element_ty),
        mask=mask_d[:, None] & mask_k[None, :],
    )


# d(images): each pixel belongs to exactly one patch (stride = kernel), so
#   dImages[pixel(m, k)] = sum_d dOut[m, d] W[d, k]
# is a GEMM whose result is scattered back through the same pixel offsets (col2im without overlap).
@triton.jit
def _patch_embed_bwd_input_kernel(
    DOut, W, DImages, num_patches, dim, k_dim, tokens, grid_w, P, stride_n, stride_c, stride_h, stride_w,
    stride_wd, stride_wk,
    HAS_CLS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < num_patches
    mask_k = offs_k < k_dim
    patches_per_image = tokens - HAS_CLS
    image = offs_m // patches_per_image
    patch = offs_m % patches_per_image
    out_rows = image.to(tl.int64) * tokens + HAS_CLS + patch
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    zero = block_zero(BLOCK_M, BLOCK_K)
    for start_d in range(0, dim, BLOCK_D):
        ds = start_d + offs_d
        mask_d = ds < dim
        dout = tl.load(
            DOut + out_rows[:, None] * dim + ds[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0
        )
        w = tl.load(
            W + ds[:, None].to(tl.int64) * stride_wd + offs_k[None, :].to(tl.int64) * stride_wk,
            mask=mask_d[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc = accumulate_dot(acc, dout, w.to(dout.dtype), zero, PRECISION)
    offsets = _pixel_offsets(
        image=image, patch_row=patch // grid_w, patch_col=patch % grid_w, offs_k=offs_k, P=P,
        stride_n=stride_n, stride_c=stride_c, stride_h=stride_h, stride_w=stride_w,
    )  # fmt: skip
    tl.store(DImages + offsets, acc.to(DImages.dtype.element_ty), mask=mask_m[:, None] & mask_k[None, :])
