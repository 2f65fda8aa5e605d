"""The embedded trainer's reporting: the train-loss logging window, the precision audit after
the first step (``audit.txt``, ``audit.json``, TensorBoard text), and the Python logging set-up
around a command-line run (Hydra's handlers removed afterwards, a failing log file quietened).

The window sums the finite losses and the step times between two log lines, so the logged
``train/loss`` is the mean over the window and ``tokens_per_s`` its throughput. Its loss part is
saved in every checkpoint: a resumed run logs the same means as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from .distributed import DistContext, merge_audits
from .logging_utils import MetricsWriter

__all__ = ["LogWindow", "record_audit", "logging_as_it_was", "quiet_failing_log_files"]

log = logging.getLogger("nemo_fp8_recipes.train")  # (the trainer's: these lines belong to the run)


@dataclass
class LogWindow:
    """Train metrics of the steps since the last log line."""

    loss_sum: float = 0.0
    steps: int = 0  #: steps with a finite loss (a skipped non-finite step adds time, not loss)
    time_s: float = 0.0
    tokens: int = 0

    @classmethod
    def resumed(cls, state: Optional[Mapping[str, Any]]) -> "LogWindow":
        """The window a checkpoint's :meth:`state` describes (time and tokens start at zero)."""
        state = state or {}
        return cls(loss_sum=float(state.get("loss_sum", 0.0)), steps=int(state.get("steps", 0)))

    def state(self) -> Dict[str, Any]:
        """The loss part of the window, as checkpoints store it."""
        return {"loss_sum": self.loss_sum, "steps": self.steps}

    def add(self, loss: float, time_s: float, tokens: int) -> None:
        """Count one optimizer step."""
        if math.isfinite(loss):
            self.loss_sum += loss
            self.steps += 1
        self.time_s += time_s
        self.tokens += tokens

    @property
    def mean_loss(self) -> float:
        """Mean finite train loss of the window (NaN when it has none)."""
        return self.loss_sum / self.steps if self.steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Throughput of the window's steps."""
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    def reset(self) -> None:
        """Start a new window (after a log line)."""
        self.loss_sum, self.steps, self.time_s, self.tokens = 0.0, 0, 0.0, 0


def record_audit(report, ctx: DistContext, *, run_dir: Path, writer: MetricsWriter, step: int,
                 extra: Optional[str] = None, data_parallel: str = "ddp") -> str:
    """Record the precision audit ``report`` of the first step and return its table.

    Every rank's audit is compared (:func:`~nemo_fp8_recipes.distributed.merge_audits`); ``extra``
    is a line added under the table. Rank 0 writes ``audit.txt`` and ``audit.json`` into
    ``run_dir``; the table goes to TensorBoard and the log, with a warning listing any policy
    violation or rank disagreement.
    """
    rank_problems: List[str] = merge_audits(report, ctx)
    table = report.table()
    if extra:
        table += f"\n{extra}"
    if ctx.distributed:
        table += (f"\n{ctx.world_size} data-parallel ranks ({data_parallel}): "
                  + ("; ".join(rank_problems) if rank_problems else "every rank ran the same precision per module"))
    if ctx.is_main:
        (run_dir / "audit.txt").write_text(table + "\n", encoding="utf-8")
        d = report.to_dict()
        d["ranks"] = {"world_size": ctx.world_size, "problems": rank_problems}
        (run_dir / "audit.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
    writer.text("fp8/audit", table, step)
    log.info("precision audit after the first step:\n%s", table)
    if report.violations or rank_problems:
        log.warning("policy violations: %s", ", ".join(list(report.violations) + rank_problems))
    return table


# ---- Python logging around a command-line run -------------------------------------------
@contextlib.contextmanager
def logging_as_it_was():
    """Hydra configures Python's logging for the job (a console handler bound to the stderr of
    the moment, the job's log file) and leaves it so. Called from Python (a notebook, a test, a
    sweep driver), ``main`` puts the caller's logging back afterwards: the handlers, level,
    ``disabled`` and ``propagate`` of the root logger and of every logger that existed before
    (Hydra's configuration may disable them); the handlers the job added are closed. Loggers
    created during the run (a library's import) keep their own."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.disabled, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, disabled, level, handlers, propagate in saved:
            for h in list(lg.handlers):
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)


def quiet_failing_log_files() -> None:
    """A log file that cannot be written (a full disk) says so once on stderr and is closed,
    instead of Python's logging printing a traceback for every later record."""
    for h in list(logging.getLogger().handlers):
        if not isinstance(h, logging.FileHandler) or getattr(h, "_nemo_fp8_quiet", False):
            continue

        def handle_error(record, h=h):
            err = sys.exc_info()[1]
            logging.getLogger().removeHandler(h)
            try:
                h.close()
            except Exception:  # noqa: BLE001 - the file is already broken
                pass
            print(f"nemo-fp8-train: warning: cannot write the log file {h.baseFilename} ({err}); "
                  "logging to the console only from here on", file=sys.stderr)

        h.handleError = handle_error
        h._nemo_fp8_quiet = True
