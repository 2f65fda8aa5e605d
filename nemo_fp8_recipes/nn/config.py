"""The FP8 linear's settings in one frozen object, chosen when the model is converted.

A :class:`~nemo_fp8_recipes.nn.Float8Linear` runs as its :class:`Float8LinearConfig` says: the
recipe and whether its GEMMs are emulated, the kernels, and the run-time choices (telemetry, the
compiled path's weight cache, fused wgrad accumulation, the delayed-scaling update schedule and
its amax reduction). :func:`~nemo_fp8_recipes.nn.convert_model` builds one for the whole model
from its arguments; the autograd functions read it instead of the module's attributes. A change
after conversion goes through :meth:`Float8Linear.reconfigure`, which replaces the config and
does what the change needs (buffers, pending amaxes, checks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..options import KernelOptions, default_kernel_options
from ..recipes import Recipe

__all__ = ["UPDATE_MODES", "Float8LinearConfig"]

#: Delayed scaling's update schedules (:mod:`nemo_fp8_recipes.nn.scaling`): ``lazy`` commits each
#: operand's amax before its next quantisation, ``step`` once per optimizer step for the whole model.
UPDATE_MODES = ("lazy", "step")

_BOOLS = ("emulate", "telemetry", "graph_weight_cache", "fuse_wgrad_accumulation")


@dataclass(frozen=True, kw_only=True)
class Float8LinearConfig:
    """How one :class:`~nemo_fp8_recipes.nn.Float8Linear` runs (frozen; validated on construction).

    Attributes:
        recipe: the resolved FP8 recipe (:func:`~nemo_fp8_recipes.get_recipe`; not bf16).
        emulate: True runs exact emulation (quantise -> dequantise -> FP32 matmul), False real FP8
            GEMMs (``torch._scaled_mm``); :func:`~nemo_fp8_recipes.nn.convert_model` decides it
            from the device.
        kernel_options: the kernels it runs (:class:`~nemo_fp8_recipes.options.KernelOptions`;
            default :func:`~nemo_fp8_recipes.options.default_kernel_options`).
        telemetry: record quantisation statistics of every operand (extra passes; the module then
            runs eagerly under ``torch.compile``).
        graph_weight_cache: the compiled forward reads the FP8 weight from buffers re-quantised
            after each optimizer step instead of quantising it in the graph (current scaling only).
        fuse_wgrad_accumulation: the wgrad GEMM adds into an existing FP32 ``weight.grad``
            (eager path; skips the weight's AccumulateGrad hooks).
        scaling_update: delayed scaling's schedule, one of :data:`UPDATE_MODES` (``lazy``:
            before each quantisation; ``step``: once per optimizer step, what the trainer runs).
        amax_reduce_fn: delayed scaling, ``lazy`` schedule: max-reduces a pending amax across
            ranks before each scale update (e.g. an all-reduce); None keeps amaxes local.
    """

    recipe: Recipe
    emulate: bool
    kernel_options: KernelOptions = field(default_factory=default_kernel_options)
    telemetry: bool = False
    graph_weight_cache: bool = False
    fuse_wgrad_accumulation: bool = False
    scaling_update: str = "lazy"
    amax_reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise TypeError(
                f"Float8LinearConfig.recipe must be a Recipe, got {type(self.recipe).__name__} {self.recipe!r}: "
                "resolve it with get_recipe(name)"
            )
        if not self.recipe.is_fp8:
            raise ValueError(
                "Float8Linear needs an FP8 recipe, got bf16: keep BF16 layers as nn.Linear "
                "(convert_model with recipe='bf16' changes no linear)"
            )
        for name in _BOOLS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"Float8LinearConfig.{name} must be True or False, got {v!r} ({type(v).__name__})")
        if not isinstance(self.kernel_options, KernelOptions):
            raise TypeError(
                f"options must be a KernelOptions, got {type(self.kernel_options).__name__} "
                "(nemo_fp8_recipes.options.KernelOptions(...))"
            )
        if self.scaling_update not in UPDATE_MODES:
            raise ValueError(
                f"unknown delayed-scaling update mode {self.scaling_update!r}; valid modes: {', '.join(UPDATE_MODES)}"
            )
        if self.amax_reduce_fn is not None and not callable(self.amax_reduce_fn):
            raise TypeError(
                f"Float8LinearConfig.amax_reduce_fn must be a callable (tensor -> tensor) or None, "
                f"got {type(self.amax_reduce_fn).__name__}"
            )
        if self.graph_weight_cache and self.recipe.is_delayed:
            raise ValueError(
                f"recipe {self.recipe.name} quantises its weight with the step's delayed scale (the eager path "
                "caches it); the compiled weight cache (graph_weight_cache=True) is for current scaling "
                "(tensorwise, blockwise, mxfp8)"
            )

    # ---- derived -----------------------------------------------------------------------------
    @property
    def row_multiple(self) -> int:
        """Rows of a GEMM operand are padded to a multiple of this for real FP8 GEMMs (the
        recipe's :attr:`~nemo_fp8_recipes.recipes.Recipe.gemm_alignment`)."""
        return self.recipe.gemm_alignment

    @property
    def triton_arg(self) -> Optional[bool]:
        """The quantiser dispatch's ``triton`` argument: None (the fused Triton kernels where they
        run) or False (``KernelOptions(triton=False)``: the reference quantisers)."""
        return None if self.kernel_options.triton else False

    def replace(self, **changes: Any) -> "Float8LinearConfig":
        """A copy with ``changes`` applied (validated again); an unknown name raises ``ValueError``
        listing the fields."""
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(valid))
        if unknown:
            raise ValueError(
                f"Float8LinearConfig has no setting {', '.join(unknown)}; its settings: {', '.join(valid)}"
            )
        return dataclasses.replace(self, **changes)
