"""How the trainer compiles its model (``trainer.compile``, ``trainer.compile_mode``):
:func:`compile_model`, and the trainer's side of a CUDA-graph mode (``reduce-overhead``,
``max-autotune``), in which torch.compile replays each compiled graph as a CUDA graph, which
removes the host's launch gaps that bound small models.

Three things make such a run train as the default mode does (:class:`CudaGraphReplays`):

- a new replay is marked before every micro-batch and validation batch
  (``torch.compiler.cudagraph_mark_step_begin``): the previous micro-batch's outputs have been
  consumed, so the graphs may write their output buffers again;
- every parameter's gradient is copied out of the graph pool before autograd accumulates it:
  otherwise ``.grad`` would be the backward graph's output buffer itself, which the next replay
  overwrites (with gradient accumulation, and with one micro-batch per step too);
- graphs Inductor could not capture run without CUDA graphs, correctly but with the launch gaps:
  they are counted (Inductor's ``cudagraph_skips`` counter), reported after the first step and at
  the end, and written to ``summary.json``.

The configuration checks (a CUDA device, one process) are
:func:`nemo_fp8_recipes.trainer.checks.check_compile_mode`.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from ..config import uses_cuda_graphs

__all__ = ["CudaGraphReplays", "compile_model", "cuda_graph_skips"]

log = logging.getLogger("nemo_fp8_recipes.train")


def cuda_graph_skips() -> int:
    """How many compiled graphs Inductor has run without CUDA graphs in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class CudaGraphReplays:
    """What the trainer does around the replays of one run under CUDA-graph ``mode``: the
    gradient copies on ``model``'s parameters (installed here, removed by :meth:`close`), the
    replay marks (:meth:`mark`) and the count of graphs run without CUDA graphs (:meth:`report`)."""

    def __init__(self, model: torch.nn.Module, mode: str):
        self.mode = mode
        self.skips0 = cuda_graph_skips()
        self.reported: Optional[int] = None
        self.hooks = [p.register_hook(torch.clone) for p in model.parameters() if p.requires_grad]
        log.info(
            "trainer.compile_mode=%s: the compiled graphs replay as CUDA graphs (gradients copied out of "
            "the graph pool: %d parameters)",
            mode,
            len(self.hooks),
        )

    @staticmethod
    def mark() -> None:
        """A new replay begins: the outputs of the previous one have been consumed."""
        torch.compiler.cudagraph_mark_step_begin()

    def report(self, final: bool = False) -> int:
        """Log whether every graph compiled so far replays as a CUDA graph and return how many do
        not; ``final``: log only if that changed since the last report (validation and telemetry
        steps compile graphs of their own)."""
        n = cuda_graph_skips() - self.skips0
        if not (final and n == self.reported):
            if n:
                log.warning(
                    "trainer.compile_mode=%s: %d compiled graph(s) run without CUDA graphs, with the host's "
                    "launch overhead (TORCH_LOGS=cudagraphs prints why)",
                    self.mode,
                    n,
                )
            else:
                log.info("trainer.compile_mode=%s: every compiled graph replays as a CUDA graph", self.mode)
        self.reported = n
        return n

    def close(self) -> int:
        """The run's last :meth:`report` (``final``), and the gradient copies removed (the trained
        model goes back to the caller as it was); returns the count of graphs run without CUDA graphs."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        return self.report(final=True)


def compile_model(
    dp_model: torch.nn.Module, raw_model: torch.nn.Module, tcfg
) -> Tuple[torch.nn.Module, Optional[CudaGraphReplays]]:
    """The module the trainer runs forward: ``dp_model`` (the data-parallel wrapper, or the model
    itself) under ``torch.compile`` with ``trainer.compile_mode`` when ``trainer.compile=true``;
    and, for a CUDA-graph mode, the :class:`CudaGraphReplays` on ``raw_model``'s parameters."""
    if not tcfg.compile:
        return dp_model, None
    model = torch.compile(dp_model, mode=None if tcfg.compile_mode == "default" else tcfg.compile_mode)
    return model, (CudaGraphReplays(raw_model, tcfg.compile_mode) if uses_cuda_graphs(tcfg) else None)
