"""Fused Triton quantisers, bit-identical to the reference quantisers in ``reference.py``.

One read of the source, one write of the FP8 codes and the scales, no intermediate tensors:

* :func:`quantize_rows`     — groups of ``GROUP`` (32 or 128) consecutive elements along each row
  (1x128 activations/gradients, 1x32 MXFP8), scales in FP32 (``fp32``/``pow2``) or E8M0. The
  1xN quantisers write their scale grids outer-dim major (:func:`~.reference.scale_grid`).
* :func:`quantize_cols_t`   — groups of ``GROUP`` consecutive elements down each column, written
  *transposed* (``[cols, rows]``): the wgrad copy, fused with the transpose.
* :func:`quantize_blocks128` — 128x128 weight blocks (``transposed=True``: also the codes of the
  transpose from the same pass, a weight's dgrad copy).
* :func:`quantize_tensor`   — per-tensor: an atomic-max amax kernel, then a cast kernel whose
  programs compute the scale from that amax on the device (no host sync, no small PyTorch ops
  in between); with a given scale (delayed scaling, from the amax history) one kernel casts with
  it and folds the tensor's amax into an accumulator (the pending amax) in the same pass.
* :func:`quantize_tensor_dual` — per-tensor codes and their transpose from one read (the
  transpose moves the 1-byte codes); :func:`quantize_dual` — the same for 1xN groups.
* :func:`delayed_commit`    — one delayed-scaling history update (append, max, new scale).
* :func:`rmsnorm_forward` / :func:`rmsnorm_backward` — the fused RMSNorm (one pass each way),
  whose forward can also take its output's per-tensor amax or write its 1xN row codes (RMSNorm →
  quantise, :mod:`nemo_fp8_recipes.nn.norm`).

Scales follow the exact rules of the reference (pow-2 by dropping mantissa bits, E8M0 from the
amax's binary exponent). Saturation and the NaN/Inf rules are applied explicitly; the
round-to-nearest-even itself is the GPU's conversion instruction (``cvt.rn.satfinite``, one
instruction per two values) when compiled for sm_90+ (E5M2 infinities, which that saturating
instruction would clamp, are written as their codes), and an explicit RNE on the FP32 bits under
Triton's CPU interpreter (``TRITON_INTERPRET=1``, which CI uses to check the kernels), whose
own cast is not a hardware RNE. Both give the reference's codes bit for bit (checked on the GPU
against the reference, ties and subnormals included).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

try:  # Triton is optional: GPU machines have it; CPU CI may install it for the interpreter.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

from ..recipes import Format, ScaleRounding
from .launch import launch as _launch
from .reference import QuantizedTensor, accumulate_amax, as_format, scale_grid

__all__ = [
    "HAVE_TRITON",
    "quantize_rows",
    "quantize_cols_t",
    "quantize_blocks128",
    "quantize_tensor",
    "quantize_dual",
    "quantize_tensor_dual",
    "delayed_commit",
    "swiglu_backward",
    "rmsnorm_forward",
    "rmsnorm_backward",
    "RMSNORM_MAX_D",
]

_MODE = {ScaleRounding.FP32: 0, ScaleRounding.POW2: 1, ScaleRounding.E8M0_CEIL: 2, ScaleRounding.E8M0_FLOOR: 3}

if HAVE_TRITON:

    @triton.jit
    def _round_fp8(y, FMAX: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr,
                   NO_INF: tl.constexpr = False):
        """Saturating RNE of FP32 ``y`` for the FP8 store that follows.

        ``HW_CVT`` (compiled for a GPU): only the saturation and the NaN/Inf rules are applied
        here; the store's cast is the hardware round-to-nearest-even conversion
        (``cvt.rn.satfinite...f32`` on sm_90+), which gives the same codes for every finite clamped
        value at a fraction of the instructions. Otherwise (Triton's CPU interpreter, whose cast
        is not a hardware RNE) the rounding is done explicitly on the FP32 bits and the value
        stays FP32, exactly on the grid, so the final cast is exact.

        ``NO_INF``: the caller guarantees ``y`` holds no ±Inf (current scaling: ``s = fmax / amax``
        keeps every finite value within the format's range up to a rounding, an infinite input
        makes the amax infinite and ``s`` zero or NaN, so it becomes NaN). With ``HW_CVT`` the
        values then go to the conversion unchanged: ``satfinite`` saturates finite overflow to
        ±fmax (what the clamp does) and keeps NaN — a few instructions per element fewer in
        kernels that must stay memory-bound (the group quantisers: measured on an H200, 1x128
        columns 0.155 -> 0.129 ms at 8192x14336)."""
        if HW_CVT and NO_INF:
            return y
        nan = y != y
        inf = (y == float("inf")) | (y == float("-inf"))
        yc = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
        if HW_CVT:
            # (the explicit clamp and NaN rule are what satfinite does anyway; but dropping them
            # together with a 1-D tile order made the per-tensor pair kernel write wrong
            # transposed codes for FP32 sources on sm_90 with Triton 3.6 (tests/test_gpu.py;
            # which of the two changes triggers it was not isolated), so the per-tensor kernels
            # keep both as they were)
            if IS_E4M3:
                r = tl.where(inf, float("nan"), yc)
            else:
                r = tl.where(inf, y, yc)
            return tl.where(nan, y, r)
        bits = yc.to(tl.int32, bitcast=True)
        if IS_E4M3:
            # normals (|y| >= 2^-6): keep 3 mantissa bits, RNE on the dropped 20 bits
            lsb = (bits >> 20) & 1
            rb = (bits + 0x7FFFF + lsb) & -1048576  # ~0xFFFFF
            # subnormals: multiples of 2^-9, RNE by the magic-number add on |y| (ulp(2^14) = 2^-9)
            ay = tl.abs(yc)
            sub = (ay + 16384.0) - 16384.0
            small = tl.abs(yc) < 0.015625
        else:
            lsb = (bits >> 21) & 1
            rb = (bits + 0xFFFFF + lsb) & -2097152  # ~0x1FFFFF
            ay = tl.abs(yc)
            sub = (ay + 128.0) - 128.0
            small = tl.abs(yc) < 6.103515625e-05
        # the sign copied as a bit (``-sub`` is ``0 - sub`` in Triton: +0, where a negative value
        # that rounds to zero must give -0, as the hardware conversion and PyTorch's cast do)
        sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
        r = tl.where(small, sub, rb.to(tl.float32, bitcast=True))
        if IS_E4M3:
            r = tl.where(inf, float("nan"), r)
        else:
            r = tl.where(inf, y, r)
        return tl.where(nan, y, r)

    @triton.jit
    def _fp8_cast(r, ELEM: tl.constexpr, IS_E4M3: tl.constexpr, NO_INF: tl.constexpr = False):
        """The FP8 codes of ``_round_fp8``'s result. The conversion saturates (``satfinite``:
        ±Inf would become ±57344), so E5M2's infinities, which the reference keeps, are written
        as their codes (0x7C / 0xFC) explicitly (unless ``NO_INF``: there are none)."""
        c = r.to(ELEM)
        if not IS_E4M3 and not NO_INF:
            bits = c.to(tl.uint8, bitcast=True).to(tl.int32)
            bits = tl.where(r == float("inf"), 0x7C, tl.where(r == float("-inf"), 0xFC, bits))
            c = bits.to(tl.uint8).to(ELEM, bitcast=True)
        return c

    @triton.jit
    def _trans_codes(codes):
        """The transpose of a 2-D tile of FP8 codes, moved as bytes (the layout conversion
        through shared memory then carries 1 byte per element, not the 4 of the FP32 values)."""
        return tl.trans(codes.to(tl.uint8, bitcast=True)).to(codes.dtype, bitcast=True)

    @triton.jit
    def _bf16_to_f32(xb, EXACT: tl.constexpr):
        """FP32 values of a BF16 tile. ``EXACT`` (no hardware conversion: Triton's interpreter,
        whose BF16 -> FP32 conversion loses BF16 subnormals): the 16 bits shifted into place,
        which is what the conversion is; otherwise the compiler's conversion (the same values)."""
        if EXACT:
            return (xb.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return xb.to(tl.float32)

    @triton.jit
    def _rne_bf16(x):
        """FP32 ``x`` rounded to the nearest BF16 value (ties to even), still as FP32 — explicit
        on the bits, so the interpreter (whose BF16 cast truncates) and the GPU agree."""
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        # libdevice's expf on a GPU (what PyTorch's CUDA kernels call; tl.exp is the approximate
        # ex2.approx there); the interpreter has no libdevice and evaluates tl.exp exactly
        if LIBDEVICE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _swiglu(g, u, LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr):
        """``silu(g) * u`` as PyTorch evaluates ``F.silu(g) * u`` in the inputs' dtype (FP32
        math, IEEE division, each op's result rounded to that dtype): bit-identical values."""
        s = tl.math.div_rn(g, 1.0 + _exp(-g, LIBDEVICE))
        if IN_BF16:
            s = _rne_bf16(s)
        a = s * u
        if IN_BF16:
            a = _rne_bf16(a)
        return a

    @triton.jit
    def _load_act(x_ptr, g_ptr, offs, m, GATED: tl.constexpr, LIBDEVICE: tl.constexpr,
                  IN_BF16: tl.constexpr):
        """The operand at ``offs`` as FP32: ``x`` itself, or (GATED) ``silu(g) * x``."""
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            x = _swiglu(g, x, LIBDEVICE, IN_BF16)
        return x

    @triton.jit
    def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr,
                           LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr):
        # autograd of F.silu(g) * u in one pass: du = dy * silu(g), dg = silu'(g) * (dy * u),
        # each product rounded to the inputs' dtype where PyTorch's separate kernels round it
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        d = 1.0 + _exp(-g, LIBDEVICE)  # one exp for SiLU and its derivative
        s = tl.math.div_rn(g, d)
        sig = tl.math.div_rn(tl.zeros_like(d) + 1.0, d)
        ds = dy * u
        if IN_BF16:
            s = _rne_bf16(s)
            ds = _rne_bf16(ds)
        dg = ds * sig * (1.0 + g * (1.0 - sig))
        du = dy * s
        if IN_BF16:  # rounded here: the interpreter's BF16 store truncates
            dg = _rne_bf16(dg)
            du = _rne_bf16(du)
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _scale_from_amax(amax, FMAX: tl.constexpr, EMAX: tl.constexpr, TOP_MANT: tl.constexpr, MODE: tl.constexpr,
                         MARGIN_DIV: tl.constexpr = 1.0):
        """(scale s, scale_inv, e8m0 biased exponent) per group, same rules as reference.py.
        ``MARGIN_DIV`` (FP32 and pow2 modes): ``2**margin`` of delayed scaling, divided out of
        ``fmax / amax`` before the Inf and zero rules (nn/scaling.advance_delayed_scaling)."""
        if MODE < 2:
            # IEEE round-to-nearest division (Triton's plain `/` may be approximate on GPU)
            s = tl.math.div_rn(tl.zeros_like(amax) + FMAX, amax)
            if MARGIN_DIV != 1.0:
                s = tl.math.div_rn(s, tl.zeros_like(s) + MARGIN_DIV)
            s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
            if MODE == 1:
                sb = s.to(tl.int32, bitcast=True)
                p2 = (sb & -8388608).to(tl.float32, bitcast=True)  # keep sign+exponent
                s = tl.where((s > 0) & (s < float("inf")), p2, s)
            s = tl.where(amax == 0, 1.0, s)
            return s, tl.math.div_rn(tl.zeros_like(s) + 1.0, s), tl.zeros_like(amax).to(tl.int32)
        else:
            ab = amax.to(tl.int32, bitcast=True)
            ebits = (ab >> 23) & 0xFF
            mant = ab & 0x7FFFFF
            floor_log2 = ebits - 127
            e = floor_log2 - EMAX
            if MODE == 2:
                e = e + (mant > TOP_MANT).to(tl.int32)
            e = tl.where(e < -127, -127, tl.where(e > 127, 127, e))
            e = tl.where(amax == 0, 0, e)
            bad = (amax != amax) | (amax == float("inf"))
            # 2^-e and 2^e from exponent bits (2^-127 is subnormal: bit 22)
            s = tl.where(e == 127, (tl.zeros_like(e) + 4194304).to(tl.float32, bitcast=True),
                         ((127 - e) << 23).to(tl.float32, bitcast=True))
            si = tl.where(e == -127, (tl.zeros_like(e) + 4194304).to(tl.float32, bitcast=True),
                          ((127 + e) << 23).to(tl.float32, bitcast=True))
            s = tl.where(bad, float("nan"), s)
            si = tl.where(bad, float("nan"), si)
            return s, si, tl.where(bad, 255, e + 127)

    @triton.jit
    def _tile_ids(n_r, n_c, group_r):
        """(row tile, column tile) of this program in a 1-D grid of ``n_r * n_c`` tiles, visited in
        bands of ``group_r`` row tiles: within a band the row tiles vary fastest, then the column
        tiles. ``group_r >= n_r``: row tiles fastest over the whole grid; ``1``: column tiles
        fastest (each band one row of tiles, read left to right). Only the order in which tiles
        run changes (which the DRAM pages of concurrently running tiles are), never a code."""
        pid = tl.program_id(0)
        per_band = group_r * n_c
        first = (pid // per_band) * group_r
        rows_in_band = tl.minimum(n_r - first, group_r)
        return first + (pid % per_band) % rows_in_band, (pid % per_band) // rows_in_band

    @triton.jit
    def _abs_bits(x):
        """The IEEE bits of FP32 ``x`` with the sign cleared, as int32: they order like the
        magnitudes, with every NaN pattern above +Inf, so one integer max gives the amax and NaN
        at once (two instructions per element instead of the five of a float max plus a NaN flag)."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _abs_bits16(xb):
        """:func:`_abs_bits` of a BF16 tile, on its 16 bits (int16; reduce them in that width).
        BF16 is FP32's top half, so :func:`_f32_bits_of_bits16` of their max gives the FP32 bits
        of the amax exactly (NaN patterns above +Inf, as there) — half the registers of the FP32
        tile, which is why the ``bf16_tile`` kernels keep the tile in BF16."""
        return xb.to(tl.int16, bitcast=True) & 0x7FFF

    @triton.jit
    def _f32_bits_of_bits16(m):
        """The FP32 bits (int32) of BF16 bits ``m`` from :func:`_abs_bits16` (non-negative)."""
        return m.to(tl.int32) << 16

    @triton.jit
    def _amax_from_bits(m):
        """The amax of a max of :func:`_abs_bits`: its float value, NaN for a NaN pattern."""
        return tl.where(m > 0x7F800000, float("nan"), m.to(tl.float32, bitcast=True))

    @triton.jit
    def _group_amax(x, axis: tl.constexpr):
        """max|x| along ``axis``, NaN if a NaN is there (:func:`_abs_bits`)."""
        return _amax_from_bits(tl.max(_abs_bits(x), axis=axis))

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
            # thread kept these kernels latency-bound (session 15's profile: 167 registers, 8
            # warps per SM)
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

    @triton.jit
    def _quant_block_kernel(x_ptr, q_ptr, qt_ptr, si_ptr, R, C, GC, stride_x, n_r, n_c, group_r,
                            BLOCK: tl.constexpr, MODE: tl.constexpr, FMAX: tl.constexpr,
                            IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr, TRANS: tl.constexpr):
        # one 128x128 block per program; TRANS: also write the codes transposed ([C, R], the
        # dgrad copy of a weight: 128x128 blocks are symmetric, so the same codes and scale)
        pr, pc = _tile_ids(n_r, n_c, group_r)
        rows = pr * BLOCK + tl.arange(0, BLOCK)
        cols = pc * BLOCK + tl.arange(0, BLOCK)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = _amax_from_bits(tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
        s, si, e8 = _scale_from_amax(amax, FMAX, 0, 0, MODE)
        # with TRANS the explicit saturation stays (NO_INF off), as in the other kernels that
        # store transposed codes: without it Triton 3.6 wrote wrong transposed codes for FP32
        # weights of several blocks on sm_90 (dgrad NaN in tests/test_gpu.py)
        q = _round_fp8(x * s, FMAX, IS_E4M3, HW_CVT, NO_INF=not TRANS)
        codes = _fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=not TRANS)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], codes, mask=m)
        if TRANS:
            mt = (cols[:, None] < C) & (rows[None, :] < R)
            tl.store(qt_ptr + cols[:, None] * R + rows[None, :], _trans_codes(codes), mask=mt)
        tl.store(si_ptr + pr * GC + pc, si)

    @triton.jit
    def _fold_amax_bits(amax_bits_ptr, m, CHECK: tl.constexpr = False):
        # m: max of |x|'s IEEE bits (sign cleared), which order like the values, with every NaN
        # pattern above +Inf; a NaN is written as the positive quiet NaN 0x7FC00000.
        # CHECK: read the accumulator first and issue the atomic only if m is larger (the value
        # read may be stale, but only ever too small: the accumulator only grows), so that most
        # of the thousands of programs folding into one address skip their atomic
        v = tl.where(m > 0x7F800000, 0x7FC00000, m)
        if CHECK:
            tl.atomic_max(amax_bits_ptr, v, mask=v > tl.load(amax_bits_ptr))
        else:
            tl.atomic_max(amax_bits_ptr, v)

    @triton.jit
    def _fold_amax(amax_bits_ptr, x, CHECK: tl.constexpr = False):
        """Fold max|x| of a 1-D block into ``amax_bits_ptr`` (int32) with one atomic max: a
        single integer reduction gives the amax and NaN at once."""
        _fold_amax_bits(amax_bits_ptr, tl.max(_abs_bits(x), axis=0), CHECK)

    @triton.jit
    def _fold_amax_2d(amax_bits_ptr, x, CHECK: tl.constexpr = False):
        """:func:`_fold_amax` for a 2-D tile (rows, then across rows: no layout conversion)."""
        _fold_amax_bits(amax_bits_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0), CHECK)

    @triton.jit
    def _amax_atomic_kernel(x_ptr, g_ptr, amax_bits_ptr, act_ptr, N, BLOCK: tl.constexpr, GATED: tl.constexpr,
                            LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr, WRITE_ACT: tl.constexpr,
                            AMAX_CHECK: tl.constexpr = False):
        # WRITE_ACT (with GATED): also store the activation silu(g) * x (its values are already
        # rounded to the store's dtype, so the store is exact) for the cast pass to read
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = _load_act(x_ptr, g_ptr, offs, m, GATED, LIBDEVICE, IN_BF16)
        if WRITE_ACT:
            tl.store(act_ptr + offs, x.to(act_ptr.dtype.element_ty), mask=m)
        _fold_amax(amax_bits_ptr, x, AMAX_CHECK)

    @triton.jit
    def _tensor_scale(amax_ptr, s_ptr, si_ptr, first, HAS_SCALE: tl.constexpr, MODE: tl.constexpr,
                      FMAX: tl.constexpr):
        """The per-tensor scale every program uses: the given (delayed) one, or the reference's
        rule applied to the amax the first pass left in memory; ``first`` program writes
        ``scale_inv``."""
        if HAS_SCALE:
            s = tl.load(s_ptr)
            si = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
        else:
            s, si, _e8 = _scale_from_amax(tl.load(amax_ptr), FMAX, 0, 0, MODE)
        tl.store(si_ptr, si, mask=first)
        return s

    @triton.jit
    def _cast_kernel(x_ptr, amax_ptr, s_ptr, si_ptr, q_ptr, N, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                     IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr, HAS_SCALE: tl.constexpr, MODE: tl.constexpr,
                     AMAX_OUT: tl.constexpr, AMAX_CHECK: tl.constexpr = False):
        # AMAX_OUT (with a given scale only: delayed scaling): also fold this block's amax into
        # amax_ptr (int32 bits), so the history gets the tensor's amax without a second read
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        s = _tensor_scale(amax_ptr, s_ptr, si_ptr, pid == 0, HAS_SCALE, MODE, FMAX)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if AMAX_OUT:
            _fold_amax(amax_ptr, x, AMAX_CHECK)
        q = _round_fp8(x * s, FMAX, IS_E4M3, HW_CVT, NO_INF=not HAS_SCALE)  # a given scale can overflow
        tl.store(q_ptr + offs, _fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=not HAS_SCALE), mask=m)

    @triton.jit
    def _quant_dual_kernel(x_ptr, q_ptr, si_ptr, e8_ptr, qt_ptr, sit_ptr, e8t_ptr, R, C, G_row, G_col,
                           stride_x, n_r, n_c, group_r, GROUP: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr,
                           FMAX: tl.constexpr, EMAX: tl.constexpr, TOP_MANT: tl.constexpr,
                           IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr):
        # One read of a TILE x TILE tile; writes the row-grouped codes [R, C] and the
        # column-grouped codes transposed [C, R] (GROUP divides TILE).
        pr, pc = _tile_ids(n_r, n_c, group_r)
        rows = pr * TILE + tl.arange(0, TILE)
        cols = pc * TILE + tl.arange(0, TILE)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        NG: tl.constexpr = TILE // GROUP
        # row-wise groups: [TILE, NG, GROUP]
        codes, si, e8 = _quant_last_groups(tl.reshape(x, (TILE, NG, GROUP)), q_ptr.dtype.element_ty,
                                           FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], tl.reshape(codes, (TILE, TILE)), mask=m)
        gcol = pc * NG + tl.arange(0, NG)
        ms = (rows[:, None] < R) & (gcol[None, :] < G_row)
        tl.store(si_ptr + gcol[None, :] * R + rows[:, None], si, mask=ms)  # outer-dim major [R, G_row]
        if MODE >= 2:
            tl.store(e8_ptr + gcol[None, :] * R + rows[:, None], e8.to(tl.uint8), mask=ms)
        # column-wise groups, reduced in the loaded layout ([NG, GROUP(rows), TILE(cols)]); only
        # the 1-byte codes are transposed for the [C, R] store
        xc = tl.reshape(x, (NG, GROUP, TILE))
        st, sit, e8t = _scale_from_amax(_group_amax(xc, 1), FMAX, EMAX, TOP_MANT, MODE)  # [NG, TILE]
        qc = _round_fp8(xc * st[:, None, :], FMAX, IS_E4M3, HW_CVT)  # not NO_INF: see _cast_dual_kernel
        codes_t = _trans_codes(_fp8_cast(tl.reshape(qc, (TILE, TILE)), qt_ptr.dtype.element_ty, IS_E4M3))
        mt = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(qt_ptr + cols[:, None] * R + rows[None, :], codes_t, mask=mt)
        grow = pr * NG + tl.arange(0, NG)
        mst = (grow[:, None] < G_col) & (cols[None, :] < C)
        tl.store(sit_ptr + grow[:, None] * C + cols[None, :], sit, mask=mst)  # outer-dim major [C, G_col]
        if MODE >= 2:
            tl.store(e8t_ptr + grow[:, None] * C + cols[None, :], e8t.to(tl.uint8), mask=mst)

    @triton.jit
    def _cast_dual_kernel(x_ptr, g_ptr, amax_ptr, s_ptr, si_ptr, q_ptr, qt_ptr, R, C, stride_x,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FMAX: tl.constexpr,
                          IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr, HAS_SCALE: tl.constexpr,
                          MODE: tl.constexpr, AMAX_OUT: tl.constexpr, GATED: tl.constexpr,
                          LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr, BF16_TILE: tl.constexpr = False,
                          AMAX_CHECK: tl.constexpr = False):
        # per-tensor scale: the codes and their transpose (the codes moved as bytes) from one read
        # (GATED: of the SwiGLU halves g (g_ptr, same strides) and x, the activation never stored)
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        s = _tensor_scale(amax_ptr, s_ptr, si_ptr, (pr == 0) & (pc == 0), HAS_SCALE, MODE, FMAX)
        if BF16_TILE:  # (a BF16 x, not GATED, AMAX_OUT) the amax on the 16-bit magnitudes, as loaded
            xb = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            _fold_amax_bits(amax_ptr, _f32_bits_of_bits16(tl.max(tl.max(_abs_bits16(xb), axis=1), axis=0)), AMAX_CHECK)
            x = _bf16_to_f32(xb, not HW_CVT)
        else:
            x = _load_act(x_ptr, g_ptr, rows[:, None] * stride_x + cols[None, :], m, GATED, LIBDEVICE, IN_BF16)
            if AMAX_OUT:  # first, so the FP32 tile need not stay live through the transpose
                _fold_amax_2d(amax_ptr, x, AMAX_CHECK)
        # NO_INF stays False here even for current scaling, and the grid stays 2-D (see _round_fp8)
        codes = _fp8_cast(_round_fp8(x * s, FMAX, IS_E4M3, HW_CVT), q_ptr.dtype.element_ty, IS_E4M3)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], codes, mask=m)
        mt = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(qt_ptr + cols[:, None] * R + rows[None, :], _trans_codes(codes), mask=mt)


    @triton.jit
    def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, amax_ptr, q_ptr, si_ptr, e8_ptr, R, D, G,
                            stride_x, stride_y, inv_d, eps, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr,
                            AMAX: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
                            FMAX: tl.constexpr, EMAX: tl.constexpr, TOP_MANT: tl.constexpr,
                            IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr):
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
            y = _rne_bf16(y)  # the store's rounding made explicit (the interpreter truncates)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(rstd_ptr + row, rstd)
        if AMAX:
            _fold_amax(amax_ptr, y)
        if GROUP > 0:
            NG: tl.constexpr = BLOCK_D // GROUP
            tl.debug_barrier()  # this program's stores of y are visible to all its threads
            offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            y2 = tl.load(y_ptr + row * stride_y + offs, mask=offs < D, other=0.0).to(tl.float32)
            codes, si, e8 = _quant_last_groups(tl.reshape(y2, (1, NG, GROUP)), q_ptr.dtype.element_ty,
                                               FMAX, EMAX, TOP_MANT, MODE, IS_E4M3, HW_CVT)
            tl.store(q_ptr + row * D + offs, tl.reshape(codes, (NG, GROUP)), mask=offs < D)
            gi = tl.arange(0, NG)
            tl.store(si_ptr + gi * R + row, tl.reshape(si, (NG,)), mask=gi < G)  # outer-dim major [R, G]
            if MODE >= 2:
                tl.store(e8_ptr + gi * R + row, tl.reshape(e8, (NG,)).to(tl.uint8), mask=gi < G)

    @triton.jit
    def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R, D, stride_dy, stride_x, inv_d,
                            ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DW: tl.constexpr,
                            OUT_BF16: tl.constexpr):
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
                dx = _rne_bf16(dx)
            tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mr)
            if HAS_DW:
                acc += dy * xh
        if HAS_DW:
            tl.store(dw_ptr + pid * D + cols, acc, mask=m)

    @triton.jit
    def _delayed_commit_kernel(hist_ptr, scale_ptr, pending_ptr, flag_ptr, L, flag_after,
                               BLOCK_L: tl.constexpr, FMAX: tl.constexpr, MARGIN_DIV: tl.constexpr,
                               MOST_RECENT: tl.constexpr):
        # One program: append the pending amax to the history (if flagged), amax over the
        # history, s = fmax / amax / 2^margin, keep the old scale unless amax is finite and > 0;
        # then pending = 0 and flag = flag_after (nn/scaling.advance_delayed_scaling's rule).
        offs = tl.arange(0, BLOCK_L)
        m = offs < L
        f = tl.load(flag_ptr) > 0
        p = tl.load(pending_ptr)
        h = tl.load(hist_ptr + offs, mask=m, other=0.0)
        prev = tl.load(hist_ptr + offs - 1, mask=m & (offs > 0), other=0.0)
        new = tl.where(f, tl.where(offs == 0, p, prev), h)
        if MOST_RECENT:
            amax = tl.sum(tl.where(offs == 0, new, 0.0), axis=0)
        else:  # amaxes are >= 0: the padding (0) never wins; NaN anywhere makes the max NaN
            amax = tl.max(tl.where(m, new, 0.0), axis=0)
            amax = tl.where(tl.max(((new != new) & m).to(tl.int32), axis=0) > 0, float("nan"), amax)
        sc, _si, _e8 = _scale_from_amax(amax, FMAX, 0, 0, 0, MARGIN_DIV)  # the FP32 rule, with the margin
        ok = (amax == amax) & (amax != float("inf")) & (amax > 0) & f
        old = tl.load(scale_ptr)
        tl.debug_barrier()  # every thread has read the old history before any entry is shifted
        tl.store(hist_ptr + offs, new, mask=m)
        tl.store(scale_ptr, tl.where(ok, sc, old))
        tl.store(pending_ptr, 0.0)
        tl.store(flag_ptr, flag_after)


#: Launch configurations (tile sizes and warps) per kernel. They change the speed, never the
#: codes (every tile size gives the same bits: tests/test_triton_kernels.py). The values are the
#: fastest of ``benchmarks/quant_bandwidth.py --sweep all`` on an H200 (8192x14336 BF16,
#: GPU-only time; docs/benchmarks.md): e.g. 1x32 columns 0.385 -> 0.208 ms with 2 warps and
#: 128-column tiles. Override temporarily with :func:`launch_config`.
LAUNCH = {
    # group_r (tiled kernels): the order the tiles run in, bands of group_r row tiles
    # (_tile_ids; 0 = all rows of tiles, row tiles fastest)
    # groups: scaling groups per tile along the grouped dim (1x128 / 1x32 rows and columns).
    # 1x32 rows: 0.202 -> 0.119 ms with 16 groups per tile (each row's load a contiguous 1 KiB);
    # 1x32 columns 0.211 -> 0.197 ms with 2 (session 13; with bf16_tile, below, 1 is fastest)
    "rows128": {"block_r": 64, "num_warps": 2, "groups": 1, "group_r": 0},
    "rows32": {"block_r": 16, "num_warps": 4, "groups": 16, "group_r": 0},
    # bf16_tile (BF16 sources): the loaded tile kept in BF16 through the amax. On an H200
    # (session 18 sweeps `cols_t128_bf16`, `cols_t32_bf16`): 1x128 columns 0.126 -> 0.107 ms,
    # 1x32 columns 0.136 -> 0.099 ms with one group of 128 columns per program
    "cols_t128": {"block_c": 64, "num_warps": 2, "groups": 1, "group_r": 0, "bf16_tile": True},
    "cols_t32": {"block_c": 128, "num_warps": 2, "groups": 1, "group_r": 0, "bf16_tile": True},
    "blocks128": {"num_warps": 16, "group_r": 0},
    # amax_check (the kernels that fold a per-tensor amax with one atomic per program into one
    # address): read the accumulator first and skip the atomic where the program's amax is not
    # larger. On an H200 (session 19 sweeps `tensor_check`, `tensor_delayed_check`,
    # `tensor_dual_delayed_check`): amax pass + cast 0.154 -> 0.145 ms, delayed cast 0.106 -> 0.104,
    # delayed pair 0.163 -> 0.157 ms (0.152 with 32x256 tiles, below)
    "tensor": {"block": 8192, "num_warps": 8, "amax_check": True},
    # the per-tensor cast with a given scale (delayed scaling: one read, the amax folded in):
    # 0.112 -> 0.107 ms with 4096-element blocks on an H200 (session 18 sweep, `tensor_delayed`)
    "tensor_delayed": {"block": 4096, "num_warps": 8, "amax_check": True},
    "dual128": {"num_warps": 4, "group_r": 0},
    "dual32": {"tile": 64, "num_warps": 8, "group_r": 0},
    # per-tensor codes + transpose: 0.228 -> 0.200 ms with 64x256 tiles (with the amax pass)
    "tensor_dual": {"block_r": 64, "block_c": 256, "num_warps": 8},
    # given scale (delayed): fold_amax=True takes the amax inside the cast pass (one read),
    # False runs the atomic amax pass first (two reads). Measured: 0.174 ms folded with 32x256
    # tiles and 4 warps, against 0.201 ms for the best two-pass configuration (and 0.25-0.39 ms
    # folded with larger tiles, whose FP32 tile then no longer fits the registers)
    # bf16_tile (BF16 sources, folded amax): the amax on the tile's 16-bit magnitudes as loaded,
    # fewer registers: 0.174 -> 0.161 ms with 64x128 tiles (session 18 sweep, `tensor_dual_delayed_bf16`);
    # with amax_check, 32x256 tiles and 4 warps are fastest again: 0.152 ms (session 19, two runs)
    "tensor_dual_delayed": {"block_r": 32, "block_c": 256, "num_warps": 4, "fold_amax": True, "bf16_tile": True,
                            "amax_check": True},
    # fused RMSNorm: one row per program, warps = row length / (32 threads x elems_per_thread)
    # (1 to 16); backward: rows_per_program consecutive rows per program (each program writes
    # one partial weight gradient)
    "rmsnorm": {"elems_per_thread": 8},
    "rmsnorm_bwd": {"elems_per_thread": 8, "rows_per_program": 16},
}

#: Longest row the fused RMSNorm takes (a whole row lives in registers: 16384 = Llama 3 405B).
RMSNORM_MAX_D = 16384


@contextlib.contextmanager
def launch_config(kernel: str, **cfg):
    """Temporarily override a kernel's launch configuration (for tuning sweeps)::

        with launch_config("rows128", block_r=16, num_warps=8):
            quantize_rows(x, "e4m3", 128, "pow2")
    """
    if kernel not in LAUNCH:
        raise KeyError(f"unknown kernel {kernel!r}; valid: {', '.join(LAUNCH)}")
    bad = set(cfg) - set(LAUNCH[kernel])
    if bad:
        raise KeyError(f"{kernel} has no launch option {', '.join(sorted(bad))}; valid: {', '.join(LAUNCH[kernel])}")
    old = dict(LAUNCH[kernel])
    LAUNCH[kernel].update(cfg)
    try:
        yield
    finally:
        LAUNCH[kernel].clear()
        LAUNCH[kernel].update(old)


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT function: a few µs per Python call)."""
    return -(-a // b)


def _hw_cvt(x: torch.Tensor) -> bool:
    """Whether the store's FP8 cast is the GPU's hardware RNE conversion (compiled for CUDA) rather
    than the interpreter's CPU emulation, which needs the explicit rounding of ``_round_fp8``."""
    if not x.is_cuda or _interpreting():
        return False
    return _cvt_capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cvt_capable(index: int) -> bool:
    # Triton lowers an FP32 -> FP8 cast to the direct cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (one
    # rounding) on sm_90+; for sm_89, Triton 3.6 goes through FP16 (two roundings, which can
    # differ from one) while 3.9 converts directly. Below sm_90 the kernels therefore keep the
    # explicit rounding, whose result is exactly representable, so any conversion of it is
    # exact. The sm_90 lowering is checked in CI by compiling the kernels
    # (tests/test_triton_kernels.py).
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _group_r(cfg: dict, n_r: int) -> int:
    """The ``group_r`` of a launch configuration (row tiles per band, :func:`_tile_ids`; 0 or
    absent = all of them: row tiles fastest over the whole grid)."""
    g = int(cfg.get("group_r", 0))
    return n_r if g <= 0 else min(g, n_r)


#: The kernels address elements with 32-bit offsets (Triton's default for int arguments and
#: program ids): the largest element offset of every tensor they read or write must fit.
INT32_MAX = 2**31 - 1


def _require_triton(*tensors: torch.Tensor):
    """Triton is there, and each of ``tensors`` (the sources; every output a kernel writes has the
    same number of elements or fewer) can be addressed with 32-bit element offsets — else a clear
    error instead of wrapped offsets that would read and write the wrong elements."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed: `pip install triton` (GPU machines ship it)")
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        # a source whose last dim is not contiguous is copied first (then numel is what counts);
        # otherwise the kernels read it through its own strides
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.stride(-1) == 1 else 0
        if t.numel() > INT32_MAX or last > INT32_MAX:
            raise ValueError(
                f"tensor of shape {tuple(t.shape)} ({t.numel():,} elements) is too large for the fused Triton "
                f"quantisers, which index with 32-bit offsets (at most {INT32_MAX:,} elements): use fewer tokens "
                "per micro-batch or shard the layer (tensor parallelism), or run the model with "
                "KernelOptions(triton=False) (trainer: kernels.triton=false) to use the reference quantisers "
                "(same codes, slower)")


def _top_mant(fmt: Format) -> int:
    # ceil rule: bump the exponent when amax's significand 1.m exceeds fmax / 2^emax (1.75 E4M3)
    top = fmt.max / float(2**fmt.emax)
    return int(round((top - 1.0) * (1 << 23)))


def _e8m0_view(e8: torch.Tensor) -> torch.Tensor:
    return e8.view(torch.float8_e8m0fnu)


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


def quantize_blocks128(x: torch.Tensor, fmt, rounding, transposed: bool = False):
    """128x128 blocks (blockwise weights); FP32 scales (``fp32`` or ``pow2``). ``transposed``:
    return ``(q, qt)``, ``qt`` the same blocks for ``x.T`` with contiguous codes ``[C, R]``
    written by the same pass (a weight's dgrad copy) and ``q.scale_inv.T`` as its scales."""
    _require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if _MODE[rounding] >= 2:
        raise ValueError("128x128 blocks take fp32 or pow2 scales")
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape
    GR, GC = -(-R // 128), -(-C // 128)
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    qt = torch.empty((C, R), dtype=fmt.dtype, device=x.device) if transposed else q
    si = torch.empty((GR, GC), dtype=torch.float32, device=x.device)
    _launch(_quant_block_kernel, (GR * GC,), x, q, qt, si, R, C, GC, x.stride(0), GR, GC,
            _group_r(LAUNCH["blocks128"], GR), BLOCK=128, MODE=_MODE[rounding],
            num_warps=LAUNCH["blocks128"]["num_warps"],
            FMAX=fmt.max, IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x), TRANS=transposed)
    a = QuantizedTensor(data=q, scale_inv=si, block=(128, 128), fmt=fmt, amax=si)
    if not transposed:
        return a
    return a, QuantizedTensor(data=qt, scale_inv=si.t(), block=(128, 128), fmt=fmt, amax=si.t())


def _tensor_amax(x2: torch.Tensor, acc: Optional[torch.Tensor] = None,
                 gate: Optional[torch.Tensor] = None, act_out: Optional[torch.Tensor] = None,
                 amax_check: Optional[bool] = None) -> torch.Tensor:
    """Per-tensor amax max-accumulated into ``acc`` (a ``[1, 1]`` FP32 tensor; default a fresh
    zero), which is returned: one atomic-max pass over a contiguous ``x2`` (NaN if any element
    is NaN), or a PyTorch reduction of a strided one. ``gate``: the amax of ``silu(gate) * x2``
    (both contiguous, :func:`_check_gate`), which the same pass also writes into ``act_out`` (a
    contiguous tensor like ``x2``) when given. ``amax_check``: the caller's launch entry's
    setting (default: ``LAUNCH["tensor"]``'s, current scaling's amax pass)."""
    if acc is None:
        acc = torch.zeros((1, 1), dtype=torch.float32, device=x2.device)  # a base tensor, not a view
    n = x2.numel()
    if n and x2.is_contiguous():
        block, warps = LAUNCH["tensor"]["block"], LAUNCH["tensor"]["num_warps"]
        # (operands a launch does not use are passed as None rather than as aliases of x2)
        _launch(_amax_atomic_kernel, (_cdiv(n, block),), x2, gate, acc.view(torch.int32), act_out, n,
                BLOCK=block, num_warps=warps, WRITE_ACT=act_out is not None,
                AMAX_CHECK=bool(LAUNCH["tensor"]["amax_check"]
                                if amax_check is None else amax_check),
                **_gate_args(x2, gate))
    elif n:
        if gate is not None:
            raise ValueError("a gated amax needs contiguous inputs")
        accumulate_amax(acc, x2.float().abs().amax())
    return acc


def _act_args(x: torch.Tensor) -> dict:
    """The constexprs of the in-kernel SwiGLU math on ``x``'s dtype and device."""
    return {"LIBDEVICE": x.is_cuda and not _interpreting(), "IN_BF16": x.dtype == torch.bfloat16}


def _gate_args(x: torch.Tensor, gate: Optional[torch.Tensor]) -> dict:
    """The SwiGLU-prologue constexprs of the per-tensor kernels."""
    return {"GATED": gate is not None, **_act_args(x)}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def gate_fusable(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernels can compute ``F.silu(gate) * x`` themselves (:func:`_check_gate`)."""
    try:
        _check_gate(x, gate)
    except ValueError:
        return False
    return True


def _check_gate(x: torch.Tensor, gate: Optional[torch.Tensor]) -> None:
    """``gate`` (the SwiGLU gate half ``g`` of ``silu(g) * x``) must match ``x`` exactly: same
    shape, dtype (BF16 or FP32), device, and both contiguous."""
    if gate is None:
        return
    if gate.shape != x.shape or gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"gate must match the input: got {tuple(gate.shape)} {gate.dtype} on {gate.device} "
                         f"for {tuple(x.shape)} {x.dtype} on {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the fused SwiGLU takes BF16 or FP32 inputs, not {x.dtype}")
    if not (x.is_contiguous() and gate.is_contiguous()):
        raise ValueError("the fused SwiGLU needs contiguous inputs")


def swiglu_backward(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """``(dg, du)``, the gradients of ``F.silu(g) * u`` for the output gradient ``dy``, in one
    pass (PyTorch's autograd takes three kernels and two intermediate tensors). ``du`` is
    bit-identical to autograd's; ``dg`` can differ by rounding where the compiler contracts the
    derivative's multiply-add differently (tests: within one unit in the last place)."""
    _require_triton(dy, g, u)
    _check_gate(u, g)
    if dy.shape != u.shape or dy.dtype != u.dtype or not dy.is_contiguous():
        raise ValueError("dy must be contiguous with the shape and dtype of u")
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = u.numel()
    if n:
        block = 4096
        _launch(_swiglu_bwd_kernel, (_cdiv(n, block),), dy, g, u, dg, du, n, BLOCK=block, num_warps=8,
                **_act_args(u))
    return dg, du


def _tensor_scale_args(amax: torch.Tensor, fmt: Format, rounding: ScaleRounding, scale):
    """``(scale operand, scale_inv buffer, HAS_SCALE, MODE)`` for the per-tensor cast kernels."""
    if _MODE[rounding] >= 2:
        raise ValueError(f"per-tensor scaling takes fp32 or pow2 scales, not {rounding.value}")
    si = torch.empty((1, 1), dtype=torch.float32, device=amax.device)
    if scale is None:
        return amax, si, False, _MODE[rounding]
    return scale.float().reshape(1, 1).contiguous(), si, True, _MODE[rounding]


def _scale_inv_of_empty(amax: torch.Tensor, fmt: Format, rounding: ScaleRounding, scale) -> torch.Tensor:
    """``scale_inv`` where no cast kernel runs (an empty tensor): the reference rule, on the device."""
    from .reference import amax_to_scale

    s = amax_to_scale(amax, fmt, rounding) if scale is None else scale.float().reshape(1, 1)
    return 1.0 / s


def _amax_accumulator(amax_out, device) -> torch.Tensor:
    """The ``[1, 1]`` FP32 buffer a given-scale cast folds the tensor's amax into: ``amax_out``
    (max-accumulated over the IEEE bits as int32, so it must hold a value without the sign bit:
    zero, a previously accumulated amax, or a positive NaN — as these kernels write; a
    sign-bit NaN would lose against any amax) or a fresh zero."""
    if amax_out is None:
        return torch.zeros((1, 1), dtype=torch.float32, device=device)
    if amax_out.dtype != torch.float32 or amax_out.numel() != 1 or not amax_out.is_contiguous():
        raise ValueError(f"amax_out must be a contiguous one-element float32 tensor, got "
                         f"{amax_out.dtype} of shape {tuple(amax_out.shape)}")
    if amax_out.device != device:
        raise ValueError(f"amax_out is on {amax_out.device}, the input on {device}")
    return amax_out.view(1, 1)


def _per_tensor_amax(x2: torch.Tensor, scale, amax_out, gate=None, act_out=None):
    """``(amax buffer, AMAX_OUT)``: current scaling runs the amax pass first (writing the gated
    activation into ``act_out`` if given); a given scale lets the cast pass itself fold the amax
    into :func:`_amax_accumulator`'s buffer."""
    if scale is None:
        if amax_out is not None:
            raise ValueError("amax_out collects the amax of a cast with a given (delayed) scale; "
                             "current scaling (scale=None) returns its amax in q.amax")
        return _tensor_amax(x2, gate=gate, act_out=act_out), False
    return _amax_accumulator(amax_out, x2.device), True


def quantize_tensor(x: torch.Tensor, fmt, rounding=ScaleRounding.FP32, scale=None,
                    amax_out: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Per-tensor. Current scaling (``scale=None``): an atomic-max amax pass, then one cast pass
    whose programs derive the scale from that amax on the device — two kernels and a 4-byte
    memset, no host synchronisation, no small PyTorch ops in between. With a given ``scale``
    (delayed scaling): one pass that casts and folds this tensor's amax (for the history) into
    ``amax_out`` by an atomic max (or into a fresh buffer); ``q.amax`` is that buffer."""
    _require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = x2.numel()
    amax, amax_in_cast = _per_tensor_amax(x2, scale, amax_out)
    q = torch.empty(x2.shape, dtype=fmt.dtype, device=x.device)
    if not n:
        return QuantizedTensor(data=q, scale_inv=_scale_inv_of_empty(amax, fmt, rounding, scale), block=None,
                               fmt=fmt, amax=amax)
    s_arg, si, has_scale, mode = _tensor_scale_args(amax, fmt, rounding, scale)
    cfg = LAUNCH["tensor" if scale is None else "tensor_delayed"]
    block, warps = cfg["block"], cfg["num_warps"]
    _launch(_cast_kernel, (_cdiv(n, block),), x2, amax.view(torch.int32) if amax_in_cast else amax, s_arg, si, q,
            n, BLOCK=block, FMAX=fmt.max,
            IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x),
            HAS_SCALE=has_scale, MODE=mode, AMAX_OUT=amax_in_cast,
            AMAX_CHECK=bool(cfg["amax_check"]) and amax_in_cast, num_warps=warps)
    return QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax)


def quantize_dual(x: torch.Tensor, fmt, group: int, rounding):
    """Both copies from one read: ``(quantize_rows(x), quantize_cols_t(x))`` — the fprop/dgrad
    operand grouped along rows and the wgrad operand grouped down columns, transposed."""
    _require_triton(x)
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
    mx = _MODE[rounding] >= 2
    e8 = scale_grid(R, Gr, torch.uint8, dev) if mx else si
    e8t = scale_grid(C, Gc, torch.uint8, dev) if mx else sit
    cfg = LAUNCH["dual128" if group == 128 else "dual32"]
    tile = 128 if group == 128 else cfg["tile"]
    n_r, n_c = _cdiv(R, tile), _cdiv(C, tile)
    _launch(_quant_dual_kernel, (n_r * n_c,), x, q, si, e8, qt, sit, e8t, R, C, Gr, Gc, x.stride(0), n_r, n_c,
            _group_r(cfg, n_r), GROUP=group,
            num_warps=cfg["num_warps"],
            TILE=tile, MODE=_MODE[rounding], FMAX=fmt.max, EMAX=fmt.emax,
            TOP_MANT=_top_mant(fmt), IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x))
    a = QuantizedTensor(data=q, scale_inv=si, block=(1, group), fmt=fmt, amax=si,
                        scale_e8m0=_e8m0_view(e8) if mx else None)
    b = QuantizedTensor(data=qt, scale_inv=sit, block=(1, group), fmt=fmt, amax=sit,
                        scale_e8m0=_e8m0_view(e8t) if mx else None)
    return a, b


def quantize_tensor_dual(x: torch.Tensor, fmt, rounding=ScaleRounding.FP32, scale=None,
                         amax_out: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                         amax: Optional[torch.Tensor] = None):
    """Per-tensor codes and their transpose (contiguous) from one read of ``x``: ``(q, q_t)``
    with the same scale — after the amax pass (current scaling, the scale computed on the device
    by the cast kernel), or in a single pass with a given ``scale`` that also folds the amax
    into ``amax_out`` as :func:`quantize_tensor` does.

    ``gate`` (SwiGLU → quantise): quantise ``F.silu(gate) * x`` — the activation is computed in
    the kernels from its two halves (bit-identical to PyTorch's, :func:`_swiglu`): with a given
    scale inside the one-pass cast, never written; with current scaling once, in the amax pass,
    which writes it for the cast to read. The same codes as quantising the materialised
    activation, without PyTorch's separate SiLU and multiply kernels and their intermediate.

    ``amax`` (current scaling): ``x``'s amax, already taken by its producer (a ``[1, 1]`` FP32
    tensor, e.g. :func:`rmsnorm_forward`'s): the amax pass is skipped, the cast pass runs alone."""
    _require_triton(x, gate)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if amax is not None and (scale is not None or gate is not None or amax_out is not None):
        raise ValueError("a precomputed amax is for current scaling of x itself (no scale, gate or amax_out)")
    if amax is not None and (amax.dtype != torch.float32 or amax.numel() != 1 or amax.device != x.device):
        raise ValueError(f"amax must be a one-element float32 tensor on {x.device}, got {amax.dtype} "
                         f"of shape {tuple(amax.shape)} on {amax.device}")
    _check_gate(x, gate)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    R, C = x2.shape
    n = x2.numel()
    # current scaling reads its operand twice (amax, then cast): with a gate, the amax pass
    # computes the activation once and writes it, and the cast reads it back — 10 bytes per
    # element like evaluating SiLU in both passes, which was ALU-bound (H200, 8192x14336: 0.65 ms
    # against 0.49 ms for materialising the activation with PyTorch)
    act = torch.empty_like(x2) if gate is not None and scale is None else None
    if amax is not None:
        amax, amax_in_cast = amax.reshape(1, 1), False
    else:
        amax, amax_in_cast = _per_tensor_amax(x2, scale, amax_out, gate, act_out=act)
    if act is not None:
        x2, gate = act, None
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    qt = torch.empty((C, R), dtype=fmt.dtype, device=x.device)
    if n:
        s_arg, si, has_scale, mode = _tensor_scale_args(amax, fmt, rounding, scale)
        cfg = LAUNCH["tensor_dual_delayed" if amax_in_cast else "tensor_dual"]
        if amax_in_cast and not cfg["fold_amax"]:  # the amax pass into the same accumulator
            _tensor_amax(x2, amax, gate=gate, amax_check=bool(cfg["amax_check"]))
            amax_in_cast = False
        grid = (_cdiv(R, cfg["block_r"]), _cdiv(C, cfg["block_c"]))
        _launch(_cast_dual_kernel, grid, x2, gate,
                amax.view(torch.int32) if amax_in_cast else amax, s_arg, si, q, qt,
                R, C, x2.stride(0),
                BLOCK_R=cfg["block_r"], BLOCK_C=cfg["block_c"],
                FMAX=fmt.max, num_warps=cfg["num_warps"],
                IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x), HAS_SCALE=has_scale,
                MODE=mode, AMAX_OUT=amax_in_cast, **_gate_args(x2, gate),
                BF16_TILE=(bool(cfg.get("bf16_tile")) and amax_in_cast and gate is None
                           and x2.dtype == torch.bfloat16),
                # (cfg is tensor_dual, without the option, for current scaling)
                AMAX_CHECK=bool(cfg.get("amax_check")) and amax_in_cast)
    else:
        si = _scale_inv_of_empty(amax, fmt, rounding, scale)
    a = QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax)
    b = QuantizedTensor(data=qt, scale_inv=si, block=None, fmt=fmt, amax=amax)
    return a, b


def _row_warps(block_d: int, elems_per_thread: int) -> int:
    return int(min(16, max(1, block_d // (32 * elems_per_thread))))


def rmsnorm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, amax: bool = False,
                    rows: Optional[tuple] = None, out: Optional[torch.Tensor] = None):
    """Fused RMSNorm of the rows of 2-D ``x2`` (BF16 or FP32, last dim contiguous, at most
    :data:`RMSNORM_MAX_D` long): ``y = (x * rstd) * weight`` in FP32 with
    ``rstd = 1 / sqrt(mean(x**2) + eps)`` (the sum of squares in FP32 in the kernel's order, times
    FP32 ``1/D``; square root and division correctly rounded), stored in ``x2``'s dtype — one
    read of ``x``, one write of ``y`` (into ``out``, a contiguous ``[R, D]`` tensor of that dtype,
    if given). The values of ``y`` and ``rstd`` do not depend on ``amax``/``rows``. Returns
    ``(y, rstd [R] FP32, amax, q)``:

    * ``amax=True``: the per-tensor amax of ``y`` as stored (a ``[1, 1]`` FP32 tensor, NaN if any
      value is NaN), taken in the same pass — what current per-tensor scaling of ``y`` needs first
      (:func:`quantize_tensor_dual`'s ``amax``);
    * ``rows=(fmt, group, rounding)``: ``y`` quantised in 1x``group`` groups along its rows, the
      same codes and scales as :func:`quantize_rows` of ``y``, from the same pass.
    Otherwise ``amax``/``q`` are None."""
    _require_triton(x2)
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
    mx = _MODE[rounding] >= 2
    e8 = scale_grid(R, G, torch.uint8, dev) if group and mx else si
    if R:
        _launch(_rmsnorm_fwd_kernel, (R,), x2, w, y, rstd, acc.view(torch.int32) if amax else rstd, qd, si, e8, R, D, G,
                x2.stride(0), y.stride(0), 1.0 / D, float(eps), BLOCK_D=block_d,
                OUT_BF16=x2.dtype == torch.bfloat16, AMAX=amax, GROUP=group,
                MODE=_MODE[rounding], FMAX=fmt.max, EMAX=fmt.emax, TOP_MANT=_top_mant(fmt),
                IS_E4M3=fmt is Format.E4M3, HW_CVT=_hw_cvt(x2),
                num_warps=_row_warps(block_d, LAUNCH["rmsnorm"]["elems_per_thread"]))
    if group:
        q = QuantizedTensor(data=qd, scale_inv=si, block=(1, group), fmt=fmt, amax=si,
                            scale_e8m0=_e8m0_view(e8) if mx else None)
    return y, rstd, acc, q


def rmsnorm_backward(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     need_dw: bool = True):
    """Gradients of :func:`rmsnorm_forward`'s ``y`` for ``dy2`` (``[R, D]``): ``(dx`` in ``x2``'s
    dtype, ``dw`` in ``weight``'s dtype or None) in one pass over ``dy`` and ``x``; ``dw`` is
    summed in FP32 from per-program partial sums."""
    _require_triton(dy2, x2)
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
        _launch(_rmsnorm_bwd_kernel, (progs,), dy2, x2, w, rstd, dx, part, R, D, dy2.stride(0), x2.stride(0), 1.0 / D,
                ROWS=per, BLOCK_D=block_d, HAS_DW=need_dw,
                OUT_BF16=dx.dtype == torch.bfloat16,
                num_warps=_row_warps(block_d, cfg["elems_per_thread"]))
    dw = None
    if need_dw:
        dw = (part[:progs].sum(0) if R else torch.zeros(D, dtype=torch.float32, device=x2.device)).to(weight.dtype)
    return dx, dw


def delayed_commit(history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, flag: torch.Tensor,
                   fmt, amax_compute_algo: str = "max", margin: int = 0, flag_after: float = 0.0) -> None:
    """One operand's delayed-scaling update in one kernel, in place: where ``flag`` is set, append
    ``pending`` to ``history`` (``[L]``, newest first), take its max (or the most recent entry),
    ``scale = fmax / amax / 2**margin`` (FP32, correctly rounded; kept unless that amax is finite
    and positive); then ``pending = 0``, ``flag = flag_after``. The same numbers as
    :func:`nemo_fp8_recipes.nn.scaling.advance_delayed_scaling` with FP32 scales (the delayed
    recipe's), which takes about fifteen PyTorch kernels for it."""
    _require_triton()
    fmt = as_format(fmt)
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax_compute_algo {amax_compute_algo!r}; valid: max, most_recent")
    for name, t in (("scale", scale), ("pending", pending), ("flag", flag)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a one-element float32 tensor")
    if history.dim() != 1 or history.stride(0) != 1 or history.dtype != torch.float32:
        raise ValueError("history must be a contiguous 1-D float32 tensor")
    L = history.numel()
    _launch(_delayed_commit_kernel, (1,), history, scale, pending, flag, L, float(flag_after),
            BLOCK_L=triton.next_power_of_2(L), FMAX=fmt.max,
            MARGIN_DIV=float(2**margin), MOST_RECENT=amax_compute_algo == "most_recent",
            num_warps=4)
