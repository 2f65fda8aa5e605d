"""The compiled FP8 linear's test model and steps, shared by the torch.compile tests
(nn/test_compile_traceable.py, nn/test_graph_weight_cache.py): a SwiGLU block of two FP8
linears, identical pairs of it (one to compile, one to run eagerly), inputs with outlier channels
and one forward/backward."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_fp8_recipes import check_supported
from nemo_fp8_recipes.nn import Float8Linear, convert_model, set_delayed_scaling_update
from nemo_fp8_recipes.recipes import get_recipe

TRACED = ["tensorwise", "blockwise", "mxfp8"]
D, H, T = 256, 384, 192  # model dim, SwiGLU hidden dim, tokens per step (2 x 96)


class SwiGLU(nn.Module):
    """``w2(silu(a) * b)`` with ``[a, b] = w1(x)``: two linears, both converted to FP8."""

    def __init__(self, d: int = D, h: int = H, bias: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 2 * h, bias=bias)
        self.w2 = nn.Linear(h, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def make_pair(recipe: str, emulate=True, device="cpu", seed=0, **overrides):
    """Two identical converted models (one to compile, one to run eagerly); ``overrides``: recipe
    fields (``get_recipe(recipe, **overrides)``)."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        m = SwiGLU().to(device)
        convert_model(m, get_recipe(recipe, **overrides), emulate=emulate)
        models.append(m)
    return models


def fp8_linears(model):
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def batch(step: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2, T // 2, D, generator=g)
    x[..., ::37] *= 20.0  # outlier channels, so per-tensor and per-group scales differ
    dy = torch.randn(2, T // 2, D, generator=g) * 1e-2
    return x.to(device, dtype), dy.to(device)


def fwd_bwd(fn, model, x, dy):
    """One fwd+bwd: ``(y, dx, [param grads])``; gradients are set to None first."""
    for p in model.parameters():
        p.grad = None
    xx = x.clone().requires_grad_(True)
    y = fn(xx)
    y.backward(dy.to(y.dtype))
    return y.detach(), xx.grad, [p.grad.clone() for p in model.parameters()]


def gpu_recipe(name):
    rec = get_recipe(name)
    ok, why = check_supported(rec, "cuda")
    return rec, (None if ok else why)


def gpu_pair(rec, emulate):
    """Two identical CUDA SwiGLU blocks (d = 1024, h = 1536) converted with ``rec``."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = SwiGLU(d=1024, h=1536).cuda()
        convert_model(m, rec, emulate=emulate)
        set_delayed_scaling_update(m, "step")  # (delayed: the trainer's schedule, traced)
        models.append(m)
    return models
