"""FP8 telemetry of the native backend: per-operand quantisation statistics collected by the FP8
linears and the grouped MoE experts, aggregated per layer group (the same tags as the Transformer
Engine hooks)."""

from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from ..policy import Role
from .gemms import OPERANDS
from .grouped import fp8_state_modules

__all__ = ["collect_telemetry", "set_telemetry", "telemetry_combine", "telemetry_group"]

#: How a statistic is combined over the modules of a group, over calls and over ranks: the largest
#: amax, the worst expert's fractions (largest) and SQNR (smallest), the mean of everything else.
_COMBINE = {"amax": "max", "underflow_frac_worst": "max", "saturated_frac_worst": "max", "sqnr_db_worst": "min"}


def telemetry_combine(key: str) -> str:
    """How the statistic of a telemetry key (``fp8/<group>/<operand>/<stat>`` or the bare stat) is
    combined over modules, calls and data-parallel ranks: ``"max"``, ``"min"`` or ``"mean"``."""
    return _COMBINE.get(key.rsplit("/", 1)[-1], "mean")


def set_telemetry(model: nn.Module, enabled: bool = True) -> None:
    """Make every Float8Linear and grouped experts module record quantisation statistics (amax,
    scale, underflow, saturation, SQNR) of its operands, or stop (dropping what was not
    collected). Costs extra passes over each operand: use an interval. A thin wrapper,
    ``reconfigure(telemetry=enabled)`` on each; a run that records from the start passes
    ``convert_model(..., telemetry=True)``."""
    for m in fp8_state_modules(model).values():
        m.reconfigure(telemetry=bool(enabled))


def telemetry_group(fqn: str, role: str) -> str:
    """The layer group a module's FP8 telemetry is logged under (``fp8/<group>/...``): experts,
    shared_expert, attention, mlp, or the role itself. Both backends group with it, so a native and
    a Transformer Engine run log the same tags."""
    parts = fqn.split(".")
    if "experts" in parts or "local_experts" in parts:
        return "experts"
    if "shared_expert" in parts or "shared_experts" in parts:
        return "shared_expert"
    if role == Role.ATTENTION_PROJECTION:
        return "attention"
    if role == Role.MLP:
        return "mlp"
    return role


def collect_telemetry(model: nn.Module, reset: bool = True) -> Dict[str, float]:
    """Flat ``{"fp8/<group>/<operand>/<stat>": value}`` aggregated per layer group (attention,
    mlp, experts, shared_expert, ...) since the last call: amax is the max, the other stats
    (scale, underflow_frac, saturated_frac, sqnr_db) the mean over modules and calls. Delayed
    scaling adds ``scale_pinned``: the fraction of the group's modules whose amax history holds a
    non-finite value, which holds their scale where it is until it ages out.

    Grouped experts (:class:`~nemo_fp8_recipes.nn.Float8GroupedExperts`) count as one module each
    whose stats are the mean over their experts' quantisations (amax: the max), and add the worst
    expert of the group: ``underflow_frac_worst`` and ``saturated_frac_worst`` (the largest of an
    expert's mean) and ``sqnr_db_worst`` (the smallest), since one expert whose scale went wrong
    (a rarely routed one, or one whose delayed-scaling history is stale) disappears in a mean over
    many; :meth:`Float8GroupedExperts.pop_telemetry(per_expert=True)
    <nemo_fp8_recipes.nn.Float8GroupedExperts.pop_telemetry>` names it."""
    from .scaling import pinned_scales

    acc: Dict[str, List[float]] = {}
    pinned = pinned_scales(model)
    for name, m in fp8_state_modules(model).items():
        tel = m.pop_telemetry() if reset else {}
        group = telemetry_group(m.fqn, m.role)
        for operand, stats in tel.items():
            for stat, v in stats.items():
                acc.setdefault(f"fp8/{group}/{operand}/{stat}", []).append(v)
        if m.recipe.is_delayed:
            for operand in OPERANDS:
                acc.setdefault(f"fp8/{group}/{operand}/scale_pinned", []).append(float(operand in pinned.get(name, ())))
    out = {}
    for k, vs in acc.items():
        how = telemetry_combine(k)
        out[k] = max(vs) if how == "max" else min(vs) if how == "min" else sum(vs) / len(vs)
    return out
