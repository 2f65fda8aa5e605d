"""Grouped FP8 expert GEMMs (emulated) vs a test-written float64 reference: each expert's
tokens and weight quantised on their own per the recipe's contract (docs/recipes.md), for every
recipe and every GEMM, on inputs with structured outliers."""

import numpy as np
import pytest
import torch
from helpers.fp8_ref import contract_reference, scale_for, structured

from nemo_fp8_recipes.nn import Float8GroupedExperts, Float8LinearConfig
from nemo_fp8_recipes.recipes import get_recipe

K, N = 256, 384
SIZES = (160, 0, 96, 33)  # rows per expert: one expert gets no token, one a short block
FP8_RECIPES = ["delayed", "tensorwise", "blockwise", "mxfp8"]


def operands(seed=0):
    E, T = len(SIZES), sum(SIZES)
    x = structured(T, K, seed=seed)
    x = x * torch.tensor([1e-3, 1.0, 30.0, 1e-2])[torch.arange(K) // 32 % 4][None, :]
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(E, N, K, generator=g) * 0.02
    w[:, ::17] *= 30.0
    w = w * torch.tensor([1.0, 5.0, 1e-2, 300.0])[:E, None, None]  # experts of very different magnitudes
    dy = structured(T, N, seed=seed + 2) * 1e-4
    return x, w, dy


def make(name, w, **kw):
    cfg = Float8LinearConfig(recipe=get_recipe(name, **kw), emulate=True)
    return Float8GroupedExperts({"weight": torch.nn.Parameter(w.clone())}, cfg)


def run(mod, x, dy):
    mod.weight.grad = None
    xx = x.clone().requires_grad_(True)
    y = mod.grouped_mm("weight", xx, SIZES)
    y.backward(dy)
    return y.detach().double().numpy(), xx.grad.double().numpy(), mod.weight.grad.double().numpy()


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def check_against_reference(name, got, x, w, dy, scales):
    y, dx, dw = got
    start = 0
    for e, m in enumerate(SIZES):
        if m == 0:
            assert not dw[e].any(), f"{name}: expert {e} got no token but a weight gradient"
            continue
        sl = slice(start, start + m)
        ref = contract_reference(name, x[sl], w[e], dy[sl], scales[e] if scales else None)
        for gemm, g, r in zip(("fprop", "dgrad", "wgrad"), (y[sl], dx[sl], dw[e]), ref):
            assert rel(g, r) < 1e-6, f"{name} expert {e} {gemm}: emulation differs from the contract reference"
        start += m


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_grouped_fprop_dgrad_wgrad_match_per_expert_contract_reference(name):
    x, w, dy = operands()
    mod = make(name, w)
    got = run(mod, x, dy)
    scales = [{"x": 1.0, "w": 1.0, "g": 1.0}] * len(SIZES) if name == "delayed" else None  # no history yet
    check_against_reference(name, got, x, w, dy, scales)
    used = sum(1 for m in SIZES if m)
    assert mod.gemm_counts == {"fprop": used, "dgrad": used, "wgrad": used}
    # per-expert scaling is what makes it exact: one scale over all experts' rows would differ
    if name == "tensorwise":
        sl = slice(SIZES[0] + SIZES[1], SIZES[0] + SIZES[1] + SIZES[2])
        one_scale = {"w": scale_for(float(w.abs().max()), "e4m3", "fp32")}
        assert rel(got[0][sl], contract_reference(name, x[sl], w[2], dy[sl], one_scale)[0]) > 1e-3


def test_grouped_delayed_uses_each_experts_history():
    x, w, dy = operands(seed=4)
    mod = make("delayed", w, amax_history_len=4)
    x2, _, dy2 = operands(seed=9)
    run(mod, x, dy)  # step 1 (scale 1), records each expert's amaxes
    got = run(mod, x2, dy2)  # step 2 uses them
    scales, start = [], 0
    for e, m in enumerate(SIZES):
        sl = slice(start, start + m)
        start += m
        if m == 0:
            scales.append(None)
            continue
        scales.append(
            {
                "x": scale_for(float(x[sl].abs().max()), "e4m3", "fp32"),
                "w": scale_for(float(w[e].abs().max()), "e4m3", "fp32"),
                "g": scale_for(float(dy[sl].abs().max()), "e5m2", "fp32"),
            }
        )
    check_against_reference("delayed", got, x2, w, dy2, scales)
    # an expert that received no token keeps scale 1 (nothing recorded for it)
    assert torch.equal(mod.fp8_scale[0, 1], torch.ones(3))


def test_grouped_sizes_are_checked():
    x, w, _ = operands()
    mod = make("tensorwise", w)
    with pytest.raises(ValueError, match="sizes"):
        mod.grouped_mm("weight", x, (1, 2, 3, 4))
