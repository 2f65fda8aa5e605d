"""1xN group quantisers: groups of ``GROUP`` (32 or 128) consecutive elements along each row
(:func:`quantize_rows`: 1x128 activations/gradients, 1x32 MXFP8) or down each column written
transposed (:func:`quantize_cols_t`: the wgrad copy, fused with the transpose). Scales in FP32
(``fp32``/``pow2``) or E8M0, their grids written outer-dim major
(:func:`~nemo_fp8_recipes.quant.reference.scale_grid`). The fused RMSNorm quantises its rows with
this family's :func:`_quant_last_groups`."""

from __future__ import annotations

import torch

from ...recipes import Format, ScaleRounding
from ..launch import launch as _launch
from ..reference import QuantizedTensor, as_format, scale_grid
from ._common import (HAVE_TRITON, LAUNCH, _MODE, _cdiv, _e8m0_view, _group_r, _hw_cvt, _require_triton, _top_mant,
                      tl, triton)

if HAVE_TRITON:
    from ._primitives import (_abs_bits16, _amax_from_bits, _bf16_to_f32, _f32_bits_of_bits16, _fp8_cast,
                              _group_amax, _round_fp8, _scale_from_amax, _tile_ids, _trans_codes)

    @triton.jit
    def _quant_last_groups(x3, ELEM: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                           TOP_MANT: tl.constexpr, MODE: tl.constexpr, IS_E4M3: tl.constexpr,
                           HW_CVT: tl.constexpr):
        """Quantise FP32 ``x3`` ``[A, NG, GROUP]`` in groups along its last axis: ``(codes
        [A, NG, GROUP], scale_inv [A, NG], e8m0 [A, NG])`` by the reference's rules (a NaN makes
        its group's amax NaN). The row quantiser and the fused RMSNorm both call it."""
        s, si, e8 = _scale_from_amax(_group_amax(x3, 2), FMAX, EMAX, TOP_MANT, MODE)
        q = _round_fp8(x3 * s[:, :, None], FMAX, IS_E4M3, HW_CVT, NO_INF=True)
        return _fp8_cast(q, ELEM, IS_E4M3, NO_INF=True), si, e8

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, si_ptr, e8_ptr, R, C, G, stride_x, n_r, n_c, group_r,
                           GROUP: tl.constexpr, NG: tl.constexpr, BLOCK_R: tl.constexpr,
                           MODE: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                           TOP_MANT: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr):
        # a tile of BLOCK_R rows x NG groups of GROUP columns: NG > 1 makes each row's load one
        # contiguous NG*GROUP-element segment (a 1x32 group alone is only 64 bytes of BF16)
        pr, pg = _tile_ids(n_r, n_c, group_r)
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pg * (NG * GROUP) + tl.arange(0, NG * GROUP)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        codes, si, e8 = _quant_last_groups(tl.reshape(x, (BLOCK_R, NG, GROUP)), q_ptr.dtype.element_ty,
                                           FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], tl.reshape(codes, (BLOCK_R, NG * GROUP)), mask=m)
        gi = pg * NG + tl.arange(0, NG)
        sm = (rows[:, None] < R) & (gi[None, :] < G)
        tl.store(si_ptr + gi[None, :] * R + rows[:, None], si, mask=sm)  # outer-dim major [R, G]
        if MODE >= 2:
            tl.store(e8_ptr + gi[None, :] * R + rows[:, None], e8.to(tl.uint8), mask=sm)

    @triton.jit
    def _quant_cols_t_kernel(x_ptr, q_ptr, si_ptr, e8_ptr, R, C, G, stride_x, n_r, n_c, group_r,
                             GROUP: tl.constexpr, NG: tl.constexpr, BLOCK_C: tl.constexpr,
                             MODE: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr,
                             TOP_MANT: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr,
                             BF16_TILE: tl.constexpr = False):
        # groups of GROUP rows down each column; output is x.T quantised along its rows: [C, R].
        # A tile is NG groups (NG*GROUP rows) x BLOCK_C columns. The groups are reduced and
        # quantised in the loaded layout; only the 1-byte codes are transposed (the layout
        # conversion moves a quarter of the bytes an FP32 transpose would), and NG > 1 makes each
        # stored row of x.T one contiguous NG*GROUP-byte segment.
        pg, pc = _tile_ids(n_r, n_c, group_r)
        cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = pg * (NG * GROUP) + tl.arange(0, NG * GROUP)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        if BF16_TILE:
            # the tile stays BF16 through the amax (_abs_bits16): the FP32 tile of 128 values per
            # thread keeps these kernels latency-bound (profiled on an H200: 167 registers per
            # thread, 8 warps per SM)
            xb = tl.reshape(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0),
                            (NG, GROUP, BLOCK_C))
            mb = _f32_bits_of_bits16(tl.max(_abs_bits16(xb), axis=1))
            s, si, e8 = _scale_from_amax(_amax_from_bits(mb), FMAX, EMAX, TOP_MANT, MODE)
            x3 = _bf16_to_f32(xb, not HW_CVT)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            x3 = tl.reshape(x, (NG, GROUP, BLOCK_C))
            s, si, e8 = _scale_from_amax(_group_amax(x3, 1), FMAX, EMAX, TOP_MANT, MODE)  # [NG, BLOCK_C]
        q = _round_fp8(x3 * s[:, None, :], FMAX, IS_E4M3, HW_CVT, NO_INF=True)
        codes = tl.reshape(_fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=True), (NG * GROUP, BLOCK_C))
        codes = _trans_codes(codes)  # [BLOCK_C, NG * GROUP]
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
    _require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    G = -(-C // group)
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    si = scale_grid(R, G, torch.float32, x.device)
    e8 = scale_grid(R, G, torch.uint8, x.device) if _MODE[rounding] >= 2 else si
    cfg = LAUNCH["rows128" if group == 128 else "rows32"]
    block_r, ng = cfg["block_r"], cfg["groups"]
    n_r, n_c = _cdiv(R, block_r), _cdiv(G, ng)
    _launch(_quant_rows_kernel, (n_r * n_c,), x, q, si, e8, R, C, G, x.stride(0), n_r, n_c, _group_r(cfg, n_r),
            GROUP=group, NG=ng, BLOCK_R=block_r, num_warps=cfg["num_warps"],
            MODE=_MODE[rounding], FMAX=fmt.max, EMAX=fmt.emax,
            TOP_MANT=_top_mant(fmt), IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x))
    return QuantizedTensor(data=q, scale_inv=si, block=(1, group), fmt=fmt, amax=si,
                           scale_e8m0=_e8m0_view(e8) if _MODE[rounding] >= 2 else None)


def quantize_cols_t(x: torch.Tensor, fmt, group: int, rounding) -> QuantizedTensor:
    """Groups of ``group`` down each column, returned for ``x.T`` (``[cols, rows]``, groups along
    its rows) — the wgrad operand, quantised and transposed in one pass (same result as
    ``reference.quantize(x, fmt, ..., dim=0)``)."""
    _require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    G = -(-R // group)
    q = torch.empty((C, R), dtype=fmt.dtype, device=x.device)
    si = scale_grid(C, G, torch.float32, x.device)
    e8 = scale_grid(C, G, torch.uint8, x.device) if _MODE[rounding] >= 2 else si
    cfg = LAUNCH["cols_t128" if group == 128 else "cols_t32"]
    block_c, ng = cfg["block_c"], cfg["groups"]
    n_r, n_c = _cdiv(G, ng), _cdiv(C, block_c)
    _launch(_quant_cols_t_kernel, (n_r * n_c,), x, q, si, e8, R, C, G, x.stride(0), n_r, n_c, _group_r(cfg, n_r),
            GROUP=group, NG=ng, BLOCK_C=block_c,
            BF16_TILE=bool(cfg.get("bf16_tile")) and x.dtype == torch.bfloat16,
            num_warps=cfg["num_warps"],
            MODE=_MODE[rounding], FMAX=fmt.max, EMAX=fmt.emax,
            TOP_MANT=_top_mant(fmt), IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x))
    return QuantizedTensor(data=q, scale_inv=si, block=(1, group), fmt=fmt, amax=si,
                           scale_e8m0=_e8m0_view(e8) if _MODE[rounding] >= 2 else None)
