"""RMSNorm → quantise: the fused RMSNorm of the native backend.

The model's norms stay in FP32 math (the precision policy: a norm is never an FP8 op). In eager
mode on CUDA, :func:`rms_norm` computes one in a single Triton pass (one read of ``x``, one write
of ``y``, the per-row ``rstd`` kept for a one-pass backward) instead of PyTorch's chain of
FP32 element-wise kernels — in BF16 and FP8 models alike. When the norm's output feeds FP8
linears (the attention's q/k/v projections, the MLP's gate/up projections) with current
scaling, the same pass also does the first step of their input quantisation
(:func:`~nemo_fp8_recipes.nn.shared_input.input_prequantization`):

* per tensor (tensorwise): the amax of ``y``, so the linears' quantiser skips its amax pass and
  only casts (codes and their transpose from one read of ``y``);
* 1x128 / 1x32 rows (blockwise, mxfp8): the row-wise codes and scales of ``y``, so only the
  transposed column-wise copy (the wgrad operand) is left to compute.

The result is handed to the linears through their shared input quantisation — the same codes
and scales, bit for bit, as their own quantisers give for ``y`` (the same quantisation core,
:mod:`nemo_fp8_recipes.quant.triton_kernels`).

The values of ``y`` (and the saved ``rstd``) are the same whichever of these the pass also does,
so the norm's output does not depend on the recipe. The backward is first-order only
(``once_differentiable``: a second-order gradient through the fused norm raises; use
``KernelOptions(fused_norm=False)`` for gradient penalties).

Under ``torch.compile`` the plain PyTorch formula is traced instead (Inductor fuses the norm
with its neighbours itself); on CPU, for other dtypes, rows longer than
:data:`~nemo_fp8_recipes.quant.triton_kernels.RMSNORM_MAX_D`, tensor subclasses, or with
``KernelOptions(fused_norm=False)`` (or ``triton=False``) the formula runs eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import Granularity
from ..options import KernelOptions
from ..quant.dispatch import triton_enabled
from .shared_input import input_prequantization, share_input_quantization

__all__ = ["fused_norm_enabled", "rms_norm", "rms_norm_reference"]

_ALL_ON = KernelOptions()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x * rsqrt(mean(x**2) + eps)) * weight`` in FP32, returned in ``x``'s dtype — the formula
    (what ``torch.compile`` traces and the CPU runs)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_norm_enabled(x: torch.Tensor, weight: torch.Tensor, options: Optional[KernelOptions] = None) -> bool:
    """Whether :func:`rms_norm` takes the fused Triton kernels: eager (not compiling), CUDA with
    Triton (:func:`~nemo_fp8_recipes.quant.dispatch.triton_enabled`), BF16 or FP32 ``x``, plain
    tensors (no subclass such as DTensor) on one device, a row of at most
    ``RMSNORM_MAX_D`` elements, and ``options`` (default: all on; a model's
    :class:`~nemo_fp8_recipes.models.llama.RMSNorm` passes its own) with ``fused_norm`` and
    ``triton`` on."""
    opts = options if options is not None else _ALL_ON
    if torch.compiler.is_compiling() or not (opts.fused_norm and opts.triton):
        return False
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if not triton_enabled(x) or weight.device != x.device or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    from ..quant.triton_kernels import RMSNORM_MAX_D

    return 0 < x.shape[-1] <= RMSNORM_MAX_D and weight.shape == x.shape[-1:]


class _RMSNormFn(torch.autograd.Function):
    """The fused RMSNorm's autograd: saves ``x`` and ``rstd`` (not an FP32 copy of ``x`` as the
    formula's autograd does); ``plan`` (or None) asks the forward pass for the amax or the row
    codes of ``y``, returned through ``extras``."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, plan, extras: Optional[dict]):
        from ..quant import triton_kernels as tk

        x2 = x.reshape(-1, x.shape[-1])
        amax, rows = False, None
        if plan is not None:
            fmt, gran, rounding = plan
            amax = gran is Granularity.TENSOR
            if not amax:
                rows = (fmt, gran.block[1], rounding)
        # y is made in x's shape (not a view of a 2-D result: a custom Function's view output
        # could not be modified in place by the caller)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _, rstd, acc, q = tk.rmsnorm_forward(x2, weight, eps, amax=amax, rows=rows, out=y.view(-1, x.shape[-1]))
        if extras is not None:
            extras["amax"], extras["rows"] = acc, q
        ctx.save_for_backward(x2, weight, rstd)
        ctx.in_shape = x.shape
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward kernels are not differentiable
    def backward(ctx, dy):
        from ..quant import triton_kernels as tk

        x2, weight, rstd = ctx.saved_tensors
        dx, dw = tk.rmsnorm_backward(dy.reshape(-1, x2.shape[-1]), x2, weight, rstd, need_dw=ctx.needs_input_grad[1])
        return dx.view(ctx.in_shape), dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    consumer: Optional[torch.nn.Module] = None,
    options: Optional[KernelOptions] = None,
):
    """RMSNorm of ``x``'s last dim (:func:`rms_norm_reference`'s formula), fused when
    :func:`fused_norm_enabled`. ``consumer``: the first FP8 linear that reads the result (the
    others that read it with the same recipe share with it) — when its input quantisation can
    start in the norm's pass (:func:`~nemo_fp8_recipes.nn.shared_input.input_prequantization`; the
    result must also be an autograd intermediate, so only with grad enabled) the norm quantises
    ``y`` for it and hands the codes over. The values of ``y`` are the same either way."""
    if not fused_norm_enabled(x, weight, options):
        return rms_norm_reference(x, weight, eps)
    plan = None
    if consumer is not None and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        plan = input_prequantization(consumer, x)
    extras = {} if plan is not None else None
    y = _RMSNormFn.apply(x, weight, eps, plan, extras)
    if plan is not None and y.grad_fn is not None:
        from ..quant import triton_kernels as tk

        fmt, gran, rounding = plan
        with torch.no_grad():
            y2 = y.detach().view(-1, y.shape[-1])
            if gran is Granularity.TENSOR:
                q, q_wgrad = tk.quantize_tensor_dual(y2, fmt, rounding, amax=extras["amax"])
            else:
                q, q_wgrad = extras["rows"], tk.quantize_cols_t(y2, fmt, gran.block[1], rounding)
        share_input_quantization(consumer, y, q, q_wgrad)
    return y
