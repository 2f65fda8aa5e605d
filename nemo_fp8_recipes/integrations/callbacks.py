"""Transformer Engine run-time hooks: apply the policy, audit it, log telemetry.

The Megatron/TE path decides precision in configs (:func:`~.megatron.megatron_config`); these
hooks *enforce and prove* it on the live model, the way :func:`nemo_fp8_recipes.audit` does for
the native backend:

* **policy** — every top-level TE module whose policy decision is not FP8 (attention core,
  ``exclude`` patterns, BF16 attention projections, first/last layers) runs inside
  ``te.autocast(enabled=False)``;
* **audit** — on entry to every TE module (inside the policy wrapper) we record whether FP8
  autocast was on and under which TE recipe; :meth:`TEPrecisionHooks.report` lists per module
  what ran and flags modules whose run contradicts the policy (``strict`` raises
  :class:`~nemo_fp8_recipes.nn.PolicyViolation`);
* **telemetry** — per layer group, the amax of the module inputs and, for delayed scaling, the
  scales and amax histories TE keeps in ``fp8_meta``; written to TensorBoard.

:class:`TEPrecisionHooks` is framework-neutral. :func:`lightning_callback` (NeMo 2.x) and
:func:`bridge_callback` (Megatron-Bridge ``pretrain(..., callbacks=[...])``) wrap it. The TE
state probe, the disabling context and the TE-module test are injectable, so the mechanism is
tested on a real Megatron module tree without TE.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..nn import PolicyViolation
from ..policy import PrecisionPolicy
from ..recipes import Recipe, get_recipe
from .te import is_te_module

__all__ = [
    "TEPrecisionHooks",
    "TEAuditRow",
    "TEAuditReport",
    "te_fp8_state",
    "lightning_callback",
    "bridge_callback",
    "write_audit",
]

log = logging.getLogger(__name__)
_WRAP_ATTR = "_nemo_fp8_te_wrapped"


def te_fp8_state() -> Tuple[bool, Optional[str]]:
    """``(FP8 autocast on?, TE recipe class name)`` from Transformer Engine's global state."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8 kept it in fp8.py
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    on = bool(FP8GlobalStateManager.is_fp8_enabled())
    return on, (type(FP8GlobalStateManager.get_fp8_recipe()).__name__ if on else None)


def _te_disable_ctx():
    from .te import te_autocast

    return te_autocast(None, enabled=False)


@dataclass
class TEAuditRow:
    """One top-level TE module: the policy decision and what ran."""

    name: str
    role: str
    decision: str
    reason: str
    calls: int = 0
    fp8_calls: int = 0
    te_recipes: List[str] = field(default_factory=list)


@dataclass
class TEAuditReport:
    """Audit of a TE model: rows, violations (policy said BF16/FP32, module ran with FP8 on) and
    modules the policy put in FP8 that ran with FP8 off (``fp8_off``: e.g. no autocast at all)."""

    recipe: str
    rows: List[TEAuditRow]
    violations: List[str]
    fp8_off: List[str]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        hdr = ("module", "role", "policy", "calls", "fp8 calls", "TE recipe", "reason")
        body = [
            (r.name, r.role, r.decision, str(r.calls), str(r.fp8_calls), ",".join(r.te_recipes) or "-", r.reason)
            for r in self.rows
        ]
        w = [max(len(x[i]) for x in [hdr] + body) for i in range(len(hdr))]
        lines = ["  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)).rstrip(), "  ".join("-" * x for x in w)]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in body]
        ran8 = sum(r.fp8_calls for r in self.rows)
        lines.append(
            f"recipe {self.recipe}: {ran8} TE module calls in FP8, "
            f"{sum(r.calls for r in self.rows) - ran8} in high precision"
        )
        if self.violations:
            lines.append("POLICY VIOLATIONS (ran with FP8 on): " + ", ".join(self.violations))
        if self.fp8_off:
            lines.append("FP8 expected but off: " + ", ".join(self.fp8_off))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _chunks(model: Union[nn.Module, Iterable[nn.Module]]) -> List[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _strip_wrappers(name: str) -> str:
    # Megatron/NeMo wrap the model (DDP -> Float16Module -> GPTModel): drop wrapper prefixes so
    # names match the policy's (and Megatron's te-precision-config) module paths.
    parts = name.split(".")
    while parts and parts[0] in ("module", "model", "_orig_mod"):
        parts = parts[1:]
    return ".".join(parts)


class TEPrecisionHooks:
    """Policy enforcement, audit and telemetry on the top-level TE modules of a model.

    Args:
        recipe: the registry recipe (for the report and the policy's shape check).
        policy: the precision policy (default: :class:`PrecisionPolicy`).
        strict: :meth:`check` raises :class:`PolicyViolation` on a violation.
        telemetry: record input amax per module (an extra reduction per call).
        is_te: which modules to hook (default: classes from ``transformer_engine``).
        fp8_state: ``() -> (fp8 on, recipe name)`` (default: TE's global state).
        disable_fp8: ``() -> context manager`` that turns FP8 off (default:
            ``te.autocast(enabled=False)``).
    """

    def __init__(
        self,
        recipe: Union[str, Recipe],
        policy: Optional[PrecisionPolicy] = None,
        *,
        strict: bool = False,
        telemetry: bool = False,
        is_te: Optional[Callable[[nn.Module], bool]] = None,
        fp8_state: Optional[Callable[[], Tuple[bool, Optional[str]]]] = None,
        disable_fp8: Optional[Callable[[], Any]] = None,
    ) -> None:
        self.recipe = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
        self.policy = policy or PrecisionPolicy()
        self.strict = strict
        self.telemetry = telemetry
        self.is_te = is_te or is_te_module
        self.fp8_state = fp8_state or te_fp8_state
        self.disable_fp8 = disable_fp8 or _te_disable_ctx
        self.rows: Dict[str, TEAuditRow] = {}
        self._modules: Dict[str, nn.Module] = {}
        self._amax: Dict[str, float] = {}

    # ---- attach / detach ------------------------------------------------------------------------
    def attach(self, model: Union[nn.Module, Iterable[nn.Module]]) -> "TEPrecisionHooks":
        """Wrap the forward of every top-level TE module of ``model`` (a module or Megatron's list
        of model chunks). Idempotent per module."""
        for chunk in _chunks(model):
            n_layers = None
            names = [_strip_wrappers(n) for n, _ in chunk.named_modules()]
            from ..policy import layer_index

            idx = [layer_index(n) for n in names]
            idx = [i for i in idx if i is not None]
            if idx:
                n_layers = max(idx) + 1
            pol = self.policy.with_num_layers(n_layers)
            covered: List[str] = []
            for raw, m in chunk.named_modules():
                if not raw or not self.is_te(m):
                    continue
                if any(raw.startswith(c + ".") for c in covered):
                    continue  # nested inside a TE module already hooked
                covered.append(raw)
                name = _strip_wrappers(raw)
                w = getattr(m, "weight", None)
                shape = tuple(w.shape) if isinstance(w, torch.Tensor) and w.dim() == 2 else None
                # Fused LayerNorm+Linear TE classes (TELayerNormColumnParallelLinear) carry "Norm" in
                # their class name, which the policy's class rule would read as a norm: classify
                # those GEMMs by module name.
                probe = None if type(m).__name__.endswith("Linear") and "Norm" in type(m).__name__ else m
                d = pol.decide(name, probe, recipe=self.recipe, shape=shape)
                self.rows[name] = TEAuditRow(name, d.role, d.precision, d.reason)
                self._wrap(name, m, fp8_allowed=d.fp8)
                self._modules[name] = m
        return self

    def _wrap(self, name: str, m: nn.Module, fp8_allowed: bool) -> None:
        if getattr(m, _WRAP_ATTR, False):
            return
        orig = m.forward
        hooks = self

        def forward(*args, **kwargs):
            ctx = contextlib.nullcontext() if fp8_allowed else hooks.disable_fp8()
            with ctx:
                hooks._record(name, args)
                return orig(*args, **kwargs)

        m.forward = forward
        m._nemo_fp8_orig_forward = orig
        setattr(m, _WRAP_ATTR, True)

    def detach(self) -> None:
        """Restore the original forwards."""
        for m in self._modules.values():
            if getattr(m, _WRAP_ATTR, False):
                m.forward = m._nemo_fp8_orig_forward
                del m._nemo_fp8_orig_forward
                setattr(m, _WRAP_ATTR, False)
        self._modules.clear()

    # ---- recording ------------------------------------------------------------------------------
    def _record(self, name: str, args) -> None:
        row = self.rows[name]
        on, recipe_name = self.fp8_state()
        row.calls += 1
        if on:
            row.fp8_calls += 1
            if recipe_name and recipe_name not in row.te_recipes:
                row.te_recipes.append(recipe_name)
        if self.telemetry and args and torch.is_tensor(args[0]):
            with torch.no_grad():
                a = float(args[0].detach().abs().amax()) if args[0].numel() else 0.0
            self._amax[name] = max(self._amax.get(name, 0.0), a)

    def reset(self) -> None:
        """Zero the call counters and telemetry (keeps the decisions)."""
        for r in self.rows.values():
            r.calls = r.fp8_calls = 0
            r.te_recipes = []
        self._amax.clear()

    # ---- reports --------------------------------------------------------------------------------
    def report(self) -> TEAuditReport:
        """Decisions vs what ran since attach / :meth:`reset`."""
        rows = sorted(self.rows.values(), key=lambda r: r.name)
        violations = [r.name for r in rows if r.decision != "fp8" and r.fp8_calls > 0]
        off = [r.name for r in rows if r.decision == "fp8" and r.calls > 0 and r.fp8_calls == 0 and self.recipe.is_fp8]
        return TEAuditReport(self.recipe.name, rows, violations, off)

    def check(self) -> TEAuditReport:
        """:meth:`report`; raises :class:`PolicyViolation` in strict mode if the policy broke."""
        rep = self.report()
        if self.strict and rep.violations:
            raise PolicyViolation(
                "modules kept out of FP8 by the policy ran with FP8 on: "
                + ", ".join(rep.violations)
                + " (check that nothing re-enters te.autocast inside them, or run without strict)"
            )
        return rep

    def collect_telemetry(self, reset: bool = True) -> Dict[str, float]:
        """``{"fp8/<group>/<operand>/<stat>": v}`` under the native backend's tags and groups
        (:func:`~nemo_fp8_recipes.nn.convert.telemetry_group`): ``input/amax`` observed at the
        modules' inputs (max over modules), and for delayed scaling TE's current scales and the
        latest amaxes from ``fp8_meta`` (``input`` / ``weight`` forward, ``grad_output``
        backward; scales the mean, amaxes the max over modules)."""
        acc: Dict[str, List[float]] = {}
        for name, a in self._amax.items():
            acc.setdefault(f"fp8/{_group(self.rows[name])}/input/amax", []).append(a)
        for name, m in self._modules.items():
            meta = getattr(m, "fp8_meta", None)
            if not isinstance(meta, dict):
                continue
            g = _group(self.rows[name])
            for key, operands in (("scaling_fwd", ("input", "weight")), ("scaling_bwd", ("grad_output",))):
                st = meta.get(key)
                scale = getattr(st, "scale", None)
                hist = getattr(st, "amax_history", None)
                for i, op in enumerate(operands):
                    if torch.is_tensor(scale) and scale.numel() > i:
                        acc.setdefault(f"fp8/{g}/{op}/scale", []).append(float(scale.reshape(-1)[i].float()))
                    if op != "input" and torch.is_tensor(hist) and hist.dim() == 2 and hist.shape[1] > i:
                        acc.setdefault(f"fp8/{g}/{op}/amax", []).append(float(hist[0, i].float()))
        if reset:
            self._amax.clear()
        return {k: (max(v) if k.endswith("amax") else sum(v) / len(v)) for k, v in acc.items()}


def _group(row: TEAuditRow) -> str:
    from ..nn.telemetry import telemetry_group

    return telemetry_group(row.name, row.role)


def _write_scalars(writer, scalars: Dict[str, float], step: int) -> None:
    if writer is None:
        return
    for k, v in scalars.items():
        writer.add_scalar(k, v, step)


def _make_writer(log_dir: Optional[str]):
    if not log_dir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir)


def lightning_callback(
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    *,
    strict: bool = False,
    telemetry_interval: int = 0,
    log_dir: Optional[str] = None,
    audit_at_step: int = 1,
    **hook_kwargs,
):
    """A Lightning callback (NeMo 2.x ``nl.Trainer(callbacks=[...])``) running
    :class:`TEPrecisionHooks`: attach at ``setup``, audit table logged (strict: raised) after
    ``audit_at_step`` training batches, telemetry every ``telemetry_interval`` steps to the
    trainer's TensorBoard logger (or ``log_dir``). Attaches at ``setup`` and again at
    ``on_fit_start``, since NeMo 2 builds the model between the two. Needs ``lightning`` (or
    ``pytorch_lightning``)."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as e:
            raise ImportError("lightning_callback needs lightning (pip install lightning); NeMo 2.x ships it") from e

    class NemoFP8TECallback(Callback):
        """Applies and audits the FP8 precision policy on the TE modules of a NeMo 2 model."""

        def __init__(self) -> None:
            super().__init__()
            self.hooks = TEPrecisionHooks(
                recipe, policy, strict=strict, telemetry=telemetry_interval > 0, **hook_kwargs
            )
            self.audit: Optional[TEAuditReport] = None
            self._writer = None

        def setup(self, trainer, pl_module, stage=None) -> None:
            self.hooks.attach(pl_module)

        def on_fit_start(self, trainer, pl_module) -> None:
            # NeMo 2 builds the Megatron model in ``configure_model``, which Lightning calls after
            # ``setup``: attach again once it exists (idempotent per module).
            self.hooks.attach(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = int(getattr(trainer, "global_step", batch_idx + 1))
            if self.audit is None and batch_idx + 1 >= audit_at_step:
                self.audit = self.hooks.check()
                log.info("FP8 precision audit (TE):\n%s", self.audit.table())
            if telemetry_interval and step % telemetry_interval == 0:
                scalars = self.hooks.collect_telemetry()
                tb = getattr(getattr(trainer, "logger", None), "experiment", None)
                if tb is not None and hasattr(tb, "add_scalar"):
                    _write_scalars(tb, scalars, step)
                else:
                    self._writer = self._writer or _make_writer(log_dir)
                    _write_scalars(self._writer, scalars, step)

        def teardown(self, trainer, pl_module, stage=None) -> None:
            self.hooks.detach()
            if self._writer is not None:
                self._writer.close()

    return NemoFP8TECallback()


def write_audit(report: "TEAuditReport", directory) -> None:
    """``audit.txt`` (the table) and ``audit.json`` into ``directory``, as the embedded trainer
    writes them into its run directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "audit.txt").write_text(report.table() + "\n", encoding="utf-8")
    (d / "audit.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")


def bridge_callback(
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    *,
    expected_model_fields: Optional[Dict[str, Any]] = None,
    strict: bool = False,
    telemetry_interval: int = 0,
    audit_at_step: int = 1,
    audit_dir=None,
    **hook_kwargs,
):
    """A Megatron-Bridge callback (``pretrain(cfg, forward_step, callbacks=[...])``):

    * ``on_train_start``: checks that the model config Bridge finally built carries
      ``expected_model_fields`` (what we set through ``mixed_precision``; proves
      ``MixedPrecisionConfig.setup()`` did not clobber the recipe) and attaches
      :class:`TEPrecisionHooks` to the model chunks;
    * ``on_train_step_end``: audit after ``audit_at_step`` steps (strict: raise; ``audit_dir``:
      also written there as ``audit.txt`` / ``audit.json``), telemetry every
      ``telemetry_interval`` steps to Bridge's TensorBoard writer;
    * ``on_train_end``: with ``audit_dir``, ``summary.json`` there: the steps run and the peak
      GPU memory (``torch.cuda.max_memory_allocated``, GiB), as the embedded trainer writes it.

    Needs Megatron-Bridge (Python >= 3.12)."""
    from megatron.bridge.training.callbacks import Callback  # type: ignore

    class NemoFP8BridgeCallback(Callback):
        """Applies, audits and logs the FP8 precision policy inside Megatron-Bridge training."""

        def __init__(self) -> None:
            self.hooks = TEPrecisionHooks(
                recipe, policy, strict=strict, telemetry=telemetry_interval > 0, **hook_kwargs
            )
            self.audit: Optional[TEAuditReport] = None
            self.steps = 0

        def on_train_start(self, context) -> None:
            model_cfg = context.state.cfg.model
            bad = {
                k: (getattr(model_cfg, k, None), v)
                for k, v in (expected_model_fields or {}).items()
                if getattr(model_cfg, k, None) != v
            }
            if bad:
                raise RuntimeError(
                    "the model config Megatron-Bridge built does not carry the FP8 recipe: "
                    + ", ".join(f"{k}={have!r} (want {want!r})" for k, (have, want) in bad.items())
                    + "; something overwrote it after mixed_precision.setup(); run nemo-fp8-check with the "
                    "same overrides"
                )
            log.info(
                "FP8 settings on the built model: %s",
                {k: getattr(model_cfg, k, None) for k in (expected_model_fields or {})},
            )
            self.hooks.attach(context.model)

        def on_train_step_end(self, context) -> None:
            self.steps += 1
            if self.audit is None and self.steps >= audit_at_step:
                try:
                    self.audit = self.hooks.check()
                except PolicyViolation:
                    if audit_dir is not None:
                        write_audit(self.hooks.report(), audit_dir)
                    raise
                log.info("FP8 precision audit (TE):\n%s", self.audit.table())
                if audit_dir is not None:
                    write_audit(self.audit, audit_dir)
            if telemetry_interval and self.steps % telemetry_interval == 0:
                _write_scalars(
                    getattr(context.state, "tensorboard_logger", None), self.hooks.collect_telemetry(), self.steps
                )

        def on_train_end(self, context) -> None:
            self.hooks.detach()
            if audit_dir is not None:  # what the embedded trainer's summary.json says of a run
                peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
                summary = {"steps": self.steps, "peak_memory_gib": peak}
                (Path(audit_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    return NemoFP8BridgeCallback()
