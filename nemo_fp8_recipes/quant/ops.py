"""The fused per-tensor Triton quantisers as PyTorch custom operators, for compiled graphs.

Under ``torch.compile`` the FP8 linear's traced path (:class:`~nemo_fp8_recipes.nn.Float8Linear`)
must quantise with something the compiler can put in its graph. Two choices, picked by
:func:`~nemo_fp8_recipes.quant.dispatch.compiled_quantizer` (``NEMO_FP8_COMPILED_QUANT``):

``triton`` (default on CUDA)
    these operators: :func:`~.triton_kernels.quantize_tensor_dual` as one opaque node — the
    atomic amax pass and the one-read cast that writes the codes and their transpose. The
    compiler schedules them like any extern kernel (no graph break) but cannot fuse them with
    neighbouring element-wise ops.
``inductor``
    the reference quantisers (plain torch ops), which Inductor generates and fuses itself.

Both give the same codes and scales bit for bit (the kernels are checked against the reference).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..recipes import Format

__all__ = ["tensor_pair"]


@torch.library.custom_op("nemo_fp8_recipes::tensor_pair", mutates_args=())
def tensor_pair(x: Tensor, fmt: str, rounding: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-tensor current scaling of 2-D ``x``: ``(codes [R, C], codes transposed [C, R],
    scale_inv [1, 1], amax [1, 1])``."""
    from . import triton_kernels as tk

    a, b = tk.quantize_tensor_dual(x, fmt, rounding)
    return a.data, b.data, a.scale_inv, a.amax


@tensor_pair.register_fake
def _tensor_pair_fake(x: Tensor, fmt: str, rounding: str):
    rows, cols = x.shape
    dt = Format(fmt).dtype
    one = (1, 1)
    return (x.new_empty((rows, cols), dtype=dt), x.new_empty((cols, rows), dtype=dt),
            x.new_empty(one, dtype=torch.float32), x.new_empty(one, dtype=torch.float32))
