"""Precision policy, convert_model and audit on (a) a small Llama-like PyTorch model and (b) a
real Megatron-Core GPTModel built on CPU (local spec), plus delayed-scaling state and the FP8
weight cache."""

import collections
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.megatron_utils import build_tiny_gpt_model, megatron_available

from nemo_fp8_recipes import (
    PolicyViolation,
    PrecisionPolicy,
    audit,
    convert_model,
    get_recipe,
    list_recipes,
)
from nemo_fp8_recipes.nn import (
    Float8Linear,
    collect_telemetry,
    fp8_modules,
    set_telemetry,
)
from nemo_fp8_recipes.policy import HIGH_PRECISION_ROLES, classify, layer_index

D, F_, V, L = 128, 256, 256, 4


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)


class CoreAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.core_attention = CoreAttention()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, 4, D // 4).transpose(1, 2) for m in (self.wq, self.wk, self.wv))
        return self.wo(self.core_attention(q, k, v).transpose(1, 2).reshape(b, s, D))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, F_, bias=False), nn.Linear(D, F_, bias=False)
        self.w2 = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.router = nn.Linear(D, n, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(n))
        self.shared_expert = MLP()

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(x.float(), self.router.weight.float()).softmax(-1)
        top = probs.argmax(-1, keepdim=True)
        out = self.shared_expert(x)
        for j, e in enumerate(self.experts):
            out = out + e(x) * (top == j) * probs[..., j : j + 1]
        return out


class Block(nn.Module):
    def __init__(self, moe=False):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(D), RMSNorm(D)
        self.attention = Attention()
        self.feed_forward = MoE() if moe else MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, moe=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(moe and i > 0) for i in range(L))
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, t):
        h = self.tok_embeddings(t)
        for blk in self.layers:
            h = blk(h)
        return self.output(self.norm(h)).float()


def step(model, seed=0):
    t = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(seed))
    logits = model(t)
    loss = F.cross_entropy(logits.view(-1, V), t.view(-1))
    loss.backward()
    return loss


def test_classify_names_from_all_ecosystems():
    cases = {
        "tok_embeddings": "embedding",
        "model.embed_tokens": "embedding",
        "embedding.word_embeddings": "embedding",
        "output": "output",
        "lm_head": "output",
        "output_layer": "output",
        "layers.0.feed_forward.router": "router",
        "model.layers.3.block_sparse_moe.gate": "router",
        "model.layers.3.mlp.gate": "router",
        "decoder.layers.1.mlp.router": "router",
        "layers.2.attention_norm": "norm",
        "model.layers.0.input_layernorm": "norm",
        "decoder.final_layernorm": "norm",
        "decoder.layers.0.self_attention.core_attention": "attention_core",
        "layers.0.attention.wq": "attention_projection",
        "model.layers.0.self_attn.q_proj": "attention_projection",
        "decoder.layers.0.self_attention.linear_qkv": "attention_projection",
        "decoder.layers.0.self_attention.linear_proj": "attention_projection",
        "model.layers.0.self_attn.kv_b_proj": "attention_projection",
        "layers.0.feed_forward.w1": "mlp",
        "model.layers.0.mlp.gate_proj": "mlp",
        "decoder.layers.0.mlp.linear_fc1": "mlp",
        "model.layers.1.block_sparse_moe.experts.3.w2": "mlp",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2": "mlp",
        "model.layers.5.mlp.shared_experts.down_proj": "mlp",
    }
    for name, role in cases.items():
        assert classify(name)[0] == role, name

    class TELayerNormColumnParallelLinear(nn.Linear):
        pass

    fused = TELayerNormColumnParallelLinear(8, 8)
    assert classify("decoder.layers.0.self_attention.linear_qkv", fused)[0] == "attention_projection"
    assert classify("decoder.layers.0.mlp.linear_fc1", fused)[0] == "mlp"
    assert layer_index("decoder.layers.17.mlp.linear_fc1") == 17
    assert layer_index("model.layers.3.self_attn") == 3 and layer_index("output") is None


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_llama_like_policy_holds_at_run_time(recipe, moe):
    model = TinyLlama(moe=moe)
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before conversion
    convert_model(model, recipe)
    assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
    assert all(p is params_before[n] for n, p in model.named_parameters())
    step(model)
    opt.step()
    rep = audit(model, strict=True)
    rows = {r.name: r for r in rep.rows}
    for name, row in rows.items():
        ran_fp8 = sum(row.fp8_gemms.values()) > 0
        if row.role in HIGH_PRECISION_ROLES:
            assert not ran_fp8 and row.precision != "fp8", name
        if row.role in ("attention_projection", "mlp") and row.fp8_gemms:
            assert row.fp8_gemms == {"fprop": 1, "dgrad": 1, "wgrad": 1}, name
    fp8_names = set(fp8_modules(model))
    expect = {f"layers.{i}.attention.{p}" for i in range(L) for p in ("wq", "wk", "wv", "wo")}
    assert expect <= fp8_names
    assert "output" not in fp8_names and "layers.1.feed_forward.router" not in fp8_names
    assert rows["output"].hp_gemms == {"fprop": 1, "dgrad": 1, "wgrad": 1}
    assert rows["layers.0.attention.core_attention"].role == "attention_core"
    assert rows["layers.0.attention_norm"].precision == "fp32"
    if moe:
        assert rows["layers.1.feed_forward.router"].precision == "fp32"
        assert "layers.1.feed_forward.experts.2.w1" in fp8_names
    n_fp8_gemms = len(fp8_names)
    assert rep.counts["fp8"] == {"fprop": n_fp8_gemms, "dgrad": n_fp8_gemms, "wgrad": n_fp8_gemms}
    assert "recipe" in rep.table() and rep.to_dict()["recipe"] == recipe


def test_first_last_layers_and_attention_option():
    model = TinyLlama()
    pol = PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1, attention_projections="bf16")
    convert_model(model, "blockwise", policy=pol)
    names = set(fp8_modules(model))
    assert not any(n.startswith(("layers.0.", "layers.3.")) for n in names)
    assert not any(".attention." in n for n in names)
    assert {"layers.1.feed_forward.w1", "layers.2.feed_forward.w2"} <= names
    rows = {r.name: r for r in audit(model).rows}
    assert "first 1" in rows["layers.0.feed_forward.w1"].reason
    assert "last 1 of 4" in rows["layers.3.feed_forward.w1"].reason


def test_include_exclude_and_strict_audit():
    model = TinyLlama()
    pol = PrecisionPolicy(exclude=("layers.2.*",), include=("output",))
    convert_model(model, "tensorwise", policy=pol)
    names = set(fp8_modules(model))
    assert "output" in names and not any(n.startswith("layers.2.") for n in names)
    step(model)
    rep = audit(model)
    assert rep.violations == ["output"]
    with pytest.raises(PolicyViolation, match="output"):
        audit(model, strict=True)


def test_shape_check_keeps_unaligned_layers_in_bf16_with_reason():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(96, 200))
    convert_model(model, "blockwise")
    row = audit(model).rows[0]
    assert row.precision == "bf16" and "not divisible by 128" in row.reason
    m2 = nn.Sequential()
    m2.add_module("proj", nn.Linear(96, 200))
    convert_model(m2, "tensorwise")  # 96 and 200 are multiples of 8 but 200 is not of 16
    assert "out_features=200" in audit(m2).rows[0].reason


def test_size_rule_keeps_small_gemms_in_bf16_with_the_size_in_the_reason():
    # w1/w3 are 256x128 = 32,768 elements, w2 128x256 the same; wq..wo 128x128 = 16,384; output 256x128
    torch.manual_seed(0)
    model = TinyLlama()
    convert_model(model, "tensorwise", policy=PrecisionPolicy(min_fp8_weight_elements=20_000))
    rows = {r.name: r for r in audit(model, strict=True).rows}
    assert rows["layers.0.feed_forward.w1"].precision == "fp8"
    assert rows["layers.0.attention.wq"].precision == "bf16"
    assert rows["layers.0.attention.wq"].reason == (
        "128x128 weight (16,384 elements) is below min_fp8_weight_elements=20,000 (policy): too small to gain from FP8"
    )
    assert isinstance(model.layers[0].attention.wq, nn.Linear) and not isinstance(
        model.layers[0].attention.wq, Float8Linear
    )
    assert isinstance(model.layers[0].feed_forward.w1, Float8Linear)
    step(model)  # trains with the mix
    # include patterns win over the size rule; 0 turns it off
    pol = PrecisionPolicy(min_fp8_weight_elements=10**9, include=("*.wq",))
    assert pol.decide("layers.0.attention.wq", recipe=get_recipe("tensorwise"), shape=(128, 128)).fp8
    assert PrecisionPolicy().decide("layers.0.attention.wk", recipe=get_recipe("tensorwise"), shape=(128, 128)).fp8
    # auto: the recipe's measured crossover, named in the reason
    auto = PrecisionPolicy(min_fp8_weight_elements="auto")
    measured = {n: get_recipe(n).fp8_crossover_weight_elements for n in list_recipes()}
    assert measured == {
        "bf16": None,
        "delayed": 24 * 2**20,
        "tensorwise": 16 * 2**20,
        "blockwise": 24 * 2**20,
        "mxfp8": None,
    }
    for name, threshold in ((n, t) for n, t in measured.items() if t):
        r = get_recipe(name)
        small = auto.decide("layers.0.mlp.w1", recipe=r, shape=(threshold // 1024 - 128, 1024))
        assert not small.fp8 and f"auto: the measured {name} crossover" in small.reason
        assert auto.decide("layers.0.mlp.w1", recipe=r, shape=(threshold // 1024, 1024)).fp8
    with pytest.raises(
        ValueError, match=r"no measured crossover for recipe mxfp8 \(measured: delayed, tensorwise, blockwise\)"
    ):
        auto.decide("layers.0.mlp.w1", recipe=get_recipe("mxfp8"), shape=(128, 128))
    # the bf16 recipe converts nothing, whatever the rule says
    assert auto.decide("layers.0.mlp.w1", recipe=get_recipe("bf16"), shape=(128, 128)).reason == "recipe bf16: no FP8"


def test_a_model_below_the_crossover_gets_a_hint_unless_the_size_rule_is_on():
    from nemo_fp8_recipes.policy import small_gemm_hint

    tw = get_recipe("tensorwise")
    small = [(3072, 1024), (1024, 3072), (1024, 1024)]  # llama3_150m's projections
    hint = small_gemm_hint(tw, PrecisionPolicy(), small)
    assert hint and "largest weight 3Mi elements, crossover 16Mi" in hint and "min_fp8_weight_elements=auto" in hint
    assert small_gemm_hint(tw, PrecisionPolicy(min_fp8_weight_elements="auto"), small) is None
    assert small_gemm_hint(tw, PrecisionPolicy(), small + [(14336, 4096)]) is None  # one GEMM gains
    assert small_gemm_hint(tw, PrecisionPolicy(), []) is None
    assert get_recipe("mxfp8").fp8_crossover_weight_elements is None
    assert small_gemm_hint(get_recipe("mxfp8"), PrecisionPolicy(), small) is None


@pytest.mark.parametrize("bad", [-1, 1.5, "big", True])
def test_size_rule_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="min_fp8_weight_elements must be an integer >= 0"):
        PrecisionPolicy(min_fp8_weight_elements=bad)


def test_size_rule_needs_a_shape_and_megatron_refuses_it():
    from nemo_fp8_recipes.integrations.megatron import megatron_config

    pol = PrecisionPolicy(min_fp8_weight_elements="auto")
    with pytest.raises(ValueError, match="needs the GEMM's shape, and no module or shape was given"):
        pol.decide("layers.0.mlp.w1", recipe=get_recipe("tensorwise"))

    class FusedLinear(nn.Module):  # a GEMM module of a project's own (by its class name), no in/out features
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4))

    with pytest.raises(ValueError, match="FusedLinear has no in_features/out_features"):
        pol.decide("layers.0.mlp.w1", FusedLinear(), recipe=get_recipe("tensorwise"))
    for backend in ("te", "native"):
        with pytest.raises(ValueError, match="cannot be expressed in Megatron-Core's FP8 settings"):
            megatron_config("tensorwise", pol, backend=backend)


class PackedLinear(nn.Module):
    """A project's own GEMM module that is not an nn.Linear: weight ``[out, in]``, no bias."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.in_features, self.out_features, self.bias = d_in, d_out, None
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class PackedMLP(nn.Module):
    def __init__(self, d_ff=F_):
        super().__init__()
        self.w1, self.w2 = PackedLinear(D, d_ff), PackedLinear(d_ff, D)
        self.w3 = nn.Linear(d_ff, d_ff, bias=False)

    def forward(self, x):
        return self.w2(self.w3(F.silu(self.w1(x))))


def _packed_model():
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([PackedMLP(), PackedMLP(d_ff=200)])  # 200: not a multiple of 16
    return model


def test_swaps_build_fp8_replacements_for_a_custom_module_class():
    # without a swap the custom class is kept in high precision, counted, and the reason says why
    plain = convert_model(_packed_model(), "tensorwise")
    assert not isinstance(plain.layers[0].w1, Float8Linear) and isinstance(plain.layers[0].w3, Float8Linear)
    assert "no swap for it" in {r.name: r for r in audit(plain).rows}["layers.0.w1"].reason

    built = []

    def factory(fqn, module, decision, config):
        built.append((fqn, decision.precision, config.recipe.name, config.emulate))
        return Float8Linear.from_linear(module, config=config)

    calls = collections.Counter()

    class CountingPolicy(PrecisionPolicy):
        def decide(self, fqn, module=None, recipe=None, shape=None):
            calls[fqn] += 1
            return super().decide(fqn, module, recipe=recipe, shape=shape)

    model = _packed_model()
    w1 = model.layers[0].w1
    seen = []
    w1.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs), with_kwargs=True)
    convert_model(model, "tensorwise", CountingPolicy(), swaps={PackedLinear: factory})
    assert set(calls.values()) == {1} and "layers.0.w1" in calls  # one decision per module
    assert built == [("layers.0.w1", "fp8", "tensorwise", True), ("layers.0.w2", "fp8", "tensorwise", True)]
    new = model.layers[0].w1
    assert isinstance(new, Float8Linear) and new.weight is w1.weight and (new.fqn, new.role) == ("layers.0.w1", "mlp")
    # layer 1's d_ff=200: the alignment check ran on the custom module's [out, in] weight
    assert not isinstance(model.layers[1].w1, Float8Linear)
    x = torch.randn(4, 8, D)
    model.layers[0](x).sum().backward()
    model.layers[1](x).sum().backward()
    assert seen == [{}]  # the user's with_kwargs hook moved to the replacement, flag included
    rows = {r.name: r for r in audit(model, strict=True).rows}
    assert rows["layers.0.w1"].precision == "fp8" and rows["layers.0.w1"].fp8_gemms == {
        "fprop": 1,
        "dgrad": 0,
        "wgrad": 1,
    }
    assert rows["layers.1.w1"].reason == "out_features=200 not divisible by 16 as tensorwise FP8 GEMMs need"
    assert rows["layers.1.w1"].hp_gemms == {"fprop": 1, "dgrad": 0, "wgrad": 1}
    assert "layers.0.w1.fp8_fwd_count" in model._ddp_params_and_buffers_to_ignore
    assert "layers.1.w1.hp_fwd_count" in model._ddp_params_and_buffers_to_ignore


def test_swaps_are_checked_before_the_model_changes():
    from nemo_fp8_recipes.nn.convert import conversion_state

    model = _packed_model()
    with pytest.raises(TypeError, match="layers.0.w1: the swap for PackedLinear returned Identity, not a Float8Linear"):
        convert_model(model, "tensorwise", swaps={PackedLinear: lambda *a: nn.Identity()})
    assert conversion_state(model) is None and not any(isinstance(m, Float8Linear) for m in model.modules())
    with pytest.raises(TypeError, match="swaps maps module classes to factories"):
        convert_model(model, "tensorwise", swaps={"PackedLinear": lambda *a: None})

    class Packed(PackedLinear):  # not named *Linear: the policy does not see a GEMM
        pass

    odd = nn.Sequential(Packed(D, D))
    with pytest.raises(ValueError, match="swaps name Packed, but the policy does not classify it as a GEMM"):
        convert_model(odd, "tensorwise", swaps={Packed: lambda *a: None})
    noweight = _packed_model()
    del noweight.layers[0].w1.weight
    noweight.layers[0].w1.weight = None
    with pytest.raises(TypeError, match="layers.0.w1: the policy puts this PackedLinear in FP8 but it has no weight"):
        convert_model(noweight, "tensorwise", swaps={PackedLinear: lambda *a: None})


def test_swaps_take_the_most_specific_class():
    class TaggedFloat8Linear(Float8Linear):
        pass

    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential()
    model.add_module("a", nn.Linear(D, D))
    model.add_module("b", MyLinear(D, D))
    tagged = lambda fqn, m, d, config: TaggedFloat8Linear.from_linear(m, config=config)  # noqa: E731
    convert_model(model, "blockwise", swaps={MyLinear: tagged})
    assert type(model.a) is Float8Linear and type(model.b) is TaggedFloat8Linear


def test_bf16_recipe_converts_nothing_but_audits():
    model = TinyLlama()
    convert_model(model, "bf16")
    assert not fp8_modules(model)
    step(model)
    rep = audit(model, strict=True)
    assert rep.counts["fp8"] == {"fprop": 0, "dgrad": 0, "wgrad": 0}
    assert rep.counts["high_precision"]["fprop"] == 4 * 7 + 1


def test_weight_requantised_only_when_it_changes():
    model = TinyLlama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_model(model, "blockwise")
    lin = model.layers[0].feed_forward.w1
    step(model, 0)
    cache1 = lin._wcache
    step(model, 1)  # second micro-batch, no optimizer step: same FP8 copy
    assert lin._wcache is cache1
    opt.step()
    step(model, 2)
    assert lin._wcache is not cache1


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_eager_weight_copies_are_released_before_each_optimizer_step(recipe):
    """The eager FP8 weight copies live through the micro-batches of a step (reused) and are
    gone before the optimizer runs: they never sit beside its memory."""
    from nemo_fp8_recipes.nn import fp8_modules

    torch.manual_seed(0)
    model = TinyLlama()
    convert_model(model, recipe)
    fp8 = list(fp8_modules(model).values())
    seen_in_step = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):  # (the global pre-step hooks have run by now)
            seen_in_step.append(sum(m.weight_cache_bytes for m in fp8))
            return super().step(closure)

    opt = Probe(model.parameters(), lr=0.1)
    for s in range(2):
        step(model, 2 * s)
        held = {m: m.weight_cache_bytes for m in fp8}
        # one byte an element and the scales (emulated, the second orientation is a transposed
        # view of the first; real GEMMs keep two copies)
        assert all(m.weight.numel() <= b < 1.1 * m.weight.numel() for m, b in held.items())
        step(model, 2 * s + 1)  # the second micro-batch reuses them
        assert {m: m.weight_cache_bytes for m in fp8} == held
        opt.step()
        opt.zero_grad()
        assert sum(m.weight_cache_bytes for m in fp8) == 0
    assert seen_in_step == [0, 0]


def test_delayed_state_dict_round_trip_is_bit_identical():
    torch.manual_seed(0)
    a = TinyLlama()
    b = TinyLlama()
    b.load_state_dict(a.state_dict())
    rec = get_recipe("delayed", amax_history_len=8)
    convert_model(a, rec)
    convert_model(b, rec)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-3)
    for s in range(3):
        step(a, s)
        opt.step()
        opt.zero_grad()
    sd = a.state_dict()
    assert any(k.endswith("fp8_amax_history") for k in sd) and any(k.endswith("fp8_scale") for k in sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    t = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(7))
    ya, yb = a(t), b(t)
    assert torch.equal(ya, yb)
    la = F.cross_entropy(ya.view(-1, V), t.view(-1))
    lb = F.cross_entropy(yb.view(-1, V), t.view(-1))
    la.backward()
    lb.backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), n


def test_delayed_history_algo_and_margin():
    lin = nn.Linear(16, 16, bias=False)
    rec = get_recipe("delayed", amax_history_len=2, amax_compute_algo="most_recent", margin=1)
    m = Float8Linear.from_linear(lin, rec, emulate=True)
    for amp in (4.0, 1.0, 2.0):
        m(torch.full((16, 16), amp))
    # 3 forwards: history (most recent first) holds amaxes 1.0 then 4.0 (len 2); the scale
    # computed at the 3rd forward used most_recent = 1.0 with margin 1: 448/1/2
    assert m.fp8_amax_history[0].tolist() == [1.0, 4.0]
    assert m.fp8_scale[0].item() == 224.0
    assert m.fp8_amax_pending[0].item() == 2.0


def test_amax_reduce_hook_is_applied():
    lin = nn.Linear(16, 16, bias=False)
    m = Float8Linear.from_linear(lin, get_recipe("delayed"), emulate=True)
    seen = []
    m.reconfigure(amax_reduce_fn=lambda t: (seen.append(t.clone()), t * 2)[1])
    m(torch.ones(16, 16))
    m(torch.ones(16, 16))
    # the second forward commits the input's and the weight's amax (the FP8 weight follows its
    # history), each through the hook
    w_amax = float(lin.weight.abs().max())
    assert len(seen) == 2 and m.fp8_amax_history[0, 0].item() == 2.0
    assert m.fp8_amax_history[1, 0].item() == pytest.approx(2 * w_amax, rel=1e-6)


def test_telemetry_groups():
    model = TinyLlama(moe=True)
    convert_model(model, "blockwise")
    set_telemetry(model, True)
    step(model)
    tel = collect_telemetry(model)
    assert {
        "fp8/attention/input/amax",
        "fp8/mlp/weight/scale",
        "fp8/experts/grad_output/underflow_frac",
        "fp8/shared_expert/input/saturated_frac",
    } <= set(tel)
    assert tel["fp8/attention/input/amax"] > 0 and collect_telemetry(model) == {}


# ---- a real Megatron-Core GPTModel (local spec), constructed on CPU ---------------------------

_ok, _why = megatron_available()
needs_megatron = pytest.mark.skipif(not _ok, reason=_why)


@needs_megatron
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_policy_on_real_megatron_gpt_model(moe):
    from nemo_fp8_recipes.policy import PrecisionPolicy

    model = build_tiny_gpt_model(num_layers=4, hidden_size=128, ffn_hidden_size=256, moe=moe)
    pol = PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1, num_layers=4)
    rec = get_recipe("blockwise")
    decisions = {n: pol.decide(n, m, recipe=rec) for n, m in model.named_modules() if n}
    by_role = {}
    for d in decisions.values():
        by_role.setdefault(d.role, []).append(d)
    for role in ("embedding", "output", "norm", "attention_core") + (("router",) if moe else ()):
        assert by_role.get(role), f"no {role} found in the Megatron tree"
        assert all(not d.fp8 for d in by_role[role]), role
    assert decisions["output_layer"].role == "output"
    assert decisions["decoder.final_layernorm"].role == "norm"
    assert decisions["decoder.layers.1.self_attention.core_attention"].role == "attention_core"
    for i in (1, 2):
        assert decisions[f"decoder.layers.{i}.self_attention.linear_qkv"].fp8
        assert decisions[f"decoder.layers.{i}.self_attention.linear_proj"].fp8
        if moe:
            assert decisions[f"decoder.layers.{i}.mlp.router"].precision == "fp32"
            assert decisions[f"decoder.layers.{i}.mlp.experts.local_experts.0.linear_fc1"].fp8
        else:
            assert decisions[f"decoder.layers.{i}.mlp.linear_fc1"].fp8
            assert decisions[f"decoder.layers.{i}.mlp.linear_fc2"].fp8
    for i in (0, 3):
        assert not decisions[f"decoder.layers.{i}.self_attention.linear_qkv"].fp8
    # convert_model on the Megatron tree records the decisions and converts no Megatron layer
    # silently: ColumnParallelLinear is not an nn.Linear, so it is kept and the reason says so
    convert_model(model, rec, policy=pol)
    rows = {r.name: r for r in audit(model, strict=True).rows}
    assert "not an nn.Linear" in rows["decoder.layers.1.self_attention.linear_qkv"].reason


def test_fp8_state_stays_fp32_under_dtype_casts_and_resets():
    lin = nn.Linear(32, 32, bias=False)
    m = Float8Linear.from_linear(lin, get_recipe("delayed"), emulate=True)
    m(torch.randn(8, 32) * 3)
    m(torch.randn(8, 32))
    m.bfloat16()
    assert m.fp8_scale.dtype == torch.float32 and m.fp8_amax_history.dtype == torch.float32
    assert m.weight.dtype == torch.bfloat16
    m.float()
    m.reset_parameters()
    assert torch.all(m.fp8_scale == 1) and torch.all(m.fp8_amax_history == 0)


def test_second_backward_with_retain_graph_and_real_path_on_cpu_errors():
    lin = nn.Linear(128, 128)
    m = Float8Linear.from_linear(lin, get_recipe("blockwise"), emulate=True)
    x = torch.randn(4, 128, requires_grad=True)
    y = m(x).sum()
    y.backward(retain_graph=True)
    g1 = m.weight.grad.clone()
    y.backward()
    assert torch.allclose(m.weight.grad, 2 * g1)
    real = Float8Linear.from_linear(nn.Linear(128, 128), get_recipe("tensorwise"), emulate=False)
    with pytest.raises(RuntimeError, match="use emulate=True"):
        real(torch.randn(4, 128))


def test_no_wgrad_copy_when_weight_frozen():
    lin = nn.Linear(128, 128)
    lin.weight.requires_grad_(False)
    m = Float8Linear.from_linear(lin, get_recipe("blockwise"), emulate=True)
    x = torch.randn(4, 128, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and m.gemm_counts == {"fprop": 1, "dgrad": 1, "wgrad": 0}


def test_delayed_buffers_are_excluded_from_ddp_broadcast():
    model = TinyLlama()
    convert_model(model, "delayed")
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    assert "layers.0.attention.wq.fp8_amax_history" in ignored
    assert "layers.0.attention.wq.fp8_scale" in ignored and not any("weight" in n for n in ignored)


@pytest.mark.parametrize(
    "opt_kwargs", [{"fused": True}, {"foreach": True}, {"foreach": False}], ids=["fused", "foreach", "for-loop"]
)
def test_fp8_weight_follows_every_optimizer_implementation(opt_kwargs):
    """Fused optimizers do not bump Tensor._version: the cached FP8 weight must still be
    refreshed after each optimizer step (and reused between micro-batches)."""
    from nemo_fp8_recipes.quant.reference import quantize

    torch.manual_seed(0)
    model = TinyLlama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    convert_model(model, "tensorwise")
    lin = model.layers[0].feed_forward.w1
    for s in range(3):
        step(model, s)
        cached = lin._wcache
        step(model, s + 10)  # a second micro-batch reuses the FP8 copy
        assert lin._wcache is cached
        opt.step()
        opt.zero_grad()
    step(model, 99)
    fresh = quantize(lin.weight.detach(), "e4m3", "tensor")
    assert torch.equal(lin._wcache[0].data.float(), fresh.data.float())


def test_step_schedule_holds_scales_within_a_step_and_advances_once():
    """trainer schedule: every use in a step quantises with the same scale, the pending amax is
    the max over the step's uses, and sync_delayed_scaling advances each history by one entry."""
    from nemo_fp8_recipes.nn import set_delayed_scaling_update, sync_delayed_scaling

    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    convert_model(model, get_recipe("delayed", amax_history_len=3, margin=1))
    m = model[0]
    assert set_delayed_scaling_update(model, "step") == 1
    for amp in (4.0, 1.0, 2.0):  # three micro-batches of one step
        model(torch.full((16, 16), amp))
        assert m.fp8_scale[0].item() == 1.0  # scale of step 0 (no history yet) for all of them
    assert m.fp8_amax_pending[0].item() == 4.0 and m.fp8_amax_history[0].tolist() == [0.0, 0.0, 0.0]
    assert sync_delayed_scaling(model) == 1
    assert m.fp8_amax_history[0].tolist() == [4.0, 0.0, 0.0]
    assert m.fp8_scale[0].item() == 448.0 / 4.0 / 2  # E4M3 max / amax / 2**margin
    assert m.fp8_amax_pending.abs().sum().item() == 0 and m.fp8_pending.sum().item() == 0
    model(torch.full((16, 16), 1.0))
    sync_delayed_scaling(model)
    assert m.fp8_amax_history[0].tolist() == [1.0, 4.0, 0.0]
    assert m.fp8_scale[0].item() == 448.0 / 4.0 / 2  # max over the history
    # an operand never used in a step (no backward here) keeps history and scale
    assert m.fp8_amax_history[2].tolist() == [0.0, 0.0, 0.0] and m.fp8_scale[2].item() == 1.0
    # switching back to lazy commits what is pending, nothing is lost
    model(torch.full((16, 16), 8.0))
    set_delayed_scaling_update(model, "lazy")
    assert m.fp8_amax_history[0].tolist() == [8.0, 1.0, 4.0]
    with pytest.raises(ValueError, match="valid modes: lazy, step"):
        set_delayed_scaling_update(model, "sometimes")


@pytest.mark.parametrize("schedule", ["lazy", "step"])
def test_a_weight_that_does_not_change_follows_its_amax_history(schedule):
    """Frozen weights, evaluation of a fresh model, a second forward before any optimizer step:
    the FP8 weight is re-quantised with the scale its history gives (TE re-quantises the weight
    at every forward), not kept at the scale 1 of its first quantisation."""
    from nemo_fp8_recipes.nn import set_delayed_scaling_update, sync_delayed_scaling
    from nemo_fp8_recipes.quant.reference import quantize

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(0.01)  # |w| << 448: scale 1 keeps few mantissa bits... and many zeros
    model[0].weight.requires_grad_(False)  # frozen
    convert_model(model, get_recipe("delayed", amax_history_len=4))
    m = model[0]
    set_delayed_scaling_update(model, schedule)
    x = torch.randn(8, 32)
    model.eval()
    with torch.no_grad():
        first = model(x)
        if schedule == "step":
            sync_delayed_scaling(model)
        second = model(x)
    w = m.weight.detach()
    s_w = 448.0 / float(w.abs().max())
    assert m._wcache[0].scale_inv.item() == pytest.approx(1 / s_w, rel=1e-6)  # not 1.0
    w_q = quantize(w, "e4m3", "tensor", scale=torch.tensor(s_w)).dequantize()
    x_q = quantize(x, "e4m3", "tensor", scale=torch.tensor(448.0 / float(x.abs().max()))).dequantize()
    want = (x_q.double() @ w_q.double().T).float()
    assert torch.allclose(second, want, rtol=1e-5, atol=1e-6)
    exact = x.double() @ w.double().T
    err = lambda y: float((y.double() - exact).norm() / exact.norm())  # noqa: E731
    assert err(second) < 0.5 * err(first)  # the first forward's scale-1 copy is far worse
    # and the weight's history keeps receiving its amax, step after step
    with torch.no_grad():
        for _ in range(3):
            model(x)
            if schedule == "step":
                sync_delayed_scaling(model)
    if schedule == "lazy":
        set_delayed_scaling_update(model, "step")  # commits what is pending
    assert (m.fp8_amax_history[1] == float(w.abs().max())).sum().item() == 4


def test_a_skipped_non_finite_step_does_not_pin_the_scales():
    """discard_delayed_scaling drops a bad step's amaxes; kept, an Inf pins the scale for the whole
    history (TE's rule: a non-finite amax keeps the previous scale), which telemetry reports."""
    from nemo_fp8_recipes.nn import (
        collect_telemetry,
        discard_delayed_scaling,
        pinned_scales,
        set_delayed_scaling_update,
        sync_delayed_scaling,
    )

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16, bias=False))
        convert_model(model, get_recipe("delayed", amax_history_len=8))
        set_delayed_scaling_update(model, "step")
        model(torch.full((16, 16), 2.0))
        sync_delayed_scaling(model)
        return model, model[0]

    bad = torch.full((16, 16), 2.0)
    bad[0, 0] = float("inf")
    kept, k = fresh()
    kept(bad)
    sync_delayed_scaling(kept)
    kept(torch.full((16, 16), 100.0))  # activations grow
    sync_delayed_scaling(kept)
    assert k.fp8_scale[0].item() == 448.0 / 2.0  # pinned: the growth is not followed (saturates)
    assert pinned_scales(kept) == {"0": ["input"]}
    tel = collect_telemetry(kept)
    assert tel["fp8/linear/input/scale_pinned"] == 1.0 and tel["fp8/linear/weight/scale_pinned"] == 0.0

    dropped, d = fresh()
    dropped(bad)
    assert discard_delayed_scaling(dropped) == 1
    dropped(torch.full((16, 16), 100.0))
    sync_delayed_scaling(dropped)
    assert d.fp8_scale[0].item() == pytest.approx(448.0 / 100.0, rel=1e-6)  # follows the growth
    assert pinned_scales(dropped) == {}
    assert torch.isfinite(d.fp8_amax_history).all()


def test_step_schedule_matches_lazy_schedule_per_step():
    """With one use per operand per step the two schedules are the same computation."""
    from nemo_fp8_recipes.nn import set_delayed_scaling_update, sync_delayed_scaling

    torch.manual_seed(0)
    lazy = nn.Sequential(nn.Linear(32, 32, bias=False))
    step = nn.Sequential(nn.Linear(32, 32, bias=False))
    step.load_state_dict(lazy.state_dict())
    convert_model(lazy, get_recipe("delayed"))
    convert_model(step, get_recipe("delayed"))
    set_delayed_scaling_update(step, "step")
    for i in range(4):
        x = torch.randn(8, 32) * (1 + i)
        a, b = lazy(x), step(x)
        a.square().sum().backward()
        b.square().sum().backward()
        assert torch.equal(a, b)
        sync_delayed_scaling(step)
    set_delayed_scaling_update(lazy, "step")  # commits lazy's pending amaxes
    assert torch.equal(lazy[0].fp8_amax_history, step[0].fp8_amax_history)
    assert torch.equal(lazy[0].fp8_scale, step[0].fp8_scale)
    assert torch.equal(lazy[0].weight.grad, step[0].weight.grad)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a_model_built_on_meta_converts_materialises_and_trains_like_one_built_on_cpu(recipe):
    """The large-model pattern: build on the meta device, convert_model, to_empty, initialise.
    The FP8 scaling state and the audit's counters start as at construction (to_empty gives them
    uninitialised memory), so the outputs, gradients and audit equal those of the same model built
    on the CPU."""
    from nemo_fp8_recipes.nn import audit

    def build():
        return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.Linear(128, 64))

    def init(model):
        torch.manual_seed(0)
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.reset_parameters()

    policy = PrecisionPolicy(exclude=["3"])  # one GEMM kept in high precision: its counters too
    with torch.device("meta"):
        meta = build()
    convert_model(meta, recipe, policy=policy, emulate=True, device="cpu")
    # to_empty's memory made visibly wrong: deterministic mode fills uninitialised memory with NaN
    # (floats) and the largest integer
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        meta.to_empty(device="cpu")
        probe = torch.empty_like(torch.zeros(3, dtype=torch.int64))
        assert int(probe[0]) == torch.iinfo(torch.int64).max  # (the filling is on)
    finally:
        torch.use_deterministic_algorithms(det)
    init(meta)
    ref = build()
    convert_model(ref, recipe, policy=policy, emulate=True)
    init(ref)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m in (meta, ref):
            m(x).square().mean().backward()
    a, b = meta(x), ref(x)
    assert torch.isfinite(a).all() and torch.equal(a, b)
    for (n, p), q in zip(meta.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert str(audit(meta)) == str(audit(ref))
    assert "4/3/3" in str(audit(meta))  # (three steps and the last forward)


def test_convert_model_says_when_it_would_do_nothing_or_cannot():
    """A bare Linear (the model itself), a policy that is not a PrecisionPolicy and a CUDA device
    on a build without CUDA are refused with the fix; a policy pattern that names no module, and
    an FP8 recipe under which no GEMM runs in FP8, are warned about; an empty GEMM stays in high
    precision (nothing to quantise) and runs as nn.Linear does."""
    import warnings

    from nemo_fp8_recipes.nn import audit

    with pytest.raises(ValueError, match=r"itself a Linear.*nn\.Sequential\(layer\)"):
        convert_model(nn.Linear(128, 128), "tensorwise", emulate=True)
    for bad, hint in (
        ("bf16", "recipe='bf16'"),
        ({"exclude": ["0"]}, r"PrecisionPolicy\(\*\*\{'exclude': \['0'\]\}\)"),
    ):
        with pytest.raises(ValueError, match=f"policy must be a PrecisionPolicy or None.*{hint}"):
            convert_model(nn.Sequential(nn.Linear(128, 128)), "tensorwise", policy=bad, emulate=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda', but this PyTorch has no CUDA GPU"):
            convert_model(nn.Sequential(nn.Linear(128, 128)), "tensorwise", device="cuda")
    with pytest.warns(UserWarning, match="policy exclude pattern 'lm_head' matches no module"):
        convert_model(nn.Sequential(nn.Linear(128, 128)), "tensorwise", policy=PrecisionPolicy(exclude=["lm_head"]))
    with pytest.warns(UserWarning, match="recipe blockwise: no GEMM of the model runs in FP8.*not divisible by 128"):
        convert_model(nn.Sequential(nn.Linear(100, 100)), "blockwise", emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with FP8 GEMMs and matching patterns: no warning
        convert_model(
            nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64)), "tensorwise", policy=PrecisionPolicy(exclude=["1"])
        )
    empty = nn.Sequential(nn.Linear(0, 128))
    with pytest.warns(UserWarning, match="an empty GEMM"):
        convert_model(empty, "tensorwise", emulate=True)
    x = torch.zeros(4, 0)
    assert torch.equal(empty(x), empty[0].bias.expand(4, 128)) and "hp" in str(audit(empty)).split("\n")[0]


def test_a_rotary_embedding_is_no_embedding():
    """Hugging Face's LlamaRotaryEmbedding (no weights) is not the token embedding: it is no role
    of the policy's, and the audit does not list it as one."""
    from nemo_fp8_recipes.policy import Role, classify

    class LlamaRotaryEmbedding(nn.Module):
        pass

    assert classify("model.rotary_emb", LlamaRotaryEmbedding())[0] == Role.OTHER
    assert classify("model.layers.0.self_attn.rotary_emb", None)[0] == Role.OTHER
    assert classify("model.embed_tokens", nn.Embedding(8, 4))[0] == Role.EMBEDDING


# ---- the FP8 linear's one config ------------------------------------------------------------


def test_float8_linear_config_is_frozen_and_names_the_valid_values():
    import dataclasses

    from nemo_fp8_recipes.nn import Float8LinearConfig
    from nemo_fp8_recipes.options import KernelOptions

    r = get_recipe("tensorwise")
    cfg = Float8LinearConfig(recipe=r, emulate=True)
    assert (cfg.telemetry, cfg.graph_weight_cache, cfg.fuse_wgrad_accumulation) == (False, False, False)
    assert (cfg.scaling_update, cfg.amax_reduce_fn, cfg.triton_arg) == ("lazy", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.telemetry = True
    for name in ("tensorwise", "blockwise", "mxfp8"):
        assert Float8LinearConfig(recipe=get_recipe(name), emulate=True).row_multiple == get_recipe(name).gemm_alignment
    assert Float8LinearConfig(recipe=r, emulate=True, kernel_options=KernelOptions(triton=False)).triton_arg is False
    bad = [
        (dict(recipe=get_recipe("bf16"), emulate=True), ValueError, "needs an FP8 recipe, got bf16"),
        (dict(recipe="tensorwise", emulate=True), TypeError, r"resolve it with get_recipe\(name\)"),
        (dict(recipe=r, emulate=True, scaling_update="eager"), ValueError, "valid modes: lazy, step"),
        (dict(recipe=r, emulate=1), TypeError, "emulate must be True or False"),
        (dict(recipe=r, emulate=True, telemetry="yes"), TypeError, "telemetry must be True or False"),
        (dict(recipe=r, emulate=True, kernel_options={"triton": False}), TypeError, "must be a KernelOptions"),
        (dict(recipe=r, emulate=True, amax_reduce_fn=2), TypeError, "callable"),
        (
            dict(recipe=get_recipe("delayed"), emulate=True, graph_weight_cache=True),
            ValueError,
            r"for current scaling \(tensorwise, blockwise, mxfp8\)",
        ),
    ]
    for kwargs, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            Float8LinearConfig(**kwargs)
    with pytest.raises(ValueError, match="no setting telemetry_enabled; its settings: recipe, emulate, kernel_options"):
        cfg.replace(telemetry_enabled=True)
    assert cfg.replace(telemetry=True).telemetry and not cfg.telemetry


def test_settings_are_read_only_and_reconfigure_replaces_the_config():
    import copy

    from nemo_fp8_recipes.nn import Float8LinearConfig

    cfg = Float8LinearConfig(recipe=get_recipe("tensorwise"), emulate=True)
    m = Float8Linear(32, 32, config=cfg)
    assert m.config is cfg and m.recipe is cfg.recipe and m.row_multiple == 16
    old = Float8Linear.from_linear(nn.Linear(32, 32), get_recipe("tensorwise"), emulate=True)  # the older keywords
    assert old.config == cfg
    with pytest.raises(TypeError, match="either config=Float8LinearConfig"):
        Float8Linear(32, 32, recipe=get_recipe("tensorwise"), emulate=True, config=cfg)
    for name, value, way in [
        ("telemetry_enabled", True, r"set_telemetry\(model, enabled\).*reconfigure\(telemetry=...\)"),
        ("scaling_update", "step", r"set_delayed_scaling_update\(model, mode\)"),
        ("kernel_options", cfg.kernel_options, r"convert_model\(..., options=...\)"),
        ("fuse_wgrad_accumulation", True, r"set_wgrad_accumulation_fusion"),
        ("amax_reduce_fn", None, r"set_amax_reduce_fn"),
        ("emulate", False, r"reconfigure\(emulate=...\)"),
        ("recipe", get_recipe("blockwise"), "fixed when the module is built"),
        ("config", cfg, r"reconfigure\(name=value"),
    ]:
        with pytest.raises(AttributeError, match=way):
            setattr(m, name, value)
    assert m.config is cfg
    new = m.reconfigure(telemetry=True)
    assert m.config is new and new.telemetry and m.telemetry_enabled and not cfg.telemetry
    with pytest.raises(ValueError, match="the recipe is fixed when the module is built"):
        m.reconfigure(recipe=get_recipe("blockwise"))
    with pytest.raises(ValueError, match="its settings: recipe, emulate"):
        m.reconfigure(telemetry_enabled=False)
    # a refused change leaves the module as it was: fused wgrad accumulation needs an FP32 weight
    half = Float8Linear.from_linear(nn.Linear(32, 32).bfloat16(), config=cfg)
    with pytest.raises(RuntimeError, match="accumulates FP32 gradients"):
        half.reconfigure(fuse_wgrad_accumulation=True, telemetry=True)
    assert half.config is cfg
    assert copy.deepcopy(m).config == m.config


def test_reconfigure_does_what_each_change_needs():
    from nemo_fp8_recipes.options import KernelOptions

    torch.manual_seed(0)
    x = torch.randn(16, 32)
    # telemetry off drops what was recorded and not collected
    m = Float8Linear.from_linear(nn.Linear(32, 32), get_recipe("tensorwise"), emulate=True)
    m.reconfigure(telemetry=True)
    m(x)
    m.reconfigure(telemetry=False)
    assert m.pop_telemetry() == {}
    # the compiled weight cache: buffers on, re-quantised when the kernels change, freed off
    m.reconfigure(graph_weight_cache=True)
    cached = {n for n, _ in m.named_buffers() if n in Float8Linear.GRAPH_WEIGHT_CACHE_BUFFERS}
    assert cached and not m.graph_weight_cache_stale()
    with torch.no_grad():
        m.weight.mul_(2)
    assert m.graph_weight_cache_stale()
    m.reconfigure(kernel_options=KernelOptions(triton=False))
    assert not m.graph_weight_cache_stale()
    m.reconfigure(graph_weight_cache=False)
    assert not any(n in Float8Linear.GRAPH_WEIGHT_CACHE_BUFFERS for n, _ in m.named_buffers())
    # delayed scaling: leaving lazy commits the pending amaxes; entering it from step appends what
    # the step accumulated (nothing is lost either way)
    d = Float8Linear.from_linear(nn.Linear(32, 32, bias=False), get_recipe("delayed", amax_history_len=4), emulate=True)
    d(x)
    assert d.fp8_pending[0].item() == 1.0
    d.reconfigure(scaling_update="step")
    assert d.fp8_amax_history[0, 0].item() == x.abs().max().item() and d.fp8_pending.sum().item() == 0.0
    d(3 * x)
    d(2 * x)
    d.reconfigure(scaling_update="lazy")
    assert d.fp8_amax_history[0, :2].tolist() == [(3 * x).abs().max().item(), x.abs().max().item()]
    assert d.fp8_pending.sum().item() == 0.0 and d.fp8_amax_pending.sum().item() == 0.0


def test_convert_model_takes_the_settings_once_as_the_wrappers_set_them():
    from nemo_fp8_recipes.nn import (
        apply_kernel_options,
        set_amax_reduce_fn,
        set_delayed_scaling_update,
        set_graph_weight_cache,
        set_wgrad_accumulation_fusion,
    )
    from nemo_fp8_recipes.options import KernelOptions

    def fn(t):
        return t

    opts = KernelOptions(shared_input=False)
    settings = dict(telemetry=True, fuse_wgrad_accumulation=True, scaling_update="step", amax_reduce_fn=fn)
    torch.manual_seed(0)
    once = TinyLlama()
    after = TinyLlama()
    after.load_state_dict(once.state_dict())
    convert_model(once, "tensorwise", options=opts, graph_weight_cache=True, **settings)
    configs = {id(m.config): m.config for m in fp8_modules(once).values()}
    assert len(configs) == 1  # one config, built once, shared by every FP8 linear
    (cfg,) = configs.values()
    assert cfg.kernel_options is opts and cfg.graph_weight_cache and cfg.recipe.name == "tensorwise"
    assert all(getattr(cfg, k) == v for k, v in settings.items())
    assert "layers.0.feed_forward.w1._fp8_wcache_fprop_data" in once._ddp_params_and_buffers_to_ignore
    # the thin wrappers reach the same config
    convert_model(after, "tensorwise")
    apply_kernel_options(after, opts)
    set_telemetry(after, True)
    set_wgrad_accumulation_fusion(after)
    set_amax_reduce_fn(after, fn)
    assert set_graph_weight_cache(after) == len(fp8_modules(after))
    assert set_delayed_scaling_update(after, "step") == 0  # (delayed-scaling modules only)
    after_cfgs = {m.config.replace(scaling_update="step") for m in fp8_modules(after).values()}
    assert after_cfgs == {cfg}
    loss_once, loss_after = step(once), step(after)
    assert torch.equal(loss_once, loss_after)
    assert collect_telemetry(once) == collect_telemetry(after)
    # a bad setting is refused before the model changes
    model = TinyLlama()
    with pytest.raises(ValueError, match="for current scaling"):
        convert_model(model, "delayed", graph_weight_cache=True)
    with pytest.raises(ValueError, match="valid modes: lazy, step"):
        convert_model(model, "delayed", scaling_update="per-step")
    assert not fp8_modules(model)
