"""SLURM submission: rendered sbatch scripts (1, 4 and 64 nodes, containers, Megatron-Bridge),
values that must never reach the shell, and a real submission through ``sbatch`` to a local
one-node cluster (munged + slurmctld + slurmd started by ``scripts/ci_start_slurm.sh``).

The real-cluster tests skip with the reason the start script recorded when the daemons are not
running on this machine (no root, packages missing, daemons failed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_fp8_recipes.config import ConfigError, compose_config, override_value
from nemo_fp8_recipes.launch.plan import BRIDGE_PRESETS, plan_jobs
from nemo_fp8_recipes.launch.sbatch import job_state, parse_job_id, wait_for_job
from nemo_fp8_recipes.launch.slurm import (
    ContainerSpec,
    SlurmJob,
    SlurmSpecError,
    check_job_name,
    render_command,
    render_sbatch,
)
from nemo_fp8_recipes.launch.submit import main

REPO = Path(__file__).resolve().parents[2]
IMAGE = "nvcr.io#nvidia/nemo:25.04"


def header(script: str):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def launch_argv(script: str):
    """The launch line (after '# ---- LAUNCH ----', continuation lines joined) split like bash."""
    body = script.split("# ---- LAUNCH ----\n", 1)[1]
    return shlex.split(body.replace("\\\n", " "))


def config_block(script: str) -> str:
    return script.split("# ---- CONFIG ----\n", 1)[1].split("\n\n", 1)[0]


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sbatch"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---- rendering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [1, 4, 64])
def test_native_script_for_1_4_64_nodes(nodes, tmp_path):
    """An 8B job the trainer would start: FSDP2 (its memory estimate per GPU fits an H100), a
    global batch that splits over every rank."""
    [job] = plan_jobs(
        [
            "recipe=blockwise",
            "model=llama3_8b",
            f"cluster.nodes={nodes}",
            "cluster.gpus_per_node=8",
            "cluster.gpu_type=H100",
            "cluster.partition=batch",
            "cluster.account=llm-fp8",
            "cluster.time=2-00:00:00",
            "cluster.mem=0",
            f"cluster.container.image='{IMAGE}'",
            "cluster.container.mounts=[/lustre/data:/data:ro]",
            f"run.root={tmp_path}/runs",
            "trainer.max_steps=1000",
            "trainer.data_parallel=fsdp2",
            "trainer.micro_batch_size=1",
            f"trainer.global_batch_size={8 * nodes}",
        ],
        cwd=tmp_path,
    )
    run_dir = f"{tmp_path}/runs/llama3_8b/blockwise"
    assert str(job.run_dir) == run_dir
    assert header(job.script) == [
        f"#SBATCH --job-name=llama3_8b-{8 * nodes}xH100-blockwise",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=batch",
        "#SBATCH --account=llm-fp8",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --mem=0",
        "#SBATCH --exclusive",
        "#SBATCH --signal=TERM@180",
        f"#SBATCH --chdir={tmp_path}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --error={run_dir}/slurm-%j.out",
    ]
    argv = launch_argv(job.script)
    assert argv[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert argv[3:7] == [
        "--container-image=$CONTAINER_IMAGE",
        "--container-mounts=$CONTAINER_MOUNTS",
        f"--container-workdir={tmp_path}",
        "--no-container-mount-home",
    ]
    t = argv.index("torchrun")
    assert argv[t : t + 9] == [
        "torchrun",
        "--nnodes=$SLURM_NNODES",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
        "-m",
        "nemo_fp8_recipes.train",
        "recipe=blockwise",
    ]
    assert argv[t + 8 :] == [
        "recipe=blockwise",
        "model=llama3_8b",
        "trainer.max_steps=1000",
        "trainer.data_parallel=fsdp2",
        "trainer.micro_batch_size=1",
        f"trainer.global_batch_size={8 * nodes}",
        "cluster=local",
        f"run.root={tmp_path}/runs",
    ]
    config = config_block(job.script)
    assert f"CONTAINER_IMAGE='{IMAGE}'" in config  # '#' would start a comment unquoted
    assert f"CONTAINER_MOUNTS=/lustre/data:/data:ro,{tmp_path}/runs,{tmp_path}" in config
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in config
    for env in ("NCCL_NVLS_ENABLE=0", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert f"export {env}" in config
    assert "NVTE_FP8_BLOCK" not in config  # the native backend has no Transformer Engine
    bash_syntax_ok(job.script, tmp_path)
    # the embedded trainer runs data parallel under torchrun: no "single process" warning
    assert not job.warnings
    assert f"{8 * nodes} processes (one per GPU), data parallel" in job.script or nodes * 8 == 1


def test_cpu_job_runs_plain_python_without_gpu_flags(tmp_path):
    [job] = plan_jobs(
        ["recipe=bf16", "cluster.gpus_per_node=0", "trainer.device=cpu", f"run.root={tmp_path}"], cwd=tmp_path
    )
    assert not any("gpus" in line for line in header(job.script))
    assert "#SBATCH --job-name=llama3_tiny-1xcpu-bf16" in header(job.script)
    argv = launch_argv(job.script)
    assert argv[3:] == [
        sys.executable,
        "-m",
        "nemo_fp8_recipes.train",
        "recipe=bf16",
        "trainer.device=cpu",
        "cluster=local",
        f"run.root={tmp_path}",
    ]
    launch = job.script.split("# ---- LAUNCH ----", 1)[1]
    assert "torchrun" not in launch and "--container" not in job.script
    assert not job.warnings
    [job] = plan_jobs(["cluster.gpus_per_node=0", "cluster.cpus_per_task=2", f"run.root={tmp_path}"], cwd=tmp_path)
    assert "#SBATCH --cpus-per-task=2" in header(job.script)
    assert "export OMP_NUM_THREADS=2" in config_block(job.script)  # no oversubscribed CPUs


def test_a_run_root_hydra_would_misread_reaches_the_job_intact(tmp_path):
    """A run root that the SLURM layer allows but Hydra would misread unquoted (``=`` makes a
    second override of it) reaches the trainer on the node as the same path: the job's overrides
    compose back to it."""
    root = tmp_path / "runs=1+a@b~c"
    [job] = plan_jobs(
        ["recipe=bf16", "cluster.gpus_per_node=0", "trainer.device=cpu", f"run.root={override_value(root)}"],
        cwd=tmp_path,
    )
    argv = launch_argv(job.script)
    overrides = argv[argv.index("nemo_fp8_recipes.train") + 1 :]
    assert compose_config(overrides).run.root == str(root)


def test_the_launch_line_quotes_its_expansions(tmp_path):
    """$SLURM_NNODES, $MASTER_ADDR, $MASTER_PORT and $SLURM_JOB_ID reach torchrun as one word each,
    whatever the environment's IFS."""
    [job] = plan_jobs(
        ["cluster.gpus_per_node=8", "cluster.nodes=2", "trainer.global_batch_size=64", f"run.root={tmp_path}"],
        cwd=tmp_path,
    )
    for word in (
        '"--nnodes=$SLURM_NNODES"',
        '"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"',
        '"--rdzv-id=$SLURM_JOB_ID"',
    ):
        assert word in job.script, word


def test_the_trainer_is_told_to_stop_before_the_time_limit(tmp_path):
    """The embedded trainer's jobs ask SLURM for SIGTERM cluster.signal_lead_s before the limit
    (it saves on SIGTERM); 0/null leaves only SLURM's own at the limit; bad values are refused."""
    [job] = plan_jobs(["cluster.gpus_per_node=0", f"run.root={tmp_path}"], cwd=tmp_path)
    assert "#SBATCH --signal=TERM@180" in header(job.script)
    for off in ("0", "null"):
        [job] = plan_jobs(
            [f"cluster.signal_lead_s={off}", "trainer.global_batch_size=32", f"run.root={tmp_path}"], cwd=tmp_path
        )
        assert not any("--signal" in line for line in header(job.script))
    for bad in ("-1", "70000", "true"):
        with pytest.raises(ConfigError, match="cluster.signal_lead_s"):
            plan_jobs([f"cluster.signal_lead_s={bad}", f"run.root={tmp_path}"], cwd=tmp_path)
    with pytest.raises(ConfigError, match="cluster.signal_lead_s"):
        plan_jobs(["+cluster.sbatch_args.signal=USR1@60", f"run.root={tmp_path}"], cwd=tmp_path)


def test_megatron_bridge_launch_line(tmp_path):
    """backend=megatron_bridge: our Bridge launcher with the recipe applied in full, Bridge's own
    keys passed through, the run directory wired to Bridge's logger and checkpoints."""
    [job] = plan_jobs(
        [
            "backend=megatron_bridge",
            "model=llama3_8b",
            "recipe=blockwise",
            "cluster.nodes=4",
            "cluster.gpu_type=H200",
            "policy.first_layers_bf16=1",
            "train.train_iters=500",
            "dataset.blend=[[/data/my_text_document],null]",
            f"cluster.container.image='{IMAGE}'",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    argv = launch_argv(job.script)
    t = argv.index("torchrun")
    run_dir = f"{tmp_path}/llama3_8b/blockwise-bridge"
    assert "#SBATCH --job-name=llama3_8b-32xH200-blockwise-bridge" in header(job.script)
    assert argv[t + 1 :] == [
        "--nnodes=$SLURM_NNODES",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
        "-m",
        "nemo_fp8_recipes.integrations.bridge",
        "backend=megatron_bridge",
        "model=llama3_8b",
        "recipe=blockwise",
        "policy.first_layers_bf16=1",
        f"run.dir={run_dir}",
        "train.train_iters=500",
        "dataset.blend=[[/data/my_text_document],null]",
        f"logger.tensorboard_dir={run_dir}",
        f"checkpoint.save={run_dir}/checkpoints",
    ]
    # Transformer Engine reads its power-of-2 switch at import: the script exports the recipe's value
    assert "export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0" in config_block(job.script)
    assert not any("torch.distributed" in w for w in job.warnings)  # Bridge does its own distributed set-up
    bash_syntax_ok(job.script, tmp_path)

    # Bridge's own run_recipe.py with the recipe's preset
    # the published 70B recipe needs TP4 x PP4 x CP2 = 32 GPUs: refused on one node of 8, before it queues
    with pytest.raises(ConfigError, match="needs a multiple of 32 GPUs.*cluster.nodes=1 x cluster.gpus_per_node=8"):
        plan_jobs(
            [
                "backend=megatron_bridge",
                "model=llama3_70b",
                "recipe=mxfp8",
                "cluster.gpu_type=B200",
                f"run.root={tmp_path}",
            ],
            cwd=tmp_path,
        )
    [job] = plan_jobs(
        [
            "backend=megatron_bridge",
            "model=llama3_70b",
            "recipe=mxfp8",
            "cluster.gpu_type=B200",
            "cluster.nodes=4",
            "submit.bridge.entry=run_recipe",
            "train.train_iters=500",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    argv = launch_argv(job.script)
    run_dir = f"{tmp_path}/llama3_70b/mxfp8-bridge"
    t = next(i for i, a in enumerate(argv) if a.endswith("torchrun"))  # the interpreter's own torchrun
    assert argv[t + 6 :] == [
        "$BRIDGE_DIR/scripts/training/run_recipe.py",
        "--recipe",
        "llama3_70b_pretrain_config",
        "--dataset",
        "llm-pretrain-mock",
        "mixed_precision=bf16_with_mxfp8_mixed",
        f"logger.tensorboard_dir={run_dir}",
        f"checkpoint.save={run_dir}/checkpoints",
        "train.train_iters=500",
    ]
    assert "BRIDGE_DIR=/opt/Megatron-Bridge" in config_block(job.script)
    assert any("preset bf16_with_mxfp8_mixed" in w for w in job.warnings)
    assert set(BRIDGE_PRESETS) == {"bf16", "delayed", "tensorwise", "blockwise", "mxfp8"}
    bash_syntax_ok(job.script, tmp_path)


def test_megatron_bridge_job_for_our_model_built_offline(tmp_path):
    [job] = plan_jobs(
        [
            "backend=megatron_bridge",
            "model=llama3_tiny",
            "recipe=tensorwise",
            "cluster.gpus_per_node=1",
            "cluster.gpu_type=H200",
            "trainer.max_steps=20",
            "backend.strict_audit=true",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    argv = launch_argv(job.script)
    m = argv.index("nemo_fp8_recipes.integrations.bridge")
    run_dir = f"{tmp_path}/llama3_tiny/tensorwise-bridge"
    assert argv[m + 1 :] == [
        "backend=megatron_bridge",
        "model=llama3_tiny",
        "recipe=tensorwise",
        "trainer.max_steps=20",
        "backend.strict_audit=true",
        f"run.dir={run_dir}",
        f"logger.tensorboard_dir={run_dir}",
        f"checkpoint.save={run_dir}/checkpoints",
    ]
    assert "built from our model config (offline), 1 GPU(s) per replica" in job.script
    with pytest.raises(ConfigError, match="run_recipe runs a Bridge recipe function"):
        plan_jobs(
            ["backend=megatron_bridge", "model=llama3_tiny", "submit.bridge.entry=run_recipe", f"run.root={tmp_path}"],
            cwd=tmp_path,
        )


def test_megatron_bridge_jobs_are_checked_before_they_queue(tmp_path):
    # the pre-launch validator runs for the GPUs the job asks for, not for this machine
    with pytest.raises(ConfigError, match="mxfp8 needs SM100"):
        plan_jobs(["backend=megatron_bridge", "model=llama3_8b", "recipe=mxfp8", "cluster.gpu_type=H100"], cwd=tmp_path)
    with pytest.raises(ConfigError, match="model=llama3_tiny has no Megatron-Bridge pretraining recipe"):
        plan_jobs(["backend=megatron_bridge", "backend.provider=recipe", f"run.root={tmp_path}"], cwd=tmp_path)
    with pytest.raises(ConfigError, match="needs GPUs"):
        plan_jobs(["backend=megatron_bridge", "model=llama3_8b", "cluster.gpus_per_node=0"], cwd=tmp_path)
    with pytest.raises(SlurmSpecError, match="contradicts recipe blockwise"):
        plan_jobs(
            [
                "backend=megatron_bridge",
                "model=llama3_8b",
                "recipe=blockwise",
                "+cluster.env.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
            ],
            cwd=tmp_path,
        )
    [job] = plan_jobs(
        [
            "backend=megatron_bridge",
            "model=llama3_8b",
            "recipe=blockwise",
            "recipe.scale_rounding=fp32",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert "export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in job.script
    # Bridge keys are not nemo-fp8-train keys: with the native backend they are unknown
    with pytest.raises(ConfigError, match="unknown config key 'train.train_iters'"):
        plan_jobs(["train.train_iters=5"], cwd=tmp_path)


def test_sweep_gives_one_job_per_recipe_side_by_side(tmp_path, capsys):
    example = [
        "recipe=bf16,tensorwise,blockwise",
        "model=llama3_8b",
        "cluster.nodes=2",
        "cluster.gpu_type=H100",
        "trainer.data_parallel=fsdp2",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=64",
    ]
    jobs = plan_jobs([*example, f"run.root={tmp_path}"], multirun=True, cwd=tmp_path)
    assert [j.run_dir for j in jobs] == [tmp_path / "llama3_8b" / r for r in ("bf16", "tensorwise", "blockwise")]
    assert [j.job.job_name for j in jobs] == [f"llama3_8b-16xH100-{r}" for r in ("bf16", "tensorwise", "blockwise")]
    assert not any(j.warnings for j in jobs)
    # the same without FSDP2 or with the trainer's default batch: refused before anything is submitted
    with pytest.raises(ConfigError, match=r"needs about .* to train .* an NVIDIA H100 \(80 GB\)"):
        plan_jobs(
            [*example[:4], "trainer.micro_batch_size=1", "trainer.global_batch_size=64", f"run.root={tmp_path}"],
            multirun=True,
            cwd=tmp_path,
        )
    with pytest.raises(ConfigError, match=r"x 16 data-parallel ranks; e.g. trainer.global_batch_size=64"):
        plan_jobs([*example[:5], f"run.root={tmp_path}"], multirun=True, cwd=tmp_path)
    for j, r in zip(jobs, ("bf16", "tensorwise", "blockwise")):
        argv = launch_argv(j.script)
        assert f"recipe={r}" in argv and "recipe=bf16,tensorwise,blockwise" not in argv
    # the CLI's dry run prints the three scripts and writes nothing
    assert main(["-m", *example, "submit.dry_run=true", f"run.root={tmp_path}/dry"]) == 0
    out = capsys.readouterr().out
    assert out.count("#!/bin/bash") == 3 and out.count("# ===== ") == 3
    assert not (tmp_path / "dry").exists()
    with pytest.raises(ConfigError, match="add -m"):
        plan_jobs(["recipe=bf16,tensorwise"], cwd=tmp_path)
    # a sweep over any other key names each job's run by it (run.sweep), so no two share one
    one = "cluster.gpus_per_node=1"
    lr = plan_jobs(
        ["trainer.lr=1e-3,2e-3", "trainer.seed=1,2", one, f"run.root={tmp_path}"], multirun=True, cwd=tmp_path
    )
    assert [j.run_dir.name for j in lr] == [
        "blockwise-lr0.001-seed1",
        "blockwise-lr0.001-seed2",
        "blockwise-lr0.002-seed1",
        "blockwise-lr0.002-seed2",
    ]
    assert "run.sweep=[trainer.lr,trainer.seed]" in launch_argv(lr[0].script)
    with pytest.raises(ConfigError, match="share a run directory"):  # unless the naming is turned off
        plan_jobs(["trainer.lr=1e-3,2e-3", "run.sweep=[]", one], multirun=True, cwd=tmp_path)


def test_dry_run_prints_the_script_only(tmp_path, capsys):
    assert (
        main(
            ["submit.dry_run=true", f"run.root={tmp_path}/runs", "cluster.job_name=my.job-1", "cluster.gpus_per_node=1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n#SBATCH --job-name=my.job-1\n")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ("cluster.job_name='bad\"name'", "cluster.job_name"),
        ("cluster.job_name='two words'", "cluster.job_name"),
        ("cluster.partition='batch;reboot'", "cluster.partition"),
        ("cluster.account='$(whoami)'", "cluster.account"),
        ("cluster.time='4 hours'", "cluster.time"),
        ("cluster.container.mounts=['/data:/data,/etc:/etc']", "cluster.container.mounts"),
        ("cluster.container.image='img`id`'", "cluster.container.image"),
        ('run.tag="it\'s"', "run.tag"),
        ("+cluster.sbatch_args.output=/tmp/x", "cluster.sbatch_args.output"),
        ("+cluster.sbatch_args.reservation='a b'", "cluster.sbatch_args.reservation"),
        ("+cluster.env.BAD-NAME=1", "cluster.env name"),
        # names the shell, the script or SLURM itself reads: IFS=- would split the rendezvous endpoint
        ("+cluster.env.IFS=-", "cluster.env.IFS cannot be exported"),
        ("+cluster.env.BASH_ENV=/tmp/x", "cluster.env.BASH_ENV cannot be exported"),
        ("+cluster.env.MASTER_PORT=1", "cluster.env.MASTER_PORT cannot be exported"),
        ("+cluster.env.SLURM_NNODES=9", "cluster.env.SLURM_NNODES cannot be exported"),
        # sbatch takes unambiguous abbreviations of long options: these would set what we render
        ("+cluster.sbatch_args.outp=/tmp/x", "cluster.sbatch_args.outp"),
        ("+cluster.sbatch_args.chd=/tmp", "cluster.sbatch_args.chd"),
        ("+cluster.sbatch_args.job=x", "cluster.sbatch_args.job"),
        ("+cluster.sbatch_args.err=/tmp/x", "cluster.sbatch_args.err"),
        ("+cluster.sbatch_args.partit=a", "cluster.sbatch_args.partit"),
        # program fields: never an srun option, never a path relative to an unknown directory
        ("cluster.python='--export=NONE'", "cluster.python"),
        ("cluster.torchrun='-n'", "cluster.torchrun"),
        ("cluster.python=venv/bin/python", "cluster.python"),
        ("cluster.python='~no_such_user_xyz/bin/python'", "cluster.python"),
        ("+cluster.env.FOO=[a,b]", "cluster.env.FOO"),
    ],
)
def test_bad_values_are_rejected_not_injected(override, key, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        plan_jobs([override, f"run.root={tmp_path}"], cwd=tmp_path)
    assert key in str(e.value)
    assert main([override, f"run.root={tmp_path}", "submit.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err and "#SBATCH" not in err


def test_abbreviations_of_our_sbatch_options_are_refused_other_options_pass(tmp_path):
    from nemo_fp8_recipes.launch.slurm import reserved_sbatch_option

    assert reserved_sbatch_option("outp") == "output" and reserved_sbatch_option("o") == "output"
    assert reserved_sbatch_option("exclusive") == "exclusive" and reserved_sbatch_option("exclu") == "exclusive"
    assert reserved_sbatch_option("tasks-per-node") == "ntasks-per-node"  # SLURM's deprecated alias
    assert reserved_sbatch_option("signal") == "signal" and reserved_sbatch_option("sig") == "signal"
    for other in ("gpus", "ntasks", "reservation", "constraint", "exclude", "gres", "mem-per-gpu", "time-min"):
        assert reserved_sbatch_option(other) is None, other
    [job] = plan_jobs(
        [
            "+cluster.sbatch_args.reservation=r1",
            "+cluster.sbatch_args.exclude=node7",
            "+cluster.sbatch_args.requeue=true",
            "trainer.global_batch_size=32",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert {"#SBATCH --reservation=r1", "#SBATCH --exclude=node7", "#SBATCH --requeue"} <= set(header(job.script))


def test_program_fields_are_programs(tmp_path):
    home = os.path.expanduser("~")
    [job] = plan_jobs(
        ["cluster.gpus_per_node=0", "cluster.python='~/venv/bin/python'", f"run.root={tmp_path}"], cwd=tmp_path
    )
    assert launch_argv(job.script)[3] == f"{home}/venv/bin/python"  # expanded, not quoted into a dead path
    [job] = plan_jobs(["cluster.gpus_per_node=0", "cluster.python=python3", f"run.root={tmp_path}"], cwd=tmp_path)
    assert launch_argv(job.script)[3] == "python3"
    [job] = plan_jobs(
        ["cluster.torchrun=/opt/venv/bin/torchrun", "trainer.global_batch_size=32", f"run.root={tmp_path}"],
        cwd=tmp_path,
    )
    assert "/opt/venv/bin/torchrun" in launch_argv(job.script)


def test_cpu_jobs_on_several_nodes_run_data_parallel(tmp_path):
    [job] = plan_jobs(
        [
            "cluster.gpus_per_node=0",
            "cluster.nodes=2",
            "trainer.device=cpu",
            "trainer.micro_batch_size=2",
            f"run.root={tmp_path}",
        ],
        cwd=tmp_path,
    )
    argv = launch_argv(job.script)
    t = next(i for i, a in enumerate(argv) if a.endswith("torchrun"))
    assert argv[t + 2] == "--nproc-per-node=1"  # one process per node, gloo; not N independent copies
    assert "data parallel over gloo" in job.script


def test_newlines_are_rejected_everywhere(tmp_path):
    with pytest.raises(SlurmSpecError, match="letters, digits and . _ \\+ -"):
        check_job_name("job\n#SBATCH --account=other")
    with pytest.raises(ConfigError, match="no newline"):
        plan_jobs(["cluster.job_name=a\nb"], cwd=tmp_path)
    base = dict(job_name="ok", run_dir=str(tmp_path), command=("python", "-m", "x"))
    with pytest.raises(SlurmSpecError, match="one line"):
        render_sbatch(SlurmJob(**base, env={"A": "x\nrm -rf ~"}))
    with pytest.raises(SlurmSpecError, match="one line"):
        render_sbatch(SlurmJob(**{**base, "command": ("python", "a\nb")}))
    with pytest.raises(SlurmSpecError, match="cluster.container.workdir"):
        render_sbatch(SlurmJob(**base, container=ContainerSpec(image="img", workdir="/a b")))


def test_values_with_quotes_and_dollars_reach_the_program_verbatim(tmp_path):
    """What the shell does with a rendered command: each argument arrives exactly as given."""
    args = ["data.paths=['/data/my corpus']", "x=$(reboot)", "y=`id`", "z=it's", 'w="q"', "v=a;b|c&d", "u=*"]
    proc = subprocess.run(
        ["bash", "-c", "printf '%s\\n' " + render_command(args)], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.stdout.splitlines() == args
    [job] = plan_jobs(
        ["data=text", "data.paths=['/data/my corpus']", "trainer.global_batch_size=32", f"run.root={tmp_path}"],
        cwd=tmp_path,
    )
    assert "data.paths=['/data/my corpus']" in launch_argv(job.script)


def test_other_errors_are_actionable(tmp_path, capsys):
    with pytest.raises(ConfigError, match="use cluster=slurm"):
        plan_jobs(["cluster=local"], cwd=tmp_path)
    with pytest.raises(ConfigError, match="submitit_nemo"):
        plan_jobs(["hydra/launcher=submitit_slurm"], cwd=tmp_path)
    assert main(["cluster.nodez=2"]) == 2
    err = capsys.readouterr().err
    assert "cluster.nodez" in err and "Did you mean 'cluster.nodes'?" in err and "gpus_per_node" in err
    assert main(["--frobnicate"]) == 2
    assert main(["--help"]) == 0
    assert "submit.dry_run=true" in capsys.readouterr().out


def test_job_id_parsing():
    assert parse_job_id("4242\n") == "4242"
    assert parse_job_id("4242;cluster-a\n") == "4242"
    assert parse_job_id("sbatch: warning: something\nSubmitted batch job 17\n") == "17"


def test_submitit_launcher_preset_composes():
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason="hydra-submitit-launcher is not installed (pip install hydra-submitit-launcher)",
    )
    from hydra import compose, initialize_config_dir

    from nemo_fp8_recipes.config import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            config_name="train", overrides=["hydra/launcher=submitit_nemo", "recipe=mxfp8"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.timeout_min) == (1, 1, 1, 240)
    assert cfg.cluster.name == "local"  # each submitit job runs the trainer in-process


# ---- the real cluster ----------------------------------------------------------------------------
STATUS_FILE = Path(os.environ.get("NEMO_FP8_SLURM_DIR", "/tmp/nemo_fp8_slurm")) / "status"


def _read_status() -> dict:
    out = {}
    for line in STATUS_FILE.read_text().splitlines():
        k, _, v = line.partition("=")
        out[k.strip()] = v.strip()
    return out


@pytest.fixture(scope="module")
def slurm_env():
    """Environment for clients of the local test cluster; skips with the start script's reason."""
    if not STATUS_FILE.is_file():
        pytest.skip(
            f"no local SLURM cluster: {STATUS_FILE} is missing; start one with "
            "`bash scripts/ci_start_slurm.sh` (root, apt-get install slurm-wlm munge), as .ci/run does"
        )
    st = _read_status()
    if st.get("SLURM_STATUS") != "ok":
        pytest.skip(f"the local SLURM cluster is not available: {st.get('SLURM_REASON') or 'no reason recorded'}")
    env = {**os.environ, "SLURM_CONF": st["SLURM_CONF"]}
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"sinfo does not answer ({e}); re-run scripts/ci_start_slurm.sh")
    if proc.returncode != 0 or "idle" not in proc.stdout and "mix" not in proc.stdout and "alloc" not in proc.stdout:
        pytest.skip(
            f"the local SLURM cluster is not up (sinfo: {(proc.stdout + proc.stderr).strip()!r}); "
            "re-run scripts/ci_start_slurm.sh"
        )
    return env


TINY_JOB = [
    "cluster.gpus_per_node=0",
    "cluster.cpus_per_task=1",
    "cluster.exclusive=false",
    "cluster.time=10",
    "trainer.device=cpu",
    "model.num_layers=1",
    "trainer.seq_len=64",
    "trainer.max_steps=8",
    "trainer.log_interval=2",
    "trainer.val_interval=4",
    "trainer.val_steps=1",
    "trainer.telemetry_interval=4",
    "data.max_files=10",
    "trainer.progress=false",
]


def test_sweep_runs_on_a_real_slurm_cluster(slurm_env, tmp_path):
    """nemo-fp8-submit -m recipe=bf16,tensorwise through sbatch to the local slurmctld/slurmd: both
    jobs complete, their logs and TensorBoard events are there, and the runs compare cleanly."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_fp8_recipes.compare import main as compare_main

    t0 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "nemo_fp8_recipes.launch.submit",
        "-m",
        "recipe=bf16,tensorwise",
        *TINY_JOB,
        f"run.root={tmp_path}/runs",
        f"data.cache_dir={tmp_path}/cache",
        "submit.wait=true",
        "submit.wait_timeout_s=240",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_ids = re.findall(r"Submitted job (\d+) \((llama3_tiny-1xcpu-(?:bf16|tensorwise))\)", proc.stdout)
    assert [name for _, name in job_ids] == ["llama3_tiny-1xcpu-bf16", "llama3_tiny-1xcpu-tensorwise"]
    for (job_id, _), recipe in zip(job_ids, ("bf16", "tensorwise")):
        run_dir = tmp_path / "runs" / "llama3_tiny" / recipe
        # SLURM's own record of the job, independent of the submit command's waiting
        show = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], env=slurm_env, capture_output=True, text=True
        ).stdout
        assert "JobState=COMPLETED" in show and "ExitCode=0:0" in show, show
        assert f"JobName=llama3_tiny-1xcpu-{recipe}" in show
        assert wait_for_job(job_id, timeout_s=5, env=slurm_env).ok
        info = json.loads((run_dir / "submit.json").read_text())
        assert info["job_id"] == job_id and (run_dir / "submit.sbatch").is_file()
        log = (run_dir / f"slurm-{job_id}.out").read_text()
        assert f"job {job_id} on 1 node(s)" in log
        assert "done: 8 steps" in log and f"Run directory:    {run_dir}" in log
        acc = EventAccumulator(str(run_dir))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]
        assert [e.step for e in acc.Scalars("val/loss")] == [4, 8]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["recipe"] == recipe and summary["steps"] == 8
    assert job_state(job_ids[0][0], env=slurm_env).state == "COMPLETED"
    # the sweep's runs sit side by side and compare cleanly
    assert compare_main([str(tmp_path / "runs" / "llama3_tiny"), "--last", "4", "--no-png", "--no-events"]) == 0
    print(f"\nreal SLURM sweep: jobs {', '.join(j for j, _ in job_ids)} completed in {time.monotonic() - t0:.1f} s")


def test_scancel_on_a_real_slurm_cluster_keeps_the_finished_steps(slurm_env, tmp_path):
    """scancel (SIGTERM, then SIGKILL after KillWait) on a running training job: the trainer saves
    the step it finished, logs it, and the same submit resumes from there and completes."""
    base = [
        sys.executable,
        "-m",
        "nemo_fp8_recipes.launch.submit",
        *TINY_JOB,
        "recipe=tensorwise",
        "trainer.max_steps=400",
        "trainer.log_interval=1",
        "trainer.val_interval=0",
        "trainer.ckpt_interval=0",
        f"run.root={tmp_path}/runs",
        f"data.cache_dir={tmp_path}/cache",
    ]
    proc = subprocess.run(base, cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"Submitted job (\d+)", proc.stdout).group(1)
    run_dir = tmp_path / "runs" / "llama3_tiny" / "tensorwise"
    log = run_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + 180
    while not (log.is_file() and "step 3/400 | loss" in log.read_text()):
        assert time.monotonic() < deadline, log.read_text() if log.is_file() else "no log"
        assert job_state(job_id, env=slurm_env).state in ("PENDING", "RUNNING", None), job_state(job_id, env=slurm_env)
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=slurm_env, check=True, timeout=30)
    assert not wait_for_job(job_id, timeout_s=120, env=slurm_env).ok
    text = log.read_text()
    assert "SIGTERM received: stopping after the step in progress" in text, text[-3000:]
    stopped = int(text.split("received: stopped after step ")[1].split(";")[0])
    assert 3 <= stopped < 400 and (run_dir / "checkpoints" / f"step_{stopped:08d}.pt").is_file(), text[-3000:]
    # the same submission again continues from that step (trainer.resume=auto)
    again = subprocess.run(
        base + ["submit.wait=true", "submit.wait_timeout_s=240"],
        cwd=tmp_path,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    second_id = re.search(r"Submitted job (\d+)", again.stdout).group(1)
    second = run_dir / f"slurm-{second_id}.out"
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}.pt'}" in second.read_text()


def test_the_real_sbatch_expands_the_abbreviations_we_refuse(slurm_env, tmp_path):
    """What the prefix check is for, shown on the real sbatch: ``--outp`` writes the job's log where
    ``--output`` would, and every prefix of one of our options that the check refuses is either
    expanded to it by sbatch or refused by sbatch as ambiguous; the exact names we let through
    (--gpus, --ntasks) are options of their own."""
    from nemo_fp8_recipes.launch.slurm import (
        _OWN_SBATCH_OPTIONS,
        reserved_sbatch_option,
    )

    log = tmp_path / "abbrev-%j.out"
    script = tmp_path / "abbrev.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --outp={log}\n#SBATCH --time=1\necho written-through-outp\n")
    proc = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=slurm_env, capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    job_id = parse_job_id(proc.stdout)
    assert wait_for_job(job_id, timeout_s=60, env=slurm_env).ok
    assert (tmp_path / f"abbrev-{job_id}.out").read_text().strip() == "written-through-outp"

    def sbatch_reads(opt: str) -> str:
        p = subprocess.run(
            ["sbatch", "--test-only", f"--{opt}=1", "--wrap=true"],
            env=slurm_env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        return p.stderr

    for ours in ("output", "chdir", "job-name", "error", "partition"):
        for n in (3, len(ours) - 1):
            prefix = ours[:n]
            assert reserved_sbatch_option(prefix) is not None
            said = sbatch_reads(prefix)
            assert "unrecognized option" not in said and "unknown option" not in said, (prefix, said)
    for exact in ("gpus", "ntasks"):
        assert reserved_sbatch_option(exact) is None and "ambiguous" not in sbatch_reads(exact)
    assert set(_OWN_SBATCH_OPTIONS) >= {"output", "error", "chdir", "job-name"}


def test_hydra_submitit_launcher_on_a_real_slurm_cluster(slurm_env, tmp_path):
    """nemo-fp8-train -m hydra/launcher=submitit_nemo submits through submitit and waits."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason="hydra-submitit-launcher is not installed (pip install hydra-submitit-launcher)",
    )
    cmd = [
        sys.executable,
        "-m",
        "nemo_fp8_recipes.train",
        "-m",
        "hydra/launcher=submitit_nemo",
        "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
        "recipe=bf16",
        *[o for o in TINY_JOB if not o.startswith("cluster.")],
        f"run.root={tmp_path}/runs",
        f"data.cache_dir={tmp_path}/cache",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "llama3_tiny" / "bf16"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    scripts = list((tmp_path / "runs" / ".submitit").rglob("*_submission.sh"))
    assert scripts and "#SBATCH" in scripts[0].read_text()


def _examples(path: Path):
    """Every `nemo-fp8-submit ...` command of a Markdown file's code blocks, continuation lines
    joined, as argument lists (without the program)."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("nemo-fp8-submit ") and "..." not in line:
                out.append(shlex.split(line)[1:])
    return out


def test_every_submit_example_of_the_docs_passes_the_trainers_checks_for_its_world(tmp_path):
    """README's and docs/slurm.md's nemo-fp8-submit commands, as written (dry run, into a temporary
    run root): each plans, and its trainer jobs pass the batch split and memory checks for their
    world size (what the trainer itself would refuse at start)."""
    repo = Path(__file__).resolve().parents[2]
    examples = [e for f in ("README.md", "docs/slurm.md") for e in _examples(repo / f)]
    assert len(examples) >= 3, examples
    for argv in examples:
        multirun = "-m" in argv
        overrides = [a for a in argv if a != "-m" and not a.startswith("submit.")]
        jobs = plan_jobs([*overrides, f"run.root={tmp_path}"], multirun=multirun, cwd=tmp_path)
        assert jobs, argv
