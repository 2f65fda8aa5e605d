"""Transformer Engine: the exact TE recipe object for each registry recipe, and autocast.

Transformer Engine (TE) describes a recipe with one of four dataclasses in
``transformer_engine.common.recipe``: ``DelayedScaling``, ``Float8CurrentScaling``,
``Float8BlockScaling`` and ``MXFP8BlockScaling``. Their defaults drift between releases and two
of them hide a trap: the power-of-2 behaviour of ``Float8CurrentScaling`` and
``Float8BlockScaling`` is read from ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` /
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` *when TE is imported* (the per-operand ``QParams`` are
class attributes evaluated once), so the constructor flags alone do not change the numbers.

This module therefore

1. describes the TE object for a recipe as plain data (:func:`te_recipe_spec`): the class, every
   constructor argument pinned explicitly, the environment TE must be imported with, and the
   attributes the built object must show;
2. sets that environment before TE is imported, and refuses with a clear error when TE was
   already imported with the other setting (:func:`prepare_te_env`);
3. builds and verifies the real object (:func:`to_te_recipe`);
4. enters ``te.autocast`` (TE >= 2.9) or the deprecated ``fp8_autocast`` on older TE
   (:func:`te_autocast`).

Field names and defaults were checked against TE 2.20.2's ``transformer_engine/common/recipe/
__init__.py`` (the pure-Python ``transformer-engine`` wheel) and the TE main branch:
``DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo,
scaling_factor_compute_algo, reduce_amax, fp8_dpa, fp8_mha, backward_override)``,
``Float8CurrentScaling(use_power_2_scales, fp8_format, fp8_gemm_fprop/dgrad/wgrad: MMParams,
fp8_dpa, fp8_mha, backward_override)``, ``Float8BlockScaling(use_f32_scales, fp8_format,
x/w/grad_block_scaling_dim, fp8_gemm_*, fp8_dpa, fp8_mha, backward_override)``,
``MXFP8BlockScaling(margin, fp8_format, fp8_dpa, fp8_mha, backward_override,
enable_2d_quantization)``; ``te.autocast(enabled, calibrating, recipe, amax_reduction_group)``
and ``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` from
``transformer_engine/pytorch/quantization.py``. TE's per-tensor GEMM accumulation for delayed
scaling is fixed in ``pytorch/module/base.py`` (``_2X_ACC_FPROP = False``, dgrad/wgrad ``True``).

Importing this module never imports Transformer Engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Optional, Tuple, Union

from ..formats import Format, Granularity, ScaleRounding
from ..recipes import Recipe, ScalingKind, get_recipe
from ..versions import version_tuple

__all__ = [
    "ENV_BLOCK_FP32_SCALES",
    "ENV_CURRENT_POW2_SCALES",
    "TE_MIN_AUTOCAST_VERSION",
    "TERecipeSpec",
    "TEImportOrderError",
    "TEUnsupportedError",
    "te_recipe_spec",
    "te_env",
    "prepare_te_env",
    "check_te_import_order",
    "to_te_recipe",
    "te_autocast",
    "te_available",
    "te_version",
    "te_check_supported",
    "is_te_module",
]

log = logging.getLogger(__name__)

ENV_BLOCK_FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
ENV_CURRENT_POW2_SCALES = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
#: ``te.autocast`` replaced ``fp8_autocast`` in TE 2.9.
TE_MIN_AUTOCAST_VERSION = (2, 9)
_TE_RECIPE_MODULE = "transformer_engine.common.recipe"

#: TE recipe class per scaling kind (:attr:`~nemo_fp8_recipes.recipes.Recipe.scaling_kind`).
TE_CLASSES = {
    ScalingKind.DELAYED: "DelayedScaling",
    ScalingKind.CURRENT: "Float8CurrentScaling",
    ScalingKind.BLOCKWISE: "Float8BlockScaling",
    ScalingKind.MICROSCALING: "MXFP8BlockScaling",
}
#: Constructor arguments whose value is an ``MMParams``.
_MM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
#: Per-operand ``QParams`` (class attributes set from the environment at import in TE 2.x;
#: constructor arguments where an installed TE declares them as fields).
_Q_FIELDS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


class TEImportOrderError(RuntimeError):
    """Transformer Engine was imported with an NVTE_* setting that contradicts the recipe."""


class TEUnsupportedError(ValueError):
    """The recipe asks for something Transformer Engine (or the installed TE) cannot express."""


@dataclass(frozen=True)
class TERecipeSpec:
    """Plain-data description of the TE recipe object for one registry recipe.

    Attributes:
        recipe: registry key.
        te_class: TE class name in ``transformer_engine.common.recipe``.
        kwargs: every constructor argument, pinned; ``fp8_format`` as the ``Format`` member name,
            ``MMParams`` values as ``{"use_split_accumulator": bool}`` dicts.
        env: environment variables TE must have been imported with.
        expected: ``attribute path -> value`` the built object must show (``"a.b"`` = nested).
        optional: constructor arguments an older TE may lack; dropped there, and ``expected``
            still proves the behaviour.
    """

    recipe: str
    te_class: str
    kwargs: Dict[str, Any]
    env: Dict[str, str] = field(default_factory=dict)
    expected: Dict[str, Any] = field(default_factory=dict)
    optional: FrozenSet[str] = frozenset()

    def describe(self) -> str:
        """``Float8BlockScaling(fp8_format=E4M3, ...)`` with the environment, for logs and tables."""
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{self.te_class}({args})" + (f" [env {env}]" if env else "")


def _short(v: Any) -> str:
    if isinstance(v, dict) and set(v) == {"use_split_accumulator"}:
        return f"MMParams(use_split_accumulator={v['use_split_accumulator']})"
    return str(v)


def _as_recipe(recipe: Union[str, Recipe]) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else get_recipe(recipe)


def _fmt(r: Recipe) -> str:
    """TE ``Format`` member: HYBRID = E4M3 forward + E5M2 gradients, E4M3 = E4M3 everywhere."""
    if r.input_format is not Format.E4M3 or r.weight_format is not Format.E4M3:
        raise TEUnsupportedError(f"{r.name}: TE needs E4M3 inputs and weights (Format.E4M3 or HYBRID)")
    return "HYBRID" if r.grad_format is Format.E5M2 else "E4M3"


def _mm(fast_accum: bool) -> Dict[str, bool]:
    # TE's "split accumulator" = periodic FP32 promotion = our fast_accum=False.
    return {"use_split_accumulator": not fast_accum}


def te_recipe_spec(recipe: Union[str, Recipe]) -> TERecipeSpec:
    """The TE recipe object for ``recipe``, as plain data (no TE import).

    Raises :class:`TEUnsupportedError` (a ``ValueError``) naming the way out when the recipe
    cannot be expressed in TE: ``bf16`` (no TE recipe: run without FP8 autocast), ``emulate=true``
    (a native-backend option), delayed scaling with non-default GEMM accumulation (fixed inside
    TE), and MXFP8 with the OCP ``e8m0_floor`` scale rule (TE implements the round-up rule).
    """
    r = _as_recipe(recipe)
    if not r.is_fp8:
        raise TEUnsupportedError(
            "bf16 has no Transformer Engine recipe: run without te.autocast (or with enabled=False)"
        )
    if r.emulate is True:
        raise TEUnsupportedError(
            f"{r.name}: emulate=true is a native-backend option (quantise -> dequantise -> matmul); "
            "Transformer Engine always runs real FP8 GEMMs. Drop recipe.emulate, or use backend=native"
        )
    common = {"fp8_dpa": False, "fp8_mha": False}  # attention core stays out of FP8 (policy)
    optional = frozenset({"backward_override", "enable_2d_quantization", "use_power_2_scales", "use_f32_scales"})
    if r.scaling_kind is ScalingKind.DELAYED:
        if not r.fprop.fast_accum or r.dgrad.fast_accum or r.wgrad.fast_accum:
            raise TEUnsupportedError(
                "delayed: TE's DelayedScaling fixes GEMM accumulation (fprop fast, dgrad/wgrad split, "
                "transformer_engine/pytorch/module/base.py); leave recipe.fprop/dgrad/wgrad.fast_accum at "
                "their defaults, use recipe=tensorwise (per-GEMM MMParams), or backend=native"
            )
        kwargs = {
            "margin": r.margin,
            "fp8_format": _fmt(r),
            "amax_history_len": r.amax_history_len,
            "amax_compute_algo": r.amax_compute_algo,
            "scaling_factor_compute_algo": None,
            "reduce_amax": True,
            **common,
            "backward_override": None,
        }
        expected = {k: v for k, v in kwargs.items() if k not in ("fp8_format", "backward_override")}
        return TERecipeSpec(r.name, TE_CLASSES[r.scaling_kind], kwargs, {}, expected, optional)
    if r.scaling_kind is ScalingKind.CURRENT:
        pow2 = r.scale_rounding is ScaleRounding.POW2
        kwargs = {
            "use_power_2_scales": pow2,
            "fp8_format": _fmt(r),
            "fp8_gemm_fprop": _mm(r.fprop.fast_accum),
            "fp8_gemm_dgrad": _mm(r.dgrad.fast_accum),
            "fp8_gemm_wgrad": _mm(r.wgrad.fast_accum),
            **common,
            "backward_override": None,
        }
        expected = {f"{q}.power_2_scale": pow2 for q in _Q_FIELDS}
        expected.update({f"{q}.amax_epsilon": 0.0 for q in _Q_FIELDS})
        expected.update({f"{m}.use_split_accumulator": kwargs[m]["use_split_accumulator"] for m in _MM_FIELDS})
        return TERecipeSpec(
            r.name,
            TE_CLASSES[r.scaling_kind],
            kwargs,
            {ENV_CURRENT_POW2_SCALES: "1" if pow2 else "0"},
            expected,
            optional,
        )
    if r.scaling_kind is ScalingKind.BLOCKWISE:
        fp32 = r.scale_rounding is ScaleRounding.FP32
        kwargs = {
            "use_f32_scales": fp32,
            "fp8_format": _fmt(r),
            "x_block_scaling_dim": 1,  # 1x128 activation tiles
            "w_block_scaling_dim": 2 if r.weight_granularity is Granularity.BLOCK_128x128 else 1,
            "grad_block_scaling_dim": 1,
            "fp8_gemm_fprop": _mm(False),
            "fp8_gemm_dgrad": _mm(False),
            "fp8_gemm_wgrad": _mm(False),
            **common,
            "backward_override": None,
        }
        expected = {f"{q}.power_2_scale": not fp32 for q in _Q_FIELDS}
        expected.update({f"{q}.amax_epsilon": 0.0 for q in _Q_FIELDS})
        expected.update(
            {k: kwargs[k] for k in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")}
        )
        return TERecipeSpec(
            r.name,
            TE_CLASSES[r.scaling_kind],
            kwargs,
            {ENV_BLOCK_FP32_SCALES: "1" if fp32 else "0"},
            expected,
            optional,
        )
    if r.scaling_kind is ScalingKind.MICROSCALING:
        if r.scale_rounding is not ScaleRounding.E8M0_CEIL:
            raise TEUnsupportedError(
                "mxfp8: TE's MXFP8BlockScaling implements NVIDIA's round-up E8M0 rule "
                "(2^ceil(log2(amax/448))); scale_rounding=e8m0_floor (OCP) exists only in backend=native. "
                "Drop recipe.scale_rounding for TE"
            )
        kwargs = {
            "margin": 0,
            "fp8_format": _fmt(r),
            **common,
            "backward_override": None,
            "enable_2d_quantization": False,
        }
        expected = {"margin": 0, "fp8_dpa": False, "fp8_mha": False}
        return TERecipeSpec(r.name, TE_CLASSES[r.scaling_kind], kwargs, {}, expected, optional)
    raise TEUnsupportedError(f"{r.name}: no Transformer Engine recipe")


def te_env(recipe: Union[str, Recipe]) -> Dict[str, str]:
    """NVTE_* variables TE must be imported with for ``recipe`` (empty for bf16/delayed/mxfp8)."""
    r = _as_recipe(recipe)
    if not r.is_fp8 or r.emulate is True:
        return {}
    return dict(te_recipe_spec(r).env)


def _te_recipe_module_if_loaded():
    return sys.modules.get(_TE_RECIPE_MODULE)


def check_te_import_order(recipe: Union[str, Recipe], te_recipe_module=None) -> None:
    """Raise :class:`TEImportOrderError` if TE's recipe module (already imported, or the one given)
    was imported with an NVTE_* power-of-2 setting that contradicts ``recipe``.

    TE evaluates the per-operand ``QParams`` of ``Float8CurrentScaling`` / ``Float8BlockScaling``
    from the environment once, at import; the class attributes show what it read. Where an
    installed TE declares them as constructor fields, :func:`to_te_recipe` pins them instead and
    there is nothing to refuse.
    """
    mod = te_recipe_module if te_recipe_module is not None else _te_recipe_module_if_loaded()
    r = _as_recipe(recipe)
    if mod is None or not r.is_fp8 or r.emulate is True:
        return
    spec = te_recipe_spec(r)
    if not spec.env:
        return
    cls = getattr(mod, spec.te_class)
    if any(q in _field_names(cls) for q in _Q_FIELDS):
        return  # pinned through the constructor
    want = spec.expected[f"{_Q_FIELDS[0]}.power_2_scale"]
    have = getattr(getattr(cls, _Q_FIELDS[0]), "power_2_scale")
    if have != want:
        ((var, val),) = spec.env.items()
        got = "power-of-2" if have else "FP32"
        need = "power-of-2" if want else "FP32"
        raise TEImportOrderError(
            f"Transformer Engine was imported with {got} scales for {spec.te_class}, but recipe "
            f"{r.name} (scale_rounding={r.scale_rounding.value}) needs {need} scales. TE reads "
            f"{var} once, at import, and the constructor flag alone does not change it. Fix: "
            f"export {var}={val} before starting Python (or call nemo_fp8_recipes.to_te_recipe() "
            "before anything imports transformer_engine: Megatron-Core and Megatron-Bridge do), "
            "or restart the process"
        )


def prepare_te_env(recipe: Union[str, Recipe]) -> Dict[str, str]:
    """Set the NVTE_* variables ``recipe`` needs, so a later TE import reads them; returns them.

    If TE is already imported, checks instead that it was imported with matching settings
    (:func:`check_te_import_order`), then sets the variables anyway for child processes. A
    differing value already in the environment is replaced, with a warning.
    """
    env = te_env(recipe)
    check_te_import_order(recipe)
    for k, v in env.items():
        old = os.environ.get(k)
        if old is not None and old != v:
            log.warning("%s=%s in the environment replaced by %s for recipe %s", k, old, v, _as_recipe(recipe).name)
        os.environ[k] = v
    return env


def _field_names(cls) -> set:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:  # not a dataclass
        return set()


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def build_te_recipe(spec: TERecipeSpec, te_recipe_module) -> Any:
    """Instantiate ``spec`` with the classes of ``te_recipe_module`` (``transformer_engine.common.
    recipe`` or a stand-alone load of that file) and verify the result against ``spec.expected``.

    Raises :class:`TEUnsupportedError` if the installed TE lacks a required constructor argument,
    and :class:`TEImportOrderError` if the built object does not show the expected power-of-2
    behaviour (TE imported with the other NVTE_* setting).
    """
    cls = getattr(te_recipe_module, spec.te_class)
    fields = _field_names(cls)
    kw: Dict[str, Any] = {}
    for k, v in spec.kwargs.items():
        if k not in fields:
            if k in spec.optional:
                continue
            raise TEUnsupportedError(
                f"the installed Transformer Engine's {spec.te_class} has no argument {k!r}; "
                "nemo_fp8_recipes needs transformer_engine >= 2.9"
            )
        if k == "fp8_format":
            v = getattr(te_recipe_module.Format, v)
        elif k in _MM_FIELDS:
            v = te_recipe_module.MMParams(**v)
        kw[k] = v
    q_key = f"{_Q_FIELDS[0]}.power_2_scale"
    if q_key in spec.expected:
        for q in _Q_FIELDS:
            if q in fields:  # an older TE with QParams as constructor fields: pin them
                kw[q] = te_recipe_module.QParams(power_2_scale=spec.expected[q_key], amax_epsilon=0.0)
    obj = cls(**kw)
    bad = []
    for path, want in spec.expected.items():
        have = _resolve(obj, path)
        if have != want:
            bad.append(f"{path}={have!r} (want {want!r})")
    if bad:
        msg = f"{spec.te_class} built for recipe {spec.recipe} does not match it: {', '.join(bad)}."
        if any("power_2_scale" in b for b in bad):
            ((var, val),) = spec.env.items()
            raise TEImportOrderError(
                msg + f" Transformer Engine read {var} at import with the other value; export "
                f"{var}={val} before Python starts (or call to_te_recipe() before importing TE)"
            )
        raise TEUnsupportedError(msg)
    return obj


def to_te_recipe(recipe: Union[str, Recipe], *, te_recipe_module=None) -> Any:
    """The real Transformer Engine recipe object for ``recipe`` (a key or a :class:`Recipe`).

    Every default is pinned explicitly (see :func:`te_recipe_spec`), the NVTE_* environment is
    set before TE is imported, and a TE imported earlier with a conflicting power-of-2 setting
    raises :class:`TEImportOrderError`::

        import nemo_fp8_recipes as nfr
        te_recipe = nfr.to_te_recipe("blockwise")      # Float8BlockScaling, pow-2 scales
        with nfr.integrations.te.te_autocast(te_recipe):
            out = model(batch)

    ``te_recipe_module`` (tests / tooling): a loaded ``transformer_engine/common/recipe``
    module to build from instead of importing TE; it must have been loaded with the
    environment from :func:`te_env`.
    """
    r = _as_recipe(recipe)
    spec = te_recipe_spec(r)
    if te_recipe_module is None:
        prepare_te_env(r)
        try:
            te_recipe_module = importlib.import_module(_TE_RECIPE_MODULE)
        except ImportError as e:
            raise ImportError(
                f"to_te_recipe({r.name!r}) needs Transformer Engine (pip install "
                f"'transformer_engine[pytorch]>=2.9' on a CUDA machine): {e}. Without TE, use "
                "backend=native (nemo_fp8_recipes.convert_model)"
            ) from e
    else:
        check_te_import_order(r, te_recipe_module)
    return build_te_recipe(spec, te_recipe_module)


def te_autocast(recipe: Any, enabled: bool = True, amax_reduction_group=None, *, te_module=None):
    """A fresh TE autocast context for ``recipe`` (registry key, :class:`Recipe` or TE recipe).

    Uses ``te.autocast(enabled=, recipe=, amax_reduction_group=)`` (TE >= 2.9) and falls back to
    the deprecated ``te.fp8_autocast(enabled=, fp8_recipe=, fp8_group=)`` on older TE. A new
    object is returned on every call (TE refuses re-entry of one autocast instance).
    ``recipe=None`` with ``enabled=False`` disables FP8 for the enclosed modules.
    """
    if te_module is None:
        te_module = importlib.import_module("transformer_engine.pytorch")
    if recipe is not None and (isinstance(recipe, (str, Recipe))):
        recipe = to_te_recipe(recipe) if _as_recipe(recipe).is_fp8 else None
        if recipe is None:
            enabled = False
    if hasattr(te_module, "autocast"):
        return te_module.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    return te_module.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)


def te_available() -> Tuple[bool, str]:
    """``(True, "transformer_engine X")`` if TE's PyTorch extension is installed, else
    ``(False, why)``. Looks the package up without importing it."""
    try:
        found = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (
            False,
            "Transformer Engine is not installed (pip install 'transformer_engine[pytorch]>=2.9' on a CUDA machine)",
        )
    v = te_version()
    return True, f"transformer_engine {'.'.join(map(str, v)) if v else 'unknown version'}"


def te_version() -> Optional[Tuple[int, ...]]:
    """Installed TE version from package metadata (no import), or None."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            raw = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return version_tuple(raw)
    return None


def te_check_supported(recipe: Union[str, Recipe]) -> Tuple[bool, str]:
    """TE's own hardware check for ``recipe`` on the current GPU (``is_fp8_available`` /
    ``is_fp8_block_scaling_available`` / ``is_mxfp8_available`` with ``return_reason=True``).
    Imports TE; use :func:`nemo_fp8_recipes.check_supported` where TE is absent."""
    r = _as_recipe(recipe)
    if not r.is_fp8:
        return True, "bf16: no FP8"
    te = importlib.import_module("transformer_engine.pytorch")
    fn = {
        ScalingKind.BLOCKWISE: "is_fp8_block_scaling_available",
        ScalingKind.MICROSCALING: "is_mxfp8_available",
    }.get(r.scaling_kind, "is_fp8_available")
    ok, reason = getattr(te, fn)(return_reason=True)
    return bool(ok), reason or f"{r.name}: supported by Transformer Engine on this GPU"


def is_te_module(module) -> bool:
    """True if ``module`` is (or subclasses) a Transformer Engine module, e.g. Megatron's
    ``TELayerNormColumnParallelLinear`` or ``TEDotProductAttention``."""
    return any(c.__module__.startswith("transformer_engine.") for c in type(module).__mro__)
