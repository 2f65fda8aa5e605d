"""TensorBoard writing and throughput / MFU accounting for the embedded trainer.

MFU follows the PaLM convention (:meth:`nemo_fp8_recipes.models.ModelConfig.flops_per_token`)
divided by the device's dense peak for the precision the GEMMs actually run in: the FP8 peak
when the recipe runs real FP8 GEMMs, the BF16 peak otherwise (BF16 baseline, emulation). Peaks
are datasheet numbers for dense math; on CPU and on unknown GPUs MFU is reported as ``n/a``
(throughput in tokens/s and TFLOP/s is always reported).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from .hardware import gpu_by_device_name

__all__ = ["peak_tflops", "MetricsWriter", "format_count", "format_duration"]

log = logging.getLogger(__name__)


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


class MetricsWriter:
    """Thin wrapper over ``torch.utils.tensorboard.SummaryWriter`` (imported lazily).

    ``purge_step`` (on resume) drops events at or after that step left by the interrupted run,
    so the curve has no doubled segment. ``enabled=False`` makes every call a no-op.
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
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        # TensorBoard's Custom Scalars tab: every run's train/val loss overlaid, and the deviation
        # chart that nemo-fp8-compare fills (nemo_fp8_recipes.compare.tensorboard_layout).
        from .compare import tensorboard_layout

        self._writer.add_custom_scalars(tensorboard_layout())

    @property
    def enabled(self) -> bool:
        """Whether events are written."""
        return self._writer is not None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write every ``tag -> value`` at ``step`` (non-numeric values are skipped)."""
        if self._writer is None:
            return
        for tag, v in values.items():
            if v is None:
                continue
            self._writer.add_scalar(tag, float(v), global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Write preformatted text (shown monospaced in TensorBoard's Text tab)."""
        if self._writer is None:
            return
        body = "\n".join("    " + line for line in text.splitlines())  # markdown code block
        self._writer.add_text(tag, body, global_step=step)

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
