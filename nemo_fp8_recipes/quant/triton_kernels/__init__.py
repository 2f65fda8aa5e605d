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
(RMSNorm); :mod:`._primitives` holds the device functions they share (FP8 rounding, scale rule,
amax bits, tile order) and :mod:`._common` the host side (the optional Triton import, the checks
before a launch, the launch-configuration table :data:`LAUNCH`). The rounding rules are
described in :mod:`._primitives`.

Callers reach everything through this package (``triton_kernels.<name>``), which is also where
tests replace a function; the names outside ``__all__`` are internal but used by
``quant/dispatch``, the tests (which compile the kernels ahead of time and check the helpers)
and the benchmarks.
"""

from __future__ import annotations

from ..launch import launch as _launch
from ._common import (
    HAVE_TRITON,
    INT32_MAX,
    LAUNCH,
    _MODE,
    _cdiv,
    _cvt_capable,
    _e8m0_view,
    _group_r,
    _hw_cvt,
    _interpreting,
    _require_triton,
    _top_mant,
    launch_config,
)
from .blocks import quantize_blocks128
from .groups import quantize_cols_t, quantize_rows
from .norm import RMSNORM_MAX_D, _row_warps, rmsnorm_backward, rmsnorm_forward
from .swiglu import _act_args, _check_gate, _gate_args, gate_fusable, swiglu_backward
from .tensor import (
    _amax_accumulator,
    _per_tensor_amax,
    _scale_inv_of_empty,
    _tensor_amax,
    _tensor_scale_args,
    delayed_commit,
    quantize_tensor,
    quantize_tensor_dual,
)

__all__ = [
    "HAVE_TRITON",
    "quantize_rows",
    "quantize_cols_t",
    "quantize_blocks128",
    "quantize_tensor",
    "quantize_tensor_dual",
    "delayed_commit",
    "swiglu_backward",
    "rmsnorm_forward",
    "rmsnorm_backward",
    "RMSNORM_MAX_D",
]

# The names above outside ``__all__``, referenced once so that each import counts as used.
_INTERNAL = (_launch, INT32_MAX, LAUNCH, _MODE, _cdiv, _cvt_capable, _e8m0_view, _group_r, _hw_cvt, _interpreting,
             _require_triton, _top_mant, launch_config, _row_warps, _act_args, _check_gate, _gate_args, gate_fusable,
             _amax_accumulator, _per_tensor_amax, _scale_inv_of_empty, _tensor_amax, _tensor_scale_args)

if HAVE_TRITON:  # the kernels and device functions, defined only where Triton is installed
    from ._primitives import (
        _abs_bits,
        _abs_bits16,
        _amax_from_bits,
        _bf16_to_f32,
        _f32_bits_of_bits16,
        _fp8_cast,
        _group_amax,
        _rne_bf16,
        _round_fp8,
        _scale_from_amax,
        _tile_ids,
        _trans_codes,
    )
    from .blocks import _quant_block_kernel
    from .groups import _quant_cols_t_kernel, _quant_last_groups, _quant_rows_kernel
    from .norm import _rmsnorm_bwd_kernel, _rmsnorm_fwd_kernel
    from .swiglu import _exp, _load_act, _swiglu, _swiglu_bwd_kernel
    from .tensor import (
        _amax_atomic_kernel,
        _cast_dual_kernel,
        _cast_kernel,
        _delayed_commit_kernel,
        _fold_amax,
        _fold_amax_2d,
        _fold_amax_bits,
        _tensor_scale,
    )

    _INTERNAL += (_abs_bits, _abs_bits16, _amax_from_bits, _bf16_to_f32, _f32_bits_of_bits16, _fp8_cast, _group_amax,
                  _rne_bf16, _round_fp8, _scale_from_amax, _tile_ids, _trans_codes, _quant_block_kernel,
                  _quant_cols_t_kernel, _quant_last_groups, _quant_rows_kernel,
                  _rmsnorm_bwd_kernel, _rmsnorm_fwd_kernel, _exp, _load_act, _swiglu, _swiglu_bwd_kernel,
                  _amax_atomic_kernel, _cast_dual_kernel, _cast_kernel, _delayed_commit_kernel, _fold_amax,
                  _fold_amax_2d, _fold_amax_bits, _tensor_scale)
