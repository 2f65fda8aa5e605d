"""What the embedded trainer checks before any work: that it is the trainer's run (backend native or
te, cluster local), the batch split over the data-parallel ranks, the model and data blocks
against the tokenizer and sequence length, the compile mode against the device and world size,
the CPU compiler's limits, Transformer Engine on this machine (backend=te), and the memory
estimate. Each raises :class:`~nemo_fp8_recipes.config.ConfigError` naming the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

from ..config import (
    ConfigError,
    RunConfig,
    TrainerConfig,
    run_config,
    trainer_config,
    uses_cuda_graphs,
)
from ..recipes import ScalingKind, get_recipe, list_recipes

if TYPE_CHECKING:  # annotations only
    import torch

    from ..data import DataConfig
    from ..models import ModelConfig

__all__ = [
    "NO_CPU_COMPILE",
    "check_embedded_run",
    "check_batch_split",
    "model_and_data_configs",
    "check_compile_mode",
    "check_cpu_compile",
    "check_memory",
    "te_backend_problem_for",
]

#: scaling kinds whose emulation torch.compile's CPU (C++) backend cannot compile (block scales)
NO_CPU_COMPILE = (ScalingKind.BLOCKWISE, ScalingKind.MICROSCALING)


def check_embedded_run(cfg) -> Tuple[TrainerConfig, RunConfig, str]:
    """The typed ``trainer`` and ``run`` blocks and the backend name of a composed config, after
    checking that the embedded trainer runs it (no missing value, backend native or te, cluster
    local); the errors name the launcher that runs the other cases."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing mandatory value(s): {', '.join(missing)}")
    tcfg = trainer_config(cfg)
    rcfg = run_config(cfg)
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
    return tcfg, rcfg, backend


def check_batch_split(tcfg: TrainerConfig, world: int) -> None:
    """The global batch must split into whole micro-batches on each of ``world`` data-parallel ranks."""
    if tcfg.global_batch_size % (tcfg.micro_batch_size * world):
        raise ConfigError(
            f"trainer.global_batch_size ({tcfg.global_batch_size}) must be a multiple of "
            f"trainer.micro_batch_size ({tcfg.micro_batch_size}) x {world} data-parallel ranks; "
            f"e.g. trainer.global_batch_size={tcfg.micro_batch_size * world * max(1, tcfg.grad_accum // world)}"
        )


def model_and_data_configs(cfg, tcfg: TrainerConfig, vocab_size: int) -> Tuple["ModelConfig", "DataConfig"]:
    """The ``model`` and ``data`` blocks as their typed configs, checked against the trainer: the
    model's vocabulary holds the tokenizer's ``vocab_size`` ids and its context ``trainer.seq_len``."""
    from omegaconf import OmegaConf

    from ..data import DataConfig, DataError
    from ..models import ModelConfig

    try:
        mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        dcfg = DataConfig.from_dict(OmegaConf.to_container(cfg.data, resolve=True))
    except DataError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if mcfg.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the byte tokenizer's "
            f"{vocab_size} ids; use model.vocab_size=512 (or any value >= {vocab_size})"
        )
    if tcfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"trainer.seq_len={tcfg.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    return mcfg, dcfg


def check_compile_mode(tcfg: TrainerConfig, device: "torch.device", *, world_size: int) -> None:
    """Refuse a CUDA-graph ``trainer.compile_mode`` where it cannot run as asked: it needs a CUDA
    device (Inductor would silently skip the graphs on CPU) and one process (the gradient hooks of
    DDP and FSDP2 run between the graph replays). (backend=te refuses ``trainer.compile`` itself.)"""
    if not uses_cuda_graphs(tcfg):
        return
    mode = tcfg.compile_mode
    if device.type != "cuda":
        raise ConfigError(
            f"trainer.compile_mode={mode} replays the compiled graphs as CUDA graphs and needs a CUDA "
            f"device (this run: {device.type}); use trainer.compile_mode=default on CPU"
        )
    if world_size > 1:
        raise ConfigError(
            f"trainer.compile_mode={mode} runs in one process only: under torchrun the "
            f"{tcfg.data_parallel} gradient hooks run between the CUDA-graph replays ({world_size} "
            "ranks); use trainer.compile_mode=default there"
        )


def check_cpu_compile(tcfg: TrainerConfig, recipe, device: "torch.device") -> None:
    """Refuse ``trainer.compile=true`` on CPU for the recipes of the kinds in :data:`NO_CPU_COMPILE`.

    Inductor's C++ backend fails on the 1x128 / 1x32 block reshapes of these emulated quantisers
    (AssertionError in CppScheduling.try_loop_split: two fused nodes end with different loop
    ranges after the split; no config switch avoids it) after one to two minutes of compiling, so
    the run is refused at start. On CUDA the Triton backend compiles them.
    """
    import torch

    if tcfg.compile and device.type == "cpu" and recipe.scaling_kind in NO_CPU_COMPILE:
        raise ConfigError(
            f"trainer.compile=true on CPU cannot compile recipe {recipe.name}: the C++ backend of torch.compile "
            f"(torch {torch.__version__}) fails on its block-scaled quantisers after minutes of compiling. On CPU "
            "use trainer.compile=false (the emulation computes the same numbers), or compile on a GPU "
            f"(trainer.device=cuda); recipes that compile on CPU: "
            + ", ".join(n for n in list_recipes() if get_recipe(n).scaling_kind not in NO_CPU_COMPILE)
        )


def check_memory(
    tcfg: TrainerConfig,
    mcfg: "ModelConfig",
    recipe,
    device: "torch.device",
    *,
    world_size: int,
    bf16_activations: bool,
    available: Optional[int] = None,
    device_name: Optional[str] = None,
) -> None:
    """Refuse a run whose estimated training memory does not fit ``device``, naming what would
    fit (:func:`nemo_fp8_recipes.memory.check_fits`); ``trainer.memory_check=false`` skips it.
    ``available`` / ``device_name``: a GPU that is not this machine's (a SLURM job's)."""
    if not tcfg.memory_check:
        return
    from .memory import check_fits

    distributed = world_size > 1
    shard = world_size if distributed and tcfg.data_parallel == "fsdp2" else 1
    where = f" with micro-batches of {tcfg.micro_batch_size} x {tcfg.seq_len} tokens"
    if distributed:  # per rank, and how the ranks hold the model
        layout = f"sharded over {shard} ranks (fsdp2)" if shard > 1 else f"trainer.data_parallel={tcfg.data_parallel}"
        where += f" per rank, {layout}"
    too_big = check_fits(
        mcfg,
        device,
        tokens_per_micro_batch=tcfg.micro_batch_size * tcfg.seq_len,
        fp8=recipe.is_fp8,
        activation_bytes=2 if bf16_activations else 4,
        shard=shard,
        where=where,
        available=available,
        device_name=device_name,
    )
    if too_big:
        raise ConfigError(too_big)


def te_backend_problem_for(cfg) -> Optional[str]:
    """Why this machine cannot run a composed config's ``backend=te`` (None when it can or the
    backend is another): Transformer Engine not importable, or no CUDA GPU."""
    if cfg.backend.get("name") != "te":
        return None
    from ..config import resolve_device
    from .te_backend import te_backend_problem

    try:
        device = resolve_device(str(cfg.trainer.device))
    except ConfigError as e:
        return str(e)
    return te_backend_problem(device)
