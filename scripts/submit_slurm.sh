#!/usr/bin/env bash
# Submit nemo_fp8_recipes training to SLURM: a thin wrapper around `nemo-fp8-submit`.
#
# Usage:
#   scripts/submit_slurm.sh [-m] [Hydra overrides...]
#
# Same config tree and overrides as `nemo-fp8-train` (recipe=, model=, trainer.*, ...) plus the
# SLURM settings cluster.* (configs/cluster/slurm.yaml) and submit.* (configs/train.yaml).
# The sbatch script is written to <run dir>/submit.sbatch and submitted; the job id and log path
# are printed. Examples:
#   scripts/submit_slurm.sh recipe=blockwise model=llama3_8b cluster.nodes=4 cluster.partition=batch
#   scripts/submit_slurm.sh -m recipe=bf16,tensorwise,blockwise model=llama3_8b submit.dry_run=true
# Environment: PYTHON (default python3) = the interpreter that has nemo_fp8_recipes installed.
set -euo pipefail
exec "${PYTHON:-python3}" -m nemo_fp8_recipes.launch.submit "$@"
