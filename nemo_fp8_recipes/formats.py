"""The terms every FP8 recipe is written in: element formats (E4M3, E5M2), how a scale is rounded,
the shape of a scaling group, and the accumulation setting of one GEMM. The quantisers and
kernels (:mod:`nemo_fp8_recipes.quant`) work in these terms; :mod:`nemo_fp8_recipes.recipes`
combines them into recipes and re-exports them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["Format", "ScaleRounding", "Granularity", "GemmConfig"]


class Format(str, enum.Enum):
    """FP8 element formats. ``e4m3`` = ``torch.float8_e4m3fn`` (max 448, no inf), ``e5m2`` =
    ``torch.float8_e5m2`` (max 57344, has inf)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        return 448.0 if self is Format.E4M3 else 57344.0

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (8 for E4M3, 15 for E5M2);
        the OCP MX ``floor`` scale rule subtracts it."""
        return 8 if self is Format.E4M3 else 15

    @property
    def clamp_threshold(self) -> float:
        """Largest magnitude that round-to-nearest-even would put on ``±max`` anyway: ``max``
        plus half its step (464 for E4M3, 61440 for E5M2). Only values beyond it lose anything
        to the saturating clamp."""
        return 464.0 if self is Format.E4M3 else 61440.0


class ScaleRounding(str, enum.Enum):
    """How a scale is rounded once computed from an amax.

    ``fp32``: keep ``fmax / amax`` as an FP32 number. ``pow2``: round the scale *down* to a
    power of two (so ``x * s`` never exceeds ``fmax``; TE's blockwise default).
    ``e8m0_ceil``: MXFP8 scale ``2^ceil(log2(amax / fmax))`` stored as E8M0 (TE/NVIDIA; no element
    saturates). ``e8m0_floor``: OCP MX v1.0 rule ``2^(floor(log2(amax)) - emax)``; elements above
    ``fmax`` after scaling saturate to ``fmax``.
    """

    FP32 = "fp32"
    POW2 = "pow2"
    E8M0_CEIL = "e8m0_ceil"
    E8M0_FLOOR = "e8m0_floor"


class Granularity(str, enum.Enum):
    """Scaling-group shapes. Tiles are laid along the contraction dim of the consuming GEMM."""

    TENSOR = "tensor"  # one scale for the whole tensor
    TILE_1x128 = "1x128"  # one scale per 128 consecutive elements along the contraction dim
    BLOCK_128x128 = "128x128"  # one scale per 128x128 block (weights, blockwise recipe)
    BLOCK_1x32 = "1x32"  # one E8M0 scale per 32 consecutive elements along the contraction dim

    @property
    def block(self) -> Optional[Tuple[int, int]]:
        """(rows, cols) of a scaling group with the contraction dim last, or None for a tensor."""
        return {
            Granularity.TENSOR: None,
            Granularity.TILE_1x128: (1, 128),
            Granularity.BLOCK_128x128: (128, 128),
            Granularity.BLOCK_1x32: (1, 32),
        }[self]


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Per-GEMM settings. ``fast_accum=True`` lets Hopper tensor cores accumulate FP8 products
    in reduced precision without periodic FP32 promotion (TE's default for per-tensor fprop
    only); ``False`` is the "split accumulator" mode that promotes to FP32."""

    fast_accum: bool = False
