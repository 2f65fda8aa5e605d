"""What Megatron-Bridge publishes and how a launch picks its model: Bridge's Llama 3 pretraining
recipes and the parallel layouts they are written for, our model names' recipe functions,
``backend.provider``, and Bridge's performance settings (``backend.perf``). No Bridge import: the
validator and the launcher both read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = [
    "BRIDGE_RECIPES",
    "BridgeLaunchError",
    "PERF_SETTINGS",
    "PROVIDER_MODES",
    "PerfSettings",
    "PUBLISHED_RECIPES",
    "PublishedRecipe",
    "bridge_recipe_name",
    "perf_settings",
    "provider_mode",
    "resolved_fp8_param_gather",
]


class BridgeLaunchError(ValueError):
    """A Bridge launch that cannot run as configured; the message says what to change."""


@dataclass(frozen=True)
class PublishedRecipe:
    """A Megatron-Bridge pretraining recipe function and the parallel layout it is written for
    (Megatron-Bridge 0.6.2, ``recipes/llama/h100/llama3.py``)."""

    fn: str
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    virtual_pipeline: Optional[int]
    seq_length: int

    @property
    def gpus(self) -> int:
        """GPUs one model replica needs (TP x PP x CP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


#: Bridge's published Llama 3 pretraining recipes (what ``backend.provider=auto`` uses for them).
PUBLISHED_RECIPES = {
    "llama3_8b": PublishedRecipe("llama3_8b_pretrain_config", 1, 1, 2, None, 8192),
    "llama3_70b": PublishedRecipe("llama3_70b_pretrain_config", 4, 4, 2, 5, 8192),
    "llama31_405b": PublishedRecipe("llama31_405b_pretrain_config", 8, 8, 4, 2, 131072),
}
PROVIDER_MODES = ("auto", "recipe", "ours")

#: Our model name -> Megatron-Bridge pretrain recipe function (``megatron.bridge.recipes``).
BRIDGE_RECIPES = {
    "llama3_8b": "llama3_8b_pretrain_config",
    "llama3_70b": "llama3_70b_pretrain_config",
    "llama31_405b": "llama31_405b_pretrain_config",
    "deepseek_v3": "deepseek_v3_pretrain_config",  # MoE: router policy (moe_router_dtype=fp32)
}


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


def provider_mode(model: str, provider: str = "auto", recipe_fn: Optional[str] = None) -> str:
    """``"recipe"`` (a Bridge recipe function builds the model) or ``"ours"`` (built from our model
    config): ``backend.recipe_fn`` forces ``recipe``; ``auto`` is ``recipe`` for the sizes Bridge
    publishes a recipe for (:data:`PUBLISHED_RECIPES`) and ``ours`` for the rest."""
    provider = str(provider or "auto")
    if provider not in PROVIDER_MODES:
        raise BridgeLaunchError(
            f"backend.provider={provider!r} is not valid; choose one of: {', '.join(PROVIDER_MODES)}"
        )
    if recipe_fn:
        if provider == "ours":
            raise BridgeLaunchError(
                "backend.recipe_fn names a Bridge recipe function, which builds its own model; "
                "with backend.provider=ours leave it unset"
            )
        return "recipe"
    if provider == "auto":
        return "recipe" if model in PUBLISHED_RECIPES else "ours"
    if provider == "recipe" and model not in BRIDGE_RECIPES:
        try:
            bridge_recipe_name(model)
        except ValueError as e:  # lists what exists
            raise BridgeLaunchError(str(e)) from None
    return provider


@dataclass(frozen=True)
class PerfSettings:
    """Megatron-Bridge's performance configuration of one model on one GPU type — what its flat
    performance recipes (``megatron.bridge.perf_recipes``) set beyond the model shape, the parallel
    layout and the batch — as fields of a ``ConfigContainer`` (``backend.perf=<name>``).

    Transcribed from Megatron-Bridge 0.6.2 (the functions in :attr:`source`), because those
    functions read the model's config from the gated Hugging Face hub and import every model
    family's recipes; the CPU tests check every value against Bridge's source. The parallel
    layout, batch sizes, run length and learning-rate schedule stay the run's own (``trainer.*``,
    ``backend.*_parallel``); what one process or this installation cannot reproduce is listed in
    :attr:`not_reproduced` and printed with the launch plan.
    """

    name: str
    source: Tuple[str, ...]
    #: ``(dotted ConfigContainer field, value)`` for every precision, in the order set.
    fields: Tuple[Tuple[str, Any], ...]
    #: Process environment for every precision (Bridge sets it with ``os.environ.setdefault``).
    env: Mapping[str, Any]
    #: Extra fields and environment of the FP8 performance recipe (Bridge's ``fp8cs``).
    fp8_fields: Tuple[Tuple[str, Any], ...] = ()
    fp8_env: Mapping[str, Any] = field(default_factory=dict)
    #: Extra environment of the BF16 performance recipe.
    bf16_env: Mapping[str, Any] = field(default_factory=dict)
    #: ``fp8_param_gather`` (FP8 primary weights) of Bridge's mixed-precision preset per recipe of
    #: ours, used when ``backend.fp8_param_gather`` is left unset (null).
    fp8_param_gather: Mapping[str, bool] = field(default_factory=dict)
    not_reproduced: Tuple[str, ...] = ()

    def settings(self, fp8: bool) -> Tuple[Tuple[str, Any], ...]:
        """The fields to set for a BF16 (``fp8=False``) or FP8 run, in order."""
        return self.fields + (self.fp8_fields if fp8 else ())

    def environment(self, fp8: bool) -> Dict[str, Any]:
        """The process environment for a BF16 or FP8 run."""
        return {**self.env, **(self.fp8_env if fp8 else self.bf16_env)}


_LLAMA3_8B_H100 = PerfSettings(
    name="llama3_8b_h100",
    source=(
        "perf_recipes/llama/h100/llama3.py: llama3_8b_pretrain_8gpu_h100_bf16_config, "
        "llama3_8b_pretrain_8gpu_h100_fp8cs_config",
        "perf_recipes/llama/common.py: _llama_benchmark_common",
        "perf_recipes/_common.py: _benchmark_common, _perf_precision",
        "recipes/llama/h100/llama3.py: llama3_8b_pretrain_2gpu_h100_bf16_config (the base recipe)",
    ),
    fields=(
        # the base recipe
        ("train.manual_gc", True),
        ("train.manual_gc_interval", 100),
        ("model.transformer_impl", "transformer_engine"),
        ("model.cuda_graph_impl", "none"),
        ("model.attention_backend", None),
        ("model.cross_entropy_loss_fusion", True),
        ("optimizer.use_precision_aware_optimizer", False),
        ("ddp.overlap_grad_reduce", True),
        ("ddp.overlap_param_gather", True),
        ("ddp.use_distributed_optimizer", True),
        ("ddp.use_megatron_fsdp", False),
        ("ddp.average_in_collective", True),
        ("ddp.data_parallel_sharding_strategy", "no_shard"),
        # _benchmark_common / _llama_benchmark_common (run length, schedule and logging stay the run's)
        ("tokenizer.use_tokenizer_vocab_size", False),
        ("ddp.check_for_nan_in_grad", False),
        ("ddp.check_for_large_grads", False),
        ("rerun_state_machine.check_for_nan_in_loss", False),
        ("model.apply_rope_fusion", True),
        ("model.cross_entropy_fusion_impl", "te"),
        ("mixed_precision.grad_reduce_in_fp32", False),
        ("ddp.grad_reduce_in_fp32", False),
        ("model.cuda_graph_scope", []),
        ("rng.te_rng_tracker", False),
        ("model.use_te_rng_tracker", False),
    ),
    env={
        "TORCH_NCCL_HIGH_PRIORITY": 1,
        "NCCL_GRAPH_REGISTER": 0,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": 1,
        "NCCL_NVLS_ENABLE": 0,
        "NVTE_BWD_LAYERNORM_SM_MARGIN": 20,
        "NVTE_FWD_LAYERNORM_SM_MARGIN": 20,
    },
    bf16_env={"CUDA_DEVICE_MAX_CONNECTIONS": 1},
    fp8_env={
        "CUDA_DEVICE_MAX_CONNECTIONS": 32,
        "NCCL_CTA_POLICY": 1,
        "NVTE_NORM_BWD_USE_CUDNN": 1,
        "NVTE_NORM_FWD_USE_CUDNN": 1,
    },
    # fp8cs: bf16_with_fp8_current_scaling_mixed; Bridge's delayed preset (fp8_ds) gathers FP8
    # weights too, its blockwise preset (fp8_sc, bf16_with_fp8_subchannel_scaling_mixed) does not
    fp8_param_gather={"tensorwise": True, "delayed": True, "blockwise": False, "mxfp8": True},
    not_reproduced=(
        "Bridge's layout is 8 GPUs: data parallel 8 (FP8) or 4 with context parallel 2 (BF16), global batch 128; "
        "one process has no gradient reduce-scatter or parameter all-gather to overlap",
        "the FP8 recipe recomputes 5 of 32 layers (full, block) to fit an 80 GB card; set "
        "model.recompute_granularity=full model.recompute_method=block model.recompute_num_layers=N to match",
        "gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda (Megatron's output layer) and "
        "is on only where that is installed",
        "Bridge publishes H100 8B performance recipes for BF16 and FP8 current scaling only; the other recipes "
        "run these settings with their own mixed-precision fields",
    ),
)

#: Bridge's performance settings by ``backend.perf`` name.
PERF_SETTINGS: Dict[str, PerfSettings] = {s.name: s for s in (_LLAMA3_8B_H100,)}


def perf_settings(name: Optional[str]) -> Optional[PerfSettings]:
    """The :class:`PerfSettings` named by ``backend.perf`` (None when unset)."""
    if name is None or str(name) in ("", "null", "none"):
        return None
    if str(name) not in PERF_SETTINGS:
        raise BridgeLaunchError(
            f"backend.perf={name!r} is not known; choose one of: {', '.join(PERF_SETTINGS)} (Megatron-Bridge's "
            "performance settings), or leave it unset for Bridge's pretraining defaults"
        )
    return PERF_SETTINGS[str(name)]


def resolved_fp8_param_gather(backend_cfg: Mapping[str, Any], recipe_name: str) -> bool:
    """``backend.fp8_param_gather`` as the launch applies it: the value given, else (null) the
    value of Bridge's mixed-precision preset for ``recipe_name`` under ``backend.perf``, else False."""
    given = backend_cfg.get("fp8_param_gather", None)
    if given is not None:
        return bool(given)
    perf = perf_settings(backend_cfg.get("perf", None))
    return bool(perf.fp8_param_gather.get(recipe_name, False)) if perf is not None else False
