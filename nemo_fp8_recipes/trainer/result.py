"""What a run of the embedded trainer returns or raises: :class:`TrainResult`, the per-step
:class:`StepStats`, and the errors :func:`nemo_fp8_recipes.train.main` turns into exit codes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

__all__ = ["TrainingError", "Terminated", "NonFiniteLossError", "TrainResult", "StepStats"]


class TrainingError(RuntimeError):
    """A training run that cannot continue; the message says why and what to do."""


class Terminated(TrainingError):
    """The run was told to stop (SIGTERM: a SLURM time limit, preemption, ``scancel``) and stopped
    after a completed step, with a checkpoint of it where checkpointing is on."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[Path], checkpointing: bool) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        if checkpoint:
            kept = f"checkpoint {checkpoint}; trainer.resume=auto (the default) continues from it"
        elif checkpointing:
            kept = "no step was completed, nothing to save"
        else:
            kept = "trainer.checkpoint=false: nothing saved, a new run starts from step 0"
        super().__init__(f"{signal_name} received: stopped after step {step}; {kept}")


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
    #: compiled graphs run without CUDA graphs under a CUDA-graph trainer.compile_mode (None: not asked)
    cuda_graph_skips: Optional[int] = None
    #: the trained module (unwrapped: no DDP / compile wrapper; FSDP2 parameters stay sharded)
    model: Optional[torch.nn.Module] = field(default=None, repr=False)

    @property
    def losses(self) -> Dict[int, float]:
        """``{step: train loss}`` for the steps run in this process."""
        return {int(h["step"]): h["loss"] for h in self.history}


class StepStats(NamedTuple):
    """What one optimizer step measured (:meth:`nemo_fp8_recipes.trainer.Trainer.step`)."""

    loss: float  #: mean cross-entropy over the step's micro-batches (and ranks)
    aux_loss_sum: torch.Tensor  #: MoE load-balancing loss summed over the micro-batches
    lr: float
    grad_norm: float  #: before clipping
    skipped: bool  #: non-finite loss or gradient norm: no update (trainer.nan_policy=skip)
    time_s: float
