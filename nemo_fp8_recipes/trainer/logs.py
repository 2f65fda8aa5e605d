"""The embedded trainer's reporting: TensorBoard writing (:class:`MetricsWriter`), throughput and
MFU accounting, the train-loss logging window, the precision audit after the first step
(``audit.txt``, ``audit.json``, TensorBoard text), and the Python logging set-up around a
command-line run (Hydra's handlers removed afterwards, a failing log file quietened).

MFU follows the PaLM convention (:meth:`nemo_fp8_recipes.models.ModelConfig.flops_per_token`)
divided by the device's dense peak for the precision the GEMMs actually run in: the FP8 peak
when the recipe runs real FP8 GEMMs, the BF16 peak otherwise (BF16 baseline, emulation). Peaks
are datasheet numbers for dense math; on CPU and on unknown GPUs MFU is reported as ``n/a``
(throughput in tokens/s and TFLOP/s is always reported).

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
from typing import Any, Dict, List, Mapping, Optional, Union

import torch

from ..hardware import gpu_by_device_name
from .distributed import DistContext, merge_audits

__all__ = [
    "LogWindow",
    "record_audit",
    "logging_as_it_was",
    "quiet_failing_log_files",
    "peak_tflops",
    "MetricsWriter",
    "format_count",
    "format_duration",
]

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


def record_audit(
    report,
    ctx: DistContext,
    *,
    run_dir: Path,
    writer: MetricsWriter,
    step: int,
    extra: Optional[str] = None,
    data_parallel: str = "ddp",
) -> str:
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
        table += f"\n{ctx.world_size} data-parallel ranks ({data_parallel}): " + (
            "; ".join(rank_problems) if rank_problems else "every rank ran the same precision per module"
        )
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
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
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
            print(
                f"nemo-fp8-train: warning: cannot write the log file {h.baseFilename} ({err}); "
                "logging to the console only from here on",
                file=sys.stderr,
            )

        h.handleError = handle_error
        h._nemo_fp8_quiet = True


def peak_tflops(device: Union[str, torch.device], precision: str) -> Optional[float]:
    """Dense peak TFLOP/s of ``device`` for ``precision`` (``bf16`` or ``fp8``), or None if
    unknown (CPU, unlisted GPU, or a precision the GPU lacks)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    gpu = gpu_by_device_name(torch.cuda.get_device_name(device))
    return gpu.peak_tflops.get(precision) if gpu is not None else None


def format_count(n: float) -> str:
    """``12345678`` -> ``12.3M``."""
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``1m15s``."""
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises its write error after handing it to the next call
    (which :class:`MetricsWriter` reports); keep Python from also printing that thread's traceback.
    The thread is known by the module of its class (TensorBoard's event-file writer), so no private
    TensorBoard name is imported: a TensorBoard that moves it only brings the traceback back."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_nemo_fp8_quiet", False):
        return

    def hook(args):
        module = type(args.thread).__module__ if args.thread is not None else ""
        if module.startswith("tensorboard.summary.writer") and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._nemo_fp8_quiet = True
    threading.excepthook = hook


class MetricsWriter:
    """Thin wrapper over ``torch.utils.tensorboard.SummaryWriter`` (imported lazily).

    ``purge_step`` drops the events at or after that step that earlier runs left in the
    directory (TensorBoard's and ``nemo-fp8-compare``'s readers honour it): after a resume the
    curve has no doubled segment, and a fresh start's curve is its own. ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, log_dir: Union[str, Path], *, enabled: bool = True, purge_step: Optional[int] = None) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard not installed
            raise RuntimeError(
                "TensorBoard logging needs the tensorboard package: `pip install tensorboard` "
                "(or run with run.tensorboard=false)"
            ) from e
        _quiet_writer_threads()
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        # TensorBoard's Custom Scalars tab: every run's train/val loss overlaid, and the deviation
        # chart that nemo-fp8-compare fills (nemo_fp8_recipes.compare.tensorboard_layout).
        from ..compare import tensorboard_layout

        self._writer.add_custom_scalars(tensorboard_layout())

    @property
    def enabled(self) -> bool:
        """Whether events are written."""
        return self._writer is not None

    @contextlib.contextmanager
    def _writing(self):
        """A write that fails (a full disk, a file system gone read-only; TensorBoard's writer
        thread hands its error to the next call) stops the run with the reason."""
        try:
            yield
        except OSError as e:
            from .result import TrainingError

            self._writer = None  # (its thread has failed: nothing more can be written through it)
            raise TrainingError(
                f"cannot write the TensorBoard events in {self.log_dir} ({e.strerror or e}): free space or fix the "
                "file system, then run the same command again (trainer.resume=auto continues from the last "
                "checkpoint)"
            ) from None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write every ``tag -> value`` at ``step`` (non-numeric values are skipped)."""
        if self._writer is None:
            return
        with self._writing():
            for tag, v in values.items():
                if v is None:
                    continue
                self._writer.add_scalar(tag, float(v), global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Write preformatted text (shown monospaced in TensorBoard's Text tab)."""
        if self._writer is None:
            return
        body = "\n".join("    " + line for line in text.splitlines())  # markdown code block
        with self._writing():
            self._writer.add_text(tag, body, global_step=step)

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self._writer is not None:
            with self._writing():
                self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (an error there is logged: the run has ended either way)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError as e:
                log.warning("closing the TensorBoard events in %s: %s", self.log_dir, e.strerror or e)
