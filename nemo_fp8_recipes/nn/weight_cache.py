"""The FP8 weight caches' invalidation: an optimizer-step generation and the compiled caches to refresh.

The eager FP8 linear keeps its FP8 weight copies until the weight changes; the compiled path can
read them from buffers (:meth:`~nemo_fp8_recipes.nn.Float8Linear.set_graph_weight_cache`). Both
need to know when an optimizer stepped: a global optimizer step hook bumps
:data:`OPTIMIZER_GENERATION` and re-quantises the compiled caches of the weights it updated.

An eager copy pays only until the next optimizer step (it is reused by the gradient-accumulation
micro-batches of one step, and every step invalidates it): a global pre-step hook releases every
eager copy before the optimizer runs, so they never sit beside the optimizer's own memory (2
bytes per FP8 weight element, both orientations, otherwise held through the step and until each
layer's next forward). The hooks are registered by the first FP8 linear
(:func:`install_optimizer_hook`), not at import.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["EAGER_CACHED", "GRAPH_CACHED", "OPTIMIZER_GENERATION", "install_optimizer_hook"]

# Every optimizer step, of any optimizer, bumps this generation; the FP8 weight cache is keyed on
# it as well as on the weight's version counter, because fused and foreach optimizers (e.g.
# ``AdamW(fused=True)``) update parameters without bumping ``Tensor._version``. Between steps
# (gradient-accumulation micro-batches) the cached FP8 weight is reused.
OPTIMIZER_GENERATION = [0]


# FP8 linears whose compiled (traced) forward reads an FP8 weight cached in buffers
# (:meth:`Float8Linear.set_graph_weight_cache`); an optimizer step re-quantises those of its params.
GRAPH_CACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# FP8 linears holding an eager FP8 weight copy (:meth:`Float8Linear.release_weight_cache` drops it);
# every optimizer step releases them all before it runs.
EAGER_CACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _release_eager_caches(optimizer, args, kwargs) -> None:
    for m in list(EAGER_CACHED):
        m.release_weight_cache()


def _bump_generation(optimizer, args, kwargs) -> None:
    OPTIMIZER_GENERATION[0] += 1
    if len(GRAPH_CACHED):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for m in list(GRAPH_CACHED):
            if id(m.weight) in stepped:
                m.refresh_graph_weight_cache()


_HOOK = []  # the optimizer hooks' handles, once installed


def install_optimizer_hook() -> None:
    """Register :func:`_release_eager_caches` and :func:`_bump_generation` as global optimizer
    step hooks (before and after each step), once, when the first FP8 linear is built (importing
    the package installs nothing)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_release_eager_caches))
        _HOOK.append(register_optimizer_step_post_hook(_bump_generation))
