"""The delayed-scaling update rule (TE's): append the pending amax to the history, take
``amax = max(history)`` (or the most recent entry), ``scale = fmax / amax / 2**margin`` (``pow2``
rounding if the recipe asks); a zero or non-finite amax keeps the previous scale. Vectorised over
modules and operands; :mod:`nemo_fp8_recipes.nn.scaling` decides when it runs."""

from __future__ import annotations

from typing import Sequence

import torch

from .reference import amax_to_scale

__all__ = ["advance_delayed_scaling"]


@torch.no_grad()
def advance_delayed_scaling(
    history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, flag: torch.Tensor, fmts: Sequence, recipe
):
    """New ``(history, scale)`` after appending ``pending`` where ``flag`` is set.

    Shapes: ``history [..., k, L]``, ``scale``/``pending``/``flag`` ``[..., k]`` with
    ``k == len(fmts)`` (the FP8 format of each operand column). Entries whose flag is 0 keep
    their history and scale. Vectorised: one call updates every module of a model.
    """
    f = flag > 0
    rolled = torch.cat([pending.unsqueeze(-1).to(history.dtype), history[..., :-1]], dim=-1)
    hist = torch.where(f.unsqueeze(-1), rolled, history)
    amax = hist.amax(-1) if recipe.amax_compute_algo == "max" else hist[..., 0]
    new = torch.stack(
        [amax_to_scale(amax[..., i], fmt, recipe.scale_rounding, margin=recipe.margin) for i, fmt in enumerate(fmts)],
        dim=-1,
    )
    ok = torch.isfinite(amax) & (amax > 0) & f
    return hist, torch.where(ok, new, scale)
