"""The embedded trainer: ``nemo-fp8-train recipe=<key> model=<name>`` (backend=native).

Trains a Llama 3 / small-MoE model (:mod:`nemo_fp8_recipes.models`) on local text
(:mod:`nemo_fp8_recipes.data`, the Python standard library by default) with the chosen FP8
recipe, on one device, with no cluster and no download:

- the recipe and precision policy are applied with :func:`nemo_fp8_recipes.nn.convert_model`
  after a hardware check (:func:`nemo_fp8_recipes.recipes.require_supported`); the audit table of
  what ran in FP8 is printed after the first step and saved in the run directory;
- AdamW on FP32 master weights, BF16 autocast for the non-FP8 ops on GPU (off on CPU by default:
  CPU BF16 GEMMs are slow without AMX and the FP8 emulation already rounds the operands), global
  grad-norm clipping, linear warmup + cosine decay, gradient accumulation;
- validation every ``trainer.val_interval`` steps, tokens/s and MFU, FP8 telemetry per layer
  group, all in TensorBoard under ``runs/<model>/<recipe>[-<tag>]`` (so
  ``tensorboard --logdir runs/<model>`` overlays the recipes);
- atomic checkpoints holding model (incl. delayed-scaling state), optimizer, scheduler, RNG and
  data position; the data order is a pure function of ``(seed, step)``, so on CPU a resumed run
  reproduces the uninterrupted loss curve exactly;
- non-finite loss stops the run naming the step and the last good checkpoint
  (``trainer.nan_policy=skip`` skips the batch and counts it instead).

Python API: :func:`train` takes a composed config (see
:func:`nemo_fp8_recipes.train_config.compose_config`) and returns a :class:`TrainResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .checkpoint import (CHECKPOINT_FORMAT, CheckpointError, CheckpointManager, capture_rng_state, check_compatible,
                         load_for_resume, load_model_state, resolve_resume, restore_rng_state)
from .distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    dist_world_size,
    full_tensor,
    grad_sync,
    init_distributed,
    merge_audits,
    reduce_telemetry,
    state_dicts,
    wrap_model,
)
from .data import ByteTokenizer, DataConfig, DataError, PackedTokens, TrainBatches, ValBatches, load_corpus
from .integrations.te_model import TERun, te_run_problem
from .logging_utils import MetricsWriter, format_count, format_duration, peak_tflops
from .models import ModelConfig, Transformer
from .train_config import (
    CONFIG_DIR,
    CONFIG_NAME,
    ConfigError,
    RunConfig,
    TrainerConfig,
    build_kernel_options,
    build_policy,
    build_recipe,
    resolve_device,
    run_config,
    trainer_config,
    validate_overrides,
)

__all__ = [
    "train",
    "main",
    "TrainResult",
    "TrainingError",
    "NonFiniteLossError",
    "resolve_device",
    "build_recipe",
    "build_policy",
    "lr_at",
]

log = logging.getLogger("nemo_fp8_recipes.train")

#: recipes whose emulation torch.compile's CPU (C++) backend cannot compile
_NO_CPU_COMPILE = ("blockwise", "mxfp8")

class TrainingError(RuntimeError):
    """A training run that cannot continue; the message says why and what to do."""


class NonFiniteLossError(TrainingError):
    """The loss (or gradient norm) became NaN/Inf."""

    def __init__(self, step: int, what: str, value: float, last_checkpoint: Optional[Path]) -> None:
        self.step, self.value, self.last_checkpoint = step, value, last_checkpoint
        where = (
            f"last good checkpoint: {last_checkpoint} (trainer.resume=auto continues from it)"
            if last_checkpoint
            else "no checkpoint was written before it"
        )
        super().__init__(
            f"non-finite {what} ({value}) at step {step}; {where}. Try a lower trainer.lr, a longer "
            "trainer.warmup_steps, recipe=blockwise/bf16 to compare, or trainer.nan_policy=skip "
            "to skip such batches"
        )


@dataclass
class TrainResult:
    """What a run did. ``history``: one dict per optimizer step run in this process
    (``step``, ``loss``, ``lr``, ``grad_norm``, ``skipped``); ``val``: ``(step, loss)`` pairs."""

    run_dir: Path
    start_step: int
    final_step: int
    history: List[Dict[str, float]] = field(default_factory=list)
    val: List[Tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    checkpoint: Optional[Path] = None
    tokens_per_s: Optional[float] = None
    wall_s: float = 0.0
    audit_table: Optional[str] = None
    world_size: int = 1
    #: FP8 linears whose compiled forward read a cached FP8 weight (trainer.compiled_weight_cache)
    compiled_weight_cache: int = 0
    #: the trained module (unwrapped: no DDP / compile wrapper; FSDP2 parameters stay sharded)
    model: Optional[torch.nn.Module] = field(default=None, repr=False)

    @property
    def losses(self) -> Dict[int, float]:
        """``{step: train loss}`` for the steps run in this process."""
        return {int(h["step"]): h["loss"] for h in self.history}


# ---- building blocks -----------------------------------------------------------------------
def lr_at(step: int, tcfg: TrainerConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``
    then cosine decay from ``lr`` to ``min_lr`` at ``max_steps``."""
    if tcfg.warmup_steps and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.max_steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _build_optimizer(model: torch.nn.Module, tcfg: TrainerConfig, device: torch.device):
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": tcfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps)
    if device.type == "cuda":
        kwargs["fused"] = True
    opt = torch.optim.AdamW(groups, **kwargs)
    # LambdaLR multiplies the base lr; lr_at returns absolute values.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, tcfg) / tcfg.lr)
    return opt, sched


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _autocast(device: torch.device, mode: str):
    use_bf16 = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext, False
    return (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)), True


def _fp8_state_snapshot(model: torch.nn.Module) -> Dict[str, Dict[str, Any]]:
    """Copy of every FP8 module's non-parameter state (scaling buffers, extra state)."""
    from .nn import fp8_modules

    snap = {}
    for name, m in fp8_modules(model).items():
        params = {n for n, _ in m.named_parameters(recurse=False)}
        snap[name] = {
            k: (v.detach().clone() if torch.is_tensor(v) else v)
            for k, v in m.state_dict().items() if k not in params
        }
    return snap


def _fp8_state_restore(model: torch.nn.Module, snap: Dict[str, Dict[str, Any]]) -> None:
    """Put back a :func:`_fp8_state_snapshot` (through ``load_state_dict``, which also drops any
    cached FP8 weight copies, as a resumed run starts without them)."""
    from .nn import fp8_modules

    for name, m in fp8_modules(model).items():
        if name in snap:
            result = m.load_state_dict(snap[name], strict=False)
            if result.unexpected_keys:  # pragma: no cover - a snapshot always matches its module
                raise RuntimeError(f"FP8 state restore of {name}: unexpected {result.unexpected_keys}")


# ---- the run -------------------------------------------------------------------------------
def train(cfg) -> TrainResult:
    """Run the embedded trainer on a composed config (``DictConfig``) and return what it did.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls it: data parallelism with
    ``trainer.data_parallel`` (ddp | fsdp2, :mod:`nemo_fp8_recipes.distributed`); rank 0 logs,
    writes TensorBoard, the audit and checkpoints. Every rank returns the same losses.

    Raises :class:`ConfigError`, :class:`~nemo_fp8_recipes.data.DataError`,
    :class:`~nemo_fp8_recipes.recipes.UnsupportedRecipeError`, :class:`CheckpointError` or
    :class:`NonFiniteLossError` with actionable messages; :func:`main` prints them cleanly.
    """
    holder: List[DistContext] = []
    level = log.level
    try:
        return _train(cfg, holder)
    finally:
        log.setLevel(level)
        for ctx in holder:
            ctx.close()


def _train(cfg, holder: List[DistContext]) -> TrainResult:
    from omegaconf import OmegaConf, open_dict

    from .nn import (apply_kernel_options, audit, collect_telemetry, convert_model, discard_delayed_scaling,
                     set_delayed_scaling_update,
                     set_graph_weight_cache, set_telemetry, set_wgrad_accumulation_fusion, sync_delayed_scaling)
    from .recipes import describe_device, require_supported, uses_real_fp8_gemm

    t_start = time.perf_counter()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing mandatory value(s): {', '.join(missing)}")
    tcfg = trainer_config(cfg)
    rcfg: RunConfig = run_config(cfg)
    backend = str(cfg.backend.name)
    if backend not in ("native", "te"):
        raise ConfigError(
            f"the embedded trainer runs backend=native or backend=te, got backend={backend}; launch "
            "Megatron-Bridge with `torchrun ... -m nemo_fp8_recipes.integrations.bridge <overrides>` "
            "or submit it with `nemo-fp8-submit backend=megatron_bridge ...`"
        )
    if cfg.cluster.name != "local":
        raise ConfigError(
            f"the embedded trainer runs cluster=local, got cluster={cfg.cluster.name}; submit "
            f"cluster={cfg.cluster.name} jobs with `nemo-fp8-submit <same overrides>`"
        )

    # ---- recipe, policy, device, model config (fail before any work) ----
    device = resolve_device(tcfg.device)
    recipe = build_recipe(cfg.recipe)
    policy = build_policy(cfg.get("policy"))
    kernel_options = build_kernel_options(cfg.get("kernels"))
    with open_dict(cfg):  # the values it runs with (null = default) go into config.yaml
        cfg.kernels = kernel_options.as_dict()
    if backend == "te":
        problem = te_run_problem(recipe, device, tcfg)
        if problem:
            raise ConfigError(problem)
    else:
        require_supported(recipe, device)
    world = dist_world_size()
    if tcfg.global_batch_size % (tcfg.micro_batch_size * world):
        raise ConfigError(
            f"trainer.global_batch_size ({tcfg.global_batch_size}) must be a multiple of "
            f"trainer.micro_batch_size ({tcfg.micro_batch_size}) x {world} data-parallel ranks; "
            f"e.g. trainer.global_batch_size={tcfg.micro_batch_size * world * max(1, tcfg.grad_accum // world)}"
        )
    ctx = init_distributed(device)
    holder.append(ctx)
    device = ctx.device
    accum = tcfg.grad_accum // ctx.world_size  # micro-batches per rank per step
    if not ctx.is_main:
        log.setLevel(logging.WARNING)
    try:
        mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        dcfg = DataConfig.from_dict(OmegaConf.to_container(cfg.data, resolve=True))
    except DataError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    tokenizer = ByteTokenizer()
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the byte tokenizer's "
            f"{tokenizer.vocab_size} ids; use model.vocab_size=512 (or any value >= {tokenizer.vocab_size})"
        )
    if tcfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"trainer.seq_len={tcfg.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    if tcfg.memory_check:
        from .memory import check_fits

        shard = ctx.world_size if ctx.distributed and tcfg.data_parallel == "fsdp2" else 1
        too_big = check_fits(mcfg, device, tokens_per_micro_batch=tcfg.micro_batch_size * tcfg.seq_len,
                             fp8=recipe.is_fp8, activation_bytes=2 if _autocast(device, tcfg.autocast)[1] else 4,
                             shard=shard, where=f" with micro-batches of {tcfg.micro_batch_size} x {tcfg.seq_len} "
                                                f"tokens" + (" per rank" if ctx.distributed else ""))
        if too_big:
            raise ConfigError(too_big)
    if tcfg.compile and device.type == "cpu" and recipe.name in _NO_CPU_COMPILE:
        # Refused at start: Inductor's C++ backend fails on the 1x128 / 1x32 block reshapes of
        # these emulated quantisers (AssertionError in CppScheduling.try_loop_split: two fused
        # nodes end with different loop ranges after the split; no config switch avoids it) after
        # one to two minutes of compiling. On CUDA the Triton backend compiles them.
        raise ConfigError(
            f"trainer.compile=true on CPU cannot compile recipe {recipe.name}: the C++ backend of torch.compile "
            f"(torch {torch.__version__}) fails on its block-scaled quantisers after minutes of compiling. On CPU "
            "use trainer.compile=false (the emulation computes the same numbers), or compile on a GPU "
            f"(trainer.device=cuda); recipes that compile on CPU: "
            + ", ".join(r for r in ("bf16", "delayed", "tensorwise") if r != recipe.name)
        )

    run_dir = Path(rcfg.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(run_dir / "checkpoints", keep=tcfg.ckpt_keep)
    resume_path = resolve_resume(tcfg, mgr)

    # ---- data ----
    corpus = load_corpus(dcfg, tokenizer)
    train_batches = TrainBatches(
        PackedTokens(corpus.train, tcfg.seq_len, "train"),
        seed=tcfg.seed, micro_batch_size=tcfg.micro_batch_size, grad_accum=tcfg.grad_accum,
    )
    val_batches = None
    if tcfg.val_interval > 0 and tcfg.val_steps > 0:
        val_batches = ValBatches(
            PackedTokens(corpus.val, tcfg.seq_len, "validation"),
            micro_batch_size=tcfg.micro_batch_size, num_batches=tcfg.val_steps,
        )

    # ---- model, FP8 conversion, optimizer ----
    _seed_everything(tcfg.seed)
    with torch.device(device):
        raw_model = Transformer(mcfg)
    te_run = None  # backend=te: conversion, micro-batch state, hooks, autocast factory
    if backend == "te":
        te_run = TERun(raw_model, recipe, policy, cfg.backend, ctx, telemetry=tcfg.telemetry_interval > 0)
        apply_kernel_options(raw_model, kernel_options)  # (the native modules: the norms)
    else:
        convert_model(raw_model, recipe, policy, options=kernel_options)
    # delayed scaling: scales fixed within a step, amaxes max-reduced once per step (all ranks)
    set_delayed_scaling_update(raw_model, "step")
    if tcfg.fuse_wgrad_accumulation:
        if ctx.distributed:
            raise ConfigError(f"trainer.fuse_wgrad_accumulation=true skips the gradient hooks {tcfg.data_parallel} "
                              f"reduces with ({ctx.world_size} ranks); set it to false under torchrun")
        n_fused = set_wgrad_accumulation_fusion(raw_model)
        if accum > 1:
            log.info("fused wgrad accumulation: %d FP8 linears add micro-batches 2..%d into their FP32 gradients "
                     "inside the wgrad GEMM", n_fused, accum)
        else:
            log.warning("trainer.fuse_wgrad_accumulation=true has nothing to fuse with one micro-batch per step "
                        "(global_batch_size = micro_batch_size): every backward starts from zeroed gradients")
    n_cached = 0
    if tcfg.compile and tcfg.compiled_weight_cache and recipe.is_fp8 and accum > 1:
        if ctx.distributed and tcfg.data_parallel == "fsdp2":
            log.info("compiled FP8 weight cache off under FSDP2: the sharded weights are quantised in the graph "
                     "at every micro-batch")
        else:  # (before DDP wraps the model and before it is compiled)
            n_cached = set_graph_weight_cache(raw_model)
            if n_cached:
                log.info("compiled FP8 weight cache: %d FP8 linears quantise their weights once per optimizer step, "
                         "not in each of the %d micro-batches", n_cached, accum)
    dp_model = wrap_model(raw_model, tcfg.data_parallel, ctx,
                          find_unused_parameters=mcfg.arch == "moe")  # unrouted experts get no grad
    optimizer, scheduler = _build_optimizer(dp_model, tcfg, device)
    autocast_ctx, bf16 = _autocast(device, tcfg.autocast)

    def fp8_ctx(first_micro_batch: Optional[bool]):
        """backend=te: te.autocast with the recipe, and TE's weight caching told which micro-batch
        this is (None: not a training step); native: nothing (the FP8 linears carry the recipe)."""
        if te_run is None:
            return contextlib.nullcontext()
        te_run.micro.first = first_micro_batch
        return te_run.autocast()
    real_fp8 = recipe.is_fp8 and uses_real_fp8_gemm(recipe, device)
    mode = "no FP8" if not recipe.is_fp8 else ("real FP8 GEMMs" if real_fp8 else "emulated FP8")
    n_params = raw_model.num_params()
    flops_per_token = mcfg.flops_per_token(tcfg.seq_len)
    peak = peak_tflops(device, "fp8" if real_fp8 else "bf16")
    peak = peak * ctx.world_size if peak else peak

    start_step, tokens_seen, skipped = 0, 0, 0
    last_ckpt: Optional[Path] = None
    if resume_path is not None:
        ckpt = load_for_resume(resume_path, tcfg)
        forced = check_compatible(ckpt, resume_path, recipe, mcfg, tcfg, corpus.fingerprint,
                                   auto=tcfg.resume == "auto", backend=backend)
        load_model_state(dp_model, optimizer, ckpt["model"], ckpt["optimizer"], forced)
        scheduler.load_state_dict(ckpt["scheduler"])
        # The checkpoint restores the *old* hyperparameters (LambdaLR's base_lrs, AdamW's
        # weight_decay/betas/eps); the current config wins, e.g. a lower lr after a divergence.
        scheduler.base_lrs = [tcfg.lr for _ in optimizer.param_groups]
        for group, wd in zip(optimizer.param_groups, (tcfg.weight_decay, 0.0)):
            group.update(weight_decay=wd, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                         lr=lr_at(int(ckpt["step"]), tcfg))
        restore_rng_state(ckpt["rng"])
        start_step = int(ckpt["step"])
        tokens_seen = int(ckpt.get("tokens_seen", 0))
        skipped = int(ckpt.get("skipped_steps", 0))
        resume_window = dict(ckpt.get("log_window") or {})
        last_ckpt = resume_path
        if ctx.is_main and resume_path.parent.resolve() == mgr.directory.resolve():
            for q in mgr.supersede_after(start_step):
                log.warning("resumed from step %d: the later checkpoint %s is kept as %s and no longer resumed from",
                            start_step, q.name.split(".superseded-")[0], q.name)
        log.info("resumed from %s at step %d", resume_path, start_step)
    # written only once the resume checks passed, so a refused run cannot overwrite the config
    # that produced the checkpoints in this directory
    if ctx.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")

    model = torch.compile(dp_model) if tcfg.compile else dp_model
    writer = MetricsWriter(run_dir, enabled=rcfg.tensorboard and ctx.is_main,
                           purge_step=start_step + 1 if start_step else None)

    log.info(
        "run %s | model %s (%s params, %d layers) | recipe %s (%s) | device %s | autocast %s | "
        "data %s: %s train / %s val tokens | %d steps x %d seq x %d tokens (grad accum %d%s)",
        run_dir, mcfg.name, format_count(n_params), mcfg.num_layers, recipe.name, mode,
        describe_device(device), "bf16" if bf16 else "off", dcfg.name,
        format_count(len(corpus.train)), format_count(len(corpus.val)), tcfg.max_steps,
        tcfg.global_batch_size, tcfg.seq_len, accum,
        f" per rank, {ctx.world_size} ranks, {tcfg.data_parallel}" if ctx.distributed else "",
    )
    if start_step == 0:
        writer.text("config", OmegaConf.to_yaml(cfg, resolve=True))

    result = TrainResult(run_dir=run_dir, start_step=start_step, final_step=start_step,
                         skipped_steps=skipped, checkpoint=last_ckpt, world_size=ctx.world_size,
                         model=raw_model, compiled_weight_cache=n_cached)
    if start_step >= tcfg.max_steps:
        log.info("run already complete at step %d (trainer.max_steps=%d); nothing to do", start_step, tcfg.max_steps)
        writer.close()
        result.wall_s = time.perf_counter() - t_start
        return result

    tokens_per_step = tcfg.global_batch_size * tcfg.seq_len
    telemetry_on = recipe.is_fp8 and tcfg.telemetry_interval > 0

    def state_dict(step: int) -> Dict[str, Any]:
        model_sd, optim_sd = state_dicts(dp_model, optimizer)  # a collective under FSDP2
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "tokens_seen": tokens_seen,
            "skipped_steps": skipped,
            "model": model_sd,
            "optimizer": optim_sd,
            "world_size": ctx.world_size,
            "data_parallel": tcfg.data_parallel if ctx.distributed else None,
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng_state(),
            "data": {
                "fingerprint": corpus.fingerprint,
                "seed": tcfg.seed,
                "next_step": step,
                "consumed_samples": step * train_batches.samples_per_step,
            },
            # the train/loss logging window open at this step, so a resumed run logs the same mean
            "log_window": {"loss_sum": window_loss, "steps": window_n},
            "recipe": recipe.describe(),
            "backend": backend,
            "model_config": mcfg.to_dict(),
            "trainer": dataclasses.asdict(tcfg),
            "config_yaml": OmegaConf.to_yaml(cfg, resolve=True),
        }

    def save(step: int) -> Path:
        nonlocal last_ckpt
        state = state_dict(step)  # every rank (collective); rank 0 writes
        if ctx.is_main:
            mgr.save(step, state)
        last_ckpt = mgr.path_for(step)
        barrier(ctx)  # no rank goes on (or resumes) before the file is in place
        result.checkpoint = last_ckpt
        log.info("checkpoint: %s", last_ckpt)
        return last_ckpt

    @torch.no_grad()
    def validate() -> float:
        # Evaluation must not steer training: the FP8 scaling state (delayed-scaling amax
        # histories, pending amaxes, cached weight quantisations) is restored afterwards, so a
        # run with validation follows the same trajectory as one without, and a checkpoint
        # written right after validation resumes exactly.
        snapshot = _fp8_state_snapshot(raw_model)
        te_snapshot = te_run.snapshot(raw_model) if te_run else None
        model.eval()
        total, n = 0.0, 0
        try:
            for x, y in val_batches.iter(device):
                with autocast_ctx(), fp8_ctx(None):
                    out = model(x, y)
                total += float(out.ce_loss)
                n += 1
        finally:
            model.train()
            _fp8_state_restore(raw_model, snapshot)
            if te_run:
                te_run.restore(raw_model, te_snapshot)
        return total / max(1, n)

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    show_bar = tcfg.progress and sys.stderr.isatty() and ctx.is_main
    bar = tqdm(total=tcfg.max_steps, initial=start_step, disable=not show_bar, dynamic_ncols=True,
               desc=f"{mcfg.name}/{recipe.name}", unit="step")
    window_loss, window_n, window_time, window_tokens = 0.0, 0, 0.0, 0
    if resume_path is not None:  # continue the logging window the checkpoint was written in
        window_loss = float(resume_window.get("loss_sum", 0.0))
        window_n = int(resume_window.get("steps", 0))
    step_time_total, steps_timed = 0.0, 0
    step = start_step
    model.train()
    mid_step = False
    try:
        with logging_redirect_tqdm():
            while step < tcfg.max_steps:
                mid_step = True  # weights, counters and FP8 state may disagree until the step ends
                t0 = time.perf_counter()
                tele_now = telemetry_on and (step + 1) % tcfg.telemetry_interval == 0
                if tele_now and not te_run:
                    set_telemetry(raw_model, True)
                loss_acc = torch.zeros((), device=device)
                aux_acc = torch.zeros((), device=device)
                for micro in range(accum):
                    # rank r takes micro-batches [r·accum, (r+1)·accum) of the global step, and
                    # back-propagates loss / (all micro-batches): gradients are summed over ranks
                    x, y = train_batches.get(step, ctx.rank * accum + micro, device)
                    try:
                        with grad_sync(dp_model, tcfg.data_parallel, ctx, micro == accum - 1), autocast_ctx(), \
                                fp8_ctx(micro == 0):
                            out = model(x, y)
                            (out.loss / tcfg.grad_accum).backward()
                    except Exception as e:
                        if tcfg.compile and type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                            raise TrainingError(
                                f"torch.compile failed for recipe {recipe.name}: {str(e).splitlines()[0]}; "
                                "run with trainer.compile=false"
                            ) from e
                        raise
                    loss_acc += out.ce_loss.detach()
                    aux_acc += out.aux_loss.detach()
                if ctx.distributed:
                    both = all_reduce_sum(torch.stack([loss_acc, aux_acc]), ctx)
                    loss_acc, aux_acc = both[0], both[1]
                loss = float(loss_acc) / tcfg.grad_accum
                clip = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
                grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(dp_model.parameters(), clip)))
                lr = optimizer.param_groups[0]["lr"]
                bad = None
                if not math.isfinite(loss):
                    bad = ("loss", loss)
                elif not math.isfinite(grad_norm):
                    bad = ("gradient norm", grad_norm)
                if bad is not None:
                    optimizer.zero_grad(set_to_none=True)
                    if tcfg.nan_policy == "stop":
                        raise NonFiniteLossError(step + 1, bad[0], bad[1], last_ckpt)
                    # the skipped batch's (non-finite) amaxes must not enter the delayed-scaling
                    # histories, where they would pin every scale for amax_history_len steps
                    discard_delayed_scaling(raw_model)
                    skipped += 1
                    log.warning("step %d: non-finite %s (%s); batch skipped (%d skipped so far), its "
                                "delayed-scaling amaxes discarded", step + 1, bad[0], bad[1], skipped)
                    if skipped > tcfg.max_skipped_steps:
                        raise NonFiniteLossError(step + 1, bad[0], bad[1], last_ckpt)
                else:
                    sync_delayed_scaling(raw_model)  # one amax all-reduce for the whole model
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                tokens_seen += tokens_per_step
                mid_step = False
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                result.history.append({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                       "skipped": bad is not None})
                if math.isfinite(loss):
                    window_loss += loss
                    window_n += 1
                window_time += dt
                window_tokens += tokens_per_step
                if step > start_step + 1:  # the first step pays compile/warm-up costs
                    step_time_total += dt
                    steps_timed += 1

                if step == start_step + 1 and start_step == 0:
                    report = te_run.audit() if te_run else audit(raw_model)
                    rank_problems = merge_audits(report, ctx)
                    result.audit_table = report.table()
                    if te_run:  # (the native audit prints them itself)
                        result.audit_table += f"\nkernel options (the native norms): {kernel_options.describe()}"
                    if ctx.distributed:
                        result.audit_table += (
                            f"\n{ctx.world_size} data-parallel ranks ({tcfg.data_parallel}): "
                            + ("; ".join(rank_problems) if rank_problems else "every rank ran the same precision per module")
                        )
                    if ctx.is_main:
                        (run_dir / "audit.txt").write_text(result.audit_table + "\n", encoding="utf-8")
                        d = report.to_dict()
                        d["ranks"] = {"world_size": ctx.world_size, "problems": rank_problems}
                        (run_dir / "audit.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
                    writer.text("fp8/audit", result.audit_table, step)
                    log.info("precision audit after the first step:\n%s", result.audit_table)
                    if report.violations or rank_problems:
                        log.warning("policy violations: %s", ", ".join(list(report.violations) + rank_problems))

                if tele_now:
                    tel = te_run.hooks.collect_telemetry() if te_run else collect_telemetry(raw_model, reset=True)
                    writer.scalars(reduce_telemetry(tel, ctx), step)
                    if not te_run:
                        set_telemetry(raw_model, False)

                tps = window_tokens / window_time if window_time > 0 else 0.0
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=format_count(tps), refresh=False)
                if tcfg.log_interval and (step % tcfg.log_interval == 0 or step == tcfg.max_steps):
                    avg = window_loss / window_n if window_n else float("nan")
                    tflops = tps * flops_per_token / 1e12
                    mfu = tflops / peak if peak else None
                    scalars = {
                        "train/loss": avg,
                        "train/loss_step": loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_per_s": tps,
                        "perf/tflops_per_s": tflops,
                        "perf/mfu": mfu,
                        "train/tokens_seen": tokens_seen,
                        "train/skipped_steps": skipped,
                    }
                    if mcfg.arch == "moe":
                        scalars["train/aux_loss"] = float(aux_acc) / tcfg.grad_accum
                    if device.type == "cuda":
                        scalars["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                    writer.scalars(scalars, step)
                    log.info(
                        "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.2f TFLOP/s | mfu %s",
                        step, tcfg.max_steps, avg, lr, grad_norm, format_count(tps), tflops,
                        f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
                    )
                    window_loss, window_n, window_time, window_tokens = 0.0, 0, 0.0, 0

                last = step == tcfg.max_steps
                if val_batches is not None and (step % tcfg.val_interval == 0 or last):
                    mid_step = True  # validation swaps the FP8 state out and back
                    vl = validate()
                    mid_step = False
                    result.val.append((step, vl))
                    writer.scalars({"val/loss": vl}, step)
                    log.info("step %d | val/loss %.4f", step, vl)
                if tcfg.checkpoint and ((tcfg.ckpt_interval and step % tcfg.ckpt_interval == 0) or last):
                    save(step)
                writer.flush()
    except KeyboardInterrupt:
        bar.close()
        if mid_step:
            # A half-finished step (e.g. optimizer updated, counters not) must not be saved
            # under a completed step's name.
            log.warning("interrupted inside step %d; not saving a partial step. Last checkpoint: %s",
                        step + 1, last_ckpt or "none")
        elif ctx.distributed:
            # saving is a collective; the other ranks are being interrupted too
            log.warning("interrupted after step %d; last checkpoint: %s", step, last_ckpt or "none")
        else:
            log.warning("interrupted after step %d", step)
            if step > start_step and tcfg.checkpoint:
                save(step)
        writer.close()
        raise
    finally:
        bar.close()
        writer.close()

    result.final_step = step
    result.skipped_steps = skipped
    result.tokens_per_s = tokens_per_step * steps_timed / step_time_total if step_time_total else None
    result.wall_s = time.perf_counter() - t_start
    tail = [h["loss"] for h in result.history[-max(1, tcfg.log_interval or 1):] if math.isfinite(h["loss"])]
    final_train = float(np.mean(tail)) if tail else float("nan")
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps({
            "model": mcfg.name, "recipe": recipe.name, "mode": mode, "params": n_params,
            "steps": step, "final_train_loss": final_train,
            "final_val_loss": result.val[-1][1] if result.val else None,
            "tokens_per_s": result.tokens_per_s, "skipped_steps": skipped,
            "world_size": ctx.world_size, "data_parallel": tcfg.data_parallel if ctx.distributed else None,
            "wall_s": result.wall_s, "checkpoint": str(result.checkpoint) if result.checkpoint else None,
            "kernel_options": kernel_options.as_dict(),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }, indent=2) + "\n", encoding="utf-8")
    log.info(
        "done: %d steps in %s | train loss %.4f%s | %s tok/s | run dir %s",
        step - start_step, format_duration(result.wall_s), final_train,
        f" | val loss {result.val[-1][1]:.4f}" if result.val else "",
        format_count(result.tokens_per_s or 0), run_dir,
    )
    return result


# ---- command line ----------------------------------------------------------------------------
_EXIT_CODES = {ConfigError: 2, DataError: 2, CheckpointError: 4, NonFiniteLossError: 3, TrainingError: 5}


def _quiet_failing_log_files() -> None:
    """A log file that cannot be written (a full disk) says so once on stderr and is closed,
    instead of Python's logging printing a traceback for every later record."""
    import logging as _logging

    for h in list(_logging.getLogger().handlers):
        if not isinstance(h, _logging.FileHandler) or getattr(h, "_nemo_fp8_quiet", False):
            continue

        def handle_error(record, h=h):
            err = sys.exc_info()[1]
            _logging.getLogger().removeHandler(h)
            try:
                h.close()
            except Exception:  # noqa: BLE001 - the file is already broken
                pass
            print(f"nemo-fp8-train: warning: cannot write the log file {h.baseFilename} ({err}); "
                  "logging to the console only from here on", file=sys.stderr)

        h.handleError = handle_error
        h._nemo_fp8_quiet = True


def _run_cli(cfg) -> None:
    """Body of the Hydra entry point: train, print clean messages for expected errors."""
    from .recipes import UnsupportedRecipeError

    _quiet_failing_log_files()
    try:
        result = train(cfg)
    except UnsupportedRecipeError as e:
        print(f"nemo-fp8-train: unsupported recipe on this device: {e}", file=sys.stderr)
        sys.exit(2)
    except tuple(_EXIT_CODES) as e:
        code = next(c for t, c in _EXIT_CODES.items() if isinstance(e, t))
        print(f"nemo-fp8-train: error: {e}", file=sys.stderr)
        sys.exit(code)
    except KeyboardInterrupt:
        print("nemo-fp8-train: interrupted; trainer.resume=auto continues from the last checkpoint", file=sys.stderr)
        sys.exit(130)
    print(
        f"\nRun directory:    {result.run_dir}  (config.yaml, audit.txt, summary.json)\n"
        f"Checkpoint:       {result.checkpoint or 'none'}\n"
        f"TensorBoard logs: {result.run_dir}\n"
        f"  tensorboard --logdir {result.run_dir.parent}   # overlays every recipe of {result.run_dir.parent.name}"
    )


def _hydra_entry() -> None:
    import hydra

    hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")(_run_cli)()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``nemo-fp8-train`` / ``python -m nemo_fp8_recipes.train``).

    Arguments are Hydra overrides (``recipe=delayed model.num_layers=2 trainer.max_steps=50``)
    and Hydra flags (``--cfg job``, ``-m`` for sweeps, ``--help``). Overrides are checked first,
    so a bad key or option fails at once with the valid choices listed.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("-") for a in args):
        problem = validate_overrides(args)
        if problem:
            print(f"nemo-fp8-train: {problem}", file=sys.stderr)
            return 2
    prog = sys.argv[0] if sys.argv else "nemo-fp8-train"
    old_argv = sys.argv
    sys.argv = [prog] + args
    with _logging_as_it_was():
        try:
            _hydra_entry()
        except SystemExit as e:
            return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old_argv
    return 0


@contextlib.contextmanager
def _logging_as_it_was():
    """Hydra configures Python's logging for the job (a console handler bound to the stderr of
    the moment, the job's log file) and leaves it so. Called from Python (a notebook, a test, a
    sweep driver), ``main`` puts the caller's logging back afterwards: the handlers, level,
    ``disabled`` and ``propagate`` of the root logger and of every logger that existed before
    (Hydra's configuration may disable them); the handlers the job added are closed. Loggers
    created during the run (a library's import) keep their own."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.disabled, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, disabled, level, handlers, propagate in saved:
            for h in list(lg.handlers):
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)

if __name__ == "__main__":
    sys.exit(main())
