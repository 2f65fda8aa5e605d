"""The embedded trainer's Transformer Engine backend (``backend=te``): our Llama 3 / MoE model with
``te.Linear`` wherever the precision policy puts a linear in FP8, the forward under
``te.autocast(recipe=to_te_recipe(key))``.

Everything else is the native model, unchanged: the embedding, the RMSNorms (FP32), the attention
core (PyTorch SDPA, BF16), the router (FP32) and the output head stay the same PyTorch modules.

Why ``te.Linear`` per projection rather than ``te.LayerNormLinear`` / ``te.LayerNormMLP`` (which
fuse the norm, and the whole MLP, into one TE module):

- the module tree, parameter names and shapes stay those of the native model (``wq``, ``wk``,
  ``wv``, ``wo``, ``w1``, ``w2``, ``w3``), so the policy decides per projection exactly as for the
  native backend (``attention_projections=bf16``, ``exclude`` patterns, first/last layers), the
  audit's rows line up one to one, and a checkpoint's weights map one to one between backends;
- the norms stay the native FP32 RMSNorm, as the policy's norm role says, so the two backends
  differ only where the FP8 GEMMs are computed — which is what a comparison of them is for.

The cost is TE's norm fusion (one read of the norm output fewer per block); Megatron-Core's TE
layer spec, which fuses them, is the other column of the end-to-end benchmark.

Gradient accumulation uses TE's weight caching: the first micro-batch of an optimizer step passes
``is_first_microbatch=True`` (TE quantises the weights and keeps the FP8 copies), the others
``False`` (TE reuses them). Delayed scaling's amaxes are max-reduced over the data-parallel group
passed to ``te.autocast`` as ``amax_reduction_group``. TE keeps its FP8 state (delayed scaling's
amax histories and scales) in each module's ``_extra_state``, which the trainer's checkpoints
carry. TE serialises that state as a Python pickle, and TE 2.20 refuses to unpickle it on load
unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``; our ``te.Linear`` writes it as plain tensors
and numbers instead (``weights_only``-loadable, no code runs on load) and reads either form.

Importing this module needs neither Transformer Engine nor a GPU; the functions that build the
model import TE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from ..config import ConfigError
from ..policy import Decision, PrecisionPolicy, grouped_weight_names
from ..recipes import Recipe, ScalingKind
from .distributed import DistContext

log = logging.getLogger("nemo_fp8_recipes.train")  # (the trainer's: the TE backend logs into the run)

__all__ = [
    "MicroBatchState",
    "TEBackend",
    "te_grouped_problem",
    "te_run_problem",
    "te_backend_problem",
    "convert_to_te",
    "te_modules",
    "te_autocast_for",
    "snapshot_te_state",
    "restore_te_state",
]


@dataclass
class MicroBatchState:
    """Which micro-batch of the optimizer step the forward belongs to: ``first=True`` for the
    first (TE quantises and caches the FP8 weights), ``False`` for the others (TE reuses them),
    ``None`` outside training steps (TE quantises every call, e.g. validation)."""

    first: Optional[bool] = None


@dataclass
class TEConversion:
    """What :func:`convert_to_te` did: the policy decision of every linear, the number swapped."""

    decisions: Dict[str, Decision] = field(default_factory=dict)
    swapped: int = 0


def te_backend_problem(device: torch.device) -> Optional[str]:
    """Why ``backend=te`` cannot run here (None when it can): Transformer Engine not importable, or
    no CUDA GPU. The message names the fix."""
    from ..integrations.te import te_available

    ok, why = te_available()
    if not ok:
        return (
            f"backend=te needs Transformer Engine, which is not importable here ({why}): on a GPU machine "
            'pip install ".[te]" (Transformer Engine >= 2.9), or use backend=native (our FP8 path, which '
            "also emulates FP8 on CPU)"
        )
    if device.type != "cuda":
        return (
            f"backend=te runs Transformer Engine's FP8 GEMMs on a CUDA GPU; trainer.device resolves to "
            f"{device}. Use a GPU (trainer.device=cuda), or backend=native (our FP8 path, emulated on CPU)"
        )
    return None


_TE_LINEAR_CLASS = None
_TE_STATE_FORMAT = "nemo_fp8_recipes.te_delayed_scaling/1"


def _has_delayed_state(module: nn.Module) -> bool:
    """Whether a TE module holds delayed-scaling state (it ran under ``DelayedScaling``)."""
    meta = getattr(module, "fp8_meta", None) or {}
    recipe = meta.get("recipe")
    return (
        "scaling_fwd" in meta
        and "scaling_bwd" in meta
        and recipe is not None
        and recipe.delayed()
        and hasattr(meta["scaling_fwd"], "amax_history")
    )


def _te_linear_class():
    """``te.Linear`` that takes ``is_first_microbatch`` from the trainer's :class:`MicroBatchState`
    when the caller does not pass it (our model calls its projections as ``self.wq(x)``)."""
    global _TE_LINEAR_CLASS
    if _TE_LINEAR_CLASS is None:
        import transformer_engine.pytorch as te

        class NemoTELinear(te.Linear):
            """``te.Linear`` with the micro-batch position read from the trainer's state, and its
            delayed-scaling state checkpointed as tensors (no pickle)."""

            def forward(self, inp, is_first_microbatch=None, **kwargs):  # noqa: D401 - TE's signature
                if is_first_microbatch is None:
                    state = getattr(self, "_nemo_fp8_micro", None)
                    is_first_microbatch = state.first if state is not None else None
                return super().forward(inp, is_first_microbatch=is_first_microbatch, **kwargs)

            def get_extra_state(self):
                if not _has_delayed_state(self):
                    return super().get_extra_state()  # stateless recipes: TE's empty tensor
                meta = self.fp8_meta
                out = {
                    "format": _TE_STATE_FORMAT,
                    "extra": {
                        k: v
                        for k, v in meta.items()
                        if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str))
                    },
                }
                for d in ("fwd", "bwd"):
                    st = meta[f"scaling_{d}"]
                    out[f"scale_{d}"] = st.scale.detach().to("cpu", copy=True)
                    out[f"amax_history_{d}"] = st.amax_history.detach().to("cpu", copy=True)
                return out

            def set_extra_state(self, state):
                if type(state).__name__ == "_EXTRA_STATE":
                    # torch.distributed.checkpoint's placeholder for a module whose extra state
                    # the checkpoint lacks (a forced resume from the native backend): no state.
                    return None
                if not (isinstance(state, dict) and state.get("format") == _TE_STATE_FORMAT):
                    return super().set_extra_state(state)  # TE's own form (and TE's rules for it)
                recipe = getattr(self, "_nemo_te_recipe", None)
                if recipe is None or not recipe.delayed():
                    raise RuntimeError(
                        "this checkpoint holds delayed-scaling FP8 state (amax histories, scales) for a "
                        "te.Linear that is not under delayed scaling: resume with recipe=delayed"
                    )
                self.fp8_meta.update(state["extra"])
                self.fp8_meta["recipe"] = recipe
                self.init_fp8_meta_tensors(recipe)  # keeps tensors that exist (TE's own rule)
                with torch.no_grad():
                    for d in ("fwd", "bwd"):
                        st = self.fp8_meta[f"scaling_{d}"]
                        for name, dst in (("scale", st.scale), ("amax_history", st.amax_history)):
                            src = state[f"{name}_{d}"]
                            if src.shape != dst.shape:
                                raise RuntimeError(
                                    f"delayed-scaling {name} ({d}) of shape {tuple(src.shape)} in the "
                                    f"checkpoint, {tuple(dst.shape)} in this run: recipe.amax_history_len "
                                    "differs from the checkpoint's"
                                )
                            dst.copy_(src)  # in place: TE's quantizers and reduction buffers see it

        _TE_LINEAR_CLASS = NemoTELinear
    return _TE_LINEAR_CLASS


def te_grouped_problem(model: nn.Module, recipe: Recipe, policy: Optional[PrecisionPolicy] = None) -> Optional[str]:
    """Why ``backend=te`` cannot run ``model`` under ``recipe``, or None: grouped MoE experts (3-D
    weights) that the policy puts in FP8, as the native path decides. No TE module takes their
    place here, and leaving them in BF16 would run less FP8 than asked. ``model`` may live on the
    meta device (the trainer checks before it loads any data)."""
    from ..nn.convert import grouped_decision, infer_num_layers

    policy = policy or PrecisionPolicy()
    if policy.num_layers is None:  # (a policy that knows its layer count needs no walk of the model)
        policy = policy.with_num_layers(infer_num_layers(model))
    for fqn, module in model.named_modules():
        names = grouped_weight_names(module) if fqn else ()
        if names and grouped_decision(policy, fqn, module, recipe, names).fp8:
            return (
                f"backend=te: {fqn} ({type(module).__name__}) holds grouped MoE experts (3-D weights), "
                "which this backend does not swap for Transformer Engine modules, so its expert GEMMs "
                f"would stay in high precision under recipe {recipe.name}. Use backend=native (grouped "
                "FP8 experts), keep the experts in BF16 on purpose with policy.exclude=[*experts*], "
                "or use recipe=bf16"
            )
    return None


def convert_to_te(
    model: nn.Module, recipe: Recipe, policy: Optional[PrecisionPolicy] = None, micro: Optional[MicroBatchState] = None
) -> TEConversion:
    """Swap every ``nn.Linear`` of ``model`` that the policy puts in FP8 for a ``te.Linear`` with the
    same weights (FP32 parameters, the master weights; TE casts them under autocast), in place.
    Linears the policy keeps in high precision, and everything that is not a linear, stay as they
    are. Grouped MoE experts (3-D weights) that the policy puts in FP8 raise ``ConfigError``: no TE
    module takes their place here, and leaving them in BF16 would run less FP8 than asked.
    ``micro``: the trainer's micro-batch position (TE's weight caching)."""
    from ..integrations.te import to_te_recipe
    from ..nn.convert import infer_num_layers, set_submodule

    policy = (policy or PrecisionPolicy()).with_num_layers(infer_num_layers(model))
    problem = te_grouped_problem(model, recipe, policy)
    if problem:
        raise ConfigError(problem)
    cls = _te_linear_class()
    te_recipe = to_te_recipe(recipe) if recipe.is_fp8 else None
    out = TEConversion()
    for fqn, module in list(model.named_modules()):
        if not fqn or type(module) is not nn.Linear:
            continue
        d = policy.decide(fqn, module, recipe=recipe)
        out.decisions[fqn] = d
        if not d.fp8:
            continue
        w = module.weight
        new = cls(
            module.in_features, module.out_features, bias=module.bias is not None, params_dtype=w.dtype, device=w.device
        )
        with torch.no_grad():
            new.weight.copy_(w)
            if module.bias is not None:
                new.bias.copy_(module.bias)
        new._nemo_fp8_micro = micro
        new._nemo_te_recipe = te_recipe
        set_submodule(model, fqn, new)
        out.swapped += 1
    return out


def te_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """``{name: module}`` of the Transformer Engine modules of ``model``."""
    from ..integrations.te import is_te_module

    return {n: m for n, m in model.named_modules() if n and is_te_module(m)}


def te_autocast_for(recipe: Recipe, amax_reduction_group=None):
    """A factory of fresh ``te.autocast`` contexts for ``recipe`` (BF16: FP8 off), reducing
    delayed-scaling amaxes over ``amax_reduction_group``."""
    from ..integrations.te import te_autocast, to_te_recipe

    if not recipe.is_fp8:
        return lambda: te_autocast(None, enabled=False)
    te_recipe = to_te_recipe(recipe)
    return lambda: te_autocast(te_recipe, amax_reduction_group=amax_reduction_group)


def snapshot_te_state(model: nn.Module) -> Dict[str, Any]:
    """Every TE module's FP8 scaling tensors (delayed scaling's scales and amax histories; TE's
    ``get_fp8_meta_tensors``, copies on the device), for :func:`restore_te_state` — so an
    evaluation under ``te.autocast`` does not steer training. ``None`` for a module whose FP8
    state does not exist yet."""
    return {n: (m.get_fp8_meta_tensors() if _has_delayed_state(m) else None) for n, m in te_modules(model).items()}


def restore_te_state(model: nn.Module, snap: Dict[str, Any]) -> None:
    """Put back a :func:`snapshot_te_state`, in place (TE's quantizers and amax-reduction buffers
    keep pointing at the same tensors). State created since the snapshot returns to TE's
    initial values (scale 1, empty history)."""
    mods = te_modules(model)
    for n, tensors in snap.items():
        if n in mods and _has_delayed_state(mods[n]):  # current scaling keeps no state between steps
            mods[n].reset_fp8_meta_tensors(tensors)


class TEBackend:
    """``backend=te`` for the trainer (:class:`~nemo_fp8_recipes.trainer.backends.Backend`):
    ``te.Linear`` where the policy puts a linear in FP8, the micro-batch state TE's weight caching
    reads, the run-time hooks (audit, telemetry) and ``te.autocast``; the norms stay the native
    modules, run with the run's kernel options."""

    name = "te"
    uses_transformer_engine = True
    cached_weights = 0  # (TE caches its FP8 weights per step itself: is_first_microbatch)

    def __init__(self, backend_cfg, telemetry: bool) -> None:
        self.backend_cfg = backend_cfg
        self.telemetry = telemetry
        self.micro = MicroBatchState()

    def check(self, recipe, device: torch.device, tcfg) -> None:
        from ..config import ConfigError

        problem = te_run_problem(recipe, device, tcfg)
        if problem:
            raise ConfigError(problem)

    def check_model(self, mcfg, recipe, policy) -> None:
        """Refuse grouped MoE experts that would stay out of FP8 (:func:`te_grouped_problem`),
        on a model built on the meta device: before the data is loaded or a weight allocated."""
        from ..models import build_model

        if not recipe.is_fp8 or mcfg.arch != "moe":
            return
        problem = te_grouped_problem(build_model(mcfg, device="meta"), recipe, policy)
        if problem:
            raise ConfigError(problem)

    def convert(self, model, *, recipe, policy, options, ctx: DistContext, tcfg, accum: int) -> None:
        from ..integrations.callbacks import TEPrecisionHooks
        from ..nn import apply_kernel_options

        self.conversion = convert_to_te(model, recipe, policy, self.micro)
        apply_kernel_options(model, options)  # (the native modules: the norms)
        self.options = options
        group = None
        if ctx.distributed:
            import torch.distributed as dist

            group = dist.group.WORLD  # delayed scaling: amaxes max-reduced over the data-parallel ranks
        self._autocast = te_autocast_for(recipe, amax_reduction_group=group)
        self.hooks = TEPrecisionHooks(
            recipe, policy, strict=bool(self.backend_cfg.get("strict_audit", False)), telemetry=self.telemetry
        )
        self.hooks.attach(model)
        log.info(
            "backend te: %d linears are te.Linear (FP8 under te.autocast), %d kept in high precision",
            self.conversion.swapped,
            len(self.conversion.decisions) - self.conversion.swapped,
        )

    def fp8_gemm_modules(self, model) -> list:
        return [model.get_submodule(n) for n, d in self.conversion.decisions.items() if d.fp8]

    def autocast(self, first_micro_batch: Optional[bool]):
        self.micro.first = first_micro_batch
        return self._autocast()

    def audit(self, model):
        """TE's audit of what ran (strict: raises on a violation), with the linears the policy kept
        out of FP8 (plain PyTorch modules here) listed beside the TE modules."""
        from ..integrations.callbacks import TEAuditRow

        rep = self.hooks.check()
        have = {r.name for r in rep.rows}
        for name, d in self.conversion.decisions.items():
            if name not in have and not d.fp8:
                rep.rows.append(TEAuditRow(name, d.role, d.precision, d.reason + " (a PyTorch module)"))
        rep.rows.sort(key=lambda r: r.name)
        return rep

    def audit_note(self) -> Optional[str]:
        return f"kernel options (the native norms): {self.options.describe()}"

    def start_telemetry(self, model) -> None:
        pass  # the hooks record every step they are asked for

    def collect_telemetry(self, model) -> Dict[str, float]:
        return self.hooks.collect_telemetry()

    def snapshot(self, model):
        return snapshot_te_state(model)

    def restore(self, model, snapshot) -> None:
        restore_te_state(model, snapshot)

    def after_optimizer_step(self, model) -> None:
        pass  # TE advances its amax histories in te.autocast, reduced over the group given there

    def skipped_step(self, model) -> None:
        pass  # TE's amaxes of a skipped batch are already in its histories (docs/limitations.md)


def te_run_problem(recipe, device: torch.device, tcfg) -> Optional[str]:
    """Why ``backend=te`` cannot run as configured, naming the fix, or None (``tcfg``: the
    trainer's :class:`~nemo_fp8_recipes.config.TrainerConfig`); the trainer stops at once
    with it."""
    from ..hardware import describe_device

    problem = te_backend_problem(device)
    if problem:
        return problem
    if recipe.emulate:
        return (
            "recipe.emulate=true is the native backend's exact emulation; Transformer Engine runs "
            "real FP8 GEMMs only: use backend=native recipe.emulate=true, or drop recipe.emulate"
        )
    info = describe_device(device)
    if recipe.scaling_kind is ScalingKind.MICROSCALING and (info.capability or (0, 0)) < (10, 0):
        return (
            f"recipe mxfp8 with backend=te needs SM100 (Blackwell): Transformer Engine refuses MXFP8 on "
            f"{info}. Use recipe=blockwise (fine-grained scales that Hopper runs), or backend=native "
            "recipe.emulate=true for mxfp8's numerics"
        )
    if tcfg.compile:
        return (
            "trainer.compile=true with backend=te: Transformer Engine's modules run eager (and "
            "DelayedScaling is refused under torch.compile); use trainer.compile=false, or "
            "backend=native, which compiles"
        )
    if tcfg.fuse_wgrad_accumulation:
        return (
            "trainer.fuse_wgrad_accumulation=true is the native FP8 linear's; with backend=te use "
            "trainer.fuse_wgrad_accumulation=false"
        )
    from ..integrations.te import te_check_supported

    ok, why = te_check_supported(recipe)  # TE's own check on this GPU, after ours
    if not ok:
        return (
            f"Transformer Engine refuses recipe {recipe.name} on {info}: {why}. Use backend=native "
            "(which says what this GPU runs), or another recipe"
        )
    return None
