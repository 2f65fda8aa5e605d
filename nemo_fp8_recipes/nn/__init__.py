"""Native backend: the FP8 linear, model conversion, run-time audit and telemetry."""

from .audit import AuditReport, PolicyViolation, audit
from .config import Float8LinearConfig
from .convert import (
    SwapFactory,
    apply_kernel_options,
    convert_model,
    invalidate_weight_cache,
    reset_gemm_counts,
    set_amax_reduce_fn,
    set_graph_weight_cache,
    set_wgrad_accumulation_fusion,
)
from .grouped import Float8GroupedExperts, grouped_fp8_modules
from .linear import Float8Linear, fp8_modules
from .scaling import (
    discard_delayed_scaling,
    fp8_state_snapshot,
    pinned_scales,
    restore_fp8_state,
    set_delayed_scaling_update,
    sync_delayed_scaling,
)
from .telemetry import collect_telemetry, set_telemetry, telemetry_combine

__all__ = [
    "AuditReport",
    "Float8GroupedExperts",
    "Float8Linear",
    "Float8LinearConfig",
    "PolicyViolation",
    "SwapFactory",
    "apply_kernel_options",
    "audit",
    "collect_telemetry",
    "convert_model",
    "fp8_modules",
    "grouped_fp8_modules",
    "invalidate_weight_cache",
    "reset_gemm_counts",
    "set_amax_reduce_fn",
    "set_delayed_scaling_update",
    "set_graph_weight_cache",
    "set_telemetry",
    "telemetry_combine",
    "set_wgrad_accumulation_fusion",
    "sync_delayed_scaling",
    "discard_delayed_scaling",
    "pinned_scales",
    "fp8_state_snapshot",
    "restore_fp8_state",
]
