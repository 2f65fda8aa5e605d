"""The 128x128 block quantiser (blockwise weights, FP32 scales): :func:`quantize_blocks128`,
optionally with the codes of the transpose from the same pass (a weight's dgrad copy)."""

from __future__ import annotations

import torch

from ...formats import Format, ScaleRounding
from ..launch import launch as _launch
from ..reference import QuantizedTensor, as_format
from .common import (
    HAVE_TRITON,
    LAUNCH,
    SCALE_MODE_ID,
    hw_cvt,
    require_triton,
    tile_group_rows,
    tl,
    triton,
)

if HAVE_TRITON:
    from .primitives import (
        abs_bits,
        amax_from_bits,
        fp8_cast,
        round_to_fp8,
        scale_from_amax,
        tile_ids,
        trans_codes,
    )

    @triton.jit
    def quant_block_kernel(
        x_ptr,
        q_ptr,
        qt_ptr,
        si_ptr,
        R,
        C,
        GC,
        stride_x,
        n_r,
        n_c,
        group_r,
        BLOCK: tl.constexpr,
        MODE: tl.constexpr,
        FMAX: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
        TRANS: tl.constexpr,
    ):
        # one 128x128 block per program; TRANS: also write the codes transposed ([C, R], the
        # dgrad copy of a weight: 128x128 blocks are symmetric, so the same codes and scale)
        pr, pc = tile_ids(n_r, n_c, group_r)
        rows = pr * BLOCK + tl.arange(0, BLOCK)
        cols = pc * BLOCK + tl.arange(0, BLOCK)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = amax_from_bits(tl.max(tl.max(abs_bits(x), axis=1), axis=0))
        s, si, e8 = scale_from_amax(amax, FMAX, 0, 0, MODE)
        # with TRANS the explicit saturation stays (NO_INF off), as in the other kernels that
        # store transposed codes: without it Triton 3.6 on sm_90 writes wrong transposed codes
        # for FP32 weights of several blocks (dgrad NaN in tests/quant/test_gpu.py)
        q = round_to_fp8(x * s, FMAX, IS_E4M3, HW_CVT, NO_INF=not TRANS)
        codes = fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=not TRANS)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], codes, mask=m)
        if TRANS:
            mt = (cols[:, None] < C) & (rows[None, :] < R)
            tl.store(qt_ptr + cols[:, None] * R + rows[None, :], trans_codes(codes), mask=mt)
        tl.store(si_ptr + pr * GC + pc, si)


def quantize_blocks128(x: torch.Tensor, fmt, rounding, transposed: bool = False):
    """128x128 blocks (blockwise weights); FP32 scales (``fp32`` or ``pow2``). ``transposed``:
    return ``(q, qt)``, ``qt`` the same blocks for ``x.T`` with contiguous codes ``[C, R]``
    written by the same pass (a weight's dgrad copy) and ``q.scale_inv.T`` as its scales."""
    require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if SCALE_MODE_ID[rounding] >= 2:
        raise ValueError("128x128 blocks take fp32 or pow2 scales")
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    GR, GC = -(-R // 128), -(-C // 128)
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    qt = torch.empty((C, R), dtype=fmt.dtype, device=x.device) if transposed else q
    si = torch.empty((GR, GC), dtype=torch.float32, device=x.device)
    _launch(
        quant_block_kernel,
        (GR * GC,),
        x,
        q,
        qt,
        si,
        R,
        C,
        GC,
        x.stride(0),
        GR,
        GC,
        tile_group_rows(LAUNCH["blocks128"], GR),
        BLOCK=128,
        MODE=SCALE_MODE_ID[rounding],
        num_warps=LAUNCH["blocks128"]["num_warps"],
        FMAX=fmt.max,
        IS_E4M3=fmt is Format.E4M3,
        HW_CVT=hw_cvt(x),
        TRANS=transposed,
    )
    a = QuantizedTensor(data=q, scale_inv=si, block=(128, 128), fmt=fmt, amax=si)
    if not transposed:
        return a
    return a, QuantizedTensor(data=qt, scale_inv=si.t(), block=(128, 128), fmt=fmt, amax=si.t())
