"""The embedded trainer end to end on CPU: every recipe trains and logs, resume is exact,
checkpoints survive interrupted writes, and bad situations stop with clear messages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers.tiny import SMALL_MODEL

from nemo_fp8_recipes import recipes as recipes_mod
from nemo_fp8_recipes.config import ConfigError, compose_config
from nemo_fp8_recipes.hardware import DeviceInfo
from nemo_fp8_recipes.nn import Float8Linear, audit
from nemo_fp8_recipes.recipes import check_supported, list_recipes
from nemo_fp8_recipes.train import main, train
from nemo_fp8_recipes.trainer import NonFiniteLossError, TrainingError
from nemo_fp8_recipes.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    save_checkpoint,
)

# A 2-layer model whose GEMM dims are multiples of 128, so every projection is FP8 under every
# recipe (blockwise needs 128), with GQA (4 heads, 2 KV heads); 256 tokens per step.
TINY = [
    *SMALL_MODEL,
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=4",
    "trainer.warmup_steps=5",
    "trainer.val_steps=2",
    "trainer.progress=false",
    "trainer.device=cpu",
    "data.max_files=40",
]


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


def _cfg(tmp_path, token_cache, *extra):
    return compose_config(TINY + [f"run.root={tmp_path / 'runs'}", f"data.cache_dir={token_cache}", *extra])


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.parametrize("recipe", list_recipes())
def test_30_step_run_writes_events_and_lowers_the_loss(recipe, tmp_path, token_cache):
    cfg = _cfg(
        tmp_path,
        token_cache,
        f"recipe={recipe}",
        "trainer.max_steps=30",
        "trainer.log_interval=5",
        "trainer.val_interval=15",
        "trainer.telemetry_interval=10",
        "trainer.ckpt_interval=0",
    )
    result = train(cfg)
    run_dir = tmp_path / "runs" / "llama3_tiny" / recipe
    assert result.run_dir == run_dir and result.final_step == 30
    assert (run_dir / "config.yaml").is_file() and f"name: {recipe}" in (run_dir / "config.yaml").read_text()
    assert list(run_dir.glob("events.out.tfevents.*"))
    acc = _events(run_dir)
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "lr", "grad_norm", "tokens_per_s"} <= scalars
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20, 25, 30]
    assert loss[-1] < loss[0] - 1.0, loss
    val = acc.Scalars("val/loss")
    assert [e.step for e in val] == [15, 30] and val[1].value < val[0].value
    assert "fp8/audit/text_summary" in acc.Tags()["tensors"]
    if recipe == "bf16":
        assert not any(t.startswith("fp8/") for t in scalars)
        assert "no FP8" in result.audit_table
    else:
        for stat in ("amax", "scale", "underflow_frac", "saturated_frac"):
            assert f"fp8/attention/input/{stat}" in scalars
            assert f"fp8/mlp/weight/{stat}" in scalars
        assert [e.step for e in acc.Scalars("fp8/mlp/grad_output/amax")] == [10, 20, 30]
        # every projection ran in FP8, the head did not
        assert "GEMMs run in FP8 fprop/dgrad/wgrad = 14/14/14" in result.audit_table
    assert (run_dir / "checkpoints" / "step_00000030.pt").is_file()  # always saved at the end


#: moe_tiny cut to a dense layer and one MoE layer of 4 experts, at a CPU-sized batch
MOE_SMALL = [
    "model=moe_tiny",
    "model.num_layers=2",
    "model.num_experts=4",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=8",
]


def test_moe_tiny_trains_with_the_router_in_fp32(tmp_path, token_cache):
    cfg = compose_config(
        [
            *MOE_SMALL,
            "trainer.max_steps=12",
            "trainer.warmup_steps=3",
            "trainer.log_interval=4",
            "trainer.val_interval=0",
            "trainer.telemetry_interval=4",
            "trainer.progress=false",
            "trainer.device=cpu",
            "data.max_files=40",
            f"data.cache_dir={token_cache}",
            f"run.root={tmp_path}",
        ]
    )
    result = train(cfg)
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 1.0
    router = [line for line in result.audit_table.splitlines() if "feed_forward.router" in line]
    assert router and "fp32" in router[0] and "2/2/2" in router[0]  # ran twice (grad accum 2), high precision
    # the routed experts: one grouped module per MoE layer, its expert GEMMs counted in FP8
    experts = [line.split() for line in result.audit_table.splitlines() if line.endswith("FP8 per recipe")]
    experts = [row for row in experts if row[0].endswith("feed_forward.experts")]
    assert [row[:3] for row in experts] == [["layers.1.feed_forward.experts", "mlp", "fp8"]]
    assert experts[0][4] == "-"  # nothing in high precision
    acc = _events(result.run_dir)
    scalars = acc.Tags()["scalars"]
    assert "train/aux_loss" in scalars
    for stat in ("amax", "scale", "underflow_frac", "sqnr_db", "underflow_frac_worst", "sqnr_db_worst"):
        assert f"fp8/experts/input/{stat}" in scalars, stat


def test_moe_tiny_resumes_exactly_under_delayed_scaling(tmp_path, token_cache):
    """Grouped experts under the trainer's delayed-scaling schedule (one update per optimizer
    step, evaluation kept out of the histories): a resumed run reproduces the uninterrupted one
    bit for bit, experts' scaling state included, and validation does not steer training."""
    common = [
        *MOE_SMALL,
        "trainer.warmup_steps=2",
        "trainer.progress=false",
        "trainer.device=cpu",
        "data.max_files=40",
        f"data.cache_dir={token_cache}",
        "recipe=delayed",
        "trainer.max_steps=8",
        "trainer.log_interval=2",
        "trainer.val_interval=4",
        "trainer.val_steps=2",
        "trainer.telemetry_interval=4",
        "trainer.ckpt_interval=4",
    ]
    full = train(compose_config(common + [f"run.root={tmp_path / 'a'}"]))
    ckpt = full.run_dir / "checkpoints" / "step_00000004.pt"
    resumed = train(compose_config(common + [f"run.root={tmp_path / 'b'}", f"trainer.resume={ckpt}"]))
    assert resumed.start_step == 4 and resumed.losses == {s: v for s, v in full.losses.items() if s > 4}
    a = load_checkpoint(full.run_dir / "checkpoints" / "step_00000008.pt")["model"]
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "step_00000008.pt")["model"]
    hist = a["layers.1.feed_forward.experts.fp8_amax_history"]  # [weights, experts, operands, history]
    assert hist.shape[:3] == (2, 4, 3) and (hist[..., :8] > 0).any() and not hist[..., 8:].any()
    for key, t in a.items():
        if torch.is_tensor(t):
            assert torch.equal(t, b[key]), key
    no_val = train(compose_config(common + [f"run.root={tmp_path / 'c'}", "trainer.val_interval=0"]))
    assert no_val.losses == full.losses


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_resume_reproduces_the_uninterrupted_run_exactly(recipe, tmp_path, token_cache):
    common = [
        f"recipe={recipe}",
        "trainer.max_steps=12",
        "trainer.log_interval=2",
        "trainer.val_interval=6",
        "trainer.telemetry_interval=4",
        "trainer.ckpt_interval=6",
        "trainer.ckpt_keep=5",
    ]
    full = train(_cfg(tmp_path / "a", token_cache, *common))
    ckpt6 = full.run_dir / "checkpoints" / "step_00000006.pt"
    assert ckpt6.is_file()
    # a second process state: a fresh model/optimizer/data pipeline, restored from step 6
    resumed = train(_cfg(tmp_path / "b", token_cache, *common, f"trainer.resume={ckpt6}"))
    assert resumed.start_step == 6 and resumed.final_step == 12
    want = {s: loss for s, loss in full.losses.items() if s > 6}
    assert resumed.losses == want  # bit-exact float equality, step by step
    assert resumed.val[-1] == full.val[-1]
    a = load_checkpoint(full.run_dir / "checkpoints" / "step_00000012.pt")
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "step_00000012.pt")
    for key, t in a["model"].items():
        if torch.is_tensor(t):
            assert torch.equal(t, b["model"][key]), key  # weights and FP8 scaling state
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # TensorBoard of the resumed run continues the curve without a doubled segment
    steps = [e.step for e in _events(resumed.run_dir).Scalars("train/loss")]
    assert steps == [8, 10, 12]
    # validation does not steer training (delayed scaling: eval amaxes stay out of the history)
    no_val = train(_cfg(tmp_path / "c", token_cache, *common, "trainer.val_interval=0"))
    assert no_val.losses == full.losses


def _train_until_sigterm(args, cwd, after_step=3, timeout=300):
    """``nemo-fp8-train args`` in a process of its own, sent SIGTERM once it logged ``after_step``:
    (exit status, everything it printed)."""
    import signal

    exe = shutil.which("nemo-fp8-train")
    cmd = [exe] if exe else [sys.executable, "-m", "nemo_fp8_recipes.train"]
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    out, deadline = [], time.time() + timeout
    for line in proc.stdout:
        out.append(line)
        if f"step {after_step}/" in line and "| loss" in line:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline, "".join(out[-40:])
    out.append(proc.stdout.read())
    return proc.wait(timeout=timeout), "".join(out)


def test_sigterm_saves_the_step_and_resume_continues_exactly(tmp_path, token_cache):
    """SIGTERM (a SLURM time limit, preemption, scancel) lets the step in progress finish, saves
    it, says so and exits 143; the run resumed from that checkpoint ends as the uninterrupted run
    does, bit for bit. With checkpointing off it says that nothing was kept."""
    common = TINY + [
        f"data.cache_dir={token_cache}",
        "recipe=delayed",
        "trainer.max_steps=60",
        "trainer.log_interval=1",
        "trainer.val_interval=0",
        "trainer.ckpt_interval=0",
    ]
    rc, out = _train_until_sigterm(common + [f"run.root={tmp_path / 'a'}"], tmp_path)
    assert rc == 143, out[-3000:]
    stopped = int(out.split("received: stopped after step ")[1].split(";")[0])
    ckpt = tmp_path / "a" / "llama3_tiny" / "delayed" / "checkpoints" / f"step_{stopped:08d}.pt"
    assert 3 <= stopped < 60 and ckpt.is_file(), out[-3000:]
    assert "SIGTERM received: stopping after the step in progress" in out
    assert f"nemo-fp8-train: error: SIGTERM received: stopped after step {stopped}; checkpoint {ckpt}" in out
    assert "Traceback" not in out
    resumed = train(compose_config(common + [f"run.root={tmp_path / 'a'}"]))
    assert resumed.start_step == stopped and resumed.final_step == 60
    full = train(compose_config(common + [f"run.root={tmp_path / 'b'}"]))
    assert resumed.losses == {s: v for s, v in full.losses.items() if s > stopped}
    rc, out = _train_until_sigterm(common + [f"run.root={tmp_path / 'c'}", "trainer.checkpoint=false"], tmp_path)
    assert rc == 143 and "trainer.checkpoint=false: nothing saved" in out, out[-3000:]
    assert not (tmp_path / "c" / "llama3_tiny" / "delayed" / "checkpoints").exists()


def test_a_fresh_start_does_not_inherit_the_old_runs_curve(tmp_path, token_cache):
    """A fresh start (no checkpoint to resume) in a directory where an 8-step run finished, stopped
    at step 3: its curve is steps 1-3 of its own, and the old summary no longer claims 8 steps."""
    from nemo_fp8_recipes.compare import load_run

    common = TINY + [f"data.cache_dir={token_cache}", f"run.root={tmp_path}", "recipe=tensorwise"]
    old = train(compose_config(common + ["trainer.max_steps=8", "trainer.log_interval=1", "trainer.checkpoint=false"]))
    assert load_run(old.run_dir, "train/loss").steps == list(range(1, 9))
    rc, out = _train_until_sigterm(
        common + ["trainer.max_steps=400", "trainer.log_interval=1", "trainer.checkpoint=false", "trainer.seed=7"],
        tmp_path,
        after_step=3,
    )
    assert rc == 143, out[-2000:]
    stopped = int(out.split("received: stopped after step ")[1].split(";")[0])
    new = load_run(old.run_dir, "train/loss")
    assert new.steps == list(range(1, stopped + 1)) and stopped < 8
    assert abs(new.values[0] - old.losses[1]) > 1e-4  # (another seed: the values are this run's)
    assert not (old.run_dir / "summary.json").exists()


def test_one_trainer_per_run_directory(tmp_path, token_cache):
    """A second trainer in a directory where one is training is refused, naming the first (host,
    PID); a lock left by a process that no longer exists is taken over; the lock goes with the run."""
    import os
    import socket

    from nemo_fp8_recipes.trainer.lock import LOCK_NAME

    args = TINY + [
        f"data.cache_dir={token_cache}",
        f"run.root={tmp_path}",
        "recipe=bf16",
        "trainer.checkpoint=false",  # (however far the first one gets, the third starts fresh)
        "trainer.max_steps=400",
        "trainer.log_interval=1",
        "trainer.val_interval=0",
    ]
    exe = shutil.which("nemo-fp8-train")
    cmd = [exe] if exe else [sys.executable, "-m", "nemo_fp8_recipes.train"]
    first = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        for line in first.stdout:
            if "step 2/400 | loss" in line:
                break
        second = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert second.returncode == 5, second.stdout + second.stderr
        err = second.stderr
        assert f"another trainer is running in {tmp_path / 'llama3_tiny' / 'bf16'}: PID {first.pid} on" in err
        assert "give this run another run.tag" in err and "Traceback" not in err
    finally:
        first.kill()
        first.wait()
    lock = tmp_path / "llama3_tiny" / "bf16" / LOCK_NAME
    assert lock.is_file()  # kill -9 leaves it; its process is gone, so the next trainer takes over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    result = train(compose_config(args[:-3] + ["trainer.max_steps=2"]))
    assert result.final_step == 2 and not lock.exists()
    # a lock from another host cannot be checked from here: refused, with the way out
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": os.getpid(), "started": "earlier"}))
    with pytest.raises(TrainingError, match=f"host node-elsewhere, delete {lock}"):
        train(compose_config(args))
    assert json.loads(lock.read_text())["host"] == "node-elsewhere"  # not theirs to remove


def test_auto_resume_continues_and_a_finished_run_is_a_no_op(tmp_path, token_cache):
    base = ["recipe=tensorwise", "trainer.log_interval=2", "trainer.val_interval=0", "trainer.ckpt_interval=2"]
    first = train(_cfg(tmp_path, token_cache, *base, "trainer.max_steps=4"))
    again = train(_cfg(tmp_path, token_cache, *base, "trainer.max_steps=4"))
    assert again.start_step == 4 and again.history == []
    longer = train(_cfg(tmp_path, token_cache, *base, "trainer.max_steps=6"))
    assert longer.start_step == 4 and longer.final_step == 6
    assert first.run_dir == longer.run_dir
    with pytest.raises(CheckpointError, match="trainer.resume=never"):
        train(_cfg(tmp_path, token_cache, *base, "trainer.max_steps=6", "trainer.resume=never"))


def test_an_automatic_resume_refuses_a_changed_policy_kernel_or_autocast(tmp_path, token_cache):
    """A finished or interrupted run is not continued under a policy, kernel or autocast setting
    it did not run with (its config.yaml would then describe curves it did not produce)."""
    base = ["recipe=tensorwise", "trainer.log_interval=2", "trainer.val_interval=0", "trainer.max_steps=2"]
    first = train(_cfg(tmp_path, token_cache, *base))
    config_before = (first.run_dir / "config.yaml").read_text()
    for change, words in (
        ("policy.first_layers_bf16=1", "policy.first_layers_bf16: 0 -> 1"),
        ("kernels.fused_swiglu=false", "kernels.fused_swiglu: True -> False"),
        ("trainer.autocast=bf16", "trainer.autocast: 'auto' -> 'bf16'"),
    ):
        with pytest.raises(CheckpointError, match="not resumed automatically") as e:
            train(_cfg(tmp_path, token_cache, *base, change))
        assert words in str(e.value), str(e.value)
        assert (first.run_dir / "config.yaml").read_text() == config_before  # nothing rewritten
    forced = train(_cfg(tmp_path, token_cache, *base, "policy.first_layers_bf16=1", "trainer.force_resume=true"))
    assert forced.start_step == 2


def test_resume_applies_the_current_hyperparameters(tmp_path, token_cache):
    """A resumed run uses the *current* lr schedule and AdamW settings, not the checkpoint's
    (e.g. resuming with a lower lr after a divergence must lower it)."""
    from nemo_fp8_recipes.trainer.optim import lr_at

    base = ["recipe=tensorwise", "trainer.log_interval=1", "trainer.val_interval=0", "trainer.ckpt_interval=4"]
    train(_cfg(tmp_path, token_cache, *base, "trainer.max_steps=4", "trainer.lr=3e-3"))
    new = ["trainer.max_steps=8", "trainer.lr=1e-3", "trainer.min_lr=1e-4", "trainer.weight_decay=0.0"]
    # an *automatic* resume with other hyperparameters is refused (sweep jobs sharing a run dir)
    with pytest.raises(CheckpointError, match="run.tag=<name>"):
        train(_cfg(tmp_path, token_cache, *base, *new))
    cfg = _cfg(tmp_path, token_cache, *base, *new, "trainer.force_resume=true")
    resumed = train(cfg)
    assert resumed.start_step == 4
    from nemo_fp8_recipes.config import trainer_config

    tcfg = trainer_config(cfg)
    lrs = [h["lr"] for h in resumed.history]
    want = [lr_at(s, tcfg) for s in range(4, 8)]
    assert lrs == pytest.approx(want, rel=1e-12)
    ck = load_checkpoint(resumed.checkpoint)
    assert all(g["weight_decay"] == 0.0 for g in ck["optimizer"]["param_groups"])


def test_checkpoint_from_another_recipe_is_refused_unless_forced(tmp_path, token_cache):
    src = train(_cfg(tmp_path, token_cache, "recipe=delayed", "trainer.max_steps=2", "trainer.val_interval=0"))
    ckpt = src.checkpoint
    with pytest.raises(CheckpointError, match="recipe 'delayed'.*force_resume=true"):
        train(
            _cfg(
                tmp_path,
                token_cache,
                "recipe=blockwise",
                "trainer.max_steps=4",
                "trainer.val_interval=0",
                f"trainer.resume={ckpt}",
            )
        )
    forced = train(
        _cfg(
            tmp_path,
            token_cache,
            "recipe=blockwise",
            "trainer.max_steps=4",
            "trainer.val_interval=0",
            f"trainer.resume={ckpt}",
            "trainer.force_resume=true",
        )
    )
    assert forced.start_step == 2 and forced.final_step == 4
    with pytest.raises(CheckpointError, match="another model shape"):
        train(
            _cfg(
                tmp_path,
                token_cache,
                "recipe=delayed",
                "model.ffn_dim=384",
                "trainer.max_steps=4",
                f"trainer.resume={ckpt}",
                "run.tag=other",
            )
        )


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, token_cache):
    result = train(
        _cfg(
            tmp_path,
            token_cache,
            "recipe=delayed",
            "trainer.max_steps=4",
            "trainer.ckpt_interval=2",
            "trainer.val_interval=0",
        )
    )
    mgr = CheckpointManager(result.run_dir / "checkpoints", keep=2)
    good = mgr.latest()
    before = good.read_bytes()
    state = load_checkpoint(good)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full (simulated by an object that cannot be pickled)")

    # overwrite of the same step and a new step: both fail half way through torch.save
    for target in (good, mgr.path_for(6)):
        with pytest.raises(RuntimeError, match="disk full"):
            save_checkpoint({**state, "zz_bad": Unpicklable()}, target)
    assert good.read_bytes() == before
    assert mgr.latest() == good and not mgr.path_for(6).exists()
    assert not [p for p in good.parent.iterdir() if p.name.startswith(".tmp-")]
    assert load_checkpoint(good)["step"] == 4


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, token_cache):
    result = train(
        _cfg(
            tmp_path,
            token_cache,
            "recipe=delayed",
            "trainer.max_steps=4",
            "trainer.ckpt_interval=2",
            "trainer.val_interval=0",
        )
    )
    ckpt_dir = result.run_dir / "checkpoints"
    # A child process starts writing step 6 and dies inside torch.save (os._exit: no cleanup,
    # no exception handling), exactly like a kill -9 or a node failure mid-write.
    script = textwrap.dedent(f"""
        import os, torch
        from nemo_fp8_recipes.trainer.checkpoint import load_checkpoint, save_checkpoint
        state = load_checkpoint({str(ckpt_dir / "step_00000004.pt")!r})
        class Die:
            def __reduce__(self):
                os._exit(9)
        state["model"]["zz_die"] = Die()
        save_checkpoint(state, {str(ckpt_dir / "step_00000006.pt")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    leftovers = [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the killed writer should have left its temporary file behind"
    mgr = CheckpointManager(ckpt_dir)
    assert mgr.latest().name == "step_00000004.pt"
    assert load_checkpoint(mgr.latest())["step"] == 4
    # the trainer resumes from it and the next successful save clears the debris
    cont = train(
        _cfg(
            tmp_path,
            token_cache,
            "recipe=delayed",
            "trainer.max_steps=6",
            "trainer.ckpt_interval=2",
            "trainer.val_interval=0",
        )
    )
    assert cont.start_step == 4
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]


NAN = [
    "recipe=bf16",
    "trainer.lr=1e30",
    "trainer.min_lr=1e30",
    "trainer.warmup_steps=0",
    "trainer.grad_clip=0",
    "trainer.max_steps=6",
    "trainer.ckpt_interval=1",
    "trainer.val_interval=0",
]


def test_nan_loss_stops_with_the_step_and_last_good_checkpoint(tmp_path, token_cache):
    with pytest.raises(NonFiniteLossError) as info:
        train(_cfg(tmp_path, token_cache, *NAN))
    err = info.value
    assert err.step == 2 and err.last_checkpoint.name == "step_00000001.pt"
    assert "at step 2" in str(err) and "step_00000001.pt" in str(err)


def test_nan_skip_policy_counts_skipped_batches(tmp_path, token_cache):
    with pytest.raises(NonFiniteLossError):
        train(
            _cfg(
                tmp_path,
                token_cache,
                *NAN,
                "trainer.nan_policy=skip",
                "trainer.max_skipped_steps=2",
                "trainer.ckpt_interval=0",
            )
        )
    ok = train(
        _cfg(
            tmp_path,
            token_cache,
            *NAN,
            "trainer.nan_policy=skip",
            "trainer.max_skipped_steps=10",
            "trainer.log_interval=1",
            "trainer.ckpt_interval=0",
            "run.tag=skip",
        )
    )
    assert ok.skipped_steps == 5 and [h["skipped"] for h in ok.history] == [False] + [True] * 5
    skipped = [e.value for e in _events(ok.run_dir).Scalars("train/skipped_steps")]
    assert skipped[-1] == 5


def test_skipped_non_finite_steps_leave_the_delayed_scaling_histories_finite(tmp_path, token_cache):
    """nan_policy=skip with delayed scaling: the skipped batches' Inf/NaN amaxes are discarded, so
    no scale is pinned by them for amax_history_len steps."""
    from nemo_fp8_recipes.nn import fp8_modules, pinned_scales

    nan = [o if not o.startswith("recipe=") else "recipe=delayed" for o in NAN]
    ok = train(
        _cfg(
            tmp_path,
            token_cache,
            *nan,
            "trainer.nan_policy=skip",
            "trainer.max_skipped_steps=10",
            "trainer.ckpt_interval=0",
        )
    )
    assert ok.skipped_steps == 5
    mods = [m for m in fp8_modules(ok.model).values() if m.recipe.is_delayed]
    assert mods and all(torch.isfinite(m.fp8_amax_history).all() for m in mods)
    assert pinned_scales(ok.model) == {}


def test_cli_errors_are_clean_and_name_the_fix(tmp_path, token_cache, capsys, monkeypatch):
    base = TINY + [f"run.root={tmp_path}", f"data.cache_dir={token_cache}"]
    # NaN: exit code 3, step and checkpoint named, no traceback
    assert main(base + NAN) == 3
    err = capsys.readouterr().err
    assert "non-finite" in err and "at step 2" in err and "step_00000001.pt" in err and "Traceback" not in err
    # missing data
    assert main(base + ["data=text", f"data.paths=[{tmp_path / 'nowhere'}]"]) == 2
    err = capsys.readouterr().err
    assert "data path not found" in err and "Traceback" not in err
    # mxfp8 on a Hopper GPU without emulation: the core's check surfaces as one clean line
    hopper = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), cuda_version=(12, 9))
    monkeypatch.setattr(recipes_mod, "describe_device", lambda device=None: hopper)
    assert main(base + ["recipe=mxfp8"]) == 2
    err = capsys.readouterr().err
    assert "mxfp8 needs SM100" in err and "emulate=true" in err and "Traceback" not in err


def test_console_script_trains_and_prints_the_tensorboard_command(tmp_path, token_cache):
    exe = shutil.which("nemo-fp8-train")
    cmd = [exe] if exe else [sys.executable, "-m", "nemo_fp8_recipes.train"]
    args = TINY + [
        f"run.root={tmp_path}",
        f"data.cache_dir={token_cache}",
        "recipe=tensorwise",
        "trainer.max_steps=3",
        "trainer.val_interval=0",
    ]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    run_dir = tmp_path / "llama3_tiny" / "tensorwise"
    assert f"tensorboard --logdir {tmp_path / 'llama3_tiny'}" in out
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # Hydra's own copy lands in the run dir
    assert (run_dir / "config.yaml").is_file() and list(run_dir.glob("events.out.tfevents.*"))
    assert not (tmp_path / "outputs").exists()
    # the audit says what ran: on the CPU (no autocast) the high-precision modules ran in FP32,
    # and the kernel options are the GPU's (the emulation runs here)
    audit_txt = (run_dir / "audit.txt").read_text()
    output_row = next(line for line in audit_txt.splitlines() if line.startswith("output "))
    assert output_row.split()[2] == "fp32", output_row
    assert "on the CPU the FP8 linears run the emulation" in audit_txt
    # the job's log is train.log, whichever module Hydra starts from, each line once
    log = (run_dir / "train.log").read_text()
    assert len([line for line in log.splitlines() if "step 3/3" in line and "| loss" in line]) == 1, log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list_recipes())
def test_compile_trains_like_eager(recipe, tmp_path, token_cache):
    args = [
        f"recipe={recipe}",
        "trainer.max_steps=4",
        "trainer.log_interval=2",
        "trainer.val_interval=2",
        "trainer.val_steps=1",
        "trainer.telemetry_interval=2",
        "model.num_layers=1",
    ]  # (compile time per layer)
    if recipe in ("blockwise", "mxfp8"):
        # torch.compile's C++ backend fails on these emulations after minutes: refused at once
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=f"cannot compile recipe {recipe}.*trainer.compile=false"):
            train(_cfg(tmp_path / "compiled", token_cache, *args, "trainer.compile=true"))
        assert time.monotonic() - t0 < 30 and not (tmp_path / "compiled").exists()
        return
    eager = train(_cfg(tmp_path / "eager", token_cache, *args))
    compiled = train(_cfg(tmp_path / "compiled", token_cache, *args, "trainer.compile=true"))
    # FP8 rounding can flip on ULP-level differences of the compiled non-FP8 ops: loose tolerance
    tol = 1e-3 if recipe == "bf16" else 1e-2
    for step, loss in eager.losses.items():
        assert abs(compiled.losses[step] - loss) < tol * abs(loss), (step, loss, compiled.losses[step])
    assert compiled.history[-1]["loss"] < compiled.history[0]["loss"]
    assert compiled.audit_table.splitlines()[-1] == eager.audit_table.splitlines()[-1]  # same GEMMs in FP8


@pytest.mark.slow
def test_compile_with_micro_batches_caches_fp8_weights(tmp_path, token_cache):
    """trainer.compile=true with two micro-batches per step: the FP8 linears' compiled forward
    reads their weights quantised once per optimizer step (trainer.compiled_weight_cache, on by
    default), the losses follow the run without the cache, no cache is stale at the end, and
    resuming from the checkpoint re-quantises from the loaded weights."""
    # one layer: what is checked is per FP8 linear, and compiling on CPU costs time per layer
    args = [
        "recipe=tensorwise",
        "trainer.compile=true",
        "trainer.global_batch_size=8",
        "trainer.max_steps=2",
        "trainer.val_interval=0",
        "trainer.log_interval=1",
        "model.num_layers=1",
    ]
    cached = train(_cfg(tmp_path / "cached", token_cache, *args, "trainer.ckpt_interval=2"))
    plain = train(_cfg(tmp_path / "plain", token_cache, *args, "trainer.compiled_weight_cache=false"))
    n_fp8 = sum(isinstance(m, Float8Linear) for m in cached.model.modules())
    assert cached.compiled_weight_cache == n_fp8 > 0 and plain.compiled_weight_cache == 0
    for step, loss in plain.losses.items():
        assert abs(cached.losses[step] - loss) < 1e-2 * abs(loss), (step, loss, cached.losses[step])
    assert audit(cached.model, strict=True).stale_weight_caches == []
    resumed = train(_cfg(tmp_path / "cached", token_cache, *args, "trainer.ckpt_interval=2", "trainer.max_steps=3"))
    assert resumed.start_step == 2 and resumed.compiled_weight_cache == n_fp8
    assert audit(resumed.model, strict=True).stale_weight_caches == []


def test_compile_mode_is_checked_before_any_work(tmp_path, token_cache):
    """``trainer.compile_mode``: an unknown mode lists the valid ones, a mode without
    ``trainer.compile=true`` says so, and a CUDA-graph mode on CPU is refused (Inductor would skip
    the graphs there without a word) before the run directory exists."""
    with pytest.raises(ConfigError, match="compile_mode='fast' is not valid; choose one of: default, reduce-overhead"):
        train(_cfg(tmp_path / "a", token_cache, "trainer.compile=true", "trainer.compile_mode=fast"))
    with pytest.raises(
        ConfigError, match="compile_mode=reduce-overhead is a torch.compile mode; it needs trainer.compile=true"
    ):
        train(_cfg(tmp_path / "b", token_cache, "trainer.compile_mode=reduce-overhead"))
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(
            ConfigError,
            match=f"compile_mode={mode} replays the compiled graphs as CUDA graphs and "
            "needs a CUDA device \\(this run: cpu\\)",
        ):
            train(
                _cfg(
                    tmp_path / "c",
                    token_cache,
                    "recipe=tensorwise",
                    "trainer.compile=true",
                    f"trainer.compile_mode={mode}",
                )
            )
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


# ---- GPU (run on the device machine; skipped on CPU with the reason) -------------------------
def _gpu_reason(recipe: str):
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    ok, reason = check_supported(recipe, "cuda")
    return None if ok else reason


GPU_MODEL = [
    "model=llama3_tiny",
    "trainer.seq_len=256",
    "trainer.micro_batch_size=8",
    "trainer.global_batch_size=8",
    "trainer.warmup_steps=5",
    "trainer.progress=false",
    "trainer.device=cuda",
    "data.max_files=100",
    "trainer.val_steps=2",
]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list_recipes())
def test_gpu_run_uses_real_fp8_gemms(recipe, tmp_path, token_cache):
    reason = _gpu_reason(recipe)
    if reason:
        pytest.skip(reason)
    cfg = compose_config(
        GPU_MODEL
        + [
            f"recipe={recipe}",
            "trainer.max_steps=40",
            "trainer.log_interval=10",
            "trainer.val_interval=20",
            "trainer.telemetry_interval=10",
            f"run.root={tmp_path}",
            f"data.cache_dir={token_cache}",
        ]
    )
    result = train(cfg)
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 1.0
    if recipe != "bf16":
        assert "(real FP8 GEMMs)" in result.audit_table
    acc = _events(result.run_dir)
    assert "perf/mfu" in acc.Tags()["scalars"]  # the H100/H200 peaks are known


@pytest.mark.gpu
def test_gpu_mxfp8_on_hopper_needs_emulate(tmp_path, token_cache):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU (SM90)")
    base = GPU_MODEL + [
        f"run.root={tmp_path}",
        f"data.cache_dir={token_cache}",
        "recipe=mxfp8",
        "trainer.max_steps=20",
        "trainer.val_interval=0",
        "trainer.log_interval=5",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_recipes.train", *base], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "mxfp8 needs SM100" in err and "emulate=true" in err and "Traceback" not in err
    result = train(compose_config(base + ["recipe.emulate=true"]))
    assert "(emulated)" in result.audit_table
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_fused_wgrad_accumulation_trains_like_unfused(tmp_path, token_cache, monkeypatch):
    """``trainer.fuse_wgrad_accumulation=true`` with two micro-batches per step: the second adds
    into the FP32 gradients inside the wgrad GEMM (emulated on CPU: the same FP32 add), so the
    run is the unfused run, loss for loss; under compile it is refused with the fix."""
    args = [
        "recipe=tensorwise",
        "trainer.max_steps=3",
        "trainer.log_interval=1",
        "trainer.val_interval=0",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=4",
        "trainer.checkpoint=false",
    ]
    from nemo_fp8_recipes.nn import fp8_modules, gemms

    plain = train(_cfg(tmp_path / "plain", token_cache, *args))
    calls = []
    real = gemms.accumulate_wgrad
    monkeypatch.setattr(gemms, "accumulate_wgrad", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = train(_cfg(tmp_path / "fused", token_cache, *args, "trainer.fuse_wgrad_accumulation=true"))
    assert fused.losses == plain.losses
    n_fp8 = len(fp8_modules(fused.model))
    assert n_fp8 and len(calls) == 3 * n_fp8  # micro-batch 2 of each of the 3 steps, every FP8 linear
    assert all(m.fuse_wgrad_accumulation for m in fp8_modules(fused.model).values())
    with pytest.raises(ValueError, match="turn one of the two off"):
        train(_cfg(tmp_path / "c", token_cache, *args, "trainer.fuse_wgrad_accumulation=true", "trainer.compile=true"))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_gpu_fused_wgrad_accumulation_trains_like_unfused(recipe, tmp_path, token_cache, monkeypatch):
    """Real FP8 GEMMs, four micro-batches per step: the cuBLASLt accumulating wgrad GEMM gives the
    unfused run's curve (one rounding per add instead of two: the losses agree to 1e-3)."""
    reason = _gpu_reason(recipe)
    if reason:
        pytest.skip(reason)
    base = GPU_MODEL + [
        f"recipe={recipe}",
        "trainer.max_steps=10",
        "trainer.log_interval=1",
        "trainer.val_interval=0",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8",
        "trainer.checkpoint=false",
        f"data.cache_dir={token_cache}",
    ]
    from nemo_fp8_recipes.quant import cublaslt

    plain = train(compose_config(base + [f"run.root={tmp_path / 'plain'}"]))
    calls = []
    real = cublaslt.fp8_matmul_accumulate
    monkeypatch.setattr(cublaslt, "fp8_matmul_accumulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = train(compose_config(base + [f"run.root={tmp_path / 'fused'}", "trainer.fuse_wgrad_accumulation=true"]))
    assert "(real FP8 GEMMs)" in fused.audit_table
    from nemo_fp8_recipes.nn import fp8_modules

    assert len(calls) == 10 * 3 * len(fp8_modules(fused.model))  # 10 steps x micro-batches 2..4 x every FP8 linear
    for step, loss in plain.losses.items():
        assert abs(fused.losses[step] - loss) < 1e-3 * abs(loss), (step, loss, fused.losses[step])


def test_main_called_from_python_gives_the_callers_logging_back(tmp_path, capsys, caplog):
    """Hydra configures logging for its job (a console handler on the stderr of the moment, the
    job's log file); called from Python, ``main`` puts the caller's handlers back, so later log
    records neither go to a closed stream nor into the finished job's log file."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    code = main(
        [
            "model=llama3_tiny",
            "trainer.device=cpu",
            "trainer.progress=false",
            f"run.root={tmp_path}",
            "trainer.resume=/nonexistent/step.pt",
        ]
    )
    assert code == 4  # a checkpoint error, raised inside the Hydra job
    assert "no such checkpoint file" in capsys.readouterr().err
    assert root.handlers == before
    logging.getLogger("nemo_fp8_recipes.after").warning("still logging")
    assert "still logging" in caplog.text


def test_kernel_options_reach_the_model_and_are_recorded(tmp_path, token_cache, monkeypatch, capsys):
    """``kernels.*`` (and a ``NEMO_FP8_*`` default for the fields left null) run the model's FP8
    linears and norms with those options, and config.yaml, audit.txt and summary.json say so; a
    bad value stops the run before any work with the option named."""
    import json

    from nemo_fp8_recipes.nn import fp8_modules
    from nemo_fp8_recipes.options import KernelOptions

    monkeypatch.setenv("NEMO_FP8_SHARED_INPUT", "0")
    cfg = _cfg(
        tmp_path,
        token_cache,
        "recipe=tensorwise",
        "trainer.max_steps=2",
        "kernels.fused_swiglu=false",
        "trainer.val_interval=0",
    )
    result = train(cfg)
    want = KernelOptions(shared_input=False, fused_swiglu=False)
    mods = fp8_modules(result.model)
    assert mods and all(m.kernel_options == want for m in mods.values())
    assert result.model.norm.kernel_options == want
    run_dir = result.run_dir
    assert "shared_input: false" in (run_dir / "config.yaml").read_text()
    assert "fused_swiglu: false" in (run_dir / "config.yaml").read_text()
    assert f"kernel options: {want.describe()}" in (run_dir / "audit.txt").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["kernel_options"] == want.as_dict()
    monkeypatch.delenv("NEMO_FP8_SHARED_INPUT")
    base = TINY + [f"run.root={tmp_path / 'bad'}", f"data.cache_dir={token_cache}"]
    assert main(base + ["kernels.triton=maybe"]) == 2
    assert "kernels: KernelOptions.triton must be True or False" in capsys.readouterr().err
    assert main(base + ["kernels=reference", "trainer.max_steps=1", "trainer.val_interval=0"]) == 0
    summary = json.loads((tmp_path / "bad" / "llama3_tiny" / "blockwise" / "summary.json").read_text())
    assert not any(summary["kernel_options"].values())


def test_size_rule_from_the_config_reaches_the_model_and_the_audit(tmp_path, token_cache):
    """``policy.min_fp8_weight_elements`` keeps the GEMMs below it in BF16; config.yaml records the
    rule and audit.txt names each kept GEMM with its size."""
    from nemo_fp8_recipes.nn import fp8_modules

    # TINY: wq/wo/w1/w2/w3 are 256x256 = 65,536 elements; wk/wv 128x256 = 32,768
    cfg = _cfg(
        tmp_path,
        token_cache,
        "recipe=tensorwise",
        "trainer.max_steps=2",
        "trainer.val_interval=0",
        "policy.min_fp8_weight_elements=50000",
    )
    result = train(cfg)
    names = set(fp8_modules(result.model))
    assert "layers.0.attention.wq" in names and "layers.1.feed_forward.w2" in names
    assert not any(n.endswith((".wk", ".wv")) for n in names)
    assert "min_fp8_weight_elements: 50000" in (result.run_dir / "config.yaml").read_text()
    audit_txt = (result.run_dir / "audit.txt").read_text()
    assert "128x256 weight (32,768 elements) is below min_fp8_weight_elements=50,000 (policy)" in audit_txt
    assert (
        main(
            TINY
            + [f"run.root={tmp_path / 'bad'}", f"data.cache_dir={token_cache}", "policy.min_fp8_weight_elements=lots"]
        )
        == 2
    )


def test_the_small_gemm_hint_names_the_size_rule(tmp_path, token_cache, caplog):
    """On a GPU the trainer warns when every FP8 GEMM is below the recipe's measured crossover
    (checked here on the CPU model through the same method); with the size rule on it stays quiet."""
    import logging

    from nemo_fp8_recipes.trainer import Trainer

    for rule, expect in (("0", True), ("auto", False)):
        trainer = Trainer(
            _cfg(tmp_path / rule, token_cache, "recipe=tensorwise", f"policy.min_fp8_weight_elements={rule}")
        )
        try:
            trainer.setup()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="nemo_fp8_recipes.train"):
                trainer._hint_small_gemms(trainer.raw_model)
        finally:
            trainer.close()
        assert ("below the measured tensorwise FP8/BF16 crossover" in caplog.text) == expect, caplog.text


def _rel_dev(a: dict, b: dict) -> float:
    """Largest relative difference between two ``{step: value}`` curves over the same steps."""
    assert a.keys() == b.keys()
    return max((abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b), default=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "recipe,accum", [("bf16", 1), ("tensorwise", 1), ("tensorwise", 2), ("blockwise", 2), ("delayed", 2)]
)
def test_gpu_cuda_graphs_train_like_the_default_compile(recipe, accum, tmp_path, token_cache):
    """``trainer.compile_mode=reduce-overhead`` (the compiled graphs replayed as CUDA graphs)
    trains the model the default mode trains, with one and two micro-batches per step (the
    gradients copied out of the graph pool before they are accumulated), delayed scaling's in-graph
    amaxes and the compiled weight cache included, and validation in between; every graph of the
    step is captured. Both runs are deterministic (``trainer.deterministic=true``), so neither
    carries run-to-run noise — which, with several tests sharing the GPU (``pytest -n 4``), grew
    beyond these bounds. Not bit for bit: on an H100 the replays left the default mode's losses by
    up to 2e-5 relative over these 6 steps. So the losses and validation must agree to 1e-4
    relative and the gradient norms (what a gradient overwritten by a later replay changes first,
    by far more) to 1e-3."""
    reason = _gpu_reason(recipe)
    if reason:
        pytest.skip(reason)
    base = GPU_MODEL + [
        f"recipe={recipe}",
        "trainer.max_steps=6",
        "trainer.log_interval=1",
        "trainer.val_interval=3",
        "trainer.compile=true",
        "trainer.micro_batch_size=4",
        f"trainer.global_batch_size={4 * accum}",
        "trainer.checkpoint=false",
        "trainer.telemetry_interval=0",
        "trainer.deterministic=true",
        f"data.cache_dir={token_cache}",
    ]
    plain = train(compose_config(base + [f"run.root={tmp_path / 'default'}"]))
    graphs = train(compose_config(base + [f"run.root={tmp_path / 'graphs'}", "trainer.compile_mode=reduce-overhead"]))
    assert graphs.cuda_graph_skips == 0 and plain.cuda_graph_skips is None

    def norms(r):
        return {h["step"]: h["grad_norm"] for h in r.history}

    for what, get, floor in (
        ("loss", lambda r: r.losses, 1e-4),
        ("val", lambda r: dict(r.val), 1e-4),
        ("grad norm", norms, 1e-3),
    ):
        assert _rel_dev(get(graphs), get(plain)) <= floor, (what, get(graphs), get(plain))
    for (name, a), b in zip(plain.model.state_dict().items(), graphs.model.state_dict().values()):
        if torch.is_floating_point(a):  # (AdamW magnifies rounding in near-zero gradients: per tensor, not per element)
            assert float((a.float() - b.float()).norm()) <= 1e-2 * float(a.float().norm()) + 1e-6, name
    summary = json.loads((graphs.run_dir / "summary.json").read_text())
    assert summary["compile_mode"] == "reduce-overhead" and summary["cuda_graph_skips"] == 0


def test_the_loop_talks_to_its_backend_through_the_protocol(tmp_path, token_cache):
    """A backend given to the Trainer is the one that runs: the loop calls the protocol's methods —
    the check and the conversion once, the autocast per forward (first micro-batch True, the others
    False, validation None), telemetry on and collected on its steps, the FP8 state snapshotted and
    restored around each validation, the audit once, and the post-optimizer hook after every step."""
    from nemo_fp8_recipes.trainer import Trainer
    from nemo_fp8_recipes.trainer.backends import NativeBackend

    calls = []

    class Recording(NativeBackend):
        name = "recording"

        def __getattribute__(self, attr):
            if attr in (
                "check",
                "convert",
                "autocast",
                "audit",
                "start_telemetry",
                "collect_telemetry",
                "snapshot",
                "restore",
                "after_optimizer_step",
                "skipped_step",
            ):
                method = super().__getattribute__(attr)

                def record(*args, **kwargs):
                    calls.append((attr, args[0]) if attr == "autocast" else attr)
                    return method(*args, **kwargs)

                return record
            return super().__getattribute__(attr)

    cfg = _cfg(
        tmp_path,
        token_cache,
        "recipe=delayed",
        "trainer.max_steps=4",
        "trainer.global_batch_size=8",
        "trainer.val_interval=2",
        "trainer.telemetry_interval=2",
        "trainer.checkpoint=false",
    )
    trainer = Trainer(cfg, backend=Recording())
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert result.final_step == 4 and calls[:2] == ["check", "convert"]
    steps = [c for c in calls if c == "after_optimizer_step"]
    assert len(steps) == 4 and calls.count("audit") == 1 and "skipped_step" not in calls
    assert [c for c in calls if isinstance(c, tuple)] == (
        [("autocast", True), ("autocast", False)] * 2 + [("autocast", None)] * 2
    ) * 2
    assert calls.count("start_telemetry") == calls.count("collect_telemetry") == 2
    assert calls.count("snapshot") == calls.count("restore") == 2
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["steps"] == 4


def test_delayed_e4m3_gradients_with_a_margin_stall_and_are_warned_about(tmp_path, token_cache, caplog):
    """recipe.numerics_warnings()'s claim, on real runs: delayed scaling with E4M3 gradients, a
    margin and the max of the amax history flushes the later gradients to zero (dY's underflow
    telemetry) and training stalls where margin 0 trains; the trainer logs the warning."""
    finals, underflow = {}, {}
    for margin in (8, 0):
        cfg = _cfg(
            tmp_path,
            token_cache,
            "recipe=delayed",
            "recipe.grad_format=e4m3",
            f"recipe.margin={margin}",
            f"run.tag=m{margin}",
            "trainer.max_steps=150",
            "trainer.log_interval=10",
            "trainer.val_interval=0",
            "trainer.telemetry_interval=25",
            "trainer.checkpoint=false",
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="nemo_fp8_recipes.train"):
            train(cfg)
        warned = [r.getMessage() for r in caplog.records if "grad_format=e4m3" in r.getMessage()]
        assert bool(warned) == (margin == 8), warned
        acc = _events(tmp_path / "runs" / "llama3_tiny" / f"delayed-m{margin}")
        finals[margin] = [e.value for e in acc.Scalars("train/loss")][-1]
        underflow[margin] = max(e.value for e in acc.Scalars("fp8/mlp/grad_output/underflow_frac"))
    assert finals[8] > finals[0] + 0.2, finals
    assert underflow[8] > 0.2 > underflow[0], underflow
