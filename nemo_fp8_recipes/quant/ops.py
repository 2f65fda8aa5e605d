"""The fused Triton quantisers and the block-scaled GEMM as PyTorch custom operators, for
compiled graphs.

Under ``torch.compile`` the FP8 linear's traced path (:class:`~nemo_fp8_recipes.nn.Float8Linear`)
must quantise with something the compiler can put in its graph. Two choices, picked by the
module's :class:`~nemo_fp8_recipes.options.KernelOptions` (``triton``):

``triton=True`` (default, on CUDA)
    these operators — :func:`tensor_pair` (per tensor: the atomic amax pass and the one-read
    cast that writes the codes and their transpose), :func:`tensor_pair_scaled` /
    :func:`tensor_scaled` (per tensor with a given delayed-scaling scale: one pass that casts and
    takes the amax), :func:`group_rows` / :func:`group_cols_t`
    (1x128 groups along rows, and down columns written transposed: blockwise activations and
    gradients) and :func:`blocks128` (128x128 weight blocks) — each one opaque node. The
    compiler schedules them like any extern kernel (no graph break) but cannot fuse them with
    neighbouring element-wise ops.
``triton=False``
    the reference quantisers (plain torch ops), which Inductor generates and fuses itself.

Both give the same codes and scales bit for bit (the kernels are checked against the reference).

:func:`blockwise_mm` is :func:`~.scaled_mm.blockwise_matmul` (the SM90 block-scaled ``F.scaled_mm``
with its scale layouts and row padding) as one node: dynamo does not trace that dispatch, so
without it every real blockwise GEMM would be a graph break.

The operators are registered with ``torch.library.Library`` (a schema, one
``CompositeExplicitAutograd`` kernel, a fake kernel), not ``torch.library.custom_op``: they are only
called inside the FP8 linear's autograd functions, where no gradient flows through them, and the
``custom_op`` wrapper's own Python layers roughly double the host time a compiled step waits for
(docs/internals/design-notes.md has the measurement). Called with inputs that require a gradient
while grad mode is on, PyTorch's autograd fallback warns that no gradient is defined for them.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..formats import ScaleRounding
from .reference import (  # as_format: how the kernels read ``fmt``, so fake and real agree
    as_format,
    scale_grid,
)

__all__ = [
    "blocks128",
    "blockwise_mm",
    "group_cols_t",
    "group_rows",
    "tensor_pair",
    "tensor_pair_scaled",
    "tensor_scaled",
]

_LIB = torch.library.Library("nemo_fp8_recipes", "FRAGMENT")


def _operator(schema: str):
    """Define ``nemo_fp8_recipes::<schema>`` with the decorated function as its kernel for every
    device; returns the operator (``torch.ops.nemo_fp8_recipes.<name>.default``), whose
    ``register_fake`` takes the fake (meta) kernel."""
    name = schema.split("(", 1)[0]

    def wrap(fn):
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        op = getattr(torch.ops.nemo_fp8_recipes, name).default
        op.register_fake = lambda fake: torch.library.register_fake(f"nemo_fp8_recipes::{name}", fake, lib=_LIB)
        op.__doc__ = fn.__doc__
        return op

    return wrap


@_operator("tensor_pair(Tensor x, str fmt, str rounding) -> (Tensor, Tensor, Tensor, Tensor)")
def tensor_pair(x: Tensor, fmt: str, rounding: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-tensor current scaling of 2-D ``x``: ``(codes [R, C], codes transposed [C, R],
    scale_inv [1, 1], amax [1, 1])``."""
    from . import triton_kernels as tk

    a, b = tk.quantize_tensor_dual(x, fmt, rounding)
    return a.data, b.data, a.scale_inv, a.amax


@tensor_pair.register_fake
def _tensor_pair_fake(x: Tensor, fmt: str, rounding: str):
    rows, cols = x.shape
    dt = as_format(fmt).dtype
    one = (1, 1)
    return (
        x.new_empty((rows, cols), dtype=dt),
        x.new_empty((cols, rows), dtype=dt),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
    )


@_operator("tensor_pair_scaled(Tensor x, Tensor scale, str fmt, str rounding) -> (Tensor, Tensor, Tensor, Tensor)")
def tensor_pair_scaled(x: Tensor, scale: Tensor, fmt: str, rounding: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-tensor cast of 2-D ``x`` with a given (delayed-scaling) ``scale``, one pass that also
    takes the amax: ``(codes [R, C], codes transposed [C, R], scale_inv [1, 1], amax [1, 1])``
    (:func:`~.triton_kernels.quantize_tensor_dual` with ``scale``; ``amax`` is this tensor's
    own, for the caller to fold into its pending amax)."""
    from . import triton_kernels as tk

    a, b = tk.quantize_tensor_dual(x, fmt, rounding, scale=scale)
    return a.data, b.data, a.scale_inv, a.amax


@tensor_pair_scaled.register_fake
def _tensor_pair_scaled_fake(x: Tensor, scale: Tensor, fmt: str, rounding: str):
    return _tensor_pair_fake(x, fmt, rounding)


@_operator("tensor_scaled(Tensor x, Tensor scale, str fmt, str rounding) -> (Tensor, Tensor, Tensor)")
def tensor_scaled(x: Tensor, scale: Tensor, fmt: str, rounding: str) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`tensor_pair_scaled` without the transposed copy: ``(codes, scale_inv [1, 1],
    amax [1, 1])`` (:func:`~.triton_kernels.quantize_tensor` with ``scale``)."""
    from . import triton_kernels as tk

    q = tk.quantize_tensor(x, fmt, rounding, scale=scale)
    return q.data, q.scale_inv, q.amax.view(1, 1)


@tensor_scaled.register_fake
def _tensor_scaled_fake(x: Tensor, scale: Tensor, fmt: str, rounding: str):
    one = (1, 1)
    return (
        x.new_empty(x.shape, dtype=as_format(fmt).dtype),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
    )


def _check_group_rounding(rounding: str) -> None:
    """The 1xN operators return FP32 ``scale_inv`` only (no E8M0 scales)."""
    if ScaleRounding(rounding) not in (ScaleRounding.FP32, ScaleRounding.POW2):
        raise ValueError(
            f"the group quantiser operators take fp32 or pow2 scales (FP32 scale_inv), got {rounding!r}; "
            "E8M0 (mxfp8) operands are quantised by the reference quantisers under torch.compile"
        )


@_operator("group_rows(Tensor x, str fmt, int group, str rounding) -> (Tensor, Tensor)")
def group_rows(x: Tensor, fmt: str, group: int, rounding: str) -> Tuple[Tensor, Tensor]:
    """Groups of ``group`` along each row of 2-D ``x``: ``(codes [R, C], scale_inv [R, C/group])``
    (:func:`~.triton_kernels.quantize_rows`; fp32 or pow2 scales)."""
    from . import triton_kernels as tk

    _check_group_rounding(rounding)
    q = tk.quantize_rows(x, fmt, group, rounding)
    return q.data, q.scale_inv


@group_rows.register_fake
def _group_rows_fake(x: Tensor, fmt: str, group: int, rounding: str):
    rows, cols = x.shape
    return (
        x.new_empty((rows, cols), dtype=as_format(fmt).dtype),
        scale_grid(rows, -(-cols // group), torch.float32, x.device),
    )


@_operator("group_cols_t(Tensor x, str fmt, int group, str rounding) -> (Tensor, Tensor)")
def group_cols_t(x: Tensor, fmt: str, group: int, rounding: str) -> Tuple[Tensor, Tensor]:
    """Groups of ``group`` down each column of 2-D ``x``, written for ``x.T``: ``(codes [C, R],
    scale_inv [C, R/group])`` — the wgrad operand (:func:`~.triton_kernels.quantize_cols_t`)."""
    from . import triton_kernels as tk

    _check_group_rounding(rounding)
    q = tk.quantize_cols_t(x, fmt, group, rounding)
    return q.data, q.scale_inv


@group_cols_t.register_fake
def _group_cols_t_fake(x: Tensor, fmt: str, group: int, rounding: str):
    rows, cols = x.shape
    return (
        x.new_empty((cols, rows), dtype=as_format(fmt).dtype),
        scale_grid(cols, -(-rows // group), torch.float32, x.device),
    )


@_operator("blocks128(Tensor x, str fmt, str rounding) -> (Tensor, Tensor)")
def blocks128(x: Tensor, fmt: str, rounding: str) -> Tuple[Tensor, Tensor]:
    """128x128 blocks of 2-D ``x`` (blockwise weights): ``(codes [R, C], scale_inv [R/128, C/128])``
    (:func:`~.triton_kernels.quantize_blocks128`)."""
    from . import triton_kernels as tk

    q = tk.quantize_blocks128(x, fmt, rounding)  # refuses E8M0 itself
    return q.data, q.scale_inv


@blocks128.register_fake
def _blocks128_fake(x: Tensor, fmt: str, rounding: str):
    rows, cols = x.shape
    return (
        x.new_empty((rows, cols), dtype=as_format(fmt).dtype),
        x.new_empty((-(-rows // 128), -(-cols // 128)), dtype=torch.float32),
    )


@_operator(
    "blockwise_mm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, bool weight_blocks, "
    "ScalarType out_dtype) -> Tensor"
)
def blockwise_mm(
    a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor, weight_blocks: bool, out_dtype: torch.dtype
) -> Tensor:
    """:func:`~.scaled_mm.blockwise_matmul`: ``A · Bᵀ`` ``[M, N]`` from 1x128-scaled ``a`` ``[M, K]`` and
    ``b`` ``[N, K]`` with 128x128 blocks (``weight_blocks``) or 1x128 groups."""
    from .scaled_mm import blockwise_matmul

    return blockwise_matmul(a, a_scale_inv, b, b_scale_inv, weight_blocks, out_dtype)


@blockwise_mm.register_fake
def _blockwise_mm_fake(a, a_scale_inv, b, b_scale_inv, weight_blocks, out_dtype):
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
