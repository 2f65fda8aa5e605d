"""An independent, deliberately naive FP8 reference for the tests (float64, loops over groups).

It shares no code with ``nemo_fp8_recipes.quant``: FP8 rounding is done by searching the table
of every finite FP8 value (round to nearest, ties to the even code), scales are computed in
float64 from the contract's formulas and only then rounded to FP32 where the contract says so.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EMAX = {"e4m3": 8, "e5m2": 15}


def _grid(fmt: str):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(DTYPE[fmt])
    vals = codes.to(torch.float64).numpy()
    ok = np.isfinite(vals)
    vals, idx = vals[ok], np.arange(256)[ok]
    order = np.argsort(vals, kind="stable")
    vals, idx = vals[order], idx[order]
    # drop the duplicate -0.0 so the grid is strictly increasing
    keep = np.concatenate([[True], np.diff(vals) > 0])
    return vals[keep], idx[keep]


_GRIDS = {}


def round_fp8(y: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating round-to-nearest-even onto the FP8 grid; NaN stays NaN; Inf -> NaN for E4M3,
    Inf for E5M2."""
    if fmt not in _GRIDS:
        _GRIDS[fmt] = _grid(fmt)
    vals, codes = _GRIDS[fmt]
    y = np.asarray(y, dtype=np.float64)
    fmax = FMAX[fmt]
    finite = np.isfinite(y)
    v = np.clip(np.where(finite, y, 0.0), -fmax, fmax)
    j = np.clip(np.searchsorted(vals, v), 1, len(vals) - 1)
    lo, hi = vals[j - 1], vals[j]
    exact_hi = hi == v
    d_lo, d_hi = v - lo, hi - v
    even_lo = codes[j - 1] % 2 == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & even_lo)
    r = np.where(exact_hi, hi, np.where(pick_lo, lo, hi))
    r = np.where(lo == v, lo, r)
    nonfinite = np.where(np.isnan(y), np.nan, np.nan if fmt == "e4m3" else y)
    return np.where(finite, r, nonfinite)


def scale_for(amax: float, fmt: str, rounding: str, margin: int = 0) -> float:
    """Contract scale s (quantised value = x * s); returns float64 holding an FP32 value."""
    fmax = FMAX[fmt]
    if math.isnan(amax):
        return math.nan
    if amax == 0:
        return 1.0
    if rounding in ("fp32", "pow2"):
        s = float(np.float32(np.float32(fmax) / np.float32(amax)))  # FP32 division, as the contract
        if margin:
            s = float(np.float32(s / 2.0**margin))
        if math.isinf(s):
            s = float(np.finfo(np.float32).max)
        if rounding == "pow2" and s > 0:
            s = 2.0 ** math.floor(math.log2(s))
        return s
    # E8M0: scale_inv = 2**e
    if math.isinf(amax):
        return math.nan
    if rounding == "e8m0_ceil":
        e = math.ceil(math.log2(amax / fmax))  # float64 is exact enough for these tests' values
        # guard against log2 rounding: smallest e with amax <= fmax * 2**e
        while amax > fmax * 2.0**e:
            e += 1
        while e > -127 and amax <= fmax * 2.0 ** (e - 1):
            e -= 1
    else:
        e = math.floor(math.log2(amax)) - EMAX[fmt]
        while 2.0 ** (e + EMAX[fmt]) > amax:
            e -= 1
        while 2.0 ** (e + 1 + EMAX[fmt]) <= amax:
            e += 1
    e = max(-127, min(127, e))
    return 2.0 ** (-e)


def quantize_groups(x: torch.Tensor, fmt: str, block, rounding: str, scale=None):
    """Fake-quantise a 2-D tensor in float64, groups of ``block`` (None = whole tensor).
    Returns (dequantised float64 array, scale-per-group array, FP8 code values array)."""
    a = x.detach().to(torch.float64).numpy()
    R, C = a.shape
    br, bc = (R, C) if block is None else block
    out = np.empty_like(a)
    codes = np.empty_like(a)
    scales = np.empty((-(-R // br), -(-C // bc)))
    for gi, r0 in enumerate(range(0, R, br)):
        for gj, c0 in enumerate(range(0, C, bc)):
            g = a[r0 : r0 + br, c0 : c0 + bc]
            amax = float(np.nan if np.isnan(g).any() else np.abs(g).max())
            s = scale_for(amax, fmt, rounding) if scale is None else float(scale)
            scales[gi, gj] = s
            y = (g.astype(np.float32) * np.float32(s)).astype(np.float64) if math.isfinite(s) else g * s
            q = round_fp8(y, fmt)
            sinv = (
                float(np.float32(1.0) / np.float32(s))
                if s not in (0.0,) and math.isfinite(s)
                else (math.inf if s == 0 else math.nan)
            )
            out[r0 : r0 + br, c0 : c0 + bc] = q * sinv
            codes[r0 : r0 + br, c0 : c0 + bc] = q
    return out, scales, codes


def structured(rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Test input with structure: row magnitudes spread over 1e-3..1e3, a few outlier channels
    (columns x50), and heavy tails — not only randn."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    row_mag = torch.logspace(-3, 3, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    col_mag = torch.ones(cols, dtype=torch.float64)
    out_cols = torch.randperm(cols, generator=g)[: max(1, cols // 64)]
    col_mag[out_cols] = 50.0
    chi2 = (torch.randn(3, rows, cols, generator=g, dtype=torch.float64) ** 2).sum(0) / 3.0
    tails = (torch.randn(rows, cols, generator=g, dtype=torch.float64) / chi2.sqrt()).clamp(-30, 30)
    x = (0.7 * base + 0.3 * tails) * row_mag[:, None] * col_mag[None, :]
    return x.to(dtype)


#: The numerics contract per recipe (docs/recipes.md), as the reference tests read it.
# per recipe: (X fmt, W fmt, dY fmt, X/dY group along contraction, W group along K, W group along N, rounding)
CONTRACT = {
    "delayed": ("e4m3", "e4m3", "e5m2", None, None, None, "fp32"),
    "tensorwise": ("e4m3", "e4m3", "e5m2", None, None, None, "fp32"),
    "blockwise": ("e4m3", "e4m3", "e4m3", 128, (128, 128), (128, 128), "pow2"),
    "mxfp8": ("e4m3", "e4m3", "e4m3", 32, (1, 32), (32, 1), "e8m0_ceil"),
}


def fake_quantize(t, fmt, block, rounding, scale=None):
    """``t`` quantised per the contract and dequantised (float64)."""
    return quantize_groups(t, fmt, block, rounding, scale=scale)[0]


def contract_reference(name, x, w, dy, scales=None):
    """fprop/dgrad/wgrad computed from operands fake-quantised per the contract, in float64."""
    xf, wf, gf, tile, wk, wn, rnd = CONTRACT[name]
    s = scales or {}
    row = None if tile is None else (1, tile)  # groups along the last dim
    col = None if tile is None else (tile, 1)  # groups along the first dim (wgrad copies)
    y = fake_quantize(x, xf, row, rnd, s.get("x")) @ fake_quantize(w, wf, wk, rnd, s.get("w")).T
    dx = fake_quantize(dy, gf, row, rnd, s.get("g")) @ fake_quantize(w, wf, wn, rnd, s.get("w"))
    dw = fake_quantize(dy, gf, col, rnd, s.get("g")).T @ fake_quantize(x, xf, col, rnd, s.get("x"))
    return y, dx, dw
