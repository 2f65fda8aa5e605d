"""``audit``: what the precision policy decided for every module of a converted model, and what
actually ran — fprop/dgrad/wgrad GEMMs counted per module in FP8 and in high precision."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch.nn as nn

from ..policy import HIGH_PRECISION_ROLES
from .convert import conversion_state, hp_gemm_counts
from .grouped import grouped_fp8_modules
from .linear import fp8_modules

__all__ = ["AuditReport", "AuditRow", "PolicyViolation", "audit"]


class PolicyViolation(RuntimeError):
    """A module with a high-precision role ran a GEMM in FP8, or a grouped GEMM module that the
    policy put in FP8 could not be converted (strict audit)."""


@dataclass
class AuditRow:
    name: str
    role: str
    precision: str
    reason: str
    fp8_gemms: Dict[str, int]
    hp_gemms: Dict[str, int]


@dataclass
class AuditReport:
    """What the policy decided for every module, and what actually ran.

    ``rows``: one per classified module. ``counts``: totals of GEMMs run, as
    ``{"fp8": {"fprop": n, "dgrad": n, "wgrad": n}, "high_precision": {...}}``.
    ``violations``: high-precision-role modules that ran a GEMM in FP8.
    ``unplaced``: grouped GEMM modules (3-D expert weights) the policy put in FP8 that
    ``convert_model`` could not convert (no recognised layout, no ``swaps`` factory), by name
    with the reason.
    ``stale_weight_caches``: FP8 linears whose compiled-path weight cache
    (:func:`set_graph_weight_cache`) is older than their weight — written in place outside an
    optimizer step or ``load_state_dict`` without :func:`invalidate_weight_cache`, so a compiled
    forward would read the old codes. ``fp8``: whether the recipe runs any GEMM in FP8 (False for
    bf16).
    """

    recipe: str
    emulated: bool
    rows: List[AuditRow]
    counts: Dict[str, Dict[str, int]]
    violations: List[str]
    stale_weight_caches: List[str] = field(default_factory=list)
    kernel_options: Dict[str, bool] = field(default_factory=dict)
    fp8: bool = True
    unplaced: Dict[str, str] = field(default_factory=dict)

    def computed_in(self, dtype: str) -> "AuditReport":
        """This report with the high-precision modules' ``bf16`` read as ``dtype`` (``"fp32"`` for a
        run without BF16 autocast, where they compute in FP32): the policy decides FP8 or not, the
        run's autocast decides the rest."""
        import dataclasses

        rows = [dataclasses.replace(r, precision=dtype) if r.precision == "bf16" else r for r in self.rows]
        return dataclasses.replace(self, rows=rows)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self, max_rows: Optional[int] = None) -> str:
        """A fixed-width text table (name, role, precision, GEMMs run in FP8 / high precision,
        reason) followed by the totals."""
        hdr = ("module", "role", "precision", "fp8 f/d/w", "hp f/d/w", "reason")
        body = []
        for r in self.rows[: max_rows or len(self.rows)]:
            f = r.fp8_gemms
            h = r.hp_gemms
            body.append(
                (
                    r.name,
                    r.role,
                    r.precision,
                    f"{f.get('fprop', 0)}/{f.get('dgrad', 0)}/{f.get('wgrad', 0)}" if f else "-",
                    f"{h.get('fprop', 0)}/{h.get('dgrad', 0)}/{h.get('wgrad', 0)}" if h else "-",
                    r.reason,
                )
            )
        widths = [max(len(str(x[i])) for x in [hdr] + body) for i in range(len(hdr))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(hdr, widths)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        for row in body:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if max_rows and len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more modules")
        if self.stale_weight_caches:
            lines.append(
                "STALE compiled FP8 weight cache (weight written in place since its last "
                "refresh; call invalidate_weight_cache): " + ", ".join(self.stale_weight_caches)
            )
        c8, ch = self.counts["fp8"], self.counts["high_precision"]
        mode = "no FP8" if not self.fp8 else ("emulated" if self.emulated else "real FP8 GEMMs")
        lines.append(
            f"recipe {self.recipe} ({mode}): GEMMs run in FP8 fprop/dgrad/wgrad = "
            f"{c8['fprop']}/{c8['dgrad']}/{c8['wgrad']}; in high precision = "
            f"{ch['fprop']}/{ch['dgrad']}/{ch['wgrad']}"
        )
        if self.kernel_options:
            lines.append(
                "kernel options: " + " ".join(f"{k}={'on' if v else 'off'}" for k, v in self.kernel_options.items())
            )
        if self.unplaced:
            lines.append("GROUPED GEMMs NOT CONVERTED (kept in high precision): " + ", ".join(self.unplaced))
        if self.violations:
            lines.append("POLICY VIOLATIONS (high-precision role ran in FP8): " + ", ".join(self.violations))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def audit(model: nn.Module, strict: bool = False) -> AuditReport:
    """Per-module decisions plus per-GEMM counts of what ran since conversion (or the last
    :func:`reset_gemm_counts`). ``strict=True`` raises :class:`PolicyViolation` if a module
    whose role must stay in high precision ran a GEMM in FP8, or if a grouped GEMM module the
    policy puts in FP8 could not be converted (:attr:`AuditReport.unplaced`)."""
    state = conversion_state(model)
    if state is None:
        raise RuntimeError("audit() needs a model converted with convert_model()")
    fp8 = fp8_modules(model)
    by_fqn = {m.fqn: m for m in (*fp8.values(), *grouped_fp8_modules(model).values())}
    rows, violations = [], []
    tot8 = {"fprop": 0, "dgrad": 0, "wgrad": 0}
    toth = dict(tot8)
    for fqn, d in state.decisions.items():
        m = by_fqn.get(fqn)
        f = dict(m.gemm_counts) if m is not None else {}
        h = hp_gemm_counts(state.hp_modules[fqn]) if fqn in state.hp_modules else {}
        for k in tot8:
            tot8[k] += f.get(k, 0)
            toth[k] += h.get(k, 0)
        if d.role in HIGH_PRECISION_ROLES and sum(f.values()) > 0:
            violations.append(fqn)
        rows.append(AuditRow(fqn, d.role, "fp8" if m is not None else d.precision, d.reason, f, h))
    stale = [m.fqn for m in fp8.values() if m.graph_weight_cache_stale()]
    report = AuditReport(
        recipe=state.recipe.name,
        emulated=state.emulate,
        rows=rows,
        counts={"fp8": tot8, "high_precision": toth},
        violations=violations,
        stale_weight_caches=stale,
        kernel_options=state.options.as_dict(),
        fp8=state.recipe.is_fp8,
        unplaced=dict(state.unplaced),
    )
    if strict and violations:
        raise PolicyViolation(
            "high-precision roles ran in FP8: "
            + ", ".join(violations)
            + " (remove them from policy.include, or run without strict)"
        )
    if strict and state.unplaced:
        raise PolicyViolation(
            "grouped GEMM modules the policy puts in FP8 were left in high precision: "
            + "; ".join(f"{k}: {v}" for k, v in state.unplaced.items())
        )
    if strict and stale:
        raise RuntimeError(
            "compiled FP8 weight cache older than the weight (written in place outside an optimizer step "
            "or load_state_dict): " + ", ".join(stale) + "; call nemo_fp8_recipes.nn.invalidate_weight_cache(model)"
        )
    return report
