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

Python API: :func:`train` takes a composed config (see
:func:`nemo_fp8_recipes.train_config.compose_config`) and returns a :class:`TrainResult`.

Reading order: :class:`~nemo_fp8_recipes.trainer.Trainer` (:mod:`nemo_fp8_recipes.trainer`)
holds one run; this module has :func:`train` and the command line (:func:`main`, Hydra).
"""


from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from .checkpoint import CheckpointError
from .data import DataError
from .run_names import with_sweep_names
from .train_config import (CONFIG_DIR, CONFIG_NAME, ConfigError, build_policy, build_recipe, resolve_device,
                           validate_overrides)
from .train_logging import logging_as_it_was, quiet_failing_log_files
from .train_optim import lr_at
from .train_result import NonFiniteLossError, TrainingError, TrainResult
from .trainer import Trainer

__all__ = [
    "train",
    "Trainer",
    "main",
    "TrainResult",
    "TrainingError",
    "NonFiniteLossError",
    "resolve_device",
    "build_recipe",
    "build_policy",
    "lr_at",
]

log = logging.getLogger("nemo_fp8_recipes.train")


def train(cfg) -> TrainResult:
    """Run the embedded trainer on a composed config (``DictConfig``) and return what it did:
    ``Trainer(cfg).run()``, then the process group is closed whatever happened.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls it: data parallelism with
    ``trainer.data_parallel`` (ddp | fsdp2, :mod:`nemo_fp8_recipes.distributed`); rank 0 logs,
    writes TensorBoard, the audit and checkpoints. Every rank returns the same losses.

    Raises :class:`ConfigError`, :class:`~nemo_fp8_recipes.data.DataError`,
    :class:`~nemo_fp8_recipes.recipes.UnsupportedRecipeError`, :class:`CheckpointError` or
    :class:`NonFiniteLossError` with actionable messages; :func:`main` prints them cleanly.
    """
    trainer = Trainer(cfg)
    level = log.level  # a non-main rank logs warnings only while it trains
    try:
        return trainer.run()
    finally:
        log.setLevel(level)
        trainer.close()


# ---- command line ----------------------------------------------------------------------------
_EXIT_CODES = {ConfigError: 2, DataError: 2, CheckpointError: 4, NonFiniteLossError: 3, TrainingError: 5}


def _run_cli(cfg) -> None:
    """Body of the Hydra entry point: train, print clean messages for expected errors."""
    from .recipes import UnsupportedRecipeError

    quiet_failing_log_files()
    try:
        result = train(cfg)
    except UnsupportedRecipeError as e:
        print(f"nemo-fp8-train: unsupported recipe on this device: {e}", file=sys.stderr)
        sys.exit(2)
    except tuple(_EXIT_CODES) as e:
        code = next(c for t, c in _EXIT_CODES.items() if isinstance(e, t))
        print(f"nemo-fp8-train: error: {e}", file=sys.stderr)
        sys.exit(code)
    except KeyboardInterrupt:
        print("nemo-fp8-train: interrupted; trainer.resume=auto continues from the last checkpoint", file=sys.stderr)
        sys.exit(130)
    print(
        f"\nRun directory:    {result.run_dir}  (config.yaml, audit.txt, summary.json)\n"
        f"Checkpoint:       {result.checkpoint or 'none'}\n"
        f"TensorBoard logs: {result.run_dir}\n"
        f"  tensorboard --logdir {result.run_dir.parent}   # overlays every recipe of {result.run_dir.parent.name}"
    )


def _hydra_entry() -> None:
    import hydra

    hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")(_run_cli)()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``nemo-fp8-train`` / ``python -m nemo_fp8_recipes.train``).

    Arguments are Hydra overrides (``recipe=delayed model.num_layers=2 trainer.max_steps=50``)
    and Hydra flags (``--cfg job``, ``-m`` for sweeps, ``--help``). Overrides are checked first,
    so a bad key or option fails at once with the valid choices listed.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-m" in args or "--multirun" in args:
        args = with_sweep_names(args)  # each job its own run directory: bf16-seed1, bf16-seed2, ...
    if not any(a.startswith("-") for a in args):
        problem = validate_overrides(args)
        if problem:
            print(f"nemo-fp8-train: {problem}", file=sys.stderr)
            return 2
    prog = sys.argv[0] if sys.argv else "nemo-fp8-train"
    old_argv = sys.argv
    sys.argv = [prog] + args
    with logging_as_it_was():
        try:
            _hydra_entry()
        except SystemExit as e:
            return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old_argv
    return 0


if __name__ == "__main__":
    sys.exit(main())

