"""Both 1xN copies of a tensor from one read: ``(quantize_rows(x), quantize_cols_t(x))`` — the
fprop/dgrad operand grouped along rows and the wgrad operand grouped down columns, transposed —
from one kernel that loads each TILE x TILE tile once and quantises it both ways.

The library runs the row kernel and the transposed-column kernel one after the other instead
(``quantize_pair_auto``): on an H200 the two take 0.109 + 0.152 ms (1x128) and 0.197 + 0.208 ms
(1x32) at 8192x14336 against 0.361 and 0.498 ms here, because the in-register transpose of a
whole tile costs more than the second read saves (docs/internals/design-notes.md). ``quant_bandwidth.py``
times it as the "one read" row and sweeps its launch configurations (``dual128``, ``dual32``);
tests/quant/test_triton_kernels.py checks its codes against the reference quantisers."""

from __future__ import annotations

import torch

from nemo_fp8_recipes.formats import Format, ScaleRounding
from nemo_fp8_recipes.quant.launch import launch
from nemo_fp8_recipes.quant.reference import QuantizedTensor, as_format, scale_grid
from nemo_fp8_recipes.quant.triton_kernels.common import (
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

# launch configurations (``launch_config`` and ``quant_bandwidth.py --sweep`` tune them): 128x128
# tiles for 1x128 groups, ``tile`` x ``tile`` for 1x32
LAUNCH.setdefault("dual128", {"num_warps": 4, "group_r": 0})
LAUNCH.setdefault("dual32", {"tile": 64, "num_warps": 8, "group_r": 0})

if HAVE_TRITON:
    from nemo_fp8_recipes.quant.triton_kernels.groups import quant_last_groups
    from nemo_fp8_recipes.quant.triton_kernels.primitives import (
        fp8_cast,
        group_amax,
        round_to_fp8,
        scale_from_amax,
        tile_ids,
        trans_codes,
    )

    @triton.jit
    def _quant_dual_kernel(
        x_ptr,
        q_ptr,
        si_ptr,
        e8_ptr,
        qt_ptr,
        sit_ptr,
        e8t_ptr,
        R,
        C,
        G_row,
        G_col,
        stride_x,
        n_r,
        n_c,
        group_r,
        GROUP: tl.constexpr,
        TILE: tl.constexpr,
        MODE: tl.constexpr,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
    ):
        # One read of a TILE x TILE tile; writes the row-grouped codes [R, C] and the
        # column-grouped codes transposed [C, R] (GROUP divides TILE).
        pr, pc = tile_ids(n_r, n_c, group_r)
        rows = pr * TILE + tl.arange(0, TILE)
        cols = pc * TILE + tl.arange(0, TILE)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        NG: tl.constexpr = TILE // GROUP
        # row-wise groups: [TILE, NG, GROUP]
        codes, si, e8 = quant_last_groups(
            tl.reshape(x, (TILE, NG, GROUP)), q_ptr.dtype.element_ty, FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT
        )
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], tl.reshape(codes, (TILE, TILE)), mask=m)
        gcol = pc * NG + tl.arange(0, NG)
        ms = (rows[:, None] < R) & (gcol[None, :] < G_row)
        tl.store(si_ptr + gcol[None, :] * R + rows[:, None], si, mask=ms)  # outer-dim major [R, G_row]
        if MODE >= 2:
            tl.store(e8_ptr + gcol[None, :] * R + rows[:, None], e8.to(tl.uint8), mask=ms)
        # column-wise groups, reduced in the loaded layout ([NG, GROUP(rows), TILE(cols)]); only
        # the 1-byte codes are transposed for the [C, R] store
        xc = tl.reshape(x, (NG, GROUP, TILE))
        st, sit, e8t = scale_from_amax(group_amax(xc, 1), FMAX, EMAX, TOP_MANT, MODE)  # [NG, TILE]
        qc = round_to_fp8(xc * st[:, None, :], FMAX, IS_E4M3, HW_CVT)  # not NO_INF: see tensor.cast_dual_kernel
        codes_t = trans_codes(fp8_cast(tl.reshape(qc, (TILE, TILE)), qt_ptr.dtype.element_ty, IS_E4M3))
        mt = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(qt_ptr + cols[:, None] * R + rows[None, :], codes_t, mask=mt)
        grow = pr * NG + tl.arange(0, NG)
        mst = (grow[:, None] < G_col) & (cols[None, :] < C)
        tl.store(sit_ptr + grow[:, None] * C + cols[None, :], sit, mask=mst)  # outer-dim major [C, G_col]
        if MODE >= 2:
            tl.store(e8t_ptr + grow[:, None] * C + cols[None, :], e8t.to(tl.uint8), mask=mst)


def quantize_dual(x: torch.Tensor, fmt, group: int, rounding):
    """Both copies from one read: ``(quantize_rows(x), quantize_cols_t(x))`` of
    :mod:`nemo_fp8_recipes.quant.triton_kernels`, the same codes and scale grids (outer-dim
    major), for a 2-D ``x`` and groups of ``group`` (32 or 128)."""
    require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    Gr, Gc = -(-C // group), -(-R // group)
    dev = x.device
    q = torch.empty((R, C), dtype=fmt.dtype, device=dev)
    qt = torch.empty((C, R), dtype=fmt.dtype, device=dev)
    si = scale_grid(R, Gr, torch.float32, dev)
    sit = scale_grid(C, Gc, torch.float32, dev)
    mx = SCALE_MODE_ID[rounding] >= 2
    e8 = scale_grid(R, Gr, torch.uint8, dev) if mx else si
    e8t = scale_grid(C, Gc, torch.uint8, dev) if mx else sit
    cfg = LAUNCH["dual128" if group == 128 else "dual32"]
    tile = 128 if group == 128 else cfg["tile"]
    n_r, n_c = cdiv(R, tile), cdiv(C, tile)
    launch(
        _quant_dual_kernel,
        (n_r * n_c,),
        x,
        q,
        si,
        e8,
        qt,
        sit,
        e8t,
        R,
        C,
        Gr,
        Gc,
        x.stride(0),
        n_r,
        n_c,
        tile_group_rows(cfg, n_r),
        GROUP=group,
        num_warps=cfg["num_warps"],
        TILE=tile,
        MODE=SCALE_MODE_ID[rounding],
        FMAX=fmt.max,
        EMAX=fmt.emax,
        TOP_MANT=top_mant(fmt),
        IS_E4M3=fmt is Format.E4M3,
        HW_CVT=hw_cvt(x),
    )
    a = QuantizedTensor(
        data=q, scale_inv=si, block=(1, group), fmt=fmt, amax=si, scale_e8m0=e8m0_view(e8) if mx else None
    )
    b = QuantizedTensor(
        data=qt, scale_inv=sit, block=(1, group), fmt=fmt, amax=sit, scale_e8m0=e8m0_view(e8t) if mx else None
    )
    return a, b
