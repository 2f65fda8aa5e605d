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

    # Bridge's published Llama 3 8B recipe (context parallel 2: at least 2 GPUs), our FP8 recipe
    torchrun --nproc-per-node 8 -m nemo_fp8_recipes.integrations.bridge \\
        model=llama3_8b recipe=blockwise policy.first_layers_bf16=1 train.train_iters=100
    # any model of ours built offline (no Hugging Face hub), mock data, one GPU
    torchrun --nproc-per-node 1 -m nemo_fp8_recipes.integrations.bridge \\
        model=llama3_tiny recipe=tensorwise trainer.max_steps=20 backend.strict_audit=true

Two ways to get the model (``backend.provider``):

``recipe`` (``auto`` for ``llama3_8b``, ``llama3_70b``, ``llama31_405b``)
    Bridge's published pretraining recipe function (:data:`PUBLISHED_RECIPES`; it reads the
    model's config from the Hugging Face hub, and needs the parallel layout it was written for:
    8B TP1·PP1·CP2 = 2 GPUs, 70B TP4·PP4·CP2 = 32, 405B TP8·PP8·CP4 = 256 — a world size that
    cannot hold it is refused). ``backend.recipe_fn=<name>`` picks any other function.
``ours`` (``auto`` for every other model)
    A ``GPTModelProvider`` built from our model config (:func:`provider_kwargs`: the fields
    Bridge's own Llama conversion sets, from ``model.*``), on Bridge's common pretraining
    defaults, with our ``trainer.*`` keys mapped onto Bridge's (:func:`trainer_settings`), mock
    data or a Megatron indexed dataset (``backend.data_path``), and Bridge's ``NullTokenizer`` or
    a local Hugging Face tokenizer (``backend.tokenizer``). Nothing is downloaded. Parallelism
    from ``backend.tensor_parallel`` / ``pipeline_parallel`` / ``context_parallel`` /
    ``sequence_parallel``. Dense Llama models only (MoE: ``backend.recipe_fn``).

Our keys (``recipe=``, ``recipe.*``, ``policy.*``, ``model=<name>``, ``backend.*``, ``trainer.*``,
``run.*``; with ``provider=ours`` also our ``model.<field>``) are composed with the trainer's
Hydra tree (``backend=megatron_bridge``); everything else is passed through to Bridge's
``process_config_with_overrides`` (``train.*``, ``optimizer.*``, ``model.*`` fields of the model
provider, ``dataset.*``, ``checkpoint.*``, ``ddp.*``, ``mixed_precision.*`` that the recipe does
not own) and wins over what we set. ``nemo-fp8-check`` runs first and refuses the traps of the
Megatron-Bridge section of ``docs/megatron.md``. TensorBoard events and checkpoints go to the
run directory (``runs/<model>/<recipe>[-<tag>]``), so ``nemo-fp8-compare runs/<model>`` compares
Bridge runs as it compares the embedded trainer's.

Bridge's performance settings (``backend.perf=llama3_8b_h100``, with ``provider=ours``): the
fields and process environment Bridge's own H100 Llama 3 8B performance recipes set beyond the
model shape, layout and batch (fused cross entropy and RoPE, manual garbage collection every 100
steps, no NaN or large-gradient checks, BF16 gradient reduction, distributed optimizer without
sharding, ``CUDA_DEVICE_MAX_CONNECTIONS``, cuDNN norms for FP8); ``backend.fp8_param_gather`` then
follows Bridge's mixed-precision preset of the recipe unless given. The plan prints them with what
one process cannot reproduce (the 8-GPU layout, recompute, APEX's wgrad fusion).

Traps handled (seen with Bridge 0.6.2 on an H200): Bridge runs ``make`` on megatron-core's dataset
helpers at start and exits when that fails — a wheel install has them compiled but no Makefile,
so the prebuilt module is used then (logged); ``gradient_accumulation_fusion`` needs APEX's fused
wgrad kernel and is turned off (logged) when it is not installed. ``backend.dry_run=true`` prints
everything resolved (FP8 settings, provider or recipe function, parallel layout, GPUs needed,
trainer mapping) without importing Bridge.

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
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .launch import build_bridge_config, launch_plan, use_prebuilt_dataset_helpers

__all__ = ["main"]


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print_plan(plan: Dict[str, Any]) -> None:
    print(
        f"Megatron-Bridge launch: model={plan['model']} recipe={plan['recipe']} provider={plan['provider']}"
        + (f" ({plan['recipe_fn']})" if plan.get("recipe_fn") else " (built from our model config, offline)"),
        flush=True,
    )
    print("  FP8 settings (mixed_precision):", flush=True)
    for k, v in plan["mixed_precision"].items():
        print(f"    {k} = {v}", flush=True)
    print("  model fields set beside it:", flush=True)
    for k, v in plan["model_fields"].items():
        print(f"    {k} = {v}", flush=True)
    if plan["te_env"]:
        print(
            "  Transformer Engine environment: " + ", ".join(f"{k}={v}" for k, v in plan["te_env"].items()), flush=True
        )
    par = plan.get("parallel")
    if par:
        print("  parallel layout: " + ", ".join(f"{k}={v}" for k, v in par.items()), flush=True)
    if plan.get("provider_kwargs"):
        kw = plan["provider_kwargs"]
        print(
            "  GPTModelProvider: "
            + ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in kw.items() if not k.endswith("_parallel_size")),
            flush=True,
        )
        print(
            f"  tokenizer: {plan['tokenizer']}; data: {plan['dataset']['kind']}"
            + (f" {plan['dataset']['blend']}" if plan["dataset"]["blend"] else ""),
            flush=True,
        )
    if plan["settings"]:
        print("  set on the ConfigContainer: " + ", ".join(f"{k}={v}" for k, v in plan["settings"]), flush=True)
    perf = plan.get("perf")
    if perf:
        print(f"  Megatron-Bridge performance settings ({perf['name']}; from {'; '.join(perf['source'])}):", flush=True)
        print("    " + ", ".join(f"{k}={v}" for k, v in perf["settings"]), flush=True)
        print("    environment: " + ", ".join(f"{k}={v}" for k, v in perf["env"].items()), flush=True)
        for line in perf["not_reproduced"]:
            print(f"    not reproduced here: {line}", flush=True)
    for note in plan.get("notes", ()):
        print(f"  note: {note}", flush=True)
    print(f"  pass-through overrides: {plan['pass_through']}", flush=True)
    print(f"  run directory: {plan['run_dir']} (TensorBoard events, checkpoints, audit.txt)", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nemo_fp8_recipes.integrations.bridge [--gpu h100] [--cuda 12.8] <overrides>``: validate,
    build and run Megatron-Bridge pretraining with our recipe (``backend.dry_run=true``: resolve,
    print and stop, without importing Bridge)."""
    from ...config import (
        ConfigError,
        build_policy,
        build_recipe,
        checked_config,
    )
    from ..callbacks import bridge_callback
    from ..validate import parse_gpu, split_overrides, validate_config

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    flags = {"--gpu": None, "--cuda": None}
    for flag in flags:
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                print(f"nemo-fp8 bridge: {flag} needs a value (--gpu h100|h200|b200|..., --cuda 12.8)", file=sys.stderr)
                return 2
            flags[flag] = args[i + 1]
            del args[i : i + 2]
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        print(
            f"nemo-fp8 bridge: unknown option {unknown[0]}; the options are --gpu NAME (the GPU to check "
            "against; default: this machine's), --cuda VERSION and --help, the rest are overrides (key=value)",
            file=sys.stderr,
        )
        return 2
    gpu = flags["--gpu"]
    if not any(a.split("=", 1)[0].lstrip("+") == "backend" for a in args):
        args.append("backend=megatron_bridge")
    ours, theirs = split_overrides(args, backend="megatron_bridge")
    cfg, problem = checked_config(ours)
    if problem:
        print(f"nemo-fp8 bridge: {problem}", file=sys.stderr)
        return 2
    if cfg.backend.name != "megatron_bridge":
        print(
            f"nemo-fp8 bridge: backend={cfg.backend.name}; this entry point runs backend=megatron_bridge",
            file=sys.stderr,
        )
        return 2
    try:
        report = validate_config(cfg, theirs, device=parse_gpu(gpu, cuda=flags["--cuda"]))
    except (ValueError, ConfigError) as e:
        print(f"nemo-fp8 bridge: {e}", file=sys.stderr)
        return 2
    if _is_rank0():
        print(report.table(), flush=True)
    if report.errors:
        return 2
    try:
        plan = launch_plan(cfg, theirs, ours)
    except (ValueError, ConfigError) as e:
        print(f"nemo-fp8 bridge: {e}", file=sys.stderr)
        return 2
    if _is_rank0():
        _print_plan(plan)
    if cfg.backend.get("dry_run", False):
        return 0
    try:
        container, expected = build_bridge_config(cfg, theirs, ours)
        use_prebuilt_dataset_helpers()
    except (ValueError, ImportError) as e:
        print(f"nemo-fp8 bridge: {e}", file=sys.stderr)
        return 2
    from megatron.bridge.training.gpt_step import forward_step  # type: ignore
    from megatron.bridge.training.pretrain import pretrain  # type: ignore

    run_dir = Path(plan["run_dir"])
    if _is_rank0():
        run_dir.mkdir(parents=True, exist_ok=True)
    cb = bridge_callback(
        build_recipe(cfg.recipe),
        build_policy(cfg.get("policy")),
        expected_model_fields=expected,
        strict=bool(cfg.backend.get("strict_audit", False)),
        telemetry_interval=int(cfg.backend.get("telemetry_interval", 0)),
        audit_dir=run_dir if _is_rank0() else None,
    )
    if "callbacks" in inspect.signature(pretrain).parameters:
        pretrain(config=container, forward_step_func=forward_step, callbacks=[cb])
    else:
        raise SystemExit(
            "nemo-fp8 bridge: this Megatron-Bridge's pretrain() takes no callbacks, so the run-time "
            "audit cannot run; use Megatron-Bridge >= 0.2 (0.6.2 is what this launcher is checked with)"
        )
    return 0
