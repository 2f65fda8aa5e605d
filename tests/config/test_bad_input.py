"""Bad input gives a clear error naming the fix (exit 2 from the command line), never a traceback
and never lost data: trainer values, model and policy values, recipe knobs, data files, the
pre-launch checker's flags, impossible model sizes, and a few smaller promises (integer inputs,
converting twice, the loss window across a resume, per-size learning-rate defaults)."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers.tiny import TINY_SHAPE

from nemo_fp8_recipes.config import compose_config, trainer_config
from nemo_fp8_recipes.data import DataConfig, DataError, load_corpus
from nemo_fp8_recipes.integrations.validate import main as check_main
from nemo_fp8_recipes.nn import Float8Linear, convert_model
from nemo_fp8_recipes.policy import PrecisionPolicy
from nemo_fp8_recipes.recipes import get_recipe
from nemo_fp8_recipes.train import main as train_main
from nemo_fp8_recipes.train import train

TINY = [*TINY_SHAPE, "data.max_files=10", "trainer.val_interval=0"]


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def _cli(tmp_path, token_cache, capsys, *extra) -> str:
    """Run nemo-fp8-train in this process; return stderr, asserting exit 2 and no traceback."""
    capsys.readouterr()
    code = train_main(
        TINY + [f"run.root={tmp_path / 'runs'}", f"data.cache_dir={token_cache}", "trainer.max_steps=1", *extra]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Error executing job" not in err
    return err


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.seed=-1", "seed must be an integer in [0, 2**32 - 1]"),
        ("trainer.seed=4294967296", "seed must be an integer in [0, 2**32 - 1]"),
        ("trainer.beta1=1.5", "beta1 must be in [0, 1)"),
        ("trainer.beta2=-0.1", "beta2 must be in [0, 1)"),
        ("trainer.eps=0", "eps must be a finite number >= 1.18e-38"),
        ("trainer.eps=-1e-8", "eps must be a finite number >= 1.18e-38"),
        ("trainer.eps=1e-300", "the smallest normal FP32 number"),  # 0 in FP32
        ("trainer.log_interval=0", "log_interval must be >= 1"),
        ("run.tag=../../elsewhere", "run.tag='../../elsewhere' is not a name"),
        ("run.tag=a/b", "run.tag='a/b' is not a name"),
        ("trainer.weight_decay=-1", "weight_decay must be a finite number >= 0"),
        ("trainer.lr=inf", "lr must be a finite number > 0"),
        ("trainer.grad_clip=nan", "grad_clip must be a finite number >= 0"),
        ("model.init_std=nan", "init_std must be a finite number > 0"),
        ("model.norm_eps=0", "norm_eps must be a finite number > 0"),
        ("policy.exclude=5", "exclude must be a glob pattern on module names or a list of them"),
        ("policy={attention_projection:bf16}", "did you mean 'attention_projections'"),
        ("policy=5", "policy must be a block of options"),
        ("recipe=delayed recipe.margin=200", "margin must be an integer in 0..8"),
        ("recipe=delayed recipe.margin=true", "margin must be an integer in 0..8, got True"),
        ("recipe=delayed recipe.amax_history_len=1000000000", "amax_history_len must be an integer in 1..65536"),
    ],
)
def test_bad_values_stop_at_once_with_the_fix(override, words, tmp_path, token_cache, capsys):
    err = _cli(tmp_path, token_cache, capsys, *override.split())
    assert words in err, err
    assert not (tmp_path / "runs").exists()  # nothing was written


def test_library_calls_raise_value_errors_not_type_errors():
    with pytest.raises(ValueError, match="exclude must be a glob pattern"):
        PrecisionPolicy(exclude=5)
    with pytest.raises(ValueError, match="include patterns must be strings"):
        PrecisionPolicy(include=["layers.*", 3])
    with pytest.raises(ValueError, match="first_layers_bf16 must be an integer"):
        PrecisionPolicy(first_layers_bf16=True)
    with pytest.raises(ValueError, match=r"margin must be an integer in 0\.\.8"):
        get_recipe("delayed", margin=200)
    with pytest.raises(ValueError, match=r"margin must be an integer in 0\.\.8, got True"):
        get_recipe("delayed", margin=True)
    with pytest.raises(ValueError, match="amax_history_len"):
        get_recipe("delayed", amax_history_len=10**9)
    assert get_recipe("delayed", margin=8, amax_history_len=65536).margin == 8


def test_margin_at_its_limit_still_gives_finite_outputs():
    """The largest margin allowed keeps the scale and every output finite (margin 200 underflowed
    the FP32 scale to 0 and turned every output into NaN)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    m = Float8Linear.from_linear(lin, get_recipe("delayed", margin=8), emulate=True)
    x = torch.randn(16, 64) * 100
    for _ in range(3):
        y = m(x)
    assert torch.isfinite(y).all() and (m.fp8_scale > 0).all()


def test_jsonl_with_invalid_utf8_names_the_line(tmp_path, token_cache, capsys):
    data = tmp_path / "data"
    data.mkdir()
    good = json.dumps({"text": "fine text " * 50}).encode()
    (data / "a.jsonl").write_bytes(good + b"\n" + b'{"text": "caf\xe9 au lait"}\n' + good + b"\n")
    err = _cli(tmp_path, token_cache, capsys, "data=jsonl", f"data.paths=[{data}]")
    assert "a.jsonl:2: not valid UTF-8" in err and "re-encode" in err


def test_jsonl_lone_surrogates_are_skipped_and_counted_deep_nesting_is_refused(tmp_path, caplog):
    """'\\ud800' is valid JSON but not Unicode text (common in crawled data): those lines are skipped
    and counted, with the file and lines; a line nested too deeply for the parser is refused, naming
    it, and the token cache keeps nothing half-written."""
    import logging

    data = tmp_path / "data"
    data.mkdir()
    good = [json.dumps({"text": f"document {i} " * 40}) for i in range(3)]
    lines = [good[0], '{"text": "bad \\ud800 text"}', good[1], '{"text": "\\udfff"}', good[2]]
    (data / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        corpus = load_corpus(DataConfig(source="jsonl", paths=[str(data)], cache_dir=str(tmp_path / "c1")))
    assert "a.jsonl: 2 line(s) skipped" in caplog.text and "lines 2, 4" in caplog.text
    import numpy as np

    tokens = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.val)])
    text = bytes(tokens[tokens < 256].astype(np.uint8))
    assert b"document 2" in text and b"bad" not in text
    (data / "a.jsonl").write_text(good[0] + "\n" + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    cache = tmp_path / "c2"
    with pytest.raises(DataError, match="a.jsonl:2: JSON nested too deeply"):
        load_corpus(DataConfig(source="jsonl", paths=[str(data)], cache_dir=str(cache)))
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_a_data_error_leaves_no_temporary_files_in_the_token_cache(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "x" * 1000}) + "\n{broken\n", encoding="utf-8")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="a.jsonl:2: not valid JSON"):
        load_corpus(DataConfig(source="jsonl", paths=[str(data)], cache_dir=str(cache)))
    left = [p.name for p in cache.rglob("*") if p.is_file()]
    assert left == [], left


def test_a_binary_file_given_directly_is_refused(tmp_path, token_cache, capsys):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(DataError, match="is a binary file"):
        load_corpus(DataConfig(source="text", paths=[str(blob)], cache_dir=str(tmp_path / "c")))
    err = _cli(tmp_path, token_cache, capsys, "data=text", f"data.paths=[{blob}]")
    assert "is a binary file" in err


def test_the_checker_refuses_bad_flags_before_checking(tmp_path, capsys):
    assert check_main(["--json", str(tmp_path / "no" / "such" / "dir" / "r.json"), "recipe=tensorwise"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "mkdir -p" in err and "Traceback" not in err
    assert check_main(["--json", str(tmp_path), "recipe=tensorwise"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert check_main(["--te", "x.y.z", "recipe=tensorwise"]) == 2
    assert "not a Transformer Engine version" in capsys.readouterr().err
    assert check_main(["--gpu", "h100", "--cuda", "-1", "recipe=tensorwise"]) == 2
    assert "not a CUDA version" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert (
        check_main(["--gpu", "h100", "--cuda", "12.9", "--te", "2.20.2", "--json", str(out), "recipe=tensorwise"]) == 0
    )
    assert json.loads(out.read_text())["recipe"] == "tensorwise"


def test_an_impossible_model_size_is_refused_before_allocating(tmp_path, token_cache, capsys):
    t0 = time.monotonic()
    capsys.readouterr()
    code = train_main(
        [
            "model=llama31_405b",
            "trainer.device=cpu",
            "trainer.progress=false",
            f"run.root={tmp_path / 'runs'}",
            f"data.cache_dir={token_cache}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert time.monotonic() - t0 < 60
    assert "model=llama31_405b" in err and "needs about" in err and "available" in err
    assert "AdamW moments (FP32)" in err and "What fits:" in err and "model=llama3_150m" in err
    assert "trainer.memory_check=false" in err


def test_the_memory_estimate_follows_a_measured_run(tmp_path, token_cache):
    """The estimate against the peak resident memory of a real run in a fresh process."""
    from omegaconf import OmegaConf

    from nemo_fp8_recipes.models import ModelConfig
    from nemo_fp8_recipes.trainer.memory import estimate_training_memory

    args = [
        "model=llama3_150m",
        "model.num_layers=2",
        "recipe=tensorwise",
        "trainer.seq_len=256",
        "trainer.micro_batch_size=4",
        "trainer.global_batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_interval=0",
        "trainer.checkpoint=false",
        "trainer.progress=false",
        "trainer.device=cpu",
        "data.max_files=20",
        f"data.cache_dir={token_cache}",
        f"run.root={tmp_path}",
    ]
    mcfg = ModelConfig.from_dict(OmegaConf.to_container(compose_config(args).model, resolve=True))
    est = estimate_training_memory(mcfg, tokens_per_micro_batch=1024, fp8=True, activation_bytes=4).total
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_recipes.train", *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if before * 1024 >= peak:
        pytest.skip("an earlier child process of this test process had a higher peak; run this test alone")
    assert 0.7 * peak <= est <= 1.4 * peak, (est / 2**30, peak / 2**30)


def test_model_sizes_carry_their_own_learning_rates():
    want = {"llama3_tiny": 3e-3, "llama3_8b": 3e-4, "llama3_70b": 1.5e-4, "llama31_405b": 8e-5}
    for model, lr in want.items():
        t = trainer_config(compose_config([f"model={model}"]))
        assert math.isclose(t.lr, lr) and 0 < t.min_lr < t.lr and t.warmup_steps > 0, model
    assert math.isclose(trainer_config(compose_config(["model=llama31_405b"])).min_lr, 8e-7)
    t = trainer_config(compose_config(["model=llama3_8b", "trainer.lr=1e-4", "trainer.warmup_steps=7"]))
    assert t.lr == 1e-4 and t.warmup_steps == 7  # an explicit value wins
    # the resolved value is what a run records
    cfg = compose_config(["model=llama3_70b"])
    from omegaconf import OmegaConf

    assert "lr: 0.00015" in OmegaConf.to_yaml(cfg, resolve=True)


def test_float8_linear_refuses_integer_inputs_like_nn_linear():
    lin = nn.Linear(16, 16)
    with pytest.raises(RuntimeError):
        lin(torch.ones(4, 16, dtype=torch.int64))
    m = Float8Linear.from_linear(lin, get_recipe("tensorwise"), emulate=True)
    with pytest.raises(RuntimeError, match="expected a floating-point input, got torch.int64"):
        m(torch.ones(4, 16, dtype=torch.int64))


def test_converting_a_part_then_the_whole_model_is_refused():
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 32)), nn.Linear(32, 32))
    convert_model(model[0], "tensorwise")
    with pytest.raises(RuntimeError, match=r"already applied to the submodule '0' \(recipe tensorwise\).*blockwise"):
        convert_model(model, "blockwise")
    with pytest.raises(RuntimeError, match="already applied to this model"):
        convert_model(model[0], "tensorwise")


def _logged(run_dir: Path, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_the_train_loss_window_that_spans_a_resume_matches_the_uninterrupted_run(tmp_path, token_cache):
    common = TINY + [
        "recipe=delayed",
        "trainer.max_steps=12",
        "trainer.log_interval=4",
        "trainer.ckpt_interval=6",
        "trainer.ckpt_keep=5",
        f"data.cache_dir={token_cache}",
    ]
    full = train(compose_config(common + [f"run.root={tmp_path / 'a'}"]))
    ckpt6 = full.run_dir / "checkpoints" / "step_00000006.pt"
    resumed = train(compose_config(common + [f"run.root={tmp_path / 'b'}", f"trainer.resume={ckpt6}"]))
    a, b = _logged(full.run_dir, "train/loss"), _logged(resumed.run_dir, "train/loss")
    assert sorted(b) == [8, 12]
    assert b[8] == a[8] and b[12] == a[12]  # the window 5..8 spans the resume at step 6


def test_backend_te_without_transformer_engine_stops_at_once(tmp_path, token_cache, capsys):
    from nemo_fp8_recipes.integrations.te import te_available

    if te_available()[0] and torch.cuda.is_available():
        pytest.skip("Transformer Engine runs here: backend=te trains (tests/integrations/test_te_gpu.py)")
    t0 = time.monotonic()
    err = _cli(tmp_path, token_cache, capsys, "backend=te")
    assert time.monotonic() - t0 < 30
    assert "backend=te" in err and 'pip install ".[te]"' in err and "backend=native" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "extra, words",
    [
        (["recipe=mxfp8"], "needs SM100 (Blackwell)"),
        (["recipe=tensorwise", "trainer.compile=true"], "Transformer Engine's modules run eager"),
        (["recipe=blockwise", "recipe.emulate=true"], "backend=native recipe.emulate=true"),
    ],
)
def test_backend_te_refuses_what_te_cannot_run(extra, words, monkeypatch, tmp_path):
    """The checks after Transformer Engine is found, with the TE/GPU probe and the device answer
    replaced by a Hopper machine's (no TE is needed to see the refusals)."""
    from nemo_fp8_recipes import hardware
    from nemo_fp8_recipes.config import build_recipe, trainer_config
    from nemo_fp8_recipes.hardware import DeviceInfo
    from nemo_fp8_recipes.trainer import te_backend as te_model

    hopper = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), cuda_version=(12, 9))
    monkeypatch.setattr(te_model, "te_backend_problem", lambda device: None)
    monkeypatch.setattr(hardware, "describe_device", lambda device=None: hopper)
    cfg = compose_config(["backend=te", *extra])
    problem = te_model.te_run_problem(build_recipe(cfg.recipe), torch.device("cuda"), trainer_config(cfg))
    assert problem and words in problem


def test_backend_te_refuses_grouped_moe_experts_it_would_leave_in_bf16(monkeypatch):
    """moe_tiny's routed experts are one grouped module (3-D weights): backend=te swaps linears
    only, so an FP8 recipe is refused before TE is touched, naming the module and the way out;
    with the experts kept in BF16 on purpose (the policy's exclude) the check lets it through."""
    from nemo_fp8_recipes.config import ConfigError
    from nemo_fp8_recipes.models import build_model, load_model_config
    from nemo_fp8_recipes.policy import PrecisionPolicy
    from nemo_fp8_recipes.recipes import get_recipe
    from nemo_fp8_recipes.trainer import te_backend as te_model

    model = build_model(load_model_config("moe_tiny", num_layers=2))
    with pytest.raises(
        ConfigError, match=r"layers\.1\.feed_forward\.experts \(GroupedExperts\).*backend=native.*policy\.exclude"
    ):
        te_model.convert_to_te(model, get_recipe("tensorwise"))

    def no_te():  # where the conversion would build its first TE module
        raise ImportError("no TE here")

    monkeypatch.setattr(te_model, "_te_linear_class", no_te)
    with pytest.raises(ImportError, match="no TE here"):  # past the grouped check
        te_model.convert_to_te(model, get_recipe("tensorwise"), PrecisionPolicy(exclude=["*experts*"]))
    # the size rule keeps experts this small in BF16, as the native path would: no refusal either
    with pytest.raises(ImportError, match="no TE here"):
        te_model.convert_to_te(model, get_recipe("tensorwise"), PrecisionPolicy(min_fp8_weight_elements="auto"))


def test_backend_te_refuses_grouped_experts_before_loading_data():
    """The trainer asks the backend about the model before it loads any data: TEBackend.check_model
    builds it on the meta device and refuses as convert_to_te would; the native backend and the
    cases convert_to_te lets through pass."""
    from nemo_fp8_recipes.config import ConfigError
    from nemo_fp8_recipes.models import load_model_config
    from nemo_fp8_recipes.policy import PrecisionPolicy
    from nemo_fp8_recipes.recipes import get_recipe
    from nemo_fp8_recipes.trainer.backends import NativeBackend
    from nemo_fp8_recipes.trainer.te_backend import TEBackend

    te = TEBackend(backend_cfg=None, telemetry=False)
    for name in ("moe_tiny", "moe_360m"):
        with pytest.raises(ConfigError, match=r"layers\.1\.feed_forward\.experts \(GroupedExperts\)"):
            te.check_model(load_model_config(name), get_recipe("blockwise"), PrecisionPolicy())
        NativeBackend().check_model(load_model_config(name), get_recipe("blockwise"), PrecisionPolicy())
        te.check_model(load_model_config(name), get_recipe("bf16"), PrecisionPolicy())
        te.check_model(load_model_config(name), get_recipe("blockwise"), PrecisionPolicy(exclude=["*experts*"]))
    te.check_model(load_model_config("llama3_tiny"), get_recipe("blockwise"), PrecisionPolicy())


def test_a_run_root_that_cannot_be_written_stops_at_once(capsys):
    """A read-only or missing file system (here /proc, which takes no new directories) is one line
    naming the run directory and the fix, not Hydra's traceback."""
    from nemo_fp8_recipes.train import main

    if not Path("/proc").is_dir():
        pytest.skip("needs Linux's /proc")
    assert main(["run.root=/proc/nemo_fp8_runs", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the run directory /proc/nemo_fp8_runs/" in err and "choose a writable run.root" in err
    assert "Traceback" not in err


def test_an_override_written_as_a_flag_gets_the_override_form(capsys):
    from nemo_fp8_recipes.train import main

    assert main(["--recipe", "blockwise"]) == 2
    err = capsys.readouterr().err
    assert "--recipe is a Hydra override, written without dashes: recipe=blockwise" in err
    assert main(["--trainer.max_steps=5"]) == 2
    assert "trainer.max_steps=5" in capsys.readouterr().err
