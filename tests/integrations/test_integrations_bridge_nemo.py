"""Megatron-Bridge and NeMo 2.x adapters without the packages: the MixedPrecisionConfig and
MegatronMixedPrecision arguments per recipe, the Hydra backend, the launcher's checks — and, where
the packages' pure-Python source is available (installed, or ``NEMO_FP8_BRIDGE_SRC`` /
``NEMO_FP8_NEMO_SRC`` pointing at unpacked wheels), our field names against theirs.

Megatron-Bridge needs Python >= 3.12 and NeMo 2.x its own stack, so the real-object tests skip
here with the reason."""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from nemo_fp8_recipes import PrecisionPolicy, get_recipe, list_recipes
from nemo_fp8_recipes.config import compose_config, list_group_options
from nemo_fp8_recipes.integrations import bridge, nemo2
from nemo_fp8_recipes.integrations.bridge import launch as bridge_launch
from nemo_fp8_recipes.integrations.validate import validate_config
from nemo_fp8_recipes.integrations.validate_checks import (
    BRIDGE_MIXED_PRECISION_FIELDS,
    RECIPE_OWNED_FIELDS,
)

# Megatron-Bridge 0.6.2 MixedPrecisionConfig defaults that FP8 runs must not inherit
BRIDGE_DEFAULTS = {
    "fp8_recipe": "tensorwise",
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
}


def _src(env: str, module: str, rel: str):
    root = os.environ.get(env)
    if root:
        p = Path(root) / rel
        return p if p.is_file() else None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]).parent / rel
    return p if p.is_file() else None


BRIDGE_SRC = _src("NEMO_FP8_BRIDGE_SRC", "megatron.bridge", "megatron/bridge/training/mixed_precision.py")
NEMO_SRC = _src("NEMO_FP8_NEMO_SRC", "nemo", "nemo/lightning/pytorch/plugins/mixed_precision.py")


@pytest.mark.parametrize("recipe", list_recipes())
def test_bridge_mixed_precision_per_recipe(recipe):
    r = get_recipe(recipe)
    pol = PrecisionPolicy() if r.is_delayed else PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=2)
    kw = bridge.bridge_mixed_precision_kwargs(r, pol)
    assert set(kw) <= set(BRIDGE_MIXED_PRECISION_FIELDS)
    assert kw["bf16"] is True and kw["params_dtype"] is torch.bfloat16 and kw["grad_reduce_in_fp32"] is True
    if not r.is_fp8:
        assert kw["fp8"] is None
        return
    owned = set(RECIPE_OWNED_FIELDS) - {"fp4"}
    assert owned <= set(kw), owned - set(kw)  # nothing the recipe owns is left to Bridge's defaults
    assert kw["fp8_recipe"] == recipe and kw["fp8"] == ("hybrid" if r.is_hybrid else "e4m3")
    if r.is_delayed:
        assert (kw["fp8_amax_history_len"], kw["fp8_amax_compute_algo"]) == (1024, "max")
        assert kw["fp8_amax_history_len"] != BRIDGE_DEFAULTS["fp8_amax_history_len"]
    else:
        assert (kw["first_last_layers_bf16"], kw["num_layers_at_start_in_bf16"], kw["num_layers_at_end_in_bf16"]) == (
            True,
            1,
            2,
        )
    assert kw["fp8_dot_product_attention"] is False and kw["fp8_wgrad"] is True
    exp = bridge.expected_model_fields(r, pol)
    assert exp["moe_router_dtype"] == "fp32" and exp["fp8_recipe"] == recipe


def test_bridge_fp8_param_gather_and_model_fields():
    kw = bridge.bridge_mixed_precision_kwargs("mxfp8", fp8_param_gather=True)
    assert kw["fp8_param"] and kw["fp8_param_gather"] and kw["reuse_grad_buf_for_mxfp8_param_ag"]
    assert not bridge.bridge_mixed_precision_kwargs("tensorwise", fp8_param_gather=True)[
        "reuse_grad_buf_for_mxfp8_param_ag"
    ]
    assert bridge.bridge_model_fields("blockwise") == {"moe_router_dtype": "fp32"}
    pytest.importorskip("megatron.core")
    mf = bridge.bridge_model_fields("blockwise", PrecisionPolicy(attention_projections="bf16"))
    assert type(mf["quant_recipe"]).__name__ == "RecipeConfig"  # megatron-core's parsed per-module config


def test_bridge_recipe_functions():
    assert bridge.bridge_recipe_name("llama3_8b") == "llama3_8b_pretrain_config"
    assert bridge.bridge_recipe_name("llama31_405b") == "llama31_405b_pretrain_config"
    assert bridge.bridge_recipe_name("moe_tiny", "deepseek_v3_pretrain_config") == "deepseek_v3_pretrain_config"
    with pytest.raises(ValueError, match="backend.recipe_fn=deepseek_v3_pretrain_config"):
        bridge.bridge_recipe_name("llama3_tiny")


def test_backend_group_and_bridge_config_validation():
    assert list_group_options("backend") == ["megatron_bridge", "native", "te"]
    assert compose_config().backend.name == "native"  # the default stays the embedded trainer
    cfg = compose_config(
        ["backend=megatron_bridge", "model=llama3_8b", "recipe=blockwise", "backend.fp8_param_gather=true"]
    )
    assert cfg.backend.recipe_fn is None and cfg.backend.fp8_param_gather is True
    rep = validate_config(cfg, ["model.fp8_recipe=delayed", "train.train_iters=10"], device="h100", te_version="2.9")
    assert "bridge-clobber" in rep.codes("error")
    rep = validate_config(cfg, ["train.train_iters=10"], device="h100", te_version="2.9")
    assert rep.ok and ("fp8_param_gather", "True", "backend") in rep.settings
    cfg = compose_config(["backend=megatron_bridge", "model=moe_tiny", "backend.recipe_fn=deepseek_v3_pretrain_config"])
    assert validate_config(cfg, [], device="h100", te_version="2.9").ok


def test_bridge_launcher_checks_before_importing_bridge(capsys):
    assert bridge.main(["--gpus", "h100", "model=llama3_tiny"]) == 2  # never handed to Bridge as an override
    assert "unknown option --gpus; the options are --gpu NAME" in capsys.readouterr().err
    assert bridge.main(["model=llama3_tiny", "--cuda"]) == 2
    assert "--cuda needs a value" in capsys.readouterr().err
    assert bridge.main(["--gpu", "h100", "--cuda", "twelve", "model=llama3_tiny"]) == 2
    assert "is not a CUDA version" in capsys.readouterr().err
    rc = bridge.main(["--gpu", "h100", "model=llama3_8b", "recipe=delayed", "policy.first_layers_bf16=1"])
    assert rc == 2 and "[delayed-first-last]" in capsys.readouterr().out
    rc = bridge.main(["--gpu", "h100", "model=llama3_tiny", "recipe=tensorwise", "backend.provider=recipe"])
    assert rc == 2 and "has no Megatron-Bridge pretraining recipe" in capsys.readouterr().err
    rc = bridge.main(["--gpu", "h100", "model=moe_tiny", "recipe=tensorwise"])
    assert rc == 2 and "cannot be built offline" in capsys.readouterr().err
    rc = bridge.main(["--gpu", "h100", "model=llama3_8b", "recipe=tensorwise", "trainer.max_steps=5"])
    assert rc == 2 and "trainer.* keys apply to backend.provider=ours" in capsys.readouterr().err
    if importlib.util.find_spec("megatron.bridge") is None:
        rc = bridge.main(["--gpu", "h100", "model=llama3_8b", "recipe=tensorwise", "train.train_iters=5"])
        assert rc == 2 and "needs Megatron-Bridge" in capsys.readouterr().err
        rc = bridge.main(["--gpu", "h100", "model=llama3_tiny", "recipe=tensorwise"])
        assert (
            rc == 2
            and "needs Megatron-Bridge" in capsys.readouterr().err
            and "backend.dry_run=true" in capsys.readouterr().err + "backend.dry_run=true"
        )


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_bridge_dry_run_of_our_model_needs_no_bridge_and_prints_the_fp8_settings(recipe, tmp_path, capsys):
    rc = bridge.main(
        [
            "--gpu",
            "h200",
            "--cuda",
            "12.9",
            "model=llama3_tiny",
            f"recipe={recipe}",
            "backend.dry_run=true",
            "trainer.max_steps=20",
            "model.num_layers=2",
            f"run.root={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "provider=ours" in out and f"fp8_recipe = {recipe}" in out
    kw = bridge.bridge_mixed_precision_kwargs(recipe)
    for k in ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"):
        assert f"    {k} = {kw[k]}" in out
    assert "num_layers=2" in out and "hidden_size=256" in out and "tokenizer_type': 'NullTokenizer'" in out
    assert "train.train_iters=20" in out and f"logger.tensorboard_dir={tmp_path}/llama3_tiny/{recipe}" in out
    assert not (tmp_path / "llama3_tiny").exists()  # a dry run writes nothing


def test_bridge_published_recipes_state_the_gpus_they_need(capsys):
    assert {k: v.gpus for k, v in bridge.PUBLISHED_RECIPES.items()} == {
        "llama3_8b": 2,
        "llama3_70b": 32,
        "llama31_405b": 256,
    }
    rc = bridge.main(
        ["--gpu", "h100", "--cuda", "12.9", "model=llama3_70b", "recipe=tensorwise", "backend.dry_run=true"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "llama3_70b_pretrain_config" in out and "gpus_per_replica=32" in out
    assert "one model replica needs 32 GPUs; this process group has 1" in out
    with pytest.raises(bridge.BridgeLaunchError, match="needs a multiple of 2 GPUs.*context parallel 2.*has 1"):
        bridge.check_world_size(1, 1, 2, "llama3_8b_pretrain_config", world=1)
    with pytest.raises(bridge.BridgeLaunchError, match="has 3"):
        bridge.check_world_size(1, 1, 2, "llama3_8b_pretrain_config", world=3)
    bridge.check_world_size(1, 1, 2, "llama3_8b_pretrain_config", world=4)


def test_bridge_provider_modes_and_model_overrides():
    from nemo_fp8_recipes.integrations.validate import split_overrides

    assert bridge.provider_mode("llama3_8b") == "recipe" and bridge.provider_mode("llama3_150m") == "ours"
    assert bridge.provider_mode("llama3_8b", "ours") == "ours"
    assert bridge.provider_mode("moe_tiny", "auto", "deepseek_v3_pretrain_config") == "recipe"
    with pytest.raises(bridge.BridgeLaunchError, match="choose one of: auto, recipe, ours"):
        bridge.provider_mode("llama3_8b", "hub")
    with pytest.raises(bridge.BridgeLaunchError, match="leave it unset"):
        bridge.provider_mode("llama3_8b", "ours", "llama3_8b_pretrain_config")
    # model.<our field> is ours when we build the model, Bridge's provider field otherwise
    ours, theirs = split_overrides(
        ["backend=megatron_bridge", "model=llama3_tiny", "model.num_layers=2", "model.recompute_granularity=full"],
        backend="megatron_bridge",
    )
    assert "model.num_layers=2" in ours and "model.recompute_granularity=full" in theirs
    ours, theirs = split_overrides(
        ["backend=megatron_bridge", "model=llama3_8b", "model.num_layers=2"], backend="megatron_bridge"
    )
    assert "model.num_layers=2" in theirs
    ours, theirs = split_overrides(
        ["backend=megatron_bridge", "model=llama3_8b", "backend.provider=ours", "model.num_layers=2"],
        backend="megatron_bridge",
    )
    assert "model.num_layers=2" in ours


def test_bridge_provider_fields_from_our_model_configs():
    from nemo_fp8_recipes.models.config import load_model_config

    m = load_model_config("llama31_405b")
    kw = bridge.provider_kwargs(
        m,
        seq_length=4096,
        tensor_parallel=8,
        pipeline_parallel=2,
        context_parallel=2,
        sequence_parallel=True,
        gradient_accumulation_fusion=False,
    )
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (126, 16384, 53248)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (128, 8, 128)
    assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == 8.0 and kw["rotary_base"] == 500000.0
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and not kw["add_bias_linear"]
    assert kw["share_embeddings_and_output_weights"] is False and kw["params_dtype"] is torch.bfloat16
    assert kw["pipeline_dtype"] is torch.bfloat16 and kw["sequence_parallel"] is True
    tiny = bridge.provider_kwargs(load_model_config("llama3_tiny"), seq_length=256)
    assert tiny["rope_scaling"] is False and tiny["pipeline_dtype"] is None and tiny["vocab_size"] == 512
    with pytest.raises(bridge.BridgeLaunchError, match="must divide model.num_heads"):
        bridge.provider_kwargs(load_model_config("llama3_tiny"), seq_length=256, tensor_parallel=3)
    with pytest.raises(bridge.BridgeLaunchError, match="needs backend.tensor_parallel >= 2"):
        bridge.provider_kwargs(load_model_config("llama3_tiny"), seq_length=256, sequence_parallel=True)
    with pytest.raises(bridge.BridgeLaunchError, match="only dense Llama"):
        bridge.provider_kwargs(load_model_config("moe_tiny"), seq_length=256)


def test_bridge_trainer_mapping_and_local_inputs(tmp_path, capsys):
    from pathlib import Path

    from nemo_fp8_recipes.config import trainer_config

    cfg = compose_config(
        [
            "backend=megatron_bridge",
            "model=llama3_150m",
            "trainer.max_steps=50",
            "trainer.ckpt_interval=0",
            "trainer.val_interval=0",
            "trainer.lr=1e-3",
        ]
    )
    got = dict(bridge.trainer_settings(trainer_config(cfg), Path("/runs/x")))
    assert got["train.train_iters"] == 50 and got["optimizer.lr"] == 1e-3 and got["scheduler.lr_decay_iters"] == 50
    assert got["checkpoint.save_interval"] == 50 and got["validation.eval_interval"] == 50
    assert got["logger.tensorboard_dir"] == "/runs/x" and got["checkpoint.save"] == "/runs/x/checkpoints"
    # trainer.checkpoint=false: Bridge saves nothing either (it saved at the end: ~39 GB at 8B width)
    off = dict(bridge.trainer_settings(trainer_config(compose_config(["trainer.checkpoint=false"])), Path("/r")))
    assert off["checkpoint.save"] is None and off["checkpoint.save_interval"] is None
    # a pass-through override wins over our mapping
    plan = bridge.launch_plan(cfg, ["train.train_iters=7"])
    assert "train.train_iters" not in dict(plan["settings"]) and plan["pass_through"] == ["train.train_iters=7"]
    # local data and tokenizer: refused with the fix when they are not there
    with pytest.raises(bridge.BridgeLaunchError, match="no Megatron indexed dataset there"):
        bridge.launch_plan(compose_config(["backend=megatron_bridge", f"+backend.data_path={tmp_path}/text"]))
    (tmp_path / "text.bin").write_bytes(b"")
    (tmp_path / "text.idx").write_bytes(b"")
    plan = bridge.launch_plan(compose_config(["backend=megatron_bridge", f"backend.data_path=[{tmp_path}/text]"]))
    assert plan["dataset"] == {"blend": [f"{tmp_path}/text"], "kind": "Megatron indexed dataset"}
    with pytest.raises(bridge.BridgeLaunchError, match="local Hugging Face tokenizer directory"):
        bridge.launch_plan(compose_config(["backend=megatron_bridge", f"backend.tokenizer={tmp_path}/nothing"]))


@pytest.mark.skipif(
    BRIDGE_SRC is None,
    reason="Megatron-Bridge source not found (needs Python >= 3.12 to install; "
    "set NEMO_FP8_BRIDGE_SRC to an unpacked megatron_bridge wheel)",
)
def test_against_megatron_bridge_source():
    tree = ast.parse(BRIDGE_SRC.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MixedPrecisionConfig")
    fields = {s.target.id: s.value for s in cls.body if isinstance(s, ast.AnnAssign)}
    assert tuple(fields) == BRIDGE_MIXED_PRECISION_FIELDS
    for k, v in BRIDGE_DEFAULTS.items():
        assert ast.literal_eval(fields[k]) == v, k
    root = BRIDGE_SRC.parents[1]  # .../megatron/bridge
    exported = ""
    for sub in ("recipes/llama/__init__.py", "recipes/deepseek/__init__.py"):
        exported += (root / sub).read_text()
    for fn in bridge.BRIDGE_RECIPES.values():
        assert f'"{fn}"' in exported, fn
    pretrain = (root / "training" / "pretrain.py").read_text()
    assert "callbacks:" in pretrain and "def pretrain(" in pretrain
    omc = (root / "training" / "utils" / "omegaconf_utils.py").read_text()
    assert "def process_config_with_overrides(" in omc and "cli_overrides" in omc


MCORE_SRC = Path(os.environ["NEMO_FP8_MCORE_SRC"]) if os.environ.get("NEMO_FP8_MCORE_SRC") else None


def _class_fields(path: Path, name: str) -> set:
    """Annotated fields of dataclass ``name`` in ``path`` (its own body, not its bases)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


@pytest.mark.skipif(
    BRIDGE_SRC is None or MCORE_SRC is None or not (MCORE_SRC / "megatron" / "training").is_dir(),
    reason="Megatron-Bridge and megatron-core 0.19 sources not found (set NEMO_FP8_BRIDGE_SRC and "
    "NEMO_FP8_MCORE_SRC to the unpacked megatron_bridge 0.6.2 / megatron_core 0.19.2 wheels)",
)
def test_the_offline_launcher_against_bridge_and_megatron_core_source():
    """Every field the launcher sets exists where it sets it: the provider's fields in
    GPTModelProvider / TransformerConfig / ModelParallelConfig, the trainer mapping's in Bridge's
    config classes; the published recipes' parallel layouts are the ones Bridge's recipe files
    set; the names the launcher imports exist."""
    from nemo_fp8_recipes.config import trainer_config
    from nemo_fp8_recipes.models.config import load_model_config

    broot = BRIDGE_SRC.parents[1]  # .../megatron/bridge
    mc = MCORE_SRC / "megatron"
    provider_fields = (
        _class_fields(broot / "models" / "gpt_provider.py", "GPTModelProvider")
        | _class_fields(mc / "core" / "transformer" / "transformer_config.py", "TransformerConfig")
        | _class_fields(mc / "core" / "model_parallel_config.py", "ModelParallelConfig")
    )
    for name in ("llama3_tiny", "llama3_150m", "llama31_405b"):
        kw = bridge.provider_kwargs(load_model_config(name), seq_length=256, gradient_accumulation_fusion=False)
        assert set(kw) <= provider_fields, sorted(set(kw) - provider_fields)
    classes = {
        "train": "TrainingConfig",
        "optimizer": None,
        "scheduler": "SchedulerConfig",
        "rng": "RNGConfig",
        "logger": "LoggerConfig",
        "validation": "ValidationConfig",
        "checkpoint": "CheckpointConfig",
        "dataset": None,
        "model": None,
    }
    src_all = "".join(p.read_text() for p in (mc / "training" / "config").glob("*.py"))
    opt_fields = _class_fields(mc / "core" / "optimizer" / "optimizer_config.py", "OptimizerConfig")
    ds_fields = (
        _class_fields(mc / "core" / "datasets" / "gpt_dataset.py", "GPTDatasetConfig")
        | _class_fields(mc / "core" / "datasets" / "blended_megatron_dataset_config.py", "BlendedMegatronDatasetConfig")
        | _class_fields(broot / "training" / "config.py", "GPTDatasetConfig")
    )
    cfg = compose_config(["backend=megatron_bridge", "model=llama3_tiny"])
    for key, _ in bridge.trainer_settings(trainer_config(cfg), Path("/r")):
        head, leaf = key.split(".", 1)
        if head == "optimizer":
            assert leaf in opt_fields, key
        elif head == "dataset":
            assert leaf in ds_fields, key
        elif head == "model":
            assert leaf in provider_fields, key
        else:
            cls = classes[head]
            assert f"class {cls}" in src_all and leaf in {
                f for p in (mc / "training" / "config").glob("*.py") for f in _class_fields_any(p, cls)
            }, key
    tok = _class_fields_any(mc / "training" / "config" / "training_config.py", "TokenizerConfig") | _class_fields_any(
        broot / "training" / "tokenizers" / "config.py", "TokenizerConfig"
    )
    for plan_tok in (
        {"tokenizer_type": "NullTokenizer", "vocab_size": 512},
        {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/t"},
    ):
        assert set(plan_tok) <= tok
    _check_offline_container_fields(broot, mc)
    assert (
        "from megatron.core.datasets.utils import compile_helpers" in (broot / "training" / "initialize.py").read_text()
    )
    h100 = (broot / "recipes" / "llama" / "h100" / "llama3.py").read_text()
    alias = (broot / "recipes" / "llama" / "llama3.py").read_text()
    for model, pub in bridge.PUBLISHED_RECIPES.items():
        impl = alias.split(f" as {pub.fn},")[0].rsplit("\n", 1)[-1].strip()
        body = h100.split(f"def {impl}(", 1)[1].split("\ndef ", 1)[0]
        for field, want in (
            ("tensor_model_parallel_size", pub.tensor_parallel),
            ("pipeline_model_parallel_size", pub.pipeline_parallel),
            ("context_parallel_size", pub.context_parallel),
        ):
            assert f"cfg.model.{field} = {want}\n" in body, (model, field)


def _check_offline_container_fields(broot: Path, mc: Path) -> None:
    """Every keyword ``_offline_container`` passes to a Bridge / megatron-core config class is a
    field of that class (or of the megatron-core class it extends)."""
    import inspect
    import textwrap

    fields: dict = {}
    files = [
        *broot.joinpath("training").rglob("*.py"),
        broot / "data" / "base.py",
        *(mc / "training").rglob("*.py"),
        *(mc / "core").rglob("*config*.py"),
        mc / "core" / "datasets" / "gpt_dataset.py",
    ]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                have = fields.setdefault(node.name, set())
                have.update(
                    s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                )
                for fn in node.body:  # a dataclass with its own __init__ (Bridge's GPTDatasetConfig)
                    if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                        have.update(a.arg for a in fn.args.args + fn.args.kwonlyargs)
    bases = {"GPTDatasetConfig": ("BlendedMegatronDatasetConfig", "DataloaderConfig")}
    tree = ast.parse(textwrap.dedent(inspect.getsource(bridge_launch._offline_container)))
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.keywords]
    assert len(calls) >= 10
    for call in calls:
        have = set(fields.get(call.func.id, set()))
        for b in bases.get(call.func.id, ()):
            have |= fields.get(b, set())
        used = {k.arg for k in call.keywords}
        assert have and used <= have, (call.func.id, sorted(used - have))


def _class_fields_any(path: Path, name: str) -> set:
    try:
        return _class_fields(path, name)
    except StopIteration:
        return set()


def _nemo_init_args(path: Path):
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "MegatronMixedPrecision")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return tuple(a.arg for a in init.args.args[1:])


@pytest.mark.skipif(
    NEMO_SRC is None,
    reason="NeMo 2.x source not found (not installed; set NEMO_FP8_NEMO_SRC to an unpacked nemo_toolkit 2.x wheel)",
)
def test_against_nemo2_source():
    args = _nemo_init_args(NEMO_SRC)
    assert any(set(args) == set(sig) for sig in nemo2.NEMO2_SIGNATURES.values()), args
    kw = nemo2.nemo2_mixed_precision_kwargs("blockwise" if "fp8_recipe" in args else "delayed", signature=args)
    assert set(kw) <= set(args)


@pytest.mark.parametrize("version", sorted(nemo2.NEMO2_SIGNATURES))
def test_nemo2_kwargs_follow_the_release(version):
    sig = nemo2.NEMO2_SIGNATURES[version]
    kw = nemo2.nemo2_mixed_precision_kwargs("delayed", signature=sig, fp8_param_gather=True)
    assert set(kw) <= set(sig) and kw["precision"] == "bf16-mixed"
    assert (kw["fp8"], kw["fp8_amax_history_len"], kw["fp8_amax_compute_algo"]) == ("hybrid", 1024, "max")
    spelling = "fp8_param_gather" if "fp8_param_gather" in sig else "fp8_params"
    assert kw[spelling] is True and ("fp8_params" not in kw or spelling == "fp8_params")
    if "fp8_recipe" in sig:
        kw = nemo2.nemo2_mixed_precision_kwargs("blockwise", PrecisionPolicy(first_layers_bf16=2), signature=sig)
        assert (kw["fp8_recipe"], kw["fp8"], kw["num_layers_at_start_in_bf16"]) == ("blockwise", "e4m3", 2)
    else:  # NeMo 2.1 / 2.2: delayed scaling only
        with pytest.raises(ValueError, match="NeMo 25.04"):
            nemo2.nemo2_mixed_precision_kwargs("tensorwise", signature=sig)
    assert nemo2.nemo2_model_overrides("tensorwise") == {"moe_router_dtype": "fp32"}


def test_lightning_callback():
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        with pytest.raises(ImportError, match="pip install lightning"):
            nemo2.nemo2_callbacks("tensorwise")
        pytest.skip("lightning not installed (NeMo 2.x ships it): the callback class was not built here")
    (cb,) = nemo2.nemo2_callbacks(
        "tensorwise",
        PrecisionPolicy(first_layers_bf16=1),
        strict=True,
        is_te=lambda m: isinstance(m, torch.nn.Linear),
        fp8_state=lambda: (False, None),
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    cb.setup(None, model, "fit")
    model(torch.randn(2, 16))
    assert cb.hooks.report().rows[0].calls == 1
    import types

    cb.on_train_batch_end(types.SimpleNamespace(global_step=1, logger=None), model, None, None, 0)
    assert cb.audit is not None and not cb.audit.violations
    cb.teardown(None, model)


def test_lightning_callback_attaches_to_a_model_built_after_setup():
    """NeMo 2 builds the Megatron model in ``configure_model``, after the callbacks' ``setup``:
    the callback attaches again at ``on_fit_start``, or it would audit nothing."""
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("lightning not installed (NeMo 2.x ships it): the callback class was not built here")
    (cb,) = nemo2.nemo2_callbacks(
        "tensorwise", strict=True, is_te=lambda m: isinstance(m, torch.nn.Linear), fp8_state=lambda: (True, "X")
    )
    pl_module = torch.nn.Module()
    cb.setup(None, pl_module, "fit")
    assert cb.hooks.report().rows == []
    pl_module.module = torch.nn.Sequential(torch.nn.Linear(16, 16))  # what configure_model does
    cb.on_fit_start(None, pl_module)
    pl_module.module(torch.randn(2, 16))
    (row,) = cb.hooks.report().rows
    assert (row.calls, row.fp8_calls) == (1, 1)


def _nemo_plugin_importable():
    try:
        from nemo.lightning.pytorch.plugins.mixed_precision import (
            MegatronMixedPrecision,  # noqa: F401
        )
    except Exception as e:  # noqa: BLE001 - any import failure: skip with it
        return (
            f"NeMo 2.x is not installed here ({type(e).__name__}: {e}); pip install nemo_toolkit==2.7.3 "
            "'megatron-core==0.15.3' 'lightning<=2.4' to run this"
        )
    return None


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8", "bf16"])
def test_nemo2_plugin_is_the_real_megatron_mixed_precision(recipe):
    """With a real NeMo 2 install: our arguments build NeMo's own MegatronMixedPrecision, and NeMo's
    own update_config_with_dtype_overrides puts every recipe-owned field on a real megatron-core
    TransformerConfig."""
    why = _nemo_plugin_importable()
    if why:
        pytest.skip(why)
    from megatron.core.transformer import TransformerConfig
    from nemo.lightning.pytorch.plugins.mixed_precision import (
        update_config_with_dtype_overrides,
    )

    pol = (
        PrecisionPolicy() if recipe in ("delayed", "bf16") else PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1)
    )
    plugin = nemo2.megatron_mixed_precision(recipe, pol)
    assert type(plugin).__name__ == "MegatronMixedPrecision"
    cfg = update_config_with_dtype_overrides(
        plugin.dtype_config,
        TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True),
    )
    want = bridge.expected_model_fields(recipe, pol)
    for k, v in want.items():
        if k == "moe_router_dtype":
            continue  # not a plugin field: nemo2_model_overrides sets it on the model config
        assert getattr(cfg, k) == v, (k, getattr(cfg, k), v)
    assert cfg.bf16 is True and cfg.params_dtype is torch.bfloat16


def _nemo2_smoke_script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "nemo2_smoke.py"
    spec = importlib.util.spec_from_file_location("nemo2_smoke", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NEMO2_STACK = {
    "nemo_toolkit": "2.7.3",
    "megatron-core": "0.15.3",
    "transformer_engine": "2.20.2",
    "lightning": "2.4.0",
    "torch": "2.11.0",
}


def test_nemo2_smoke_script_arguments_and_messages(monkeypatch, capsys):
    """scripts/nemo2_smoke.py before it imports NeMo: help, argument errors, the install checks
    and the recipe refusals (the run itself needs NeMo 2 and a GPU)."""
    smoke = _nemo2_smoke_script()
    with pytest.raises(SystemExit) as e:
        smoke.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for word in ("--recipes", "--steps", "--root", "scripts/nemo2_prepare.sh", "mxfp8 (Blackwell only)"):
        assert word in out, word
    assert smoke.main(["--recipes", "fp4"]) == 2
    assert "unknown recipe 'fp4'; the recipes are bf16, delayed" in capsys.readouterr().err
    assert smoke.main(["--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    monkeypatch.setattr(smoke, "stack_versions", lambda: dict(NEMO2_STACK, nemo_toolkit=None))
    assert smoke.main(["--recipes", "tensorwise"]) == 2
    assert "NeMo 2 (nemo_toolkit 2.x) is not installed here; prepare it with scripts/nemo2_prepare.sh" in (
        capsys.readouterr().err
    )
    for field, version, words in (
        ("nemo_toolkit", "3.0.0", "3.x has no nemo.collections.llm"),
        ("megatron-core", "0.19.2", "needs 0.15.x"),
        # (NeMo 2.7.3 on an H100 with 0.16.1: the model built, the optimizer setup raised TypeError)
        ("megatron-core", "0.16.1", "passes no_weight_decay_cond to get_megatron_optimizer"),
    ):
        why = smoke.nemo_install_problem(dict(NEMO2_STACK, **{field: version}))
        assert words in why and "scripts/nemo2_prepare.sh" in why
    assert smoke.nemo_install_problem(NEMO2_STACK) is None
    assert [smoke.recipe_problem(k, NEMO2_STACK) for k in smoke.HOPPER_RECIPES] == [None] * 4
    old_te = dict(NEMO2_STACK, transformer_engine="2.2.0")
    assert smoke.recipe_problem("tensorwise", old_te) is None
    assert "blockwise only with Transformer Engine >= 2.3; found 2.2.0" in smoke.recipe_problem("blockwise", old_te)
    # (the minimum is the one nemo-fp8-check applies: Megatron-Core builds delayed scaling with any TE)
    assert smoke.recipe_problem("delayed", dict(NEMO2_STACK, transformer_engine="1.13.0")) is None
    assert "mxfp8 only with Transformer Engine >= 2.1" in smoke.recipe_problem(
        "mxfp8", dict(old_te, transformer_engine="2.0")
    )
    assert ".te/install.sh" in smoke.recipe_problem("bf16", dict(NEMO2_STACK, transformer_engine=None))
    assert set(smoke.NEMO2_PRESETS) == set(list_recipes())  # NeMo 2.7 has a preset for every registry key


def _assignments(fn: ast.FunctionDef) -> dict:
    """``{"a.b.c": value}`` for every ``cfg.a.b.c = <value>`` in ``fn`` (any nesting; the last one
    wins; ``...`` for a value that is not a literal). ``env_vars`` dicts are kept as AST nodes."""

    def dotted(t):
        parts = []
        while isinstance(t, ast.Attribute):
            parts.append(t.attr)
            t = t.value
        return ".".join(reversed(parts)) if isinstance(t, ast.Name) and t.id == "cfg" else None

    out = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for t in node.targets:
            key = dotted(t)
            if not key:  # not cfg.<field>, or cfg itself
                continue
            if key == "env_vars":
                out[key] = node.value
                continue
            try:
                out[key] = ast.literal_eval(node.value)
            except ValueError:
                out[key] = ...
    return out


def _functions(path: Path) -> dict:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def _env(node: ast.Dict, common: dict) -> dict:
    env = {}
    for k, v in zip(node.keys, node.values):
        if k is None:  # **COMMON_..._ENV_VARS
            env.update(common)
        else:
            env[ast.literal_eval(k)] = ast.literal_eval(v)
    return env


#: Fields Bridge's H100 Llama 3 8B performance recipes set that are the run's own (parallel layout,
#: batch, run length, schedule, logging, checkpoints, tokenizer, data) or have no effect on a dense
#: model, so ``backend.perf`` leaves them to ``trainer.*`` / ``backend.*`` / pass-through overrides.
PERF_LEFT_TO_THE_RUN = {
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.context_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.sequence_parallel",
    "model.pipeline_model_parallel_layout",
    "model.pipeline_dtype",
    "model.seq_length",
    "model.should_pad_vocab",
    "model.moe_token_dispatcher_type",
    "model.moe_hybridep_num_sms",
    "model.use_transformer_engine_op_fuser",
    "model.cuda_graph_warmup_steps",
    "model.recompute_granularity",
    "model.recompute_method",
    "model.recompute_num_layers",
    "model.recompute_modules",
    "model.fine_grained_activation_offloading",
    "model.offload_modules",
    "train.train_iters",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.eval_iters",
    "validation.eval_interval",
    "scheduler.lr_warmup_iters",
    "scheduler.lr_decay_iters",
    "logger.log_interval",
    "logger.tensorboard_dir",
    "logger.log_timers_to_tensorboard",
    "checkpoint.save",
    "checkpoint.save_interval",
    "tokenizer.tokenizer_type",
    "tokenizer.tokenizer_model",
    "tokenizer.vocab_size",
    "dataset.blend",
    "dataset.num_workers",
    "dataset.seq_length",
    "model",
    "comm_overlap",
    "mixed_precision",
    "env_vars",  # the model: our provider; precision: our recipe
    "optimizer.main_grads_dtype",
    "optimizer.main_params_dtype",
    "optimizer.exp_avg_dtype",
    "optimizer.exp_avg_sq_dtype",  # torch.float32, the optimizer's defaults
}


@pytest.mark.skipif(BRIDGE_SRC is None, reason="Megatron-Bridge source not found (set NEMO_FP8_BRIDGE_SRC)")
def test_perf_settings_against_bridge_source():
    """``backend.perf=llama3_8b_h100`` is what Bridge's H100 Llama 3 8B performance recipes set:
    every field we set has Bridge's value, every performance field Bridge sets is ours or
    deliberately the run's (:data:`PERF_LEFT_TO_THE_RUN`), the environment is the recipes' own per
    precision, and ``fp8_param_gather`` follows Bridge's mixed-precision preset per recipe."""
    from nemo_fp8_recipes.integrations.bridge.recipes import PERF_SETTINGS

    perf = PERF_SETTINGS["llama3_8b_h100"]
    root = BRIDGE_SRC.parents[1]
    base = _functions(root / "recipes/llama/h100/llama3.py")["llama3_8b_pretrain_2gpu_h100_bf16_config"]
    flat = _functions(root / "perf_recipes/llama/h100/llama3.py")
    common = _functions(root / "perf_recipes/_common.py")["_benchmark_common"]
    llama = _functions(root / "perf_recipes/llama/common.py")["_llama_benchmark_common"]
    env_tree = ast.parse((root / "perf_recipes/environment.py").read_text())
    common_env = next(
        ast.literal_eval(n.value)
        for n in ast.walk(env_tree)
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "COMMON_PERF_ENV_VARS"
    )
    for fp8, name in (
        (False, "llama3_8b_pretrain_8gpu_h100_bf16_config"),
        (True, "llama3_8b_pretrain_8gpu_h100_fp8cs_config"),
    ):
        src = {**_assignments(base), **_assignments(flat[name]), **_assignments(llama), **_assignments(common)}
        ours = dict(perf.settings(fp8))
        for key, value in ours.items():
            assert key in src, f"{key}: Bridge's {name} does not set it"
            if src[key] is not ...:  # te_rng_tracker: False unless CUDA graphs run (they do not)
                assert src[key] == value, f"{key}: ours {value!r}, Bridge's {src[key]!r}"
        missed = {k for k in src if k not in ours and k not in PERF_LEFT_TO_THE_RUN}
        assert not missed, f"Bridge's {name} sets {sorted(missed)}; add them to backend.perf or PERF_LEFT_TO_THE_RUN"
        assert _env(_assignments(flat[name])["env_vars"], common_env) == perf.environment(fp8)
    presets = _functions(BRIDGE_SRC)
    for recipe, fn in (
        ("tensorwise", "bf16_with_fp8_current_scaling_mixed"),
        ("delayed", "bf16_with_fp8_delayed_scaling_mixed"),
        ("blockwise", "bf16_with_fp8_subchannel_scaling_mixed"),
        ("mxfp8", "bf16_with_mxfp8_mixed"),
    ):
        assert _assignments(presets[fn])["fp8_param_gather"] == perf.fp8_param_gather[recipe], recipe


def test_launch_plan_notes_fp8_primary_weights_without_data_parallel_ranks(monkeypatch):
    """FP8 primary weights exist to shrink the parameter all-gather across data-parallel ranks:
    with one rank the plan says they cost the run (measured on one GPU) and how to turn them off;
    with two ranks, or with them off, it says nothing."""
    base = ["backend=megatron_bridge", "model=llama3_tiny", "backend.provider=ours", "backend.perf=llama3_8b_h100"]

    def notes(world: str, *more: str) -> list:
        monkeypatch.setenv("WORLD_SIZE", world)
        return [n for n in bridge.launch_plan(compose_config(base + list(more))).get("notes", ()) if "FP8 primary" in n]

    (note,) = notes("1", "recipe=tensorwise")  # the preset turns them on
    assert "one data-parallel rank" in note and "backend.fp8_param_gather=false" in note
    assert notes("1", "recipe=delayed", "backend.fp8_param_gather=true")
    assert notes("2", "recipe=tensorwise") == []
    assert notes("1", "recipe=tensorwise", "backend.fp8_param_gather=false") == []
    assert notes("1", "recipe=blockwise") == []  # Bridge's subchannel preset keeps them off


def test_perf_settings_in_the_launch_plan(monkeypatch):
    """``backend.perf`` puts Bridge's performance fields, environment and what one process cannot
    reproduce into the plan; ``fp8_param_gather`` follows the preset unless given; an unknown name
    lists the valid ones; an override the user passes wins over the preset's field."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["backend=megatron_bridge", "model=llama3_tiny", "backend.provider=ours", "backend.perf=llama3_8b_h100"]
    plan = bridge.launch_plan(compose_config(base + ["recipe=tensorwise"]), ["model.apply_rope_fusion=false"])
    perf = plan["perf"]
    assert perf["name"] == "llama3_8b_h100" and perf["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == 32
    settings = dict(perf["settings"])
    assert settings["ddp.grad_reduce_in_fp32"] is False and settings["train.manual_gc"] is True
    assert "model.apply_rope_fusion" not in settings  # passed through: the user's value wins
    assert plan["mixed_precision"]["fp8_param_gather"] is True  # Bridge's current-scaling preset
    assert any("recomputes 5 of 32 layers" in n for n in perf["not_reproduced"])
    plan = bridge.launch_plan(compose_config(base + ["recipe=blockwise"]))
    assert plan["mixed_precision"]["fp8_param_gather"] is False  # Bridge's subchannel preset
    plan = bridge.launch_plan(compose_config(base + ["recipe=tensorwise", "backend.fp8_param_gather=false"]))
    assert plan["mixed_precision"]["fp8_param_gather"] is False  # given: kept
    plan = bridge.launch_plan(compose_config(base + ["recipe=bf16"]))
    assert (
        plan["perf"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == 1 and "NVTE_NORM_FWD_USE_CUDNN" not in plan["perf"]["env"]
    )
    plan = bridge.launch_plan(compose_config(base[:-1] + ["recipe=tensorwise"]))
    assert "perf" not in plan and plan["mixed_precision"]["fp8_param_gather"] is False
    assert not any("FP8 primary weights" in n for n in plan.get("notes", ()))
    with pytest.raises(bridge.BridgeLaunchError, match="llama3_8b_h100"):
        bridge.launch_plan(compose_config(base[:-1] + ["backend.perf=llama3_8b_b200"]))
