"""The three GEMMs of an FP8 linear and the quantisation of their operands, shared by the eager
and the compile-traced autograd functions (:mod:`nemo_fp8_recipes.nn.autograd`).

For ``Y = X · Wᵀ``: fprop contracts over K (X rows, W rows), dgrad over N (dY rows, W columns),
wgrad over M (dY columns, X columns) — each operand quantised along its GEMM's contraction dim
(the numerics contract, docs/recipes.md). Only FP8 codes and the scales the GEMMs consume are
saved for backward (:func:`pack_meta` / :func:`pack_tensors` / :func:`unpack`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import Granularity, ScaleRounding
from ..quant.dispatch import quantize_auto as quantize
from ..quant.dispatch import quantize_pair_auto, triton_enabled
from ..quant.gemm import scaled_matmul
from ..quant.reference import QuantizedTensor
from ..recipes import Recipe

__all__ = [
    "GO",
    "IN",
    "OPERANDS",
    "W",
    "accumulate_wgrad",
    "check_device",
    "contiguous_codes",
    "fprop",
    "grads",
    "output_dtype",
    "operand_spec",
    "pack_meta",
    "pack_tensors",
    "quantize_current",
    "quantize_delayed",
    "quantize_plain",
    "quantize_weight",
    "unpack",
]

OPERANDS = ("input", "weight", "grad_output")
IN, W, GO = 0, 1, 2


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an FP8 GEMM of input ``x`` returns: the autocast dtype where autocast is on for
    ``x``'s device, else ``x``'s own (as the high-precision matmul it replaces would)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def pack_meta(q: Optional[QuantizedTensor]):
    if q is None:
        return None
    return (q.block, q.fmt, q.scale_e8m0 is not None)


def pack_tensors(q: Optional[QuantizedTensor]):
    if q is None:
        return ()
    return (q.data, q.scale_inv, q.scale_e8m0 if q.scale_e8m0 is not None else q.scale_inv)


def unpack(meta, tensors) -> Optional[QuantizedTensor]:
    if meta is None:
        return None
    block, fmt, has_e8m0 = meta
    data, scale_inv, e8m0 = tensors
    return QuantizedTensor(
        data=data, scale_inv=scale_inv, block=block, fmt=fmt, amax=scale_inv, scale_e8m0=e8m0 if has_e8m0 else None
    )


def operand_spec(recipe: Recipe, i: int):
    """(format, granularity) of operand ``i`` (input, weight, grad_output) under ``recipe``."""
    fmt = (recipe.input_format, recipe.weight_format, recipe.grad_format)[i]
    gran = (recipe.input_granularity, recipe.weight_granularity, recipe.grad_granularity)[i]
    return fmt, gran


def quantize_current(recipe: Recipe, i: int, t: torch.Tensor, pair: bool = False, triton: bool = True):
    """Stateless current scaling of operand ``i``: the quantiser of the compile-traced path.
    On CUDA the fused Triton kernels run as custom operators (:mod:`nemo_fp8_recipes.quant.ops`:
    per-tensor pairs, 1x128 groups along rows and down columns, 128x128 weight blocks) unless
    ``triton`` is False (the module's ``KernelOptions.triton``); everything else (and E8M0
    scales) uses the reference quantisers (plain torch ops, which the compiler fuses into its own
    kernels). Same codes either way, and on CPU the same calls as
    :meth:`~nemo_fp8_recipes.nn.linear.Float8LinearOperands.quantize` of a current-scaling recipe in eager mode."""
    fmt, gran = operand_spec(recipe, i)
    rounding = recipe.scale_rounding
    if triton and triton_enabled(t):
        from ..quant import ops

        if gran is Granularity.TENSOR and pair:
            q, qt, si, amax = ops.tensor_pair(t, fmt.value, rounding.value)
            return (
                QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax),
                QuantizedTensor(data=qt, scale_inv=si, block=None, fmt=fmt, amax=amax),
            )
        if gran is Granularity.TILE_1x128 and rounding in (ScaleRounding.FP32, ScaleRounding.POW2):
            q, si = ops.group_rows(t, fmt.value, 128, rounding.value)
            rows = QuantizedTensor(data=q, scale_inv=si, block=(1, 128), fmt=fmt, amax=si)
            if not pair:
                return rows
            qt, sit = ops.group_cols_t(t, fmt.value, 128, rounding.value)
            return rows, QuantizedTensor(data=qt, scale_inv=sit, block=(1, 128), fmt=fmt, amax=sit)
        if gran is Granularity.BLOCK_128x128:
            q, si = ops.blocks128(t, fmt.value, rounding.value)
            q = QuantizedTensor(data=q, scale_inv=si, block=(128, 128), fmt=fmt, amax=si)
            # the pair's second copy (a weight's dgrad operand) is the transposed view, whose
            # contiguous codes the compiler's own transpose writes: faster than the one-pass pair
            # kernel eager mode uses (docs/internals/kernels.md)
            return (q, q.t()) if pair else q
    return quantize_plain(recipe, i, t, pair, triton=False)


def quantize_delayed(
    recipe: Recipe, scales: torch.Tensor, i: int, t: torch.Tensor, pair: bool = False, triton: bool = True
):
    """Stateless delayed scaling of operand ``i`` with its given scale ``scales[i]`` (the
    module's ``fp8_scale``, fixed for the optimizer step under the ``step`` update schedule): the
    quantiser of the compile-traced delayed path. Returns what :func:`quantize_current` returns,
    with ``amax`` this tensor's own amax (``[1, 1]``), which the caller folds into the module's
    pending amax. On CUDA the one-pass Triton cast as a custom operator
    (:func:`~nemo_fp8_recipes.quant.ops.tensor_pair_scaled` / ``tensor_scaled``) unless
    ``triton`` is False, else the reference cast; the same codes as the eager path's
    :meth:`~nemo_fp8_recipes.nn.linear.Float8LinearOperands.quantize` with the same scale."""
    fmt, gran = operand_spec(recipe, i)
    if gran is not Granularity.TENSOR:
        raise ValueError(
            f"delayed scaling is per tensor; operand {OPERANDS[i]} of recipe {recipe.name} is {gran.value}"
        )
    scale = scales[i]
    rounding = recipe.scale_rounding
    if triton and triton_enabled(t) and rounding in (ScaleRounding.FP32, ScaleRounding.POW2):
        from ..quant import ops

        if pair:
            q, qt, si, amax = ops.tensor_pair_scaled(t, scale, fmt.value, rounding.value)
            return (
                QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax),
                QuantizedTensor(data=qt, scale_inv=si, block=None, fmt=fmt, amax=amax),
            )
        q, si, amax = ops.tensor_scaled(t, scale, fmt.value, rounding.value)
        return QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax)
    q = quantize(t, fmt, gran, rounding, dim=-1, scale=scale, triton=False)  # (its amax: this tensor's, [1, 1])
    return (q, q.t()) if pair else q


def quantize_plain(recipe: Recipe, i: int, t: torch.Tensor, pair: bool = False, triton: Optional[bool] = None):
    """Stateless current scaling of operand ``i`` through the dispatch (``quantize_auto`` /
    ``quantize_pair_auto``; ``triton``: None picks the fused kernels where they run)."""
    fmt, gran = operand_spec(recipe, i)
    if pair:
        return quantize_pair_auto(t, fmt, gran, recipe.scale_rounding, triton=triton)
    return quantize(t, fmt, gran, recipe.scale_rounding, dim=-1, triton=triton)


def contiguous_codes(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` with row-major codes (what ``torch._scaled_mm`` wants for its first operand and, as
    the transpose of a row-major tensor, for its second)."""
    return QuantizedTensor(
        data=q.data.contiguous(), scale_inv=q.scale_inv, block=q.block, fmt=q.fmt, amax=q.amax, scale_e8m0=q.scale_e8m0
    )


def quantize_weight(w: torch.Tensor, recipe: Recipe, emulate: bool, quantize_operand):
    """``(W quantised along K as [N, K], W quantised along N as [K, N])`` from ``w`` (detached),
    with ``quantize_operand(i, t, pair=True)`` — the module's (eager) or the stateless one.
    Per tensor the two share the scale; 1xN groups are taken along N for dgrad; 128x128 blocks
    are symmetric, so the second copy is the first transposed (real GEMMs: its codes written by
    the same pass of the Triton kernel in eager mode, by the compiler's transpose when traced;
    emulated: a transposed view, as the emulated GEMM takes any layout)."""
    if emulate and recipe.weight_granularity is Granularity.BLOCK_128x128:
        q = quantize_operand(W, w)
        return q, q.t()
    q, qt = quantize_operand(W, w, pair=True)
    if not emulate:
        q, qt = contiguous_codes(q), contiguous_codes(qt)
    return q, qt


# ---- the three GEMMs, shared by the eager and the compile-traced autograd functions ----------
def check_device(x: torch.Tensor, emulate: bool, fqn: str) -> None:
    if not emulate and x.device.type != "cuda":
        raise RuntimeError(
            f"{fqn or 'Float8Linear'} was converted for real FP8 GEMMs but got an input on "
            f"{x.device}; convert the model on the device it runs on, or use emulate=True"
        )


def fprop(
    ctx,
    x,
    bias,
    weights,
    *,
    recipe: Recipe,
    emulate: bool,
    row_multiple: int,
    out_dtype,
    quantize_operand,
    grad_enabled: bool,
):
    """fprop of ``x`` (any leading dims) with ``weights`` = (W along K, W along N) from
    :func:`quantize_weight`: returns ``(y, tensors to save)`` and records on ``ctx`` what
    :func:`grads` needs. ``grad_enabled``: the caller's grad mode (inside ``forward`` autograd
    is always off, and ``ctx.needs_input_grad`` says True for a trainable weight even under
    ``torch.no_grad``), so evaluation skips the wgrad copy of ``x``."""
    in_shape = x.shape
    x2 = x.reshape(-1, in_shape[-1])
    m = x2.shape[0]
    pad = (-m) % row_multiple if not emulate else 0
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    w_fprop, w_dgrad = weights
    if ctx.needs_input_grad[1] and grad_enabled:  # both copies of X from one read (fprop rows, wgrad columns)
        qx, qx_wgrad = quantize_operand(IN, x2, pair=True)
    else:
        qx, qx_wgrad = quantize_operand(IN, x2), None
    y = scaled_matmul(
        qx,
        w_fprop,
        emulate=emulate,
        out_dtype=out_dtype,
        fast_accum=recipe.fprop.fast_accum,
        bias=bias,
    )[:m]
    # Save only FP8 codes and the scales the GEMMs consume, through save_for_backward so
    # saved-tensor hooks (offloading, activation checkpointing) see them.
    ctx.qx_meta = pack_meta(qx_wgrad)
    ctx.w_meta = pack_meta(w_dgrad)
    ctx.has_bias = bias is not None
    ctx.x_dtype = x.dtype
    ctx.in_shape = in_shape
    ctx.m, ctx.pad = m, pad
    return y.reshape(*in_shape[:-1], y.shape[-1]), (*pack_tensors(qx_wgrad), *pack_tensors(w_dgrad))


def grads(
    ctx,
    dy,
    saved,
    *,
    recipe: Recipe,
    emulate: bool,
    w_dtype,
    quantize_operand,
    need_dx: Optional[bool] = None,
    accumulate_into: Optional[torch.Tensor] = None,
):
    """dgrad and wgrad (each only if needed) and the bias gradient from ``dy`` and the tensors
    :func:`fprop` saved: returns ``(dx, dw, db)``, None for a gradient not needed (``need_dx``:
    whether dgrad runs; default: whether the input needs a gradient). ``accumulate_into``: an
    FP32 gradient the wgrad is added into in place (:func:`accumulate_wgrad`), which is then
    returned as ``dw``."""
    if need_dx is None:
        need_dx = ctx.needs_input_grad[0]
    dy2 = dy.reshape(-1, dy.shape[-1])
    if ctx.pad:
        dy2 = torch.cat([dy2, dy2.new_zeros(ctx.pad, dy2.shape[1])])
    dx = dw = db = None
    n_qx = 0 if ctx.qx_meta is None else len(saved) - 3
    saved_qx = unpack(ctx.qx_meta, saved[:n_qx])
    saved_w = unpack(ctx.w_meta, saved[n_qx:])
    need_w = ctx.needs_input_grad[1] and saved_qx is not None
    if need_w:
        qdy, qdy_wgrad = quantize_operand(GO, dy2, pair=True)
    else:
        qdy, qdy_wgrad = quantize_operand(GO, dy2), None
    if need_dx:
        dx = scaled_matmul(
            qdy,
            saved_w,
            emulate=emulate,
            out_dtype=ctx.x_dtype,
            fast_accum=recipe.dgrad.fast_accum,
        )[: ctx.m]
        dx = dx.reshape(ctx.in_shape)
    if need_w and accumulate_into is not None:
        dw = accumulate_wgrad(qdy_wgrad, saved_qx, accumulate_into, emulate=emulate, fast_accum=recipe.wgrad.fast_accum)
    elif need_w:
        dw = scaled_matmul(
            qdy_wgrad,
            saved_qx,
            emulate=emulate,
            out_dtype=torch.float32,
            fast_accum=recipe.wgrad.fast_accum,
        ).to(w_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy2[: ctx.m].float().sum(0)
    return dx, dw, db


def accumulate_wgrad(
    qdy: QuantizedTensor, qx: QuantizedTensor, grad: torch.Tensor, *, emulate: bool, fast_accum: bool
) -> torch.Tensor:
    """``grad += dYᵀ · X`` in FP32, in place. Real per-tensor and blockwise GEMMs add in the GEMM
    itself (cuBLASLt with ``beta = 1``: :func:`~nemo_fp8_recipes.quant.cublaslt.fp8_matmul_accumulate`),
    so the weight-sized FP32 product is never written; emulation and real MXFP8 (whose E8M0 GEMM
    has no accumulating form here) compute the product and add it."""
    per_tensor = qdy.block is None and qx.block is None
    blocks = qdy.block == (1, 128) and qx.block == (1, 128)
    if not emulate and (per_tensor or blocks):
        from ..quant.cublaslt import fp8_matmul_accumulate
        from ..quant.scaled_mm import outer_major, scalar_scale

        def scale(q):  # each scale as the non-accumulating GEMM dispatch passes it
            return scalar_scale(q.scale_inv) if per_tensor else outer_major(q.scale_inv.float())

        return fp8_matmul_accumulate(
            qdy.data, scale(qdy), qx.data, scale(qx), grad, block=blocks, fast_accum=fast_accum and per_tensor
        )
    return grad.add_(scaled_matmul(qdy, qx, emulate=emulate, out_dtype=torch.float32, fast_accum=fast_accum))
