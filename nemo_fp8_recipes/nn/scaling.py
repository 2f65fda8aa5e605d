"""Delayed scaling: the one place where amax histories advance and scales are recomputed.

A delayed-scaling :class:`~nemo_fp8_recipes.nn.Float8Linear` keeps, per operand (input, weight,
grad_output), an amax history, a scale, and the amax recorded since the last update ("pending").
Two update schedules share :func:`~nemo_fp8_recipes.quant.delayed.advance_delayed_scaling`:

``lazy`` (the module default, no trainer needed)
    each operand commits its pending amax right before its next quantisation, so every
    forward/backward call advances the history (a plain training loop needs no extra call). On
    CUDA the commit is one Triton kernel (``quant.triton_kernels.delayed_commit``, same numbers)
    and the cast that follows folds the new amax into the pending value in the same pass.

``step`` (what the embedded trainer uses)
    scales stay fixed for a whole optimizer step; every quantisation in the step max-accumulates
    its amax (which lets ``torch.compile`` trace the linear: each cast takes a given scale);
    :func:`sync_delayed_scaling` then max-reduces all pending amaxes of the model across the
    data-parallel group in **one** collective and advances every history once. The result is
    the same for any split of the global batch over ranks and micro-batches (the max is exact), so
    a 2-rank run reproduces a 1-rank run with gradient accumulation, and every rank holds
    identical scales. Transformer Engine advances its histories once per forward/backward pass
    instead (with its own amax reduction per pass).

Update rule (both schedules, TE's): append the pending amax, ``amax = max(history)`` (or the most
recent entry), ``scale = fmax / amax / 2**margin`` (``pow2`` rounding if the recipe asks); a zero
or non-finite amax keeps the previous scale.

Grouped MoE experts (:class:`~nemo_fp8_recipes.nn.Float8GroupedExperts`) keep the same state per
weight and expert; every function here treats them like the FP8 linears (their amaxes go into the
same all-reduce).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn

from ..quant.delayed import advance_delayed_scaling
from .config import UPDATE_MODES
from .grouped import fp8_state_modules, grouped_fp8_modules
from .linear import fp8_modules

__all__ = [
    "discard_delayed_scaling",
    "pinned_scales",
    "set_delayed_scaling_update",
    "sync_delayed_scaling",
    "fp8_state_snapshot",
    "restore_fp8_state",
]


def _delayed_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in fp8_modules(model).values() if m.recipe.is_delayed]


def _delayed_grouped(model: nn.Module) -> List[nn.Module]:
    return [m for m in grouped_fp8_modules(model).values() if m.recipe.is_delayed]


def set_delayed_scaling_update(model: nn.Module, mode: str) -> int:
    """Choose when delayed-scaling modules of ``model`` advance their amax histories:
    ``"lazy"`` (before each quantisation) or ``"step"`` (once per optimizer step, in
    :func:`sync_delayed_scaling`). A thin wrapper: ``reconfigure(scaling_update=mode)`` on each
    (which commits pending amaxes first, so switching never loses one); choose the schedule once
    with ``convert_model(..., scaling_update=mode)``. Returns the number of delayed-scaling
    modules."""
    if mode not in UPDATE_MODES:
        raise ValueError(f"unknown delayed-scaling update mode {mode!r}; valid modes: {', '.join(UPDATE_MODES)}")
    mods = _delayed_modules(model) + _delayed_grouped(model)
    for m in mods:
        m.reconfigure(scaling_update=mode)
    return len(mods)


@torch.no_grad()
def sync_delayed_scaling(model: nn.Module, process_group=None) -> int:
    """Advance every delayed-scaling history of ``model`` by the amaxes recorded since the last
    call, max-reduced across ``process_group`` (default: the default group when
    ``torch.distributed`` is initialised with more than one rank) in a single all-reduce.

    Call it once per optimizer step, after the last backward and before the next forward, on
    every rank (it is a collective). No host synchronisation. Returns the number of modules.
    """
    mods, grouped = _delayed_modules(model), _delayed_grouped(model)
    if mods or grouped:
        _advance(mods, grouped, process_group, reduce=True)
    return len(mods) + len(grouped)


@torch.no_grad()
def _advance(mods: List[nn.Module], grouped: List[nn.Module], process_group, reduce: bool) -> None:
    import torch.distributed as dist

    rows = []  # [n, 6] per module kind: pending amaxes and flags of (input, weight, grad_output)
    if mods:
        pend = torch.stack([m.fp8_amax_pending for m in mods])
        flags = torch.stack([m.fp8_pending for m in mods])
        # the compile-traced path's grad_output amaxes (recorded in its backward, Float8Linear.fold_traced_amax)
        traced = torch.stack([m.fp8_grad_pending for m in mods])
        pend[:, 2] = torch.maximum(pend[:, 2], traced[:, 0])
        flags[:, 2] = torch.maximum(flags[:, 2], traced[:, 1])
        rows.append(torch.cat([pend, flags], dim=1))
    # grouped experts: one row per (weight, expert)
    rows += [torch.cat([g.fp8_amax_pending.reshape(-1, 3), g.fp8_pending.reshape(-1, 3)], dim=1) for g in grouped]
    both = torch.cat(rows)  # one collective for the whole model
    if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=process_group)
    start = len(mods)
    for g in grouped:
        n = g.fp8_pending.numel() // 3
        g.fp8_amax_pending.copy_(both[start : start + n, :3].reshape(g.fp8_amax_pending.shape))
        g.fp8_pending.copy_(both[start : start + n, 3:].reshape(g.fp8_pending.shape))
        g.advance_delayed_scaling((0, 1, 2), reduce=False)
        start += n
    if not mods:
        return
    pend, flags = both[: len(mods), :3], both[: len(mods), 3:]
    groups: Dict[int, List[int]] = {}
    recipes = {}
    for k, m in enumerate(mods):
        key = id(m.recipe)
        groups.setdefault(key, []).append(k)
        recipes[key] = m.recipe
    for key, idx in groups.items():
        r = recipes[key]
        sel = torch.tensor(idx, device=pend.device) if len(idx) != len(mods) else None
        p = pend if sel is None else pend.index_select(0, sel)
        f = flags if sel is None else flags.index_select(0, sel)
        group = [mods[k] for k in idx]
        hist = torch.stack([m.fp8_amax_history for m in group])
        scale = torch.stack([m.fp8_scale for m in group])
        new_hist, new_scale = advance_delayed_scaling(
            hist, scale, p, f, (r.input_format, r.weight_format, r.grad_format), r
        )
        torch._foreach_copy_([m.fp8_amax_history for m in group], list(new_hist.unbind(0)))
        torch._foreach_copy_([m.fp8_scale for m in group], list(new_scale.unbind(0)))
    torch._foreach_zero_(
        [m.fp8_amax_pending for m in mods] + [m.fp8_pending for m in mods] + [m.fp8_grad_pending for m in mods]
    )
    for m in mods:
        m.pending_amaxes_cleared(scales_advanced=True)  # (its cached FP8 weight follows the new scale)


@torch.no_grad()
def discard_delayed_scaling(model: nn.Module) -> int:
    """Drop the amaxes recorded since the last :func:`sync_delayed_scaling` without appending
    them: for a step whose batch is skipped (non-finite loss or gradients), whose Inf/NaN amaxes
    would otherwise sit in every history for ``amax_history_len`` steps and pin the scales there
    (a non-finite amax keeps the previous scale). Local, no collective; call it on every rank
    (the trainer's skip decision is taken on all-reduced values). Returns the number of modules."""
    mods, grouped = _delayed_modules(model), _delayed_grouped(model)
    if mods:
        torch._foreach_zero_(
            [m.fp8_amax_pending for m in mods] + [m.fp8_pending for m in mods] + [m.fp8_grad_pending for m in mods]
        )
        for m in mods:
            m.pending_amaxes_cleared(scales_advanced=False)
    if grouped:
        torch._foreach_zero_([g.fp8_amax_pending for g in grouped] + [g.fp8_pending for g in grouped])
    return len(mods) + len(grouped)


@torch.no_grad()
def pinned_scales(model: nn.Module) -> Dict[str, List[str]]:
    """``{module name: [operands]}`` whose amax history holds a non-finite value (grouped
    experts: for any weight and expert): their scale cannot move until that entry leaves the
    history (``amax_history_len`` updates)."""
    out: Dict[str, List[str]] = {}
    for name, m in fp8_state_modules(model).items():
        if not m.recipe.is_delayed:
            continue
        # [3] for a linear; grouped experts: any of their weights and experts
        bad = (~torch.isfinite(m.fp8_amax_history)).any(-1).reshape(-1, 3).any(0).tolist()
        ops = [op for op, b in zip(("input", "weight", "grad_output"), bad) if b]
        if ops:
            out[name] = ops
    return out


def fp8_state_snapshot(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    """A copy of every FP8 linear's and grouped experts module's state besides its parameters
    (scaling buffers, extra state), to put back with :func:`restore_fp8_state` (e.g. around an
    evaluation that must not advance delayed scaling)."""
    snap = {}
    for name, m in fp8_state_modules(model).items():
        params = {n for n, _ in m.named_parameters(recurse=False)}
        snap[name] = {
            k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in m.state_dict().items() if k not in params
        }
    return snap


def restore_fp8_state(model: nn.Module, snap: Dict[str, Dict[str, Any]]) -> None:
    """Put back a :func:`fp8_state_snapshot` (through ``load_state_dict``, which also drops any
    cached FP8 weight copies, as a resumed run starts without them)."""
    for name, m in fp8_state_modules(model).items():
        if name in snap:
            result = m.load_state_dict(snap[name], strict=False)
            if result.unexpected_keys:  # pragma: no cover - a snapshot always matches its module
                raise RuntimeError(f"FP8 state restore of {name}: unexpected {result.unexpected_keys}")
