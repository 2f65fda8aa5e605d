"""The FP8 linear's autograd functions: they take tensors and the module's
:class:`~nemo_fp8_recipes.nn.Float8LinearConfig`, never the module.

The eager one (and its fused-SwiGLU form) also takes an :class:`Operands` object — the module's
stateful services: its operand quantiser (delayed-scaling state, telemetry), FP8 weight cache,
GEMM counters and fused-wgrad target (:class:`~nemo_fp8_recipes.nn.linear.Float8LinearOperands`).
The compile-traceable ones (current scaling; delayed scaling with its scales fixed for the step)
have no Python-side state: tensors, the config and the module's name for messages."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Protocol, Tuple

import torch

from ..recipes import Recipe
from .config import Float8LinearConfig
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

__all__ = [
    "Float8LinearDelayedTracedFn",
    "Float8LinearFn",
    "Float8LinearTracedFn",
    "Float8SwiGLULinearFn",
    "Operands",
    "module_fprop",
    "module_grads",
]


class Operands(Protocol):
    """What the eager autograd functions need of an FP8 linear (its implementation:
    :class:`~nemo_fp8_recipes.nn.linear.Float8LinearOperands`)."""

    config: Float8LinearConfig
    fqn: str

    def quantize(self, i: int, t: torch.Tensor, pair: bool = False, gate: Optional[torch.Tensor] = None):
        """Quantise operand ``i`` of ``t`` with the module's state (a ``QuantizedTensor``; with
        ``pair``, also the wgrad copy)."""

    def input_quantizer(self, x: torch.Tensor) -> Callable:
        """:meth:`quantize`, sharing the quantisation of the input ``x`` where that is exact."""

    def quantized_weight(self) -> Tuple:
        """The cached FP8 weight: (along K, along N)."""

    def count(self, gemm: str) -> None:
        """Count one GEMM run in FP8."""

    def wgrad_target(self, ctx) -> Optional[torch.Tensor]:
        """The gradient the wgrad GEMM accumulates into, or None."""


class Float8LinearFn(torch.autograd.Function):
    """Eager path: the module's quantisers (fused Triton kernels on CUDA), FP8 weight cache,
    delayed-scaling state, telemetry and Python GEMM counters, through ``ops``."""

    @staticmethod
    def forward(ctx, x, weight, bias, ops: Operands, out_dtype: torch.dtype, grad_enabled: bool):
        check_device(x, ops.config.emulate, ops.fqn)
        return module_fprop(ctx, x, weight, bias, ops, out_dtype, ops.input_quantizer(x), grad_enabled)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = module_grads(ctx, dy, ctx.saved_tensors)
        return dx, dw, db, None, None, None


def module_fprop(ctx, x, weight, bias, ops: Operands, out_dtype, quantize_operand, grad_enabled: bool, keep=()):
    """The eager autograd functions' forward: :func:`fprop` with the module's cached FP8 weight
    and ``quantize_operand``, the fprop count, and the saved tensors (plus ``keep``, appended)."""
    cfg = ops.config
    y, to_save = fprop(
        ctx,
        x,
        bias,
        ops.quantized_weight(),
        recipe=cfg.recipe,
        emulate=cfg.emulate,
        row_multiple=cfg.row_multiple,
        out_dtype=out_dtype,
        quantize_operand=quantize_operand,
        grad_enabled=grad_enabled,
    )
    ops.count("fprop")
    ctx.save_for_backward(*to_save, *keep)
    ctx.ops = ops
    ctx.w_dtype = weight.dtype
    return y


def module_grads(ctx, dy, saved, need_dx: Optional[bool] = None):
    """The eager autograd functions' dgrad/wgrad (:func:`grads` with the module's quantisers),
    counted."""
    ops = ctx.ops
    into = ops.wgrad_target(ctx)
    dx, dw, db = grads(
        ctx,
        dy,
        saved,
        recipe=ops.config.recipe,
        emulate=ops.config.emulate,
        w_dtype=ctx.w_dtype,
        quantize_operand=ops.quantize,
        need_dx=need_dx,
        accumulate_into=into,
    )
    if dx is not None:
        ops.count("dgrad")
    if dw is not None:
        ops.count("wgrad")
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
    def forward(ctx, u, weight, bias, g, ops: Operands, out_dtype: torch.dtype, grad_enabled: bool):
        g2 = g.reshape(-1, g.shape[-1])

        def quantize_operand(i, t, pair=False):
            return ops.quantize(i, t, pair=pair, gate=g2 if i == IN else None)

        return module_fprop(ctx, u, weight, bias, ops, out_dtype, quantize_operand, grad_enabled, keep=(g, u))

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
    """Compile-traceable path (current scaling only): no Python-side state, the module's
    ``config`` (recipe, emulation, ``KernelOptions.triton``). The quantisers of
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
        config: Float8LinearConfig,
        out_dtype: torch.dtype,
        fqn: str,
        grad_enabled: bool,
        wmeta,
        *wcache,
    ):
        recipe, emulate = config.recipe, config.emulate
        check_device(x, emulate, fqn)
        quantize_operand = functools.partial(quantize_current, recipe, triton=config.kernel_options.triton)
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
            row_multiple=config.row_multiple,
            out_dtype=out_dtype,
            quantize_operand=quantize_operand,
            grad_enabled=grad_enabled,
        )
        ctx.save_for_backward(*to_save, bwd_counts)
        ctx.config = config
        ctx.w_dtype = weight.dtype
        ctx.n_wcache = len(wcache)
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, bwd_counts = ctx.saved_tensors
        cfg = ctx.config
        dx, dw, db = grads(
            ctx,
            dy,
            saved,
            recipe=cfg.recipe,
            emulate=cfg.emulate,
            w_dtype=ctx.w_dtype,
            quantize_operand=functools.partial(quantize_current, cfg.recipe, triton=cfg.kernel_options.triton),
        )
        if dx is not None:
            bwd_counts[0].add_(1)
        if dw is not None:
            bwd_counts[1].add_(1)
        # (bwd_counts, config, out_dtype, fqn, grad_enabled, wmeta, *wcache) take no gradient
        return (dx, dw, db) + (None,) * (6 + ctx.n_wcache)


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
        config: Float8LinearConfig,
        out_dtype: torch.dtype,
        fqn: str,
        grad_enabled: bool,
    ):
        recipe, emulate = config.recipe, config.emulate
        check_device(x, emulate, fqn)
        amaxes: dict = {}
        quantize_operand = _recording(recipe, scales, config.kernel_options.triton, amaxes)
        weights = quantize_weight(weight.detach(), recipe, emulate, quantize_operand)
        y, to_save = fprop(
            ctx,
            x,
            bias,
            weights,
            recipe=recipe,
            emulate=emulate,
            row_multiple=config.row_multiple,
            out_dtype=out_dtype,
            quantize_operand=quantize_operand,
            grad_enabled=grad_enabled,
        )
        ctx.save_for_backward(*to_save, scales, grad_pending, bwd_counts)
        ctx.config = config
        ctx.w_dtype = weight.dtype
        fwd_amax = torch.cat([amaxes[IN], amaxes[W]])
        ctx.mark_non_differentiable(fwd_amax)
        return y, fwd_amax

    @staticmethod
    def backward(ctx, dy, _unused):
        *saved, scales, grad_pending, bwd_counts = ctx.saved_tensors
        amaxes: dict = {}
        cfg = ctx.config
        dx, dw, db = grads(
            ctx,
            dy,
            saved,
            recipe=cfg.recipe,
            emulate=cfg.emulate,
            w_dtype=ctx.w_dtype,
            quantize_operand=_recording(cfg.recipe, scales, cfg.kernel_options.triton, amaxes),
        )
        grad_pending[0:1].copy_(torch.maximum(grad_pending[0:1], amaxes[GO]))
        grad_pending[1:2].fill_(1.0)
        if dx is not None:
            bwd_counts[0].add_(1)
        if dw is not None:
            bwd_counts[1].add_(1)
        # (scales, grad_pending, bwd_counts, config, out_dtype, fqn, grad_enabled) take no gradient
        return (dx, dw, db) + (None,) * 7
