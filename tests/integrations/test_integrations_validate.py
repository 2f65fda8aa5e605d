"""The pre-launch validator: every trap of docs/megatron.md gets its own actionable message (and, where
Megatron-Core itself would reject the combination, ours comes first), the effective settings
table, and the ``nemo-fp8-check`` CLI with Hydra overrides like the trainer."""

from __future__ import annotations

import json

import pytest

from nemo_fp8_recipes import PrecisionPolicy, get_recipe, validate
from nemo_fp8_recipes.integrations.validate import (
    ValidationError,
    main,
    parse_gpu,
    parse_overrides,
    split_overrides,
)

L8 = dict(dim=4096, ffn_dim=14336, num_heads=32, num_kv_heads=8, num_layers=32, arch="llama")  # Llama 3 8B
H100_129 = parse_gpu("h100", "12.9")
TE = dict(device=H100_129, model=L8, te_version="2.9")  # a cluster target: H100, CUDA 12.9, TE 2.9


def errors(rep):
    return {f.code: f.message for f in rep.errors}


def warns(rep):
    return {f.code: f.message for f in rep.warnings}


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
@pytest.mark.parametrize("backend", ["te", "megatron_bridge", "native"])
def test_clean_setups_pass(recipe, backend):
    rep = validate(
        recipe,
        PrecisionPolicy() if recipe == "delayed" else PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1),
        backend=backend,
        **TE,
    )
    assert rep.ok, rep.table()
    assert "OK to launch" in rep.table()


def test_delayed_with_first_last_bf16_layers():
    rep = validate("delayed", PrecisionPolicy(first_layers_bf16=1), backend="te", **TE)
    msg = errors(rep)["delayed-first-last"]
    assert "Megatron-Core rejects" in msg and "recipe=tensorwise" in msg and "policy.first_layers_bf16=0" in msg
    # via a Bridge override too
    rep = validate(
        "delayed", backend="megatron_bridge", overrides=["mixed_precision.first_last_layers_bf16=true"], **TE
    )
    assert "delayed-first-last" in errors(rep)
    # the native backend keeps first/last layers in BF16 with delayed scaling fine
    assert validate("delayed", PrecisionPolicy(first_layers_bf16=1), backend="native", **TE).ok


@pytest.mark.parametrize(
    "gpu, needle",
    [
        ("h100", "mxfp8 needs SM100"),
        ("h200", "found SM90"),
        ("rtx5090", "Transformer Engine does not support for MXFP8"),
    ],
)
def test_mxfp8_on_hopper_or_sm120(gpu, needle):
    rep = validate("mxfp8", backend="te", device=gpu, model=L8, te_version="2.9")
    msg = errors(rep)["hardware"]
    assert needle in msg and "exists only on backend=native" in msg
    assert "emulate=true for numerics only" not in msg  # TE cannot emulate: not offered there
    assert "hardware" in errors(validate("mxfp8", backend="native", device=gpu, model=L8))
    assert validate(get_recipe("mxfp8", emulate=True), backend="native", device=gpu, model=L8).ok
    assert validate("mxfp8", backend="te", device="b200", model=L8, te_version="2.9").ok


def test_blockwise_needs_cuda_12_9():
    rep = validate("blockwise", backend="megatron_bridge", device=parse_gpu("h100", "12.8"), model=L8, te_version="2.9")
    assert "needs CUDA >= 12.9" in errors(rep)["hardware"] and "found CUDA 12.8" in errors(rep)["hardware"]
    assert "--cuda" in warns(validate("blockwise", backend="te", device="h100", model=L8, te_version="2.9"))["hardware"]


def test_fp8_wgrad_false_is_a_noop():
    for backend, key in (("te", "model.fp8_wgrad"), ("megatron_bridge", "mixed_precision.fp8_wgrad")):
        rep = validate("tensorwise", backend=backend, overrides=[f"{key}=false"], **TE)
        assert "silently ignored by Transformer Engine >= 2.0" in errors(rep)["fp8-wgrad-noop"]


@pytest.mark.parametrize("backend", ["native", "te"])
def test_delayed_e4m3_gradients_with_a_margin_are_a_warning(backend):
    rep = validate(get_recipe("delayed", grad_format="e4m3", margin=4), backend=backend, **TE)
    msg = warns(rep)["recipe-numerics"]
    assert rep.ok and "margin=4" in msg and "flushes the later, smaller gradients to zero" in msg
    assert "recipe-numerics" not in warns(validate("delayed", backend=backend, **TE))


def test_delayed_with_megatrons_default_history_of_one():
    rep = validate("delayed", backend="te", overrides={"model.fp8_amax_history_len": 1}, **TE)
    msg = errors(rep)["delayed-history-1"]
    assert "Megatron's default history of 1" in msg and "1024/max" in msg
    rep = validate(get_recipe("delayed", amax_history_len=1, amax_compute_algo="most_recent"), backend="te", **TE)
    assert rep.ok and "delayed-history-1" in warns(rep)


def test_bridge_settings_that_setup_would_overwrite():
    rep = validate(
        "blockwise",
        backend="megatron_bridge",
        overrides=["model.fp8_recipe=delayed", "ddp.grad_reduce_in_fp32=false", "train.train_iters=10"],
        **TE,
    )
    clobber = [f.message for f in rep.errors if f.code == "bridge-clobber"]
    assert len(clobber) == 2
    assert any("model.fp8_recipe='delayed' would be silently overwritten" in m and "recipe=" in m for m in clobber)
    assert any("Use mixed_precision.grad_reduce_in_fp32=False instead" in m for m in clobber)
    rep = validate("blockwise", backend="megatron_bridge", overrides=["mixed_precision.fp8_recipe=tensorwise"], **TE)
    assert "contradicts recipe=blockwise" in errors(rep)["bridge-conflict"]
    rep = validate(
        "blockwise", backend="megatron_bridge", overrides=["mixed_precision=bf16_with_fp8_current_scaling_mixed"], **TE
    )
    assert "replaces the MixedPrecisionConfig" in errors(rep)["bridge-conflict"]
    # the same model.* key is a legitimate TransformerConfig override for plain Megatron-Core ...
    assert "bridge-clobber" not in errors(validate("blockwise", backend="te", overrides=["model.fp8_margin=0"], **TE))
    # ... but contradicting the recipe there is caught too
    assert "recipe-conflict" in errors(validate("blockwise", backend="te", overrides=["model.fp8=hybrid"], **TE))


def test_layer_dims_a_recipe_cannot_take():
    odd = dict(L8, ffn_dim=14300)  # multiple of 4, not of 16 / 128
    rep = validate("blockwise", backend="te", device=H100_129, model=odd, te_version="2.9")
    msgs = [f.message for f in rep.errors if f.code == "layer-dims"]
    assert any(m.startswith("*.mlp.linear_fc2: in_features=14300 not divisible by 128") for m in msgs)
    assert all("policy.exclude=" in m and "tensorwise: 16" in m for m in msgs)
    excluded = PrecisionPolicy(exclude=("*.mlp.linear_fc1", "*.mlp.linear_fc2"))
    assert validate("blockwise", excluded, backend="te", device=H100_129, model=odd, te_version="2.9").ok
    # native: the policy keeps such layers in BF16 itself: a warning, not an error
    rep = validate("blockwise", backend="native", device=H100_129, model=odd)
    assert rep.ok and "policy keeps it in BF16" in warns(rep)["layer-dims"]
    # Megatron names work as well as ours
    rep = validate(
        "mxfp8",
        backend="te",
        device="b200",
        te_version="2.9",
        model=dict(hidden_size=1000, ffn_hidden_size=4096, num_attention_heads=8, num_query_groups=8),
    )
    assert "not divisible by 32" in errors(rep)["layer-dims"]


def test_fp8_param_gather_without_distributed_optimizer():
    rep = validate(
        "tensorwise",
        backend="megatron_bridge",
        fp8_param_gather=True,
        overrides=["ddp.use_distributed_optimizer=false"],
        **TE,
    )
    assert "ddp.use_distributed_optimizer=true" in errors(rep)["fp8-param-gather"]
    assert validate("tensorwise", backend="megatron_bridge", fp8_param_gather=True, **TE).ok  # recipes turn it on
    rep = validate(
        "mxfp8",
        backend="megatron_bridge",
        device="b200",
        model=L8,
        te_version="2.9",
        overrides=["mixed_precision.fp8_param_gather=true"],
    )
    assert "reuse_grad_buf_for_mxfp8_param_ag" in errors(rep)["fp8-param-gather"]
    assert "fp8-param-gather" in warns(validate("tensorwise", backend="te", overrides=["model.fp8_param=true"], **TE))


def test_transformer_engine_presence_version_and_environment():
    rep = validate("tensorwise", backend="te", device=H100_129, model=L8, te_version="2.1")
    assert ">= 2.2" in errors(rep)["te-version"]
    assert (
        "fp8_autocast"
        in warns(validate("tensorwise", backend="te", device=H100_129, model=L8, te_version="2.5"))["te-version"]
    )
    rep = validate("blockwise", backend="te", environ={"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}, **TE)
    assert "TE reads it once at import" in errors(rep)["nvte-env"]
    rep = validate("tensorwise", backend="te", overrides=["model.transformer_impl=local"], **TE)
    assert "silent no-op" in errors(rep)["local-spec-fp8"]
    rep = validate("tensorwise", backend="te", overrides=["model.fp8_dot_product_attention=true"], **TE)
    assert "attention core" in errors(rep)["attention-fp8"]
    rep = validate(
        "tensorwise",
        backend="te",
        overrides=["model.moe_router_dtype=null"],
        device=H100_129,
        te_version="2.9",
        model=dict(L8, num_experts=8, moe_ffn_dim=2048),
    )
    assert "router-dtype" in errors(rep)
    rep = validate(get_recipe("blockwise", emulate=True), backend="te", **TE)
    assert "native-backend option" in errors(rep)["te-unexpressible"]


def test_layers_per_pipeline_stage_and_patterns():
    rep = validate(
        "tensorwise",
        PrecisionPolicy(first_layers_bf16=9),
        backend="te",
        overrides=["model.pipeline_model_parallel_size=4"],
        **TE,
    )
    assert "exceeds the 8 layers per pipeline stage" in errors(rep)["bf16-layers-per-stage"]
    rep = validate(
        "tensorwise",
        PrecisionPolicy(exclude=("decoder.layers.3.*",)),
        backend="te",
        overrides=["model.pipeline_model_parallel_size=2"],
        **TE,
    )
    assert "local module path" in warns(rep)["pp-layer-patterns"]
    assert "policy-include-te" in warns(
        validate("tensorwise", PrecisionPolicy(include=("output_layer",)), backend="te", **TE)
    )


def test_report_table_and_raise():
    rep = validate("delayed", PrecisionPolicy(attention_projections="bf16"), backend="megatron_bridge", **TE)
    t = rep.table()
    for needle in (
        "fp8_amax_history_len",
        "1024",
        "fp8_amax_compute_algo",
        "moe_router_dtype",
        "te_precision_config",
        "DelayedScaling(",
        "fp8_param_gather",
        "target SM90 (NVIDIA H100)",
    ):
        assert needle in t, needle
    bad = validate("delayed", PrecisionPolicy(last_layers_bf16=2), backend="te", **TE)
    with pytest.raises(ValidationError, match=r"\[delayed-first-last\]"):
        bad.raise_for_errors()
    assert rep.raise_for_errors() is rep
    assert json.loads(json.dumps(bad.to_dict()))["ok"] is False


def test_helpers():
    assert parse_gpu("H200").capability == (9, 0) and parse_gpu("gb200").sm == 100 and parse_gpu("sm120").sm == 120
    assert parse_gpu("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_gpu("v100x")
    assert parse_overrides(["+model.fp8_wgrad=false", "train.train_iters=10", "~x"]) == {
        "model.fp8_wgrad": False,
        "train.train_iters": 10,
    }
    ours, theirs = split_overrides(
        [
            "recipe=delayed",
            "model=llama3_8b",
            "model.num_layers=2",
            "model.fp8_wgrad=false",
            "policy.first_layers_bf16=1",
            "train.train_iters=5",
        ],
        backend="te",
    )
    assert ours == ["recipe=delayed", "model=llama3_8b", "model.num_layers=2", "policy.first_layers_bf16=1"]
    assert theirs == ["model.fp8_wgrad=false", "train.train_iters=5"]
    _, theirs = split_overrides(["backend=megatron_bridge", "model=llama3_8b", "model.num_layers=2"])
    assert theirs == ["model.num_layers=2"]  # Bridge's published recipe builds the model: its provider's field
    ours, _ = split_overrides(["backend=megatron_bridge", "model.num_layers=2"])
    assert "model.num_layers=2" in ours  # llama3_tiny is built from our config (backend.provider=auto -> ours)


def test_cli(capsys, tmp_path):
    out = tmp_path / "report.json"
    rc = main(
        [
            "--gpu",
            "h100",
            "--cuda",
            "12.9",
            "--te",
            "2.9",
            "--json",
            str(out),
            "recipe=delayed",
            "policy.first_layers_bf16=1",
            "backend=megatron_bridge",
            "model=llama3_8b",
            "mixed_precision.fp8_wgrad=false",
            "model.fp8_recipe=tensorwise",
            "train.train_iters=10",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1
    for code in ("delayed-first-last", "fp8-wgrad-noop", "bridge-clobber"):
        assert f"[{code}]" in text
    assert json.loads(out.read_text())["ok"] is False
    assert (
        main(
            [
                "--gpu",
                "h100",
                "--cuda",
                "12.9",
                "--te",
                "2.9",
                "recipe=blockwise",
                "backend=megatron_bridge",
                "model=llama3_70b",
                "policy.first_layers_bf16=1",
                "policy.last_layers_bf16=1",
            ]
        )
        == 0
    )
    assert "fp8_recipe" in capsys.readouterr().out
    assert (
        main(
            [
                "--gpu",
                "h100",
                "--megatron",
                "--te",
                "2.9",
                "recipe=tensorwise",
                "model=llama3_8b",
                "model.fp8_wgrad=false",
            ]
        )
        == 1
    )
    assert main(["recipe=fp4"]) == 2 and "Could not find 'recipe/fp4'" in capsys.readouterr().err
    assert main(["--gpu", "v100x"]) == 2
    assert main(["recipe=tensorwise", "train.train_iters=3"]) == 2  # native takes no framework overrides
    assert main(["--gpu", "h100", "recipe=mxfp8", "model=llama3_tiny"]) == 1  # native, Hopper, no emulate
    assert main(["--gpu", "h100", "recipe=mxfp8", "recipe.emulate=true", "model=llama3_tiny"]) == 0
