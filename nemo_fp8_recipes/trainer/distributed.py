"""Data parallelism for the embedded trainer: ``torchrun`` + DDP or FSDP2 (``fully_shard``).

One process per GPU (or per CPU process with gloo, for tests). What the trainer gets from here:

- :func:`init_distributed` — reads the ``torchrun`` environment (``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``), initialises the default process group (NCCL on CUDA, gloo on CPU) and pins the
  rank's device; a single process without ``torchrun`` gets a one-rank context and no group.
- :func:`wrap_model` — DDP or FSDP2 around the FP8-converted model, with gradient **sum**
  reduction: every rank back-propagates ``loss / (micro-batches of the whole global batch)``, so
  each micro-batch sees exactly the gradients it would see in a one-rank run with gradient
  accumulation (FP8 quantisation of ``dY`` included), and the sum over ranks is the global mean.
- :func:`state_dicts` / :func:`load_state_dicts` — full (unsharded, FQN-keyed) model and optimizer
  state for checkpoints, so a checkpoint written at one world size / wrapper resumes at another.
- :func:`reduce_telemetry`, :func:`merge_audits` — FP8 telemetry and the precision audit of every
  rank aggregated on rank 0 (the audit fails if any rank ran a GEMM at another precision).

The delayed-scaling amax reduction (one all-reduce per optimizer step) is
:func:`nemo_fp8_recipes.nn.sync_delayed_scaling`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..options import env_setting

__all__ = [
    "DATA_PARALLEL_MODES",
    "DistContext",
    "dist_world_size",
    "init_distributed",
    "wrap_model",
    "state_dicts",
    "load_state_dicts",
    "all_reduce_sum",
    "grad_sync",
    "full_tensor",
    "reduce_telemetry",
    "merge_audits",
    "barrier",
]

DATA_PARALLEL_MODES = ("ddp", "fsdp2")


@dataclass
class DistContext:
    """Where this process sits: ``world_size`` 1 means no process group (plain single device)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        """Destroy the process group if :func:`init_distributed` created it."""
        import torch.distributed as dist

        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
            self.initialized_here = False


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return int(v) if v not in (None, "") else default
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _timeout_minutes() -> int:
    """The process-group timeout: ``$NEMO_FP8_DIST_TIMEOUT_MIN`` minutes, 30 by default."""
    raw = env_setting("dist_timeout_min")
    try:
        minutes = int(raw) if raw is not None else 30
    except ValueError:
        raise ValueError(f"NEMO_FP8_DIST_TIMEOUT_MIN={raw!r} is not an integer number of minutes") from None
    if minutes <= 0:
        raise ValueError(f"NEMO_FP8_DIST_TIMEOUT_MIN={raw!r} must be a positive number of minutes")
    return minutes


def dist_world_size() -> int:
    """World size of the initialised default group, else ``$WORLD_SIZE`` (torchrun), else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, _env_int("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> DistContext:
    """A :class:`DistContext` for this process.

    ``device`` is the trainer's resolved device: on CUDA each rank takes ``cuda:LOCAL_RANK``.
    Uses an already initialised default group (e.g. set up by the caller) as is.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local = _env_int("LOCAL_RANK", rank)
        here = False
    else:
        world = _env_int("WORLD_SIZE", 1)
        if world <= 1:
            return DistContext(device=device)
        rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"timeout": datetime.timedelta(minutes=_timeout_minutes())}
        if device.type == "cuda":
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend=backend, **kwargs)
        here = True
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {rank} has LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) are "
                "visible; start at most one process per GPU (torchrun --nproc_per_node)"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return DistContext(world_size=world, rank=rank, local_rank=local, device=device, initialized_here=here)


def _sum_allreduce_hook(process_group, bucket):
    """DDP communication hook: all-reduce SUM (DDP's default divides by the world size)."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_model(
    model: nn.Module, mode: str, ctx: DistContext, *, find_unused_parameters: bool = False, block_attr: str = "layers"
) -> nn.Module:
    """Wrap ``model`` for data parallelism; returns it unchanged on one rank.

    ``ddp``: :class:`~torch.nn.parallel.DistributedDataParallel` (FP8 scaling buffers are kept out
    of its buffer broadcast by ``convert_model``). ``fsdp2``: ``fully_shard`` on every block of
    ``model.<block_attr>`` and on the root (parameters sharded, FP32 all-gather). Both reduce
    gradients with a sum (see the module docstring).
    """
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"unknown data-parallel mode {mode!r}; valid modes: {', '.join(DATA_PARALLEL_MODES)}")
    if not ctx.distributed:
        return model
    fused = [fqn for fqn, m in model.named_modules() if getattr(m, "fuse_wgrad_accumulation", False)]
    if fused:
        raise ValueError(
            f"{len(fused)} FP8 linears (e.g. {fused[0]!r}) fuse their weight-gradient accumulation into "
            f"the GEMM, which skips the gradient hooks {mode} reduces with; call "
            "set_wgrad_accumulation_fusion(model, False) before wrap_model"
        )
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, find_unused_parameters=find_unused_parameters)
        ddp.register_comm_hook(None, _sum_allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    blocks = getattr(model, block_attr, None)
    if blocks is None:
        raise ValueError(f"fsdp2 shards model.{block_attr}, which {type(model).__name__} does not have")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in list(blocks) + [model]:
        m.set_gradient_divide_factor(1.0)
        if hasattr(m, "set_force_sum_reduction_for_comms"):  # plain SUM: gloo has no PREMUL_SUM
            m.set_force_sum_reduction_for_comms(True)
    return model


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """In-place SUM all-reduce across ranks (no-op on one rank); returns ``t``."""
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def grad_sync(model: nn.Module, mode: str, ctx: DistContext, sync: bool):
    """Context for one micro-batch's backward: gradient reduction only when ``sync`` (the last
    micro-batch of the step); earlier micro-batches accumulate locally."""
    import contextlib

    if not ctx.distributed or sync:
        if ctx.distributed and mode == "fsdp2":
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if mode == "ddp":
        return model.no_sync()
    model.set_requires_gradient_sync(False)
    return contextlib.nullcontext()


def full_tensor(t):
    """A DTensor's full value (FSDP2 grad norms); other tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        if ctx.device.type == "cuda":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


_SD_OPTIONS_KW = dict(full_state_dict=True, cpu_offload=True)


def state_dicts(model: nn.Module, optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Full model and optimizer state dicts (FQN-keyed, on CPU), identical for one rank, DDP and
    FSDP2. A collective under FSDP2: call on every rank; only rank 0's copy is complete."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(**_SD_OPTIONS_KW)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def load_state_dicts(
    model: nn.Module, optimizer, model_state: Dict[str, Any], optim_state: Optional[Dict[str, Any]], strict: bool = True
):
    """Load full state dicts written by :func:`state_dicts` (any world size / wrapper) into this
    rank's model and optimizer. Returns the model's incompatible keys (``strict=False``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=strict)
    result = set_model_state_dict(model, model_state, options=opts)
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
    return result


def reduce_telemetry(values: Dict[str, float], ctx: DistContext) -> Dict[str, float]:
    """FP8 telemetry of every rank combined (same keys everywhere), each statistic as
    :func:`~nemo_fp8_recipes.nn.telemetry_combine` says: ``…/amax`` and the worst expert's
    fractions the max over ranks, the worst expert's SQNR the min, other statistics the mean.
    Every rank gets the result."""
    if not ctx.distributed or not values:
        return values
    import torch.distributed as dist

    from ..nn import telemetry_combine

    keys = sorted(values)
    dev = ctx.device
    out = {}
    for how, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("mean", dist.ReduceOp.SUM)):
        ks = [k for k in keys if telemetry_combine(k) == how]
        if not ks:
            continue
        t = torch.tensor([values[k] for k in ks], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        out.update(zip(ks, (t / ctx.world_size if how == "mean" else t).tolist()))
    return out


def merge_audits(report, ctx: DistContext) -> List[str]:
    """Gather every rank's audit on rank 0 and compare it with rank 0's ``report``. Returns, on
    rank 0, the problems found (ranks whose per-module precision or GEMM counts differ, ranks with
    policy violations); an empty list elsewhere and on one rank."""
    if not ctx.distributed:
        return []
    import torch.distributed as dist

    mine = report.to_dict()
    gathered: List[Optional[dict]] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    problems = []
    if ctx.is_main:
        for r, other in enumerate(gathered):
            if r != 0 and other != mine:
                problems.append(f"rank {r}'s precision audit differs from rank 0's")
            if other and other.get("violations"):
                problems.append(f"rank {r}: policy violations {other['violations']}")
    return problems
