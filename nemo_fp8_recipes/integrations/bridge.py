"""Megatron-Bridge: our recipe as a ``MixedPrecisionConfig``, and the Llama / DeepSeek-V3 launcher.

Megatron-Bridge (``megatron.bridge``, Python >= 3.12) resolves ``cfg.mixed_precision`` in
``runtime_config_update`` and calls ``MixedPrecisionConfig.setup(model, optimizer, ddp)``, which
copies *every* same-named field onto the model, optimizer and DDP configs. A recipe set on the
model (``model.fp8_recipe=blockwise``) is therefore silently replaced by the mixed-precision
default (``fp8_recipe="tensorwise"``, history 1, no BF16 layers). We put the whole recipe into the
``MixedPrecisionConfig`` itself, so ``setup()`` applies it instead of clobbering it; the fields
Bridge's config does not have (``moe_router_dtype``, ``quant_recipe`` for per-module BF16
overrides) go on the model, where ``setup()`` leaves them alone. At train start a callback checks
the built model config still carries every value.

Launch (one process per GPU, e.g. under ``torchrun``)::

    torchrun --nproc-per-node 8 -m nemo_fp8_recipes.integrations.bridge \\
        model=llama3_8b recipe=blockwise policy.first_layers_bf16=1 train.train_iters=100

Our keys (``recipe=``, ``recipe.*``, ``policy.*``, ``model=<name>``, ``backend.*``) are composed
with the trainer's Hydra tree (``backend=megatron_bridge``); everything else is passed through to
Bridge's ``process_config_with_overrides`` (``train.*``, ``optimizer.*``, ``model.*`` fields of the
model provider, ``dataset.*``, ``checkpoint.*``, ``ddp.*``, ``mixed_precision.*`` that the recipe
does not own). ``nemo-fp8-check`` runs first and refuses the traps of DESIGN §5.

Checked against Megatron-Bridge 0.6.2 (the PyPI wheel): ``training/mixed_precision.py``
(fields, ``setup``, ``bf16_mixed``), ``training/config.py`` (``runtime_config_update``,
``env_vars``), ``training/utils/omegaconf_utils.py: process_config_with_overrides``,
``training/pretrain.py: pretrain(config, forward_step_func, callbacks)``,
``training/gpt_step.py: forward_step``, ``training/callbacks.py: Callback``, and the recipe
exports ``llama3_8b_pretrain_config``, ``llama3_70b_pretrain_config``,
``llama31_405b_pretrain_config``, ``deepseek_v3_pretrain_config`` in ``megatron.bridge.recipes``.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..policy import PrecisionPolicy
from ..recipes import Recipe, get_recipe
from .megatron import MegatronFP8Config, megatron_config
from .te import prepare_te_env

__all__ = [
    "BRIDGE_RECIPES",
    "bridge_recipe_name",
    "bridge_mixed_precision_kwargs",
    "bridge_mixed_precision_config",
    "bridge_model_fields",
    "expected_model_fields",
    "build_bridge_config",
    "main",
]

log = logging.getLogger(__name__)

#: Our model name -> Megatron-Bridge pretrain recipe function (``megatron.bridge.recipes``).
BRIDGE_RECIPES = {
    "llama3_8b": "llama3_8b_pretrain_config",
    "llama3_70b": "llama3_70b_pretrain_config",
    "llama31_405b": "llama31_405b_pretrain_config",
    "deepseek_v3": "deepseek_v3_pretrain_config",  # MoE: router policy (moe_router_dtype=fp32)
}

#: The FP8 fields ``setup()`` copies onto the model config, which must survive to train start.
_MODEL_FP8_FIELDS = (
    "fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp8_dot_product_attention", "fp8_multi_head_attention", "first_last_layers_bf16",
    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
)


def bridge_recipe_name(model: str, override: Optional[str] = None) -> str:
    """The Bridge recipe function for our ``model=`` name (or ``backend.recipe_fn``)."""
    if override:
        return str(override)
    if model not in BRIDGE_RECIPES:
        raise ValueError(
            f"model={model} has no Megatron-Bridge pretraining recipe; choose one of "
            f"{', '.join(k for k in BRIDGE_RECIPES if k != 'deepseek_v3')}, or name a Bridge recipe function "
            "with backend.recipe_fn=<name> (e.g. backend.recipe_fn=deepseek_v3_pretrain_config for the MoE "
            "router policy)"
        )
    return BRIDGE_RECIPES[model]


def _mc(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy], fp8_param_gather: bool) -> MegatronFP8Config:
    return megatron_config(recipe, policy, backend="te", fp8_param=fp8_param_gather)


def bridge_mixed_precision_kwargs(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, *,
                                  fp8_param_gather: bool = False) -> Dict[str, Any]:
    """``MixedPrecisionConfig(**kwargs)`` for ``recipe``: Bridge's ``bf16_mixed`` base (BF16 params
    and pipeline, no autocast, FP32 gradient reduction) plus every FP8 field pinned from
    :func:`~.megatron.megatron_config` (no Bridge default survives). ``fp8_param_gather`` keeps
    FP8 weight copies (needs the distributed optimizer; mxfp8 then also sets
    ``reuse_grad_buf_for_mxfp8_param_ag``, which Bridge requires)."""
    import torch

    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    kw: Dict[str, Any] = {
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16,
        "autocast_enabled": False,
        "grad_reduce_in_fp32": True,
    }
    if not r.is_fp8:
        kw.update(fp8=None, fp8_param=False, fp8_param_gather=False, first_last_layers_bf16=False,
                  num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0)
        return kw
    mc = _mc(r, policy, fp8_param_gather)
    for k in _MODEL_FP8_FIELDS:
        kw[k] = mc[k]
    kw["fp8_param"] = bool(fp8_param_gather)
    kw["fp8_param_gather"] = bool(fp8_param_gather)
    kw["reuse_grad_buf_for_mxfp8_param_ag"] = bool(fp8_param_gather and r.name == "mxfp8")
    return kw


def bridge_mixed_precision_config(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, *,
                                  fp8_param_gather: bool = False):
    """The real ``megatron.bridge.training.mixed_precision.MixedPrecisionConfig`` for ``recipe``
    (imports Megatron-Bridge; set the NVTE_* environment first, see :func:`~.te.prepare_te_env`)."""
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig  # type: ignore

    return MixedPrecisionConfig(**bridge_mixed_precision_kwargs(recipe, policy, fp8_param_gather=fp8_param_gather))


def bridge_model_fields(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None) -> Dict[str, Any]:
    """Model-provider fields that ``MixedPrecisionConfig`` does not carry (so ``setup()`` leaves
    them alone): ``moe_router_dtype="fp32"`` and, when the policy needs per-module BF16 overrides,
    ``quant_recipe`` (Megatron's parsed ``--te-precision-config-file``; imports megatron-core)."""
    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    out: Dict[str, Any] = {"moe_router_dtype": "fp32"}
    if r.is_fp8:
        qr = _mc(r, policy, False).quant_recipe()
        if qr is not None:
            out["quant_recipe"] = qr
    return out


def expected_model_fields(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None) -> Dict[str, Any]:
    """What the model config must carry at train start (checked by the Bridge callback)."""
    kw = bridge_mixed_precision_kwargs(recipe, policy)
    out = {k: kw[k] for k in ("fp8",) + _MODEL_FP8_FIELDS if k in kw}
    out["moe_router_dtype"] = "fp32"
    return out


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def build_bridge_config(cfg, bridge_overrides: Sequence[str] = ()) -> Tuple[Any, Dict[str, Any]]:
    """Build Megatron-Bridge's ``ConfigContainer`` for a composed config (``backend=megatron_bridge``)
    and pass-through overrides; returns ``(config_container, expected_model_fields)``.

    Order: Bridge recipe function -> our ``MixedPrecisionConfig`` -> pass-through overrides (on top,
    so allowed ``mixed_precision.*`` tweaks such as ``fp8_param_gather`` apply) -> our model-only
    fields -> a check that the recipe-owned fields are unchanged.
    """
    from ..train import build_policy, build_recipe

    r = build_recipe(cfg.recipe)
    p = build_policy(cfg.get("policy"))
    b = cfg.backend
    fpg = bool(b.get("fp8_param_gather", False))
    fn_name = bridge_recipe_name(str(cfg.model.name), b.get("recipe_fn"))
    if r.is_fp8:
        prepare_te_env(r)  # before anything imports Transformer Engine
    try:
        import megatron.bridge.recipes as bridge_recipes  # type: ignore
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides  # type: ignore
    except ImportError as e:
        raise ImportError(
            f"backend=megatron_bridge needs Megatron-Bridge (pip install megatron-bridge; Python >= 3.12, CUDA, "
            f"Transformer Engine): {e}. nemo-fp8-check validates the same command line without it"
        ) from e
    fn = getattr(bridge_recipes, fn_name, None)
    if fn is None:
        raise ValueError(f"megatron.bridge.recipes has no {fn_name}; check backend.recipe_fn and the Bridge version")
    container = fn()
    container.mixed_precision = bridge_mixed_precision_config(r, p, fp8_param_gather=fpg)
    env_vars = getattr(container, "env_vars", None)
    if isinstance(env_vars, dict):
        from .te import te_env

        env_vars.update(te_env(r))
    if bridge_overrides:
        container = process_config_with_overrides(container, cli_overrides=list(bridge_overrides))
    for k, v in bridge_model_fields(r, p).items():
        setattr(container.model, k, v)
    want = bridge_mixed_precision_kwargs(r, p, fp8_param_gather=fpg)
    mp = container.mixed_precision
    changed = {k: (getattr(mp, k, None), v) for k, v in want.items()
               if k in _MODEL_FP8_FIELDS and getattr(mp, k, None) != v}
    if changed:
        raise ValueError(
            "the pass-through overrides changed recipe-owned mixed_precision fields: "
            + ", ".join(f"{k}={have!r} (recipe: {v!r})" for k, (have, v) in changed.items())
            + "; choose them with recipe=/recipe.*/policy.* instead"
        )
    return container, expected_model_fields(r, p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nemo_fp8_recipes.integrations.bridge [--gpu h100] <overrides>``: validate,
    build and run Megatron-Bridge pretraining with our recipe (``backend.dry_run=true``: build,
    log and stop)."""
    from ..train import build_policy, build_recipe
    from ..train_config import compose_config, validate_overrides
    from .callbacks import bridge_callback
    from .validate import parse_gpu, split_overrides, validate_config

    args = list(sys.argv[1:] if argv is None else argv)
    gpu = None
    if "--gpu" in args:
        i = args.index("--gpu")
        gpu = args[i + 1] if i + 1 < len(args) else None
        del args[i:i + 2]
    if not any(a.split("=", 1)[0].lstrip("+") == "backend" for a in args):
        args.append("backend=megatron_bridge")
    ours, theirs = split_overrides(args, backend="megatron_bridge")
    problem = validate_overrides(ours)
    if problem:
        print(f"nemo-fp8 bridge: {problem}", file=sys.stderr)
        return 2
    cfg = compose_config(ours)
    if cfg.backend.name != "megatron_bridge":
        print(f"nemo-fp8 bridge: backend={cfg.backend.name}; this entry point runs backend=megatron_bridge",
              file=sys.stderr)
        return 2
    try:
        report = validate_config(cfg, theirs, device=parse_gpu(gpu))
    except ValueError as e:
        print(f"nemo-fp8 bridge: {e}", file=sys.stderr)
        return 2
    if _is_rank0():
        print(report.table(), flush=True)
    if report.errors:
        return 2
    try:
        container, expected = build_bridge_config(cfg, theirs)
    except (ValueError, ImportError) as e:
        print(f"nemo-fp8 bridge: {e}", file=sys.stderr)
        return 2
    mp = container.mixed_precision
    if _is_rank0():
        resolved = {k: getattr(mp, k, None) for k in bridge_mixed_precision_kwargs(build_recipe(cfg.recipe))}
        resolved.update({k: getattr(container.model, k, None) for k in ("moe_router_dtype",)})
        resolved["quant_recipe"] = "set" if getattr(container.model, "quant_recipe", None) is not None else None
        print("Megatron-Bridge resolved FP8 settings (mixed_precision + model):", flush=True)
        for k, v in resolved.items():
            print(f"  {k} = {v}", flush=True)
        print(f"  pass-through overrides: {theirs}", flush=True)
    if cfg.backend.get("dry_run", False):
        return 0
    from megatron.bridge.training.gpt_step import forward_step  # type: ignore
    from megatron.bridge.training.pretrain import pretrain  # type: ignore

    cb = bridge_callback(build_recipe(cfg.recipe), build_policy(cfg.get("policy")), expected_model_fields=expected,
                         strict=bool(cfg.backend.get("strict_audit", False)),
                         telemetry_interval=int(cfg.backend.get("telemetry_interval", 0)))
    if "callbacks" in inspect.signature(pretrain).parameters:
        pretrain(config=container, forward_step_func=forward_step, callbacks=[cb])
    else:
        log.warning("this Megatron-Bridge's pretrain() takes no callbacks: the run-time audit is skipped")
        pretrain(config=container, forward_step_func=forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
