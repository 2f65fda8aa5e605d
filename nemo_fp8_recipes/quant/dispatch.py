"""Pick the quantiser for a tensor: the fused Triton kernels on CUDA, the reference elsewhere.

Both produce bit-identical codes and scales (checked by tests/quant/test_triton_kernels.py on the GPU
and under Triton's CPU interpreter), so this choice never changes the numbers — only the speed.
``triton=False`` forces the reference quantisers for one call (an FP8 linear passes it when its
:class:`~nemo_fp8_recipes.options.KernelOptions` say ``triton=False``; under ``torch.compile``
those are plain torch ops that the compiler fuses into its own kernels).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import Granularity, ScaleRounding
from .reference import QuantizedTensor, accumulate_amax, quantize

__all__ = [
    "quantize_auto",
    "quantize_pair_auto",
    "triton_enabled",
]


def triton_enabled(x: torch.Tensor, triton: Optional[bool] = None) -> bool:
    """Whether the Triton kernels run for ``x``: ``triton=None`` (auto) when ``x`` is on CUDA and
    Triton imports; ``False`` never (the reference quantisers).

    ``triton=True`` asks for the kernels whatever the defaults say: on CUDA, or on CPU under
    Triton's interpreter (``TRITON_INTERPRET=1``: slow, for checking the kernels where there is
    no GPU, as the CI's benchmark smoke runs do); anything else is an error, not a silent
    fallback to the reference."""
    if triton is False:
        return False
    if triton is True:
        from . import triton_kernels

        if not triton_kernels.HAVE_TRITON:
            raise RuntimeError("triton=True: Triton is not installed (`pip install triton`)")
        if x.device.type != "cuda" and not triton_kernels.interpreting():
            raise RuntimeError(
                f"triton=True: the Triton kernels run on CUDA tensors (got {x.device.type}), or on "
                "CPU under Triton's interpreter (TRITON_INTERPRET=1 set before Triton is imported)"
            )
        return True
    if x.device.type != "cuda":
        return False
    from . import triton_kernels

    return triton_kernels.HAVE_TRITON


def quantize_auto(
    x: torch.Tensor,
    fmt,
    granularity,
    rounding=ScaleRounding.FP32,
    dim: int = -1,
    scale: Optional[torch.Tensor] = None,
    triton: Optional[bool] = None,
    amax_out: Optional[torch.Tensor] = None,
) -> QuantizedTensor:
    """Same contract as :func:`nemo_fp8_recipes.quant.reference.quantize`. ``triton=False``
    forces the reference quantiser (None: Triton kernels where :func:`triton_enabled`).

    ``amax_out`` (per tensor with a given ``scale``: delayed scaling) is a one-element FP32
    tensor into which this tensor's amax is max-accumulated (NaN sticks); the returned
    ``q.amax`` is then ``amax_out`` itself. The Triton path folds the amax into the cast pass
    (one read of ``x``)."""
    _check_amax_out(granularity, scale, amax_out)
    if not triton_enabled(x, triton):
        return fold_amax_block(quantize(x, fmt, granularity, rounding, dim=dim, scale=scale), amax_out)
    from . import triton_kernels as tk

    g = Granularity(granularity)
    along_cols = dim in (0, -2)
    if g is Granularity.TENSOR:
        q = tk.quantize_tensor(x, fmt, rounding, scale=scale, amax_out=amax_out)
        return q.t() if along_cols else q
    if scale is not None:
        raise ValueError("an explicit scale (delayed scaling) is only defined per tensor")
    if g is Granularity.BLOCK_128x128:
        q = tk.quantize_blocks128(x, fmt, rounding)
        return q.t() if along_cols else q
    group = g.block[1]
    if along_cols:
        return tk.quantize_cols_t(x, fmt, group, rounding)
    return tk.quantize_rows(x, fmt, group, rounding)


def _check_amax_out(granularity, scale, amax_out) -> None:
    if amax_out is not None and (scale is None or Granularity(granularity) is not Granularity.TENSOR):
        raise ValueError("amax_out collects the amax of a per-tensor cast with a given (delayed) scale")


@torch.no_grad()
def fold_amax_block(q: QuantizedTensor, amax_out: Optional[torch.Tensor]) -> QuantizedTensor:
    """The reference path's ``amax_out`` contract: max-accumulate ``q.amax`` into it and return
    ``q`` carrying it."""
    if amax_out is None:
        return q
    accumulate_amax(amax_out, q.amax)
    return QuantizedTensor(
        data=q.data, scale_inv=q.scale_inv, block=q.block, fmt=q.fmt, amax=amax_out.view(1, 1), scale_e8m0=q.scale_e8m0
    )


def quantize_pair_auto(
    x: torch.Tensor,
    fmt,
    granularity,
    rounding=ScaleRounding.FP32,
    scale: Optional[torch.Tensor] = None,
    triton: Optional[bool] = None,
    amax_out: Optional[torch.Tensor] = None,
    gate: Optional[torch.Tensor] = None,
):
    """``(quantize(x, dim=-1), quantize(x, dim=0))`` — the operand for the GEMM contracting over
    ``x``'s last dim and the one contracting over its first dim (the wgrad copy, written already
    transposed and contiguous). Per tensor, both copies come from one read of ``x`` after the
    amax pass (:func:`~.triton_kernels.quantize_tensor_dual`), or — with a given (delayed)
    scale — from a single pass that also takes the amax. For 1xN groups the row-wise and
    the transposed column-wise kernels run one after the other: a one-read kernel writing both
    is slower, its in-register transpose of a whole tile costing more than the second read
    saves (docs/internals/design-notes.md).
    128x128 blocks are symmetric: the Triton kernel writes the second copy's codes transposed
    and contiguous in the same pass (a weight's dgrad operand), same scale grid transposed.
    ``triton=False`` forces the reference quantisers (per-tensor and 128x128 copies are then
    transposed views of one quantisation). ``amax_out``: as in :func:`quantize_auto` (both
    copies carry it).

    ``gate``: quantise the SwiGLU activation ``F.silu(gate) * x`` instead of ``x`` — per tensor
    on CUDA, for contiguous BF16/FP32 halves of one shape, computed inside the Triton kernels
    (never written with a given scale; written once by the amax pass with current scaling; same
    codes, :func:`~.triton_kernels.quantize_tensor_dual`); otherwise materialised first."""
    g = Granularity(granularity)
    _check_amax_out(g, scale, amax_out)
    if gate is not None:
        if g is Granularity.TENSOR and triton_enabled(x, triton):
            from . import triton_kernels as tk

            if tk.gate_fusable(x, gate):
                return tk.quantize_tensor_dual(x, fmt, rounding, scale=scale, amax_out=amax_out, gate=gate)
        x = torch.nn.functional.silu(gate) * x
    if not triton_enabled(x, triton):
        a = fold_amax_block(quantize(x, fmt, g, rounding, dim=-1, scale=scale), amax_out)
        b = a.t() if g in (Granularity.TENSOR, Granularity.BLOCK_128x128) else quantize(x, fmt, g, rounding, dim=0)
        return a, b
    from . import triton_kernels as tk

    if scale is not None and g is not Granularity.TENSOR:
        raise ValueError("an explicit scale (delayed scaling) is only defined per tensor")
    if g is Granularity.BLOCK_128x128:
        return tk.quantize_blocks128(x, fmt, rounding, transposed=True)  # the dgrad copy written too
    if g is Granularity.TENSOR:
        return tk.quantize_tensor_dual(x, fmt, rounding, scale=scale, amax_out=amax_out)
    group = g.block[1]
    return tk.quantize_rows(x, fmt, group, rounding), tk.quantize_cols_t(x, fmt, group, rounding)
