"""The FP8 weight caches' invalidation: an optimizer-step generation and the compiled caches to refresh.

The eager FP8 linear keeps its FP8 weight copies until the weight changes; the compiled path can
read them from buffers (:meth:`~nemo_fp8_recipes.nn.Float8Linear.set_graph_weight_cache`). Both
need to know when an optimizer stepped: a global optimizer step hook bumps
:data:`OPTIMIZER_GENERATION` and re-quantises the compiled caches of the weights it updated. The
hook is registered by the first FP8 linear (:func:`install_optimizer_hook`), not at import.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["GRAPH_CACHED", "OPTIMIZER_GENERATION", "install_optimizer_hook"]

# Every optimizer step, of any optimizer, bumps this generation; the FP8 weight cache is keyed on
# it as well as on the weight's version counter, because fused and foreach optimizers (e.g.
# ``AdamW(fused=True)``) update parameters without bumping ``Tensor._version``. Between steps
# (gradient-accumulation micro-batches) the cached FP8 weight is reused.
OPTIMIZER_GENERATION = [0]


# FP8 linears whose compiled (traced) forward reads an FP8 weight cached in buffers
# (:meth:`Float8Linear.set_graph_weight_cache`); an optimizer step re-quantises those of its params.
GRAPH_CACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _bump_generation(optimizer, args, kwargs) -> None:
    OPTIMIZER_GENERATION[0] += 1
    if len(GRAPH_CACHED):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for m in list(GRAPH_CACHED):
            if id(m.weight) in stepped:
                m.refresh_graph_weight_cache()


_HOOK = []  # the optimizer hook's handle, once installed


def install_optimizer_hook() -> None:
    """Register :func:`_bump_generation` as a global optimizer step hook, once, when the first
    FP8 linear is built (importing the package installs nothing)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_bump_generation))
