"""Launchers: SLURM batch scripts (:mod:`.slurm`) and the ``nemo-fp8-submit`` command
(:mod:`.submit`, not imported here so that ``python -m nemo_fp8_recipes.launch.submit`` runs
cleanly; ``from nemo_fp8_recipes.launch.submit import plan_jobs``).

Local runs need no launcher (``nemo-fp8-train``); Hydra's submitit launcher is configured in
``configs/hydra/launcher/submitit_nemo.yaml`` for users who prefer it. Nothing here imports a
GPU library; SLURM commands are only run when a job is submitted.
"""

from .sbatch import JobState, SbatchError, job_state, submit_script, wait_for_job
from .slurm import ContainerSpec, ShellExpr, SlurmJob, SlurmSpecError, render_sbatch

__all__ = [
    "ContainerSpec",
    "JobState",
    "SbatchError",
    "ShellExpr",
    "SlurmJob",
    "SlurmSpecError",
    "job_state",
    "render_sbatch",
    "submit_script",
    "wait_for_job",
]
