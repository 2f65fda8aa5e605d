"""Hydra configs: every recipe x model composes (no training), groups agree with the registries,
bad keys and options fail with the valid choices listed, and the configs ship with the package."""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from nemo_fp8_recipes.config import (
    CONFIG_DIR,
    GROUPS,
    ConfigError,
    build_policy,
    build_recipe,
    compose_config,
    list_group_options,
    override_value,
    run_config,
    trainer_config,
    validate_overrides,
)
from nemo_fp8_recipes.data import DataConfig
from nemo_fp8_recipes.models import ModelConfig, list_model_configs
from nemo_fp8_recipes.recipes import get_recipe, list_recipes
from nemo_fp8_recipes.train import main

REPO = Path(__file__).resolve().parents[2]
RECIPES = list_group_options("recipe")
MODELS = list_group_options("model")


def test_recipe_group_is_the_registry():
    assert sorted(RECIPES) == sorted(list_recipes())


def test_model_group_is_the_model_registry():
    assert MODELS == list_model_configs()
    assert {"llama3_8b", "llama3_70b", "llama31_405b", "llama3_tiny", "llama3_150m", "moe_tiny"} <= set(MODELS)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_yaml_holds_only_registry_fields(recipe):
    values = yaml.safe_load((Path(CONFIG_DIR) / "recipe" / f"{recipe}.yaml").read_text())
    assert values["name"] == recipe
    fields = {f.name for f in dataclasses.fields(type(get_recipe(recipe)))}
    assert set(values) <= fields, set(values) - fields
    assert "emulate" in values


def test_delayed_defaults_are_te_defaults_not_megatron_ones():
    r = build_recipe(compose_config(["recipe=delayed"]).recipe)
    assert (r.amax_history_len, r.amax_compute_algo, r.margin) == (1024, "max", 0)
    assert r.fprop.fast_accum is True  # null in the YAML keeps the registry default


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_and_model_composes(recipe, model):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"recipe={recipe}", f"model={model}"])
    r = build_recipe(cfg.recipe)
    assert r.name == recipe and r.is_fp8 == (recipe != "bf16")
    mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model))
    assert mcfg.name == model
    t = trainer_config(cfg)
    assert t.grad_accum >= 1
    assert run_config(cfg).dir == f"runs/{model}/{recipe}"
    build_policy(cfg.policy)
    DataConfig.from_dict(OmegaConf.to_container(cfg.data))
    assert cfg.backend.name == "native" and cfg.cluster.name == "local"


def test_defaults_are_the_embedded_default_run():
    cfg = compose_config()
    assert (cfg.recipe.name, cfg.model.name, cfg.backend.name, cfg.cluster.name, cfg.data.name) == (
        "blockwise",
        "llama3_tiny",
        "native",
        "local",
        "stdlib",
    )


def test_hydra_writes_into_the_run_dir_without_chdir():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["recipe=mxfp8", "run.tag=lr1e-3", "run.root=/tmp/r"],
            return_hydra_config=True,
        )
    assert cfg.run.dir == "/tmp/r/llama3_tiny/mxfp8-lr1e-3"
    assert cfg.hydra.run.dir == cfg.run.dir
    assert cfg.hydra.sweep.dir + "/" + cfg.hydra.sweep.subdir == cfg.run.dir
    assert cfg.hydra.job.chdir is False


def test_model_overrides_reach_the_model():
    cfg = compose_config(["model=llama31_405b", "model.num_layers=2", "model.vocab_size=512"])
    mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model))
    assert (mcfg.num_layers, mcfg.dim, mcfg.vocab_size) == (2, 16384, 512)


def test_recipe_and_policy_overrides_reach_the_objects():
    cfg = compose_config(
        [
            "recipe=delayed",
            "recipe.amax_history_len=16",
            "recipe.emulate=true",
            "recipe.fprop.fast_accum=false",
            "policy.first_layers_bf16=1",
            "policy.exclude=[layers.0.*]",
        ]
    )
    r = build_recipe(cfg.recipe)
    assert r.amax_history_len == 16 and r.emulate is True and r.fprop.fast_accum is False
    p = build_policy(cfg.policy)
    assert p.first_layers_bf16 == 1 and p.exclude == ("layers.0.*",)


def test_unknown_key_lists_the_valid_keys():
    msg = validate_overrides(["trainer.stpes=3"])
    assert "unknown config key 'trainer.stpes'" in msg
    for key in ("max_steps", "micro_batch_size", "global_batch_size", "seq_len", "grad_clip"):
        assert key in msg
    msg = validate_overrides(["recipe=delayed", "recipe.amax_history=8"])
    assert "Did you mean 'recipe.amax_history_len'?" in msg and "amax_compute_algo" in msg
    msg = validate_overrides(["modle=llama3_8b"])
    assert "Did you mean 'model'?" in msg and "llama3_8b" in msg and "blockwise" in msg
    msg = validate_overrides(["+trainer.stpes=3"])  # appended keys are caught by the typed block
    assert "trainer.stpes" in msg and "max_steps" in msg


@pytest.mark.parametrize(
    "group, bad",
    [("recipe", "fp4"), ("model", "llama3_9b"), ("data", "parquet"), ("backend", "deepspeed"), ("cluster", "k8s")],
)
def test_unknown_option_lists_the_options(group, bad):
    msg = validate_overrides([f"{group}={bad}"])
    assert f"Could not find '{group}/{bad}'" in msg
    for option in list_group_options(group):
        assert option in msg


def test_bad_values_are_explained():
    assert "could not be converted to Integer" in validate_overrides(["trainer.max_steps=ten"])
    assert "multiple of micro_batch_size" in validate_overrides(["trainer.global_batch_size=6"])
    assert "stop, skip" in validate_overrides(["trainer.nan_policy=retry"])
    assert "data.paths" in validate_overrides(["data=text"])
    with pytest.raises(ValueError, match="valid options"):
        build_recipe(compose_config(["+recipe.history=3"]).recipe)
    with pytest.raises(ValueError, match="scale_rounding"):
        build_recipe(compose_config(["recipe.scale_rounding=nearest"]).recipe)


def test_cli_rejects_a_bad_key_before_running(capsys, tmp_path):
    code = main(["trainer.stpes=3", f"run.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "max_steps" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_configs_ship_inside_the_package():
    pkg = importlib.resources.files("nemo_fp8_recipes") / "configs"
    assert (pkg / "train.yaml").is_file()
    for group in GROUPS:
        assert (pkg / group).is_dir()
    # the README's top-level configs/ is the same tree
    assert (REPO / "configs").resolve() == Path(CONFIG_DIR).resolve()
    manifest = (REPO / "MANIFEST.in").read_text()
    assert "nemo_fp8_recipes/configs" in manifest and "*.yaml" in manifest


def test_sweeps_name_each_job_by_the_keys_they_vary():
    """``nemo-fp8-train -m`` adds run.sweep=[the swept keys] (recipe and model are already in the
    path; run.*, hydra, cluster and submit never name a run); each key becomes part of the run's
    name, so no two jobs of a sweep share a directory."""
    from nemo_fp8_recipes.config import compose_config, swept_keys, with_sweep_names

    args = [
        "recipe=bf16,blockwise",
        "model=llama3_tiny,moe_tiny",
        "trainer.seed=1,2",
        "run.tag=a,b",
        "policy.first_layers_bf16=range(0,2)",
        "trainer.compile=true,false",
        "run.root=x,y",
        "trainer.lr=1e-3",
    ]
    assert swept_keys(args) == ["trainer.seed", "policy.first_layers_bf16", "trainer.compile"]
    assert with_sweep_names(["-m", *args])[-1] == "run.sweep=[trainer.seed,policy.first_layers_bf16,trainer.compile]"
    assert with_sweep_names(["-m", "recipe=bf16,blockwise"]) == ["-m", "recipe=bf16,blockwise"]  # nothing to add
    assert with_sweep_names(["trainer.seed=1,2", "run.sweep=[]"])[-1] == "run.sweep=[]"  # yours is kept
    cfg = compose_config(
        [
            "recipe=blockwise",
            "run.tag=x",
            "trainer.seed=7",
            "policy.first_layers_bf16=2",
            "trainer.compile=false",
            "run.sweep=[trainer.seed,policy.first_layers_bf16,trainer.compile]",
        ]
    )
    assert cfg.run.dir == "runs/llama3_tiny/blockwise-x-seed7-first_layers_bf16_2-compile_false"
    cfg = compose_config(["trainer.lr=0.001", "model.optim.lr=0.002", "run.sweep=[trainer.lr,model.optim.lr]"])
    assert cfg.run.dir == "runs/llama3_tiny/blockwise-trainer.lr0.001-model.optim.lr0.002"  # same leaf: full keys
    cfg = compose_config(["data=text", "data.paths=[/a/b]", "run.sweep=[data,data.paths]"])
    assert cfg.run.dir == "runs/llama3_tiny/blockwise-data_text-paths____a_b__"


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/e2e_bf16,tensorwise",  # unquoted, Hydra reads a sweep and stops: "Ambiguous value"
        "/data/a b=[c]{d}(e)",
        "/data/it's",
        "/data/a\\'b",
        "/data/trailing\\",
        "/data/${not_an_interpolation}",
        '/data/"q"',
        "/a/%b~c@d:e+f",
        "/data/Grüße",
        "runs",
        "null",
        "1e3",
        "true",
        "/plain/path_1.2-3",
    ],
)
def test_override_value_gives_hydra_back_the_same_string(path):
    """A path passed as a Hydra override comes back as the same string, whatever it holds: the
    benchmarks, the study and the SLURM launcher pass run roots and corpora this way."""
    ov = override_value(path)
    cfg = compose_config([f"run.root={ov}", "data=jsonl", f"data.paths=[{ov}]"])
    assert cfg.run.root == path and list(cfg.data.paths) == [path]
    assert (ov == path) == (path == "/plain/path_1.2-3")  # only a plain path stays unquoted


def test_override_value_refuses_what_omegaconf_cannot_keep_literal():
    with pytest.raises(ConfigError, match="backslash before"):
        override_value("/data/a\\${b}")


def test_megatron_bridge_runs_get_a_directory_of_their_own():
    """The Bridge launcher's run of a model and recipe is not the embedded trainer's: its own
    directory (its checkpoints are Megatron's), named <recipe>-bridge[-<tag>][-<sweep keys>]."""
    from pathlib import Path

    native = Path(compose_config(["recipe=blockwise"]).run.dir)
    bridge = Path(compose_config(["recipe=blockwise", "backend=megatron_bridge"]).run.dir)
    assert native.name == "blockwise" and bridge.name == "blockwise-bridge" and bridge.parent == native.parent
    tagged = compose_config(
        ["backend=megatron_bridge", "recipe=bf16", "run.tag=a", "trainer.seed=2", "run.sweep=[trainer.seed]"]
    )
    assert Path(tagged.run.dir).name == "bf16-bridge-a-seed2"
    assert Path(compose_config(["backend=te", "recipe=blockwise"]).run.dir) == native
