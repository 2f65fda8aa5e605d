"""One quantisation of an input shared by the eager FP8 linears that read it (q/k/v, gate/up),
and its hand-over from the fused RMSNorm (:mod:`nemo_fp8_recipes.nn.norm`)."""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..formats import Format, Granularity, ScaleRounding
from ..quant.reference import QuantizedTensor
from .config import Float8LinearConfig
from .gemms import IN, operand_spec

__all__ = ["SHARED_INPUT", "input_prequantization", "input_quantizer", "is_fp8_linear", "share_input_quantization"]


def is_fp8_linear(mod) -> bool:
    """Whether ``mod`` is an FP8 linear of the native backend (an ``nn.Linear`` with a
    :class:`~nemo_fp8_recipes.nn.Float8LinearConfig`: :class:`~nemo_fp8_recipes.nn.Float8Linear`),
    without importing it here."""
    return isinstance(mod, nn.Linear) and isinstance(getattr(mod, "config", None), Float8LinearConfig)


class SharedInput(threading.local):
    """The last stateless input quantisation of the eager FP8 linears, for the next linear that
    reads the same tensor: a transformer's q/k/v projections all take the attention norm's
    output, its gate and up projections the MLP norm's, so with current scaling (tensorwise,
    blockwise, mxfp8) they would quantise the same values to the same codes three and two times,
    and save the wgrad copy for backward as often.

    One entry per thread: the input tensor (weakly referenced: freeing it drops the entry and
    its codes), its version counter (an in-place change invalidates it), the CUDA stream it was
    quantised on, and the results per quantisation spec — replaced as a whole, never mutated in
    place. Only autograd intermediates are shared (:func:`input_quantizer`): a leaf — a
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


SHARED_INPUT = SharedInput()


def shareable(mod: nn.Module, x: torch.Tensor) -> bool:
    """:func:`input_quantizer`'s conditions on the module and the moment (not on ``x``'s
    ``grad_fn``, which a producer checks once it has made ``x``)."""
    cfg = mod.config
    return not (
        cfg.recipe.is_delayed
        or cfg.telemetry
        or (x.is_cuda and torch.cuda.is_current_stream_capturing())
        or not cfg.kernel_options.shared_input
    )


def share_key(mod: nn.Module, x: torch.Tensor):
    """(quantisation spec, CUDA stream) under which ``mod``'s input quantisation of ``x`` is shared."""
    cfg = mod.config
    r = cfg.recipe
    spec = (type(mod), *operand_spec(r, IN), r.scale_rounding, cfg.emulate, cfg.row_multiple)
    return spec, (torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None)


def input_prequantization(mod, x: torch.Tensor) -> Optional[Tuple[Format, Granularity, ScaleRounding]]:
    """What the producer of ``mod``'s coming input ``x`` — the fused RMSNorm
    (:func:`nemo_fp8_recipes.nn.norm.rms_norm`) — may quantise for it in its own pass and hand over
    with :func:`share_input_quantization`: ``(format, granularity, rounding)`` of ``mod``'s input
    when that is per tensor or 1x32 / 1x128 along rows and ``mod`` shares its input quantisation
    (:func:`input_quantizer`: an eager FP8 linear with current scaling and telemetry off, no CUDA
    graph being captured, ``KernelOptions.shared_input`` on) with a trainable weight (the pair
    includes the wgrad copy) and takes ``x``'s rows unpadded; else None. ``x``: the producer's
    input (same rows, device)."""
    if (
        not is_fp8_linear(mod) or torch.compiler.is_compiling() or not shareable(mod, x) or not mod.weight.requires_grad
    ):  # a frozen weight takes no wgrad copy of x
        return None
    fmt, gran = operand_spec(mod.recipe, IN)
    if gran is not Granularity.TENSOR and gran.block not in ((1, 32), (1, 128)):
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if not mod.config.emulate and rows % mod.config.row_multiple:
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
    spec, stream = share_key(mod, x)
    SHARED_INPUT.put(x, stream, spec, (q, q_wgrad))
    return True


def input_quantizer(mod: nn.Module, x: torch.Tensor, quantize: Callable):
    """``quantize`` (``mod``'s operand quantiser,
    :meth:`~nemo_fp8_recipes.nn.linear.Float8LinearOperands.quantize`), sharing the input's
    quantisation with the other eager FP8
    linears that read the same ``x`` (:class:`SharedInput`) where that is safe and gives the
    same codes: current scaling (delayed scaling's scale is per module), telemetry off (it
    records statistics per module), ``x`` an autograd intermediate (it has a ``grad_fn``; so
    never under ``torch.no_grad``), not while a CUDA graph is captured (the graph must contain
    its own quantisation). ``KernelOptions(shared_input=False)`` turns the sharing off (A/B runs)."""
    if x.grad_fn is None or not shareable(mod, x):
        return quantize
    spec, stream = share_key(mod, x)

    def quantize_operand(i: int, t: torch.Tensor, pair: bool = False):
        if i != IN:
            return quantize(i, t, pair=pair)
        got = SHARED_INPUT.get(x, stream, spec, pair)
        if got is None:
            got = quantize(i, t, pair=True) if pair else (quantize(i, t), None)
            SHARED_INPUT.put(x, stream, spec, got)
        return got if pair else got[0]

    return quantize_operand
