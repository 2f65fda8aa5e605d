"""Per-tensor quantisers: the atomic-max amax pass and the cast whose programs compute the
scale from that amax on the device (:func:`quantize_tensor`), the codes with their transpose
from one read (:func:`quantize_tensor_dual`, also with the SwiGLU computed in the kernels), the
given-scale cast of delayed scaling that folds the tensor's amax into an accumulator in the same
pass, and the delayed-scaling history update in one kernel (:func:`delayed_commit`). The
fused RMSNorm takes its output's amax with this family's :func:`fold_amax_block`."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import Format, ScaleRounding
from ..launch import launch as _launch
from ..reference import QuantizedTensor, accumulate_amax, as_format
from . import swiglu
from .common import (
    HAVE_TRITON,
    LAUNCH,
    SCALE_MODE_ID,
    cdiv,
    hw_cvt,
    require_triton,
    tl,
    triton,
)

if HAVE_TRITON:
    from .primitives import (
        abs_bits,
        abs_bits16,
        bf16_to_f32,
        f32_bits_of_bits16,
        fp8_cast,
        round_to_fp8,
        scale_from_amax,
        trans_codes,
    )

    @triton.jit
    def fold_amax_bits(amax_bits_ptr, m, CHECK: tl.constexpr = False):
        # m: max of |x|'s IEEE bits (sign cleared), which order like the values, with every NaN
        # pattern above +Inf; a NaN is written as the positive quiet NaN 0x7FC00000.
        # CHECK: read the accumulator first and issue the atomic only if m is larger (the value
        # read may be stale, but only ever too small: the accumulator only grows), so that most
        # of the thousands of programs folding into one address skip their atomic
        v = tl.where(m > 0x7F800000, 0x7FC00000, m)
        if CHECK:
            tl.atomic_max(amax_bits_ptr, v, mask=v > tl.load(amax_bits_ptr))
        else:
            tl.atomic_max(amax_bits_ptr, v)

    @triton.jit
    def fold_amax_block(amax_bits_ptr, x, CHECK: tl.constexpr = False):
        """Fold max|x| of a 1-D block into ``amax_bits_ptr`` (int32) with one atomic max: a
        single integer reduction gives the amax and NaN at once."""
        fold_amax_bits(amax_bits_ptr, tl.max(abs_bits(x), axis=0), CHECK)

    @triton.jit
    def fold_amax_2d(amax_bits_ptr, x, CHECK: tl.constexpr = False):
        """:func:`fold_amax_block` for a 2-D tile (rows, then across rows: no layout conversion)."""
        fold_amax_bits(amax_bits_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0), CHECK)

    @triton.jit
    def amax_atomic_kernel(
        x_ptr,
        g_ptr,
        amax_bits_ptr,
        act_ptr,
        N,
        BLOCK: tl.constexpr,
        GATED: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        IN_BF16: tl.constexpr,
        WRITE_ACT: tl.constexpr,
        AMAX_CHECK: tl.constexpr = False,
    ):
        # WRITE_ACT (with GATED): also store the activation silu(g) * x (its values are already
        # rounded to the store's dtype, so the store is exact) for the cast pass to read
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = swiglu.load_act(x_ptr, g_ptr, offs, m, GATED, LIBDEVICE, IN_BF16)
        if WRITE_ACT:
            tl.store(act_ptr + offs, x.to(act_ptr.dtype.element_ty), mask=m)
        fold_amax_block(amax_bits_ptr, x, AMAX_CHECK)

    @triton.jit
    def tensor_scale(amax_ptr, s_ptr, si_ptr, first, HAS_SCALE: tl.constexpr, MODE: tl.constexpr, FMAX: tl.constexpr):
        """The per-tensor scale every program uses: the given (delayed) one, or the reference's
        rule applied to the amax the first pass left in memory; ``first`` program writes
        ``scale_inv``."""
        if HAS_SCALE:
            s = tl.load(s_ptr)
            si = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
        else:
            s, si, _e8 = scale_from_amax(tl.load(amax_ptr), FMAX, 0, 0, MODE)
        tl.store(si_ptr, si, mask=first)
        return s

    @triton.jit
    def cast_kernel(
        x_ptr,
        amax_ptr,
        s_ptr,
        si_ptr,
        q_ptr,
        N,
        BLOCK: tl.constexpr,
        FMAX: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        MODE: tl.constexpr,
        AMAX_OUT: tl.constexpr,
        AMAX_CHECK: tl.constexpr = False,
    ):
        # AMAX_OUT (with a given scale only: delayed scaling): also fold this block's amax into
        # amax_ptr (int32 bits), so the history gets the tensor's amax without a second read
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        s = tensor_scale(amax_ptr, s_ptr, si_ptr, pid == 0, HAS_SCALE, MODE, FMAX)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if AMAX_OUT:
            fold_amax_block(amax_ptr, x, AMAX_CHECK)
        q = round_to_fp8(x * s, FMAX, IS_E4M3, HW_CVT, NO_INF=not HAS_SCALE)  # a given scale can overflow
        tl.store(q_ptr + offs, fp8_cast(q, q_ptr.dtype.element_ty, IS_E4M3, NO_INF=not HAS_SCALE), mask=m)

    @triton.jit
    def cast_dual_kernel(
        x_ptr,
        g_ptr,
        amax_ptr,
        s_ptr,
        si_ptr,
        q_ptr,
        qt_ptr,
        R,
        C,
        stride_x,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        FMAX: tl.constexpr,
        IS_E4M3: tl.constexpr,
        HW_CVT: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        MODE: tl.constexpr,
        AMAX_OUT: tl.constexpr,
        GATED: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        IN_BF16: tl.constexpr,
        BF16_TILE: tl.constexpr = False,
        AMAX_CHECK: tl.constexpr = False,
    ):
        # per-tensor scale: the codes and their transpose (the codes moved as bytes) from one read
        # (GATED: of the SwiGLU halves g (g_ptr, same strides) and x, the activation never stored)
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        s = tensor_scale(amax_ptr, s_ptr, si_ptr, (pr == 0) & (pc == 0), HAS_SCALE, MODE, FMAX)
        if BF16_TILE:  # (a BF16 x, not GATED, AMAX_OUT) the amax on the 16-bit magnitudes, as loaded
            xb = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            fold_amax_bits(amax_ptr, f32_bits_of_bits16(tl.max(tl.max(abs_bits16(xb), axis=1), axis=0)), AMAX_CHECK)
            x = bf16_to_f32(xb, not HW_CVT)
        else:
            x = swiglu.load_act(x_ptr, g_ptr, rows[:, None] * stride_x + cols[None, :], m, GATED, LIBDEVICE, IN_BF16)
            if AMAX_OUT:  # first, so the FP32 tile need not stay live through the transpose
                fold_amax_2d(amax_ptr, x, AMAX_CHECK)
        # NO_INF stays False here even for current scaling, and the grid stays 2-D (see round_to_fp8)
        codes = fp8_cast(round_to_fp8(x * s, FMAX, IS_E4M3, HW_CVT), q_ptr.dtype.element_ty, IS_E4M3)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], codes, mask=m)
        mt = (cols[:, None] < C) & (rows[None, :] < R)
        tl.store(qt_ptr + cols[:, None] * R + rows[None, :], trans_codes(codes), mask=mt)

    @triton.jit
    def delayed_commit_kernel(
        hist_ptr,
        scale_ptr,
        pending_ptr,
        flag_ptr,
        L,
        flag_after,
        BLOCK_L: tl.constexpr,
        FMAX: tl.constexpr,
        MARGIN_DIV: tl.constexpr,
        MOST_RECENT: tl.constexpr,
    ):
        # One program: append the pending amax to the history (if flagged), amax over the
        # history, s = fmax / amax / 2^margin, keep the old scale unless amax is finite and > 0;
        # then pending = 0 and flag = flag_after (nn/scaling.advance_delayed_scaling's rule).
        offs = tl.arange(0, BLOCK_L)
        m = offs < L
        f = tl.load(flag_ptr) > 0
        p = tl.load(pending_ptr)
        h = tl.load(hist_ptr + offs, mask=m, other=0.0)
        prev = tl.load(hist_ptr + offs - 1, mask=m & (offs > 0), other=0.0)
        new = tl.where(f, tl.where(offs == 0, p, prev), h)
        if MOST_RECENT:
            amax = tl.sum(tl.where(offs == 0, new, 0.0), axis=0)
        else:  # amaxes are >= 0: the padding (0) never wins; NaN anywhere makes the max NaN
            amax = tl.max(tl.where(m, new, 0.0), axis=0)
            amax = tl.where(tl.max(((new != new) & m).to(tl.int32), axis=0) > 0, float("nan"), amax)
        sc, _si, _e8 = scale_from_amax(amax, FMAX, 0, 0, 0, MARGIN_DIV)  # the FP32 rule, with the margin
        ok = (amax == amax) & (amax != float("inf")) & (amax > 0) & f
        old = tl.load(scale_ptr)
        tl.debug_barrier()  # every thread has read the old history before any entry is shifted
        tl.store(hist_ptr + offs, new, mask=m)
        tl.store(scale_ptr, tl.where(ok, sc, old))
        tl.store(pending_ptr, 0.0)
        tl.store(flag_ptr, flag_after)


def tensor_amax(
    x2: torch.Tensor,
    acc: Optional[torch.Tensor] = None,
    gate: Optional[torch.Tensor] = None,
    act_out: Optional[torch.Tensor] = None,
    amax_check: Optional[bool] = None,
) -> torch.Tensor:
    """Per-tensor amax max-accumulated into ``acc`` (a ``[1, 1]`` FP32 tensor; default a fresh
    zero), which is returned: one atomic-max pass over a contiguous ``x2`` (NaN if any element
    is NaN), or a PyTorch reduction of a strided one. ``gate``: the amax of ``silu(gate) * x2``
    (both contiguous, :func:`~.swiglu.check_gate`), which the same pass also writes into ``act_out`` (a
    contiguous tensor like ``x2``) when given. ``amax_check``: the caller's launch entry's
    setting (default: ``LAUNCH["tensor"]``'s, current scaling's amax pass)."""
    if acc is None:
        acc = torch.zeros((1, 1), dtype=torch.float32, device=x2.device)  # a base tensor, not a view
    n = x2.numel()
    if n and x2.is_contiguous():
        block, warps = LAUNCH["tensor"]["block"], LAUNCH["tensor"]["num_warps"]
        # (operands a launch does not use are passed as None rather than as aliases of x2)
        _launch(
            amax_atomic_kernel,
            (cdiv(n, block),),
            x2,
            gate,
            acc.view(torch.int32),
            act_out,
            n,
            BLOCK=block,
            num_warps=warps,
            WRITE_ACT=act_out is not None,
            AMAX_CHECK=bool(LAUNCH["tensor"]["amax_check"] if amax_check is None else amax_check),
            **swiglu.gate_args(x2, gate),
        )
    elif n:
        if gate is not None:
            raise ValueError("a gated amax needs contiguous inputs")
        accumulate_amax(acc, x2.float().abs().amax())
    return acc


def tensor_scale_args(amax: torch.Tensor, fmt: Format, rounding: ScaleRounding, scale):
    """``(scale operand, scale_inv buffer, HAS_SCALE, MODE)`` for the per-tensor cast kernels."""
    if SCALE_MODE_ID[rounding] >= 2:
        raise ValueError(f"per-tensor scaling takes fp32 or pow2 scales, not {rounding.value}")
    si = torch.empty((1, 1), dtype=torch.float32, device=amax.device)
    if scale is None:
        return amax, si, False, SCALE_MODE_ID[rounding]
    return scale.float().reshape(1, 1).contiguous(), si, True, SCALE_MODE_ID[rounding]


def scale_inv_of_empty(amax: torch.Tensor, fmt: Format, rounding: ScaleRounding, scale) -> torch.Tensor:
    """``scale_inv`` where no cast kernel runs (an empty tensor): the reference rule, on the device."""
    from ..reference import amax_to_scale

    s = amax_to_scale(amax, fmt, rounding) if scale is None else scale.float().reshape(1, 1)
    return 1.0 / s


def amax_accumulator(amax_out, device) -> torch.Tensor:
    """The ``[1, 1]`` FP32 buffer a given-scale cast folds the tensor's amax into: ``amax_out``
    (max-accumulated over the IEEE bits as int32, so it must hold a value without the sign bit:
    zero, a previously accumulated amax, or a positive NaN — as these kernels write; a
    sign-bit NaN would lose against any amax) or a fresh zero."""
    if amax_out is None:
        return torch.zeros((1, 1), dtype=torch.float32, device=device)
    if amax_out.dtype != torch.float32 or amax_out.numel() != 1 or not amax_out.is_contiguous():
        raise ValueError(
            f"amax_out must be a contiguous one-element float32 tensor, got "
            f"{amax_out.dtype} of shape {tuple(amax_out.shape)}"
        )
    if amax_out.device != device:
        raise ValueError(f"amax_out is on {amax_out.device}, the input on {device}")
    return amax_out.view(1, 1)


def per_tensor_amax(x2: torch.Tensor, scale, amax_out, gate=None, act_out=None):
    """``(amax buffer, AMAX_OUT)``: current scaling runs the amax pass first (writing the gated
    activation into ``act_out`` if given); a given scale lets the cast pass itself fold the amax
    into :func:`amax_accumulator`'s buffer."""
    if scale is None:
        if amax_out is not None:
            raise ValueError(
                "amax_out collects the amax of a cast with a given (delayed) scale; "
                "current scaling (scale=None) returns its amax in q.amax"
            )
        return tensor_amax(x2, gate=gate, act_out=act_out), False
    return amax_accumulator(amax_out, x2.device), True


def quantize_tensor(
    x: torch.Tensor, fmt, rounding=ScaleRounding.FP32, scale=None, amax_out: Optional[torch.Tensor] = None
) -> QuantizedTensor:
    """Per-tensor. Current scaling (``scale=None``): an atomic-max amax pass, then one cast pass
    whose programs derive the scale from that amax on the device — two kernels and a 4-byte
    memset, no host synchronisation, no small PyTorch ops in between. With a given ``scale``
    (delayed scaling): one pass that casts and folds this tensor's amax (for the history) into
    ``amax_out`` by an atomic max (or into a fresh buffer); ``q.amax`` is that buffer."""
    require_triton(x)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = x2.numel()
    amax, amax_in_cast = per_tensor_amax(x2, scale, amax_out)
    q = torch.empty(x2.shape, dtype=fmt.dtype, device=x.device)
    if not n:
        return QuantizedTensor(
            data=q, scale_inv=scale_inv_of_empty(amax, fmt, rounding, scale), block=None, fmt=fmt, amax=amax
        )
    s_arg, si, has_scale, mode = tensor_scale_args(amax, fmt, rounding, scale)
    cfg = LAUNCH["tensor" if scale is None else "tensor_delayed"]
    block, warps = cfg["block"], cfg["num_warps"]
    _launch(
        cast_kernel,
        (cdiv(n, block),),
        x2,
        amax.view(torch.int32) if amax_in_cast else amax,
        s_arg,
        si,
        q,
        n,
        BLOCK=block,
        FMAX=fmt.max,
        IS_E4M3=fmt is Format.E4M3,
        HW_CVT=hw_cvt(x),
        HAS_SCALE=has_scale,
        MODE=mode,
        AMAX_OUT=amax_in_cast,
        AMAX_CHECK=bool(cfg["amax_check"]) and amax_in_cast,
        num_warps=warps,
    )
    return QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax)


def quantize_tensor_dual(
    x: torch.Tensor,
    fmt,
    rounding=ScaleRounding.FP32,
    scale=None,
    amax_out: Optional[torch.Tensor] = None,
    gate: Optional[torch.Tensor] = None,
    amax: Optional[torch.Tensor] = None,
):
    """Per-tensor codes and their transpose (contiguous) from one read of ``x``: ``(q, q_t)``
    with the same scale — after the amax pass (current scaling, the scale computed on the device
    by the cast kernel), or in a single pass with a given ``scale`` that also folds the amax
    into ``amax_out`` as :func:`quantize_tensor` does.

    ``gate`` (SwiGLU → quantise): quantise ``F.silu(gate) * x`` — the activation is computed in
    the kernels from its two halves (bit-identical to PyTorch's, :func:`~.swiglu.swiglu_fwd`): with a given
    scale inside the one-pass cast, never written; with current scaling once, in the amax pass,
    which writes it for the cast to read. The same codes as quantising the materialised
    activation, without PyTorch's separate SiLU and multiply kernels and their intermediate.

    ``amax`` (current scaling): ``x``'s amax, already taken by its producer (a ``[1, 1]`` FP32
    tensor, e.g. :func:`~.norm.rmsnorm_forward`'s): the amax pass is skipped, the cast pass runs alone."""
    require_triton(x, gate)
    fmt, rounding = as_format(fmt), ScaleRounding(rounding)
    if amax is not None and (scale is not None or gate is not None or amax_out is not None):
        raise ValueError("a precomputed amax is for current scaling of x itself (no scale, gate or amax_out)")
    if amax is not None and (amax.dtype != torch.float32 or amax.numel() != 1 or amax.device != x.device):
        raise ValueError(
            f"amax must be a one-element float32 tensor on {x.device}, got {amax.dtype} "
            f"of shape {tuple(amax.shape)} on {amax.device}"
        )
    swiglu.check_gate(x, gate)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    R, C = x2.shape
    n = x2.numel()
    # current scaling reads its operand twice (amax, then cast): with a gate, the amax pass
    # computes the activation once and writes it, and the cast reads it back — 10 bytes per
    # element, as many as evaluating SiLU in both passes, which is ALU-bound and slower
    # (docs/internals/kernels.md)
    act = torch.empty_like(x2) if gate is not None and scale is None else None
    if amax is not None:
        amax, amax_in_cast = amax.reshape(1, 1), False
    else:
        amax, amax_in_cast = per_tensor_amax(x2, scale, amax_out, gate, act_out=act)
    if act is not None:
        x2, gate = act, None
    q = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    qt = torch.empty((C, R), dtype=fmt.dtype, device=x.device)
    if n:
        s_arg, si, has_scale, mode = tensor_scale_args(amax, fmt, rounding, scale)
        cfg = LAUNCH["tensor_dual_delayed" if amax_in_cast else "tensor_dual"]
        if amax_in_cast and not cfg["fold_amax"]:  # the amax pass into the same accumulator
            tensor_amax(x2, amax, gate=gate, amax_check=bool(cfg["amax_check"]))
            amax_in_cast = False
        grid = (cdiv(R, cfg["block_r"]), cdiv(C, cfg["block_c"]))
        _launch(
            cast_dual_kernel,
            grid,
            x2,
            gate,
            amax.view(torch.int32) if amax_in_cast else amax,
            s_arg,
            si,
            q,
            qt,
            R,
            C,
            x2.stride(0),
            BLOCK_R=cfg["block_r"],
            BLOCK_C=cfg["block_c"],
            FMAX=fmt.max,
            num_warps=cfg["num_warps"],
            IS_E4M3=fmt is Format.E4M3,
            HW_CVT=hw_cvt(x),
            HAS_SCALE=has_scale,
            MODE=mode,
            AMAX_OUT=amax_in_cast,
            **swiglu.gate_args(x2, gate),
            BF16_TILE=(bool(cfg.get("bf16_tile")) and amax_in_cast and gate is None and x2.dtype == torch.bfloat16),
            # (cfg is tensor_dual, without the option, for current scaling)
            AMAX_CHECK=bool(cfg.get("amax_check")) and amax_in_cast,
        )
    else:
        si = scale_inv_of_empty(amax, fmt, rounding, scale)
    a = QuantizedTensor(data=q, scale_inv=si, block=None, fmt=fmt, amax=amax)
    b = QuantizedTensor(data=qt, scale_inv=si, block=None, fmt=fmt, amax=amax)
    return a, b


def delayed_commit(
    history: torch.Tensor,
    scale: torch.Tensor,
    pending: torch.Tensor,
    flag: torch.Tensor,
    fmt,
    amax_compute_algo: str = "max",
    margin: int = 0,
    flag_after: float = 0.0,
) -> None:
    """One operand's delayed-scaling update in one kernel, in place: where ``flag`` is set, append
    ``pending`` to ``history`` (``[L]``, newest first), take its max (or the most recent entry),
    ``scale = fmax / amax / 2**margin`` (FP32, correctly rounded; kept unless that amax is finite
    and positive); then ``pending = 0``, ``flag = flag_after``. The same numbers as
    :func:`nemo_fp8_recipes.nn.scaling.advance_delayed_scaling` with FP32 scales (the delayed
    recipe's), which takes about fifteen PyTorch kernels for it."""
    require_triton()
    fmt = as_format(fmt)
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax_compute_algo {amax_compute_algo!r}; valid: max, most_recent")
    for name, t in (("scale", scale), ("pending", pending), ("flag", flag)):
        if t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a one-element float32 tensor")
    if history.dim() != 1 or history.stride(0) != 1 or history.dtype != torch.float32:
        raise ValueError("history must be a contiguous 1-D float32 tensor")
    L = history.numel()
    _launch(
        delayed_commit_kernel,
        (1,),
        history,
        scale,
        pending,
        flag,
        L,
        float(flag_after),
        BLOCK_L=triton.next_power_of_2(L),
        FMAX=fmt.max,
        MARGIN_DIV=float(2**margin),
        MOST_RECENT=amax_compute_algo == "most_recent",
        num_warps=4,
    )
