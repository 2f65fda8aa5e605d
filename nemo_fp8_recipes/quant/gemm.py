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
from .scaled_mm import (
    blockwise_matmul,
    has_scaled_mm_v2,
    pad_rows,
    scalar_scale,
    to_blocked_e8m0,
)

__all__ = [
    "scaled_matmul",
    "emulated_matmul",
    "real_matmul",
]


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


def _real_matmul(a, b, out_dtype, fast_accum):
    M, K = a.shape
    N, K2 = b.shape
    if K != K2:
        raise ValueError(f"contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    ba, bb = a.block, b.block
    if ba is None and bb is None:  # per-tensor (delayed, tensorwise)
        mult = 16
        a_data = pad_rows(a.data.contiguous(), mult)
        out = torch._scaled_mm(
            a_data,
            b.data.contiguous().t(),
            scale_a=scalar_scale(a.scale_inv),
            scale_b=scalar_scale(b.scale_inv),
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
        a_data = pad_rows(a.data.contiguous(), 128)
        sa = to_blocked_e8m0(a.scale_e8m0)
        sb = to_blocked_e8m0(b.scale_e8m0)
        if has_scaled_mm_v2():
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
        return torch._scaled_mm(a_data, b.data.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)[:M]
    raise ValueError(f"no real FP8 GEMM for scaling groups {ba} x {bb}")


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
        return emulated_matmul(a, b, out_dtype=out_dtype, compute_dtype=compute_dtype or torch.float32, bias=bias)
    return real_matmul(a, b, out_dtype=out_dtype, fast_accum=fast_accum, bias=bias)
