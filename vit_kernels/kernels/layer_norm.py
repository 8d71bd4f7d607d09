"""LayerNorm's forward and backward Triton kernels (launched by ``vit_kernels.ops.layer_norm``)."""

from __future__ import annotations

from vit_kernels._triton import as_float32, tl, triton


# Forward, one program per ROWS rows (D <= BLOCK_D columns, one tile per row):
#   s = x + r (stored when there is a residual), m0 = sum(s) / D, c = sum(s - m0) / D, mean = m0 + c,
#   var = sum((s - m0)^2) / D - c^2  (= sum((s - mean)^2) / D, the corrected two-pass form),
#   rstd = 1 / sqrt(var + eps), y = (s - mean) * rstd * w + b; mean and rstd saved for backward.
@triton.jit
def _layer_norm_fwd_kernel(
    X, Residual, Weight, Bias, Y, Sum, Mean, Rstd, num_rows, num_cols, stride_x, stride_r, stride_y, stride_s,
    stride_w, stride_b, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    eps = as_float32(eps)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask_rows = rows < num_rows
    mask_cols = cols < num_cols
    mask = mask_rows[:, None] & mask_cols[None, :]
    s = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rounded = (s + r).to(Sum.dtype.element_ty)
        tl.store(Sum + rows[:, None] * stride_s + cols[None, :], rounded, mask=mask)
        s = rounded.to(tl.float32)  # normalise the rounded sum that is returned and that backward re-reads
    mean = tl.sum(s, 1) / num_cols
    centered = tl.where(mask, s - mean[:, None], 0.0)
    # corrected two-pass moments: the centred values' own mean removes the rounding of the first sum
    # (rows with a large mean and a small spread keep their digits)
    correction = tl.sum(centered, 1) / num_cols
    mean += correction
    var = tl.sum(centered * centered, 1) / num_cols - correction * correction
    centered = tl.where(mask, centered - correction[:, None], 0.0)
    # a variance past the float range has no finite reciprocal: NaN, as PyTorch gives, not a silent 0
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(tl.maximum(var, 0.0) + eps), float("nan"))
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(Weight + cols * stride_w, mask=mask_cols, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(Bias + cols * stride_b, mask=mask_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=mask_rows)
    tl.store(Rstd + rows, rstd, mask=mask_rows)


# Backward, one program per `tiles` consecutive tiles of ROWS rows (the grid is sized to the GPU),
# with xhat = (s - mean) * rstd and g = dy * w:
#   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dS, the gradient reaching the returned sum)
#   dx = dr = ds;  d(weight) = sum_rows dy * xhat,  d(bias) = sum_rows dy, accumulated per element
#   over the program's tiles and reduced over rows once, written as per-program partial sums (fp32)
#   that the host adds up: no atomics, a deterministic result. `tiles` varies with the batch: not
#   specialised on (one compiled variant whatever its value).
@triton.jit(do_not_specialize=["tiles"])
def _layer_norm_bwd_kernel(
    S, DY, DSum, Weight, Mean, Rstd, DS, PartialW, PartialB, num_rows, num_cols, tiles, stride_s, stride_dy,
    stride_dsum, stride_ds, stride_w,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEEDS_WB: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask_cols = cols < num_cols
    if HAS_WEIGHT:
        w = tl.load(Weight + cols * stride_w, mask=mask_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for tile in range(tiles):
        rows = (pid * tiles + tile).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask_rows = rows < num_rows
        mask = mask_rows[:, None] & mask_cols[None, :]
        s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=mask_rows, other=0.0)
        rstd = tl.load(Rstd + rows, mask=mask_rows, other=0.0)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        # g through a select (a no-op: dy is 0 off the mask): g - mean(g) must subtract the rounded
        # product, not contract into fma(dy, w, -mean(g)), whose rounding residue rstd amplifies
        # (at width 1, where ds is exactly 0, to 1e-5 of dy)
        g = tl.where(mask, dy * w[None, :], 0.0) if HAS_WEIGHT else dy
        c1 = tl.sum(g * xhat, 1) / num_cols
        c2 = tl.sum(g, 1) / num_cols
        ds = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DSUM:
            ds += tl.load(DSum + rows[:, None] * stride_dsum + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(DS + rows[:, None] * stride_ds + cols[None, :], ds.to(DS.dtype.element_ty), mask=mask)
        if NEEDS_WB:
            dw += dy * xhat
            db += dy
    if NEEDS_WB:
        tl.store(PartialW + pid.to(tl.int64) * num_cols + cols, tl.sum(dw, 0), mask=mask_cols)
        tl.store(PartialB + pid.to(tl.int64) * num_cols + cols, tl.sum(db, 0), mask=mask_cols)
