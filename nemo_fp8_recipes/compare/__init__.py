"""``nemo-fp8-compare``: loss curves of training runs from their TensorBoard event files, overlaid,
with each run's (and, over seeds, each recipe's) deviation from a baseline, throughput, and a
pass/fail gate. Every definition is in :mod:`.cli`; the parts: :mod:`.reading` (finding and
reading runs), :mod:`.statistics` (the per-run numbers and the :class:`Comparison`),
:mod:`.seeds` (seed groups, intervals, the noise floor), :mod:`.outputs` (PNG, tables,
TensorBoard). It imports no trainer: other layers may use its readers and layout."""

from .cli import main
from .outputs import (
    DEVIATION_HIGH_TAG,
    DEVIATION_LOW_TAG,
    DEVIATION_TAG,
    plot,
    tensorboard_layout,
    write_deviation_events,
    write_outputs,
)
from .reading import (
    DEFAULT_TAG,
    LOSS_TAGS,
    TOKENS_TAG,
    CompareError,
    RunSeries,
    check_event_file,
    find_runs,
    load_run,
    load_runs,
    resolve_run_dirs,
    up_to_step,
)
from .seeds import (
    GATE_RULES,
    GroupStats,
    NoiseFloor,
    group_label,
    mean_interval,
    t_quantile,
    welch_interval,
)
from .statistics import (
    JSON_VERSION,
    Comparison,
    RunStats,
    check_gate,
    check_max_rel_dev,
    compare_runs,
    moving_average,
)

__all__ = [
    "DEFAULT_TAG",
    "DEVIATION_HIGH_TAG",
    "DEVIATION_LOW_TAG",
    "DEVIATION_TAG",
    "GATE_RULES",
    "JSON_VERSION",
    "LOSS_TAGS",
    "TOKENS_TAG",
    "CompareError",
    "Comparison",
    "GroupStats",
    "NoiseFloor",
    "RunSeries",
    "RunStats",
    "check_event_file",
    "check_gate",
    "check_max_rel_dev",
    "compare_runs",
    "find_runs",
    "group_label",
    "load_run",
    "load_runs",
    "main",
    "mean_interval",
    "moving_average",
    "plot",
    "resolve_run_dirs",
    "t_quantile",
    "tensorboard_layout",
    "up_to_step",
    "welch_interval",
    "write_deviation_events",
    "write_outputs",
]
