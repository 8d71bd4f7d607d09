"""2-D axial rotary position embedding (EVA02's RoPE) as the (cos, sin) tables ``vk.attention`` takes.

A patch at row i, column j of an (h, w) grid gets, for each of the Dh/4 frequencies
``w_k = temperature^(-k / (Dh/4))``, the angles ``i * w_k`` and ``j * w_k``: Dh/2 angles
``f = [i w_0 .. i w_{Dh/4-1}, j w_0 .. j w_{Dh/4-1}]``, each rotating one pair of q's and k's
columns. In the interleaved layout the pair of angle m is the columns (2m, 2m + 1), so
``cos[n, 2m] = cos[n, 2m + 1] = cos(f_m)`` (and sin alike) for the patch n = i * w + j.

With ``ref_grid`` (EVA02's ``ref_feat_shape``: the grid the model was pretrained on), positions are
rescaled to it, ``i * ref_h / h``, so a model run at another resolution sees the angles it learned.
The tables are computed in float32 with the operations timm uses, so they are the very numbers of
timm's ``RotaryEmbeddingCat`` (``in_pixels=False``), and a model converted to float64 matches.
"""

from __future__ import annotations

from typing import Optional

import torch


def axial_rope_tables(
    grid: tuple[int, int],
    head_dim: int,
    temperature: float = 10000.0,
    ref_grid: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) patch grid -> (cos, sin), each (h * w, head_dim) float32, interleaved layout."""
    if head_dim % 4:
        raise ValueError(f"2-D rotary embedding needs head_dim divisible by 4, got {head_dim}")
    bands_per_axis = head_dim // 4
    exponents = torch.arange(bands_per_axis, dtype=torch.int64).to(torch.float32) / bands_per_axis
    frequencies = 1.0 / (temperature**exponents)
    positions = [torch.arange(size, dtype=torch.int64).to(torch.float32) for size in grid]
    if ref_grid is not None:
        positions = [p / size * ref for p, size, ref in zip(positions, grid, ref_grid)]
    coordinates = torch.stack(torch.meshgrid(positions, indexing="ij"), dim=-1)  # (h, w, 2)
    angles = coordinates.unsqueeze(-1) * frequencies  # (h, w, 2, Dh/4)

    def table(values: torch.Tensor) -> torch.Tensor:
        return values.flatten(-2).flatten(0, -2).repeat_interleave(2, -1)  # (h*w, Dh/2) -> pairs

    return table(angles.cos()), table(angles.sin())
