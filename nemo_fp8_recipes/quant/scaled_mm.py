"""The raw FP8 GEMM calls of cuBLAS on tensors (codes and scale grids, no
:class:`~.reference.QuantizedTensor`): the scale layouts cuBLAS expects, row padding, and the SM90
block-scaled GEMM. :mod:`.gemm` dispatches to these; :mod:`.ops` wraps :func:`blockwise_matmul`
as a custom operator for ``torch.compile``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["blockwise_matmul", "has_scaled_mm_v2", "outer_major", "pad_rows", "scalar_scale", "to_blocked_e8m0"]


def pad_rows(t: torch.Tensor, mult: int) -> torch.Tensor:
    r = t.shape[0]
    pad = (-r) % mult
    if pad == 0:
        return t
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], dim=0)


def outer_major(s: torch.Tensor) -> torch.Tensor:
    """Same values, column-major strides (1, rows): the layout cuBLAS wants for block scales
    (no copy for a grid already laid out so, :func:`~.reference.scale_grid`)."""
    return s.t().contiguous().t()


def to_blocked_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Rearrange a ``[rows, K/32]`` E8M0 scale grid into cuBLAS' swizzled 128x4 tile layout
    (rows padded to 128, scale columns to 4; each 128x4 tile stored as 32x16 interleaved)."""
    rows, cols = scales.shape
    n_rb, n_cb = -(-rows // 128), -(-cols // 4)
    # padding holds 2^0 (biased exponent 127); the rearrangement works on the raw bytes
    padded = torch.full((n_rb * 128, n_cb * 4), 127, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    blocks = padded.view(n_rb, 128, n_cb, 4).permute(0, 2, 1, 3)
    tiles = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return tiles.flatten().view(torch.float8_e8m0fnu)


def has_scaled_mm_v2() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def scalar_scale(s: torch.Tensor) -> torch.Tensor:
    """A per-tensor ``scale_inv`` as ``torch._scaled_mm`` takes it: one FP32 element (the
    quantisers' ``[1, 1]`` FP32 scales pass as they are; no reshape or cast per GEMM)."""
    if s.dtype != torch.float32:
        s = s.float()
    return s if s.dim() == 0 or s.shape == (1, 1) else s.reshape(())


def blockwise_matmul(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    weight_blocks: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The SM90 block-scaled GEMM ``A · Bᵀ`` on raw tensors: ``a_data`` ``[M, K]`` FP8 codes with
    1x128 groups along K (``a_scale_inv`` ``[M, K/128]``); ``b_data`` ``[N, K]`` with 128x128 blocks
    (``weight_blocks``, ``b_scale_inv`` ``[N/128, K/128]``: fprop, dgrad) or 1x128 groups along K
    (``[N, K/128]``: wgrad). Lays the scales out as cuBLAS wants them (outer-dim major, the
    128x128 grid's K blocks padded to a multiple of 4) and pads A's rows to 128 with zero rows
    of scale 1; the fused quantisers already write 1x128 grids outer-dim major
    (:func:`~nemo_fp8_recipes.quant.reference.scale_grid`), which then pass through without a copy (unless A's rows
    need padding, which makes a new grid). Returns ``[M, N]`` in ``out_dtype``. FP32 accumulation (no fast accumulation:
    cuBLAS' block-scaled kernels promote every K block)."""
    M, K = a_data.shape
    if b_data.shape[1] != K:
        raise ValueError(f"contraction dims differ: {tuple(a_data.shape)} x {tuple(b_data.shape)}")
    a_data = pad_rows(a_data.contiguous(), 128)
    sa = pad_rows(a_scale_inv.float(), 128)
    if sa.shape[0] != M:
        sa[M:] = 1.0
    if weight_blocks:
        # 128x128 weight blocks: shape (L4, N/128) with strides (1, L4), L4 = K/128 rounded
        # up to a multiple of 4 — the transpose of a contiguous (N/128, L4) grid
        sw = b_scale_inv.float()
        kb = sw.shape[1]
        l4 = -(-kb // 4) * 4
        if l4 != kb:
            sw = torch.cat([sw, sw.new_ones(sw.shape[0], l4 - kb)], dim=1)
        sb = sw.contiguous().t()
        recipe_b = "BlockWise128x128"
    else:
        # 1x128 x 1x128 (wgrad): scale_b shape (N, K/128), outer-dim major like scale_a
        sb = outer_major(b_scale_inv.float())
        recipe_b = "BlockWise1x128"
    if has_scaled_mm_v2():
        out = F.scaled_mm(
            a_data,
            b_data.contiguous().t(),
            outer_major(sa),
            F.ScalingType.BlockWise1x128,
            sb,
            getattr(F.ScalingType, recipe_b),
            output_dtype=out_dtype,
            use_fast_accum=False,
        )
    else:
        out = torch._scaled_mm(
            a_data,
            b_data.contiguous().t(),
            scale_a=outer_major(sa),
            scale_b=sb,
            out_dtype=out_dtype,
            use_fast_accum=False,
        )
    return out[:M]
