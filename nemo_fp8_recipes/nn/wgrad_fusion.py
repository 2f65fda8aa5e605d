"""Fused wgrad accumulation: where the FP8 wgrad GEMM may add into ``weight.grad`` itself, and
where that would change results (:attr:`~nemo_fp8_recipes.nn.Float8Linear.fuse_wgrad_accumulation`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

__all__ = ["check_wgrad_fusion", "wgrad_target"]


def wgrad_target(mod: nn.Module, ctx) -> Optional[torch.Tensor]:
    """The gradient a fused wgrad accumulates into (:attr:`Float8Linear.fuse_wgrad_accumulation`):
    ``weight.grad`` when it exists and this backward (a ``.backward()``, not ``autograd.grad`` or
    a ``backward(inputs=...)`` that leaves the weight out; no ``create_graph``) is going to
    accumulate into it; else None (the wgrad is returned to autograd as usual)."""
    w = mod.weight
    g = w.grad
    if g is None or not ctx.needs_input_grad[1] or torch.is_grad_enabled():
        return None
    node = mod.grad_accumulator()
    try:
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:  # autograd.grad(): gradients are returned, not accumulated
        return None
    check_wgrad_fusion(mod)
    if (
        g.dtype != torch.float32
        or g.shape != w.shape
        or not g.is_contiguous()
        or g.device != w.device
        or g.data_ptr() % 16
    ):
        raise RuntimeError(
            f"{mod.fqn or 'Float8Linear'}: fuse_wgrad_accumulation accumulates into a contiguous, 16-byte aligned "
            f"float32 weight.grad of shape {tuple(w.shape)} on {w.device}; got {g.dtype} {tuple(g.shape)} on "
            f"{g.device}{'' if g.is_contiguous() else ' (not contiguous)'}"
            f"{' at a misaligned address' if g.data_ptr() % 16 else ''} — keep FP32 master weights and their own "
            "gradient tensors, or turn it off (set_wgrad_accumulation_fusion(model, False))"
        )
    return g


def check_wgrad_fusion(mod: nn.Module) -> None:
    """Refuse fused wgrad accumulation where it would change results: weights that are not FP32
    (gradients must accumulate in FP32) and gradient hooks on the weight, which run in — or
    receive what goes to — AccumulateGrad, which the fused GEMM bypasses."""
    w, name = mod.weight, mod.fqn or "Float8Linear"
    if w.dtype != torch.float32:
        raise RuntimeError(
            f"{name}: fuse_wgrad_accumulation accumulates FP32 gradients, and this weight is "
            f"{w.dtype}; keep FP32 master weights, or turn it off (set_wgrad_accumulation_fusion"
            "(model, False))"
        )
    hooks = [
        kind
        for kind, attr in (
            ("register_hook", "_backward_hooks"),
            ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"),
        )
        if getattr(w, attr, None)
    ]
    if hooks:
        raise RuntimeError(
            f"{name}: fuse_wgrad_accumulation adds the weight gradient inside the GEMM, so the "
            f"weight's {' and '.join(hooks)} hooks would never see it; turn it off for this module "
            "(set_wgrad_accumulation_fusion(module, False))"
        )
