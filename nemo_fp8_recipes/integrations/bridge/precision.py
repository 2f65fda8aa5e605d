"""Our recipe as Megatron-Bridge's ``MixedPrecisionConfig``, and the model fields beside it.

Bridge's ``MixedPrecisionConfig.setup(model, optimizer, ddp)`` copies *every* same-named field
onto the model, optimizer and DDP configs, so a recipe set on the model alone is replaced by the
mixed-precision defaults (``fp8_recipe="tensorwise"``, history 1, no BF16 layers). The whole
recipe therefore goes into the ``MixedPrecisionConfig`` (:func:`bridge_mixed_precision_kwargs`);
the fields that config does not have go on the model (:func:`bridge_model_fields`), and
:func:`expected_model_fields` is what the Bridge callback checks at train start. No Bridge import
except in :func:`bridge_mixed_precision_config`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from ...policy import PrecisionPolicy
from ...recipes import Recipe, ScalingKind, get_recipe
from ..megatron import MegatronFP8Config, megatron_config

__all__ = [
    "bridge_mixed_precision_kwargs",
    "bridge_mixed_precision_config",
    "bridge_model_fields",
    "expected_model_fields",
    "MODEL_FP8_FIELDS",
]

#: The FP8 fields ``setup()`` copies onto the model config, which must survive to train start.
MODEL_FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)


def _mc(recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy], fp8_param_gather: bool) -> MegatronFP8Config:
    return megatron_config(recipe, policy, backend="te", fp8_param=fp8_param_gather)


def bridge_mixed_precision_kwargs(
    recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, *, fp8_param_gather: bool = False
) -> Dict[str, Any]:
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
        kw.update(
            fp8=None,
            fp8_param=False,
            fp8_param_gather=False,
            first_last_layers_bf16=False,
            num_layers_at_start_in_bf16=0,
            num_layers_at_end_in_bf16=0,
        )
        return kw
    mc = _mc(r, policy, fp8_param_gather)
    for k in MODEL_FP8_FIELDS:
        kw[k] = mc[k]
    kw["fp8_param"] = bool(fp8_param_gather)
    kw["fp8_param_gather"] = bool(fp8_param_gather)
    kw["reuse_grad_buf_for_mxfp8_param_ag"] = bool(fp8_param_gather and r.scaling_kind is ScalingKind.MICROSCALING)
    return kw


def bridge_mixed_precision_config(
    recipe: Union[str, Recipe], policy: Optional[PrecisionPolicy] = None, *, fp8_param_gather: bool = False
):
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
    out = {k: kw[k] for k in ("fp8",) + MODEL_FP8_FIELDS if k in kw}
    out["moe_router_dtype"] = "fp32"
    return out
