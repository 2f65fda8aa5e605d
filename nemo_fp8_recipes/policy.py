"""The precision policy: which module runs in FP8 and which stays in BF16/FP32, and why.

This is the only place in the project that knows module names. It classifies a
``(fully qualified name, module)`` pair into a *role* (docs/recipes.md) and decides a precision with
a recorded reason. Backends apply the decision (native ``convert_model``, TE autocast
callbacks, Megatron configs); the audit proves at run time that it held.

Roles and defaults:

====================  ==================================================  ================
role                  recognised as                                       default
====================  ==================================================  ================
embedding             nn.Embedding, ``tok_embeddings``, ``embed_tokens``,  BF16
                      ``word_embeddings``, ``wte``
output                ``output``, ``lm_head``, ``output_layer``            BF16 (FP32 logits)
router                ``router``, ``gate`` (Mixtral/DeepSeek MoE gate)     FP32
norm                  any *Norm class, ``*_layernorm``, ``*_norm``         FP32
attention_core        ``core_attention``, *DotProductAttention, SDPA       BF16
attention_projection  ``wq/wk/wv/wo``, ``wqkv``, ``q/k/v/o_proj``,         FP8 (option BF16)
                      ``linear_qkv``, ``linear_proj``, MLA ``*_a_proj``/
                      ``*_b_proj``
mlp                   ``w1/w2/w3``, ``w13``, ``gate/up/down_proj``,        FP8
                      ``linear_fc1/fc2``, experts, shared experts
linear                any other Linear                                     FP8 if its shape
                                                                           allows
====================  ==================================================  ================

Order of rules for a GEMM module: ``exclude`` patterns -> ``include`` patterns -> high-precision
roles -> first/last N layers -> attention projections option -> recipe is bf16 -> shape check ->
size rule (``min_fp8_weight_elements``: GEMMs too small to gain from FP8 stay BF16; off by default).
The shape check uses the recipe's *real-GEMM* alignment (16 per-tensor, 128 blockwise, 32 MXFP8)
even when emulating, so a CPU emulation makes the same choices as the GPU run it stands in for.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Tuple, Union

import torch.nn as nn

from .recipes import Recipe, get_recipe, list_recipes

__all__ = [
    "Role",
    "HIGH_PRECISION_ROLES",
    "GEMM_ROLES",
    "Decision",
    "PrecisionPolicy",
    "small_gemm_hint",
    "linear_shape",
    "grouped_weight_names",
    "layer_index",
    "classify",
]


class Role:
    EMBEDDING = "embedding"
    OUTPUT = "output"
    ROUTER = "router"
    NORM = "norm"
    ATTENTION_CORE = "attention_core"
    ATTENTION_PROJECTION = "attention_projection"
    MLP = "mlp"
    LINEAR = "linear"
    OTHER = "other"


HIGH_PRECISION_ROLES = frozenset({Role.EMBEDDING, Role.OUTPUT, Role.ROUTER, Role.NORM, Role.ATTENTION_CORE})
GEMM_ROLES = frozenset({Role.ATTENTION_PROJECTION, Role.MLP, Role.LINEAR, Role.OUTPUT, Role.ROUTER})

_HP_PRECISION = {
    Role.EMBEDDING: "bf16",
    Role.OUTPUT: "bf16",
    Role.ROUTER: "fp32",
    Role.NORM: "fp32",
    Role.ATTENTION_CORE: "bf16",
}

_EMBED_NAMES = {
    "tok_embeddings",
    "embed_tokens",
    "word_embeddings",
    "wte",
    "wpe",
    "embedding",
    "embeddings",
    "position_embeddings",
    "embed",
}
_OUTPUT_NAMES = {"output", "lm_head", "output_layer", "output_projection"}
_ROUTER_NAMES = {"router", "gate"}
_ATTN_CORE_NAMES = {"core_attention", "attn_core", "sdpa", "flash_attn", "inner_attention"}
_ATTN_PROJ_NAMES = {
    "wq",
    "wk",
    "wv",
    "wo",
    "wqkv",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "linear_qkv",
    "linear_proj",
    "c_attn",
    "out_proj",
    "query_key_value",
    "dense",
    # DeepSeek / Megatron multi-latent attention
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
}
_MLP_NAMES = {
    "w1",
    "w2",
    "w3",
    "w13",
    "gate_proj",
    "up_proj",
    "down_proj",
    "linear_fc1",
    "linear_fc2",
    "fc1",
    "fc2",
    "c_fc",
    "dense_h_to_4h",
    "dense_4h_to_h",
}
_MLP_CONTEXT = {
    "experts",
    "local_experts",
    "shared_expert",
    "shared_experts",
    "mlp",
    "feed_forward",
    "block_sparse_moe",
    "moe",
}
_ATTN_CONTEXT = {"attention", "self_attention", "self_attn", "attn", "cross_attention"}
_NORM_SUFFIXES = ("norm", "layernorm", "ln", "ln_f", "ln_1", "ln_2")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)(?:\.|$)")


def layer_index(fqn: str) -> Optional[int]:
    """Global transformer-layer index encoded in a module name (``layers.3.``, ``h.3.``,
    ``decoder.layers.3.``), or None."""
    m = _LAYER_RE.search(fqn)
    return int(m.group(1)) if m else None


def _is_gemm_module(module: Optional[nn.Module]) -> bool:
    if module is None:
        return True
    if isinstance(module, nn.Linear):
        return True
    cls = type(module).__name__
    return cls.endswith("Linear") or cls in {"TopKRouter", "Router", "MoEGate"}


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def grouped_weight_names(module: Optional[nn.Module]) -> Tuple[str, ...]:
    """Names of ``module``'s own 3-D Parameters: the weights of a grouped GEMM
    (``[experts, out_features, in_features]``, transformers 5's experts modules), or ``()``.
    A convolution's 3-D kernel (``nn.Conv1d``, e.g. a Mamba or audio layer) is no grouped GEMM."""
    if module is None or isinstance(module, _CONVOLUTIONS):
        return ()
    return tuple(n for n, p in module.named_parameters(recurse=False) if p.dim() == 3)


def classify(fqn: str, module: Optional[nn.Module] = None) -> Tuple[str, str]:
    """Role of a module and the rule that matched, from its name and class.

    ``module`` may be None to classify by name alone (e.g. for Megatron config generation).
    """
    parts = fqn.split(".") if fqn else [""]
    leaf = parts[-1]
    parents = set(parts[:-1])
    cls = type(module).__name__ if module is not None else ""

    if "Rotary" in cls or "rotary" in leaf:  # (Hugging Face's LlamaRotaryEmbedding: no weights, no GEMM)
        return Role.OTHER, f"rotary position embedding ({cls or leaf}): no weights"
    if isinstance(module, nn.Embedding) or "Embedding" in cls or leaf in _EMBED_NAMES:
        return Role.EMBEDDING, f"embedding ({cls or leaf})"
    # TE's fused TELayerNormColumnParallelLinear is a GEMM (QKV / FC1 under the TE spec), not a norm
    if ("Norm" in cls and not cls.endswith("Linear")) or leaf.endswith(_NORM_SUFFIXES):
        return Role.NORM, f"normalisation ({cls or leaf})"
    if "Router" in cls or cls == "MoEGate" or leaf in _ROUTER_NAMES:
        return Role.ROUTER, f"MoE router/gate ({cls or leaf})"
    if parents & _ROUTER_NAMES:  # e.g. DBRX ffn.router.layer, Switch mlp.router.classifier
        return Role.ROUTER, f"inside an MoE router/gate ({fqn})"
    if (
        leaf in _ATTN_CORE_NAMES
        or "DotProductAttention" in cls
        or "FlashAttention" in cls
        or cls in {"CoreAttention", "SDPA", "ScaledDotProductAttention"}
    ):
        return Role.ATTENTION_CORE, f"attention core ({cls or leaf})"
    if leaf in _OUTPUT_NAMES and layer_index(fqn) is None and not parents & (_MLP_CONTEXT | _ATTN_CONTEXT):
        # at any wrapper depth (PEFT base_model.model.lm_head, DDP module.output_layer, ...)
        return Role.OUTPUT, f"output head ({leaf})"
    if parents & {"shared_head"} and leaf == "head":  # DeepSeek multi-token-prediction head
        return Role.OUTPUT, "multi-token-prediction output head"
    grouped = grouped_weight_names(module)
    if grouped:
        return Role.MLP, f"MoE grouped experts ({cls}, 3-D weights {', '.join(grouped)})"
    if not _is_gemm_module(module):
        return Role.OTHER, f"not a GEMM module ({cls})"
    if parents & {"experts", "local_experts", "shared_expert", "shared_experts"}:
        return Role.MLP, "MoE expert projection"
    if leaf in _ATTN_PROJ_NAMES and (leaf not in {"dense", "out_proj"} or parents & _ATTN_CONTEXT):
        return Role.ATTENTION_PROJECTION, f"attention projection ({leaf})"
    if leaf in _MLP_NAMES or parents & _MLP_CONTEXT:
        return Role.MLP, f"MLP projection ({leaf})"
    return Role.LINEAR, "linear layer with no special role"


def linear_shape(module: Optional[nn.Module]) -> Optional[Tuple[int, int]]:
    """``(out_features, in_features)`` of a linear-like module (nn.Linear, te.Linear), else None."""
    o, i = getattr(module, "out_features", None), getattr(module, "in_features", None)
    return (o, i) if isinstance(o, int) and isinstance(i, int) else None


def _millions(n: int) -> str:
    return f"{n / 2**20:.3g}Mi" if n >= 2**20 else f"{n:,}"


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on one module."""

    fqn: str
    role: str
    precision: str  # "fp8", "bf16" or "fp32"
    reason: str
    layer: Optional[int] = None

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """What stays in high precision.

    Attributes:
        attention_projections: ``"fp8"`` (default) or ``"bf16"`` for QKV/output projections.
        first_layers_bf16 / last_layers_bf16: keep the first / last N transformer layers in BF16
            (by global layer index; needs ``num_layers`` or a model to infer it from).
        include: glob patterns on module names forced into FP8 (overrides roles; the strict
            audit still rejects a high-precision role that ran in FP8).
        exclude: glob patterns on module names kept in BF16 (wins over everything).
        num_layers: total transformer layers; inferred by ``convert_model`` when None.
        min_fp8_weight_elements: GEMMs whose weight has fewer elements (``in_features ×
            out_features``) stay BF16, with the size in the audit's reason: FP8 only pays off once
            the GEMM outweighs the quantisation and its launches. ``0`` (default) = off; ``"auto"``
            = the recipe's measured crossover
            (:attr:`~nemo_fp8_recipes.recipes.Recipe.fp8_crossover_weight_elements`). ``include``
            patterns win over it. Applied where the policy sees ``nn.Linear`` shapes (the native
            backend, the embedded trainer's ``backend=te``); Megatron configs refuse it.
    """

    attention_projections: str = "fp8"
    first_layers_bf16: int = 0
    last_layers_bf16: int = 0
    include: Tuple[str, ...] = field(default_factory=tuple)
    exclude: Tuple[str, ...] = field(default_factory=tuple)
    num_layers: Optional[int] = None
    min_fp8_weight_elements: Union[int, str] = 0

    def __post_init__(self) -> None:
        if self.attention_projections not in ("fp8", "bf16"):
            raise ValueError(f"attention_projections={self.attention_projections!r} is not valid; choose fp8 or bf16")
        for name in ("first_layers_bf16", "last_layers_bf16"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("include", "exclude"):
            v = getattr(self, name)
            if v is None:
                v = ()
            elif isinstance(v, str):
                v = (v,)
            elif not isinstance(v, (list, tuple, set, frozenset)):
                raise ValueError(
                    f"{name} must be a glob pattern on module names or a list of them "
                    f"(e.g. {name}=['layers.0.*', '*.wo']), got {v!r}"
                )
            bad = [p for p in v if not isinstance(p, str)]
            if bad:
                raise ValueError(f"{name} patterns must be strings (glob patterns on module names), got {bad!r}")
            object.__setattr__(self, name, tuple(v))
        if self.num_layers is not None and (
            isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1
        ):
            raise ValueError(f"num_layers must be an integer >= 1 or None, got {self.num_layers!r}")
        m = self.min_fp8_weight_elements
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(
                f"min_fp8_weight_elements must be an integer >= 0 (0 = off) or 'auto' (the recipe's "
                f"measured FP8/BF16 crossover), got {m!r}"
            )

    def fp8_weight_threshold(self, recipe: Recipe) -> int:
        """The size rule's threshold for ``recipe`` in weight elements (0 = no size rule)."""
        m = self.min_fp8_weight_elements
        if m != "auto":
            return int(m)
        if recipe.fp8_crossover_weight_elements is None:
            measured = [n for n in list_recipes() if get_recipe(n).fp8_crossover_weight_elements is not None]
            raise ValueError(
                f"min_fp8_weight_elements='auto' has no measured crossover for recipe {recipe.name} (measured: "
                f"{', '.join(measured)}); give the threshold in weight elements instead"
            )
        return recipe.fp8_crossover_weight_elements

    def with_num_layers(self, n: Optional[int]) -> "PrecisionPolicy":
        import dataclasses

        return self if self.num_layers is not None or n is None else dataclasses.replace(self, num_layers=n)

    @staticmethod
    def first_match(names: Iterable[str], pattern: str) -> Optional[str]:
        """The first of ``names`` that ``pattern`` matches (as the policy matches it), or None."""
        return next((n for n in names if fnmatch.fnmatchcase(n, pattern)), None)

    @staticmethod
    def _match(fqn: str, patterns: Iterable[str]) -> Optional[str]:
        for p in patterns:
            if fnmatch.fnmatchcase(fqn, p):
                return p
        return None

    def decide(
        self,
        fqn: str,
        module: Optional[nn.Module] = None,
        recipe: Optional[Recipe] = None,
        shape: Optional[Tuple[int, int]] = None,
    ) -> Decision:
        """Decide the precision of one module.

        ``shape`` = ``(out_features, in_features)`` of a GEMM module (read from ``module`` if it
        is a Linear); ``recipe`` decides the alignment of the shape check.
        """
        role, why = classify(fqn, module)
        layer = layer_index(fqn)

        def d(precision: str, reason: str) -> Decision:
            return Decision(fqn, role, precision, reason, layer)

        if role not in GEMM_ROLES:
            return d(
                _HP_PRECISION.get(role, "bf16"),
                f"{why}: kept out of FP8 by policy" if role in HIGH_PRECISION_ROLES else why,
            )
        pat = self._match(fqn, self.exclude)
        if pat:
            return d("bf16", f"excluded by pattern {pat!r}")
        included = self._match(fqn, self.include)
        if not included:
            if role in HIGH_PRECISION_ROLES:
                return d(_HP_PRECISION[role], f"{why}: kept out of FP8 by policy")
            if layer is not None and layer < self.first_layers_bf16:
                return d("bf16", f"layer {layer} is among the first {self.first_layers_bf16} kept in BF16")
            if layer is not None and self.last_layers_bf16:
                if self.num_layers is None:
                    raise ValueError("last_layers_bf16 needs num_layers (or a model to infer it)")
                if layer >= self.num_layers - self.last_layers_bf16:
                    return d(
                        "bf16",
                        f"layer {layer} is among the last {self.last_layers_bf16} of {self.num_layers} kept in BF16",
                    )
            if role == Role.ATTENTION_PROJECTION and self.attention_projections == "bf16":
                return d("bf16", "attention projections set to bf16 by policy")
        if recipe is not None and not recipe.is_fp8:
            return d("bf16", "recipe bf16: no FP8")
        if shape is None and isinstance(module, nn.Linear):
            shape = linear_shape(module)
        if recipe is not None and shape is not None and 0 in shape:
            return d("bf16", f"an empty GEMM (out_features={shape[0]}, in_features={shape[1]}): nothing to quantise")
        if recipe is not None and shape is not None:
            a = recipe.gemm_alignment
            bad = [f"{n}={v}" for n, v in zip(("out_features", "in_features"), shape) if v % a]
            if bad:
                return d("bf16", f"{', '.join(bad)} not divisible by {a} as {recipe.name} FP8 GEMMs need")
        if recipe is not None and not included and self.min_fp8_weight_elements:
            if shape is None:
                shape = linear_shape(module)
            if shape is None:
                what = (
                    f"{type(module).__name__} has no in_features/out_features"
                    if module is not None
                    else "no module or shape was given"
                )
                raise ValueError(
                    f"{fqn}: min_fp8_weight_elements needs the GEMM's shape, and {what}; pass "
                    "shape=(out_features, in_features), or keep such modules in BF16 with exclude "
                    "patterns instead of the size rule"
                )
            threshold = self.fp8_weight_threshold(recipe)
            n = shape[0] * shape[1]
            if n < threshold:
                src = (
                    f"auto: the measured {recipe.name} crossover"
                    if self.min_fp8_weight_elements == "auto"
                    else "policy"
                )
                return d(
                    "bf16",
                    f"{shape[0]}x{shape[1]} weight ({_millions(n)} elements) is below "
                    f"min_fp8_weight_elements={_millions(threshold)} ({src}): too small to gain from FP8",
                )
        if included:
            return d(
                "fp8",
                f"included by pattern {included!r}"
                + (f" (overrides {role} role)" if role in HIGH_PRECISION_ROLES else ""),
            )
        return d("fp8", f"{why}: FP8 per recipe")


def small_gemm_hint(recipe: Recipe, policy: PrecisionPolicy, shapes: Iterable[Tuple[int, int]]) -> Optional[str]:
    """A hint for a model whose FP8 GEMMs (``(out_features, in_features)`` each) are all below the
    recipe's measured FP8/BF16 crossover while the size rule is off: such a model likely trains
    slower in FP8 than in BF16. None when the rule is on, the recipe has no measured crossover,
    there is no FP8 GEMM, or one is at or above the crossover."""
    threshold = recipe.fp8_crossover_weight_elements
    if policy.min_fp8_weight_elements or threshold is None:
        return None
    sizes = [o * i for o, i in shapes]
    if not sizes or max(sizes) >= threshold:
        return None
    return (
        f"every FP8 GEMM of this model is below the measured {recipe.name} FP8/BF16 crossover (largest weight "
        f"{_millions(max(sizes))} elements, crossover {_millions(threshold)} on an H200 at 8,192 tokens per "
        "micro-batch): FP8 likely trains slower than BF16 here; policy.min_fp8_weight_elements=auto keeps such "
        "GEMMs in BF16 and says so in the audit (docs/policy.md)"
    )
