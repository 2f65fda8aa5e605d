"""The fused SwiGLU ``F.silu(g) * u``: its evaluation in a kernel, bit-identical to PyTorch's
(:func:`swiglu_fwd`), which the per-tensor quantisers apply to what they load (:func:`load_act`,
:func:`~.tensor.quantize_tensor_dual`'s ``gate``); the checks of a gate operand
(:func:`gate_fusable`); and the backward in one pass (:func:`swiglu_backward`)."""

from __future__ import annotations

from typing import Optional

import torch

from ..launch import launch as _launch
from .common import (
    HAVE_TRITON,
    cdiv,
    interpreting,
    libdevice,
    require_triton,
    tl,
    triton,
)

if HAVE_TRITON:
    from .primitives import rne_bf16

    @triton.jit
    def exp_f32(x, LIBDEVICE: tl.constexpr):
        # libdevice's expf on a GPU (what PyTorch's CUDA kernels call; tl.exp is the approximate
        # ex2.approx there); the interpreter has no libdevice and evaluates tl.exp exactly
        if LIBDEVICE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def swiglu_fwd(g, u, LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr):
        """``silu(g) * u`` as PyTorch evaluates ``F.silu(g) * u`` in the inputs' dtype (FP32
        math, IEEE division, each op's result rounded to that dtype): bit-identical values."""
        s = tl.math.div_rn(g, 1.0 + exp_f32(-g, LIBDEVICE))
        if IN_BF16:
            s = rne_bf16(s)
        a = s * u
        if IN_BF16:
            a = rne_bf16(a)
        return a

    @triton.jit
    def load_act(x_ptr, g_ptr, offs, m, GATED: tl.constexpr, LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr):
        """The operand at ``offs`` as FP32: ``x`` itself, or (GATED) ``silu(g) * x``."""
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            x = swiglu_fwd(g, x, LIBDEVICE, IN_BF16)
        return x

    @triton.jit
    def swiglu_bwd_kernel(
        dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr
    ):
        # autograd of F.silu(g) * u in one pass: du = dy * silu(g), dg = silu'(g) * (dy * u),
        # each product rounded to the inputs' dtype where PyTorch's separate kernels round it
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        d = 1.0 + exp_f32(-g, LIBDEVICE)  # one exp for SiLU and its derivative
        s = tl.math.div_rn(g, d)
        sig = tl.math.div_rn(tl.zeros_like(d) + 1.0, d)
        ds = dy * u
        if IN_BF16:
            s = rne_bf16(s)
            ds = rne_bf16(ds)
        dg = ds * sig * (1.0 + g * (1.0 - sig))
        du = dy * s
        if IN_BF16:  # rounded here: the interpreter's BF16 store truncates
            dg = rne_bf16(dg)
            du = rne_bf16(du)
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=m)


def act_args(x: torch.Tensor) -> dict:
    """The constexprs of the in-kernel SwiGLU math on ``x``'s dtype and device."""
    return {"LIBDEVICE": x.is_cuda and not interpreting(), "IN_BF16": x.dtype == torch.bfloat16}


def gate_args(x: torch.Tensor, gate: Optional[torch.Tensor]) -> dict:
    """The SwiGLU-prologue constexprs of the per-tensor kernels."""
    return {"GATED": gate is not None, **act_args(x)}


def gate_fusable(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernels can compute ``F.silu(gate) * x`` themselves (:func:`check_gate`)."""
    try:
        check_gate(x, gate)
    except ValueError:
        return False
    return True


def check_gate(x: torch.Tensor, gate: Optional[torch.Tensor]) -> None:
    """``gate`` (the SwiGLU gate half ``g`` of ``silu(g) * x``) must match ``x`` exactly: same
    shape, dtype (BF16 or FP32), device, and both contiguous."""
    if gate is None:
        return
    if gate.shape != x.shape or gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(
            f"gate must match the input: got {tuple(gate.shape)} {gate.dtype} on {gate.device} "
            f"for {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the fused SwiGLU takes BF16 or FP32 inputs, not {x.dtype}")
    if not (x.is_contiguous() and gate.is_contiguous()):
        raise ValueError("the fused SwiGLU needs contiguous inputs")


def swiglu_backward(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """``(dg, du)``, the gradients of ``F.silu(g) * u`` for the output gradient ``dy``, in one
    pass (PyTorch's autograd takes three kernels and two intermediate tensors). ``du`` is
    bit-identical to autograd's; ``dg`` can differ by rounding where the compiler contracts the
    derivative's multiply-add differently (tests: within one unit in the last place)."""
    require_triton(dy, g, u)
    check_gate(u, g)
    if dy.shape != u.shape or dy.dtype != u.dtype or not dy.is_contiguous():
        raise ValueError("dy must be contiguous with the shape and dtype of u")
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = u.numel()
    if n:
        block = 4096
        _launch(swiglu_bwd_kernel, (cdiv(n, block),), dy, g, u, dg, du, n, BLOCK=block, num_warps=8, **act_args(u))
    return dg, du
