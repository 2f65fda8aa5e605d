"""The native FP8 linear: fprop, dgrad and wgrad each in FP8, per recipe.

For ``Y = X · Wᵀ`` the three GEMMs of a linear layer contract over different dims, so each
quantises its operands along its own contraction dim (the numerics contract, docs/recipes.md):

=========  ==============  =========================  ===============================
GEMM       formula         contraction dim            operands quantised along it
=========  ==============  =========================  ===============================
fprop      X · Wᵀ          K (in_features)            X rows, W rows
dgrad      dY · W          N (out_features)           dY rows, W columns
wgrad      dYᵀ · X         M (tokens)                 dY columns, X columns
=========  ==============  =========================  ===============================

Per-tensor recipes use one set of codes for both orientations (a transpose). Blockwise keeps the
128x128 weight blocks (symmetric) and re-quantises X and dY in 128x1 tiles for wgrad; MXFP8
quantises every operand twice. Only the wgrad copy of X is saved for backward, in FP8.

The FP8 weight copies are cached and re-quantised only when the weight changed (its version
counter moved, i.e. once per optimizer step, not per micro-batch) — and, under delayed scaling,
when its scale moved (the copy follows the amax history even for a frozen weight). Under ``torch.compile`` the
traced linear quantises its weight in the graph unless its compiled weight cache is on
(:meth:`Float8Linear.set_graph_weight_cache`: buffers re-quantised after each optimizer step).
Delayed scaling keeps an amax history per operand in buffers, so it is part of ``state_dict``; its scale for step t is
computed from the history through step t-1, the amax of step t is appended after use, and an
optional hook max-reduces pending amaxes across data-parallel ranks before each update. The
update schedule (per use, or once per optimizer step with one collective for the whole model)
lives in :mod:`nemo_fp8_recipes.nn.scaling`.

This module holds the module itself (set-up, weight caches, delayed-scaling state, counters,
telemetry, which path runs) and :class:`Float8LinearOperands`, the narrow view of its state that
the eager autograd functions get instead of the module; its settings are one frozen
:class:`~nemo_fp8_recipes.nn.config.Float8LinearConfig`, changed only through
:meth:`Float8Linear.reconfigure`. The GEMMs and operand quantisation are in
:mod:`~nemo_fp8_recipes.nn.gemms`, the autograd functions in :mod:`~nemo_fp8_recipes.nn.autograd`,
the input sharing in :mod:`~nemo_fp8_recipes.nn.shared_input`, the fused wgrad accumulation's checks
in :mod:`~nemo_fp8_recipes.nn.wgrad_fusion` and the optimizer-step hook in
:mod:`~nemo_fp8_recipes.nn.weight_cache`.

The autograd functions take tensors and the config and share the GEMM code (:func:`~.gemms.fprop`,
:func:`~.gemms.grads`): the eager one (:class:`~.autograd.Float8LinearFn`: fused Triton quantisers on CUDA,
weight cache, delayed scaling, telemetry, through :class:`Float8LinearOperands`) and, under
``torch.compile``, traceable ones for the current-scaling recipes
(:class:`~.autograd.Float8LinearTracedFn`: on CUDA the same Triton quantisers as custom operators, else the
reference quantisers, which the compiler fuses into its own kernels; no Python-side state) and for
delayed scaling under the ``step`` schedule (:class:`~.autograd.Float8LinearDelayedTracedFn`: the step's
scales as inputs, the amaxes as outputs), so a compiled model has no graph break at its FP8 linears.
:meth:`Float8Linear.forward` says which path runs when.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..formats import Granularity, ScaleRounding
from ..options import KernelOptions, default_kernel_options
from ..quant.delayed import advance_delayed_scaling
from ..quant.dispatch import quantize_auto as quantize
from ..quant.dispatch import quantize_pair_auto, triton_enabled
from ..quant.reference import accumulate_amax, quantization_stats, summarize_stats
from ..recipes import Recipe
from .autograd import (
    Float8LinearDelayedTracedFn,
    Float8LinearFn,
    Float8LinearTracedFn,
    Float8SwiGLULinearFn,
)
from .config import Float8LinearConfig
from .gemms import (
    OPERANDS,
    W,
    check_device,
    operand_spec,
    output_dtype,
    pack_meta,
    pack_tensors,
    quantize_plain,
    quantize_weight,
)
from .shared_input import input_quantizer
from .weight_cache import EAGER_CACHED, GRAPH_CACHED, OPTIMIZER_GENERATION, install_optimizer_hook
from .wgrad_fusion import check_wgrad_fusion, wgrad_target

__all__ = [
    "Float8Linear",
    "Float8LinearOperands",
    "fp8_modules",
]


def _config_from(
    recipe: Optional[Recipe],
    emulate: Optional[bool],
    options: Optional[KernelOptions],
    config: Optional[Float8LinearConfig],
) -> Float8LinearConfig:
    """The config of a new Float8Linear: ``config``, or one built from ``recipe``, ``emulate`` and
    ``options`` (the constructor's older keywords; not both)."""
    if config is not None:
        if recipe is not None or emulate is not None or options is not None:
            raise TypeError(
                "Float8Linear takes either config=Float8LinearConfig(...) or recipe=/emulate=/options=, not both"
            )
        if not isinstance(config, Float8LinearConfig):
            raise TypeError(f"config must be a Float8LinearConfig, got {type(config).__name__}")
        return config
    if recipe is None or emulate is None:
        raise TypeError(
            "Float8Linear needs config=Float8LinearConfig(recipe=..., emulate=...) (or recipe= and emulate=)"
        )
    if options is None:
        return Float8LinearConfig(recipe=recipe, emulate=bool(emulate))
    return Float8LinearConfig(recipe=recipe, emulate=bool(emulate), kernel_options=options)


def _read_only(name: str, field: str, how: str) -> property:
    """A property reading ``config.<field>``; assigning it raises, naming the supported way."""

    def get(self):
        return getattr(self._config, field)

    def set_(self, value):
        raise AttributeError(
            f"Float8Linear.{name} is read-only: it is config.{field} (a frozen Float8LinearConfig); {how}"
        )

    return property(get, set_, doc=f"``config.{field}`` (read-only).")


def _ways(field: str, convert_kw: str, wrapper: str) -> str:
    return (
        f"set it when converting (convert_model(..., {convert_kw}=...)), for a whole model with {wrapper}, "
        f"or for one module with module.reconfigure({field}=...)"
    )


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in FP8 as its :class:`~nemo_fp8_recipes.nn.Float8LinearConfig`
    says (``config``: recipe, emulation, kernel options, telemetry, weight cache, wgrad fusion,
    delayed-scaling schedule).

    Build it with :meth:`from_linear` (keeps the same ``Parameter`` objects) or through
    :func:`nemo_fp8_recipes.nn.convert_model`, which builds the config once for the whole model.
    ``Float8Linear(in, out, config=Float8LinearConfig(recipe=..., emulate=...))``; the older keywords
    ``recipe=``, ``emulate=`` (True: exact emulation, quantise -> dequantise -> FP32 matmul; False:
    ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm`` on the tensor cores) and ``options=``
    (:class:`~nemo_fp8_recipes.options.KernelOptions`) build the config with the other settings at
    their defaults. The settings are read-only attributes (``recipe``, ``emulate``,
    ``kernel_options``, ``telemetry_enabled``, ``scaling_update``, ``amax_reduce_fn``,
    ``fuse_wgrad_accumulation``); :meth:`reconfigure` changes them.
    """

    #: the compiled path's FP8 weight cache (:meth:`set_graph_weight_cache`): buffers, not in
    #: ``state_dict``, of the weight quantised along K (data, scale, E8M0 scale) and along N
    GRAPH_WEIGHT_CACHE_BUFFERS = (
        "_fp8_wcache_fprop_data",
        "_fp8_wcache_fprop_scale",
        "_fp8_wcache_fprop_e8m0",
        "_fp8_wcache_dgrad_data",
        "_fp8_wcache_dgrad_scale",
        "_fp8_wcache_dgrad_e8m0",
    )
    _config: Optional[Float8LinearConfig] = None  # (None until set up: nn.Linear's __init__ resets first)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Optional[Recipe] = None,
        emulate: Optional[bool] = None,
        options: Optional[KernelOptions] = None,
        config: Optional[Float8LinearConfig] = None,
        device=None,
        dtype=None,
    ) -> None:
        cfg = _config_from(recipe, emulate, options, config)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(cfg)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: Optional[Recipe] = None,
        emulate: Optional[bool] = None,
        options: Optional[KernelOptions] = None,
        *,
        config: Optional[Float8LinearConfig] = None,
        fqn: str = "",
    ) -> "Float8Linear":
        """A Float8Linear sharing ``linear``'s weight and bias Parameter objects, configured by
        ``config`` (or by ``recipe``, ``emulate`` and ``options``); ``fqn``: its name in the model
        (what its messages and the audit say)."""
        new = cls.from_parameters(linear.weight, linear.bias, _config_from(recipe, emulate, options, config), fqn=fqn)
        new.to(linear.weight.device)
        return new

    @classmethod
    def from_parameters(
        cls, weight: nn.Parameter, bias: Optional[nn.Parameter], config: Float8LinearConfig, *, fqn: str = ""
    ) -> "Float8Linear":
        """A Float8Linear (or subclass) around an existing ``[out, in]`` ``weight`` and ``bias``
        (the same Parameter objects, so an optimizer built before keeps working): what
        :meth:`from_linear` and integrations that wrap another library's linear build on. The
        subclass sets its own attributes afterwards. ``fqn``: its name in the model, for messages."""
        if not isinstance(config, Float8LinearConfig):
            raise TypeError(f"config must be a Float8LinearConfig, got {type(config).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_features, new.in_features = int(weight.shape[0]), int(weight.shape[1])
        new.weight = weight
        new.bias = bias
        new._setup_fp8(config, fqn)
        return new

    # ---- set-up ------------------------------------------------------------------------------
    def _setup_fp8(self, config: Float8LinearConfig, fqn: str = "") -> None:
        install_optimizer_hook()
        self.fqn = fqn
        self.role = "linear"
        self._gemm_counts_eager: Dict[str, int] = {"fprop": 0, "dgrad": 0, "wgrad": 0}
        self._telemetry: Dict[int, list] = {}
        self._wcache_key = None
        self._wcache = None
        # delayed scaling: bumped whenever the scales advance (step schedule), so the cached FP8
        # weight is re-quantised with its new scale even when the weight itself did not change
        self._scale_generation = 0
        self._graph_wcache_meta = None
        self._graph_wcache_version = None
        recipe = config.recipe
        dev = self.weight.device
        # GEMM counters of the compile-traced path, added to in-graph (in-place adds that the
        # compiler keeps in its graphs); fprop is counted in forward, dgrad/wgrad in backward, in
        # two buffers so that none is mutated in both. Not in state_dict.
        self.register_buffer("fp8_fwd_count", torch.zeros(1, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("fp8_bwd_count", torch.zeros(2, dtype=torch.int64, device=dev), persistent=False)
        if recipe.is_delayed:
            L = recipe.amax_history_len
            self.register_buffer("fp8_amax_history", torch.zeros(3, L, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            self.register_buffer("fp8_amax_pending", torch.zeros(3, device=dev))
            # 1.0 where an operand has an amax waiting to be appended (mirrored in _pending so
            # the hot path never reads the device)
            self.register_buffer("fp8_pending", torch.zeros(3, device=dev))
            # the compile-traced path's grad_output [amax, flag], written only in its backward (a
            # buffer the forward also mutated would break the compiled graphs) and folded into the
            # two above by fold_traced_amax; not in state_dict (folded before a save)
            self.register_buffer("fp8_grad_pending", torch.zeros(2, device=dev), persistent=False)
        self._pending = [False, False, False]
        if config.fuse_wgrad_accumulation:
            check_wgrad_fusion(self)
        if config.graph_weight_cache:
            self._check_graph_weight_cache()
        self._config = config
        if config.graph_weight_cache:
            GRAPH_CACHED.add(self)
            self.refresh_graph_weight_cache()

    # ---- the configuration -------------------------------------------------------------------
    @property
    def config(self) -> Float8LinearConfig:
        """How this module runs (frozen); :meth:`reconfigure` replaces it."""
        return self._config

    @config.setter
    def config(self, value) -> None:
        raise AttributeError(
            "Float8Linear.config is read-only: change settings with module.reconfigure(name=value, ...), which "
            "also does what each change needs (buffers, pending amaxes, checks)"
        )

    recipe = _read_only(
        "recipe", "recipe", "the recipe is fixed when the module is built: convert a fresh model with another recipe"
    )
    emulate = _read_only(
        "emulate",
        "emulate",
        "set it when converting (convert_model(..., emulate=...)) or with module.reconfigure(emulate=...)",
    )
    kernel_options = _read_only(
        "kernel_options", "kernel_options", _ways("kernel_options", "options", "apply_kernel_options(model, options)")
    )
    telemetry_enabled = _read_only(
        "telemetry_enabled", "telemetry", _ways("telemetry", "telemetry", "set_telemetry(model, enabled)")
    )
    scaling_update = _read_only(
        "scaling_update",
        "scaling_update",
        _ways("scaling_update", "scaling_update", "set_delayed_scaling_update(model, mode)"),
    )
    amax_reduce_fn = _read_only(
        "amax_reduce_fn", "amax_reduce_fn", _ways("amax_reduce_fn", "amax_reduce_fn", "set_amax_reduce_fn(model, fn)")
    )
    fuse_wgrad_accumulation = _read_only(
        "fuse_wgrad_accumulation",
        "fuse_wgrad_accumulation",
        _ways("fuse_wgrad_accumulation", "fuse_wgrad_accumulation", "set_wgrad_accumulation_fusion(model, enabled)"),
    )

    @property
    def row_multiple(self) -> int:
        """Rows of this module's GEMM operands are padded to a multiple of this for real FP8
        GEMMs (``config.row_multiple``, the recipe's GEMM alignment)."""
        return self._config.row_multiple

    def reconfigure(self, **changes) -> Float8LinearConfig:
        """Change settings of this module's :attr:`config` (``dataclasses.replace``, validated) and
        do what each change needs; returns the new config. The model-wide ``set_*`` functions of
        :mod:`nemo_fp8_recipes.nn` call this for every FP8 linear.

        * ``scaling_update`` (delayed scaling): leaving or re-entering ``lazy`` commits the pending
          amaxes first (with the old settings); entering ``lazy`` from ``step`` appends what the
          step accumulated, locally — no amax is lost either way.
        * ``telemetry=False`` drops the statistics not yet collected.
        * ``graph_weight_cache``: True allocates and quantises the compiled path's FP8 weight
          buffers (a plain, materialised weight; current scaling), False frees them. With the cache
          on, a change of ``emulate`` or ``kernel_options`` re-quantises it.
        * ``fuse_wgrad_accumulation=True`` checks the weight first (FP32, no gradient hooks).

        The recipe is fixed at construction (its scaling state is in buffers): convert a fresh model
        for another recipe. A refused change leaves the module as it was."""
        old = self._config
        new = old.replace(**changes)
        if new == old:
            new = old  # (the same object: a converted model's FP8 linears keep sharing one config)
        if new.recipe != old.recipe:
            raise ValueError(
                f"{self.fqn or 'Float8Linear'}: the recipe is fixed when the module is built (recipe "
                f"{old.recipe.name}: its scaling state lives in this module's buffers); build a new one "
                "(Float8Linear.from_linear, or convert_model on a fresh model) for another recipe"
            )
        if new.fuse_wgrad_accumulation and "fuse_wgrad_accumulation" in changes:
            check_wgrad_fusion(self)  # (checked again in backward: hooks can be added later)
        if new.graph_weight_cache and "graph_weight_cache" in changes:
            self._check_graph_weight_cache()
        if "scaling_update" in changes and old.recipe.is_delayed and old.scaling_update == "lazy":
            for i in range(3):
                self._commit(i)
        self._config = new
        if "scaling_update" in changes and new.recipe.is_delayed and new.scaling_update == "lazy":
            self._advance_pending()
        if not new.telemetry:
            self._telemetry = {}
        if "graph_weight_cache" in changes:
            if new.graph_weight_cache:
                GRAPH_CACHED.add(self)
                self.refresh_graph_weight_cache()
            else:
                self._drop_graph_weight_cache()
        elif new.graph_weight_cache and (new.emulate != old.emulate or new.kernel_options != old.kernel_options):
            self.refresh_graph_weight_cache()
        return new

    def __setstate__(self, state) -> None:  # copy.deepcopy, pickle: the copy's cache is refreshed too
        super().__setstate__(state)
        install_optimizer_hook()  # (an unpickled module may be this process's first)
        if "_config" not in self.__dict__:  # (a module pickled when its settings were attributes)
            self._config = _config_of_old_pickle(self.__dict__)
        if self._config.graph_weight_cache:
            GRAPH_CACHED.add(self)

    def extra_repr(self) -> str:
        mode = "emulated" if self.emulate else "real"
        fused = ", fuse_wgrad_accumulation" if self.fuse_wgrad_accumulation else ""
        if self.kernel_options != KernelOptions():
            fused += f", {self.kernel_options.describe()}"
        return f"{super().extra_repr()}, recipe={self.recipe.name}, {mode}{fused}"

    def grad_accumulator(self):
        """The weight's AccumulateGrad node (what fused wgrad accumulation checks autograd will
        run), looked up each time: it changes when the weight's data is replaced with another dtype
        or device (``module.to(...)``)."""
        with torch.enable_grad():  # (called from backward, where grad mode is off)
            return self.weight.view_as(self.weight).grad_fn.next_functions[0][0]

    # ---- delayed scaling ---------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.release_weight_cache()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.recipe.is_delayed and prefix + "fp8_pending" in state_dict:
            self._pending = [bool(v) for v in state_dict[prefix + "fp8_pending"].tolist()]
        if self.recipe.is_delayed:
            with torch.no_grad():  # amaxes are >= 0; the kernels max-accumulate their IEEE bits
                self.fp8_amax_pending.abs_()
                self.fp8_grad_pending.zero_()  # (replaced by the loaded pending amaxes)
        self.refresh_graph_weight_cache()

    def _apply(self, fn, *args, **kwargs):
        # .to()/.half()/.bfloat16() must not cast the FP32 scaling state
        was_meta = self.fp8_fwd_count.is_meta
        out = super()._apply(fn, *args, **kwargs)
        if was_meta and not self.fp8_fwd_count.is_meta:
            # materialised (to_empty after building on the meta device): the buffers hold whatever
            # memory they got, so start the counters and the scaling state as at construction
            with torch.no_grad():
                self.fp8_fwd_count.zero_()
                self.fp8_bwd_count.zero_()
            self.reset_fp8_state()
        for name in ("fp8_amax_history", "fp8_scale", "fp8_amax_pending", "fp8_pending", "fp8_grad_pending"):
            b = getattr(self, name, None)
            if b is not None and b.dtype != torch.float32:
                setattr(self, name, b.float())
        self.release_weight_cache()
        if self._config is not None:  # the weight moved or changed dtype
            self.refresh_graph_weight_cache()
        return out

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_fp8_state()

    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Forget amax histories and scales (scale 1, as at construction) and the FP8 weight."""
        if self._config is not None and self._config.recipe.is_delayed:
            self.fp8_amax_history.zero_()
            self.fp8_scale.fill_(1.0)
            self.fp8_amax_pending.zero_()
            self.fp8_pending.zero_()
            self.fp8_grad_pending.zero_()
        self._pending = [False, False, False]
        self.release_weight_cache()
        if self._config is not None:
            self.refresh_graph_weight_cache()

    @torch.no_grad()
    def fold_traced_amax(self) -> None:
        """Fold the grad_output amax that the compile-traced delayed path recorded in its
        backward (``fp8_grad_pending``) into the pending amax and flag, and clear it. The update
        functions of :mod:`~nemo_fp8_recipes.nn.scaling` do this for the whole model at once;
        ``state_dict`` does it before saving. A no-op for current scaling."""
        if self._config is None or not self._config.recipe.is_delayed:
            return
        gp = self.fp8_grad_pending
        self.fp8_amax_pending[2:].copy_(torch.maximum(self.fp8_amax_pending[2:], gp[:1]))
        self.fp8_pending[2:].copy_(torch.maximum(self.fp8_pending[2:], gp[1:]))
        gp.zero_()

    def pending_amaxes_cleared(self, scales_advanced: bool) -> None:
        """Record that the pending amax buffers were consumed for the whole model by
        :mod:`~nemo_fp8_recipes.nn.scaling` (and zeroed there): appended to the histories
        (``scales_advanced``: the cached FP8 weight is re-quantised with its new scale at the next
        forward) or discarded."""
        self._pending = [False, False, False]
        if scales_advanced:
            self._scale_generation += 1

    @torch.no_grad()
    def _advance_pending(self) -> None:
        """Append every pending amax (the traced backward's included) to its history and recompute
        the scales, locally (no reduction): the per-module form of
        :func:`~nemo_fp8_recipes.nn.sync_delayed_scaling`, for leaving the ``step`` schedule."""
        self.fold_traced_amax()
        r = self._config.recipe
        hist, scale = advance_delayed_scaling(
            self.fp8_amax_history,
            self.fp8_scale,
            self.fp8_amax_pending,
            self.fp8_pending,
            (r.input_format, r.weight_format, r.grad_format),
            r,
        )
        self.fp8_amax_history.copy_(hist)
        self.fp8_scale.copy_(scale)
        self.fp8_amax_pending.zero_()
        self.fp8_pending.zero_()
        self.pending_amaxes_cleared(scales_advanced=True)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.fold_traced_amax()  # the saved pending amaxes include the traced backward's
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def invalidate_weight_cache(self) -> None:
        """Force re-quantisation of the FP8 weight: the eager path's cache at the next forward,
        the compiled path's (:meth:`set_graph_weight_cache`) now. Needed only when the weight is
        written outside an optimizer step and ``load_state_dict``: through ``.data`` (which does
        not bump its version counter) in eager mode, by any in-place write when the compiled
        forward reads the cache."""
        self.release_weight_cache()
        self.refresh_graph_weight_cache()

    # ---- the compiled path's FP8 weight cache ----------------------------------------------------
    def set_graph_weight_cache(self, enabled: bool = True) -> None:
        """``reconfigure(graph_weight_cache=enabled)``: let the compiled (traced) forward read the
        FP8 weight from buffers of this module instead of quantising it in the graph — Transformer
        Engine's FP8 weight caching across micro-batches, for ``torch.compile``. The buffers are
        (re-)quantised eagerly: now, after every optimizer step that updates this weight (a global
        optimizer hook, any optimizer), after ``load_state_dict``, ``.to()`` and
        :meth:`reset_fp8_state`, and by :meth:`invalidate_weight_cache`. So with K micro-batches
        per step the weight is quantised once per step, not K times. The cost: the two FP8 copies
        (1 byte per parameter each) stay allocated between steps, as the eager path's cache does.

        The contract: the weight changes only through those. An in-place write outside them
        (``with torch.no_grad(): w.mul_(…)``, ``.data`` copies) leaves the compiled forward
        reading the old codes until :meth:`invalidate_weight_cache`;
        :func:`~nemo_fp8_recipes.nn.audit` reports a cache older than its weight's version
        counter. Only for current scaling (delayed scaling quantises its weight with the step's
        scale, in the graph or, eagerly, into its own cache) and plain tensors: a DTensor (FSDP2)
        weight is refused."""
        self.reconfigure(graph_weight_cache=bool(enabled))

    def _check_graph_weight_cache(self) -> None:
        """Refuse the compiled weight cache for a weight it cannot follow."""
        if type(self.weight.data) is not torch.Tensor or self.weight.is_meta:
            raise ValueError(
                f"{self.fqn or 'Float8Linear'}: the compiled weight cache needs a plain, materialised "
                f"weight tensor, got {type(self.weight.data).__name__} on {self.weight.device} "
                "(a DTensor / FSDP2 weight is re-quantised in the graph)"
            )

    def _drop_graph_weight_cache(self) -> None:
        GRAPH_CACHED.discard(self)
        for name in self.GRAPH_WEIGHT_CACHE_BUFFERS:
            self._buffers.pop(name, None)
            self._non_persistent_buffers_set.discard(name)
        self._graph_wcache_meta = self._graph_wcache_version = None

    @torch.no_grad()
    def refresh_graph_weight_cache(self) -> None:
        """Re-quantise the compiled path's cached FP8 weight from the current weight, in place
        (same buffers, so compiled graphs and CUDA graphs that read them stay valid). Called for
        you (:meth:`set_graph_weight_cache`); a no-op while the cache is off."""
        if not self._config.graph_weight_cache:
            return
        w = self.weight.detach()
        if w.is_meta:  # (.to("meta"), deferred init): quantised when the weight is materialised
            return
        if type(self.weight.data) is not torch.Tensor:
            raise RuntimeError(
                f"{self.fqn or 'Float8Linear'}: the weight became a {type(self.weight.data).__name__} "
                "(e.g. fully_shard) after set_graph_weight_cache; the cached FP8 weight would be the "
                "unsharded old one. Call set_graph_weight_cache(model, False) before sharding"
            )
        # current scaling, the eager quantisers (the fused kernels on CUDA), no module state
        q_f, q_d = quantize_weight(
            w, self.recipe, self.emulate, functools.partial(quantize_plain, self.recipe, triton=self._config.triton_arg)
        )
        new = (*pack_tensors(q_f), *pack_tensors(q_d))
        for name, t in zip(self.GRAPH_WEIGHT_CACHE_BUFFERS, new):
            old = self._buffers.get(name)
            if (
                old is not None
                and old.shape == t.shape
                and old.dtype == t.dtype
                and old.device == t.device
                and old.stride() == t.stride()
            ):
                old.copy_(t)
            else:  # (empty_like keeps t's strides: the GEMMs' layouts)
                self.register_buffer(name, torch.empty_like(t).copy_(t), persistent=False)
        self._graph_wcache_meta = (pack_meta(q_f), pack_meta(q_d))
        self._graph_wcache_version = self.weight._version

    def graph_weight_cache_stale(self) -> bool:
        """Whether the compiled path's cached FP8 weight is older than the weight (its version
        counter moved since the last refresh: an in-place write outside an optimizer step or
        ``load_state_dict``). False while the cache is off."""
        return self._config.graph_weight_cache and self.weight._version != self._graph_wcache_version

    @torch.no_grad()
    def _commit(self, i: int, quantising: bool = False) -> bool:
        """Lazy schedule: append operand i's pending amax to its history and recompute its scale
        (:func:`~nemo_fp8_recipes.quant.delayed.advance_delayed_scaling`). ``quantising``: a
        quantisation that records a new amax follows at once, so the pending flag stays set.
        On CUDA with Triton (and no ``amax_reduce_fn``) the whole update is one kernel
        (:func:`~nemo_fp8_recipes.quant.triton_kernels.delayed_commit`, same numbers). Returns
        whether it left the flag set for the coming quantisation."""
        if not self._pending[i]:
            return False
        r = self.recipe
        fmt = (r.input_format, r.weight_format, r.grad_format)[i]
        hist_i = self.fp8_amax_history[i]
        if (
            self.amax_reduce_fn is None
            and triton_enabled(hist_i, self._config.triton_arg)
            and r.scale_rounding is ScaleRounding.FP32
        ):
            from ..quant.triton_kernels import delayed_commit

            delayed_commit(
                hist_i,
                self.fp8_scale[i],
                self.fp8_amax_pending[i],
                self.fp8_pending[i],
                fmt,
                r.amax_compute_algo,
                r.margin,
                flag_after=1.0 if quantising else 0.0,
            )
            self._pending[i] = quantising
            return quantising
        pending = self.fp8_amax_pending[i : i + 1]
        if self.amax_reduce_fn is not None:
            pending = self.amax_reduce_fn(pending.clone())
        hist, scale = advance_delayed_scaling(
            self.fp8_amax_history[i : i + 1],
            self.fp8_scale[i : i + 1],
            pending.reshape(1),
            self.fp8_pending[i : i + 1],
            (fmt,),
            r,
        )
        self.fp8_amax_history[i : i + 1].copy_(hist)
        self.fp8_scale[i : i + 1].copy_(scale)
        self.fp8_amax_pending[i].zero_()
        self.fp8_pending[i].zero_()
        self._pending[i] = False
        return False

    def _quantize_operand(self, i: int, t: torch.Tensor, pair: bool = False, gate: Optional[torch.Tensor] = None):
        """Quantise operand ``i`` (input, weight, grad_output) of 2-D ``t`` along its last dim;
        with ``pair=True`` also along its first dim (the wgrad copy), from one read on CUDA.
        ``gate``: the operand is ``F.silu(gate) * t`` (fused into the per-tensor pair kernels,
        :meth:`fuses_swiglu`; materialised otherwise).
        Delayed scaling: commit the pending amax (lazy schedule), cast with the scale, and
        max-accumulate this tensor's amax into the pending amax — on CUDA inside the cast pass
        itself (the tensor is read once), so a delayed quantisation is two kernels."""
        r = self.recipe
        fmt, gran = operand_spec(r, i)
        scale = amax_out = None
        committed = False
        if r.is_delayed:
            if self.scaling_update == "lazy":
                committed = self._commit(i, quantising=True)
            scale = self.fp8_scale[i]
            # lazy: the commit left it at 0, so it receives exactly this amax; step: the max over
            # every use in this optimizer step (NaN sticks). With telemetry on, the cast gets a
            # fresh accumulator (q.amax = this call's amax, for the statistics) that is then
            # folded into the pending value.
            if not self.telemetry_enabled:
                amax_out = self.fp8_amax_pending[i : i + 1]
        if gate is not None and (not pair or self.telemetry_enabled):
            t, gate = torch.nn.functional.silu(gate) * t, None
        try:
            if pair:
                q, qt = quantize_pair_auto(
                    t,
                    fmt,
                    gran,
                    r.scale_rounding,
                    scale=scale,
                    amax_out=amax_out,
                    gate=gate,
                    triton=self._config.triton_arg,
                )
            else:
                q, qt = (
                    quantize(
                        t,
                        fmt,
                        gran,
                        r.scale_rounding,
                        dim=-1,
                        scale=scale,
                        amax_out=amax_out,
                        triton=self._config.triton_arg,
                    ),
                    None,
                )
        except BaseException:
            if committed:  # the commit left the flag set for an amax that never came
                with torch.no_grad():
                    self.fp8_pending[i].fill_(0.0)
                self._pending[i] = False
            raise
        if r.is_delayed:
            if amax_out is None:
                accumulate_amax(self.fp8_amax_pending[i : i + 1], q.amax)
            if not self._pending[i]:
                self.fp8_pending[i].fill_(1.0)
                self._pending[i] = True
        if self.telemetry_enabled:
            self._telemetry.setdefault(i, []).append(quantization_stats(t.detach(), q))
        return (q, qt) if pair else q

    # ---- weight cache ------------------------------------------------------------------------
    def _quantized_weight(self):
        """(W quantised along K as [N, K], W quantised along N as [K, N]) — cached until the
        weight changes (delayed scaling: or its scale). A weight created under
        ``torch.inference_mode`` has no version counter, so a change could not be seen: it is
        quantised at every call instead."""
        w = self.weight
        if w.is_inference():
            return quantize_weight(w.detach(), self.recipe, self.emulate, self._quantize_operand)
        key = (w._version, OPTIMIZER_GENERATION[0], w.data_ptr(), w.dtype, w.device)
        if self.recipe.is_delayed:
            # The FP8 weight follows its amax history, as TE's (which re-quantises the weight at
            # every forward): a frozen weight, an evaluation or a second forward before any
            # optimizer step must not keep the scale of its first quantisation. Step schedule:
            # re-quantised once the scales advanced; lazy schedule: whenever an amax is pending
            # (i.e. at every forward, like TE).
            if self.scaling_update == "lazy" and self._pending[W]:
                self._wcache_key = None
            key = key + (self._scale_generation,)
        if self._wcache_key == key and self._wcache is not None:
            return self._wcache
        self.release_weight_cache()  # (the stale copy goes before the new one is made)
        self._wcache = quantize_weight(w.detach(), self.recipe, self.emulate, self._quantize_operand)
        self._wcache_key = key
        EAGER_CACHED.add(self)
        return self._wcache

    def release_weight_cache(self) -> None:
        """Drop the eager FP8 weight copy (the next forward quantises the weight again). Every
        optimizer step does this for every FP8 linear before it runs
        (:mod:`~nemo_fp8_recipes.nn.weight_cache`); the compiled weight cache is not touched."""
        self._wcache_key = self._wcache = None
        EAGER_CACHED.discard(self)

    @property
    def weight_cache_bytes(self) -> int:
        """Bytes held by the eager FP8 weight copy (codes and scales; 0 when there is none)."""
        if self._wcache is None:
            return 0
        seen, total = set(), 0
        for q in self._wcache:
            for t in (q.data, q.scale_inv, q.scale_e8m0):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        return total

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def gemm_counts(self) -> Dict[str, int]:
        """fprop/dgrad/wgrad GEMMs run in FP8 since construction or :meth:`reset_gemm_counts`:
        the eager path's Python counts plus the compile-traced path's in-graph counts (reading
        those synchronises with the device)."""
        fwd = int(self.fp8_fwd_count.sum().item())
        dgrad, wgrad = (int(v) for v in self.fp8_bwd_count.tolist())
        c = self._gemm_counts_eager
        return {"fprop": c["fprop"] + fwd, "dgrad": c["dgrad"] + dgrad, "wgrad": c["wgrad"] + wgrad}

    @torch.no_grad()
    def reset_gemm_counts(self) -> None:
        """Zero the GEMM counters (both paths)."""
        self._gemm_counts_eager = {k: 0 for k in self._gemm_counts_eager}
        self.fp8_fwd_count.zero_()
        self.fp8_bwd_count.zero_()

    def pop_telemetry(self) -> Dict[str, Dict[str, float]]:
        """Mean of each statistic per operand since the last call (amax: the max), then reset."""
        out = {}
        for i, stats in self._telemetry.items():
            if not stats:
                continue
            out[OPERANDS[i]] = summarize_stats(torch.stack(stats))
        self._telemetry = {}
        return out

    # ---- forward -------------------------------------------------------------------------------
    def traceable(self) -> bool:
        """Whether ``torch.compile`` traces this module's FP8 linear (no graph break), with
        telemetry off: current scaling — tensorwise and blockwise with real or emulated GEMMs,
        mxfp8 emulated — and delayed scaling under the ``step`` update schedule (what the trainer
        runs: scales fixed for the optimizer step; without a per-module ``amax_reduce_fn``).
        Telemetry, delayed scaling's ``lazy`` schedule (each quantisation first commits the
        previous amax to the history: state read and written per call), real MXFP8 GEMMs (SM100)
        and emulation on CUDA while TF32 matmuls are enabled (the exact FP32 product needs TF32
        switched off for one op, which a compiled graph cannot do) keep the eager island (see
        :meth:`forward`). Decided when the graph is traced."""
        if self.telemetry_enabled:
            return False
        if self.recipe.is_delayed and (self.scaling_update != "step" or self.amax_reduce_fn is not None):
            return False
        if self.emulate and self.weight.is_cuda and torch.backends.cuda.matmul.allow_tf32:
            return False
        if not self.emulate and self.recipe.input_granularity is Granularity.BLOCK_1x32:
            # Real MXFP8 GEMMs (SM100) keep the island: their dispatch is not wrapped as an
            # operator and has not been traced on a machine that runs it. Blockwise traces: its
            # GEMM is one operator (quant.ops.blockwise_mm; the bare dispatch broke the graph
            # 30 times in the 8B layer on torch 2.11).
            return False
        return True

    def fuses_swiglu(self, gate: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether ``self(x, gate=gate)`` runs the fused SwiGLU → quantise path: eager (not under
        ``torch.compile``, where Inductor fuses SiLU, the product and the quantisers itself), on
        CUDA with the Triton kernels, a per-tensor input (tensorwise, delayed),
        telemetry off, ``gate`` and ``x`` contiguous with the same shape and dtype (BF16 or
        FP32), whole GEMM tiles of rows (no padding), and ``KernelOptions.fused_swiglu`` on (the
        default: the forward codes are bit-identical to materialising the activation and the
        backward's ``dg`` may differ by one unit in the last place — tested on an H200 and under
        Triton's interpreter; ``fused_swiglu=False`` turns it off for an A/B run). Otherwise
        the activation is materialised first."""
        if (
            torch.compiler.is_compiling()
            or not self.kernel_options.fused_swiglu
            or self.recipe.input_granularity is not Granularity.TENSOR
            or self.telemetry_enabled
            or not triton_enabled(x, self._config.triton_arg)
        ):
            return False
        from ..quant.triton_kernels import gate_fusable

        return gate_fusable(x, gate) and (x.numel() // max(x.shape[-1], 1)) % self._config.row_multiple == 0

    def forward_eager(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x · Wᵀ (+ bias)`` through the eager FP8 path (the autograd function of
        :meth:`forward` in eager mode), with ``bias`` given by the caller: wrappers that own the
        bias handling (Megatron's ``skip_bias_add``) call this."""
        return Float8LinearFn.apply(
            x, self.weight, bias, Float8LinearOperands(self), output_dtype(x), torch.is_grad_enabled()
        )

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x · Wᵀ + b`` with the three GEMMs in FP8; with ``gate``, ``(F.silu(gate) * x) · Wᵀ + b``
        — a SwiGLU MLP's down projection called with the gate and up halves, so that the
        activation can be fused (:meth:`fuses_swiglu`: delayed scaling computes it inside the
        one-pass quantiser and never writes it, current scaling computes it once in its amax
        pass; the SwiGLU backward is one kernel). The forward
        gives the same codes and outputs as materialising the activation; the gate's gradient
        ``dg`` may differ in its last bit (and with it what depends on it downstream, e.g. the
        gate projection's delayed-scaling amax of its output gradient).

        Eager mode runs :class:`Float8LinearFn`: the fused Triton quantisers on CUDA, the FP8
        weight cached between optimizer steps, delayed-scaling state, telemetry, Python GEMM
        counters.

        Under ``torch.compile`` a current-scaling module (:meth:`traceable`) runs
        :class:`Float8LinearTracedFn`, which the compiler traces like any other op, so the
        model has no graph break here; a delayed-scaling one under the ``step`` schedule runs
        :class:`Float8LinearDelayedTracedFn` (casts with the step's scales, one pass each; the
        input and weight amaxes max-accumulated into ``fp8_amax_pending`` in the graph, the
        gradient's into ``fp8_grad_pending`` in its backward), with the eager path's codes. On
        CUDA it quantises with the eager path's Triton kernels as custom operators
        (:mod:`nemo_fp8_recipes.quant.ops`; per-tensor pairs, 1x128 groups, 128x128 blocks),
        elsewhere — or with ``KernelOptions(triton=False)`` — with the
        reference quantisers (the numerics contract in plain torch ops, which Inductor fuses into
        the neighbouring kernels); the same numbers either way. The GEMMs are the dispatch of
        :mod:`nemo_fp8_recipes.quant.gemm` (``torch._scaled_mm``; blockwise's block-scaled GEMM
        as the operator ``blockwise_mm``; or emulation). It quantises the weight in the graph, in
        every forward — or, with :meth:`set_graph_weight_cache`, reads it from buffers that are
        re-quantised eagerly after each optimizer step (FP8 weights cached across micro-batches) —
        and counts its GEMMs in the int64 buffers ``fp8_fwd_count`` /
        ``fp8_bwd_count`` with in-graph adds, so :func:`~nemo_fp8_recipes.nn.audit` stays exact.

        Deliberate fallbacks to the eager island (one graph break per FP8 linear) under
        ``torch.compile``: delayed scaling's ``lazy`` schedule (its amax histories and scales
        are state that each quantisation reads and writes), telemetry (its statistics are
        collected Python-side, also in backward), real MXFP8 GEMMs and CUDA emulation with TF32
        on (:meth:`traceable`). Turning telemetry on or off between steps makes the compiler
        re-trace once for each state (a guard on ``config.telemetry``).
        """
        if not x.is_floating_point():
            raise RuntimeError(
                f"Float8Linear {self.fqn or ''}: expected a floating-point input, got {x.dtype} "
                "(as nn.Linear, it multiplies floating-point tensors; cast the input first)"
            )
        out_dtype = output_dtype(x)
        if gate is not None:
            if self.fuses_swiglu(gate, x):
                return self._forward_swiglu(gate, x, out_dtype)
            x = torch.nn.functional.silu(gate) * x
        if torch.compiler.is_compiling() and self.traceable():
            self.fp8_fwd_count.add_(1)
            if self.recipe.is_delayed:
                y, amax = Float8LinearDelayedTracedFn.apply(
                    x,
                    self.weight,
                    self.bias,
                    self.fp8_scale,
                    self.fp8_grad_pending,
                    self.fp8_bwd_count,
                    self._config,
                    out_dtype,
                    self.fqn,
                    torch.is_grad_enabled(),
                )
                with torch.no_grad():  # the step schedule's max over every use in the step (NaN sticks)
                    self.fp8_amax_pending[:2].copy_(torch.maximum(self.fp8_amax_pending[:2], amax))
                    self.fp8_pending[:2].fill_(1.0)
                return y
            wmeta, wcache = None, ()
            if self._config.graph_weight_cache:
                wmeta = self._graph_wcache_meta
                wcache = tuple(getattr(self, n) for n in self.GRAPH_WEIGHT_CACHE_BUFFERS)
            return Float8LinearTracedFn.apply(
                x,
                self.weight,
                self.bias,
                self.fp8_bwd_count,
                self._config,
                out_dtype,
                self.fqn,
                torch.is_grad_enabled(),
                wmeta,
                *wcache,
            )
        return self._forward_eager(x, out_dtype)

    # The eager island: under torch.compile this call is a graph break; quantisation (fused
    # Triton kernels), delayed-scaling state updates, telemetry and the audit counters stay
    # exact Python-side.
    @torch.compiler.disable
    def _forward_eager(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return Float8LinearFn.apply(
            x, self.weight, self.bias, Float8LinearOperands(self), out_dtype, torch.is_grad_enabled()
        )

    def _forward_swiglu(self, gate: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        check_device(x, self.emulate, self.fqn)
        return Float8SwiGLULinearFn.apply(
            x, self.weight, self.bias, gate, Float8LinearOperands(self), out_dtype, torch.is_grad_enabled()
        )


class Float8LinearOperands:
    """What the eager autograd functions (:mod:`nemo_fp8_recipes.nn.autograd`) use of one
    :class:`Float8Linear`: its config, the stateful operand quantiser (delayed-scaling commit and
    amax recording, telemetry), the cached FP8 weight, the GEMM counters and the fused-wgrad
    target. A view on the module, made per forward; the state stays in the module (buffers that
    ``state_dict`` and ``.to()`` handle)."""

    __slots__ = ("_module",)

    def __init__(self, module: Float8Linear) -> None:
        self._module = module

    @property
    def config(self) -> Float8LinearConfig:
        """The module's settings."""
        return self._module.config

    @property
    def fqn(self) -> str:
        """The module's name in its model, for messages."""
        return self._module.fqn

    def quantize(self, i: int, t: torch.Tensor, pair: bool = False, gate: Optional[torch.Tensor] = None):
        """Quantise operand ``i`` (input, weight, grad_output) of 2-D ``t`` along its last dim (and,
        with ``pair=True``, along its first: the wgrad copy) with the module's state: delayed
        scaling commits (``lazy``) and records amaxes, telemetry records statistics. ``gate``: the
        operand is ``F.silu(gate) * t`` (:meth:`Float8Linear.fuses_swiglu`)."""
        return self._module._quantize_operand(i, t, pair=pair, gate=gate)

    def input_quantizer(self, x: torch.Tensor) -> Callable:
        """:meth:`quantize`, sharing the quantisation of input ``x`` with the other eager FP8
        linears that read it where that gives the same codes
        (:func:`~nemo_fp8_recipes.nn.shared_input.input_quantizer`)."""
        return input_quantizer(self._module, x, self.quantize)

    def quantized_weight(self) -> Tuple:
        """(W quantised along K as [N, K], W quantised along N as [K, N]), cached until the weight
        (or, delayed scaling, its scale) changes."""
        return self._module._quantized_weight()

    def count(self, gemm: str) -> None:
        """Count one ``fprop`` / ``dgrad`` / ``wgrad`` GEMM run in FP8 (the audit's counts)."""
        self._module._gemm_counts_eager[gemm] += 1

    def wgrad_target(self, ctx) -> Optional[torch.Tensor]:
        """The ``weight.grad`` this backward's wgrad GEMM accumulates into with fused wgrad
        accumulation on (:func:`~nemo_fp8_recipes.nn.wgrad_fusion.wgrad_target`), else None."""
        if not self._module.config.fuse_wgrad_accumulation:
            return None
        return wgrad_target(self._module, ctx)


def _config_of_old_pickle(state: dict) -> Float8LinearConfig:
    """The config of a Float8Linear pickled when its settings were attributes (taken out of
    ``state``, where the read-only properties would hide them)."""
    options = state.pop("kernel_options", None)
    cfg = Float8LinearConfig(
        recipe=state.pop("recipe"),
        emulate=bool(state.pop("emulate")),
        kernel_options=options if options is not None else default_kernel_options(),
        telemetry=bool(state.pop("telemetry_enabled", False)),
        graph_weight_cache=bool(state.pop("_graph_wcache_on", False)),
        fuse_wgrad_accumulation=bool(state.pop("fuse_wgrad_accumulation", False)),
        scaling_update=state.pop("scaling_update", "lazy"),
        amax_reduce_fn=state.pop("amax_reduce_fn", None),
    )
    state.pop("_row_multiple", None)
    return cfg


def fp8_modules(model: nn.Module) -> Dict[str, Float8Linear]:
    """All Float8Linear modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
