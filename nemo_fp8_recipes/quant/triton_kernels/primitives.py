"""The ``@triton.jit`` device functions the kernel families share: the saturating RNE of FP32
values for an FP8 store and the codes' cast, the byte-wise transpose of a code tile, exact
BF16 <-> FP32 conversions, the reference's scale rule per group, the tile order of a 1-D grid
and the amax taken on IEEE bits (NaN included). Defined only where Triton is installed.

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

from .common import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def round_to_fp8(y, FMAX: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr, NO_INF: tl.constexpr = False):
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
        kernels that must stay memory-bound (the group quantisers; docs/internals/kernels.md)."""
        if HW_CVT and NO_INF:
            return y
        nan = y != y
        inf = (y == float("inf")) | (y == float("-inf"))
        yc = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
        if HW_CVT:
            # (the explicit clamp and NaN rule are what satfinite does anyway, but the kernels
            # that store transposed codes keep them: without them and with a 1-D tile order,
            # Triton 3.6 on sm_90 compiles the per-tensor pair kernel into one that writes wrong
            # transposed codes for FP32 sources (tests/quant/test_gpu.py); which of the two triggers
            # it is not known)
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
    def fp8_cast(r, ELEM: tl.constexpr, IS_E4M3: tl.constexpr, NO_INF: tl.constexpr = False):
        """The FP8 codes of ``round_to_fp8``'s result. The conversion saturates (``satfinite``:
        ±Inf would become ±57344), so E5M2's infinities, which the reference keeps, are written
        as their codes (0x7C / 0xFC) explicitly (unless ``NO_INF``: there are none)."""
        c = r.to(ELEM)
        if not IS_E4M3 and not NO_INF:
            bits = c.to(tl.uint8, bitcast=True).to(tl.int32)
            bits = tl.where(r == float("inf"), 0x7C, tl.where(r == float("-inf"), 0xFC, bits))
            c = bits.to(tl.uint8).to(ELEM, bitcast=True)
        return c

    @triton.jit
    def trans_codes(codes):
        """The transpose of a 2-D tile of FP8 codes, moved as bytes (the layout conversion
        through shared memory then carries 1 byte per element, not the 4 of the FP32 values)."""
        return tl.trans(codes.to(tl.uint8, bitcast=True)).to(codes.dtype, bitcast=True)

    @triton.jit
    def bf16_to_f32(xb, EXACT: tl.constexpr):
        """FP32 values of a BF16 tile. ``EXACT`` (no hardware conversion: Triton's interpreter,
        whose BF16 -> FP32 conversion loses BF16 subnormals): the 16 bits shifted into place,
        which is what the conversion is; otherwise the compiler's conversion (the same values)."""
        if EXACT:
            return (xb.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return xb.to(tl.float32)

    @triton.jit
    def rne_bf16(x):
        """FP32 ``x`` rounded to the nearest BF16 value (ties to even), still as FP32 — explicit
        on the bits, so the interpreter (whose BF16 cast truncates) and the GPU agree."""
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def scale_from_amax(
        amax,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        TOP_MANT: tl.constexpr,
        MODE: tl.constexpr,
        MARGIN_DIV: tl.constexpr = 1.0,
    ):
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
            s = tl.where(
                e == 127,
                (tl.zeros_like(e) + 4194304).to(tl.float32, bitcast=True),
                ((127 - e) << 23).to(tl.float32, bitcast=True),
            )
            si = tl.where(
                e == -127,
                (tl.zeros_like(e) + 4194304).to(tl.float32, bitcast=True),
                ((127 + e) << 23).to(tl.float32, bitcast=True),
            )
            s = tl.where(bad, float("nan"), s)
            si = tl.where(bad, float("nan"), si)
            return s, si, tl.where(bad, 255, e + 127)

    @triton.jit
    def tile_ids(n_r, n_c, group_r):
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
    def abs_bits(x):
        """The IEEE bits of FP32 ``x`` with the sign cleared, as int32: they order like the
        magnitudes, with every NaN pattern above +Inf, so one integer max gives the amax and NaN
        at once (two instructions per element instead of the five of a float max plus a NaN flag)."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def abs_bits16(xb):
        """:func:`abs_bits` of a BF16 tile, on its 16 bits (int16; reduce them in that width).
        BF16 is FP32's top half, so :func:`f32_bits_of_bits16` of their max gives the FP32 bits
        of the amax exactly (NaN patterns above +Inf, as there) — half the registers of the FP32
        tile, which is why the ``bf16_tile`` kernels keep the tile in BF16."""
        return xb.to(tl.int16, bitcast=True) & 0x7FFF

    @triton.jit
    def f32_bits_of_bits16(m):
        """The FP32 bits (int32) of BF16 bits ``m`` from :func:`abs_bits16` (non-negative)."""
        return m.to(tl.int32) << 16

    @triton.jit
    def amax_from_bits(m):
        """The amax of a max of :func:`abs_bits`: its float value, NaN for a NaN pattern."""
        return tl.where(m > 0x7F800000, float("nan"), m.to(tl.float32, bitcast=True))

    @triton.jit
    def group_amax(x, axis: tl.constexpr):
        """max|x| along ``axis``, NaN if a NaN is there (:func:`abs_bits`)."""
        return amax_from_bits(tl.max(abs_bits(x), axis=axis))
