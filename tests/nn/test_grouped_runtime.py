"""Grouped FP8 experts at run time, against one Float8Linear per expert holding that expert's
weight and fed its tokens (emulated, CPU): delayed scaling's ``step`` schedule (the trainer's)
with its whole-model functions (sync, discard, pinned scales, snapshot / restore), and telemetry —
per expert the same statistics as the linear's, aggregated per module with the worst expert."""

import copy

import pytest
import torch
import torch.nn as nn

from nemo_fp8_recipes.nn import (
    Float8GroupedExperts,
    Float8Linear,
    Float8LinearConfig,
    collect_telemetry,
    discard_delayed_scaling,
    fp8_state_snapshot,
    pinned_scales,
    restore_fp8_state,
    set_delayed_scaling_update,
    set_telemetry,
    sync_delayed_scaling,
)
from nemo_fp8_recipes.recipes import get_recipe

E, K, N = 4, 128, 256
SIZES = (40, 0, 24, 64)  # rows per expert: expert 1 gets no token


def weights(seed=0):
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) * 0.02
    return w * torch.tensor([1.0, 3.0, 0.1, 10.0])[:, None, None]  # experts of different magnitudes


def pair(recipe, w, **settings):
    """(the grouped module in an nn.Sequential, the per-expert Float8Linears in an nn.ModuleList),
    same weights, same config."""
    r = get_recipe(recipe, amax_history_len=4) if recipe == "delayed" else get_recipe(recipe)
    cfg = Float8LinearConfig(recipe=r, emulate=True, **settings)
    grouped = Float8GroupedExperts({"weight": nn.Parameter(w.clone())}, cfg)
    grouped.fqn = "experts"
    linears = nn.ModuleList(
        Float8Linear.from_parameters(nn.Parameter(w[e].clone()), None, cfg, fqn=f"experts.{e}") for e in range(E)
    )
    for m in linears:
        m.role = "mlp"
    return nn.Sequential(grouped), linears


def micro_batch(grouped_model, linears, seed):
    """One forward/backward of both on the same rows and output gradient: (y, dx) of each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), K, generator=g) * torch.rand(1, K, generator=g) * 4
    dy = torch.randn(sum(SIZES), N, generator=g) * 1e-3
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya = grouped_model[0].grouped_mm("weight", xa, SIZES)
    ya.backward(dy)
    parts = [lin(xe) for lin, xe in zip(linears, xb.split(SIZES)) if xe.shape[0]]
    yb = torch.cat(parts)
    yb.backward(dy)
    return (ya, xa.grad), (yb, xb.grad)


def assert_same_state(grouped, linears):
    """The grouped module's delayed-scaling state of expert e is linear e's."""
    for e, lin in enumerate(linears):
        assert torch.equal(grouped.fp8_scale[0, e], lin.fp8_scale), e
        assert torch.equal(grouped.fp8_amax_history[0, e], lin.fp8_amax_history), e


def test_delayed_step_schedule_is_the_per_expert_linears():
    """Two micro-batches per step, scales fixed within the step, sync_delayed_scaling once per
    step: outputs, gradients, scales and amax histories equal the per-expert linears' bit for bit."""
    gm, linears = pair("delayed", weights(), scaling_update="step")
    grouped = gm[0]
    for step in range(3):
        for micro in range(2):
            (ya, dxa), (yb, dxb) = micro_batch(gm, linears, seed=10 * step + micro)
            assert torch.equal(ya, yb) and torch.equal(dxa, dxb), (step, micro)
        for e, lin in enumerate(linears):  # (an expert without tokens: a zero gradient, a linear never called)
            want = lin.weight.grad if SIZES[e] else torch.zeros(N, K)
            assert torch.equal(grouped.weight.grad[e], want), (step, e)
        assert_same_state(grouped, linears)  # (nothing advanced within the step)
        assert sync_delayed_scaling(gm) == 1 and sync_delayed_scaling(linears) == E
        assert_same_state(grouped, linears)
        grouped.weight.grad = None
        for lin in linears:
            lin.weight.grad = None
    assert (grouped.fp8_amax_history[0, [0, 2, 3], :, :3] > 0).all()  # one entry per step
    assert not grouped.fp8_amax_history[0, 1].any() and torch.equal(grouped.fp8_scale[0, 1], torch.ones(3))


def test_discard_snapshot_restore_and_pinned_scales_cover_grouped_experts():
    """The whole-model delayed-scaling functions the trainer calls reach the grouped experts:
    a skipped step's amaxes are discarded, an evaluation's are put back, an Inf pins a scale
    (and telemetry says so), the schedule can change."""
    gm, _ = pair("delayed", weights(), scaling_update="step")
    grouped = gm[0]
    x = torch.randn(sum(SIZES), K)
    grouped.grouped_mm("weight", x, SIZES)
    assert grouped.fp8_pending.any()
    snap = fp8_state_snapshot(gm)
    assert set(snap) == {"0"} and "fp8_amax_pending" in snap["0"] and "weight" not in snap["0"]
    assert discard_delayed_scaling(gm) == 1
    assert not grouped.fp8_pending.any() and not grouped.fp8_amax_pending.any()
    restore_fp8_state(gm, snap)
    assert torch.equal(grouped.fp8_amax_pending, snap["0"]["fp8_amax_pending"])
    assert pinned_scales(gm) == {}
    x[3, 5] = float("inf")  # expert 0's input
    grouped.grouped_mm("weight", x, SIZES)
    sync_delayed_scaling(gm)
    assert pinned_scales(gm) == {"0": ["input"]}
    tel = collect_telemetry(gm)
    assert tel["fp8/experts/input/scale_pinned"] == 1.0 and tel["fp8/experts/weight/scale_pinned"] == 0.0
    assert set_delayed_scaling_update(gm, "lazy") == 1 and grouped.config.scaling_update == "lazy"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "delayed"])
def test_telemetry_per_expert_is_the_linears_and_aggregates_with_the_worst_expert(recipe):
    gm, linears = pair(recipe, weights(), telemetry=True)
    grouped = gm[0]
    micro_batch(gm, linears, seed=1)
    per = copy.deepcopy(grouped._telemetry)  # (kept to pop it twice: per expert, then aggregated)
    by_expert = grouped.pop_telemetry(per_expert=True)
    assert set(by_expert) == {"weight"} and set(by_expert["weight"]) == {0, 2, 3}  # experts that ran
    for e in (0, 2, 3):
        want = linears[e].pop_telemetry()
        assert set(want) == {"input", "weight", "grad_output"}
        assert by_expert["weight"][e] == want, (recipe, e)  # the same statistics, value for value
    grouped._telemetry = per
    agg = grouped.pop_telemetry()
    assert grouped.pop_telemetry() == {}  # popped
    for op, stats in agg.items():
        experts = [by_expert["weight"][e][op] for e in (0, 2, 3)]
        assert stats["amax"] == max(s["amax"] for s in experts)
        assert stats["underflow_frac_worst"] == max(s["underflow_frac"] for s in experts)
        assert stats["saturated_frac_worst"] == max(s["saturated_frac"] for s in experts)
        assert stats["sqnr_db_worst"] == min(s["sqnr_db"] for s in experts)
        # one quantisation per expert and operand here: the mean is the experts' mean
        assert stats["sqnr_db"] == pytest.approx(sum(s["sqnr_db"] for s in experts) / 3, rel=1e-6)
    micro_batch(gm, linears, seed=2)
    set_telemetry(gm, False)  # drops what was not collected
    assert grouped.config.telemetry is False
    assert not [k for k in collect_telemetry(gm) if not k.endswith("scale_pinned")]


def test_the_worst_expert_stands_out_of_the_mean():
    """An outlier in one expert's weight sets its per-tensor scale: the rest of that expert's
    weight underflows. The mean over experts dilutes it; the worst-expert statistics and the
    per-expert table show it."""
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    w[2, 0, 0] = 1e4
    gm, _ = pair("tensorwise", w, telemetry=True)
    grouped = gm[0]
    grouped.fqn, grouped.role = "layers.0.mlp.experts", "mlp"
    grouped.grouped_mm("weight", torch.randn(sum(SIZES), K), SIZES)
    per = copy.deepcopy(grouped._telemetry)
    tel = collect_telemetry(gm)
    worst, mean = tel["fp8/experts/weight/underflow_frac_worst"], tel["fp8/experts/weight/underflow_frac"]
    assert worst > 0.5 and mean < worst / 2, (worst, mean)
    assert tel["fp8/experts/weight/sqnr_db_worst"] < tel["fp8/experts/weight/sqnr_db"] - 10
    grouped._telemetry = per
    by_expert = grouped.pop_telemetry(per_expert=True)["weight"]
    assert max(by_expert, key=lambda e: by_expert[e]["weight"]["underflow_frac"]) == 2
    assert by_expert[0]["weight"]["underflow_frac"] < 0.01
