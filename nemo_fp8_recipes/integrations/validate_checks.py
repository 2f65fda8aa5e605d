"""The checks behind :func:`nemo_fp8_recipes.integrations.validate.validate`, one per finding code.

Each ``check_<code>`` takes the inputs :func:`~nemo_fp8_recipes.integrations.validate.validate`
has already resolved (the :class:`Recipe` and :class:`PrecisionPolicy` objects, the backend name,
the target :class:`DeviceInfo`, the framework overrides as a ``{key: value}`` mapping, the model
dims, ...) and returns the :class:`Finding` objects it produces: an empty list when the set-up is
fine or when the check does not apply to that backend or recipe. ``validate`` runs them in a fixed
order, which is the order of the report.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from ..hardware import DeviceInfo
from ..policy import PrecisionPolicy
from ..recipes import Recipe, ScalingKind, check_supported
from .megatron import DELAYED_FIRST_LAST_MSG, megatron_config
from .te import (
    TE_MIN_AUTOCAST_VERSION,
    TEImportOrderError,
    TEUnsupportedError,
    check_te_import_order,
    te_recipe_spec,
)

__all__ = [
    "Finding",
    "TE_BACKENDS",
    "BRIDGE_MIXED_PRECISION_FIELDS",
    "RECIPE_OWNED_FIELDS",
    "bridge_mixed_precision_fields",
    "effective_value",
    "check_te_unexpressible",
    "check_hardware",
    "check_recipe_numerics",
    "check_delayed_first_last",
    "check_bf16_layers_per_stage",
    "check_all_layers_bf16",
    "check_pp_layer_patterns",
    "check_policy_include_te",
    "check_bridge_clobber",
    "check_mixed_precision_replaced",
    "check_recipe_conflict",
    "check_fp8_wgrad_noop",
    "check_attention_fp8",
    "check_delayed_history_1",
    "check_router_dtype",
    "check_local_spec_fp8",
    "check_fp8_param_gather",
    "check_no_te",
    "check_moe_fp8_no_te",
    "check_te_version",
    "te_min_version",
    "check_nvte_env",
    "check_te_imported_settings",
    "check_layer_dims",
    "check_token_dims",
]

#: The backends on which Megatron-Core runs FP8 through Transformer Engine.
TE_BACKENDS = ("te", "megatron_bridge")

#: MixedPrecisionConfig fields of Megatron-Bridge 0.6.2 (src/megatron/bridge/training/
#: mixed_precision.py); ``setup()`` copies each onto every model/optimizer/DDP config that has a
#: field of the same name. Read from the real class when Bridge is importable.
BRIDGE_MIXED_PRECISION_FIELDS = (
    "fp32",
    "fp16",
    "bf16",
    "params_dtype",
    "pipeline_dtype",
    "autocast_dtype",
    "autocast_enabled",
    "grad_reduce_in_fp32",
    "fp8",
    "fp8_recipe",
    "first_last_layers_bf16",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "fp8_param",
    "fp8_param_gather",
    "fp4",
    "fp4_recipe",
    "fp4_param",
    "fp4_param_gather",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "reuse_grad_buf_for_mxfp8_param_ag",
)

#: The MixedPrecisionConfig fields our recipe + policy own (anything else may be overridden).
RECIPE_OWNED_FIELDS = (
    "fp8",
    "fp8_recipe",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "fp4",
)

#: Minimum TE version per scaling kind, as Megatron-Core's get_fp8_recipe() requires it
#: (delayed scaling has no minimum there).
_TE_MIN_FOR_SCALING = {
    ScalingKind.DELAYED: (1, 0),
    ScalingKind.CURRENT: (2, 2),
    ScalingKind.BLOCKWISE: (2, 3),
    ScalingKind.MICROSCALING: (2, 1),
}


@dataclass(frozen=True)
class Finding:
    """One problem: ``level`` is ``error`` (the run would fail or silently misbehave) or
    ``warning`` (works, but probably not what you want); ``code`` is stable for tests/tools."""

    level: str
    code: str
    message: str


# ---- helpers ------------------------------------------------------------------------------------
def bridge_mixed_precision_fields() -> Tuple[str, ...]:
    """The fields of Megatron-Bridge's ``MixedPrecisionConfig``: from the installed class, else
    :data:`BRIDGE_MIXED_PRECISION_FIELDS`."""
    try:
        from megatron.bridge.training.mixed_precision import MixedPrecisionConfig  # type: ignore

        return tuple(f.name for f in dataclasses.fields(MixedPrecisionConfig))
    except Exception:  # noqa: BLE001 - Bridge absent (Python < 3.12 here): the 0.6.2 list
        return BRIDGE_MIXED_PRECISION_FIELDS


def effective_value(overrides: Mapping[str, Any], name: str, ours: Any) -> Tuple[Any, str]:
    """The value Megatron will use for field ``name`` and where it comes from: a
    ``mixed_precision.<name>`` or ``model.<name>`` override, else ``ours`` (recipe/policy)."""
    for key in (f"mixed_precision.{name}", f"model.{name}"):
        if key in overrides:
            return overrides[key], f"override {key}"
    return ours, "recipe/policy"


def _gemm_shapes(d: Mapping[str, Any]) -> List[Tuple[str, int, int]]:
    """``(module pattern, out_features, in_features)`` of the FP8 GEMMs of one layer."""
    h, ffn, heads, kv, hd = d.get("hidden"), d.get("ffn"), d.get("heads"), d.get("kv_heads"), d.get("head_dim")
    shapes = []
    if h and heads and hd:
        shapes.append(("*.self_attention.linear_qkv", (heads + 2 * (kv or heads)) * hd, h))
        shapes.append(("*.self_attention.linear_proj", h, heads * hd))
    mult = 2 if d.get("gated") else 1
    if h and ffn:
        shapes.append(("*.mlp.linear_fc1", mult * ffn, h))
        shapes.append(("*.mlp.linear_fc2", h, ffn))
    if h and d.get("experts") and d.get("moe_ffn"):
        shapes.append(("*.mlp.experts.*linear_fc1", mult * d["moe_ffn"], h))
        shapes.append(("*.mlp.experts.*linear_fc2", h, d["moe_ffn"]))
    return shapes


def _pat_covers(user_pattern: str, module_pattern: str) -> bool:
    """Whether a user exclude pattern keeps every module matching ``module_pattern`` in BF16
    (checked on a representative module name)."""
    sample = module_pattern.replace("*.", "decoder.layers.0.").replace("*", "local_experts.0.")
    return fnmatch.fnmatchcase(sample, user_pattern)


# ---- recipe and hardware ------------------------------------------------------------------------
def check_te_unexpressible(recipe: Recipe, backend: str) -> List[Finding]:
    """``te-unexpressible``: on the TE backends the recipe must map onto a Transformer Engine recipe
    and onto Megatron-Core's fp8 fields; a knob only our native FP8 path has would be lost."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    try:
        te_recipe_spec(recipe)
        megatron_config(recipe, PrecisionPolicy())  # Megatron-expressibility (the policy has its own checks)
    except TEUnsupportedError as e:
        return [Finding("error", "te-unexpressible", str(e))]
    return []


def check_hardware(recipe: Recipe, backend: str, target: DeviceInfo) -> List[Finding]:
    """``hardware``: the target GPU (and its CUDA) can run the recipe's FP8 format
    (docs/recipes.md, "Hardware support"). Transformer Engine does not emulate, so on the TE
    backends ``recipe.emulate`` does not make a format supported; without a GPU target the TE
    backends cannot be checked (a warning says so)."""
    if not recipe.is_fp8:
        return []
    te_backend = backend in TE_BACKENDS
    found: List[Finding] = []
    if target.type != "cuda":
        if te_backend:
            found.append(
                Finding(
                    "warning",
                    "hardware",
                    f"no GPU target given and {target} has none: the hardware checks were skipped; pass "
                    "--gpu h100 (or b200, sm90, ...) and --cuda 12.9 for the cluster you will run on",
                )
            )
        else:
            ok, why = check_supported(recipe, target)
            if not ok:
                found.append(Finding("error", "hardware", why))
        return found
    probe = recipe.replace(emulate=None) if te_backend else recipe
    ok, why = check_supported(probe, target)
    if te_backend and not ok:
        why = re.sub(r",? or emulate=true( for numerics only)?", "", why)
        why += " (recipe.emulate=true exists only on backend=native: Transformer Engine does not emulate)"
    if not ok:
        found.append(Finding("error", "hardware", why))
    if target.sm == 90 and recipe.scaling_kind is ScalingKind.BLOCKWISE and target.cuda_version is None:
        found.append(
            Finding(
                "warning",
                "hardware",
                "blockwise on Hopper needs CUDA >= 12.9 for its 1x128/128x128 GEMMs; pass --cuda to check it",
            )
        )
    return found


def check_recipe_numerics(recipe: Recipe) -> List[Finding]:
    """``recipe-numerics``: settings the recipe accepts but that are known to ruin training
    (:meth:`Recipe.numerics_warnings`), on every backend."""
    return [Finding("warning", "recipe-numerics", w) for w in recipe.numerics_warnings()]


# ---- first/last BF16 layers, pipeline stages, policy patterns ----------------------------------
def check_delayed_first_last(
    recipe: Recipe, policy: PrecisionPolicy, backend: str, overrides: Mapping[str, Any]
) -> List[Finding]:
    """``delayed-first-last``: Megatron-Core refuses delayed scaling with first/last layers in BF16
    (from the policy or a ``first_last_layers_bf16`` override)."""
    mp_first_last = overrides.get(
        "mixed_precision.first_last_layers_bf16", overrides.get("model.first_last_layers_bf16")
    )
    if (
        backend in TE_BACKENDS
        and recipe.is_delayed
        and (policy.first_layers_bf16 or policy.last_layers_bf16 or mp_first_last)
    ):
        return [Finding("error", "delayed-first-last", DELAYED_FIRST_LAST_MSG)]
    return []


def check_bf16_layers_per_stage(
    policy: PrecisionPolicy, backend: str, num_layers: Optional[int], pp: Any
) -> List[Finding]:
    """``bf16-layers-per-stage``: Megatron-Core allows at most one pipeline stage's worth of layers
    for ``policy.first_layers_bf16`` and for ``policy.last_layers_bf16``."""
    if not num_layers:
        return []
    found: List[Finding] = []
    per_stage = num_layers // max(1, int(pp))
    for label, n in (("first_layers_bf16", policy.first_layers_bf16), ("last_layers_bf16", policy.last_layers_bf16)):
        if n > per_stage and backend in TE_BACKENDS:
            found.append(
                Finding(
                    "error",
                    "bf16-layers-per-stage",
                    f"policy.{label}={n} exceeds the {per_stage} layers per pipeline stage (num_layers="
                    f"{num_layers}, pipeline parallel {pp}); Megatron-Core allows at most that many. Lower it",
                )
            )
    return found


def check_all_layers_bf16(recipe: Recipe, policy: PrecisionPolicy, num_layers: Optional[int]) -> List[Finding]:
    """``all-layers-bf16``: the first/last BF16 layers leave at least one layer with FP8 GEMMs."""
    first, last = policy.first_layers_bf16, policy.last_layers_bf16
    if num_layers and first + last >= num_layers and recipe.is_fp8:
        return [
            Finding(
                "warning",
                "all-layers-bf16",
                f"policy keeps the first {first} and last {last} of {num_layers} layers in BF16: no FP8 GEMM "
                "is left; lower policy.first_layers_bf16/last_layers_bf16",
            )
        ]
    return []


def check_pp_layer_patterns(policy: PrecisionPolicy, backend: str, pp: Any) -> List[Finding]:
    """``pp-layer-patterns``: with pipeline parallelism Megatron matches ``policy.exclude`` against
    each stage's local module path, so a pattern naming a layer index hits a different layer on
    every stage."""
    if (
        policy.exclude
        and int(pp) > 1
        and any(re.search(r"layers\.\d", x) for x in policy.exclude)
        and backend in TE_BACKENDS
    ):
        return [
            Finding(
                "warning",
                "pp-layer-patterns",
                f"policy.exclude {list(policy.exclude)} names layer indices, but Megatron matches them against the "
                f"local module path of each of the {pp} pipeline stages; use policy.first_layers_bf16/"
                "last_layers_bf16 for global indices, or patterns without layer numbers",
            )
        ]
    return []


def check_policy_include_te(policy: PrecisionPolicy, backend: str) -> List[Finding]:
    """``policy-include-te``: ``policy.include`` only acts on backend=native; with Transformer Engine
    it changes nothing."""
    if policy.include and backend in TE_BACKENDS:
        return [
            Finding(
                "warning",
                "policy-include-te",
                "policy.include has no effect with Transformer Engine (TE modules already run in FP8 inside the "
                "autocast; Megatron's output layer and router are not TE modules); drop it or use backend=native",
            )
        ]
    return []


# ---- framework overrides against the effective Megatron / Bridge settings -----------------------
def check_bridge_clobber(
    recipe: Recipe, backend: str, overrides: Mapping[str, Any], mp_fields: Sequence[str]
) -> List[Finding]:
    """``bridge-clobber``: a ``model.`` / ``optimizer.`` / ``ddp.`` override of a field that
    Megatron-Bridge's ``MixedPrecisionConfig.setup()`` copies over at launch (``mp_fields``) would be
    silently lost."""
    if not (backend == "megatron_bridge" and recipe.is_fp8):
        return []
    found: List[Finding] = []
    for key in overrides:
        head, _, leaf = key.partition(".")
        if head in ("model", "optimizer", "ddp") and leaf in mp_fields:
            found.append(
                Finding(
                    "error",
                    "bridge-clobber",
                    f"{key}={overrides[key]!r} would be silently overwritten: Megatron-Bridge's "
                    f"MixedPrecisionConfig.setup() copies mixed_precision.{leaf} onto the {head} config "
                    "at launch. "
                    + (
                        "Set it with recipe=/policy.* (it is part of the FP8 recipe)"
                        if leaf in RECIPE_OWNED_FIELDS
                        else f"Use mixed_precision.{leaf}={overrides[key]} instead"
                    ),
                )
            )
    return found


def check_mixed_precision_replaced(recipe: Recipe, backend: str, overrides: Mapping[str, Any]) -> List[Finding]:
    """``bridge-conflict``: a whole ``mixed_precision=`` override replaces the MixedPrecisionConfig
    that ``recipe=`` builds for Megatron-Bridge."""
    if backend == "megatron_bridge" and recipe.is_fp8 and "mixed_precision" in overrides:
        return [
            Finding(
                "error",
                "bridge-conflict",
                f"mixed_precision={overrides['mixed_precision']!r} replaces the MixedPrecisionConfig built from "
                f"recipe={recipe.name}; choose the recipe with recipe=<key> (and tune it with recipe.* / policy.*)",
            )
        ]
    return []


def check_recipe_conflict(
    recipe: Recipe, policy: PrecisionPolicy, backend: str, overrides: Mapping[str, Any]
) -> List[Finding]:
    """``bridge-conflict`` (Megatron-Bridge, ``mixed_precision.*``) / ``recipe-conflict``
    (Megatron-Core, ``model.*``): an override of a field the recipe and policy set contradicts them.
    ``fp8_wgrad``, the amax history and the attention fields have checks of their own."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    first, last = policy.first_layers_bf16, policy.last_layers_bf16
    try:
        want = megatron_config(
            recipe,
            PrecisionPolicy(first_layers_bf16=first, last_layers_bf16=last)
            if not (recipe.is_delayed and (first or last))
            else PrecisionPolicy(),
        )
    except (TEUnsupportedError, ValueError):
        return []
    found: List[Finding] = []
    for name in RECIPE_OWNED_FIELDS:
        key = f"mixed_precision.{name}" if backend == "megatron_bridge" else f"model.{name}"
        if (
            key in overrides
            and name in want
            and overrides[key] != want[name]
            and name
            not in ("fp8_wgrad", "fp8_amax_history_len", "fp8_dot_product_attention", "fp8_multi_head_attention")
        ):
            found.append(
                Finding(
                    "error",
                    "bridge-conflict" if backend == "megatron_bridge" else "recipe-conflict",
                    f"{key}={overrides[key]!r} contradicts recipe={recipe.name} / policy (which set "
                    f"{name}={want[name]!r}); "
                    f"drop the override and choose it through recipe=<key>, recipe.* or policy.*",
                )
            )
    return found


def check_fp8_wgrad_noop(recipe: Recipe, backend: str, overrides: Mapping[str, Any]) -> List[Finding]:
    """``fp8-wgrad-noop``: Transformer Engine >= 2.0 ignores ``fp8_wgrad=False``; the wgrad GEMM
    still runs in FP8."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    wgrad, src = effective_value(overrides, "fp8_wgrad", True)
    if wgrad is False:
        return [
            Finding(
                "error",
                "fp8-wgrad-noop",
                f"fp8_wgrad=False ({src}) is silently ignored by Transformer Engine >= 2.0: the wgrad GEMM "
                "still runs in FP8. Remove the override; to keep a layer's GEMMs in BF16 use "
                "policy.exclude=[<module pattern>]",
            )
        ]
    return []


def check_attention_fp8(recipe: Recipe, backend: str, overrides: Mapping[str, Any]) -> List[Finding]:
    """``attention-fp8``: the precision policy keeps the attention core in BF16; the
    ``fp8_dot_product_attention`` / ``fp8_multi_head_attention`` overrides would put it in FP8."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    found: List[Finding] = []
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        v, src = effective_value(overrides, name, False)
        if v:
            found.append(
                Finding(
                    "error",
                    "attention-fp8",
                    f"{name}=True ({src}) puts the attention core in FP8, which the precision policy keeps in "
                    "BF16; remove the override",
                )
            )
    return found


def check_delayed_history_1(recipe: Recipe, backend: str, overrides: Mapping[str, Any]) -> List[Finding]:
    """``delayed-history-1``: delayed scaling with an amax history of 1 (Megatron's default, from an
    override or the recipe) makes each scale follow a single step's amax, with no headroom after a
    spike."""
    if not (backend in TE_BACKENDS and recipe.is_fp8 and recipe.is_delayed):
        return []
    hist, src = effective_value(overrides, "fp8_amax_history_len", recipe.amax_history_len)
    if hist == 1 and src.startswith("override"):
        return [
            Finding(
                "error",
                "delayed-history-1",
                f"delayed scaling with fp8_amax_history_len=1 ({src}): Megatron's default history of 1 "
                "with most_recent makes every scale follow a single step's amax (no headroom after a "
                "spike). Remove the override to keep the recipe's history "
                f"({recipe.amax_history_len}/{recipe.amax_compute_algo}), or set recipe.amax_history_len=1 on purpose",
            )
        ]
    if hist == 1:
        return [
            Finding(
                "warning",
                "delayed-history-1",
                "recipe.amax_history_len=1 is Megatron's default, not TE's (1024 / max): each scale follows "
                "a single step's amax; set recipe.amax_history_len=1024 recipe.amax_compute_algo=max unless "
                "you mean it",
            )
        ]
    return []


def check_router_dtype(
    recipe: Recipe, backend: str, overrides: Mapping[str, Any], dims: Mapping[str, Any]
) -> List[Finding]:
    """``router-dtype``: the policy keeps MoE gating in FP32 (or FP64); a lower
    ``moe_router_dtype`` override contradicts it."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    router, src = effective_value(overrides, "moe_router_dtype", "fp32")
    if router not in ("fp32", "fp64") and (dims.get("experts") or "model.moe_router_dtype" in overrides):
        return [
            Finding(
                "error",
                "router-dtype",
                f"moe_router_dtype={router!r} ({src}): the policy keeps MoE gating in FP32; remove the override "
                "(our config sets fp32)",
            )
        ]
    return []


def check_local_spec_fp8(recipe: Recipe, backend: str, overrides: Mapping[str, Any]) -> List[Finding]:
    """``local-spec-fp8``: Megatron's FP8 autocast only covers Transformer Engine layers, so with a
    ``model.transformer_impl`` other than ``transformer_engine`` fp8 does nothing."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    impl = overrides.get("model.transformer_impl")
    if impl is not None and impl != "transformer_engine":
        return [
            Finding(
                "error",
                "local-spec-fp8",
                f"model.transformer_impl={impl!r}: Megatron's get_fp8_context only enters an FP8 autocast for "
                "Transformer Engine layers, so fp8 would be a silent no-op; use transformer_impl="
                "transformer_engine, or backend=native (convert_megatron_model) for FP8 without TE",
            )
        ]
    return []


def check_fp8_param_gather(
    recipe: Recipe, backend: str, overrides: Mapping[str, Any], fp8_param_gather: bool
) -> List[Finding]:
    """``fp8-param-gather``: FP8 weight copies all-gathered in FP8 (``fp8_param_gather`` /
    ``fp8_param``) need Megatron's distributed optimizer, and for mxfp8 also
    ``reuse_grad_buf_for_mxfp8_param_ag``. ``fp8_param_gather`` is what our Bridge launcher sets."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    ov = overrides
    fpg = ov.get(
        "mixed_precision.fp8_param_gather",
        ov.get("model.fp8_param", ov.get("mixed_precision.fp8_param", fp8_param_gather)),
    )
    dist_opt = ov.get("ddp.use_distributed_optimizer", ov.get("optimizer.use_distributed_optimizer"))
    if backend == "megatron_bridge" and dist_opt is None:
        dist_opt = True  # the Llama / DeepSeek-V3 pretrain recipes turn it on
    found: List[Finding] = []
    if fpg and dist_opt is False:
        found.append(
            Finding(
                "error",
                "fp8-param-gather",
                "fp8_param_gather=True keeps FP8 weight copies and all-gathers them in FP8, which needs "
                "Megatron's distributed optimizer; set ddp.use_distributed_optimizer=true, or drop "
                "fp8_param_gather",
            )
        )
    elif fpg and dist_opt is None:
        found.append(
            Finding(
                "warning",
                "fp8-param-gather",
                "fp8_param_gather / fp8_param needs the distributed optimizer (--use-distributed-optimizer); "
                "make sure it is on",
            )
        )
    if (
        fpg
        and recipe.scaling_kind is ScalingKind.MICROSCALING
        and not ov.get(
            "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag", fp8_param_gather and backend == "megatron_bridge"
        )
    ):
        found.append(
            Finding(
                "error",
                "fp8-param-gather",
                "mxfp8 with fp8_param_gather needs reuse_grad_buf_for_mxfp8_param_ag=True (Megatron-Bridge "
                "asserts it); set mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true",
            )
        )
    return found


# ---- Transformer Engine: presence, version, environment -----------------------------------------
def check_no_te(recipe: Recipe, backend: str, te_missing: Optional[str]) -> List[Finding]:
    """``no-te``: without Transformer Engine, Megatron's FP8 context is a ``nullcontext`` and fp8 is
    silently a no-op. ``te_missing`` is why TE is not importable, when the check is for this
    machine (``te_version="auto"``) and TE is not installed here; else None."""
    if backend in TE_BACKENDS and recipe.is_fp8 and te_missing is not None:
        return [
            Finding(
                "warning",
                "no-te",
                f"{te_missing}. Without it Megatron's get_fp8_context() returns nullcontext and fp8 is silently a "
                "no-op (the local spec has no FP8 layers): install TE >= 2.9 where the job runs (this check "
                "can run without it), or use backend=native (convert_megatron_model) for FP8 without TE",
            )
        ]
    return []


def check_moe_fp8_no_te(
    recipe: Recipe, backend: str, te_missing: Optional[str], dims: Mapping[str, Any]
) -> List[Finding]:
    """``moe-fp8-no-te``: for an MoE model with fp8, Megatron-Core's ``TransformerConfig`` itself
    fails to build where TE is missing (``te_missing`` as for :func:`check_no_te`)."""
    if backend in TE_BACKENDS and recipe.is_fp8 and te_missing is not None and dims.get("experts"):
        return [
            Finding(
                "warning",
                "moe-fp8-no-te",
                "MoE + fp8: megatron-core validates the TE version in TransformerConfig.__post_init__ "
                "and, without TE, fails with TypeError ('>=' between NoneType and Version); build the "
                "config where TE is installed, or with megatron_config(..., backend='native')",
            )
        ]
    return []


def te_min_version(recipe: Recipe) -> Tuple[int, ...]:
    """The oldest Transformer Engine with which Megatron-Core builds ``recipe``'s TE recipe."""
    return _TE_MIN_FOR_SCALING.get(recipe.scaling_kind, (2, 0))


def check_te_version(recipe: Recipe, backend: str, target_te: Optional[Tuple[int, ...]]) -> List[Finding]:
    """``te-version``: the Transformer Engine on the target (``target_te``; None = unknown) is new
    enough for the recipe in Megatron-Core, and has ``te.autocast`` (2.9)."""
    if not (backend in TE_BACKENDS and recipe.is_fp8) or target_te is None:
        return []
    need = te_min_version(recipe)
    if target_te < need:
        return [
            Finding(
                "error",
                "te-version",
                f"recipe {recipe.name} needs Transformer Engine >= {'.'.join(map(str, need))} in Megatron-Core; "
                f"found {'.'.join(map(str, target_te))}. Upgrade TE (>= 2.9 recommended)",
            )
        ]
    if target_te < TE_MIN_AUTOCAST_VERSION:
        return [
            Finding(
                "warning",
                "te-version",
                f"Transformer Engine {'.'.join(map(str, target_te))} predates te.autocast (2.9): the deprecated "
                "fp8_autocast is used; upgrade to >= 2.9",
            )
        ]
    return []


def _te_spec(recipe: Recipe):
    try:
        return te_recipe_spec(recipe)
    except TEUnsupportedError:
        return None


def check_nvte_env(recipe: Recipe, backend: str, env: Mapping[str, str]) -> List[Finding]:
    """``nvte-env``: an ``NVTE_*`` variable in the job's environment (``env``) that contradicts the
    recipe's scale rounding; TE reads it once, at import."""
    if not (backend in TE_BACKENDS and recipe.is_fp8):
        return []
    spec = _te_spec(recipe)
    if spec is None:
        return []
    found: List[Finding] = []
    for var, val in spec.env.items():
        if var in env and env[var] != val:
            found.append(
                Finding(
                    "error",
                    "nvte-env",
                    f"{var}={env[var]} is exported, but recipe {recipe.name} (scale_rounding="
                    f"{recipe.scale_rounding.value}) needs {var}={val}; TE reads it once at import. Unset it (the "
                    f"launcher sets it) or choose recipe.scale_rounding to match",
                )
            )
    return found


def check_te_imported_settings(recipe: Recipe, backend: str) -> List[Finding]:
    """``te-import-order``: a Transformer Engine already imported in this process was imported with
    NVTE_* scale settings that contradict the recipe (see
    :func:`nemo_fp8_recipes.integrations.te.check_te_import_order`)."""
    if not (backend in TE_BACKENDS and recipe.is_fp8) or _te_spec(recipe) is None:
        return []
    try:
        check_te_import_order(recipe)
    except TEImportOrderError as e:
        return [Finding("error", "te-import-order", str(e))]
    return []


# ---- GEMM shapes --------------------------------------------------------------------------------
def check_layer_dims(recipe: Recipe, policy: PrecisionPolicy, backend: str, dims: Mapping[str, Any]) -> List[Finding]:
    """``layer-dims``: each FP8 GEMM's in/out features are multiples of the recipe's alignment
    (16 / 128 / 32). Transformer Engine fails on such a GEMM (an error, unless ``policy.exclude``
    keeps it in BF16); on backend=native the policy keeps it in BF16 itself (a warning)."""
    if not recipe.is_fp8:
        return []
    a = recipe.gemm_alignment
    excluded = list(policy.exclude)
    found: List[Finding] = []
    for pat, n_out, n_in in _gemm_shapes(dims):
        if policy.attention_projections == "bf16" and "self_attention" in pat:
            continue
        bad = [f"{k}={v}" for k, v in (("out_features", n_out), ("in_features", n_in)) if v % a]
        if not bad:
            continue
        if any(_pat_covers(x, pat) for x in excluded):
            continue
        leaf = pat.rsplit(".", 1)[-1]
        if backend in TE_BACKENDS:
            found.append(
                Finding(
                    "error",
                    "layer-dims",
                    f"{pat}: {', '.join(bad)} not divisible by {a} as {recipe.name} FP8 GEMMs need; keep it in BF16 "
                    f"with policy.exclude=['{pat}'], pad the dim to a multiple of {a}, or use a recipe with a "
                    f"smaller alignment (tensorwise: 16)",
                )
            )
        else:
            found.append(
                Finding(
                    "warning",
                    "layer-dims",
                    f"{leaf}: {', '.join(bad)} not divisible by {a}: the policy keeps it in BF16 (reason recorded "
                    f"in the audit); pad the dim to a multiple of {a} to run it in FP8",
                )
            )
    return found


def check_token_dims(recipe: Recipe, backend: str, micro_batch_size: Any, seq_len: Any) -> List[Finding]:
    """``token-dims``: Transformer Engine's FP8 GEMMs need the tokens per micro-batch
    (``micro_batch_size x seq_len``) to be a multiple of 16 (32 for mxfp8)."""
    if not (recipe.is_fp8 and backend in TE_BACKENDS and micro_batch_size and seq_len):
        return []
    need_m = 32 if recipe.scaling_kind is ScalingKind.MICROSCALING else 16
    tokens = int(micro_batch_size) * int(seq_len)
    if tokens % need_m:
        return [
            Finding(
                "warning",
                "token-dims",
                f"micro_batch_size x seq_length = {tokens} tokens is not a multiple of {need_m}; "
                "Transformer Engine's FP8 GEMMs need it; pad the sequence length",
            )
        ]
    return []
