"""Reference quantisers: the numerics contract (docs/recipes.md) in plain PyTorch.

This module is the single source of truth for how a tensor becomes FP8 codes plus scales. It runs
on CPU and GPU, accepts any shape (short trailing groups are scaled by their own amax), and is
what every faster kernel is checked against bit for bit.

Conventions
-----------
* ``q = saturate(round_to_nearest_even(x * s))`` stored as FP8; the GEMM multiplies by
  ``scale_inv = 1 / s`` (Transformer Engine's ``scale_inv``).
* Scaling groups are laid along the *last* dim of the 2-D tensor handed in (the contraction
  dim of the GEMM that consumes it). :func:`quantize` takes ``dim`` to quantise along another dim.
* An all-zero group gets scale 1. A group whose amax is NaN or Inf gets a NaN or zero scale, so
  the whole group dequantises to NaN: non-finite inputs are never hidden by a clamp.
* ``saturate`` clamps finite values to ``±fmax``. E4M3 has no infinity: ±Inf become NaN. E5M2
  keeps ±Inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from ..formats import Format, Granularity, ScaleRounding

__all__ = [
    "QuantizedTensor",
    "accumulate_amax",
    "as_format",
    "amax_to_scale",
    "e8m0_exponent",
    "cast_to_fp8",
    "quantize_tensorwise",
    "quantize_blocks",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantization_stats",
    "STAT_NAMES",
    "summarize_stats",
    "scale_grid",
]


def scale_grid(rows: int, groups: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty ``[rows, groups]`` grid of 1xN group scales laid out outer-dim major (strides
    ``(1, rows)``): the layout cuBLAS' block-scaled GEMMs read 1x128 scales in, so the fused
    quantisers write it directly and no layout copy sits between them and the GEMM. Values and
    indexing are those of any ``[rows, groups]`` tensor; only the memory order differs."""
    return torch.empty((groups, rows), dtype=dtype, device=device).t()


def as_format(fmt: Union[Format, str]) -> Format:
    """``"e4m3"`` / ``Format.E4M3`` -> ``Format.E4M3``: how every quantiser reads ``fmt``."""
    return fmt if isinstance(fmt, Format) else Format(str(fmt).lower())


@dataclass
class QuantizedTensor:
    """FP8 codes of a 2-D tensor plus the per-group ``scale_inv``.

    Attributes:
        data: FP8 codes, same shape as the source (``[rows, cols]``), groups along ``cols``.
        scale_inv: FP32 ``1/s`` per group, shape ``[ceil(rows/br), ceil(cols/bc)]`` (``[1, 1]``
            for a per-tensor scale).
        block: ``(br, bc)`` group shape, or ``None`` for one scale over the whole tensor.
        fmt: element format.
        amax: FP32 amax per group (same shape as ``scale_inv``); kept for delayed scaling and
            telemetry.
        scale_e8m0: for MXFP8, the scales as ``torch.float8_e8m0fnu`` (the bits a GEMM consumes).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Optional[Tuple[int, int]]
    fmt: Format
    amax: torch.Tensor
    scale_e8m0: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def expanded_scale_inv(self) -> torch.Tensor:
        """``scale_inv`` broadcast to the shape of ``data``."""
        rows, cols = self.data.shape
        if self.block is None:
            return self.scale_inv.reshape(1, 1).expand(rows, cols)
        return _expand(self.scale_inv, self.block, (rows, cols))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every code times its group's ``scale_inv``: computed in FP64 when ``dtype`` is FP64
        (exact), else in FP32, then cast to ``dtype``."""
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.data.to(ct) * self.expanded_scale_inv().to(ct)).to(dtype)

    def t(self) -> "QuantizedTensor":
        """The transposed view (codes and scale grid transposed; groups now along rows)."""
        return QuantizedTensor(
            data=self.data.t(),
            scale_inv=self.scale_inv.t(),
            block=None if self.block is None else (self.block[1], self.block[0]),
            fmt=self.fmt,
            amax=self.amax.t(),
            scale_e8m0=None if self.scale_e8m0 is None else self.scale_e8m0.t(),
        )


def _div_rn(num: float, den: torch.Tensor) -> torch.Tensor:
    """FP32 ``num / den``, correctly rounded (round to nearest even), computed as an FP64
    quotient rounded once to FP32. That is the same bits as an IEEE FP32 division: an FP64
    quotient carries 53 >= 2·24 + 2 significant bits, and at that margin rounding twice
    cannot differ from rounding once (Figueroa). Eager CPU/CUDA FP32 division and the Triton
    kernels' ``div_rn`` are correctly rounded already, but compiled code need not be (Inductor
    lowers FP32 ``/`` to Triton's approximate division on GPU by default); FP64 division is
    correctly rounded in every backend, so scales have the same bits eager and compiled."""
    return (float(num) / den.double()).float()


def accumulate_amax(acc: torch.Tensor, amax: torch.Tensor) -> None:
    """``acc = max(acc, amax)`` in place (NaN sticks, as the kernels' integer max of the IEEE
    bits does): how a pending delayed-scaling amax collects the amaxes of its uses."""
    torch.maximum(acc, amax.reshape(acc.shape).to(acc.dtype), out=acc)


def amax_to_scale(
    amax: torch.Tensor,
    fmt: Union[Format, str],
    rounding: Union[ScaleRounding, str] = ScaleRounding.FP32,
    margin: int = 0,
) -> torch.Tensor:
    """FP32 scale ``s`` from an FP32 amax, for the ``fp32`` and ``pow2`` rules.

    ``s = (fmax / amax) / 2**margin``; ``pow2`` rounds ``s`` down to a power of two (exactly:
    the mantissa bits are dropped). ``amax == 0`` gives 1; a tiny amax whose ``fmax/amax``
    overflows gives FLT_MAX (``2**127`` under ``pow2``); NaN amax gives NaN and Inf amax gives 0,
    so the group dequantises to NaN.
    """
    fmt = as_format(fmt)
    rounding = ScaleRounding(rounding)
    amax = amax.float()
    s = _div_rn(fmt.max, amax)
    if margin:
        s = s / float(2**margin)
    # torch.finfo inline, not a module-level float: torch.compile(dynamic=True) lifts a global
    # Python float to a graph input, which fails inside the FP8 linear's autograd function
    flt_max = torch.finfo(torch.float32).max
    s = torch.where(torch.isinf(s) & (amax >= 0), torch.full_like(s, flt_max), s)
    if rounding is ScaleRounding.POW2:
        mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
        p2 = torch.ldexp(torch.full_like(s, 0.5), exp)
        s = torch.where(torch.isfinite(s) & (s > 0), p2, s)
    elif rounding is not ScaleRounding.FP32:
        raise ValueError(f"amax_to_scale handles fp32/pow2 rounding, not {rounding.value}")
    return torch.where(amax == 0, torch.ones_like(s), s)


def e8m0_exponent(amax: torch.Tensor, fmt: Union[Format, str], rounding: Union[ScaleRounding, str]) -> torch.Tensor:
    """Unbiased exponent ``e`` of the MX scale ``scale_inv = 2**e`` for each group, as FP32
    (NaN for a non-finite amax), clamped to E8M0's ``[-127, 127]``.

    ``e8m0_ceil`` (NVIDIA/TE): the smallest ``e`` with ``amax <= fmax * 2**e`` — no element
    saturates. ``e8m0_floor`` (OCP MX v1.0): ``e = floor(log2(amax)) - emax`` — elements above
    ``fmax`` after scaling saturate. Both are computed from the exact binary exponent of amax
    (no rounded ``log2``), so kernels can reproduce them bit for bit. ``amax == 0`` gives 0.
    """
    fmt = as_format(fmt)
    rounding = ScaleRounding(rounding)
    amax = amax.float()
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1): floor(log2) = exp-1
    floor_log2 = (exp - 1).float()
    if rounding is ScaleRounding.E8M0_FLOOR:
        e = floor_log2 - fmt.emax
    elif rounding is ScaleRounding.E8M0_CEIL:
        # fmax = (fmax / 2**emax) * 2**emax with fmax / 2**emax in [1, 2) (1.75 for E4M3).
        # amax = (2*mant) * 2**floor_log2.  e = floor_log2 - emax works iff 2*mant <= 1.75.
        top = fmt.max / float(2**fmt.emax)
        e = floor_log2 - fmt.emax + (2.0 * mant > top).float()
    else:
        raise ValueError(f"e8m0_exponent handles e8m0_ceil/e8m0_floor, not {rounding.value}")
    e = e.clamp(-127.0, 127.0)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    return torch.where(torch.isfinite(amax), e, torch.full_like(e, float("nan")))


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` for FP32 ``e``: integers in ``[-127, 127]`` (the E8M0 exponents) are built from the
    exponent bits, so exact everywhere — ``2**-127`` is an FP32 subnormal, and CUDA's
    ``torch.exp2`` returns it one subnormal ulp low (measured on an H200: 5.877470352812973e-39
    for 5.877471754111438e-39), while the kernels write the exact value. Anything else (NaN, ±Inf,
    other values) goes to ``torch.exp2``."""
    ok = (e >= -127) & (e <= 127) & (e == torch.round(e))  # False for NaN
    ei = torch.where(ok, e, torch.zeros_like(e)).to(torch.int32)
    bits = torch.where(ei > -127, (ei + 127) << 23, torch.full_like(ei, 1 << 22))
    return torch.where(ok, bits.view(torch.float32), torch.exp2(e))


def cast_to_fp8(y: torch.Tensor, fmt: Union[Format, str]) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of FP32 ``y`` to FP8, keeping NaN (and, for E5M2,
    Inf). Finite values beyond ``±fmax`` clamp to ``±fmax``; E4M3 turns ±Inf into NaN."""
    fmt = as_format(fmt)
    y = y.float()
    clamped = y.clamp(-fmt.max, fmt.max)
    if fmt is Format.E4M3:
        nonfinite = torch.full_like(y, float("nan"))
    else:
        nonfinite = y
    return torch.where(torch.isfinite(y), clamped, nonfinite).to(fmt.dtype)


def _group_amax(x: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """Amax per ``block`` group of a 2-D tensor (trailing partial groups included). NaN in a
    group makes its amax NaN."""
    rows, cols = x.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    a = x.float().abs()
    pad_r, pad_c = gr * br - rows, gc * bc - cols
    if pad_r or pad_c:
        a = torch.nn.functional.pad(a, (0, pad_c, 0, pad_r))
    a = a.reshape(gr, br, gc, bc)
    amax = a.amax(dim=(1, 3))
    # torch's amax propagates NaN already; keep it explicit for readers and other backends.
    has_nan = torch.isnan(a).any(dim=3).any(dim=1)
    return torch.where(has_nan, torch.full_like(amax, float("nan")), amax)


def _expand(g: torch.Tensor, block: Tuple[int, int], shape) -> torch.Tensor:
    rows, cols = shape
    return g.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize_tensorwise(
    x: torch.Tensor,
    fmt: Union[Format, str],
    rounding: Union[ScaleRounding, str] = ScaleRounding.FP32,
    scale: Optional[torch.Tensor] = None,
) -> QuantizedTensor:
    """One scale for the whole 2-D tensor.

    ``scale=None``: current scaling, ``s`` from this tensor's amax (``tensorwise``). Given a
    ``scale`` (delayed scaling: computed from the amax history), it is used as is; the returned
    ``amax`` is this tensor's, for the history.
    """
    fmt = as_format(fmt)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    # amax propagates NaN (torch's max does), so a NaN input poisons the scale: no host sync
    amax = x2.float().abs().amax().reshape(1, 1) if x2.numel() else torch.zeros(1, 1, device=x.device)
    s = amax_to_scale(amax, fmt, rounding) if scale is None else scale.float().reshape(1, 1)
    data = cast_to_fp8(x2.float() * s, fmt)
    return QuantizedTensor(data=data, scale_inv=_div_rn(1.0, s), block=None, fmt=fmt, amax=amax)


def quantize_blocks(
    x: torch.Tensor,
    fmt: Union[Format, str],
    block: Tuple[int, int],
    rounding: Union[ScaleRounding, str],
) -> QuantizedTensor:
    """One scale per ``block = (br, bc)`` group of a 2-D tensor, from the group's own amax.

    ``rounding``: ``fp32`` / ``pow2`` give FP32 scales (blockwise recipe: 1x128, 128x128);
    ``e8m0_ceil`` / ``e8m0_floor`` give power-of-two E8M0 scales (MXFP8: 1x32).
    """
    fmt = as_format(fmt)
    rounding = ScaleRounding(rounding)
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    amax = _group_amax(x, block)
    scale_e8m0 = None
    if rounding in (ScaleRounding.E8M0_CEIL, ScaleRounding.E8M0_FLOOR):
        e = e8m0_exponent(amax, fmt, rounding)
        scale_inv = exp2_int(e)
        scale_e8m0 = scale_inv.to(torch.float8_e8m0fnu)
        s = exp2_int(-e)
    else:
        s = amax_to_scale(amax, fmt, rounding)
        scale_inv = _div_rn(1.0, s)
    data = cast_to_fp8(x.float() * _expand(s, block, x.shape), fmt)
    return QuantizedTensor(data=data, scale_inv=scale_inv, block=block, fmt=fmt, amax=amax, scale_e8m0=scale_e8m0)


def quantize(
    x: torch.Tensor,
    fmt: Union[Format, str],
    granularity: Union[Granularity, str],
    rounding: Union[ScaleRounding, str] = ScaleRounding.FP32,
    dim: int = -1,
    scale: Optional[torch.Tensor] = None,
) -> QuantizedTensor:
    """Quantise a 2-D tensor with groups laid along ``dim`` (the contraction dim).

    ``dim=-1`` (or 1): groups along each row (1x128, 1x32). ``dim=0``: groups along each
    column (128x1, 32x1 tiles of the row-major tensor) — the wgrad copy; the result is returned
    for ``x.t()``, i.e. with the groups along its last dim, ready to feed a GEMM that contracts
    over ``x``'s first dim. 128x128 blocks and per-tensor scales are symmetric; ``dim`` then only
    decides the orientation of the returned codes.
    """
    granularity = Granularity(granularity)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if dim in (0, -2):
        x = x.t()
    elif dim not in (1, -1):
        raise ValueError(f"dim must be 0 or -1 for a 2-D tensor, got {dim}")
    if granularity is Granularity.TENSOR:
        return quantize_tensorwise(x, fmt, rounding, scale=scale)
    if scale is not None:
        raise ValueError("an explicit scale (delayed scaling) is only defined per tensor")
    return quantize_blocks(x, fmt, granularity.block, rounding)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same as ``q.dequantize(dtype)``."""
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor,
    fmt: Union[Format, str],
    granularity: Union[Granularity, str],
    rounding: Union[ScaleRounding, str] = ScaleRounding.FP32,
    dim: int = -1,
) -> torch.Tensor:
    """Quantise then dequantise (FP32), in ``x``'s orientation — for numerics studies."""
    q = quantize(x, fmt, granularity, rounding, dim=dim)
    out = q.dequantize()
    return out.t() if dim in (0, -2) else out


def quantization_stats(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Telemetry of one quantisation, as an FP32 tensor ``[amax, mean_scale, underflow_frac,
    saturated_frac, sqnr_db]`` (no host sync).

    ``x`` is the 2-D source in the orientation of ``q`` (groups along its last dim).
    underflow = non-zero inputs that became zero codes; saturated = inputs whose scaled magnitude
    exceeded what rounding alone would map to ``±fmax`` (:attr:`Format.clamp_threshold`: 464 for
    E4M3) and so lost precision to the clamp — an amax element that lands an ulp above 448
    because its FP32 scale was rounded is not counted; SQNR = 10·log10(Σx² / Σ(x − x̂)²) over
    finite elements.
    """
    xf = x.float()
    deq = q.dequantize()
    finite = torch.isfinite(xf)
    n = max(xf.numel(), 1)
    underflow = ((xf != 0) & (q.data.float() == 0)).sum() / n
    limit = q.fmt.clamp_threshold * q.expanded_scale_inv()
    saturated = (finite & (xf.abs() > limit)).sum() / n
    sig = torch.where(finite, xf, torch.zeros_like(xf)).pow(2).sum()
    err = torch.where(finite, xf - deq, torch.zeros_like(xf)).pow(2).sum()
    sqnr = 10.0 * torch.log10(sig.clamp_min(1e-30) / err.clamp_min(1e-30))
    amax = torch.where(torch.isfinite(q.amax), q.amax, torch.zeros_like(q.amax)).max()
    scale = (1.0 / q.scale_inv.float()).mean()
    return torch.stack([amax, scale, underflow.float(), saturated.float(), sqnr]).float()


STAT_NAMES = ("amax", "scale", "underflow_frac", "saturated_frac", "sqnr_db")


def summarize_stats(stats: torch.Tensor) -> Dict[str, float]:
    """Rows of :func:`quantization_stats` (``[n, 5]``) as one ``{stat: value}``: the largest amax,
    the mean of every other statistic."""
    st = stats.float().cpu()
    out = {name: float(st[:, k].mean()) for k, name in enumerate(STAT_NAMES)}
    out["amax"] = float(st[:, 0].max())
    return out
