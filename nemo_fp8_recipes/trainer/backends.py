"""The seam between the trainer and who computes the FP8 GEMMs: a small :class:`Backend` protocol,
and :class:`NativeBackend` (our FP8 linears). The Transformer Engine implementation is
:class:`~nemo_fp8_recipes.trainer.te_backend.TEBackend`; :func:`make_backend` picks one by the
``backend`` config group's name.

The trainer's loop calls the same methods whatever the backend: it checks the recipe on the
device (:meth:`Backend.check`), converts the model (:meth:`Backend.convert`), runs every forward
inside :meth:`Backend.autocast`, asks for the audit after the first step, turns telemetry on and
collects it, snapshots the FP8 state around validation (so evaluation never steers training) and
calls :meth:`Backend.after_optimizer_step` / :meth:`Backend.skipped_step` (delayed scaling's
once-per-step amax reduction, or dropping a skipped batch's amaxes). FP8 state that a checkpoint
must carry is module state (buffers, ``_extra_state``), so checkpoints need nothing from it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Dict, List, Optional, Protocol

import torch
import torch.nn as nn

from ..config import ConfigError
from ..options import KernelOptions
from ..policy import PrecisionPolicy
from ..recipes import Recipe
from .distributed import DistContext

__all__ = ["Backend", "NativeBackend", "make_backend"]

log = logging.getLogger("nemo_fp8_recipes.train")


class Backend(Protocol):
    """Who computes a run's FP8 GEMMs, as the trainer uses it (one object per run)."""

    #: the ``backend`` config group's name (recorded in checkpoints and summaries)
    name: str
    #: whether its modules are Transformer Engine's (deterministic mode then sets TE's switch too)
    uses_transformer_engine: bool
    #: FP8 linears that quantise their weights once per optimizer step under torch.compile (set by convert)
    cached_weights: int

    def check(self, recipe: Recipe, device: torch.device, tcfg) -> None:
        """Raise (naming the fix) when the recipe cannot run on ``device`` with this backend."""

    def check_model(self, mcfg, recipe: Recipe, policy: PrecisionPolicy) -> None:
        """Raise (naming the fix) when this backend cannot run the model ``mcfg`` describes under
        the recipe and policy; called before the data is loaded."""

    def convert(
        self,
        model: nn.Module,
        *,
        recipe: Recipe,
        policy: PrecisionPolicy,
        options: KernelOptions,
        ctx: DistContext,
        tcfg,
        accum: int,
    ) -> None:
        """Put the recipe into ``model`` (in place), with the per-step options of the run."""

    def fp8_gemm_modules(self, model: nn.Module) -> List[nn.Module]:
        """The modules whose GEMMs run in FP8."""

    def autocast(self, first_micro_batch: Optional[bool]) -> ContextManager:
        """The context every forward runs in; ``first_micro_batch``: whether this forward is the
        first of an optimizer step (None outside training steps, e.g. validation)."""

    def audit(self, model: nn.Module):
        """What ran in FP8, per module and GEMM (strict: raises on a policy violation)."""

    def audit_note(self) -> Optional[str]:
        """A line the audit file adds (None: nothing)."""

    def start_telemetry(self, model: nn.Module) -> None:
        """Record FP8 statistics in the coming step."""

    def collect_telemetry(self, model: nn.Module) -> Dict[str, float]:
        """The statistics recorded since :meth:`start_telemetry`, and stop recording."""

    def snapshot(self, model: nn.Module) -> Any:
        """A copy of the FP8 scaling state, for :meth:`restore`."""

    def restore(self, model: nn.Module, snapshot: Any) -> None:
        """Put back a :meth:`snapshot`."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """After a completed optimizer step."""

    def skipped_step(self, model: nn.Module) -> None:
        """After a step whose batch was skipped (a non-finite loss, ``trainer.nan_policy=skip``)."""


class NativeBackend:
    """Our FP8 linears (:func:`~nemo_fp8_recipes.nn.convert_model`): real FP8 GEMMs where the GPU
    has them, the exact emulation elsewhere; delayed scaling advances once per optimizer step."""

    name = "native"
    uses_transformer_engine = False

    def check(self, recipe: Recipe, device: torch.device, tcfg) -> None:
        from ..recipes import require_supported

        require_supported(recipe, device)

    def check_model(self, mcfg, recipe: Recipe, policy: PrecisionPolicy) -> None:
        """Nothing to check: :func:`~nemo_fp8_recipes.nn.convert_model` places every module the
        policy can, and the audit reports the rest."""

    def convert(
        self,
        model: nn.Module,
        *,
        recipe: Recipe,
        policy: PrecisionPolicy,
        options: KernelOptions,
        ctx: DistContext,
        tcfg,
        accum: int,
    ) -> None:
        from ..nn import convert_model, fp8_modules

        fuse = bool(tcfg.fuse_wgrad_accumulation)
        if fuse and ctx.distributed:
            raise ConfigError(
                f"trainer.fuse_wgrad_accumulation=true skips the gradient hooks "
                f"{tcfg.data_parallel} reduces with ({ctx.world_size} ranks); set it to false "
                "under torchrun"
            )
        # the compiled path's FP8 weight cache: current scaling (delayed scaling caches its weight
        # with the step's scale eagerly), set before DDP wraps the model and before it is compiled
        graph_cache = False
        if tcfg.compile and tcfg.compiled_weight_cache and recipe.is_fp8 and accum > 1:
            if ctx.distributed and tcfg.data_parallel == "fsdp2":
                log.info(
                    "compiled FP8 weight cache off under FSDP2: the sharded weights are quantised in the "
                    "graph at every micro-batch"
                )
            else:
                graph_cache = not recipe.is_delayed
        # delayed scaling: scales fixed within a step, amaxes max-reduced once per step (all ranks)
        convert_model(
            model,
            recipe,
            policy,
            options=options,
            scaling_update="step",
            fuse_wgrad_accumulation=fuse,
            graph_weight_cache=graph_cache,
        )
        mods = fp8_modules(model).values()
        if fuse:
            if accum > 1:
                log.info(
                    "fused wgrad accumulation: %d FP8 linears add micro-batches 2..%d into their FP32 "
                    "gradients inside the wgrad GEMM",
                    len(mods),
                    accum,
                )
            else:
                log.warning(
                    "trainer.fuse_wgrad_accumulation=true has nothing to fuse with one micro-batch per "
                    "step (global_batch_size = micro_batch_size): every backward starts from zeroed "
                    "gradients"
                )
        self.cached_weights = sum(1 for m in mods if m.config.graph_weight_cache)
        if self.cached_weights:
            log.info(
                "compiled FP8 weight cache: %d FP8 linears quantise their weights once per optimizer "
                "step, not in each of the %d micro-batches",
                self.cached_weights,
                accum,
            )

    def fp8_gemm_modules(self, model: nn.Module) -> List[nn.Module]:
        from ..nn import fp8_modules

        return list(fp8_modules(model).values())

    def autocast(self, first_micro_batch: Optional[bool]) -> ContextManager:
        return contextlib.nullcontext()  # the FP8 linears carry the recipe

    def audit(self, model: nn.Module):
        from ..nn import audit

        return audit(model)

    def audit_note(self) -> Optional[str]:
        return None  # (the native audit prints the kernel options itself)

    def start_telemetry(self, model: nn.Module) -> None:
        from ..nn import set_telemetry

        set_telemetry(model, True)  # (a run-time switch: on for one logging step, off in collect_telemetry)

    def collect_telemetry(self, model: nn.Module) -> Dict[str, float]:
        from ..nn import collect_telemetry, set_telemetry

        tel = collect_telemetry(model, reset=True)
        set_telemetry(model, False)
        return tel

    def snapshot(self, model: nn.Module) -> Any:
        from ..nn import fp8_state_snapshot

        return fp8_state_snapshot(model)

    def restore(self, model: nn.Module, snapshot: Any) -> None:
        from ..nn import restore_fp8_state

        restore_fp8_state(model, snapshot)

    def after_optimizer_step(self, model: nn.Module) -> None:
        from ..nn import sync_delayed_scaling

        sync_delayed_scaling(model)  # one amax all-reduce for the whole model

    def skipped_step(self, model: nn.Module) -> None:
        from ..nn import discard_delayed_scaling

        # the skipped batch's (non-finite) amaxes must not enter the delayed-scaling histories,
        # where they would pin every scale for amax_history_len steps
        discard_delayed_scaling(model)


def make_backend(name: str, backend_cfg=None, *, telemetry: bool = False) -> Backend:
    """The backend of the ``backend`` config group ``name`` (``native`` or ``te``)."""
    if name == "native":
        return NativeBackend()
    if name == "te":
        from .te_backend import TEBackend

        return TEBackend(backend_cfg or {}, telemetry=telemetry)
    raise ConfigError(f"the embedded trainer runs backend=native or backend=te, got backend={name}")
