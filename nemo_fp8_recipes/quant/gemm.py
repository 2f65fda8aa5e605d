"""Scaled-GEMM dispatch: ``out = A · Bᵀ`` for two quantised operands, real or emulated.

Both operands arrive as :class:`~nemo_fp8_recipes.quant.reference.QuantizedTensor` in the
orientation ``[rows, K]`` with their scaling groups along ``K`` (the contraction dim), so one
function serves fprop (``X · Wᵀ``), dgrad (``dY · W`` = ``dY · (Wᵀ)ᵀ``) and wgrad
(``dYᵀ · X`` = ``dYᵀ · (Xᵀ)ᵀ``).

* Emulation: dequantise both operands exactly to FP32 and multiply in FP32 (or FP64 for tests).
  This is the same function the hardware computes, up to accumulation order.
* Real: ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm`` on older PyTorch) with the scale
  layout cuBLAS expects for each scaling mode (docs/recipes.md, "Hardware support"): per-tensor scalars; 1x128 x 128x128
  (fprop, dgrad) and 1x128 x 1x128 (wgrad) with "outer-dim-major" FP32 scale tensors on SM90;
  1x32 E8M0 scales in cuBLAS' swizzled block layout on SM100. Rows that are not a multiple of
  the alignment are padded with zeros (exact: zero rows add nothing and get scale 1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .reference import QuantizedTensor

__all__ = ["blockwise_matmul", "outer_major", "scaled_matmul", "emulated_matmul", "real_matmul", "to_blocked_e8m0"]


def emulated_matmul(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)`` computed in ``compute_dtype``, then cast once.

    TF32 is switched off for the product so the emulation stays exact in FP32 on GPUs where a
    user enabled it (``torch.backends.cuda.matmul.allow_tf32``). Under ``torch.compile`` a global
    flag cannot be switched for one op of a graph, so the product is traced as is: the compiled
    FP8 linear emulates on CUDA only while TF32 is off (else it keeps its eager island, see
    :meth:`nemo_fp8_recipes.nn.Float8Linear.traceable`)."""
    if torch.compiler.is_compiling():
        out = a.dequantize(compute_dtype) @ b.dequantize(compute_dtype).t()
    else:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            out = a.dequantize(compute_dtype) @ b.dequantize(compute_dtype).t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor, mult: int) -> torch.Tensor:
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


def _has_v2() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def real_matmul(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FP8 GEMM on the tensor cores. ``a``: ``[M, K]``, ``b``: ``[N, K]``, both with contiguous
    codes and groups along K. Returns ``[M, N]`` in ``out_dtype`` (+ ``bias``)."""
    out = _real_matmul(a, b, out_dtype, fast_accum)
    return out if bias is None else out + bias.to(out.dtype)


def _scalar_scale(s: torch.Tensor) -> torch.Tensor:
    """A per-tensor ``scale_inv`` as ``torch._scaled_mm`` takes it: one FP32 element (the
    quantisers' ``[1, 1]`` FP32 scales pass as they are; no reshape or cast per GEMM)."""
    if s.dtype != torch.float32:
        s = s.float()
    return s if s.dim() == 0 or s.shape == (1, 1) else s.reshape(())


def _real_matmul(a, b, out_dtype, fast_accum):
    M, K = a.shape
    N, K2 = b.shape
    if K != K2:
        raise ValueError(f"contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    ba, bb = a.block, b.block
    if ba is None and bb is None:  # per-tensor (delayed, tensorwise)
        mult = 16
        a_data = _pad_rows(a.data.contiguous(), mult)
        out = torch._scaled_mm(
            a_data,
            b.data.contiguous().t(),
            scale_a=_scalar_scale(a.scale_inv),
            scale_b=_scalar_scale(b.scale_inv),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        return out if out.shape[0] == M else out[:M]
    if ba == (1, 128) and bb in ((128, 128), (1, 128)):  # blockwise on SM90
        weight_blocks = bb == (128, 128)
        if torch.compiler.is_compiling():
            # the same function as one opaque node: dynamo does not trace the block-scaled
            # dispatch (graph breaks on torch 2.11), the operator it can schedule
            from .ops import blockwise_mm

            return blockwise_mm(a.data, a.scale_inv, b.data, b.scale_inv, weight_blocks, out_dtype)
        return blockwise_matmul(a.data, a.scale_inv, b.data, b.scale_inv, weight_blocks, out_dtype)
    if ba == (1, 32) and bb == (1, 32):  # MXFP8 on SM100
        if a.scale_e8m0 is None or b.scale_e8m0 is None:
            raise ValueError("MXFP8 operands need E8M0 scales")
        a_data = _pad_rows(a.data.contiguous(), 128)
        sa = to_blocked_e8m0(a.scale_e8m0)
        sb = to_blocked_e8m0(b.scale_e8m0)
        if _has_v2():
            return F.scaled_mm(
                a_data,
                b.data.contiguous().t(),
                sa,
                F.ScalingType.BlockWise1x32,
                sb,
                F.ScalingType.BlockWise1x32,
                swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
                swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
                output_dtype=out_dtype,
            )[:M]
        return torch._scaled_mm(
            a_data, b.data.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype
        )[:M]
    raise ValueError(f"no real FP8 GEMM for scaling groups {ba} x {bb}")


def blockwise_matmul(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor,
                     b_scale_inv: torch.Tensor, weight_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The SM90 block-scaled GEMM ``A · Bᵀ`` on raw tensors: ``a_data`` ``[M, K]`` FP8 codes with
    1x128 groups along K (``a_scale_inv`` ``[M, K/128]``); ``b_data`` ``[N, K]`` with 128x128 blocks
    (``weight_blocks``, ``b_scale_inv`` ``[N/128, K/128]``: fprop, dgrad) or 1x128 groups along K
    (``[N, K/128]``: wgrad). Lays the scales out as cuBLAS wants them (outer-dim major, the
    128x128 grid's K blocks padded to a multiple of 4) and pads A's rows to 128 with zero rows
    of scale 1; the fused quantisers already write 1x128 grids outer-dim major
    (:func:`~.reference.scale_grid`), which then pass through without a copy (unless A's rows
    need padding, which makes a new grid). Returns ``[M, N]`` in ``out_dtype``. FP32 accumulation (no fast accumulation:
    cuBLAS' block-scaled kernels promote every K block)."""
    M, K = a_data.shape
    if b_data.shape[1] != K:
        raise ValueError(f"contraction dims differ: {tuple(a_data.shape)} x {tuple(b_data.shape)}")
    a_data = _pad_rows(a_data.contiguous(), 128)
    sa = _pad_rows(a_scale_inv.float(), 128)
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
    if _has_v2():
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


def scaled_matmul(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    emulate: bool,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``A · Bᵀ (+ bias)``: emulated (exact dequantise + FP32 matmul, bias added in FP32 before
    the one cast) or on the FP8 tensor cores (bias added in the output dtype)."""
    if emulate:
        return emulated_matmul(a, b, out_dtype=out_dtype,
                               compute_dtype=compute_dtype or torch.float32, bias=bias)
    return real_matmul(a, b, out_dtype=out_dtype, fast_accum=fast_accum, bias=bias)
