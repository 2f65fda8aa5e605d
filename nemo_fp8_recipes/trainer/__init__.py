"""The embedded trainer: ``nemo-fp8-train recipe=<key> model=<name>`` (backend=native or te).

Trains a Llama 3 / small-MoE model (:mod:`nemo_fp8_recipes.models`) on local text
(:mod:`nemo_fp8_recipes.data`, the Python standard library by default) with the chosen FP8
recipe, with no cluster and no download: on one device, or data parallel (DDP / FSDP2) with one
process per GPU under ``torchrun``:

- the recipe and precision policy are applied with :func:`nemo_fp8_recipes.nn.convert_model`
  after a hardware check (:func:`nemo_fp8_recipes.recipes.require_supported`); the audit table of
  what ran in FP8 is printed after the first step and saved in the run directory;
- AdamW on FP32 master weights, BF16 autocast for the non-FP8 ops on GPU (off on CPU by default:
  CPU BF16 GEMMs are slow without AMX and the FP8 emulation already rounds the operands), global
  grad-norm clipping, linear warmup + cosine decay, gradient accumulation;
- validation every ``trainer.val_interval`` steps, tokens/s and MFU, FP8 telemetry per layer
  group, all in TensorBoard under ``runs/<model>/<recipe>[-<tag>]`` (so
  ``tensorboard --logdir runs/<model>`` overlays the recipes);
- atomic checkpoints holding model (incl. delayed-scaling state), optimizer, scheduler, RNG and
  data position; the data order is a pure function of ``(seed, step)``, so on CPU a resumed run
  reproduces the uninterrupted loss curve exactly;
- non-finite loss stops the run naming the step and the last good checkpoint
  (``trainer.nan_policy=skip`` skips the batch and counts it instead).

Python API: :func:`nemo_fp8_recipes.trainer.train` takes a composed config (see
:func:`nemo_fp8_recipes.config.compose_config`) and returns a
:class:`~nemo_fp8_recipes.trainer.TrainResult`.

The parts, in :mod:`nemo_fp8_recipes.trainer`: the run (:mod:`~.trainer.run`: ``Trainer``,
``train``), its checks, optimizer, compilation, logs, checkpoints, memory estimate, data
parallelism and the Transformer Engine backend; the command line is :mod:`~.trainer.cli`.
"""

from .checkpoint import CheckpointError
from .cli import main
from .result import NonFiniteLossError, TrainingError, TrainResult
from .run import Trainer, train

__all__ = ["CheckpointError", "NonFiniteLossError", "Trainer", "TrainResult", "TrainingError", "main", "train"]
