"""Megatron-Core integration with the real megatron-core (CPU): every recipe's TransformerConfig
fields pass Megatron's own validation, our messages come before Megatron's for the combinations
it rejects, the per-module BF16 overrides parse with Megatron's quantization-config parser and hit
the intended modules of a real GPTModel, the native FP8 swap keeps Megatron's (output, bias)
contract, and the TE run-time hooks apply and audit the policy on a real module tree."""

from __future__ import annotations

import collections
import importlib.util
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.megatron_utils import build_tiny_gpt_model, megatron_available, teardown_megatron

from nemo_fp8_recipes import (
    PolicyViolation,
    PrecisionPolicy,
    audit,
    get_recipe,
    list_recipes,
    megatron_config,
)
from nemo_fp8_recipes.integrations.megatron import (
    DELAYED_FIRST_LAST_MSG,
    MEGATRON_FP8_FIELDS,
    Float8MegatronLinear,
    convert_megatron_model,
)
from nemo_fp8_recipes.integrations.te import TEUnsupportedError

_OK, _WHY = megatron_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_WHY), pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[2]
BASE = dict(
    num_layers=4,
    hidden_size=128,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    use_cpu_initialization=True,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron_state():
    yield
    if _OK:
        teardown_megatron()


def tcfg(**fields):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{**BASE, **fields})


@pytest.mark.parametrize("recipe", list_recipes())
@pytest.mark.parametrize(
    "policy",
    [
        PrecisionPolicy(),
        PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1),
        PrecisionPolicy(attention_projections="bf16", exclude=("*.mlp.linear_fc2",)),
    ],
    ids=["default", "first_last", "attn_bf16_exclude"],
)
def test_every_recipe_builds_a_valid_transformer_config(recipe, policy):
    r = get_recipe(recipe)
    if r.is_delayed and (policy.first_layers_bf16 or policy.last_layers_bf16):
        with pytest.raises(ValueError, match="Megatron-Core rejects first_last_layers_bf16"):
            megatron_config(r, policy)
        return
    mc = megatron_config(r, policy, num_layers=4)
    from nemo_fp8_recipes.integrations.megatron import transformer_config_field_names

    assert set(mc) <= transformer_config_field_names()
    cfg = tcfg(**mc.transformer_config_kwargs())  # Megatron's __post_init__ validation runs here
    assert cfg.moe_router_dtype == "fp32"
    assert cfg.fp8_dot_product_attention is False and cfg.fp8_multi_head_attention is False
    if not r.is_fp8:
        assert cfg.fp8 is None
        return
    assert set(MEGATRON_FP8_FIELDS) == set(mc)  # every FP8 field pinned, none left to Megatron
    assert cfg.fp8_recipe == recipe and cfg.fp8 == ("hybrid" if r.is_hybrid else "e4m3")
    assert cfg.fp8_wgrad is True
    if r.is_delayed:  # TE's defaults, not Megatron's (1 / most_recent)
        assert (cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo, cfg.fp8_margin) == (1024, "max", 0)
    assert cfg.first_last_layers_bf16 == bool(policy.first_layers_bf16 or policy.last_layers_bf16)
    assert (cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16) == (
        policy.first_layers_bf16,
        policy.last_layers_bf16,
    )
    if policy.attention_projections == "bf16":
        assert cfg.quant_recipe is not None and mc.te_precision_config is not None
    else:
        assert mc.te_precision_config is None


def test_our_message_comes_before_megatrons_own_rejections():
    # Megatron's own check (the trap) ...
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer in BF16"):
        tcfg(fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=True)
    # ... and ours, which names the way out, comes first
    with pytest.raises(ValueError) as e:
        megatron_config("delayed", PrecisionPolicy(first_layers_bf16=1))
    assert str(e.value) == DELAYED_FIRST_LAST_MSG and "recipe=tensorwise" in str(e.value)
    with pytest.raises(ValueError, match="must be between 0 and number of layers per pipeline stage"):
        tcfg(
            fp8="hybrid",
            fp8_recipe="tensorwise",
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=3,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.bfloat16,
        )
    with pytest.raises(ValueError, match="exceeds the 2 layers per pipeline stage"):
        megatron_config(
            "tensorwise", PrecisionPolicy(first_layers_bf16=3), num_layers=4, pipeline_model_parallel_size=2
        )
    # Megatron builds the TE recipe itself: knobs it cannot pass are refused, not dropped
    with pytest.raises(TEUnsupportedError, match="weight_granularity=1x128"):
        megatron_config(get_recipe("blockwise", weight_granularity="1x128"))
    with pytest.raises(TEUnsupportedError, match="default GEMM accumulation"):
        megatron_config(get_recipe("tensorwise", wgrad={"fast_accum": True}))


def test_moe_fields_and_the_no_te_crash_are_handled():
    moe = dict(num_moe_experts=4, moe_router_topk=2)
    # the native backend's fields construct a MoE config without TE, router in FP32
    cfg = tcfg(**moe, **megatron_config("blockwise", backend="native"))
    assert cfg.fp8 is None and cfg.moe_router_dtype == "fp32"
    te_fields = megatron_config("blockwise")
    if importlib.util.find_spec("transformer_engine") is None:
        # megatron-core compares the (missing) TE version in __post_init__; our validator explains it
        with pytest.raises(TypeError):
            tcfg(**moe, **te_fields)
        from nemo_fp8_recipes import validate

        rep = validate("blockwise", backend="te", model={"num_moe_experts": 4, "hidden_size": 128})
        assert "moe-fp8-no-te" in rep.codes("warning") and "no-te" in rep.codes("warning")
    else:
        tcfg(**moe, **te_fields)


@pytest.fixture(scope="module")
def gpt():
    return build_tiny_gpt_model(num_layers=4)


def test_te_precision_config_matches_the_intended_megatron_modules(gpt, tmp_path):
    from megatron.core.quantization.utils import (
        get_quant_config_or_none,
        load_quantization_recipe,
    )

    pol = PrecisionPolicy(attention_projections="bf16", exclude=("*.layers.2.mlp.linear_fc1",))
    mc = megatron_config("blockwise", pol)
    path = mc.write_te_precision_config(tmp_path / "te_precision.yaml")
    recipe = load_quantization_recipe(str(path))  # Megatron's own parser (--te-precision-config-file)
    hit = {n for n, _ in gpt.named_modules() if get_quant_config_or_none(n, recipe) is not None}
    want = {f"decoder.layers.{i}.self_attention.{p}" for i in range(4) for p in ("linear_qkv", "linear_proj")}
    assert hit == want | {"decoder.layers.2.mlp.linear_fc1"}
    qc = get_quant_config_or_none("decoder.layers.0.self_attention.linear_qkv", recipe)
    assert qc.config == {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}
    try:  # TE's parser of the per-module config lives in megatron's TE extension
        from megatron.core.extensions.transformer_engine import TEQuantizationParams
    except Exception:  # noqa: BLE001 - TE absent
        TEQuantizationParams = None
    if TEQuantizationParams is not None:
        params = TEQuantizationParams.parse_from_config(qc)
        assert params.training_recipe.fp8_quantization_recipe is None  # = BF16 for this module
    assert "--te-precision-config-file" in mc.cli_args(str(path))
    assert mc.cli_args(str(path))[:4] == ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]


@pytest.fixture(scope="module")
def swapped_pair():
    pol = PrecisionPolicy(first_layers_bf16=1)
    model = build_tiny_gpt_model(num_layers=4, seed=11)
    ref = build_tiny_gpt_model(num_layers=4, seed=11)
    params = {n: p for n, p in model.named_parameters()}
    convert_megatron_model(model, "tensorwise", pol)
    return model, ref, params


def test_native_swap_keeps_parameters_and_megatrons_contract(swapped_pair):
    model, ref, params = swapped_pair
    assert {n: p for n, p in model.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    l1, r1 = model.decoder.layers[1], ref.decoder.layers[1]
    for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert isinstance(l1.get_submodule(name), Float8MegatronLinear), name
    assert not isinstance(model.decoder.layers[0].mlp.linear_fc1, Float8MegatronLinear)  # first layer BF16
    assert not isinstance(model.output_layer, Float8MegatronLinear)  # output head BF16
    x = torch.randn(16, 2, 128)
    # linear_qkv: skip_bias_add=False -> bias added inside, None returned
    out, b = l1.self_attention.linear_qkv(x)
    ref_out, ref_b = r1.self_attention.linear_qkv(x)
    assert b is None and ref_b is None
    assert (out - ref_out).norm() / ref_out.norm() < 0.1
    # linear_proj: skip_bias_add=True -> the same bias Parameter returned, not added
    out, b = l1.self_attention.linear_proj(x)
    ref_out, ref_b = r1.self_attention.linear_proj(x)
    assert b is l1.self_attention.linear_proj.bias and torch.equal(b, ref_b)
    assert (out - ref_out).norm() / ref_out.norm() < 0.1
    # a whole Megatron MLP (fc1 -> activation -> fc2) runs through the swapped layers
    y, yb = l1.mlp(x)
    ry, ryb = r1.mlp(x)
    assert torch.equal(yb, ryb) and (y - ry).norm() / ry.norm() < 0.1
    (y.float().sum() + yb.sum()).backward()
    assert l1.mlp.linear_fc1.weight.grad is not None and l1.mlp.linear_fc2.bias.grad is not None


def test_native_swap_audit_over_the_megatron_tree(swapped_pair):
    model, _, _ = swapped_pair
    y, yb = model.decoder.layers[1].mlp(torch.randn(16, 2, 128))  # its own step: any test order
    (y.float().sum() + yb.sum()).backward()
    rep = audit(model, strict=True)
    rows = {r.name: r for r in rep.rows}
    assert rows["decoder.layers.1.mlp.linear_fc1"].precision == "fp8"
    assert rows["decoder.layers.1.mlp.linear_fc1"].fp8_gemms["fprop"] >= 1
    assert rows["decoder.layers.0.mlp.linear_fc1"].precision == "bf16"
    assert "first 1" in rows["decoder.layers.0.mlp.linear_fc1"].reason
    assert rows["output_layer"].role == "output" and rows["output_layer"].precision == "bf16"
    assert rows["embedding.word_embeddings"].role == "embedding"
    assert rows["decoder.layers.1.self_attention.core_attention"].precision == "bf16"
    assert not rep.violations and rep.counts["fp8"]["wgrad"] >= 2
    # tensorwise keeps no scaling state: only the per-rank GEMM counters (FP8 and high-precision
    # ones) stay out of DDP's broadcast, and every name is a buffer the model has
    ignored = model._ddp_params_and_buffers_to_ignore
    assert ignored and all(
        n.endswith((".fp8_fwd_count", ".fp8_bwd_count", ".hp_fwd_count", ".hp_bwd_count")) for n in ignored
    )
    buffers = dict(model.named_buffers())
    assert all(n in buffers for n in ignored)
    assert "decoder.layers.1.mlp.linear_fc1.fp8_fwd_count" in ignored
    assert "decoder.layers.1.mlp.linear_fc1.hp_fwd_count" not in ignored  # swapped to FP8
    assert "output_layer.hp_bwd_count" in ignored


def test_native_swap_moe_keeps_router_fp32_and_refuses_parallel_layers():
    model = build_tiny_gpt_model(num_layers=2, moe=True, seed=5)
    convert_megatron_model(model, "delayed")
    ignored = set(model._ddp_params_and_buffers_to_ignore)  # per-rank delayed-scaling state
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.fp8_amax_history" in ignored
    assert not any(n.endswith("weight") for n in ignored)
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp.experts.local_experts[0].linear_fc1, Float8MegatronLinear)
    assert type(mlp.router).__name__ == "TopKRouter" and mlp.router.weight.dtype == torch.float32
    rows = {r.name: r for r in audit(model).rows}
    assert rows["decoder.layers.0.mlp.router"].precision == "fp32"
    other = build_tiny_gpt_model(num_layers=1, seed=6)
    other.decoder.layers[0].mlp.linear_fc1.sequence_parallel = True
    with pytest.raises(ValueError, match="sequence_parallel=True.*tensor_model_parallel_size=1"):
        convert_megatron_model(other, "tensorwise")


def test_native_swap_takes_the_linear_settings_of_convert_model():
    """convert_megatron_model passes convert_model's per-linear settings to every swapped layer."""
    from nemo_fp8_recipes.options import KernelOptions

    model = build_tiny_gpt_model(num_layers=1, seed=7)
    opts = KernelOptions(triton=False)
    convert_megatron_model(model, "delayed", options=opts, telemetry=True, scaling_update="step")
    swapped = [m for m in model.modules() if isinstance(m, Float8MegatronLinear)]
    assert swapped
    for m in swapped:
        assert m.config.telemetry and m.config.scaling_update == "step" and m.config.kernel_options == opts
    with pytest.raises(ValueError, match="unknown delayed-scaling update mode .often.; valid modes: lazy, step"):
        convert_megatron_model(build_tiny_gpt_model(num_layers=1, seed=8), "delayed", scaling_update="often")


def _counting_policy(calls, **kw):
    """A PrecisionPolicy that counts its ``decide`` calls per module name into ``calls``."""

    class CountingPolicy(PrecisionPolicy):
        def decide(self, fqn, module=None, recipe=None, shape=None):
            calls[fqn] += 1
            return super().decide(fqn, module, recipe=recipe, shape=shape)

    return CountingPolicy(**kw)


def test_native_swap_decides_each_module_once_and_checks_alignment_on_the_weight():
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    from nemo_fp8_recipes.nn.convert import conversion_state

    model = build_tiny_gpt_model(num_layers=2, ffn_hidden_size=200, seed=9)
    names = {n for n, _ in model.named_modules() if n}
    linears = {n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    calls = collections.Counter()
    convert_megatron_model(model, "tensorwise", _counting_policy(calls))
    assert set(calls) == names and set(calls.values()) == {1}  # one decision per module
    state = conversion_state(model)
    # the swapped layers carry no high-precision counter (none was installed on them, then dropped)
    swapped = {n for n in linears if isinstance(model.get_submodule(n), Float8MegatronLinear)}
    assert swapped == {
        f"decoder.layers.{i}.self_attention.{p}" for i in range(2) for p in ("linear_qkv", "linear_proj")
    }
    assert not swapped & set(state.hp_modules) and len(state.hooks) == len(state.hp_modules)
    assert (linears - swapped) <= set(state.hp_modules)
    rows = {r.name: r for r in audit(model).rows}
    # ffn 200 is not a multiple of 16: the alignment check ran on the [out, in] weight shape
    assert (
        rows["decoder.layers.0.mlp.linear_fc1"].reason
        == "out_features=200 not divisible by 16 as tensorwise FP8 GEMMs need"
    )
    assert (
        rows["decoder.layers.0.mlp.linear_fc2"].reason
        == "in_features=200 not divisible by 16 as tensorwise FP8 GEMMs need"
    )
    assert rows["decoder.layers.1.self_attention.linear_qkv"].precision == "fp8"
    assert [r.name for r in audit(model).rows] == [n for n in calls if n in state.decisions]  # model order


# ---- TE run-time hooks, exercised on a real Megatron tree with a stand-in FP8 switch -------------
class _Switch:
    """A process-wide 'FP8 autocast' flag with enter/exit contexts (stands for TE's global state)."""

    def __init__(self):
        self.on = False

    @contextmanager
    def ctx(self, on):
        old, self.on = self.on, on
        try:
            yield
        finally:
            self.on = old


def test_te_hooks_apply_and_audit_the_policy_on_a_megatron_tree():
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    from nemo_fp8_recipes.integrations.callbacks import TEPrecisionHooks

    model = build_tiny_gpt_model(num_layers=4, seed=3)
    sw = _Switch()
    hooks = TEPrecisionHooks(
        "tensorwise",
        PrecisionPolicy(first_layers_bf16=1, exclude=("*.layers.2.mlp.linear_fc2",)),
        strict=True,
        telemetry=True,
        is_te=lambda m: isinstance(m, (ColumnParallelLinear, RowParallelLinear)),
        fp8_state=lambda: (sw.on, "Float8CurrentScaling" if sw.on else None),
        disable_fp8=lambda: sw.ctx(False),
    )
    hooks.attach([model])  # Megatron passes a list of model chunks
    x = torch.randn(8, 2, 128)
    with sw.ctx(True):  # the run's FP8 autocast
        for i in range(4):
            model.decoder.layers[i].mlp(x)
    rep = hooks.check()
    rows = {r.name: r for r in rep.rows}
    assert rows["decoder.layers.1.mlp.linear_fc1"].fp8_calls == 1
    assert rows["decoder.layers.1.mlp.linear_fc1"].te_recipes == ["Float8CurrentScaling"]
    assert (
        rows["decoder.layers.0.mlp.linear_fc1"].decision == "bf16"
        and rows["decoder.layers.0.mlp.linear_fc1"].fp8_calls == 0
    )
    assert (
        rows["decoder.layers.2.mlp.linear_fc2"].fp8_calls == 0
        and rows["decoder.layers.2.mlp.linear_fc1"].fp8_calls == 1
    )
    assert rows["output_layer"].decision == "bf16" and not rep.violations
    tel = hooks.collect_telemetry()
    assert tel["fp8/mlp/input/amax"] > 0  # the native backend's tags and groups
    # a wrapper that fails to disable FP8 is caught (strict)
    hooks.detach()
    bad = TEPrecisionHooks(
        "tensorwise",
        PrecisionPolicy(first_layers_bf16=1),
        strict=True,
        is_te=lambda m: isinstance(m, (ColumnParallelLinear, RowParallelLinear)),
        fp8_state=lambda: (sw.on, "Float8CurrentScaling"),
        disable_fp8=lambda: sw.ctx(True),
    )
    bad.attach(model)
    with sw.ctx(True):
        model.decoder.layers[0].mlp(x)
    with pytest.raises(PolicyViolation, match="decoder.layers.0.mlp.linear_fc1"):
        bad.check()
    bad.detach()
    assert "_nemo_fp8_orig_forward" not in vars(model.decoder.layers[0].mlp.linear_fc1)


def _benchmark_module():
    spec = importlib.util.spec_from_file_location(
        "megatron_native_train", REPO / "benchmarks" / "megatron_native_train.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_builds_converts_and_audits_on_cpu(capsys):
    mod = _benchmark_module()
    rc = mod.main(
        [
            "--steps",
            "0",
            "--recipes",
            "blockwise",
            "--layers",
            "3",
            "--hidden",
            "256",
            "--ffn",
            "512",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--seq",
            "128",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "blockwise" in out and "decoder.layers.1.mlp.linear_fc1" in out
    assert "layer 0 is among the first 1 kept in BF16" in out and "last 1 of 3" in out
    assert mod.main(["--steps", "2", "--device", "cpu"]) == 2  # training steps need CUDA, said clearly


def test_megatron_native_train_flops_follow_megatrons_formula():
    """Megatron-LM's model FLOPs (``num_floating_point_operations``, core_v0.19.0): Llama 3 8B at
    sequence 8192 is 51.47 GFLOP per token — GEMM weights 6·7.5047e9, causal attention 6·32·8192·4096."""
    flops = _benchmark_module().megatron_flops_per_token
    llama3_8b = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
    assert flops(**llama3_8b, seq=8192) == 51_470_401_536
    # the attention term grows linearly with the sequence; GQA shrinks only the K/V projections
    assert flops(**llama3_8b, seq=8192) - flops(**llama3_8b, seq=4096) == 6 * 32 * 4096 * 4096
    mha = flops(**{**llama3_8b, "kv_heads": 32}, seq=8192) - flops(**llama3_8b, seq=8192)
    assert mha == 6 * 32 * 4096 * 2 * (4096 - 1024)
    assert flops(**llama3_8b, seq=8192, gated=False) == flops(**llama3_8b, seq=8192) - 6 * 32 * 4096 * 14336


def test_megatron_native_train_te_ways_are_labelled_and_refused_without_te(capsys, monkeypatch):
    """``--impl te`` is Megatron's way (BF16 parameters, FP32 master weights); ``te-fp32params`` is the
    labelled variant. Without Transformer Engine or a GPU both are refused with the reason, and the
    gradient-accumulation fusion says why it is off."""
    mod = _benchmark_module()
    assert mod.PARAMS == {"native": "fp32", "te": "bf16+fp32-master", "te-fp32params": "fp32"}
    assert "not how Megatron trains" in mod.IMPLS["te-fp32params"]
    args = mod.parse_args(["--impl", "te-fp32params"])
    assert args.impl == "te-fp32params" and not args.grad_reduce_in_fp32 and args.grad_accum_fusion == "auto"
    with pytest.raises(SystemExit):
        mod.parse_args(["--impl", "megatron"])
    assert "invalid choice: 'megatron'" in capsys.readouterr().err
    import nemo_fp8_recipes.integrations.te as te_mod

    monkeypatch.setattr(te_mod, "te_available", lambda: (False, "transformer_engine is not installed"))
    for impl in ("te", "te-fp32params"):
        assert mod.main(["--impl", impl, "--steps", "1", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert f"--impl {impl} needs Transformer Engine on a CUDA GPU (transformer_engine is not installed)" in err
    assert mod.grad_accum_fusion_setting("auto") == (False, "Transformer Engine is not importable")
    assert mod.grad_accum_fusion_setting("off") == (False, "--grad-accum-fusion off")
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))
    on, why = mod.grad_accum_fusion_setting("auto")
    assert on == (importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)
    assert on or "fused_weight_gradient_mlp_cuda is not importable" in why


def test_megatron_native_train_runs_recipes_in_processes_of_their_own(capsys):
    """The TE ways train each recipe in a child process (Megatron's DDP and distributed optimizer
    outlive a run in-process); the children's results merge into one ``runs`` table. Exercised here
    with the native build (``--steps 0``), which runs on CPU."""
    mod = _benchmark_module()
    shape = ["--layers", "3", "--hidden", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--seq", "128"]
    rc, out = mod.run_recipes_apart(["--steps", "0", "--device", "cpu", *shape], ["bf16", "blockwise"])
    assert rc == 0 and list(out["runs"]) == ["bf16", "blockwise"] and out["device"] == "cpu"
    assert {r["params"] for r in out["runs"].values()} == {"fp32"}
    assert out["runs"]["bf16"]["audit"]["fp8_modules"] == 0 < out["runs"]["blockwise"]["audit"]["fp8_modules"]
    rc, out = mod.run_recipes_apart(["--steps", "0", "--device", "cpu", *shape], ["bf16", "nope"])
    assert rc != 0 and list(out["runs"]) == ["bf16"]
    assert "recipe nope failed" in capsys.readouterr().err
