"""Fused Triton quantisers, bit-identical to the reference quantisers in ``reference.py``.

One read of the source, one write of the FP8 codes and the scales, no intermediate tensors:

* :func:`quantize_rows`     — groups of ``GROUP`` (32 or 128) consecutive elements along each row
  (1x128 activations/gradients, 1x32 MXFP8), scales in FP32 (``fp32``/``pow2``) or E8M0. The
  1xN quantisers write their scale grids outer-dim major
  (:func:`~nemo_fp8_recipes.quant.reference.scale_grid`).
* :func:`quantize_cols_t`   — groups of ``GROUP`` consecutive elements down each column, written
  *transposed* (``[cols, rows]``): the wgrad copy, fused with the transpose.
* :func:`quantize_blocks128` — 128x128 weight blocks (``transposed=True``: also the codes of the
  transpose from the same pass, a weight's dgrad copy).
* :func:`quantize_tensor`   — per-tensor: an atomic-max amax kernel, then a cast kernel whose
  programs compute the scale from that amax on the device (no host sync, no small PyTorch ops
  in between); with a given scale (delayed scaling, from the amax history) one kernel casts with
  it and folds the tensor's amax into an accumulator (the pending amax) in the same pass.
* :func:`quantize_tensor_dual` — per-tensor codes and their transpose from one read (the
  transpose moves the 1-byte codes), optionally of ``F.silu(gate) * x`` computed in the kernels.
* :func:`delayed_commit`    — one delayed-scaling history update (append, max, new scale).
* :func:`swiglu_backward`   — the gradients of ``F.silu(g) * u`` in one pass.
* :func:`rmsnorm_forward` / :func:`rmsnorm_backward` — the fused RMSNorm (one pass each way),
  whose forward can also take its output's per-tensor amax or write its 1xN row codes (RMSNorm →
  quantise, :mod:`nemo_fp8_recipes.nn.norm`).

One module per kernel family: :mod:`.tensor` (per-tensor amax, casts and pairs, the delayed
commit), :mod:`.swiglu` (the SwiGLU evaluated in the per-tensor kernels, and its backward),
:mod:`.groups` (1xN rows, transposed columns), :mod:`.blocks` (128x128) and :mod:`.norm`
(RMSNorm); :mod:`.primitives` holds the device functions they share (FP8 rounding, scale rule,
amax bits, tile order) and :mod:`.common` the host side (the optional Triton import, the checks
before a launch, the launch-configuration table :data:`LAUNCH`). The rounding rules are
described in :mod:`.primitives`.

Callers reach the quantisers, the launch table and the Triton checks through this package
(``triton_kernels.<name>``), which is also where tests replace a function; the kernels and
device functions themselves are reached in their modules (``triton_kernels.tensor.cast_kernel``):
by the tests, which compile them ahead of time and check the helpers, and by the benchmarks.
"""

from __future__ import annotations

from .blocks import quantize_blocks128
from .common import HAVE_TRITON, INT32_MAX, LAUNCH, interpreting, launch_config
from .groups import quantize_cols_t, quantize_rows
from .norm import RMSNORM_MAX_D, rmsnorm_backward, rmsnorm_forward
from .swiglu import gate_fusable, swiglu_backward
from .tensor import delayed_commit, quantize_tensor, quantize_tensor_dual

__all__ = [
    "HAVE_TRITON",
    "INT32_MAX",
    "LAUNCH",
    "RMSNORM_MAX_D",
    "delayed_commit",
    "gate_fusable",
    "interpreting",
    "launch_config",
    "quantize_blocks128",
    "quantize_cols_t",
    "quantize_rows",
    "quantize_tensor",
    "quantize_tensor_dual",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "swiglu_backward",
]
