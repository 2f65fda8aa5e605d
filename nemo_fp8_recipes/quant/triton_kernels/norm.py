"""The fused RMSNorm: :func:`rmsnorm_forward` (one read of ``x``, one write of ``y``; the same
pass can also take ``y``'s per-tensor amax, with the per-tensor family's fold, or write its 1xN
row codes, with the group family's quantiser: RMSNorm -> quantise, :mod:`nemo_fp8_recipes.nn.norm`)
and :func:`rmsnorm_backward` (one pass over ``dy`` and ``x``)."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import Format, ScaleRounding
from ..launch import launch as _launch
from ..reference import QuantizedTensor, as_format, scale_grid
from . import groups, tensor
from .common import (
    HAVE_TRITON,
    LAUNCH,
    SCALE_MODE_ID,
    e8m0_view,
    hw_cvt,
    require_triton,
    tl,
    top_mant,
    triton,
)

if HAVE_TRITON:
    from .primitives import rne_bf16

    @triton.jit
    def rmsnorm_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        amax_ptr,
        q_ptr,
        si_ptr,
        e8_ptr,
        R,
        D,
        G,
        stride_x,
        stride_y,
        inv_d,
        eps,
        BLOCK_D: tl.constexpr,
        OUT_BF16: tl.constexpr,
        AMAX: tl.constexpr,
        GROUP: tl.constexpr,
        MODE: tl.constexpr,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
    ):
        # One row per program: y = (x * rstd) * w in FP32, rstd = 1 / sqrt(mean(x^2) + eps),
        # rounded to the output dtype; rstd kept for backward. AMAX: fold max|y| into amax_ptr
        # (per-tensor current scaling of y). GROUP > 0: also quantise y in 1xGROUP groups along the
        # row (the fprop/dgrad copy of blockwise / mxfp8) — the values quantised are y as stored,
        # read back after a barrier: reshaping the register tile instead let the compiler pick
        # another layout for the whole row, and with it another order for the sum of squares
        # (a different rstd than the plain norm's on an H200), so y would depend on the recipe.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=0) * inv_d
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
        y = (x * rstd) * w
        if OUT_BF16:
            y = rne_bf16(y)  # the store's rounding made explicit (the interpreter truncates)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(rstd_ptr + row, rstd)
        if AMAX:
            tensor.fold_amax_block(amax_ptr, y)
        if GROUP > 0:
            NG: tl.constexpr = BLOCK_D // GROUP
            tl.debug_barrier()  # this program's stores of y are visible to all its threads
            offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            y2 = tl.load(y_ptr + row * stride_y + offs, mask=offs < D, other=0.0).to(tl.float32)
            codes, si, e8 = groups.quant_last_groups(
                tl.reshape(y2, (1, NG, GROUP)), q_ptr.dtype.element_ty, FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT
            )
            tl.store(q_ptr + row * D + offs, tl.reshape(codes, (NG, GROUP)), mask=offs < D)
            gi = tl.arange(0, NG)
            tl.store(si_ptr + gi * R + row, tl.reshape(si, (NG,)), mask=gi < G)  # outer-dim major [R, G]
            if MODE >= 2:
                tl.store(e8_ptr + gi * R + row, tl.reshape(e8, (NG,)).to(tl.uint8), mask=gi < G)

    @triton.jit
    def rmsnorm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_ptr,
        R,
        D,
        stride_dy,
        stride_x,
        inv_d,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_DW: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        # ROWS consecutive rows per program: dx = rstd * (dy*w - xh * mean(dy*w*xh)),
        # xh = x * rstd; the program's partial sum of dy * xh (the weight gradient) goes to row
        # pid of dw_ptr ([programs, D], FP32), summed afterwards.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i in range(0, ROWS):
            row = pid * ROWS + i
            # rows past the end load zeros (they add nothing to dw); the row test is made a
            # vector (Triton 3.9's interpreter rejects a scalar-and-vector mask)
            mr = m & ((tl.zeros_like(cols) + row) < R)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mr, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * stride_x + cols, mask=mr, other=0.0).to(tl.float32)
            r = tl.load(rstd_ptr + tl.minimum(row, R - 1))  # in bounds without a scalar mask
            xh = x * r
            dt = dy * w
            c = tl.sum(dt * xh, axis=0) * inv_d
            dx = (dt - xh * c) * r
            if OUT_BF16:
                dx = rne_bf16(dx)
            tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mr)
            if HAS_DW:
                acc += dy * xh
        if HAS_DW:
            tl.store(dw_ptr + pid * D + cols, acc, mask=m)


#: Longest row the fused RMSNorm takes (a whole row lives in registers: 16384 = Llama 3 405B).
RMSNORM_MAX_D = 16384


def row_warps(block_d: int, elems_per_thread: int) -> int:
    """Warps for a row of ``block_d`` elements, ``elems_per_thread`` per thread (1 to 16)."""
    return int(min(16, max(1, block_d // (32 * elems_per_thread))))


def rmsnorm_forward(
    x2: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    amax: bool = False,
    rows: Optional[tuple] = None,
    out: Optional[torch.Tensor] = None,
):
    """Fused RMSNorm of the rows of 2-D ``x2`` (BF16 or FP32, last dim contiguous, at most
    :data:`RMSNORM_MAX_D` long): ``y = (x * rstd) * weight`` in FP32 with
    ``rstd = 1 / sqrt(mean(x**2) + eps)`` (the sum of squares in FP32 in the kernel's order, times
    FP32 ``1/D``; square root and division correctly rounded), stored in ``x2``'s dtype — one
    read of ``x``, one write of ``y`` (into ``out``, a contiguous ``[R, D]`` tensor of that dtype,
    if given). The values of ``y`` and ``rstd`` do not depend on ``amax``/``rows``. Returns
    ``(y, rstd [R] FP32, amax, q)``:

    * ``amax=True``: the per-tensor amax of ``y`` as stored (a ``[1, 1]`` FP32 tensor, NaN if any
      value is NaN), taken in the same pass — what current per-tensor scaling of ``y`` needs first
      (:func:`~.tensor.quantize_tensor_dual`'s ``amax``);
    * ``rows=(fmt, group, rounding)``: ``y`` quantised in 1x``group`` groups along its rows, the
      same codes and scales as :func:`~.groups.quantize_rows` of ``y``, from the same pass.
    Otherwise ``amax``/``q`` are None."""
    require_triton(x2)
    R, D = x2.shape
    if x2.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the fused RMSNorm takes BF16 or FP32 input, not {x2.dtype}")
    if D > RMSNORM_MAX_D:
        raise ValueError(f"the fused RMSNorm takes rows of at most {RMSNORM_MAX_D} elements, got {D}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.contiguous()
    dev = x2.device
    if out is None:
        y = torch.empty((R, D), dtype=x2.dtype, device=dev)
    elif out.shape != (R, D) or out.dtype != x2.dtype or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous {x2.dtype} tensor of shape {(R, D)} on {dev}")
    else:
        y = out
    rstd = torch.empty((R,), dtype=torch.float32, device=dev)
    acc = torch.zeros((1, 1), dtype=torch.float32, device=dev) if amax else None
    group, q = 0, None
    fmt, rounding = Format.E4M3, ScaleRounding.FP32
    if rows is not None:
        fmt, group, rounding = as_format(rows[0]), int(rows[1]), ScaleRounding(rows[2])
        if group not in (32, 128):
            raise ValueError(f"row groups of 32 or 128 elements, not {group}")
    block_d = max(triton.next_power_of_2(D), group, 16)
    G = -(-D // group) if group else 1
    qd = torch.empty((R, D), dtype=fmt.dtype, device=dev) if group else y
    si = scale_grid(R, G, torch.float32, dev) if group else rstd
    mx = SCALE_MODE_ID[rounding] >= 2
    e8 = scale_grid(R, G, torch.uint8, dev) if group and mx else si
    if R:
        _launch(
            rmsnorm_fwd_kernel,
            (R,),
            x2,
            w,
            y,
            rstd,
            acc.view(torch.int32) if amax else rstd,
            qd,
            si,
            e8,
            R,
            D,
            G,
            x2.stride(0),
            y.stride(0),
            1.0 / D,
            float(eps),
            BLOCK_D=block_d,
            OUT_BF16=x2.dtype == torch.bfloat16,
            AMAX=amax,
            GROUP=group,
            MODE=SCALE_MODE_ID[rounding],
            FMAX=fmt.max,
            EMAX=fmt.emax,
            TOP_MANT=top_mant(fmt),
            IS_E4M3=fmt is Format.E4M3,
            HW_CVT=hw_cvt(x2),
            num_warps=row_warps(block_d, LAUNCH["rmsnorm"]["elems_per_thread"]),
        )
    if group:
        q = QuantizedTensor(
            data=qd, scale_inv=si, block=(1, group), fmt=fmt, amax=si, scale_e8m0=e8m0_view(e8) if mx else None
        )
    return y, rstd, acc, q


def rmsnorm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, need_dw: bool = True
):
    """Gradients of :func:`rmsnorm_forward`'s ``y`` for ``dy2`` (``[R, D]``): ``(dx`` in ``x2``'s
    dtype, ``dw`` in ``weight``'s dtype or None) in one pass over ``dy`` and ``x``; ``dw`` is
    summed in FP32 from per-program partial sums."""
    require_triton(dy2, x2)
    R, D = x2.shape
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.contiguous()
    dx = torch.empty((R, D), dtype=x2.dtype, device=x2.device)
    cfg = LAUNCH["rmsnorm_bwd"]
    per = cfg["rows_per_program"]
    progs = -(-R // per)
    part = torch.empty((max(progs, 1), D), dtype=torch.float32, device=x2.device) if need_dw else dx
    block_d = max(triton.next_power_of_2(D), 16)
    if R:
        _launch(
            rmsnorm_bwd_kernel,
            (progs,),
            dy2,
            x2,
            w,
            rstd,
            dx,
            part,
            R,
            D,
            dy2.stride(0),
            x2.stride(0),
            1.0 / D,
            ROWS=per,
            BLOCK_D=block_d,
            HAS_DW=need_dw,
            OUT_BF16=dx.dtype == torch.bfloat16,
            num_warps=row_warps(block_d, cfg["elems_per_thread"]),
        )
    dw = None
    if need_dw:
        dw = (part[:progs].sum(0) if R else torch.zeros(D, dtype=torch.float32, device=x2.device)).to(weight.dtype)
    return dx, dw
