"""The Megatron-Bridge launcher behind ``python -m nemo_fp8_recipes.integrations.bridge``: which
model and how it is built (Bridge's published recipe function, or a ``GPTModelProvider`` from our
model config, :func:`provider_kwargs`), our ``trainer.*`` mapped onto Bridge's fields
(:func:`trainer_settings`), the world-size check, the resolved :func:`launch_plan` and the
``ConfigContainer`` built from it (:func:`build_bridge_config`). Bridge itself is imported only
by :func:`build_bridge_config` and what it calls; the command line and its documentation are in
:mod:`nemo_fp8_recipes.integrations.bridge`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...policy import PrecisionPolicy
from ...recipes import Recipe
from ..te import prepare_te_env
from .precision import (
    MODEL_FP8_FIELDS,
    bridge_mixed_precision_config,
    bridge_mixed_precision_kwargs,
    bridge_model_fields,
    expected_model_fields,
)
from .recipes import (
    PUBLISHED_RECIPES,
    BridgeLaunchError,
    bridge_recipe_name,
    perf_settings,
    provider_mode,
    resolved_fp8_param_gather,
)

__all__ = [
    "provider_kwargs",
    "trainer_settings",
    "check_world_size",
    "launch_plan",
    "build_bridge_config",
    "apply_perf_environment",
    "use_prebuilt_dataset_helpers",
]

log = logging.getLogger(__name__)


# ---- which model, how it is built -------------------------------------------------------------------
def _apex_wgrad_fusion() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # type: ignore  # noqa: F401
    except ImportError:
        return False
    return True


def provider_kwargs(
    mcfg,
    *,
    seq_length: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    gradient_accumulation_fusion: Optional[bool] = None,
) -> Dict[str, Any]:
    """``GPTModelProvider(**kwargs)`` for one of our (dense Llama) model configs: the fields
    Megatron-Bridge's Hugging Face Llama conversion sets (``models/conversion/model_bridge.py``'s
    field map plus ``models/llama/llama_bridge.py``), computed from our config instead of a hub
    download; Llama 3.1 RoPE scaling when the config has it. Pure data (imports torch only)."""
    import torch
    import torch.nn.functional as F

    if mcfg.arch != "llama":
        raise BridgeLaunchError(
            f"model={mcfg.name} (arch {mcfg.arch}) cannot be built offline for Megatron-Bridge: only dense Llama "
            "configs are mapped; give a Bridge recipe function with backend.recipe_fn=<name> (e.g. "
            "deepseek_v3_pretrain_config)"
        )
    for name, v in (
        ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel),
        ("context_parallel", context_parallel),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BridgeLaunchError(f"backend.{name} must be an integer >= 1, got {v!r}")
    if sequence_parallel and tensor_parallel < 2:
        raise BridgeLaunchError("backend.sequence_parallel=true needs backend.tensor_parallel >= 2")
    if mcfg.num_heads % tensor_parallel or mcfg.num_kv_heads % tensor_parallel:
        raise BridgeLaunchError(
            f"backend.tensor_parallel={tensor_parallel} must divide model.num_heads "
            f"({mcfg.num_heads}) and model.num_kv_heads ({mcfg.num_kv_heads})"
        )
    if mcfg.num_layers % pipeline_parallel:
        raise BridgeLaunchError(
            f"backend.pipeline_parallel={pipeline_parallel} must divide model.num_layers ({mcfg.num_layers})"
        )
    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = _apex_wgrad_fusion()
    scaled = float(getattr(mcfg, "rope_scaling_factor", 1.0) or 1.0)
    return {
        "num_layers": mcfg.num_layers,
        "hidden_size": mcfg.dim,
        "ffn_hidden_size": mcfg.ffn_dim,
        "num_attention_heads": mcfg.num_heads,
        "num_query_groups": mcfg.num_kv_heads,
        "kv_channels": mcfg.head_dim,
        "vocab_size": mcfg.vocab_size,
        "make_vocab_size_divisible_by": 128,
        "seq_length": int(seq_length),
        "layernorm_epsilon": mcfg.norm_eps,
        "init_method_std": mcfg.init_std,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "share_embeddings_and_output_weights": False,
        "position_embedding_type": "rope",
        "rotary_base": mcfg.rope_theta,
        "rotary_percent": 1.0,
        "rope_scaling": scaled > 1.0,
        "rope_scaling_factor": scaled if scaled > 1.0 else 1.0,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bias_activation_fusion": True,
        "masked_softmax_fusion": True,
        "persist_layer_norm": True,
        "bias_dropout_fusion": True,
        "apply_rope_fusion": True,
        "bf16": True,
        "fp16": False,
        "params_dtype": torch.bfloat16,
        "tensor_model_parallel_size": tensor_parallel,
        "pipeline_model_parallel_size": pipeline_parallel,
        "context_parallel_size": context_parallel,
        "sequence_parallel": bool(sequence_parallel),
        "pipeline_dtype": torch.bfloat16 if pipeline_parallel > 1 else None,
        "gradient_accumulation_fusion": bool(gradient_accumulation_fusion),
    }


def trainer_settings(tcfg, run_dir: Path) -> List[Tuple[str, Any]]:
    """Our ``trainer.*`` (and the run directory) as Bridge ``ConfigContainer`` fields, in the order
    they are set: ``(dotted field, value)``. Pass-through Bridge overrides are applied after them."""
    ckpt_every = min(tcfg.ckpt_interval or tcfg.max_steps, tcfg.max_steps)
    return [
        ("train.train_iters", tcfg.max_steps),
        ("train.micro_batch_size", tcfg.micro_batch_size),
        ("train.global_batch_size", tcfg.global_batch_size),
        ("dataset.seq_length", tcfg.seq_len),
        ("model.seq_length", tcfg.seq_len),
        ("optimizer.lr", tcfg.lr),
        ("optimizer.min_lr", tcfg.min_lr),
        ("optimizer.weight_decay", tcfg.weight_decay),
        ("optimizer.adam_beta1", tcfg.beta1),
        ("optimizer.adam_beta2", tcfg.beta2),
        ("optimizer.adam_eps", tcfg.eps),
        ("optimizer.clip_grad", tcfg.grad_clip),
        ("scheduler.lr_warmup_iters", tcfg.warmup_steps),
        ("scheduler.lr_decay_iters", tcfg.max_steps),
        ("rng.seed", tcfg.seed),
        ("dataset.random_seed", tcfg.seed),
        ("logger.log_interval", max(1, tcfg.log_interval)),
        ("logger.tensorboard_dir", str(run_dir)),
        ("validation.eval_interval", min(tcfg.val_interval or tcfg.max_steps, tcfg.max_steps)),
        ("validation.eval_iters", max(1, tcfg.val_steps)),
        # trainer.checkpoint=false: Bridge saves nothing (a null checkpoint.save), as the trainer does
        ("checkpoint.save", str(run_dir / "checkpoints") if tcfg.checkpoint else None),
        ("checkpoint.load", str(run_dir / "checkpoints")),
        ("checkpoint.save_interval", ckpt_every if tcfg.checkpoint else None),
    ]


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_world_size(tp: int, pp: int, cp: int, what: str, world: Optional[int] = None) -> None:
    """A run whose world size cannot hold one model replica (TP x PP x CP GPUs) is refused."""
    world = _world_size() if world is None else world
    need = tp * pp * cp
    if world < need or world % need:
        raise BridgeLaunchError(
            f"{what} needs a multiple of {need} GPUs (tensor parallel {tp} x pipeline parallel {pp} x context parallel "
            f"{cp}); this run has {world} process(es). Launch it with torchrun --nproc-per-node / SLURM "
            f"cluster.nodes x cluster.gpus_per_node = {need} (or a multiple), or build the model offline with fewer "
            "layers on the GPUs you have: backend.provider=ours model.num_layers=<n> (backend.tensor_parallel etc.)"
        )


def _given(overrides: Sequence[str]) -> set:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def launch_plan(cfg, bridge_overrides: Sequence[str] = (), our_overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Everything the launch resolves, without importing Megatron-Bridge: the provider mode, the
    recipe function or the provider fields, the parallel layout and GPUs one replica needs, the
    FP8 ``mixed_precision`` and model fields, the trainer mapping, the run directory and the
    pass-through overrides. ``backend.dry_run=true`` prints it; :func:`build_bridge_config`
    builds from it."""
    from omegaconf import OmegaConf

    from ...config import build_policy, build_recipe, run_config, trainer_config
    from ...models import ModelConfig

    r = build_recipe(cfg.recipe)
    p = build_policy(cfg.get("policy"))
    b = cfg.backend
    model_name = str(cfg.model.name)
    mode = provider_mode(model_name, b.get("provider", "auto"), b.get("recipe_fn"))
    run_dir = Path(run_config(cfg).dir).expanduser().resolve()
    perf = perf_settings(b.get("perf"))
    fpg = resolved_fp8_param_gather(b, r.name)
    plan: Dict[str, Any] = {
        "model": model_name,
        "recipe": r.name,
        "provider": mode,
        "run_dir": str(run_dir),
        "mixed_precision": bridge_mixed_precision_kwargs(r, p, fp8_param_gather=fpg),
        "model_fields": {
            k: (v if k != "quant_recipe" else "per-module BF16 overrides (set)")
            for k, v in bridge_model_fields(r, p).items()
        }
        if r.is_fp8
        else {"moe_router_dtype": "fp32"},
        "te_env": {},
        "pass_through": list(bridge_overrides),
    }
    if r.is_fp8:
        from ..te import te_env

        plan["te_env"] = te_env(r)
    if mode == "recipe":
        fn = bridge_recipe_name(model_name, b.get("recipe_fn"))
        pub = next((v for v in PUBLISHED_RECIPES.values() if v.fn == fn), None)
        plan["recipe_fn"] = fn
        if pub is not None:
            plan["parallel"] = {
                "tensor_parallel": pub.tensor_parallel,
                "pipeline_parallel": pub.pipeline_parallel,
                "context_parallel": pub.context_parallel,
                "virtual_pipeline": pub.virtual_pipeline,
                "seq_length": pub.seq_length,
                "gpus_per_replica": pub.gpus,
            }
        ours = [o for o in our_overrides if o.split("=", 1)[0].lstrip("+~").split(".", 1)[0] == "trainer"]
        if ours:
            raise BridgeLaunchError(
                f"{', '.join(ours)}: trainer.* keys apply to backend.provider=ours; Bridge's recipe {fn} keeps its own "
                "schedule: override it with train.*, optimizer.*, scheduler.* (e.g. train.train_iters=100)"
            )
        plan["settings"] = [
            (k, v)
            for k, v in (("logger.tensorboard_dir", str(run_dir)), ("checkpoint.save", str(run_dir / "checkpoints")))
        ]
    else:
        mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        tcfg = trainer_config(cfg)
        par = dict(
            tensor_parallel=int(b.get("tensor_parallel", 1)),
            pipeline_parallel=int(b.get("pipeline_parallel", 1)),
            context_parallel=int(b.get("context_parallel", 1)),
            sequence_parallel=bool(b.get("sequence_parallel", False)),
        )
        kw = provider_kwargs(mcfg, seq_length=tcfg.seq_len, **par)
        plan["provider_kwargs"] = kw
        plan["parallel"] = {
            **par,
            "gpus_per_replica": par["tensor_parallel"] * par["pipeline_parallel"] * par["context_parallel"],
        }
        plan["settings"] = trainer_settings(tcfg, run_dir)
        data = b.get("data_path")
        data = (
            [str(d) for d in (data if isinstance(data, (list, tuple)) or OmegaConf.is_list(data) else [data])]
            if data
            else []
        )
        for prefix in data:
            if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
                raise BridgeLaunchError(
                    f"backend.data_path {prefix!r}: no Megatron indexed dataset there (want {prefix}.bin and "
                    f"{prefix}.idx, as Megatron-LM's tools/preprocess_data.py writes them); leave "
                    "backend.data_path unset for mock data"
                )
        plan["dataset"] = {"blend": data or None, "kind": "Megatron indexed dataset" if data else "mock data"}
        tok = b.get("tokenizer")
        if tok:
            if not Path(str(tok)).is_dir():
                raise BridgeLaunchError(
                    f"backend.tokenizer={tok}: not a directory; give a local Hugging Face tokenizer "
                    "directory (tokenizer.json / tokenizer_config.json), or leave it unset for "
                    "Bridge's NullTokenizer"
                )
            plan["tokenizer"] = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tok)}
        else:
            plan["tokenizer"] = {"tokenizer_type": "NullTokenizer", "vocab_size": mcfg.vocab_size}
        if not kw["gradient_accumulation_fusion"]:
            plan["notes"] = ["gradient_accumulation_fusion off: APEX's fused wgrad kernel is not installed"]
    given = _given(bridge_overrides)
    plan["settings"] = [(k, v) for k, v in plan["settings"] if k not in given]
    if perf is not None:
        plan["perf"] = {
            "name": perf.name,
            "source": list(perf.source),
            "settings": [(k, v) for k, v in perf.settings(r.is_fp8) if k not in given],
            "env": perf.environment(r.is_fp8),
            "not_reproduced": list(perf.not_reproduced),
        }
    need = plan.get("parallel", {}).get("gpus_per_replica")
    world = _world_size()
    if need and (world < need or world % need):
        plan.setdefault("notes", []).append(
            f"one model replica needs {need} GPUs; this process group has {world}: the launch itself would be refused "
            f"(run it under torchrun with a multiple of {need} processes)"
        )
    if fpg and need and world // need == 1:
        plan.setdefault("notes", []).append(
            "FP8 primary weights (backend.fp8_param_gather=true) with one data-parallel rank: they shrink the "
            "all-gather of the parameters across ranks, and there is none here; on one H100/H200 they cost Bridge's "
            "tensorwise and delayed runs their FP8 gain (0.79-0.93x its BF16, docs/performance.md): set "
            "backend.fp8_param_gather=false for a single-replica run"
        )
    return plan


def _setattr_path(obj: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, leaf, value)


def _check_recipe_owned(container, r: Recipe, p: Optional[PrecisionPolicy], fpg: bool) -> None:
    want = bridge_mixed_precision_kwargs(r, p, fp8_param_gather=fpg)
    mp = container.mixed_precision
    changed = {
        k: (getattr(mp, k, None), v) for k, v in want.items() if k in MODEL_FP8_FIELDS and getattr(mp, k, None) != v
    }
    if changed:
        raise ValueError(
            "the pass-through overrides changed recipe-owned mixed_precision fields: "
            + ", ".join(f"{k}={have!r} (recipe: {v!r})" for k, (have, v) in changed.items())
            + "; choose them with recipe=/recipe.*/policy.* instead"
        )


def build_bridge_config(
    cfg, bridge_overrides: Sequence[str] = (), our_overrides: Sequence[str] = ()
) -> Tuple[Any, Dict[str, Any]]:
    """Build Megatron-Bridge's ``ConfigContainer`` for a composed config (``backend=megatron_bridge``)
    and pass-through overrides; returns ``(config_container, expected_model_fields)``.

    Order: the model (Bridge recipe function, or our provider on Bridge's common pretraining
    defaults with tokenizer, data and our trainer mapping) -> our ``MixedPrecisionConfig`` ->
    pass-through overrides (on top, so allowed ``mixed_precision.*`` tweaks such as
    ``fp8_param_gather`` apply) -> our model-only fields -> a check that the recipe-owned fields
    are unchanged and that the world size holds one model replica.
    """
    from ...config import build_policy, build_recipe

    plan = launch_plan(cfg, bridge_overrides, our_overrides)
    r = build_recipe(cfg.recipe)
    p = build_policy(cfg.get("policy"))
    fpg = plan["mixed_precision"]["fp8_param_gather"]  # (backend.fp8_param_gather as resolved)
    if r.is_fp8:
        prepare_te_env(r)  # before anything imports Transformer Engine
    apply_perf_environment(plan)
    try:
        from megatron.bridge.training.utils.omegaconf_utils import (
            process_config_with_overrides,  # type: ignore
        )

        if plan["provider"] == "recipe":  # every model family's recipes (diffusion ones need diffusers)
            import megatron.bridge.recipes as bridge_recipes  # type: ignore
    except ImportError as e:
        raise ImportError(
            f"backend=megatron_bridge needs Megatron-Bridge (pip install megatron-bridge; Python >= 3.12, CUDA, "
            f"Transformer Engine): {e}. backend.dry_run=true prints the resolved settings without it, and "
            "nemo-fp8-check validates the same command line"
        ) from e
    if plan["provider"] == "recipe":
        fn = getattr(bridge_recipes, plan["recipe_fn"], None)
        if fn is None:
            raise ValueError(
                f"megatron.bridge.recipes has no {plan['recipe_fn']}; check backend.recipe_fn and the Bridge version"
            )
        container = fn()
    else:
        from megatron.bridge.models.gpt_provider import GPTModelProvider  # type: ignore
        from megatron.bridge.training.tokenizers.config import TokenizerConfig  # type: ignore

        container = _offline_container()
        container.model = GPTModelProvider(**plan["provider_kwargs"])
        container.tokenizer = TokenizerConfig(**plan["tokenizer"])
        container.dataset.blend = (plan["dataset"]["blend"], None) if plan["dataset"]["blend"] else None
    for key, value in plan["settings"]:
        _setattr_path(container, key, value)
    container.mixed_precision = bridge_mixed_precision_config(r, p, fp8_param_gather=fpg)
    perf = plan.get("perf")
    for key, value in perf["settings"] if perf else ():
        _setattr_path(container, key, value)
    env_vars = getattr(container, "env_vars", None)
    if isinstance(env_vars, dict):
        env_vars.update(perf["env"] if perf else {})
        env_vars.update(plan["te_env"])
    if bridge_overrides:
        container = process_config_with_overrides(container, cli_overrides=list(bridge_overrides))
    for k, v in bridge_model_fields(r, p).items():
        setattr(container.model, k, v)
    if getattr(container.model, "gradient_accumulation_fusion", False) and not _apex_wgrad_fusion():
        log.warning(
            "gradient_accumulation_fusion turned off: it needs APEX's fused wgrad kernel "
            "(fused_weight_gradient_mlp_cuda), which is not installed"
        )
        container.model.gradient_accumulation_fusion = False
    _check_recipe_owned(container, r, p, fpg)
    m = container.model
    check_world_size(
        int(getattr(m, "tensor_model_parallel_size", 1) or 1),
        int(getattr(m, "pipeline_model_parallel_size", 1) or 1),
        int(getattr(m, "context_parallel_size", 1) or 1),
        plan.get("recipe_fn") or f"model={plan['model']} (backend.provider=ours)",
    )
    return container, expected_model_fields(r, p)


def apply_perf_environment(plan: Dict[str, Any]) -> None:
    """Set the process environment of ``backend.perf`` (``CUDA_DEVICE_MAX_CONNECTIONS``, the
    NVTE_* norm settings, the allocator) where it is not set already, as Bridge does — before
    anything creates a CUDA context, which reads some of them once."""
    for k, v in (plan.get("perf") or {}).get("env", {}).items():
        os.environ.setdefault(k, str(v))


def _offline_container():
    """Bridge's ``ConfigContainer`` for a model built from our config, assembled from
    ``megatron.bridge.training.config`` alone: the package ``megatron.bridge.recipes`` imports
    every model family's recipes at once (diffusion models need ``diffusers``), which an offline
    LLM run does not. Defaults follow Bridge's pretraining recipes (distributed Adam, cosine
    decay, mock data until ``backend.data_path`` is set); the launch plan's settings (batch sizes,
    steps, learning rate, logging) are applied on top."""
    from megatron.bridge.training.config import (  # type: ignore
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        GPTDatasetConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.core.distributed import DistributedDataParallelConfig  # type: ignore

    return ConfigContainer(
        model=None,
        train=TrainingConfig(train_iters=1000, global_batch_size=32, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=500, eval_iters=32),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=3e-4,
            min_lr=3e-5,
            weight_decay=0.1,
            bf16=True,
            fp16=False,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        scheduler=SchedulerConfig(
            start_weight_decay=0.1,
            end_weight_decay=0.1,
            weight_decay_incr_style="constant",
            lr_decay_style="cosine",
            lr_warmup_iters=100,
            lr_warmup_init=0.0,
            override_opt_param_scheduler=True,
        ),
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            average_in_collective=True,
            use_distributed_optimizer=True,
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            seq_length=4096,
            num_dataset_builder_threads=1,
            blend=None,
            blend_per_split=None,
            split="9999,8,2",
            data_sharding=True,
            dataloader_type="single",
            skip_getting_attention_mask_from_dataset=True,
        ),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=None),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        checkpoint=CheckpointConfig(save_interval=None, save=None, load=None, ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        mixed_precision="bf16_mixed",
    )


def use_prebuilt_dataset_helpers() -> None:
    """Bridge compiles megatron-core's dataset helpers with ``make`` at start and exits if that
    fails; a wheel install ships them compiled but without the Makefile. Then use the compiled
    module (logged); with neither, stop with the fix."""
    import megatron.core.datasets as mds  # type: ignore

    here = Path(mds.__file__).parent
    if (here / "Makefile").is_file():
        return  # Bridge can build them itself
    try:
        from megatron.core.datasets import helpers_cpp  # type: ignore  # noqa: F401
    except ImportError as e:
        raise BridgeLaunchError(
            f"megatron-core's dataset helpers are neither compiled nor buildable here ({here} has no Makefile and "
            f"helpers_cpp does not import: {e}); reinstall megatron-core from a wheel built for this Python"
        ) from e
    import megatron.bridge.training.initialize as binit  # type: ignore

    def prebuilt() -> None:
        log.info("megatron-core's dataset helpers are prebuilt (%s); not compiling them", here)

    binit.compile_helpers = prebuilt
