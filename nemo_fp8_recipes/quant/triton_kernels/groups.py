"""1xN group quantisers: groups of ``GROUP`` (32 or 128) consecutive elements along each row
(:func:`quantize_rows`: 1x128 activations/gradients, 1x32 MXFP8) or down each column written
transposed (:func:`quantize_cols_t`: the wgrad copy, fused with the transpose). Scales in FP32
(``fp32``/``pow2``) or E8M0, their grids written outer-dim major
(:func:`~nemo_fp8_recipes.quant.reference.scale_grid`). The fused RMSNorm quantises its rows with
this family's :func:`quant_last_groups`."""

from __future__ import annotations

import torch

from ...formats import Format, ScaleRounding
from ..launch import launch as _launch
from ..reference import QuantizedTensor, as_format, scale_grid
from .common import (
    HAVE_TRITON,
    LAUNCH,
    SCALE_MODE_ID,
    cdiv,
    e8m0_view,
    hw_cvt,
    require_triton,
    tile_group_rows,
    tl,
    top_mant,
    triton,
)

if HAVE_TRITON:
    from .primitives import (
        abs_bits16,
        amax_from_bits,
        bf16_to_f32,
        f32_bits_of_bits16,
        fp8_cast,
        group_amax,
        round_to_fp8,
        scale_from_amax,
        tile_ids,
        trans_codes,
    )

    @triton.jit
    def quant_last_groups(
        x3,
        ELEM: tl.constexpr,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        MODE: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
    ):
        """Quantise FP32 ``x3`` ``[A, NG, GROUP]`` in groups along its last axis: ``(codes
        [A, NG, GROUP], scale_inv [A, NG], e8m0 [A, NG])`` by the reference's rules (a NaN makes
        its group's amax NaN). The row quantiser and the fused RMSNorm both call it."""
        s, si, e8 = scale_from_amax(group_amax(x3, 2), FMAX, EMAX, TOP_MANT, MODE)
        q = round_to_fp8(x3 * s[:, :, None], FMAX, IS_E4M3, HW_CVT, NO_INF=True)
        return fp8_cast(q, ELEM, IS_E4M3, NO_INF=True), si, e8

    @triton.jit
    def quant_rows_kernel(
        x_ptr,
        q_ptr,
        si_ptr,
        e8_ptr,
        R,
        C,
        G,
        stride_x,
        n_r,
        n_c,
        group_r,
        GROUP: tl.constexpr,
        NG: tl.constexpr,
        BLOCK_R: tl.constexpr,
        MODE: tl.constexpr,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
    ):
        # a tile of BLOCK_R rows x NG groups of GROUP columns: NG > 1 makes each row's load one
        # contiguous NG*GROUP-element segment (a 1x32 group alone is only 64 bytes of BF16)
        pr, pg = tile_ids(n_r, n_c, group_r)
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pg * (NG * GROUP) + tl.arange(0, NG * GROUP)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        codes, si, e8 = quant_last_groups(
            tl.reshape(x, (BLOCK_R, NG, GROUP)), q_ptr.dtype.element_ty, FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT
        )
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], tl.reshape(codes, (BLOCK_R, NG * GROUP)), mask=m)
        gi = pg * NG + tl.arange(0, NG)
        sm = (rows[:, None] < R) & (gi[None, :] < G)
        tl.store(si_ptr + gi[None, :] * R + rows[:, None], si, mask=sm)  # outer-dim major [R, G]
        if MODE >= 2:
            tl.store(e8_ptr + gi[None, :] * R + rows[:, None], e8.to(tl.uint8), mask=sm)

    @triton.jit
    def quant_cols_t_kernel(
        x_ptr,
        q_ptr,
        si_ptr,
        e8_ptr,
        R,
        C,
        G,
        stride_x,
        n_r,
        n_c,
        group_r,
        GROUP: tl.constexpr,
        NG: tl.constexpr,
        BLOCK_C: tl.constexpr,
        MODE: tl.constexpr,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
        BF16_TILE: tl.constexpr = False,
    ):
        # groups of GROUP rows down each column; output is x.T quantised along its rows: [C, R].
        # A tile is NG groups (NG*GROUP rows) x BLOCK_C columns. The groups are reduced and
        # quantised in the loaded layout; only the 1-byte codes are transposed (the layout
        # conversion moves a quarter of the bytes an FP32 transpose would), and NG > 1 makes each
        # stored row of x.T one contiguous NG*GROUP-byte segment.
        pg, pc = tile_ids(n_r, n_c, group_r)
        cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = pg * (NG * GROUP) + tl.arange(0, NG * GROUP)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        if BF16_TILE:
            # the tile stays BF16 through the amax (abs_bits16): an FP32 tile of 128 values per
            # thread takes so many registers that these kernels become latency-bound
            # (docs/internals/kernels.md)
            xb = tl.reshape(
                tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0), (NG, GROUP, BLOCK_C)
            )
            mb = f32_bits_of_bits16(tl.max(abs_bits16(xb), axis=1))
            s, si, e8 = scale_from_amax(amax_from_bits(mb), FMAX, EMAX, TOP_MANT, MODE)
            x3 = bf16_to_f32(xb, not HW_CVT)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            x3 = tl.reshape(x, (NG, GROUP, BLOCK_C))
            s, si, e8 = scale_from_amax(group_amax(x3, 1), FMAX, EMAX, TOP_MANT, MODE)  # [NG, BLOCK_C]
        q = round_to_fp8(x3 * s[:, None, :], FMAX, IS_E4M3, HW_CVT, NO_INF=True)
        codes = tl.reshape(fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=True), (NG * GROUP, BLOCK_C))
        codes = trans_codes(codes)  # [BLOCK_C, NG * GROUP]
        mt = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(q_ptr + cols[:, None] * R + rows[None, :], codes, mask=mt)
        gi = pg * NG + tl.arange(0, NG)
        sm = (gi[:, None] < G) & (cols[None, :] < C)
        tl.store(si_ptr + gi[:, None] * C + cols[None, :], si, mask=sm)  # outer-dim major [C, G]
        if MODE >= 2:
            tl.store(e8_ptr + gi[:, None] * C + cols[None, :], e8.to(tl.uint8), mask=sm)


def quantize_rows(x: torch.Tensor, fmt, group: int, rounding) -> QuantizedTensor:
    """Groups of ``group`` along each row of a 2-D tensor (same result as
    ``reference.quantize_blocks(x, fmt, (1, group), rounding)``)."""
    require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    G = -(-C // group)
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    si = scale_grid(R, G, torch.float32, x.device)
    e8 = scale_grid(R, G, torch.uint8, x.device) if SCALE_MODE_ID[rounding] >= 2 else si
    cfg = LAUNCH["rows128" if group == 128 else "rows32"]
    block_r, ng = cfg["block_r"], cfg["groups"]
    n_r, n_c = cdiv(R, block_r), cdiv(G, ng)
    _launch(
        quant_rows_kernel,
        (n_r * n_c,),
        x,
        q,
        si,
        e8,
        R,
        C,
        G,
        x.stride(0),
        n_r,
        n_c,
        tile_group_rows(cfg, n_r),
        GROUP=group,
        NG=ng,
        BLOCK_R=block_r,
        num_warps=cfg["num_warps"],
        MODE=SCALE_MODE_ID[rounding],
        FMAX=fmt.max,
        EMAX=fmt.emax,
        TOP_MANT=top_mant(fmt),
        IS_E4M3=fmt is Format.E4M3,
        HW_CVT=hw_cvt(x),
    )
    return QuantizedTensor(
        data=q,
        scale_inv=si,
        block=(1, group),
        fmt=fmt,
        amax=si,
        scale_e8m0=e8m0_view(e8) if SCALE_MODE_ID[rounding] >= 2 else None,
    )


def quantize_cols_t(x: torch.Tensor, fmt, group: int, rounding) -> QuantizedTensor:
    """Groups of ``group`` down each column, returned for ``x.T`` (``[cols, rows]``, groups along
    its rows) — the wgrad operand, quantised and transposed in one pass (same result as
    ``reference.quantize(x, fmt, ..., dim=0)``)."""
    require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    G = -(-R // group)
    q = torch.empty((C, R), dtype=fmt.dtype, device=x.device)
    si = scale_grid(C, G, torch.float32, x.device)
    e8 = scale_grid(C, G, torch.uint8, x.device) if SCALE_MODE_ID[rounding] >= 2 else si
    cfg = LAUNCH["cols_t128" if group == 128 else "cols_t32"]
    block_c, ng = cfg["block_c"], cfg["groups"]
    n_r, n_c = cdiv(G, ng), cdiv(C, block_c)
    _launch(
        quant_cols_t_kernel,
        (n_r * n_c,),
        x,
        q,
        si,
        e8,
        R,
        C,
        G,
        x.stride(0),
        n_r,
        n_c,
        tile_group_rows(cfg, n_r),
        GROUP=group,
        NG=ng,
        BLOCK_C=block_c,
        BF16_TILE=bool(cfg.get("bf16_tile")) and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        MODE=SCALE_MODE_ID[rounding],
        FMAX=fmt.max,
        EMAX=fmt.emax,
        TOP_MANT=top_mant(fmt),
        IS_E4M3=fmt is Format.E4M3,
        HW_CVT=hw_cvt(x),
    )
    return QuantizedTensor(
        data=q,
        scale_inv=si,
        block=(1, group),
        fmt=fmt,
        amax=si,
        scale_e8m0=e8m0_view(e8) if SCALE_MODE_ID[rounding] >= 2 else None,
    )
