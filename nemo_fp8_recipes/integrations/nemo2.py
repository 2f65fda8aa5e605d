"""NeMo 2.x (``nemo_toolkit<2.8``, ``nemo.collections.llm``): the ``MegatronMixedPrecision`` plugin
arguments for each recipe, and a Lightning callback. Legacy: NeMo's LLM training moved to
Megatron-Bridge (:mod:`.bridge`); this adapter is kept for containers that still run NeMo 2, and
is tested against a real nemo_toolkit 2.7.3 install (plugin built, its dtype overrides applied to a
megatron-core ``TransformerConfig``), not in a NeMo 2 training run.

NeMo 2's precision plugin (``nemo/lightning/pytorch/plugins/mixed_precision.py``) takes the FP8
settings as constructor arguments and, like Megatron-Bridge, copies them onto the model config
(``update_config_with_dtype_overrides``), so they must go through the plugin. Its arguments were
checked against the NeMo 2.x source: ``precision, params_dtype, pipeline_dtype, autocast_dtype,
autocast_enabled, grad_reduce_in_fp32, fp8, fp8_recipe, first_last_layers_bf16, fp8_margin,
fp8_amax_history_len, fp8_amax_compute_algo, fp8_wgrad, fp8_dot_product_attention,
fp8_multi_head_attention, fp8_params / fp8_param_gather, fp16_*, num_layers_at_start_in_bf16,
num_layers_at_end_in_bf16`` (nemo_toolkit 2.1.0, 2.2.0, 2.3.0 and 2.7.0 wheels).

Spelling trap: FP8 weights are ``fp8_params`` (plural) in NeMo 2.1 / 2.2, ``fp8_param_gather`` in
2.3 (NeMo 25.04), both in 2.7 (``fp8_params`` deprecated) — stored as ``DtypeConfig.fp8_param``
/ ``fp8_param_gather``, while Megatron-Core says ``fp8_param`` and Megatron-Bridge both. Passing
the wrong one is a ``TypeError`` (2.3) or a silent no-op default; :func:`nemo2_mixed_precision_kwargs`
uses whichever the installed NeMo takes (:data:`NEMO2_SIGNATURES`).
``moe_router_dtype`` is not a plugin argument: set it on the model config
(:func:`nemo2_model_overrides`).

Usage (NeMo 2.x / NeMo-Run)::

    from nemo import lightning as nl
    from nemo_fp8_recipes.integrations import nemo2
    plugin = nemo2.megatron_mixed_precision("blockwise", policy)
    trainer = nl.Trainer(..., plugins=plugin, callbacks=nemo2.nemo2_callbacks("blockwise", policy))
"""

from __future__ import annotations

import inspect
from typing import Any, Collection, Dict, List, Optional, Union

from ..policy import PrecisionPolicy
from ..recipes import Recipe, ScalingKind, get_recipe
from .megatron import megatron_config

__all__ = [
    "NEMO2_MIXED_PRECISION_ARGS",
    "NEMO2_SIGNATURES",
    "nemo2_mixed_precision_kwargs",
    "megatron_mixed_precision",
    "nemo2_model_overrides",
    "nemo2_callbacks",
]

_COMMON = (
    "precision",
    "params_dtype",
    "pipeline_dtype",
    "autocast_dtype",
    "autocast_enabled",
    "grad_reduce_in_fp32",
    "fp8",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "fp16_loss_scale",
    "fp16_initial_loss_scale",
    "fp16_min_loss_scale",
    "fp16_loss_scale_window",
    "fp16_hysteresis",
)
_BF16_LAYERS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
#: ``MegatronMixedPrecision.__init__`` arguments by NeMo release, read from the nemo_toolkit wheels
#: (``nemo/lightning/pytorch/plugins/mixed_precision.py``): 2.1 / 2.2 take ``fp8_params`` and no
#: ``fp8_recipe`` (delayed scaling only); 2.3 (NeMo 25.04) renamed it ``fp8_param_gather`` and added
#: ``fp8_recipe`` and the BF16 layer counts; 2.7 accepts both spellings (``fp8_params`` deprecated)
#: and adds ``reuse_grad_buf_for_mxfp8_param_ag`` and ``fp4``/``fp4_recipe``.
NEMO2_SIGNATURES = {
    "2.2": _COMMON + ("fp8_params",),
    "2.3": _COMMON + ("fp8_recipe", "fp8_param_gather") + _BF16_LAYERS,
    "2.7": _COMMON
    + ("fp8_recipe", "fp8_params", "fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "fp4", "fp4_recipe")
    + _BF16_LAYERS,
}
#: The newest (used when NeMo is not installed).
NEMO2_MIXED_PRECISION_ARGS = NEMO2_SIGNATURES["2.7"]

# Arguments an older NeMo 2.x may lack, with the value that means "not used".
_NEUTRAL = {
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
    "fp8_recipe": "delayed",
    "fp8_dot_product_attention": False,
    "fp8_multi_head_attention": False,
    "fp8_wgrad": True,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
}


def _installed_signature() -> Optional[set]:
    try:
        from nemo.lightning.pytorch.plugins.mixed_precision import (
            MegatronMixedPrecision,  # type: ignore
        )
    except Exception:  # noqa: BLE001 - NeMo absent
        return None
    return set(inspect.signature(MegatronMixedPrecision.__init__).parameters) - {"self"}


def nemo2_mixed_precision_kwargs(
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    *,
    fp8_param_gather: bool = False,
    signature: Optional[Collection[str]] = None,
) -> Dict[str, Any]:
    """``MegatronMixedPrecision(**kwargs)`` for ``recipe``: ``bf16-mixed`` with BF16 params and
    every FP8 field pinned from :func:`~.megatron.megatron_config`.

    ``signature``: the plugin's argument names (default: the installed NeMo's, else
    :data:`NEMO2_MIXED_PRECISION_ARGS`). With ``fp8_param_gather`` in it that spelling is used,
    otherwise ``fp8_params``; arguments an older NeMo lacks are dropped when unused and refused
    (naming the NeMo version to use) when the recipe needs them.
    """
    import torch

    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    sig = set(signature) if signature is not None else (_installed_signature() or set(NEMO2_MIXED_PRECISION_ARGS))
    kw: Dict[str, Any] = {
        "precision": "bf16-mixed",
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16,
        "autocast_enabled": False,
        "grad_reduce_in_fp32": True,
    }
    if r.is_fp8:
        mc = megatron_config(r, policy, backend="te", fp8_param=fp8_param_gather)
        for k in (
            "fp8",
            "fp8_recipe",
            "first_last_layers_bf16",
            "fp8_margin",
            "fp8_amax_history_len",
            "fp8_amax_compute_algo",
            "fp8_wgrad",
            "fp8_dot_product_attention",
            "fp8_multi_head_attention",
            "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16",
        ):
            kw[k] = mc[k]
    else:
        kw["fp8"] = None
    gather_key = "fp8_param_gather" if "fp8_param_gather" in sig else "fp8_params"
    kw[gather_key] = bool(fp8_param_gather)
    if r.scaling_kind is ScalingKind.MICROSCALING:
        kw["reuse_grad_buf_for_mxfp8_param_ag"] = bool(fp8_param_gather)
    out = {}
    for k, v in kw.items():
        if k in sig:
            out[k] = v
        elif k in _NEUTRAL and v == _NEUTRAL[k]:
            continue
        else:
            raise ValueError(
                f"the installed NeMo's MegatronMixedPrecision has no argument {k!r}, which recipe {r.name} needs "
                f"({k}={v!r}); use NeMo 25.04 (nemo_toolkit 2.3) or later 2.x, or Megatron-Bridge"
            )
    return out


def megatron_mixed_precision(
    recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, *, fp8_param_gather: bool = False
):
    """The real NeMo 2.x ``MegatronMixedPrecision`` plugin for ``recipe`` (imports NeMo; the NVTE_*
    environment is set first, see :func:`~.te.prepare_te_env`)."""
    from .te import prepare_te_env

    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    if r.is_fp8:
        prepare_te_env(r)
    from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision  # type: ignore

    return MegatronMixedPrecision(**nemo2_mixed_precision_kwargs(r, policy, fp8_param_gather=fp8_param_gather))


def nemo2_model_overrides(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None) -> Dict[str, Any]:
    """Model-config fields the plugin does not carry: ``moe_router_dtype="fp32"`` and, when the
    policy needs per-module BF16 overrides, ``quant_recipe`` (set them on ``llm.GPTConfig``)."""
    from .bridge.precision import bridge_model_fields

    return bridge_model_fields(recipe, policy)


def nemo2_callbacks(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, **kwargs) -> List[Any]:
    """``[lightning callback]`` applying, auditing and logging the policy on the TE modules (see
    :func:`~.callbacks.lightning_callback`; ``strict``, ``telemetry_interval``, ``log_dir``)."""
    from .callbacks import lightning_callback

    return [lightning_callback(recipe, policy, **kwargs)]
