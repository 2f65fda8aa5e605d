"""The native FP8 linear: fprop, dgrad and wgrad each in FP8, per recipe.

For ``Y = X · Wᵀ`` the three GEMMs of a linear layer contract over different dims, so each
quantises its operands along its own contraction dim (the numerics contract, docs/recipes.md):

=========  ==============  =========================  ===============================
GEMM       formula         contraction dim            operands quantised along it
=========  ==============  =========================  ===============================
fprop      X · Wᵀ          K (in_features)            X rows, W rows
dgrad      dY · W          N (out_features)           dY rows, W columns
wgrad      dYᵀ · X         M (tokens)                 dY columns, X columns
=========  ==============  =========================  ===============================

Per-tensor recipes use one set of codes for both orientations (a transpose). Blockwise keeps the
128x128 weight blocks (symmetric) and re-quantises X and dY in 128x1 tiles for wgrad; MXFP8
quantises every operand twice. Only the wgrad copy of X is saved for backward, in FP8.

The FP8 weight copies are cached and re-quantised only when the weight changed (its version
counter moved, i.e. once per optimizer step, not per micro-batch) — and, under delayed scaling,
when its scale moved (the copy follows the amax history even for a frozen weight). Under ``torch.compile`` the
traced linear quantises its weight in the graph unless its compiled weight cache is on
(:meth:`Float8Linear.set_graph_weight_cache`: buffers re-quantised after each optimizer step).
Delayed scaling keeps an amax history per operand in buffers, so it is part of ``state_dict``; its scale for step t is
computed from the history through step t-1, the amax of step t is appended after use, and an
optional hook max-reduces pending amaxes across data-parallel ranks before each update. The
update schedule (per use, or once per optimizer step with one collective for the whole model)
lives in :mod:`nemo_fp8_recipes.nn.scaling`.

Two autograd functions share the GEMM code (:func:`_fprop`, :func:`_grads`): the eager one
(:class:`_Float8LinearFn`: fused Triton quantisers on CUDA, weight cache, delayed scaling,
telemetry) and, under ``torch.compile``, a traceable one for the current-scaling recipes
(:class:`_Float8LinearTracedFn`: on CUDA the same Triton quantisers as custom operators, else the
reference quantisers, which the compiler fuses into its own kernels; no Python-side state), so a
compiled model has no graph break at its FP8 linears.
:meth:`Float8Linear.forward` says which path runs when.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..quant.gemm import scaled_matmul
from ..quant.dispatch import quantize_auto as quantize
from ..quant.dispatch import accumulate_amax, quantize_pair_auto, triton_enabled
from ..quant.reference import QuantizedTensor, STAT_NAMES, quantization_stats
from ..recipes import Format, Granularity, Recipe, ScaleRounding
from ..quant.delayed import advance_delayed_scaling
from ..options import KernelOptions, default_kernel_options

__all__ = ["Float8Linear", "OPERANDS", "fp8_modules", "input_prequantization", "share_input_quantization"]

OPERANDS = ("input", "weight", "grad_output")
_IN, _W, _GO = 0, 1, 2

# Every optimizer step, of any optimizer, bumps this generation; the FP8 weight cache is keyed on
# it as well as on the weight's version counter, because fused and foreach optimizers (e.g.
# ``AdamW(fused=True)``) update parameters without bumping ``Tensor._version``. Between steps
# (gradient-accumulation micro-batches) the cached FP8 weight is reused.
_OPTIMIZER_GENERATION = [0]


# FP8 linears whose compiled (traced) forward reads an FP8 weight cached in buffers
# (:meth:`Float8Linear.set_graph_weight_cache`); an optimizer step re-quantises those of its params.
_GRAPH_CACHED: "weakref.WeakSet[Float8Linear]" = weakref.WeakSet()


def _bump_generation(optimizer, args, kwargs) -> None:
    _OPTIMIZER_GENERATION[0] += 1
    if len(_GRAPH_CACHED):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for m in list(_GRAPH_CACHED):
            if id(m.weight) in stepped:
                m.refresh_graph_weight_cache()


_HOOK = []  # the optimizer hook's handle, once installed


def _install_optimizer_hook() -> None:
    """Register :func:`_bump_generation` as a global optimizer step hook, once, when the first
    FP8 linear is built (importing the package installs nothing)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_bump_generation))


def _out_dtype_for(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _meta(q: Optional[QuantizedTensor]):
    if q is None:
        return None
    return (q.block, q.fmt, q.scale_e8m0 is not None)


def _tensors(q: Optional[QuantizedTensor]):
    if q is None:
        return ()
    return (q.data, q.scale_inv, q.scale_e8m0 if q.scale_e8m0 is not None else q.scale_inv)


def _rebuild(meta, tensors) -> Optional[QuantizedTensor]:
    if meta is None:
        return None
    block, fmt, has_e8m0 = meta
    data, scale_inv, e8m0 = tensors
    return QuantizedTensor(data=data, scale_inv=scale_inv, block=block, fmt=fmt,
                           amax=scale_inv, scale_e8m0=e8m0 if has_e8m0 else None)


def _operand_spec(recipe: Recipe, i: int):
    """(format, granularity) of operand ``i`` (input, weight, grad_output) under ``recipe``."""
    fmt = (recipe.input_format, recipe.weight_format, recipe.grad_format)[i]
    gran = (recipe.input_granularity, recipe.weight_granularity, recipe.grad_granularity)[i]
    return fmt, gran


def _quantize_current(recipe: Recipe, i: int, t: torch.Tensor, pair: bool = False, triton: bool = True):
    """Stateless current scaling of operand ``i``: the quantiser of the compile-traced path.
    On CUDA the fused Triton kernels run as custom operators (:mod:`nemo_fp8_recipes.quant.ops`:
    per-tensor pairs, 1x128 groups along rows and down columns, 128x128 weight blocks) unless
    ``triton`` is False (the module's ``KernelOptions.triton``); everything else (and E8M0
    scales) uses the reference quantisers (plain torch ops, which the compiler fuses into its own
    kernels). Same codes either way, and on CPU the same calls as
    :meth:`Float8Linear._quantize_operand` of a current-scaling recipe in eager mode."""
    fmt, gran = _operand_spec(recipe, i)
    rounding = recipe.scale_rounding
    if triton and triton_enabled(t):
        from ..quant import ops

        if gran is Granularity.TENSOR and pair:
            q, qt, si, amax = ops.tensor_pair(t, fmt.value, rounding.value)
            return (QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax),
                    QuantizedTensor(data=qt, scale_inv=si, block=None, fmt=fmt, amax=amax))
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
            # contiguous codes the compiler's own transpose writes: on the H200 that is faster
            # than the one-pass pair kernel eager mode uses (0.19 vs 0.28 ms at 8192x14336 BF16)
            return (q, q.t()) if pair else q
    return _quantize_plain(recipe, i, t, pair, triton=False)


def _quantize_plain(recipe: Recipe, i: int, t: torch.Tensor, pair: bool = False, triton: Optional[bool] = None):
    """Stateless current scaling of operand ``i`` through the dispatch (``quantize_auto`` /
    ``quantize_pair_auto``; ``triton``: None picks the fused kernels where they run)."""
    fmt, gran = _operand_spec(recipe, i)
    if pair:
        return quantize_pair_auto(t, fmt, gran, recipe.scale_rounding, triton=triton)
    return quantize(t, fmt, gran, recipe.scale_rounding, dim=-1, triton=triton)


def _contiguous_codes(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` with row-major codes (what ``torch._scaled_mm`` wants for its first operand and, as
    the transpose of a row-major tensor, for its second)."""
    return QuantizedTensor(data=q.data.contiguous(), scale_inv=q.scale_inv, block=q.block,
                           fmt=q.fmt, amax=q.amax, scale_e8m0=q.scale_e8m0)


def _quantize_weight(w: torch.Tensor, recipe: Recipe, emulate: bool, quantize_operand):
    """``(W quantised along K as [N, K], W quantised along N as [K, N])`` from ``w`` (detached),
    with ``quantize_operand(i, t, pair=True)`` — the module's (eager) or the stateless one.
    Per tensor the two share the scale; 1xN groups are taken along N for dgrad; 128x128 blocks
    are symmetric, so the second copy is the first transposed (real GEMMs: its codes written by
    the same pass of the Triton kernel in eager mode, by the compiler's transpose when traced;
    emulated: a transposed view, as the emulated GEMM takes any layout)."""
    if emulate and recipe.weight_granularity is Granularity.BLOCK_128x128:
        q = quantize_operand(_W, w)
        return q, q.t()
    q, qt = quantize_operand(_W, w, pair=True)
    if not emulate:
        q, qt = _contiguous_codes(q), _contiguous_codes(qt)
    return q, qt


# ---- one quantisation of an input shared by the eager FP8 linears that read it ---------------
class _SharedInput(threading.local):
    """The last stateless input quantisation of the eager FP8 linears, for the next linear that
    reads the same tensor: a transformer's q/k/v projections all take the attention norm's
    output, its gate and up projections the MLP norm's, so with current scaling (tensorwise,
    blockwise, mxfp8) they would quantise the same values to the same codes three and two times,
    and save the wgrad copy for backward as often.

    One entry per thread: the input tensor (weakly referenced: freeing it drops the entry and
    its codes), its version counter (an in-place change invalidates it), the CUDA stream it was
    quantised on, and the results per quantisation spec — replaced as a whole, never mutated in
    place. Only autograd intermediates are shared (:func:`_input_quantizer`): a leaf — a
    parameter, a buffer, a static input — can be changed without its version counter moving
    (fused optimizers, ``.data``, NumPy or DLPack views, CUDA-graph replays), an intermediate is
    made anew by every forward. The compile-traced path (current scaling without telemetry)
    does not come here, the compiler de-duplicates those calls itself."""

    entry = None  # (weakref to x, x._version, stream, {spec: (q, qt or None)})

    def _drop(self, ref) -> None:
        if self.entry is not None and self.entry[0] is ref:
            self.entry = None

    def get(self, x: torch.Tensor, stream, spec: tuple, pair: bool):
        e = self.entry
        if e is None or e[0]() is not x or e[1] != x._version or e[2] != stream:
            return None
        got = e[3].get(spec)
        if got is None or (pair and got[1] is None):
            return None
        return got if pair else (got[0], None)

    def put(self, x: torch.Tensor, stream, spec: tuple, result: tuple) -> None:
        e = self.entry
        if e is None or e[0]() is not x or e[1] != x._version or e[2] != stream:
            self.entry = (weakref.ref(x, self._drop), x._version, stream, {spec: result})
        else:
            self.entry = (*e[:3], {**e[3], spec: result})


_SHARED_INPUT = _SharedInput()


def _shareable(mod: "Float8Linear", x: torch.Tensor) -> bool:
    """:func:`_input_quantizer`'s conditions on the module and the moment (not on ``x``'s
    ``grad_fn``, which a producer checks once it has made ``x``)."""
    return not (mod.recipe.is_delayed or mod.telemetry_enabled
                or (x.is_cuda and torch.cuda.is_current_stream_capturing())
                or not mod.kernel_options.shared_input)


def _share_key(mod: "Float8Linear", x: torch.Tensor):
    """(quantisation spec, CUDA stream) under which ``mod``'s input quantisation of ``x`` is shared."""
    r = mod.recipe
    spec = (type(mod), *_operand_spec(r, _IN), r.scale_rounding, mod.emulate, mod._row_multiple)
    return spec, (torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None)


def input_prequantization(mod, x: torch.Tensor) -> Optional[Tuple[Format, Granularity, ScaleRounding]]:
    """What the producer of ``mod``'s coming input ``x`` — the fused RMSNorm
    (:func:`nemo_fp8_recipes.nn.norm.rms_norm`) — may quantise for it in its own pass and hand over
    with :func:`share_input_quantization`: ``(format, granularity, rounding)`` of ``mod``'s input
    when that is per tensor or 1x32 / 1x128 along rows and ``mod`` shares its input quantisation
    (:func:`_input_quantizer`: an eager FP8 linear with current scaling and telemetry off, no CUDA
    graph being captured, ``KernelOptions.shared_input`` on) with a trainable weight (the pair
    includes the wgrad copy) and takes ``x``'s rows unpadded; else None. ``x``: the producer's input (same rows, device)."""
    if (not isinstance(mod, Float8Linear) or torch.compiler.is_compiling() or not _shareable(mod, x)
            or not mod.weight.requires_grad):  # a frozen weight takes no wgrad copy of x
        return None
    fmt, gran = _operand_spec(mod.recipe, _IN)
    if gran is not Granularity.TENSOR and gran.block not in ((1, 32), (1, 128)):
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if not mod.emulate and rows % mod._row_multiple:
        return None
    return fmt, gran, mod.recipe.scale_rounding


def share_input_quantization(mod, x: torch.Tensor, q: QuantizedTensor, q_wgrad: QuantizedTensor) -> bool:
    """Hand ``mod`` (and the other FP8 linears that read ``x`` with the same spec) the pair its
    input quantisation of ``x`` would give — ``(x`` quantised along its last dim, the wgrad copy
    ``[K, rows]``) for :func:`input_prequantization`'s spec, bit-identical to what ``mod`` would
    compute (the caller's contract). Only for an autograd intermediate ``x`` (returns False and
    keeps nothing otherwise)."""
    if x.grad_fn is None or input_prequantization(mod, x) is None:
        return False
    spec, stream = _share_key(mod, x)
    _SHARED_INPUT.put(x, stream, spec, (q, q_wgrad))
    return True


def _input_quantizer(mod: "Float8Linear", x: torch.Tensor):
    """``mod._quantize_operand``, sharing the input's quantisation with the other eager FP8
    linears that read the same ``x`` (:class:`_SharedInput`) where that is safe and gives the
    same codes: current scaling (delayed scaling's scale is per module), telemetry off (it
    records statistics per module), ``x`` an autograd intermediate (it has a ``grad_fn``; so
    never under ``torch.no_grad``), not while a CUDA graph is captured (the graph must contain
    its own quantisation). ``KernelOptions(shared_input=False)`` turns the sharing off (A/B runs)."""
    if x.grad_fn is None or not _shareable(mod, x):
        return mod._quantize_operand
    spec, stream = _share_key(mod, x)

    def quantize_operand(i: int, t: torch.Tensor, pair: bool = False):
        if i != _IN:
            return mod._quantize_operand(i, t, pair=pair)
        got = _SHARED_INPUT.get(x, stream, spec, pair)
        if got is None:
            got = mod._quantize_operand(i, t, pair=True) if pair else (mod._quantize_operand(i, t), None)
            _SHARED_INPUT.put(x, stream, spec, got)
        return got if pair else got[0]

    return quantize_operand


# ---- the three GEMMs, shared by the eager and the compile-traced autograd functions ----------
def _check_device(x: torch.Tensor, emulate: bool, fqn: str) -> None:
    if not emulate and x.device.type != "cuda":
        raise RuntimeError(
            f"{fqn or 'Float8Linear'} was converted for real FP8 GEMMs but got an input on "
            f"{x.device}; convert the model on the device it runs on, or use emulate=True"
        )


def _fprop(ctx, x, bias, weights, *, recipe: Recipe, emulate: bool, row_multiple: int, out_dtype,
           quantize_operand, grad_enabled: bool):
    """fprop of ``x`` (any leading dims) with ``weights`` = (W along K, W along N) from
    :func:`_quantize_weight`: returns ``(y, tensors to save)`` and records on ``ctx`` what
    :func:`_grads` needs. ``grad_enabled``: the caller's grad mode (inside ``forward`` autograd
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
        qx, qx_wgrad = quantize_operand(_IN, x2, pair=True)
    else:
        qx, qx_wgrad = quantize_operand(_IN, x2), None
    y = scaled_matmul(
        qx, w_fprop, emulate=emulate, out_dtype=out_dtype, fast_accum=recipe.fprop.fast_accum,
        bias=bias,
    )[:m]
    # Save only FP8 codes and the scales the GEMMs consume, through save_for_backward so
    # saved-tensor hooks (offloading, activation checkpointing) see them.
    ctx.qx_meta = _meta(qx_wgrad)
    ctx.w_meta = _meta(w_dgrad)
    ctx.has_bias = bias is not None
    ctx.x_dtype = x.dtype
    ctx.in_shape = in_shape
    ctx.m, ctx.pad = m, pad
    return y.reshape(*in_shape[:-1], y.shape[-1]), (*_tensors(qx_wgrad), *_tensors(w_dgrad))


def _grads(ctx, dy, saved, *, recipe: Recipe, emulate: bool, w_dtype, quantize_operand,
           need_dx: Optional[bool] = None, accumulate_into: Optional[torch.Tensor] = None):
    """dgrad and wgrad (each only if needed) and the bias gradient from ``dy`` and the tensors
    :func:`_fprop` saved: returns ``(dx, dw, db)``, None for a gradient not needed (``need_dx``:
    whether dgrad runs; default: whether the input needs a gradient). ``accumulate_into``: an
    FP32 gradient the wgrad is added into in place (:func:`_accumulate_wgrad`), which is then
    returned as ``dw``."""
    if need_dx is None:
        need_dx = ctx.needs_input_grad[0]
    dy2 = dy.reshape(-1, dy.shape[-1])
    if ctx.pad:
        dy2 = torch.cat([dy2, dy2.new_zeros(ctx.pad, dy2.shape[1])])
    dx = dw = db = None
    n_qx = 0 if ctx.qx_meta is None else len(saved) - 3
    saved_qx = _rebuild(ctx.qx_meta, saved[:n_qx])
    saved_w = _rebuild(ctx.w_meta, saved[n_qx:])
    need_w = ctx.needs_input_grad[1] and saved_qx is not None
    if need_w:
        qdy, qdy_wgrad = quantize_operand(_GO, dy2, pair=True)
    else:
        qdy, qdy_wgrad = quantize_operand(_GO, dy2), None
    if need_dx:
        dx = scaled_matmul(
            qdy, saved_w, emulate=emulate, out_dtype=ctx.x_dtype,
            fast_accum=recipe.dgrad.fast_accum,
        )[: ctx.m]
        dx = dx.reshape(ctx.in_shape)
    if need_w and accumulate_into is not None:
        dw = _accumulate_wgrad(qdy_wgrad, saved_qx, accumulate_into, emulate=emulate,
                               fast_accum=recipe.wgrad.fast_accum)
    elif need_w:
        dw = scaled_matmul(
            qdy_wgrad, saved_qx, emulate=emulate, out_dtype=torch.float32,
            fast_accum=recipe.wgrad.fast_accum,
        ).to(w_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy2[: ctx.m].float().sum(0)
    return dx, dw, db


def _accumulate_wgrad(qdy: QuantizedTensor, qx: QuantizedTensor, grad: torch.Tensor, *, emulate: bool,
                      fast_accum: bool) -> torch.Tensor:
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

        return fp8_matmul_accumulate(qdy.data, scale(qdy), qx.data, scale(qx), grad, block=blocks,
                                     fast_accum=fast_accum and per_tensor)
    return grad.add_(scaled_matmul(qdy, qx, emulate=emulate, out_dtype=torch.float32, fast_accum=fast_accum))


def _wgrad_target(mod: "Float8Linear", ctx) -> Optional[torch.Tensor]:
    """The gradient a fused wgrad accumulates into (:attr:`Float8Linear.fuse_wgrad_accumulation`):
    ``weight.grad`` when it exists and this backward (a ``.backward()``, not ``autograd.grad`` or
    a ``backward(inputs=...)`` that leaves the weight out; no ``create_graph``) is going to
    accumulate into it; else None (the wgrad is returned to autograd as usual)."""
    w = mod.weight
    g = w.grad
    if g is None or not ctx.needs_input_grad[1] or torch.is_grad_enabled():
        return None
    node = mod._grad_accumulator()
    try:
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad(): gradients are returned, not accumulated
        return None
    check_wgrad_fusion(mod)
    if (g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous() or g.device != w.device
            or g.data_ptr() % 16):
        raise RuntimeError(
            f"{mod.fqn or 'Float8Linear'}: fuse_wgrad_accumulation accumulates into a contiguous, 16-byte aligned "
            f"float32 weight.grad of shape {tuple(w.shape)} on {w.device}; got {g.dtype} {tuple(g.shape)} on "
            f"{g.device}{'' if g.is_contiguous() else ' (not contiguous)'}"
            f"{' at a misaligned address' if g.data_ptr() % 16 else ''} — keep FP32 master weights and their own "
            "gradient tensors, or turn it off (set_wgrad_accumulation_fusion(model, False))")
    return g


def check_wgrad_fusion(mod: "Float8Linear") -> None:
    """Refuse fused wgrad accumulation where it would change results: weights that are not FP32
    (gradients must accumulate in FP32) and gradient hooks on the weight, which run in — or
    receive what goes to — AccumulateGrad, which the fused GEMM bypasses."""
    w, name = mod.weight, mod.fqn or "Float8Linear"
    if w.dtype != torch.float32:
        raise RuntimeError(f"{name}: fuse_wgrad_accumulation accumulates FP32 gradients, and this weight is "
                           f"{w.dtype}; keep FP32 master weights, or turn it off (set_wgrad_accumulation_fusion"
                           "(model, False))")
    hooks = [kind for kind, attr in (("register_hook", "_backward_hooks"),
                                     ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"))
             if getattr(w, attr, None)]
    if hooks:
        raise RuntimeError(f"{name}: fuse_wgrad_accumulation adds the weight gradient inside the GEMM, so the "
                           f"weight's {' and '.join(hooks)} hooks would never see it; turn it off for this module "
                           "(set_wgrad_accumulation_fusion(module, False))")


class _Float8LinearFn(torch.autograd.Function):
    """Eager path: the module's quantisers (fused Triton kernels on CUDA), FP8 weight cache,
    delayed-scaling state, telemetry and Python GEMM counters."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod: "Float8Linear", out_dtype: torch.dtype, grad_enabled: bool):
        _check_device(x, mod.emulate, mod.fqn)
        return _module_fprop(ctx, x, weight, bias, mod, out_dtype, _input_quantizer(mod, x), grad_enabled)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _module_grads(ctx, dy, ctx.saved_tensors)
        return dx, dw, db, None, None, None


def _module_fprop(ctx, x, weight, bias, mod: "Float8Linear", out_dtype, quantize_operand, grad_enabled: bool,
                  keep=()):
    """The eager autograd functions' forward: :func:`_fprop` with the module's cached FP8 weight
    and ``quantize_operand``, the fprop count, and the saved tensors (plus ``keep``, appended)."""
    y, to_save = _fprop(
        ctx, x, bias, mod._quantized_weight(), recipe=mod.recipe, emulate=mod.emulate,
        row_multiple=mod._row_multiple, out_dtype=out_dtype, quantize_operand=quantize_operand,
        grad_enabled=grad_enabled,
    )
    mod._count("fprop")
    ctx.save_for_backward(*to_save, *keep)
    ctx.mod = mod
    ctx.w_dtype = weight.dtype
    return y


def _module_grads(ctx, dy, saved, need_dx: Optional[bool] = None):
    """The eager autograd functions' dgrad/wgrad (:func:`_grads` with the module's quantisers),
    counted."""
    mod: Float8Linear = ctx.mod
    into = _wgrad_target(mod, ctx) if mod.fuse_wgrad_accumulation else None
    dx, dw, db = _grads(ctx, dy, saved, recipe=mod.recipe, emulate=mod.emulate, w_dtype=ctx.w_dtype,
                        quantize_operand=mod._quantize_operand, need_dx=need_dx, accumulate_into=into)
    if dx is not None:
        mod._count("dgrad")
    if dw is not None:
        mod._count("wgrad")
        if dw is into:  # already in weight.grad: autograd gets no gradient to add
            dw = None
    return dx, dw, db


class _Float8SwiGLULinearFn(torch.autograd.Function):
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
    def forward(ctx, u, weight, bias, g, mod: "Float8Linear", out_dtype: torch.dtype, grad_enabled: bool):
        g2 = g.reshape(-1, g.shape[-1])

        def quantize_operand(i, t, pair=False):
            return mod._quantize_operand(i, t, pair=pair, gate=g2 if i == _IN else None)

        return _module_fprop(ctx, u, weight, bias, mod, out_dtype, quantize_operand, grad_enabled, keep=(g, u))

    @staticmethod
    def backward(ctx, dy):
        from ..quant.triton_kernels import swiglu_backward

        *saved, g, u = ctx.saved_tensors
        dact, dw, db = _module_grads(ctx, dy, saved, need_dx=ctx.needs_input_grad[0] or ctx.needs_input_grad[3])
        dg = du = None
        if dact is not None:
            dg, du = swiglu_backward(dact.contiguous(), g, u)
        return du, dw, db, dg, None, None, None


class _Float8LinearTracedFn(torch.autograd.Function):
    """Compile-traceable path (current scaling only): no Python-side state. The quantisers of
    :func:`_quantize_current` (Triton custom operators on CUDA, else the reference quantisers in
    plain torch ops) and the GEMM dispatch of :mod:`nemo_fp8_recipes.quant.gemm`,
    the weight quantised in every forward — or, given ``wmeta`` and the six ``wcache`` tensors
    (the module's compiled weight cache, :meth:`Float8Linear.set_graph_weight_cache`), read from
    them — and the dgrad/wgrad counts added in-graph to ``bwd_counts`` (an int64 buffer of the
    module, only ever mutated in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, bwd_counts, recipe: Recipe, emulate: bool,
                row_multiple: int, out_dtype: torch.dtype, fqn: str, grad_enabled: bool, triton: bool, wmeta,
                *wcache):
        _check_device(x, emulate, fqn)
        quantize_operand = functools.partial(_quantize_current, recipe, triton=triton)
        if wmeta is None:  # quantised here, in the graph
            weights = _quantize_weight(weight.detach(), recipe, emulate, quantize_operand)
        else:  # the module's cached FP8 weight (buffers re-quantised after each optimizer step)
            weights = (_rebuild(wmeta[0], wcache[:3]), _rebuild(wmeta[1], wcache[3:]))
        y, to_save = _fprop(
            ctx, x, bias, weights, recipe=recipe, emulate=emulate, row_multiple=row_multiple,
            out_dtype=out_dtype, quantize_operand=quantize_operand, grad_enabled=grad_enabled,
        )
        ctx.save_for_backward(*to_save, bwd_counts)
        ctx.recipe, ctx.emulate, ctx.triton = recipe, emulate, triton
        ctx.w_dtype = weight.dtype
        ctx.n_wcache = len(wcache)
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, bwd_counts = ctx.saved_tensors
        dx, dw, db = _grads(ctx, dy, saved, recipe=ctx.recipe, emulate=ctx.emulate,
                            w_dtype=ctx.w_dtype,
                            quantize_operand=functools.partial(_quantize_current, ctx.recipe, triton=ctx.triton))
        if dx is not None:
            bwd_counts[0].add_(1)
        if dw is not None:
            bwd_counts[1].add_(1)
        return (dx, dw, db, None, None, None, None, None, None, None, None, None) + (None,) * ctx.n_wcache


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in FP8 per ``recipe``.

    Build it with :meth:`from_linear` (keeps the same ``Parameter`` objects) or through
    :func:`nemo_fp8_recipes.nn.convert_model`. ``emulate=True`` runs exact emulation
    (quantise -> dequantise -> FP32 matmul); ``False`` runs ``torch._scaled_mm`` /
    ``torch.nn.functional.scaled_mm`` on the tensor cores. ``options``: the kernels it runs
    (:class:`~nemo_fp8_recipes.options.KernelOptions`; default
    :func:`~nemo_fp8_recipes.options.default_kernel_options`), attribute ``kernel_options``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Recipe,
        emulate: bool,
        options: Optional[KernelOptions] = None,
        device=None,
        dtype=None,
    ) -> None:
        self.recipe = None
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(recipe, emulate, options)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, emulate: bool,
                    options: Optional[KernelOptions] = None) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s weight and bias Parameter objects."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._setup_fp8(recipe, emulate, options)
        new.to(linear.weight.device)
        return new

    # ---- set-up ------------------------------------------------------------------------------
    def _setup_fp8(self, recipe: Recipe, emulate: bool, options: Optional[KernelOptions] = None) -> None:
        if not recipe.is_fp8:
            raise ValueError("Float8Linear needs an FP8 recipe, got bf16")
        if options is not None and not isinstance(options, KernelOptions):
            raise TypeError(f"options must be a KernelOptions, got {type(options).__name__}")
        self.recipe = recipe
        self.emulate = bool(emulate)
        self.kernel_options = options if options is not None else default_kernel_options()
        _install_optimizer_hook()
        self._row_multiple = recipe.gemm_alignment
        self.fqn = ""
        self.role = "linear"
        self.amax_reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.scaling_update = "lazy"  # or "step": see nemo_fp8_recipes.nn.scaling
        self._gemm_counts_eager: Dict[str, int] = {"fprop": 0, "dgrad": 0, "wgrad": 0}
        self.telemetry_enabled = False
        self._telemetry: Dict[int, list] = {}
        self._wcache_key = None
        self._wcache = None
        # delayed scaling: bumped whenever the scales advance (step schedule), so the cached FP8
        # weight is re-quantised with its new scale even when the weight itself did not change
        self._scale_generation = 0
        self._graph_wcache_on = False  # set_graph_weight_cache
        self._graph_wcache_meta = None
        self._graph_wcache_version = None
        dev = self.weight.device
        # GEMM counters of the compile-traced path, added to in-graph (in-place adds that the
        # compiler keeps in its graphs); fprop is counted in forward, dgrad/wgrad in backward, in
        # two buffers so that none is mutated in both. Not in state_dict.
        self.register_buffer("fp8_fwd_count", torch.zeros(1, dtype=torch.int64, device=dev),
                             persistent=False)
        self.register_buffer("fp8_bwd_count", torch.zeros(2, dtype=torch.int64, device=dev),
                             persistent=False)
        if recipe.is_delayed:
            L = recipe.amax_history_len
            self.register_buffer("fp8_amax_history", torch.zeros(3, L, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            self.register_buffer("fp8_amax_pending", torch.zeros(3, device=dev))
            # 1.0 where an operand has an amax waiting to be appended (mirrored in _pending so
            # the hot path never reads the device)
            self.register_buffer("fp8_pending", torch.zeros(3, device=dev))
        self._pending = [False, False, False]
        self.fuse_wgrad_accumulation = False

    def __setstate__(self, state) -> None:  # copy.deepcopy, pickle: the copy's cache is refreshed too
        super().__setstate__(state)
        _install_optimizer_hook()  # (an unpickled module may be this process's first)
        if "kernel_options" not in self.__dict__:  # (a module pickled before it had options)
            self.kernel_options = default_kernel_options()
        if getattr(self, "_graph_wcache_on", False):
            _GRAPH_CACHED.add(self)

    def extra_repr(self) -> str:
        mode = "emulated" if self.emulate else "real"
        fused = ", fuse_wgrad_accumulation" if self.fuse_wgrad_accumulation else ""
        if self.kernel_options != KernelOptions():
            fused += f", {self.kernel_options.describe()}"
        return f"{super().extra_repr()}, recipe={self.recipe.name}, {mode}{fused}"

    def _grad_accumulator(self):
        """The weight's AccumulateGrad node, looked up each time: it changes when the weight's
        data is replaced with another dtype or device (``module.to(...)``)."""
        with torch.enable_grad():  # (called from backward, where grad mode is off)
            return self.weight.view_as(self.weight).grad_fn.next_functions[0][0]

    # ---- delayed scaling ---------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._wcache_key = self._wcache = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.recipe.is_delayed and prefix + "fp8_pending" in state_dict:
            self._pending = [bool(v) for v in state_dict[prefix + "fp8_pending"].tolist()]
        if self.recipe.is_delayed:
            with torch.no_grad():  # amaxes are >= 0; the kernels max-accumulate their IEEE bits
                self.fp8_amax_pending.abs_()
        if self._graph_wcache_on:
            self.refresh_graph_weight_cache()

    def _apply(self, fn, *args, **kwargs):
        # .to()/.half()/.bfloat16() must not cast the FP32 scaling state
        out = super()._apply(fn, *args, **kwargs)
        for name in ("fp8_amax_history", "fp8_scale", "fp8_amax_pending", "fp8_pending"):
            b = getattr(self, name, None)
            if b is not None and b.dtype != torch.float32:
                setattr(self, name, b.float())
        self._wcache_key = self._wcache = None
        if getattr(self, "_graph_wcache_on", False):  # the weight moved or changed dtype
            self.refresh_graph_weight_cache()
        return out

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_fp8_state()

    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Forget amax histories and scales (scale 1, as at construction) and the FP8 weight."""
        if getattr(self, "recipe", None) is not None and self.recipe.is_delayed:
            self.fp8_amax_history.zero_()
            self.fp8_scale.fill_(1.0)
            self.fp8_amax_pending.zero_()
            self.fp8_pending.zero_()
        self._pending = [False, False, False]
        self._wcache_key = self._wcache = None
        if getattr(self, "_graph_wcache_on", False):
            self.refresh_graph_weight_cache()

    def invalidate_weight_cache(self) -> None:
        """Force re-quantisation of the FP8 weight: the eager path's cache at the next forward,
        the compiled path's (:meth:`set_graph_weight_cache`) now. Needed only when the weight is
        written outside an optimizer step and ``load_state_dict``: through ``.data`` (which does
        not bump its version counter) in eager mode, by any in-place write when the compiled
        forward reads the cache."""
        self._wcache_key = self._wcache = None
        if self._graph_wcache_on:
            self.refresh_graph_weight_cache()

    # ---- the compiled path's FP8 weight cache ----------------------------------------------------
    _GRAPH_WCACHE = ("_fp8_wcache_fprop_data", "_fp8_wcache_fprop_scale", "_fp8_wcache_fprop_e8m0",
                     "_fp8_wcache_dgrad_data", "_fp8_wcache_dgrad_scale", "_fp8_wcache_dgrad_e8m0")

    def set_graph_weight_cache(self, enabled: bool = True) -> None:
        """Let the compiled (traced) forward read the FP8 weight from buffers of this module
        instead of quantising it in the graph — Transformer Engine's FP8 weight caching across
        micro-batches, for ``torch.compile``. The buffers are (re-)quantised eagerly: now, after
        every optimizer step that updates this weight (a global optimizer hook, any optimizer),
        after ``load_state_dict``, ``.to()`` and :meth:`reset_fp8_state`, and by
        :meth:`invalidate_weight_cache`. So with K micro-batches per step the weight is
        quantised once per step, not K times. The cost: the two FP8 copies (1 byte per parameter
        each) stay allocated between steps, as the eager path's cache does.

        The contract: the weight changes only through those. An in-place write outside them
        (``with torch.no_grad(): w.mul_(…)``, ``.data`` copies) leaves the compiled forward
        reading the old codes until :meth:`invalidate_weight_cache`;
        :func:`~nemo_fp8_recipes.nn.audit` reports a cache older than its weight's version
        counter. Only for the traced path (:meth:`traceable` — current scaling; delayed scaling's
        eager island caches its weight anyway) and plain tensors: a DTensor (FSDP2) weight is
        refused."""
        if not enabled:
            self._graph_wcache_on = False
            _GRAPH_CACHED.discard(self)
            for name in self._GRAPH_WCACHE:
                self._buffers.pop(name, None)
                self._non_persistent_buffers_set.discard(name)
            self._graph_wcache_meta = self._graph_wcache_version = None
            return
        if self.recipe.is_delayed:
            raise ValueError(f"{self.fqn or 'Float8Linear'}: recipe {self.recipe.name} keeps its eager island, which "
                             "caches the FP8 weight itself; the compiled weight cache is for current scaling "
                             "(tensorwise, blockwise, mxfp8)")
        if type(self.weight.data) is not torch.Tensor or self.weight.is_meta:
            raise ValueError(f"{self.fqn or 'Float8Linear'}: the compiled weight cache needs a plain, materialised "
                             f"weight tensor, got {type(self.weight.data).__name__} on {self.weight.device} "
                             "(a DTensor / FSDP2 weight is re-quantised in the graph)")
        self._graph_wcache_on = True
        _GRAPH_CACHED.add(self)
        self.refresh_graph_weight_cache()

    @torch.no_grad()
    def refresh_graph_weight_cache(self) -> None:
        """Re-quantise the compiled path's cached FP8 weight from the current weight, in place
        (same buffers, so compiled graphs and CUDA graphs that read them stay valid). Called for
        you (:meth:`set_graph_weight_cache`); a no-op while the cache is off."""
        if not self._graph_wcache_on:
            return
        w = self.weight.detach()
        if w.is_meta:  # (.to("meta"), deferred init): quantised when the weight is materialised
            return
        if type(self.weight.data) is not torch.Tensor:
            raise RuntimeError(f"{self.fqn or 'Float8Linear'}: the weight became a {type(self.weight.data).__name__} "
                               "(e.g. fully_shard) after set_graph_weight_cache; the cached FP8 weight would be the "
                               "unsharded old one. Call set_graph_weight_cache(model, False) before sharding")
        # current scaling, the eager quantisers (the fused kernels on CUDA), no module state
        q_f, q_d = _quantize_weight(w, self.recipe, self.emulate,
                                    functools.partial(_quantize_plain, self.recipe, triton=self._triton_arg()))
        new = (*_tensors(q_f), *_tensors(q_d))
        for name, t in zip(self._GRAPH_WCACHE, new):
            old = self._buffers.get(name)
            if (old is not None and old.shape == t.shape and old.dtype == t.dtype and old.device == t.device
                    and old.stride() == t.stride()):
                old.copy_(t)
            else:  # (empty_like keeps t's strides: the GEMMs' layouts)
                self.register_buffer(name, torch.empty_like(t).copy_(t), persistent=False)
        self._graph_wcache_meta = (_meta(q_f), _meta(q_d))
        self._graph_wcache_version = self.weight._version

    def graph_weight_cache_stale(self) -> bool:
        """Whether the compiled path's cached FP8 weight is older than the weight (its version
        counter moved since the last refresh: an in-place write outside an optimizer step or
        ``load_state_dict``). False while the cache is off."""
        return self._graph_wcache_on and self.weight._version != self._graph_wcache_version

    @torch.no_grad()
    def _commit(self, i: int, quantising: bool = False) -> bool:
        """Lazy schedule: append operand i's pending amax to its history and recompute its scale
        (:func:`~nemo_fp8_recipes.quant.delayed.advance_delayed_scaling`). ``quantising``: a
        quantisation that records a new amax follows at once, so the pending flag stays set.
        On CUDA with Triton (and no ``amax_reduce_fn``) the whole update is one kernel
        (:func:`~nemo_fp8_recipes.quant.triton_kernels.delayed_commit`, same numbers). Returns
        whether it left the flag set for the coming quantisation."""
        if not self._pending[i]:
            return False
        r = self.recipe
        fmt = (r.input_format, r.weight_format, r.grad_format)[i]
        hist_i = self.fp8_amax_history[i]
        if (self.amax_reduce_fn is None and triton_enabled(hist_i, self._triton_arg())
                and r.scale_rounding is ScaleRounding.FP32):
            from ..quant.triton_kernels import delayed_commit

            delayed_commit(hist_i, self.fp8_scale[i], self.fp8_amax_pending[i], self.fp8_pending[i], fmt,
                           r.amax_compute_algo, r.margin, flag_after=1.0 if quantising else 0.0)
            self._pending[i] = quantising
            return quantising
        pending = self.fp8_amax_pending[i : i + 1]
        if self.amax_reduce_fn is not None:
            pending = self.amax_reduce_fn(pending.clone())
        hist, scale = advance_delayed_scaling(
            self.fp8_amax_history[i : i + 1], self.fp8_scale[i : i + 1], pending.reshape(1),
            self.fp8_pending[i : i + 1], (fmt,), r)
        self.fp8_amax_history[i : i + 1].copy_(hist)
        self.fp8_scale[i : i + 1].copy_(scale)
        self.fp8_amax_pending[i].zero_()
        self.fp8_pending[i].zero_()
        self._pending[i] = False
        return False

    def _quantize_operand(self, i: int, t: torch.Tensor, pair: bool = False,
                          gate: Optional[torch.Tensor] = None):
        """Quantise operand ``i`` (input, weight, grad_output) of 2-D ``t`` along its last dim;
        with ``pair=True`` also along its first dim (the wgrad copy), from one read on CUDA.
        ``gate``: the operand is ``F.silu(gate) * t`` (fused into the per-tensor pair kernels,
        :meth:`fuses_swiglu`; materialised otherwise).
        Delayed scaling: commit the pending amax (lazy schedule), cast with the scale, and
        max-accumulate this tensor's amax into the pending amax — on CUDA inside the cast pass
        itself (the tensor is read once), so a delayed quantisation is two kernels."""
        r = self.recipe
        fmt, gran = _operand_spec(r, i)
        scale = amax_out = None
        committed = False
        if r.is_delayed:
            if self.scaling_update == "lazy":
                committed = self._commit(i, quantising=True)
            scale = self.fp8_scale[i]
            # lazy: the commit left it at 0, so it receives exactly this amax; step: the max over
            # every use in this optimizer step (NaN sticks). With telemetry on, the cast gets a
            # fresh accumulator (q.amax = this call's amax, for the statistics) that is then
            # folded into the pending value.
            if not self.telemetry_enabled:
                amax_out = self.fp8_amax_pending[i : i + 1]
        if gate is not None and (not pair or self.telemetry_enabled):
            t, gate = torch.nn.functional.silu(gate) * t, None
        try:
            if pair:
                q, qt = quantize_pair_auto(t, fmt, gran, r.scale_rounding, scale=scale, amax_out=amax_out,
                                           gate=gate, triton=self._triton_arg())
            else:
                q, qt = quantize(t, fmt, gran, r.scale_rounding, dim=-1, scale=scale, amax_out=amax_out,
                                 triton=self._triton_arg()), None
        except BaseException:
            if committed:  # the commit left the flag set for an amax that never came
                with torch.no_grad():
                    self.fp8_pending[i].fill_(0.0)
                self._pending[i] = False
            raise
        if r.is_delayed:
            if amax_out is None:
                accumulate_amax(self.fp8_amax_pending[i : i + 1], q.amax)
            if not self._pending[i]:
                self.fp8_pending[i].fill_(1.0)
                self._pending[i] = True
        if self.telemetry_enabled:
            self._telemetry.setdefault(i, []).append(quantization_stats(t.detach(), q))
        return (q, qt) if pair else q

    # ---- weight cache ------------------------------------------------------------------------
    def _quantized_weight(self):
        """(W quantised along K as [N, K], W quantised along N as [K, N]) — cached until the
        weight changes (delayed scaling: or its scale). A weight created under
        ``torch.inference_mode`` has no version counter, so a change could not be seen: it is
        quantised at every call instead."""
        w = self.weight
        if w.is_inference():
            return _quantize_weight(w.detach(), self.recipe, self.emulate, self._quantize_operand)
        key = (w._version, _OPTIMIZER_GENERATION[0], w.data_ptr(), w.dtype, w.device)
        if self.recipe.is_delayed:
            # The FP8 weight follows its amax history, as TE's (which re-quantises the weight at
            # every forward): a frozen weight, an evaluation or a second forward before any
            # optimizer step must not keep the scale of its first quantisation. Step schedule:
            # re-quantised once the scales advanced; lazy schedule: whenever an amax is pending
            # (i.e. at every forward, like TE).
            if self.scaling_update == "lazy" and self._pending[_W]:
                self._wcache_key = None
            key = key + (self._scale_generation,)
        if self._wcache_key == key and self._wcache is not None:
            return self._wcache
        self._wcache_key = key
        self._wcache = _quantize_weight(w.detach(), self.recipe, self.emulate, self._quantize_operand)
        return self._wcache

    def _triton_arg(self) -> Optional[bool]:
        """The dispatch's ``triton`` argument for this module's quantisers: None (the Triton
        kernels where they run) or False (``KernelOptions(triton=False)``: the reference)."""
        return None if self.kernel_options.triton else False

    # ---- bookkeeping -------------------------------------------------------------------------
    def _count(self, gemm: str) -> None:
        self._gemm_counts_eager[gemm] += 1

    @property
    def gemm_counts(self) -> Dict[str, int]:
        """fprop/dgrad/wgrad GEMMs run in FP8 since construction or :meth:`reset_gemm_counts`:
        the eager path's Python counts plus the compile-traced path's in-graph counts (reading
        those synchronises with the device)."""
        fwd = int(self.fp8_fwd_count.sum().item())
        dgrad, wgrad = (int(v) for v in self.fp8_bwd_count.tolist())
        c = self._gemm_counts_eager
        return {"fprop": c["fprop"] + fwd, "dgrad": c["dgrad"] + dgrad, "wgrad": c["wgrad"] + wgrad}

    @torch.no_grad()
    def reset_gemm_counts(self) -> None:
        """Zero the GEMM counters (both paths)."""
        self._gemm_counts_eager = {k: 0 for k in self._gemm_counts_eager}
        self.fp8_fwd_count.zero_()
        self.fp8_bwd_count.zero_()

    def pop_telemetry(self) -> Dict[str, Dict[str, float]]:
        """Mean of each statistic per operand since the last call (amax: the max), then reset."""
        out = {}
        for i, stats in self._telemetry.items():
            if not stats:
                continue
            s = torch.stack(stats).float().cpu()
            vals = {name: float(s[:, k].mean()) for k, name in enumerate(STAT_NAMES)}
            vals["amax"] = float(s[:, 0].max())
            out[OPERANDS[i]] = vals
        self._telemetry = {}
        return out

    # ---- forward -------------------------------------------------------------------------------
    def traceable(self) -> bool:
        """Whether ``torch.compile`` traces this module's FP8 linear (no graph break): current
        scaling with telemetry off — tensorwise and blockwise with real or emulated GEMMs, mxfp8
        emulated. Delayed scaling, telemetry, real MXFP8 GEMMs (SM100) and emulation on CUDA
        while TF32 matmuls are enabled (the exact FP32 product needs TF32 switched off for one
        op, which a compiled graph cannot do) keep the eager island (see :meth:`forward`).
        Decided when the graph is traced."""
        if self.recipe.is_delayed or self.telemetry_enabled:
            return False
        if self.emulate and self.weight.is_cuda and torch.backends.cuda.matmul.allow_tf32:
            return False
        if not self.emulate and self.recipe.input_granularity is Granularity.BLOCK_1x32:
            # Real MXFP8 GEMMs (SM100) keep the island: their dispatch is not wrapped as an
            # operator and has not been traced on a machine that runs it. Blockwise traces: its
            # GEMM is one operator (quant.ops.blockwise_mm; the bare dispatch broke the graph
            # 30 times in the 8B layer on torch 2.11).
            return False
        return True

    def fuses_swiglu(self, gate: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether ``self(x, gate=gate)`` runs the fused SwiGLU → quantise path: eager (not under
        ``torch.compile``, where Inductor fuses SiLU, the product and the quantisers itself), on
        CUDA with the Triton kernels, a per-tensor input (tensorwise, delayed),
        telemetry off, ``gate`` and ``x`` contiguous with the same shape and dtype (BF16 or
        FP32), whole GEMM tiles of rows (no padding), and ``KernelOptions.fused_swiglu`` on (the
        default: the forward codes are bit-identical to materialising the activation and the
        backward's ``dg`` may differ by one unit in the last place — tested on an H200 and under
        Triton's interpreter; ``fused_swiglu=False`` turns it off for an A/B run). Otherwise
        the activation is materialised first."""
        if (torch.compiler.is_compiling() or not self.kernel_options.fused_swiglu
                or self.recipe.input_granularity is not Granularity.TENSOR or self.telemetry_enabled
                or not triton_enabled(x, self._triton_arg())):
            return False
        from ..quant.triton_kernels import gate_fusable

        return gate_fusable(x, gate) and (x.numel() // max(x.shape[-1], 1)) % self._row_multiple == 0

    def forward_eager(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through the eager FP8 path (the autograd function of
        :meth:`forward` in eager mode), with ``bias`` given by the caller: wrappers that own the
        bias handling (Megatron's ``skip_bias_add``) call this."""
        return _Float8LinearFn.apply(x, self.weight, bias, self, _out_dtype_for(x), torch.is_grad_enabled())

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x · Wᵀ + b`` with the three GEMMs in FP8; with ``gate``, ``(F.silu(gate) * x) · Wᵀ + b``
        — a SwiGLU MLP's down projection called with the gate and up halves, so that the
        activation can be fused (:meth:`fuses_swiglu`: delayed scaling computes it inside the
        one-pass quantiser and never writes it, current scaling computes it once in its amax
        pass; the SwiGLU backward is one kernel). The forward
        gives the same codes and outputs as materialising the activation; the gate's gradient
        ``dg`` may differ in its last bit (and with it what depends on it downstream, e.g. the
        gate projection's delayed-scaling amax of its output gradient).

        Eager mode runs :class:`_Float8LinearFn`: the fused Triton quantisers on CUDA, the FP8
        weight cached between optimizer steps, delayed-scaling state, telemetry, Python GEMM
        counters.

        Under ``torch.compile`` a current-scaling module (:meth:`traceable`) runs
        :class:`_Float8LinearTracedFn`, which the compiler traces like any other op, so the
        model has no graph break here. On CUDA it quantises with the eager path's Triton kernels
        as custom operators (:mod:`nemo_fp8_recipes.quant.ops`; per-tensor pairs, 1x128 groups,
        128x128 blocks), elsewhere — or with ``KernelOptions(triton=False)`` — with the
        reference quantisers (the numerics contract in plain torch ops, which Inductor fuses into
        the neighbouring kernels); the same numbers either way. The GEMMs are the dispatch of
        :mod:`nemo_fp8_recipes.quant.gemm` (``torch._scaled_mm``; blockwise's block-scaled GEMM
        as the operator ``blockwise_mm``; or emulation). It quantises the weight in the graph, in
        every forward — or, with :meth:`set_graph_weight_cache`, reads it from buffers that are
        re-quantised eagerly after each optimizer step (FP8 weights cached across micro-batches) —
        and counts its GEMMs in the int64 buffers ``fp8_fwd_count`` /
        ``fp8_bwd_count`` with in-graph adds, so :func:`~nemo_fp8_recipes.nn.audit` stays exact.

        Deliberate fallbacks to the eager island (one graph break per FP8 linear) under
        ``torch.compile``: delayed scaling (its amax histories and scales are state that each
        quantisation reads and writes), telemetry (its statistics are collected Python-side,
        also in backward), real MXFP8 GEMMs and CUDA emulation with TF32 on
        (:meth:`traceable`). Turning telemetry on or off between steps makes the compiler
        re-trace once for each state (a guard on ``telemetry_enabled``).
        """
        if not x.is_floating_point():
            raise RuntimeError(f"Float8Linear {self.fqn or ''}: expected a floating-point input, got {x.dtype} "
                               "(as nn.Linear, it multiplies floating-point tensors; cast the input first)")
        out_dtype = _out_dtype_for(x)
        if gate is not None:
            if self.fuses_swiglu(gate, x):
                return self._forward_swiglu(gate, x, out_dtype)
            x = torch.nn.functional.silu(gate) * x
        if torch.compiler.is_compiling() and self.traceable():
            self.fp8_fwd_count.add_(1)
            wmeta, wcache = None, ()
            if self._graph_wcache_on:
                wmeta, wcache = self._graph_wcache_meta, tuple(getattr(self, n) for n in self._GRAPH_WCACHE)
            return _Float8LinearTracedFn.apply(
                x, self.weight, self.bias, self.fp8_bwd_count, self.recipe, self.emulate,
                self._row_multiple, out_dtype, self.fqn, torch.is_grad_enabled(), self.kernel_options.triton,
                wmeta, *wcache)
        return self._forward_eager(x, out_dtype)

    # The eager island: under torch.compile this call is a graph break; quantisation (fused
    # Triton kernels), delayed-scaling state updates, telemetry and the audit counters stay
    # exact Python-side.
    @torch.compiler.disable
    def _forward_eager(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return _Float8LinearFn.apply(x, self.weight, self.bias, self, out_dtype, torch.is_grad_enabled())

    def _forward_swiglu(self, gate: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        _check_device(x, self.emulate, self.fqn)
        return _Float8SwiGLULinearFn.apply(x, self.weight, self.bias, gate, self, out_dtype, torch.is_grad_enabled())


def fp8_modules(model: nn.Module) -> Dict[str, Float8Linear]:
    """All Float8Linear modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
