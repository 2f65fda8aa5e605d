"""The recipe registry: one frozen dataclass per FP8 scaling recipe, and the hardware check.

FP8 training multiplies operands that were rounded to 8-bit floats. What makes one FP8 recipe
differ from another is *how the scale is chosen* before rounding: one scale for a whole tensor
taken from the history of past maxima (``delayed``), one scale from the tensor itself
(``tensorwise``), one scale per 1x128 tile of activations and gradients and per 128x128 block of
weights (``blockwise``, DeepSeek-V3), or one power-of-two scale per 32 consecutive elements
(``mxfp8``, OCP microscaling). Every knob that changes the numbers is a field here; the
quantisers (``nemo_fp8_recipes.quant``), the FP8 linear (``nemo_fp8_recipes.nn``) and the
integrations (Transformer Engine, Megatron, Bridge) all read them from these objects and
nowhere else.

Keys follow Megatron-Core's ``fp8_recipe`` names: ``bf16``, ``delayed``, ``tensorwise``,
``blockwise``, ``mxfp8``. Importing this module needs neither a GPU nor Transformer Engine.
The formats, scale-rounding rules and scaling groups the recipes are made of are defined in
:mod:`nemo_fp8_recipes.formats`, the device description in :mod:`nemo_fp8_recipes.hardware`;
both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional, Tuple, Union

from .formats import Format, GemmConfig, Granularity, ScaleRounding
from .hardware import DeviceInfo, describe_device

__all__ = [
    "RecipeName",
    "ScalingKind",
    "Recipe",
    "BF16Recipe",
    "DelayedScalingRecipe",
    "TensorwiseRecipe",
    "BlockwiseRecipe",
    "MXFP8Recipe",
    "list_recipes",
    "get_recipe",
    "check_supported",
    "require_supported",
    "uses_real_fp8_gemm",
    "UnsupportedRecipeError",
]


class RecipeName(str, enum.Enum):
    """Registry keys (the same strings as Megatron-Core's ``fp8_recipe``; ``bf16`` = no FP8)."""

    BF16 = "bf16"
    DELAYED = "delayed"
    TENSORWISE = "tensorwise"
    BLOCKWISE = "blockwise"
    MXFP8 = "mxfp8"


class ScalingKind(str, enum.Enum):
    """How a recipe chooses its scales: one kind per recipe class (Transformer Engine has one recipe
    class per kind). Ask ``recipe.scaling_kind`` instead of comparing ``recipe.name`` with a key."""

    NONE = "none"  # no FP8 (bf16)
    DELAYED = "delayed"  # one scale per tensor, from an amax history
    CURRENT = "current"  # one scale per tensor, from the tensor itself
    BLOCKWISE = "blockwise"  # FP32 / power-of-2 scales per 1x128 tile and 128x128 block
    MICROSCALING = "microscaling"  # E8M0 scales per 1x32 block (OCP MX)


_ALGOS = ("max", "most_recent")
#: Largest delayed-scaling margin: E4M3's emax (448 / 2**8 = 1.75, the amax still in the normal range).
MAX_MARGIN = 8
#: Longest amax history: 3 x 65536 FP32 entries = 768 KiB per FP8 linear.
MAX_AMAX_HISTORY_LEN = 65536


def _is_int(v) -> bool:
    """An int that is not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base class for all recipes. Every field is a numeric knob; see the subclasses.

    Attributes:
        name: registry key.
        input_format / weight_format / grad_format: element format of X, W and dY.
        input_granularity / weight_granularity / grad_granularity: scaling-group shape of each
            operand, laid along the contraction dim of the GEMM that consumes it.
        scale_rounding: how scales are rounded (see :class:`ScaleRounding`).
        fprop / dgrad / wgrad: accumulation settings of the three GEMMs.
        emulate: ``True`` forces exact emulation (quantise -> dequantise -> FP32 matmul);
            ``False`` demands real FP8 GEMMs; ``None`` picks real GEMMs where the hardware has
            them, else emulation only where emulation is the documented path (CPU). A GPU that
            lacks the format for this recipe is an error unless ``emulate=True``.
    """

    name: str = ""
    input_format: Format = Format.E4M3
    weight_format: Format = Format.E4M3
    grad_format: Format = Format.E5M2
    input_granularity: Granularity = Granularity.TENSOR
    weight_granularity: Granularity = Granularity.TENSOR
    grad_granularity: Granularity = Granularity.TENSOR
    scale_rounding: ScaleRounding = ScaleRounding.FP32
    fprop: GemmConfig = field(default_factory=GemmConfig)
    dgrad: GemmConfig = field(default_factory=GemmConfig)
    wgrad: GemmConfig = field(default_factory=GemmConfig)
    emulate: Optional[bool] = None

    #: how this recipe class chooses its scales (a class constant, not a field)
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.NONE
    #: ``PrecisionPolicy(min_fp8_weight_elements="auto")``: the weight size (``in_features ×
    #: out_features``) from which an FP8 linear's forward + backward is at least as fast as BF16's.
    #: Measured on one H200 with 8,192 tokens per micro-batch, steps queued back to back
    #: (docs/policy.md has the table and the command); fewer tokens per micro-batch move it up.
    #: None: not measured (give the threshold as a number). A class constant, not a field.
    fp8_crossover_weight_elements: ClassVar[Optional[int]] = None

    # ---- derived -----------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        """False only for the BF16 baseline."""
        return True

    @property
    def is_delayed(self) -> bool:
        return False

    @property
    def is_hybrid(self) -> bool:
        """HYBRID = E4M3 forward, E5M2 gradients (TE ``Format.HYBRID``)."""
        return self.grad_format is Format.E5M2 and self.input_format is Format.E4M3

    @property
    def gemm_alignment(self) -> int:
        """Divisibility every GEMM dim needs for real FP8 GEMMs (docs/recipes.md, 'Shapes')."""
        return 16

    def replace(self, **overrides: Any) -> "Recipe":
        """A copy with fields replaced (validated again); enum fields accept their string values."""
        return _build(type(self), dataclasses.replace, self, overrides)

    def numerics_warnings(self) -> List[str]:
        """Valid settings known to ruin training, each with the fix (the trainer logs them, the
        validator reports them as warnings); empty for the registry's defaults."""
        return []

    def describe(self) -> dict:
        """Plain-dict view (enums as strings) for logs, tables and checkpoints."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, GemmConfig):
                v = dataclasses.asdict(v)
            out[f.name] = v
        return out

    # ---- validation --------------------------------------------------------------------------
    def __post_init__(self) -> None:
        _coerce_enums(self)
        for op in ("fprop", "dgrad", "wgrad"):
            v = getattr(self, op)
            if isinstance(v, dict) or (hasattr(v, "keys") and not isinstance(v, GemmConfig)):
                v = dict(v)  # also an OmegaConf DictConfig from Hydra
                valid = [f.name for f in dataclasses.fields(GemmConfig)]
                unknown = sorted(set(v) - set(valid))
                if unknown:
                    raise ValueError(
                        f"{self.name}: {op} has unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
                    )
                object.__setattr__(self, op, GemmConfig(**v))
            elif not isinstance(v, GemmConfig):
                raise ValueError(f"{self.name}: {op} must be a GemmConfig or dict, got {v!r}")
        if self.emulate not in (None, True, False):
            raise ValueError(f"{self.name}: emulate must be true, false or null, got {self.emulate!r}")
        self._validate()

    def _validate(self) -> None:  # pragma: no cover - overridden
        pass


def _coerce_enums(obj: Recipe) -> None:
    """Accept strings for enum-typed fields (Hydra passes strings); reject unknown values with
    the list of valid ones."""
    enum_fields = {
        "input_format": Format,
        "weight_format": Format,
        "grad_format": Format,
        "input_granularity": Granularity,
        "weight_granularity": Granularity,
        "grad_granularity": Granularity,
        "scale_rounding": ScaleRounding,
    }
    for fname, etype in enum_fields.items():
        if not hasattr(obj, fname):
            continue
        v = getattr(obj, fname)
        if isinstance(v, etype):
            continue
        try:
            object.__setattr__(obj, fname, etype(str(v).lower()))
        except ValueError:
            valid = ", ".join(e.value for e in etype)
            raise ValueError(f"{obj.name}: {fname}={v!r} is not valid; choose one of: {valid}") from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True, kw_only=True)
class BF16Recipe(Recipe):
    """The baseline: no FP8 at all (BF16 autocast, FP32 master weights)."""

    name: str = "bf16"
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.NONE

    @property
    def is_fp8(self) -> bool:
        return False

    def _validate(self) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class DelayedScalingRecipe(Recipe):
    """``delayed`` (TE ``DelayedScaling``): one FP32 scale per tensor, from an amax history.

    ``s = (fmax / amax_hist) / 2**margin`` where ``amax_hist`` is the max (``algo="max"``) or the
    most recent entry (``"most_recent"``) of the last ``amax_history_len`` amaxes. The scale used
    at step t is computed from the history through step t-1; the amax of step t is appended after
    use. A non-finite or zero amax leaves the previous scale in place (TE behaviour). HYBRID
    formats: E4M3 X and W, E5M2 dY.
    """

    name: str = "delayed"
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.DELAYED
    fp8_crossover_weight_elements: ClassVar[Optional[int]] = 24 * 2**20
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    # TE default: per-tensor fprop may use fast accumulation; dgrad/wgrad promote to FP32.
    fprop: GemmConfig = field(default_factory=lambda: GemmConfig(fast_accum=True))

    @property
    def is_delayed(self) -> bool:
        return True

    def numerics_warnings(self) -> List[str]:
        """E4M3 gradients with a margin and the max of a history: the scale of dY comes from the
        largest gradient of the last ``amax_history_len`` steps (early training's), divided by
        ``2**margin``, and E4M3's range (2^-9 to 448, a quarter of E5M2's binades) then flushes the
        later, smaller gradients to zero. Measured (docs/numerics.md): ``llama3_tiny`` on the CPU,
        300 steps, margins 4 and 8 stall at loss 3.2 against 2.27 at margin 0 and 2.30 for margin
        8 with ``most_recent``; ``llama3_150m`` on an H100, margins 4 to 8: +110% over BF16."""
        if self.grad_format is not Format.E4M3 or self.margin == 0:
            return []
        if self.amax_compute_algo != "max" or self.amax_history_len == 1:
            return []
        return [
            f"delayed: E4M3 gradients (grad_format=e4m3) with margin={self.margin} and the max of a "
            f"{self.amax_history_len}-step amax history scale dY from its largest recent amax / 2**{self.margin}, "
            "and E4M3's narrow range then flushes the later, smaller gradients to zero: training "
            "stalls (docs/numerics.md). Use margin=0, grad_format=e5m2 (HYBRID, the default) or "
            "amax_compute_algo=most_recent"
        ]

    def _validate(self) -> None:
        _require(
            _is_int(self.amax_history_len) and 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN,
            f"delayed: amax_history_len must be an integer in 1..{MAX_AMAX_HISTORY_LEN}, got "
            f"{self.amax_history_len!r} (each FP8 linear keeps 3 x amax_history_len FP32 entries; TE's "
            "default is 1024)",
        )
        _require(
            self.amax_compute_algo in _ALGOS,
            f"delayed: amax_compute_algo={self.amax_compute_algo!r} is not valid; choose one of: " + ", ".join(_ALGOS),
        )
        _require(
            _is_int(self.margin) and 0 <= self.margin <= MAX_MARGIN,
            f"delayed: margin must be an integer in 0..{MAX_MARGIN}, got {self.margin!r} (the scale is divided "
            f"by 2**margin: beyond {MAX_MARGIN} a tensor's amax lands below 1.0 in E4M3, in its subnormals, and a "
            "large margin underflows the FP32 scale to 0, which turns every output into NaN; TE's default is 0)",
        )
        _per_tensor_checks(self)


@dataclass(frozen=True, kw_only=True)
class TensorwiseRecipe(Recipe):
    """``tensorwise`` (TE ``Float8CurrentScaling``): one FP32 scale per tensor, ``s = fmax/amax``
    from the tensor itself, every time. ``scale_rounding="pow2"`` rounds it down to a power of
    two (TE's ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``; off by default). HYBRID formats."""

    name: str = "tensorwise"
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.CURRENT
    fp8_crossover_weight_elements: ClassVar[Optional[int]] = 16 * 2**20
    fprop: GemmConfig = field(default_factory=lambda: GemmConfig(fast_accum=True))

    def _validate(self) -> None:
        _per_tensor_checks(self)
        _require(
            self.scale_rounding in (ScaleRounding.FP32, ScaleRounding.POW2),
            f"tensorwise: scale_rounding must be fp32 or pow2, got {self.scale_rounding.value}",
        )


def _per_tensor_checks(r: Recipe) -> None:
    for role in ("input", "weight", "grad"):
        g = getattr(r, f"{role}_granularity")
        _require(
            g is Granularity.TENSOR,
            f"{r.name}: {role}_granularity must be 'tensor' for a per-tensor recipe, got {g.value!r}",
        )
    _require(
        r.input_format is Format.E4M3 and r.weight_format is Format.E4M3,
        f"{r.name}: input_format and weight_format must be e4m3 (E5M2 forward operands lose too "
        "much precision; TE's HYBRID and E4M3 formats both use E4M3 forward)",
    )
    if r.name == "delayed":
        _require(r.scale_rounding is ScaleRounding.FP32, "delayed: scale_rounding must be fp32")


@dataclass(frozen=True, kw_only=True)
class BlockwiseRecipe(Recipe):
    """``blockwise`` (TE ``Float8BlockScaling``, DeepSeek-V3): E4M3 everywhere; X and dY in 1x128
    tiles along the contraction dim of each GEMM, W in 128x128 blocks; ``s = fmax/amax`` rounded
    down to a power of two by default (``scale_rounding="fp32"`` keeps exact FP32 scales, TE's
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``). All three GEMMs promote to FP32."""

    name: str = "blockwise"
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.BLOCKWISE
    fp8_crossover_weight_elements: ClassVar[Optional[int]] = 24 * 2**20
    grad_format: Format = Format.E4M3
    input_granularity: Granularity = Granularity.TILE_1x128
    weight_granularity: Granularity = Granularity.BLOCK_128x128
    grad_granularity: Granularity = Granularity.TILE_1x128
    scale_rounding: ScaleRounding = ScaleRounding.POW2

    @property
    def gemm_alignment(self) -> int:
        return 128

    def _validate(self) -> None:
        _require(
            self.input_granularity is Granularity.TILE_1x128 and self.grad_granularity is Granularity.TILE_1x128,
            "blockwise: input_granularity and grad_granularity must be '1x128'",
        )
        _require(
            self.weight_granularity in (Granularity.BLOCK_128x128, Granularity.TILE_1x128),
            "blockwise: weight_granularity must be '128x128' (default) or '1x128'",
        )
        _require(
            self.scale_rounding in (ScaleRounding.POW2, ScaleRounding.FP32),
            f"blockwise: scale_rounding must be pow2 or fp32, got {self.scale_rounding.value}",
        )
        for op in ("fprop", "dgrad", "wgrad"):
            _require(
                not getattr(self, op).fast_accum,
                f"blockwise: {op}.fast_accum must be false (blockwise GEMMs promote to FP32)",
            )


@dataclass(frozen=True, kw_only=True)
class MXFP8Recipe(Recipe):
    """``mxfp8`` (TE ``MXFP8BlockScaling``, OCP MX): E4M3 everywhere, one E8M0 (power-of-two)
    scale per 1x32 block along the contraction dim, for every operand of every GEMM (so each
    tensor has a row-wise and a column-wise copy). Default scale rule is NVIDIA's
    ``1/s = 2^ceil(log2(amax/448))`` (no element saturates); ``scale_rounding="e8m0_floor"`` is
    the OCP v1.0 rule. Real GEMMs need Blackwell (sm_100/103); Hopper only emulates."""

    name: str = "mxfp8"
    scaling_kind: ClassVar[ScalingKind] = ScalingKind.MICROSCALING
    grad_format: Format = Format.E4M3
    input_granularity: Granularity = Granularity.BLOCK_1x32
    weight_granularity: Granularity = Granularity.BLOCK_1x32
    grad_granularity: Granularity = Granularity.BLOCK_1x32
    scale_rounding: ScaleRounding = ScaleRounding.E8M0_CEIL

    @property
    def gemm_alignment(self) -> int:
        return 32

    def _validate(self) -> None:
        for role in ("input", "weight", "grad"):
            _require(
                getattr(self, f"{role}_granularity") is Granularity.BLOCK_1x32,
                f"mxfp8: {role}_granularity must be '1x32'",
            )
            _require(
                getattr(self, f"{role}_format") is Format.E4M3,
                f"mxfp8: {role}_format must be e4m3 (E5M2 MX gradients are not supported by TE)",
            )
        _require(
            self.scale_rounding in (ScaleRounding.E8M0_CEIL, ScaleRounding.E8M0_FLOOR),
            f"mxfp8: scale_rounding must be e8m0_ceil or e8m0_floor, got {self.scale_rounding.value}",
        )
        for op in ("fprop", "dgrad", "wgrad"):
            _require(not getattr(self, op).fast_accum, f"mxfp8: {op}.fast_accum must be false")


_REGISTRY = {
    RecipeName.BF16.value: BF16Recipe,
    RecipeName.DELAYED.value: DelayedScalingRecipe,
    RecipeName.TENSORWISE.value: TensorwiseRecipe,
    RecipeName.BLOCKWISE.value: BlockwiseRecipe,
    RecipeName.MXFP8.value: MXFP8Recipe,
}


def list_recipes() -> list[str]:
    """The registry keys, in order: ``bf16, delayed, tensorwise, blockwise, mxfp8``."""
    return list(_REGISTRY)


def _build(cls, ctor, base, overrides: dict) -> Recipe:
    valid = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        label = cls.name if base is None else base.name
        raise ValueError(f"{label}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
    if base is None:
        return ctor(**overrides)
    return ctor(base, **overrides)


def get_recipe(name: Union[str, RecipeName, Recipe], **overrides: Any) -> Recipe:
    """Build a recipe by registry key, with optional field overrides.

    >>> get_recipe("delayed", amax_history_len=16).amax_history_len
    16

    A :class:`Recipe` passes through (overrides applied). ``None`` values in ``overrides`` mean
    "keep the default" (convenient for Hydra configs). Unknown names, unknown fields and bad
    values raise ``ValueError`` listing what is valid.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None or k == "emulate"}
    if isinstance(name, Recipe):
        return name.replace(**overrides) if overrides else name
    key = name.value if isinstance(name, RecipeName) else str(name).strip().lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid recipes: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[key]
    overrides.pop("name", None)
    return _build(cls, cls, None, overrides)


# ------------------------------------------------------------------------------------------------
# Hardware check (docs/recipes.md, "Hardware support")
# ------------------------------------------------------------------------------------------------


class UnsupportedRecipeError(RuntimeError):
    """Raised when a recipe cannot run as asked on the device; the message names the recipe,
    the GPU it needs, the device found and what to use instead."""


def _hw_status(recipe: Recipe, info: DeviceInfo) -> Tuple[bool, str]:
    """Whether ``info`` runs ``recipe`` with real FP8 GEMMs, and if not why."""
    key = recipe.name
    if not recipe.is_fp8:
        return True, "bf16 needs no FP8 hardware"
    if info.type != "cuda":
        return False, f"{key}: {info} has no FP8 GEMMs"
    sm = info.sm or 0
    if key in ("delayed", "tensorwise"):
        if sm >= 89:
            return True, f"{key}: real FP8 GEMMs on {info}"
        return False, (
            f"{key} needs an FP8 GPU (SM89 Ada, SM90 Hopper or newer); found {info}; use bf16, "
            "or emulate=true for numerics only"
        )
    if key == "blockwise":
        if sm == 90:
            cv = info.cuda_version
            if cv is not None and cv < (12, 9):
                return False, (
                    f"blockwise needs CUDA >= 12.9 for 1x128/128x128 scaled GEMMs on SM90; found "
                    f"CUDA {cv[0]}.{cv[1]} on {info}; upgrade CUDA, use tensorwise, or emulate=true"
                )
            return True, f"blockwise: real 1x128/128x128 GEMMs on {info}"
        if sm in (100, 103):
            return False, (
                f"blockwise has no native GEMM on {info} (TE emulates it through MXFP8 with "
                "power-of-2 scales); use mxfp8 on Blackwell, or emulate=true for numerics"
            )
        return False, (
            f"blockwise needs SM90 (Hopper, H100/H200) with CUDA >= 12.9; found {info}; use "
            "tensorwise, or emulate=true for numerics only"
        )
    if key == "mxfp8":
        if sm in (100, 103):
            return True, f"mxfp8: real MXFP8 GEMMs on {info}"
        if sm == 120:
            return False, (
                f"mxfp8 needs SM100/SM103 (Blackwell datacenter: B200/GB200/B300); found {info}, "
                "which Transformer Engine does not support for MXFP8; use tensorwise, or "
                "emulate=true for numerics only"
            )
        return False, (
            f"mxfp8 needs SM100 (Blackwell: B200/GB200); found {info}; use blockwise, or emulate=true for numerics only"
        )
    return False, f"{key}: unknown recipe"


def uses_real_fp8_gemm(recipe: Recipe, device=None) -> bool:
    """True when the FP8 linear will run real FP8 GEMMs for ``recipe`` on ``device``
    (False = emulation, or no FP8 at all for bf16)."""
    if not recipe.is_fp8 or recipe.emulate is True:
        return False
    ok, _ = _hw_status(recipe, describe_device(device))
    return ok


def check_supported(recipe: Union[str, Recipe], device=None) -> Tuple[bool, str]:
    """Can ``recipe`` run on ``device`` as configured? Returns ``(ok, reason)``.

    CPU: every recipe runs, emulated (``emulate`` may be None or True; ``emulate=False`` is an
    error there). GPU: per the hardware table of docs/recipes.md. Where the hardware lacks the
    format, ``emulate=True`` makes it supported (numerics only, slow); otherwise the reason names
    the recipe, the GPU it needs, the device found and an alternative.
    """
    r = get_recipe(recipe) if not isinstance(recipe, Recipe) else recipe
    info = describe_device(device)
    if not r.is_fp8:
        return True, "bf16: no FP8, runs anywhere"
    hw_ok, hw_reason = _hw_status(r, info)
    if r.emulate is True:
        return True, f"{r.name}: emulated (quantise -> dequantise -> FP32 matmul) on {info}"
    if hw_ok:
        return True, hw_reason
    if info.type == "cpu":
        if r.emulate is False:
            return False, (
                f"{r.name}: emulate=false asks for real FP8 GEMMs but found {info}; run on an FP8 "
                "GPU or leave emulate unset to emulate"
            )
        return True, f"{r.name}: emulated on CPU (no FP8 GEMMs there)"
    return False, hw_reason


def require_supported(recipe: Union[str, Recipe], device=None) -> Recipe:
    """Like :func:`check_supported` but raises :class:`UnsupportedRecipeError`; returns the recipe."""
    r = get_recipe(recipe) if not isinstance(recipe, Recipe) else recipe
    ok, reason = check_supported(r, device)
    if not ok:
        raise UnsupportedRecipeError(reason)
    return r
