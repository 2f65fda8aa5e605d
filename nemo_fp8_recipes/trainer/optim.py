"""The embedded trainer's optimizer and learning-rate schedule.

AdamW on the FP32 master weights, with weight decay on matrices and embeddings and none on
norms (parameters of one dimension); the learning rate warms up linearly over
``trainer.warmup_steps`` optimizer steps, then decays along a cosine from ``trainer.lr`` to
``trainer.min_lr`` at ``trainer.max_steps``. A resumed run takes the hyperparameters of its
current config, not the checkpoint's (:func:`apply_hyperparameters`).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from ..config import TrainerConfig

__all__ = ["lr_at", "build_optimizer", "apply_hyperparameters"]


def lr_at(step: int, tcfg: TrainerConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``
    then cosine decay from ``lr`` to ``min_lr`` at ``max_steps``."""
    if tcfg.warmup_steps and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.max_steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, tcfg: TrainerConfig, device: torch.device
) -> Tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s trainable parameters (group 0: decayed, group 1: not) and the
    :func:`lr_at` schedule as a ``LambdaLR``; fused AdamW on CUDA."""
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


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, tcfg: TrainerConfig, step: int) -> None:
    """After loading a checkpoint's optimizer and scheduler state at ``step``: put back the
    current config's hyperparameters. The checkpoint restores the *old* ones (LambdaLR's
    base_lrs, AdamW's weight_decay/betas/eps); the current config wins, e.g. a lower lr after a
    divergence."""
    scheduler.base_lrs = [tcfg.lr for _ in optimizer.param_groups]
    for group, wd in zip(optimizer.param_groups, (tcfg.weight_decay, 0.0)):
        group.update(weight_decay=wd, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps, lr=lr_at(step, tcfg))
