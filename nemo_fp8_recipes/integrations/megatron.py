"""Megatron-Core: TransformerConfig FP8 fields per recipe, and the native FP8 swap.

Two ways to run a recipe inside Megatron-Core:

* **Transformer Engine** (``backend="te"``, what clusters use): :func:`megatron_config` returns
  the ``TransformerConfig`` fields that make Megatron build the exact TE recipe — ``fp8`` format,
  ``fp8_recipe``, margin, amax history length and algorithm pinned (Megatron's own defaults are
  history 1 / ``most_recent``, not TE's 1024 / ``max``), first/last layers in BF16 from the
  policy, ``moe_router_dtype="fp32"``, FP8 attention off — plus, when the policy keeps more than
  the first/last layers in BF16 (attention projections, ``exclude`` patterns), the per-module
  overrides in Megatron's ``--te-precision-config-file`` format (``quant_recipe``).
  Megatron builds the TE recipe itself (``megatron/core/fp8_utils.py: get_fp8_recipe``) from
  ``fp8``, ``fp8_recipe``, margin/history/algorithm and ``fp8_dot_product_attention`` only, so
  recipe knobs it cannot pass are refused here with the way out; the NVTE_* power-of-2
  environment is returned in ``.env`` and must be set before TE is imported.
* **Native** (``backend="native"``, no TE needed): :func:`convert_megatron_model` swaps a
  local-spec ``GPTModel``'s ``ColumnParallelLinear`` / ``RowParallelLinear`` layers (tensor
  parallel size 1) for :class:`Float8MegatronLinear` per the precision policy, keeping the
  Parameter objects and Megatron's ``(output, bias)`` contract. It is ``convert_model`` with a
  swap for those two classes (``convert_model(..., swaps=...)``), so the policy, audit and
  telemetry of :mod:`nemo_fp8_recipes.nn` work on a real Megatron module tree.

Field names were checked against megatron-core 0.16.1 (installed here) and 0.19.2
(``megatron/core/transformer/transformer_config.py``, ``fp8_utils.py``,
``quantization/quant_config.py``, ``extensions/transformer_engine.py: TEQuantizationRecipe``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn as nn

from ..formats import Granularity
from ..nn import Float8Linear, Float8LinearConfig
from ..options import KernelOptions
from ..policy import Decision, PrecisionPolicy
from ..recipes import Recipe, ScalingKind, get_recipe
from .te import TEUnsupportedError, te_env, te_recipe_spec

__all__ = [
    "DELAYED_FIRST_LAST_MSG",
    "MEGATRON_FP8_FIELDS",
    "ATTENTION_PROJECTION_PATTERNS",
    "MegatronFP8Config",
    "megatron_config",
    "te_precision_config",
    "Float8MegatronLinear",
    "convert_megatron_model",
    "megatron_linear_classes",
]

#: Our message for the combination Megatron-Core rejects in ``TransformerConfig.__post_init__``
#: ("Delayed scaling does not support first / last layer in BF16.").
DELAYED_FIRST_LAST_MSG = (
    "recipe delayed with policy.first_layers_bf16/last_layers_bf16 > 0: Megatron-Core rejects "
    "first_last_layers_bf16 with fp8_recipe='delayed' (per-layer autocast breaks the delayed-scaling "
    "amax reduction). Use recipe=tensorwise or recipe=blockwise to keep the first/last layers in "
    "BF16, or set policy.first_layers_bf16=0 policy.last_layers_bf16=0 to keep delayed scaling"
)

#: Every TransformerConfig field :func:`megatron_config` sets.
MEGATRON_FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_param",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "moe_router_dtype",
)

#: Megatron module names of the attention projections (GQA and multi-latent attention).
ATTENTION_PROJECTION_PATTERNS = (
    "*.self_attention.linear_qkv",
    "*.self_attention.linear_proj",
    "*.self_attention.linear_q_proj",
    "*.self_attention.linear_q_down_proj",
    "*.self_attention.linear_q_up_proj",
    "*.self_attention.linear_kv_down_proj",
    "*.self_attention.linear_kv_up_proj",
)

_BF16_CONFIG_KEY = "bf16"


class MegatronFP8Config(dict):
    """``TransformerConfig`` keyword arguments for one recipe + policy (a plain ``dict``), with:

    Attributes:
        recipe / policy / backend: what it was built from.
        te_precision_config: the ``--te-precision-config-file`` content (a dict) when the policy
            keeps modules beyond the first/last layers in BF16, else None.
        env: NVTE_* variables to export before Transformer Engine is imported.
        notes: human-readable remarks (why a field has its value).

    ``TransformerConfig(**base, **cfg)`` works as is; :meth:`transformer_config_kwargs` adds the
    parsed ``quant_recipe`` for the per-module overrides.
    """

    def __init__(
        self,
        fields: Dict[str, Any],
        *,
        recipe: Recipe,
        policy: PrecisionPolicy,
        backend: str,
        te_precision_config: Optional[dict],
        env: Dict[str, str],
        notes: List[str],
    ) -> None:
        super().__init__(fields)
        self.recipe = recipe
        self.policy = policy
        self.backend = backend
        self.te_precision_config = te_precision_config
        self.env = env
        self.notes = notes

    def te_precision_yaml(self) -> Optional[str]:
        """The per-module override file (YAML text), or None when not needed."""
        if self.te_precision_config is None:
            return None
        import yaml

        return yaml.safe_dump(self.te_precision_config, sort_keys=False)

    def write_te_precision_config(self, path: Union[str, Path]) -> Optional[Path]:
        """Write :meth:`te_precision_yaml` to ``path`` (for ``--te-precision-config-file``)."""
        text = self.te_precision_yaml()
        if text is None:
            return None
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        return p

    def quant_recipe(self):
        """Megatron's parsed ``RecipeConfig`` (``TransformerConfig.quant_recipe``), or None."""
        if self.te_precision_config is None:
            return None
        from megatron.core.quantization.quant_config import RecipeConfig

        return RecipeConfig.from_config_dict(self.te_precision_config)

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        """The fields plus ``quant_recipe`` (when per-module overrides exist)."""
        out = dict(self)
        qr = self.quant_recipe()
        if qr is not None:
            out["quant_recipe"] = qr
        return out

    def cli_args(self, te_precision_config_file: Optional[str] = None) -> List[str]:
        """The same settings as Megatron-LM ``pretrain_gpt.py`` flags."""
        args: List[str] = []
        if self.get("fp8"):
            args += [
                "--fp8-format",
                self["fp8"],
                "--fp8-recipe",
                self["fp8_recipe"],
                "--fp8-margin",
                str(self["fp8_margin"]),
                "--fp8-amax-history-len",
                str(self["fp8_amax_history_len"]),
                "--fp8-amax-compute-algo",
                self["fp8_amax_compute_algo"],
            ]
            if self["first_last_layers_bf16"]:
                args += [
                    "--first-last-layers-bf16",
                    "--num-layers-at-start-in-bf16",
                    str(self["num_layers_at_start_in_bf16"]),
                    "--num-layers-at-end-in-bf16",
                    str(self["num_layers_at_end_in_bf16"]),
                ]
            if self.te_precision_config is not None:
                args += ["--te-precision-config-file", te_precision_config_file or "<write_te_precision_config(path)>"]
        args += ["--moe-router-dtype", self["moe_router_dtype"]]
        return args


def te_precision_config(recipe: Recipe, policy: PrecisionPolicy) -> Optional[dict]:
    """Per-module BF16 overrides in Megatron's ``--te-precision-config-file`` format, or None.

    One config (``bf16``: a ``TEQuantizationParams`` with an empty training recipe, which makes
    Megatron wrap the module in ``fp8_autocast(enabled=False)``) and one glob matcher per policy
    rule beyond first/last layers: attention projections when ``attention_projections="bf16"``,
    and every ``exclude`` pattern. Megatron matches against the module path inside ``GPTModel``
    (``decoder.layers.3.self_attention.linear_qkv``); the layer index there is local to a
    pipeline stage, so layer-indexed patterns need pipeline parallel size 1.
    """
    if not recipe.is_fp8:
        return None
    matchers: Dict[str, dict] = {}
    if policy.attention_projections == "bf16":
        for pat in ATTENTION_PROJECTION_PATTERNS:
            name = "attention_projections_bf16_" + pat.rsplit(".", 1)[-1]
            matchers[name] = {"type": "glob", "enabled": True, "pattern": pat, "config": _BF16_CONFIG_KEY}
    for i, pat in enumerate(policy.exclude):
        matchers[f"policy_exclude_{i}"] = {"type": "glob", "enabled": True, "pattern": pat, "config": _BF16_CONFIG_KEY}
    if not matchers:
        return None
    return {
        "configs": {
            _BF16_CONFIG_KEY: {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}
        },
        "matchers": matchers,
    }


def _megatron_expressible(r: Recipe) -> None:
    """Refuse recipe knobs Megatron's own TE recipe construction cannot pass through."""
    te_recipe_spec(r)  # raises for bf16, emulate, delayed accumulation, mxfp8 floor rule
    if r.scaling_kind is ScalingKind.CURRENT:
        if (r.fprop.fast_accum, r.dgrad.fast_accum, r.wgrad.fast_accum) != (True, False, False):
            raise TEUnsupportedError(
                "tensorwise: Megatron-Core builds Float8CurrentScaling(fp8_format, fp8_dpa) with TE's "
                "default GEMM accumulation (fprop fast, dgrad/wgrad split); non-default "
                "recipe.fprop/dgrad/wgrad.fast_accum cannot reach it. Leave them at the defaults, or "
                "build the recipe with to_te_recipe() and your own te.autocast"
            )
    if r.scaling_kind is ScalingKind.BLOCKWISE and r.weight_granularity is not Granularity.BLOCK_128x128:
        raise TEUnsupportedError(
            "blockwise: Megatron-Core builds Float8BlockScaling(fp8_format) with 128x128 weight blocks; "
            "recipe.weight_granularity=1x128 cannot reach it. Drop the override, or use to_te_recipe() "
            "with your own te.autocast"
        )


def megatron_config(
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    *,
    backend: str = "te",
    num_layers: Optional[int] = None,
    pipeline_model_parallel_size: int = 1,
    fp8_param: bool = False,
) -> MegatronFP8Config:
    """The Megatron-Core ``TransformerConfig`` fields for ``recipe`` under ``policy``.

    ``backend="te"``: FP8 through Transformer Engine (see the module docstring); every FP8 field
    is set explicitly, never left to Megatron's defaults. ``backend="native"``: ``fp8=None`` (TE
    stays off) and the FP8 GEMMs come from :func:`convert_megatron_model`; the router and
    attention settings are the same.

    ``num_layers`` / ``pipeline_model_parallel_size`` (optional) let the first/last BF16 layer
    counts be checked as Megatron will (at most ``num_layers // pp`` each). ``fp8_param=True``
    keeps FP8 weight copies (needs the distributed optimizer; see the validator).

    Raises ``ValueError`` with our message for combinations Megatron would reject or silently
    change: delayed + first/last BF16 layers, too many BF16 layers per pipeline stage, recipe
    knobs Megatron cannot pass to TE.
    """
    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    p = policy or PrecisionPolicy()
    if p.min_fp8_weight_elements:
        raise ValueError(
            f"policy.min_fp8_weight_elements={p.min_fp8_weight_elements!r} (the size rule) cannot be expressed in "
            "Megatron-Core's FP8 settings, which decide per layer and per module name: keep the small GEMMs in "
            "BF16 with policy.exclude patterns (e.g. policy.exclude=['*.linear_proj']), or set "
            "policy.min_fp8_weight_elements=0"
        )
    if backend not in ("te", "native"):
        raise ValueError(f"backend={backend!r} is not valid; choose te or native")
    notes: List[str] = []
    router = {"moe_router_dtype": "fp32"}
    notes.append("moe_router_dtype=fp32: MoE gating stays FP32 (policy role router)")
    if backend == "native" or not r.is_fp8:
        fields = {
            "fp8": None,
            "fp8_param": False,
            "fp8_dot_product_attention": False,
            "fp8_multi_head_attention": False,
            "first_last_layers_bf16": False,
            **router,
        }
        if r.is_fp8:
            notes.append("fp8=None: Transformer Engine stays off; FP8 GEMMs come from convert_megatron_model")
        return MegatronFP8Config(
            fields, recipe=r, policy=p, backend=backend, te_precision_config=None, env={}, notes=notes
        )

    _megatron_expressible(r)
    first, last = p.first_layers_bf16, p.last_layers_bf16
    if r.is_delayed and (first or last):
        raise ValueError(DELAYED_FIRST_LAST_MSG)
    if num_layers is not None:
        per_stage = num_layers // max(1, pipeline_model_parallel_size)
        for label, n in (("first_layers_bf16", first), ("last_layers_bf16", last)):
            if n > per_stage:
                raise ValueError(
                    f"policy.{label}={n} exceeds the {per_stage} layers per pipeline stage "
                    f"(num_layers={num_layers}, pipeline parallel size {pipeline_model_parallel_size}); "
                    "Megatron-Core allows at most that many. Lower it or reduce pipeline parallelism"
                )
    spec = te_recipe_spec(r)
    fmt = "hybrid" if spec.kwargs["fp8_format"] == "HYBRID" else "e4m3"
    if r.is_delayed:
        margin, hist, algo = r.margin, r.amax_history_len, r.amax_compute_algo
        notes.append(f"delayed: amax history {hist} / {algo} pinned (Megatron defaults are 1 / most_recent)")
    else:
        margin, hist, algo = 0, 1, "most_recent"  # unused by current/block scaling; pinned anyway
    fields = {
        "fp8": fmt,
        "fp8_recipe": r.name,
        "fp8_param": bool(fp8_param),
        "fp8_margin": margin,
        "fp8_amax_history_len": hist,
        "fp8_amax_compute_algo": algo,
        "fp8_wgrad": True,
        "fp8_dot_product_attention": False,
        "fp8_multi_head_attention": False,
        "first_last_layers_bf16": bool(first or last),
        "num_layers_at_start_in_bf16": first,
        "num_layers_at_end_in_bf16": last,
        **router,
    }
    notes.append(f"fp8={fmt}: " + ("E4M3 forward, E5M2 gradients" if fmt == "hybrid" else "E4M3 everywhere"))
    notes.append("fp8_dot_product_attention/fp8_multi_head_attention=False: attention core stays BF16")
    tpc = te_precision_config(r, p)
    if tpc is not None:
        notes.append(f"per-module BF16 overrides: {len(tpc['matchers'])} matcher(s) (--te-precision-config-file)")
    if p.include:
        notes.append(
            "policy.include has no effect with Transformer Engine: TE modules already run in FP8 "
            "inside the autocast, and Megatron's non-TE modules (output layer, router) cannot"
        )
    return MegatronFP8Config(
        fields, recipe=r, policy=p, backend="te", te_precision_config=tpc, env=te_env(r), notes=notes
    )


# ------------------------------------------------------------------------------------------------
# The native swap: Megatron local-spec linears -> Float8 linears
# ------------------------------------------------------------------------------------------------


def megatron_linear_classes():
    """``(ColumnParallelLinear, RowParallelLinear)`` from megatron-core (imported lazily)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    return ColumnParallelLinear, RowParallelLinear


class Float8MegatronLinear(Float8Linear):
    """A Megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` (tensor parallel size 1) whose
    three GEMMs run in FP8 per the recipe.

    Keeps Megatron's contract: ``forward(input_) -> (output, output_bias)`` on ``[seq, batch,
    hidden]`` inputs; with ``skip_bias_add=True`` the bias is returned, not added (Megatron fuses
    it later), otherwise it is added inside the GEMM and ``None`` is returned. The weight
    ``[out, in]`` and bias are the original Parameter objects (with their Megatron attributes), so
    optimizers and state dicts keep their keys; FP8 scaling state adds buffers, as in
    :class:`~nemo_fp8_recipes.nn.Float8Linear`.
    """

    @classmethod
    def from_megatron(cls, layer: nn.Module, config: Float8LinearConfig, fqn: str = "") -> "Float8MegatronLinear":
        """Wrap ``layer`` (same Parameter objects), configured by ``config``; ``fqn``: its name."""
        bias = layer.bias if isinstance(getattr(layer, "bias", None), nn.Parameter) else None
        new = cls.from_parameters(layer.weight, bias, config, fqn=fqn)
        new.skip_bias_add = bool(getattr(layer, "skip_bias_add", False))
        new.megatron_class = type(layer).__name__
        new.is_expert = bool(getattr(layer, "is_expert", False))
        return new

    def extra_repr(self) -> str:
        return f"{self.megatron_class}, {super().extra_repr()}, skip_bias_add={self.skip_bias_add}"

    @torch.compiler.disable
    def forward(
        self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None
    ):
        if weight is not None and weight is not self.weight:
            raise NotImplementedError(
                f"{self.fqn}: an externally supplied weight (shared embeddings / output layer) is not "
                "supported by the FP8 swap; keep that layer in BF16 (it is, by the output role)"
            )
        bias = None if self.skip_bias_add else self.bias
        out = self.forward_eager(input_, bias)
        return out, (self.bias if self.skip_bias_add else None)


def _check_swappable(fqn: str, layer: nn.Module) -> None:
    tp = getattr(layer, "tp_size", None)
    if tp is None:
        tp = getattr(layer, "world_size", None)
    if tp is None:
        from megatron.core import parallel_state

        tp = (
            parallel_state.get_tensor_model_parallel_world_size()
            if parallel_state.model_parallel_is_initialized()
            else 1
        )
    problems = []
    if tp != 1:
        problems.append(f"tensor parallel size {tp} (the swap supports 1)")
    if getattr(layer, "sequence_parallel", False):
        problems.append("sequence_parallel=True")
    if getattr(layer, "gradient_accumulation_fusion", False):
        problems.append("gradient_accumulation_fusion=True (fused main_grad wgrad)")
    if getattr(layer, "explicit_expert_comm", False) and tp != 1:
        problems.append("expert tensor parallelism")
    if problems:
        raise ValueError(
            f"{fqn}: cannot swap {type(layer).__name__} for an FP8 linear: {', '.join(problems)}. Build the "
            "model with tensor_model_parallel_size=1, sequence_parallel=False, "
            "gradient_accumulation_fusion=False, or use backend=te (Transformer Engine) for parallel runs"
        )


def _swap_megatron_linear(
    fqn: str, layer: nn.Module, decision: Decision, config: Float8LinearConfig
) -> Float8MegatronLinear:
    """The :data:`~nemo_fp8_recipes.nn.SwapFactory` of Megatron's parallel linears."""
    return Float8MegatronLinear.from_megatron(layer, config, fqn)


def convert_megatron_model(
    model: nn.Module,
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    emulate: Optional[bool] = None,
    device=None,
    options: Optional[KernelOptions] = None,
    *,
    telemetry: bool = False,
    graph_weight_cache: bool = False,
    scaling_update: str = "lazy",
    amax_reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> nn.Module:
    """Apply ``recipe`` to a Megatron-Core model built with the local spec (in place; returns it).

    Checks that every ``ColumnParallelLinear`` / ``RowParallelLinear`` can be swapped (tensor
    parallel size 1, no sequence parallelism, no fused ``main_grad`` wgrad), then runs
    :func:`nemo_fp8_recipes.convert_model` with a swap for those two classes: the policy decides
    each module once — for the parallel linears with the recipe's GEMM alignment checked on the
    ``[out, in]`` weight — and each one it puts in FP8 becomes a :class:`Float8MegatronLinear`.
    :func:`nemo_fp8_recipes.audit` then reports per module what ran in FP8;
    ``collect_telemetry`` / ``set_telemetry`` work as for plain PyTorch models.

    ``options`` and the keyword-only settings are :func:`~nemo_fp8_recipes.convert_model`'s, set
    once for every FP8 linear. Its ``fuse_wgrad_accumulation`` is not offered: it skips the
    weight's gradient hooks, through which Megatron's DDP fills ``main_grad``.
    """
    from ..nn.convert import convert_model

    col, row = megatron_linear_classes()
    for fqn, layer in model.named_modules():
        if isinstance(layer, (col, row)):
            _check_swappable(fqn, layer)
    return convert_model(
        model,
        recipe,
        policy=policy,
        emulate=emulate,
        device=device,
        options=options,
        swaps={col: _swap_megatron_linear, row: _swap_megatron_linear},
        telemetry=telemetry,
        graph_weight_cache=graph_weight_cache,
        scaling_update=scaling_update,
        amax_reduce_fn=amax_reduce_fn,
    )


def transformer_config_field_names() -> set:
    """Field names of the installed megatron-core ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}
