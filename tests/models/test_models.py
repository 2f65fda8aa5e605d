"""Models: published sizes (on the meta device), Llama 3 components, the DeepSeek-style MoE and
the module names the precision policy relies on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_fp8_recipes.models import (
    ModelConfig,
    MoE,
    RMSNorm,
    Transformer,
    build_model,
    list_model_configs,
    load_model_config,
)
from nemo_fp8_recipes.models.llama import (
    Attention,
    FeedForward,
    GroupedExperts,
    apply_rope,
    fuse_projections_state_dict,
    precompute_rope,
)
from nemo_fp8_recipes.nn import Float8GroupedExperts, Float8Linear, audit, convert_model
from nemo_fp8_recipes.policy import PrecisionPolicy, Role
from nemo_fp8_recipes.recipes import get_recipe

SMALL = dict(dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=256, vocab_size=512, max_seq_len=128)
SMALL_MOE = dict(SMALL, num_experts=4, moe_top_k=2, moe_ffn_dim=128, num_shared_experts=1, first_k_dense=1)


@pytest.mark.parametrize(
    "name, published",
    [("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9), ("llama31_405b", 405.9e9)],
)
def test_published_parameter_counts_on_meta_device(name, published):
    cfg = load_model_config(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    n = model.num_params()
    assert abs(n - published) / published < 0.01, f"{name}: {n / 1e9:.3f}B vs {published / 1e9}B"
    assert n == cfg.num_params()  # the analytic count the MFU estimate uses agrees


def test_published_shapes():
    c = load_model_config("llama3_8b")
    assert (c.num_layers, c.dim, c.ffn_dim, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        32,
        4096,
        14336,
        32,
        8,
        128256,
    )
    c = load_model_config("llama3_70b")
    assert (c.num_layers, c.dim, c.ffn_dim, c.num_heads, c.num_kv_heads) == (80, 8192, 28672, 64, 8)
    c = load_model_config("llama31_405b")
    assert (c.num_layers, c.dim, c.ffn_dim, c.num_heads, c.num_kv_heads) == (126, 16384, 53248, 128, 8)
    assert c.rope_theta == 500000.0 and c.rope_scaling_factor == 8.0
    small = load_model_config("llama3_150m")
    assert 125e6 <= small.num_params() <= 350e6


def test_every_packaged_config_builds_on_meta():
    for name in list_model_configs():
        model = build_model(name, device="meta")
        assert isinstance(model, Transformer)


def test_layer_override_keeps_layer_shapes():
    model = build_model("llama31_405b", device="meta", num_layers=2, vocab_size=512)
    assert len(model.layers) == 2
    attn = model.layers[1].attention
    assert attn.wq.weight.shape == (16384, 16384)
    assert attn.wk.weight.shape == (8 * 128, 16384)
    assert model.layers[0].feed_forward.w1.weight.shape == (53248, 16384)


def test_unknown_names_and_bad_shapes_are_explained():
    with pytest.raises(ValueError, match="llama3_8b"):
        load_model_config("llama3_9b")
    with pytest.raises(ValueError, match="num_layers"):
        load_model_config("llama3_tiny", num_layer=3)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=512, dim=100, num_layers=1, num_heads=3, num_kv_heads=1, ffn_dim=64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=512, dim=128, num_layers=1, num_heads=4, num_kv_heads=3, ffn_dim=64)
    with pytest.raises(ValueError, match="moe_top_k"):
        ModelConfig(
            arch="moe",
            vocab_size=512,
            dim=128,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            ffn_dim=64,
            num_experts=2,
            moe_top_k=3,
            moe_ffn_dim=64,
        )


def test_module_names_match_the_policy_roles():
    model = build_model(ModelConfig(arch="moe", **SMALL_MOE))
    names = dict(model.named_modules())
    policy = PrecisionPolicy()
    expect = {
        "tok_embeddings": Role.EMBEDDING,
        "layers.0.attention_norm": Role.NORM,
        "layers.0.attention.wq": Role.ATTENTION_PROJECTION,
        "layers.0.attention.wk": Role.ATTENTION_PROJECTION,
        "layers.0.attention.wv": Role.ATTENTION_PROJECTION,
        "layers.0.attention.wo": Role.ATTENTION_PROJECTION,
        "layers.0.ffn_norm": Role.NORM,
        "layers.0.feed_forward.w1": Role.MLP,
        "layers.0.feed_forward.w2": Role.MLP,
        "layers.0.feed_forward.w3": Role.MLP,
        "layers.1.feed_forward.router": Role.ROUTER,
        "layers.1.feed_forward.experts": Role.MLP,
        "layers.1.feed_forward.shared_expert.w3": Role.MLP,
        "norm": Role.NORM,
        "output": Role.OUTPUT,
    }
    for fqn, role in expect.items():
        assert fqn in names, fqn
        assert policy.decide(fqn, names[fqn]).role == role, fqn
    assert (
        "grouped experts"
        in policy.decide("layers.1.feed_forward.experts", names["layers.1.feed_forward.experts"]).reason
    )
    assert isinstance(names["tok_embeddings"], nn.Embedding)
    assert isinstance(names["output"], nn.Linear) and names["output"].weight is not names["tok_embeddings"].weight
    for leaf in ("wq", "wk", "wv", "wo"):
        assert names[f"layers.0.attention.{leaf}"].bias is None


def test_forward_shapes_dtypes_and_initial_loss():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**SMALL))
    x = torch.randint(0, 259, (2, 32))
    out = model(x, x)
    assert out.logits.shape == (2, 32, 512) and out.logits.dtype == torch.float32
    assert abs(out.ce_loss.item() - math.log(512)) < 0.3  # near-uniform at init
    assert out.aux_loss.item() == 0.0 and torch.equal(out.loss, out.ce_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, x)
    assert out.logits.dtype == torch.float32  # FP32 logits for the loss under autocast too
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_attention_is_causal_gqa_through_sdpa():
    torch.manual_seed(0)
    cfg = ModelConfig(**SMALL)
    attn = Attention(cfg)
    x = torch.randn(2, 16, cfg.dim)
    rope = precompute_rope(cfg)[:16]
    with torch.profiler.profile() as prof:
        y = attn(x, rope)
    assert any("scaled_dot_product" in e.key for e in prof.key_averages())
    # reference: K/V repeated per query head, explicit causal softmax
    b, t, h, kv, hd = 2, 16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = apply_rope(attn.wq(x).view(b, t, h, hd), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, t, kv, hd), rope).transpose(1, 2).repeat_interleave(h // kv, 1)
    v = attn.wv(x).view(b, t, kv, hd).transpose(1, 2).repeat_interleave(h // kv, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.wo((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * hd))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # causality: changing a later token leaves earlier outputs alone
    x2 = x.clone()
    x2[:, 10] += 1.0
    torch.testing.assert_close(attn(x2, rope)[:, :10], y[:, :10])


def test_rope_theta_and_relative_positions():
    cfg = ModelConfig(**SMALL)
    table = precompute_rope(cfg)
    hd = cfg.head_dim
    i = torch.arange(hd // 2, dtype=torch.float64)
    expected = 1.0 / (500000.0 ** (2 * i / hd))
    angle1 = torch.atan2(table[1, :, 1].double(), table[1, :, 0].double())
    torch.testing.assert_close(angle1, expected, rtol=1e-5, atol=1e-6)
    # <R_m q, R_n k> depends only on m - n
    q = torch.randn(1, 1, 1, hd).expand(1, 64, 1, hd)
    k = torch.randn(1, 1, 1, hd).expand(1, 64, 1, hd)
    rq, rk = apply_rope(q, table[:64]), apply_rope(k, table[:64])
    d1 = (rq[0, 10, 0] * rk[0, 7, 0]).sum()
    d2 = (rq[0, 40, 0] * rk[0, 37, 0]).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))


def test_llama31_rope_scaling_changes_only_low_frequencies():
    base = load_model_config("llama31_405b", max_seq_len=4, rope_scaling_factor=None)
    scaled = load_model_config("llama31_405b", max_seq_len=4)
    a = torch.atan2(precompute_rope(base)[1, :, 1], precompute_rope(base)[1, :, 0])
    b = torch.atan2(precompute_rope(scaled)[1, :, 1], precompute_rope(scaled)[1, :, 0])
    assert torch.allclose(a[:8], b[:8])  # high frequencies untouched
    torch.testing.assert_close(b[-1], a[-1] / 8.0, rtol=1e-4, atol=0)  # lowest divided by factor


def test_rmsnorm_computes_in_fp32():
    norm = RMSNorm(64)
    x = (torch.randn(4, 64) * 300).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    x32 = x.float()
    ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y, ref.bfloat16())


def test_router_runs_in_fp32_under_autocast():
    torch.manual_seed(0)
    moe = MoE(ModelConfig(arch="moe", **SMALL_MOE))
    x = torch.randn(10, SMALL["dim"]).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, idx, scores = moe.route(x)
    assert w.dtype == scores.dtype == torch.float32
    ref_scores = (
        (x.float() @ moe.router.weight.t()).sigmoid()
        if moe.score_func == "sigmoid"
        else (x.float() @ moe.router.weight.t()).softmax(-1)
    )
    torch.testing.assert_close(scores, ref_scores, rtol=1e-6, atol=1e-6)
    assert idx.shape == (10, 2) and torch.allclose(w.sum(-1), torch.ones(10))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_matches_a_per_token_reference(score):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="moe", router_score=score, **SMALL_MOE)
    moe = MoE(cfg)
    x = torch.randn(2, 5, cfg.dim)
    y, aux = moe(x)
    xf = x.reshape(-1, cfg.dim)
    w, idx, _ = moe.route(xf)
    ex = moe.experts
    f = cfg.moe_ffn_dim

    def expert(e, v):  # SwiGLU of expert e from its slices of the 3-D weights: w2(silu(w1 v) * w3 v)
        w1, w3, w2 = ex.gate_up_proj[e, :f], ex.gate_up_proj[e, f:], ex.down_proj[e]
        return w2 @ (F.silu(w1 @ v) * (w3 @ v))

    ref = torch.stack(
        [
            sum(w[t, s] * expert(int(idx[t, s]), xf[t]) for s in range(cfg.moe_top_k)) + moe.shared_expert(xf[t])
            for t in range(xf.shape[0])
        ]
    ).view_as(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert aux.item() == 0.0  # aux_loss_coef = 0 in SMALL_MOE


def test_moe_first_layers_dense_and_aux_loss():
    cfg = ModelConfig(arch="moe", **dict(SMALL_MOE, num_layers=3, aux_loss_coef=0.01))
    model = build_model(cfg)
    assert isinstance(model.layers[0].feed_forward, FeedForward)
    assert all(isinstance(model.layers[i].feed_forward, MoE) for i in (1, 2))
    x = torch.randint(0, 259, (2, 16))
    out = model(x, x)
    assert out.aux_loss.item() > 0  # two MoE layers, each ~1 when balanced
    torch.testing.assert_close(out.loss, out.ce_loss + 0.01 * out.aux_loss)
    out.loss.backward()
    assert model.layers[1].feed_forward.router.weight.grad is not None
    model.eval()
    assert model(x, x).aux_loss.item() == 0.0


@pytest.mark.parametrize("arch", ["llama", "moe"])
def test_fused_projections_compute_the_separate_model_function(arch):
    """``model.fused_projections``: one ``wqkv`` and one ``w13`` per block (the shared expert too;
    routed experts are grouped, gate and up stacked, either way) holding the separate weights
    stacked in order; the state-dict conversion goes
    both ways, loads strictly, and the three models agree (FP32, CPU) on logits and gradients."""
    shape = SMALL_MOE if arch == "moe" else SMALL
    cfg = ModelConfig(arch=arch, **shape)
    cfg_f = cfg.replace(fused_projections=True)
    torch.manual_seed(0)
    sep = build_model(cfg)
    fused = build_model(cfg_f)
    names = dict(fused.named_modules())
    assert "layers.0.attention.wqkv" in names and "layers.0.attention.wq" not in names
    assert "layers.0.feed_forward.w13" in names and "layers.0.feed_forward.w1" not in names
    if arch == "moe":
        assert "layers.1.feed_forward.shared_expert.w13" in names  # routed experts: gate_up_proj either way
    assert sum(p.numel() for p in fused.parameters()) == cfg.num_params() == cfg_f.num_params()
    state = fuse_projections_state_dict(sep.state_dict(), cfg, fused=True)
    fused.load_state_dict(state, strict=True)
    wq, wk, wv = (sep.state_dict()[f"layers.0.attention.{n}.weight"] for n in ("wq", "wk", "wv"))
    assert torch.equal(state["layers.0.attention.wqkv.weight"], torch.cat([wq, wk, wv]))
    w1, w3 = (sep.state_dict()[f"layers.0.feed_forward.{n}.weight"] for n in ("w1", "w3"))
    assert torch.equal(state["layers.0.feed_forward.w13.weight"], torch.cat([w1, w3]))
    back = build_model(cfg)
    back.load_state_dict(fuse_projections_state_dict(fused.state_dict(), cfg, fused=False), strict=True)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    outs = [m(x, x) for m in (sep, fused, back)]
    for o in outs[1:]:
        torch.testing.assert_close(o.logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    for m, o in zip((sep, fused), outs):
        o.loss.backward()
    g = fused.layers[0].attention.wqkv.weight.grad
    torch.testing.assert_close(g[: wq.shape[0]], sep.layers[0].attention.wq.weight.grad, rtol=1e-4, atol=1e-6)
    g = fused.layers[0].feed_forward.w13.weight.grad
    torch.testing.assert_close(g[w1.shape[0] :], sep.layers[0].feed_forward.w3.weight.grad, rtol=1e-4, atol=1e-6)


def test_fused_projections_state_dict_names_a_missing_partner():
    cfg = ModelConfig(**SMALL)
    state = build_model(cfg).state_dict()
    del state["layers.1.attention.wv.weight"]
    with pytest.raises(KeyError, match=r"layers\.1\.attention\.wv\.weight: needed with"):
        fuse_projections_state_dict(state, cfg, fused=True)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensorwise"])
def test_fused_projections_run_in_fp8_and_keep_block_scaling(recipe):
    """Converted, ``wqkv`` and ``w13`` are FP8 attention / MLP projections (strict audit). Block
    and group recipes quantise the same blocks fused or not (every projection width here is a
    multiple of 128), so the loss matches the separate model's; per-tensor scaling shares one
    scale over the stacked weight, so it may differ (within FP8 error)."""
    shape = dict(SMALL, dim=256, num_heads=2, num_kv_heads=1, ffn_dim=384)
    cfg = ModelConfig(**shape)
    torch.manual_seed(0)
    sep = build_model(cfg)
    fused = build_model(cfg.replace(fused_projections=True))
    fused.load_state_dict(fuse_projections_state_dict(sep.state_dict(), cfg, fused=True))
    for m in (sep, fused):
        convert_model(m, get_recipe(recipe), PrecisionPolicy())
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    loss_s, loss_f = sep(x, x).loss, fused(x, x).loss
    loss_f.backward()
    if recipe == "tensorwise":
        torch.testing.assert_close(loss_f, loss_s, rtol=2e-3, atol=0)
    else:
        torch.testing.assert_close(loss_f, loss_s, rtol=1e-6, atol=0)
    report = audit(fused, strict=True)
    rows = {r.name: r for r in report.rows}
    for name, role in (("layers.0.attention.wqkv", "attention_projection"), ("layers.0.feed_forward.w13", "mlp")):
        assert isinstance(dict(fused.named_modules())[name], Float8Linear)
        assert rows[name].role == role and rows[name].precision == "fp8"
        assert rows[name].fp8_gemms == {"fprop": 1, "dgrad": 1, "wgrad": 1}


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("preset", ["moe_tiny", "moe_360m"])
def test_moe_presets_convert_to_grouped_fp8_experts_with_router_and_head_out_of_fp8(recipe, preset):
    """Both MoE presets (cut to their dense first layer and one MoE layer, at full width): every
    expert GEMM in FP8 under every recipe (moe_360m's widths are multiples of 128), the router FP32."""
    cfg = load_model_config(preset, num_layers=2)
    model = build_model(cfg)
    params = {n: p for n, p in model.named_parameters()}
    convert_model(model, get_recipe(recipe))
    assert dict(model.named_parameters()) == params  # the same Parameter objects, the same names
    moe = model.layers[1].feed_forward
    assert type(moe.router) is nn.Linear  # FP32 gate, not converted
    assert isinstance(moe.experts, Float8GroupedExperts)  # one module, every expert GEMM in FP8
    assert isinstance(moe.shared_expert.w2, Float8Linear)
    assert type(model.output) is nn.Linear
    x = torch.randint(0, 259, (2, 32))
    hit = []  # the experts the router gave tokens to
    moe.experts.register_forward_pre_hook(lambda m, args: hit.append(torch.unique(args[1]).numel()))
    model(x, x).loss.backward()
    report = audit(model, strict=True)
    rows = {r.name: r for r in report.rows}
    router = rows["layers.1.feed_forward.router"]
    assert router.precision == "fp32" and router.fp8_gemms == {}
    assert router.hp_gemms["fprop"] == 1  # ran, in high precision
    experts = rows["layers.1.feed_forward.experts"]
    assert (experts.role, experts.precision, experts.hp_gemms) == ("mlp", "fp8", {})
    n = 2 * hit[0]  # gate_up_proj and down_proj of each expert that got tokens
    assert len(hit) == 1 and experts.fp8_gemms == {"fprop": n, "dgrad": n, "wgrad": n}
    assert "MoE grouped experts (GroupedExperts" in experts.reason
    assert not report.unplaced


def test_grouped_experts_match_the_moe_without_conversion_and_in_fp8():
    """The same weights through GroupedExperts and through its FP8 form: close (FP8 rounding),
    and under the bf16 recipe the module is left as it is."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="moe", **SMALL_MOE)
    hp = build_model(cfg)
    fp8 = build_model(cfg)
    fp8.load_state_dict(hp.state_dict())
    convert_model(fp8, get_recipe("blockwise"))
    x = torch.randint(0, 259, (2, 32))
    with torch.no_grad():
        a, b = hp(x, x), fp8(x, x)
    assert 0 < float((a.logits - b.logits).norm() / a.logits.norm()) < 0.05
    bf16 = build_model(cfg)
    convert_model(bf16, get_recipe("bf16"))
    assert type(bf16.layers[1].feed_forward.experts) is GroupedExperts


def test_grouped_experts_built_alone_are_initialised_as_linears():
    """A GroupedExperts (or an MoE) built outside a Transformer holds usable weights: each expert's
    as nn.Linear would initialise it, U(-1/sqrt(in), 1/sqrt(in))."""
    torch.manual_seed(0)
    ex = GroupedExperts(4, 128, 64)
    for w, fan_in in ((ex.gate_up_proj, 128), (ex.down_proj, 64)):
        bound = 1 / math.sqrt(fan_in)
        assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
        assert abs(float(w.detach().std()) * math.sqrt(3) / bound - 1) < 0.02  # a uniform's std
    assert (ex.gate_up_proj.shape, ex.down_proj.shape) == ((4, 128, 128), (4, 128, 64))
    assert "experts=4, dim=128, hidden_dim=64" in repr(ex)


def _expert_loop(ex: GroupedExperts, name: str, x: torch.Tensor, sizes) -> torch.Tensor:
    """The reference: one ``F.linear`` per expert."""
    w = getattr(ex, name)
    return torch.cat([F.linear(xe, w[e]) for e, xe in enumerate(x.split(list(sizes)))])


def _grouped_and_loop(ex, name, x, sizes, autocast, device="cpu", compile=False):
    """Output and both gradients of ``ex.grouped_mm`` and of the per-expert loop, same input and
    output gradient, under BF16 autocast or not."""
    outs = []
    for fn in (ex.grouped_mm, lambda n, t, s: _expert_loop(ex, n, t, s)):
        f = torch.compile(fn) if compile else fn
        xi = x.clone().requires_grad_(True)
        ex.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = f(name, xi, sizes)
        y.backward(torch.ones_like(y).mul_(torch.linspace(-1, 1, y.numel(), device=device).view_as(y)))
        outs.append((y.detach(), xi.grad, getattr(ex, name).grad.clone()))
    return outs


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_grouped_experts_grouped_gemm_equals_one_linear_per_expert(autocast, compile):
    """GroupedExperts runs BF16 through PyTorch's grouped GEMM (``F.grouped_mm``) and other dtypes
    through one ``F.linear`` per expert; on the CPU both give the per-expert loop's bits — output,
    dgrad and the 3-D wgrad — with an expert that gets no rows, eager and compiled."""
    torch.manual_seed(0)
    ex = GroupedExperts(4, 64, 48)
    x = torch.randn(20, 64)
    (y, gx, gw), (ry, rgx, rgw) = _grouped_and_loop(ex, "gate_up_proj", x, [5, 0, 9, 6], autocast, compile=compile)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32) and y.shape == (20, 96)
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw)
    assert gw[1].abs().max() == 0  # the expert without rows gets a zero gradient


def test_grouped_experts_in_bf16_call_the_grouped_gemm_and_unaligned_widths_do_not(monkeypatch):
    """Which path runs: BF16 weights with widths of a multiple of 16 bytes call ``F.grouped_mm``
    once; a width that breaks the grouped kernel's alignment (gate and up of hidden 35: 140 bytes) and FP32
    without autocast take the per-expert loop, with the loop's bits."""
    calls = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    for hidden, dtype, expect in ((48, torch.bfloat16, 1), (35, torch.bfloat16, 0), (48, torch.float32, 0)):
        calls.clear()
        ex = GroupedExperts(3, 64, hidden).to(dtype)
        x = torch.randn(10, 64, dtype=dtype)
        with torch.no_grad():
            y = ex.grouped_mm("gate_up_proj", x, [4, 2, 4])
            assert torch.equal(y, _expert_loop(ex, "gate_up_proj", x, [4, 2, 4]))
        assert len(calls) == expect, (hidden, dtype)


@pytest.mark.gpu
def test_grouped_experts_bf16_grouped_gemm_on_the_gpu_matches_the_loop():
    """On a CUDA GPU PyTorch's BF16 grouped kernel (CUTLASS on Hopper) against one ``F.linear``
    per expert under BF16 autocast, skewed rows with an empty expert: other kernels, so equal to
    BF16 rounding of the FP32-accumulated products (relative error below 1%), and the same
    bits when run again."""
    torch.manual_seed(0)
    ex = GroupedExperts(8, 1024, 512).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    sizes = [96, 0, 1200, 288, 1520, 16, 512, 464]
    (y, gx, gw), (ry, rgx, rgw) = _grouped_and_loop(ex, "gate_up_proj", x, sizes, True, device="cuda")
    for a, b in ((y, ry), (gx, rgx), (gw, rgw)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    (y2, gx2, gw2), _ = _grouped_and_loop(ex, "gate_up_proj", x, sizes, True, device="cuda")
    assert torch.equal(y, y2) and torch.equal(gx, gx2) and torch.equal(gw, gw2)


@torch.no_grad()
def test_expert_init_follows_the_linear_init():
    """The grouped experts draw from the distributions the per-expert linears had: Normal(0,
    init_std) for gate and up (like w1, w3), Normal(0, init_std / sqrt(2 * num_layers)) for down
    (like w2, a residual-branch output) — every expert, and the gate and up halves alike."""
    torch.manual_seed(0)
    cfg = load_model_config("moe_tiny")
    model = build_model(cfg)
    std, out_std, f = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers), cfg.moe_ffn_dim
    ex = model.layers[1].feed_forward.experts
    dense = model.layers[0].feed_forward

    def check(w, want, tol):  # sample std within tol of want, mean within 4 standard errors of 0
        assert abs(float(w.std()) / want - 1) < tol and abs(float(w.mean())) < 4 * want / math.sqrt(w.numel())

    for w, want in (
        (ex.gate_up_proj, std),
        (ex.down_proj, out_std),
        (dense.w1.weight, std),
        (dense.w2.weight, out_std),
    ):
        check(w, want, 0.01)  # (0.2M-1M values: the sample std is within 0.3% of the true one)
    for e in range(cfg.num_experts):  # 65k values each: within 1%
        check(ex.gate_up_proj[e, :f], std, 0.02)
        check(ex.gate_up_proj[e, f:], std, 0.02)
        check(ex.down_proj[e], out_std, 0.02)
    # init_weights draws them again (as after to_empty), in the FP8 form too
    convert_model(model, get_recipe("tensorwise"))
    before = ex.gate_up_proj.clone()
    model.init_weights()
    assert not torch.equal(before, ex.gate_up_proj)
    check(ex.gate_up_proj, std, 0.01)


def test_init_weights_materialises_a_meta_model():
    cfg = ModelConfig(**SMALL)
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.isfinite(model.layers[0].attention.wq.weight).all()
    torch.testing.assert_close(model.rope_cache, precompute_rope(cfg))
    x = torch.randint(0, 259, (1, 8))
    assert torch.isfinite(model(x).logits).all()


# ---- outlier stress (model.outlier_channels / model.outlier_scale) -------------------------------
def _swiglu_inputs(model, tokens):
    """The input of every layer's w1 (the SwiGLU input), captured by forward pre-hooks."""
    seen = []
    hooks = [
        layer.feed_forward.w1.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
        for layer in model.layers
    ]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_outlier_stress_is_off_by_default_and_leaves_checkpoints_unchanged():
    cfg = ModelConfig(**SMALL)
    assert cfg.outlier_channels == 0 and cfg.outlier_channel_ids == []
    assert "outlier_channels" not in cfg.to_dict() and "outlier_scale" not in cfg.to_dict()
    model = Transformer(cfg)
    assert all(layer.ffn_outliers is None for layer in model.layers)
    assert not any("ffn_outliers" in k for k in model.state_dict())
    for name in list_model_configs():  # the packaged configs carry the switch, off
        c = load_model_config(name)
        assert c.outlier_channels == 0 and c.outlier_scale == 1.0


def test_outlier_stress_scales_exactly_the_chosen_swiglu_input_channels():
    torch.manual_seed(0)
    cfg = ModelConfig(**SMALL, outlier_channels=2, outlier_scale=1000.0)
    assert cfg.outlier_channel_ids == [32, 96]  # evenly spaced, centred; one per 1x64 half of dim 128
    assert ModelConfig(
        **dict(SMALL, dim=1024, num_heads=8, num_kv_heads=4), outlier_channels=2, outlier_scale=10.0
    ).outlier_channel_ids == [256, 768]
    assert cfg.to_dict()["outlier_channels"] == 2 and cfg.to_dict()["outlier_scale"] == 1000.0
    stressed = Transformer(cfg)
    plain = Transformer(ModelConfig(**SMALL))
    state = {k: v for k, v in stressed.state_dict().items() if "ffn_outliers" not in k}
    plain.load_state_dict(state)  # same weights; only the gain differs
    tokens = torch.randint(0, 512, (2, 16))
    xs, x0s = _swiglu_inputs(stressed, tokens), _swiglu_inputs(plain, tokens)
    # layer 0 sees the same residual stream in both models: the gain is the only difference
    expected = x0s[0].clone()
    expected[..., [32, 96]] *= 1000.0
    torch.testing.assert_close(xs[0], expected, rtol=1e-6, atol=0)
    bulk = [c for c in range(128) if c not in (32, 96)]
    for x in xs:  # every layer: the outlier channels dominate the tensor's amax
        assert x[..., [32, 96]].abs().mean() > 100 * x[..., bulk].abs().mean()
    assert "channels=[32, 96], scale=1000" in repr(stressed.layers[0].ffn_outliers)


def test_outlier_stress_gain_is_state_and_survives_meta_materialisation():
    cfg = ModelConfig(**SMALL, outlier_channels=3, outlier_scale=50.0)
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    gain = model.layers[1].ffn_outliers.gain
    assert gain[cfg.outlier_channel_ids].eq(50.0).all() and (gain == 1.0).sum() == 128 - 3
    assert model.num_params() == cfg.num_params()  # a buffer, not a parameter
    sd = model.state_dict()
    assert "layers.0.ffn_outliers.gain" in sd
    with pytest.raises(RuntimeError, match="ffn_outliers.gain"):  # stressed <-> unstressed never mix
        Transformer(ModelConfig(**SMALL)).load_state_dict(sd)
    with pytest.raises(RuntimeError, match="ffn_outliers.gain"):
        model.load_state_dict(Transformer(ModelConfig(**SMALL)).state_dict())


def test_outlier_stress_stays_out_of_fp8_and_trains_under_every_fp8_recipe():
    cfg = ModelConfig(**SMALL, outlier_channels=2, outlier_scale=100.0)
    for recipe in ("tensorwise", "blockwise", "mxfp8"):
        torch.manual_seed(0)
        model = convert_model(Transformer(cfg), get_recipe(recipe), emulate=True)
        assert not isinstance(model.layers[0].ffn_outliers, Float8Linear)
        tokens = torch.randint(0, 512, (2, 32))
        out = model(tokens, tokens)
        out.loss.backward()
        assert math.isfinite(float(out.loss.detach()))
        rep = audit(model, strict=True)
        assert not any("ffn_outliers" in r.name for r in rep.rows)  # not a GEMM: no role to decide


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(outlier_channels=129), "outlier_channels must be in"),
        (dict(outlier_channels=-1), "outlier_channels must be in"),
        (dict(outlier_channels=2, outlier_scale=0.0), "outlier_scale must be"),
        (dict(outlier_channels=2, outlier_scale=float("nan")), "outlier_scale must be"),
    ],
)
def test_outlier_stress_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**SMALL, **bad)


def test_outlier_stress_is_a_hydra_override():
    from omegaconf import OmegaConf

    from nemo_fp8_recipes.config import compose_config

    cfg = compose_config(["model=llama3_150m", "model.outlier_channels=2", "model.outlier_scale=1e4"])
    mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model))
    assert mcfg.outlier_channel_ids == [256, 768] and mcfg.outlier_scale == 1e4
