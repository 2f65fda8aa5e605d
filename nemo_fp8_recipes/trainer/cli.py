"""``nemo-fp8-train``: the embedded trainer's command line (Hydra). Arguments are overrides checked
before Hydra starts (a bad key or value fails at once with the valid choices), ``-m`` sweeps name
each job's run by the keys they vary, and expected failures print one clean line with an exit
code (:data:`EXIT_CODES`). The run itself is :func:`nemo_fp8_recipes.trainer.train`."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ..config import (
    CONFIG_DIR,
    CONFIG_NAME,
    ConfigError,
    checked_config,
    compose_config,
    with_sweep_names,
)
from ..data import DataError
from .checkpoint import CheckpointError
from .checks import te_backend_problem_for
from .logs import logging_as_it_was, quiet_failing_log_files
from .result import NonFiniteLossError, Terminated, TrainingError
from .run import train

__all__ = ["EXIT_CODES", "main"]


# ---- command line ----------------------------------------------------------------------------
#: (the first class that matches wins; 143 = 128 + SIGTERM, as a process killed by it reports)
EXIT_CODES = {
    ConfigError: 2,
    DataError: 2,
    CheckpointError: 4,
    NonFiniteLossError: 3,
    Terminated: 143,
    TrainingError: 5,
}


def _run_cli(cfg) -> None:
    """Body of the Hydra entry point: train, print clean messages for expected errors."""
    from ..recipes import UnsupportedRecipeError

    quiet_failing_log_files()
    try:
        result = train(cfg)
    except UnsupportedRecipeError as e:
        print(f"nemo-fp8-train: unsupported recipe on this device: {e}", file=sys.stderr)
        sys.exit(2)
    except tuple(EXIT_CODES) as e:
        code = next(c for t, c in EXIT_CODES.items() if isinstance(e, t))
        if isinstance(e, Terminated):  # already stopping: a late SIGTERM must not turn 143 into a kill
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
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


def _dashed_override(args: Sequence[str]) -> Optional[str]:
    """``--recipe blockwise`` / ``--trainer.max_steps=5``: an override written as a flag (Hydra
    would only say "unrecognized arguments"); the message gives the override form."""
    keys = None
    for i, a in enumerate(args):
        if not a.startswith("--") or len(a) < 3:
            continue
        name, eq, value = a[2:].partition("=")
        if keys is None:
            keys = set(compose_config([]).keys())
        if name.split(".", 1)[0] in keys:
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
            example = f"{name}={value}" if value else f"{name}=<value>"
            return (
                f"{a} is a Hydra override, written without dashes: {example} "
                f"(e.g. nemo-fp8-train {example}; nemo-fp8-train --help lists the groups and keys)"
            )
    return None


def _run_dir_problem(run_dir: Path) -> Optional[str]:
    """Why the run directory cannot be created and written (a read-only or missing file system),
    or None. (Hydra creates it first, and would end in a traceback.)"""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        return f"cannot write the run directory {run_dir} ({e.strerror or e}): choose a writable run.root (or run.dir)"
    return None


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
    dashed = _dashed_override(args)
    if dashed:
        print(f"nemo-fp8-train: {dashed}", file=sys.stderr)
        return 2
    if "-m" in args or "--multirun" in args:
        args = with_sweep_names(args)  # each job its own run directory: bf16-seed1, bf16-seed2, ...
    if not any(a.startswith("-") for a in args):
        cfg, problem = checked_config(args)
        if not problem:
            problem = te_backend_problem_for(cfg) or _run_dir_problem(Path(cfg.run.dir))
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
