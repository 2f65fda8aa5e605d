"""``nemo-fp8-submit``: render an sbatch script from the trainer's config tree and submit it.

Same Hydra config tree and overrides as ``nemo-fp8-train``, with ``cluster=slurm`` by default::

    nemo-fp8-submit recipe=blockwise model=llama3_8b cluster.nodes=4 cluster.partition=batch \\
        cluster.account=llm cluster.container.image=nvcr.io#nvidia/nemo:25.04
    nemo-fp8-submit -m recipe=bf16,tensorwise,blockwise model=llama3_8b    # one job per recipe
    nemo-fp8-submit submit.dry_run=true ...                                 # print the script only

For every job (one, or one per combination of a ``-m`` sweep) it:

1. composes the config exactly like the trainer and validates it (unknown keys and bad values
   fail with the valid choices, before anything is written);
2. builds a :class:`~nemo_fp8_recipes.launch.slurm.SlurmJob` from ``cluster.*`` (resources,
   container, environment) and the launch line from ``backend.name``:

   - ``native``: ``srun`` + ``torchrun --nnodes=$SLURM_NNODES --nproc-per-node=<gpus>
     --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT -m nemo_fp8_recipes.train
     <your overrides> cluster=local run.root=<absolute run root>``; with ``gpus_per_node=0`` (CPU
     jobs) plain ``python -m nemo_fp8_recipes.train ...`` instead of torchrun;
   - ``megatron_bridge`` (``submit.bridge.entry=nemo_fp8``, the default): ``srun`` + ``torchrun ...
     -m nemo_fp8_recipes.integrations.bridge <your overrides> logger.tensorboard_dir=<run dir>
     checkpoint.save=<run dir>/checkpoints`` — Bridge's pretraining recipe for ``model=`` with our
     recipe applied in full through ``mixed_precision`` (keys that are not ours, ``train.*``,
     ``optimizer.*``, ``dataset.*``..., pass through to Bridge); the pre-launch validator
     (``nemo-fp8-check``) runs here first, for ``cluster.gpu_type``, and refuses the job on an
     error. ``submit.bridge.entry=run_recipe``: Bridge's own ``scripts/training/run_recipe.py
     --recipe <fn> mixed_precision=<preset of the recipe>`` instead (the preset's FP8 settings);

3. writes ``<run dir>/submit.sbatch``, runs ``sbatch`` and prints the job id, the log
   ``<run dir>/slurm-<jobid>.out`` and the run directory; ``<run dir>/submit.json`` records it.

The job's run directory is the trainer's own (``runs/<model>/<recipe>[-<tag>]``), so the jobs of
a recipe sweep land side by side and ``nemo-fp8-compare runs/<model>`` compares them.
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..config import ConfigError
from .plan import (
    PROG,
    PlannedJob,
    plan_jobs,
)
from .sbatch import SbatchError, submit_script, wait_for_job, write_json
from .slurm import render_command

__all__ = [
    "main",
]


# ---- command line ----------------------------------------------------------------------------------
HELP = f"""usage: {PROG} [-m] [OVERRIDE ...]

Render an sbatch script from the nemo-fp8-train config tree and submit it to SLURM.
OVERRIDEs are the trainer's Hydra overrides (recipe=, model=, trainer.*, data.*, policy.*,
run.tag=) plus the SLURM settings cluster.* (configs/cluster/slurm.yaml; cluster=slurm is the
default here) and submit.* (train.yaml). The script goes to <run dir>/submit.sbatch, its log to
<run dir>/slurm-<jobid>.out, and the job trains with the same overrides and cluster=local.

options:
  -m, --multirun   one job per combination of the sweeps (recipe=bf16,tensorwise,blockwise)
  -h, --help       this help

common overrides:
  cluster.nodes=N cluster.gpus_per_node=G cluster.partition=P cluster.account=A cluster.time=HH:MM:SS
  "cluster.container.image='nvcr.io#nvidia/nemo:25.04'" cluster.container.mounts=[/lustre:/lustre]
  cluster.env.NCCL_DEBUG=INFO   +cluster.sbatch_args.reservation=R   cluster.job_name=NAME
  submit.dry_run=true (print only)   submit.wait=true (wait, exit 1 if a job fails)
  cluster.gpu_type=H100 (job name; the GPU the Megatron-Bridge pre-launch check targets)
  backend=megatron_bridge model=llama3_8b train.train_iters=1000   (Bridge keys pass through)
  submit.bridge.entry=run_recipe   (Megatron-Bridge's run_recipe.py with the recipe's preset)

examples:
  {PROG} recipe=blockwise model=llama3_8b cluster.nodes=4 cluster.partition=batch submit.dry_run=true
  {PROG} -m recipe=bf16,tensorwise,blockwise model=llama3_8b cluster.nodes=2 cluster.account=llm
  nemo-fp8-compare runs/llama3_8b           # once the jobs have written their TensorBoard events

exit status: 0 submitted (or printed); 1 a waited-for job did not complete; 2 bad config;
3 sbatch/scontrol failed.
"""


def _tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + line for line in lines[-n:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``nemo-fp8-submit`` (also ``python -m nemo_fp8_recipes.launch.submit``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    multirun = False
    overrides = []
    for a in args:
        if a in ("-h", "--help"):
            print(HELP)
            return 0
        if a in ("-m", "--multirun"):
            multirun = True
        elif a.startswith("-"):
            print(
                f"{PROG}: unknown option {a!r}; options are -m/--multirun and -h/--help; everything "
                "else is a Hydra override (key=value)",
                file=sys.stderr,
            )
            return 2
        else:
            overrides.append(a)
    try:
        jobs = plan_jobs(overrides, multirun=multirun)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    sub = jobs[0].submit  # submit.* is the same for every job of a sweep unless swept itself
    if sub.dry_run:
        for j in jobs:
            if len(jobs) > 1:
                print(f"# ===== {j.script_path} =====")
            print(j.script)
            for w in j.warnings:
                print(f"{PROG}: warning: {w}", file=sys.stderr)
        return 0

    submitted: List[Tuple[PlannedJob, str]] = []
    for j in jobs:
        for w in j.warnings:
            print(f"{PROG}: warning: {w}", file=sys.stderr)
        j.run_dir.mkdir(parents=True, exist_ok=True)
        j.script_path.write_text(j.script, encoding="utf-8")
        try:
            job_id = submit_script(j.script_path, sbatch=str(j.submit.sbatch))
        except SbatchError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 3
        log = j.job.log_path(job_id)
        write_json(
            j.run_dir / "submit.json",
            {
                "job_id": job_id,
                "job_name": j.job.job_name,
                "script": str(j.script_path),
                "log": str(log),
                "run_dir": str(j.run_dir),
                "backend": j.backend,
                "nodes": j.job.nodes,
                "gpus_per_node": j.job.gpus_per_node,
                "command": render_command(j.job.command),
                "submitted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            },
        )
        submitted.append((j, job_id))
        print(
            f"Submitted job {job_id} ({j.job.job_name})\n"
            f"  script:  {j.script_path}\n"
            f"  log:     {log}\n"
            f"  run dir: {j.run_dir}\n"
            f"  watch:   squeue -j {job_id}; tail -f {log}",
            flush=True,
        )
    if len(submitted) > 1:
        dirs = " ".join(str(j.run_dir) for j, _ in submitted)
        print(f"\n{len(submitted)} jobs submitted; when they are done: nemo-fp8-compare {dirs}")

    if not any(j.submit.wait for j in jobs):
        return 0
    timeout = float(sub.wait_timeout_s or 0)
    failed = 0
    for j, job_id in submitted:

        def show(st, job_id=job_id):
            print(f"  job {job_id}: {st.state}", flush=True)

        try:
            st = wait_for_job(job_id, timeout_s=timeout, on_change=show)
        except (TimeoutError, SbatchError) as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1 if isinstance(e, TimeoutError) else 3
        if not st.ok:
            failed += 1
            print(
                f"{PROG}: job {job_id} ended {st.state} (exit {st.exit_code}); last lines of "
                f"{j.job.log_path(job_id)}:\n{_tail(j.job.log_path(job_id))}",
                file=sys.stderr,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
