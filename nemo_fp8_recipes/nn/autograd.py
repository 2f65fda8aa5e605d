"""The FP8 linear's autograd functions: the eager one (the module's quantisers, FP8 weight cache,
delayed-scaling state, telemetry, Python GEMM counters), its fused-SwiGLU form, and the
compile-traceable ones (current scaling; delayed scaling with its scales fixed for the step) with
no Python-side state."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from ..recipes import Recipe
from .gemms import (
    GO,
    IN,
    W,
    check_device,
    fprop,
    grads,
    quantize_current,
    quantize_delayed,
    quantize_weight,
    unpack,
)
from .shared_input import input_quantizer
from .wgrad_fusion import wgrad_target

__all__ = [
    "Float8LinearDelayedTracedFn",
    "Float8LinearFn",
    "Float8LinearTracedFn",
    "Float8SwiGLULinearFn",
    "module_fprop",
    "module_grads",
]


class Float8LinearFn(torch.autograd.Function):
    """Eager path: the module's quantisers (fused Triton kernels on CUDA), FP8 weight cache,
    delayed-scaling state, telemetry and Python GEMM counters."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod: nn.Module, out_dtype: torch.dtype, grad_enabled: bool):
        check_device(x, mod.emulate, mod.fqn)
        return module_fprop(ctx, x, weight, bias, mod, out_dtype, input_quantizer(mod, x), grad_enabled)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = module_grads(ctx, dy, ctx.saved_tensors)
        return dx, dw, db, None, None, None


def module_fprop(ctx, x, weight, bias, mod: nn.Module, out_dtype, quantize_operand, grad_enabled: bool, keep=()):
    """The eager autograd functions' forward: :func:`fprop` with the module's cached FP8 weight
    and ``quantize_operand``, the fprop count, and the saved tensors (plus ``keep``, appended)."""
    y, to_save = fprop(
        ctx,
        x,
        bias,
        mod._quantized_weight(),
        recipe=mod.recipe,
        emulate=mod.emulate,
        row_multiple=mod._row_multiple,
        out_dtype=out_dtype,
        quantize_operand=quantize_operand,
        grad_enabled=grad_enabled,
    )
    mod._count("fprop")
    ctx.save_for_backward(*to_save, *keep)
    ctx.mod = mod
    ctx.w_dtype = weight.dtype
    return y


def module_grads(ctx, dy, saved, need_dx: Optional[bool] = None):
    """The eager autograd functions' dgrad/wgrad (:func:`grads` with the module's quantisers),
    counted."""
    mod = ctx.mod
    into = wgrad_target(mod, ctx) if mod.fuse_wgrad_accumulation else None
    dx, dw, db = grads(
        ctx,
        dy,
        saved,
        recipe=mod.recipe,
        emulate=mod.emulate,
        w_dtype=ctx.w_dtype,
        quantize_operand=mod._quantize_operand,
        need_dx=need_dx,
        accumulate_into=into,
    )
    if dx is not None:
        mod._count("dgrad")
    if dw is not None:
        mod._count("wgrad")
        if dw is into:  # already in weight.grad: autograd gets no gradient to add
            dw = None
    return dx, dw, db


class Float8SwiGLULinearFn(torch.autograd.Function):
    """The eager path for ``x = F.silu(g) * u``, fused (:meth:`Float8Linear.fuses_swiglu`): the
    input's per-tensor codes and their transpose are computed from ``g`` and ``u`` by the Triton
    quantisers — delayed scaling inside its one-pass cast (the activation is never written),
    current scaling in its amax pass, which writes the activation once for the cast to read
    (:func:`~nemo_fp8_recipes.quant.triton_kernels.quantize_tensor_dual`). Backward turns the dgrad
    output into ``(dg, du)`` in one kernel
    (:func:`~nemo_fp8_recipes.quant.triton_kernels.swiglu_backward`) instead of autograd's
    three. Saves ``g`` and ``u`` (autograd of the unfused SwiGLU saves them too, and SiLU's
    output)."""

    @staticmethod
    def forward(ctx, u, weight, bias, g, mod: nn.Module, out_dtype: torch.dtype, grad_enabled: bool):
        g2 = g.reshape(-1, g.shape[-1])

        def quantize_operand(i, t, pair=False):
            return mod._quantize_operand(i, t, pair=pair, gate=g2 if i == IN else None)

        return module_fprop(ctx, u, weight, bias, mod, out_dtype, quantize_operand, grad_enabled, keep=(g, u))

    @staticmethod
    def backward(ctx, dy):
        from ..quant.triton_kernels import swiglu_backward

        *saved, g, u = ctx.saved_tensors
        dact, dw, db = module_grads(ctx, dy, saved, need_dx=ctx.needs_input_grad[0] or ctx.needs_input_grad[3])
        dg = du = None
        if dact is not None:
            dg, du = swiglu_backward(dact.contiguous(), g, u)
        return du, dw, db, dg, None, None, None


class Float8LinearTracedFn(torch.autograd.Function):
    """Compile-traceable path (current scaling only): no Python-side state. The quantisers of
    :func:`quantize_current` (Triton custom operators on CUDA, else the reference quantisers in
    plain torch ops) and the GEMM dispatch of :mod:`nemo_fp8_recipes.quant.gemm`,
    the weight quantised in every forward — or, given ``wmeta`` and the six ``wcache`` tensors
    (the module's compiled weight cache, :meth:`Float8Linear.set_graph_weight_cache`), read from
    them — and the dgrad/wgrad counts added in-graph to ``bwd_counts`` (an int64 buffer of the
    module, only ever mutated in backward)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        bwd_counts,
        recipe: Recipe,
        emulate: bool,
        row_multiple: int,
        out_dtype: torch.dtype,
        fqn: str,
        grad_enabled: bool,
        triton: bool,
        wmeta,
        *wcache,
    ):
        check_device(x, emulate, fqn)
        quantize_operand = functools.partial(quantize_current, recipe, triton=triton)
        if wmeta is None:  # quantised here, in the graph
            weights = quantize_weight(weight.detach(), recipe, emulate, quantize_operand)
        else:  # the module's cached FP8 weight (buffers re-quantised after each optimizer step)
            weights = (unpack(wmeta[0], wcache[:3]), unpack(wmeta[1], wcache[3:]))
        y, to_save = fprop(
            ctx,
            x,
            bias,
            weights,
            recipe=recipe,
            emulate=emulate,
            row_multiple=row_multiple,
            out_dtype=out_dtype,
            quantize_operand=quantize_operand,
            grad_enabled=grad_enabled,
        )
        ctx.save_for_backward(*to_save, bwd_counts)
        ctx.recipe, ctx.emulate, ctx.triton = recipe, emulate, triton
        ctx.w_dtype = weight.dtype
        ctx.n_wcache = len(wcache)
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, bwd_counts = ctx.saved_tensors
        dx, dw, db = grads(
            ctx,
            dy,
            saved,
            recipe=ctx.recipe,
            emulate=ctx.emulate,
            w_dtype=ctx.w_dtype,
            quantize_operand=functools.partial(quantize_current, ctx.recipe, triton=ctx.triton),
        )
        if dx is not None:
            bwd_counts[0].add_(1)
        if dw is not None:
            bwd_counts[1].add_(1)
        return (dx, dw, db, None, None, None, None, None, None, None, None, None) + (None,) * ctx.n_wcache


def _recording(recipe: Recipe, scales: torch.Tensor, triton: bool, amaxes: dict):
    """:func:`quantize_delayed` with the given scales that keeps each operand's amax in ``amaxes``."""

    def quantize_operand(i, t, pair=False):
        q = quantize_delayed(recipe, scales, i, t, pair=pair, triton=triton)
        amaxes[i] = (q[0] if pair else q).amax.reshape(1)
        return q

    return quantize_operand


class Float8LinearDelayedTracedFn(torch.autograd.Function):
    """Compile-traceable delayed scaling under the ``step`` update schedule
    (:mod:`nemo_fp8_recipes.nn.scaling`): the module's scales ``scales`` (its ``fp8_scale``
    buffer) are fixed for the whole optimizer step, so each quantisation is a stateless cast with
    a given scale (:func:`quantize_delayed`: one pass that also takes the amax) and the amaxes
    leave the graph as values: the forward returns ``(y, amax of input and weight [2])`` for the
    module to fold into its pending amaxes; the backward max-accumulates the gradient's amax into
    ``grad_pending`` (``[amax, flag]``, a buffer of the module mutated only here, folded into the
    pending amaxes by :func:`~nemo_fp8_recipes.nn.sync_delayed_scaling`) and counts its GEMMs in
    ``bwd_counts``. The weight is quantised in every forward (its scale is the step's, so the
    codes are those the eager path caches for the step)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        scales,
        grad_pending,
        bwd_counts,
        recipe: Recipe,
        emulate: bool,
        row_multiple: int,
        out_dtype: torch.dtype,
        fqn: str,
        grad_enabled: bool,
        triton: bool,
    ):
        check_device(x, emulate, fqn)
        amaxes: dict = {}
        quantize_operand = _recording(recipe, scales, triton, amaxes)
        weights = quantize_weight(weight.detach(), recipe, emulate, quantize_operand)
        y, to_save = fprop(
            ctx,
            x,
            bias,
            weights,
            recipe=recipe,
            emulate=emulate,
            row_multiple=row_multiple,
            out_dtype=out_dtype,
            quantize_operand=quantize_operand,
            grad_enabled=grad_enabled,
        )
        ctx.save_for_backward(*to_save, scales, grad_pending, bwd_counts)
        ctx.recipe, ctx.emulate, ctx.triton = recipe, emulate, triton
        ctx.w_dtype = weight.dtype
        fwd_amax = torch.cat([amaxes[IN], amaxes[W]])
        ctx.mark_non_differentiable(fwd_amax)
        return y, fwd_amax

    @staticmethod
    def backward(ctx, dy, _unused):
        *saved, scales, grad_pending, bwd_counts = ctx.saved_tensors
        amaxes: dict = {}
        dx, dw, db = grads(
            ctx,
            dy,
            saved,
            recipe=ctx.recipe,
            emulate=ctx.emulate,
            w_dtype=ctx.w_dtype,
            quantize_operand=_recording(ctx.recipe, scales, ctx.triton, amaxes),
        )
        grad_pending[0:1].copy_(torch.maximum(grad_pending[0:1], amaxes[GO]))
        grad_pending[1:2].fill_(1.0)
        if dx is not None:
            bwd_counts[0].add_(1)
        if dw is not None:
            bwd_counts[1].add_(1)
        return (dx, dw, db) + (None,) * 10
