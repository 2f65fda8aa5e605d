"""Model configuration: one flat dataclass for the Llama 3 family and the small MoE.

The published sizes live in the Hydra configs (``configs/model/<name>.yaml``), which are the
single source of truth; :func:`load_model_config` reads them without Hydra, so benchmarks and
notebooks get the same shapes as ``nemo-fp8-train model=<name>``. Every field is flat so that
any of them can be overridden on the command line (``model.num_layers=2``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["ModelConfig", "load_model_config", "list_model_configs", "MODEL_CONFIG_DIR"]

#: The model-config block holding the size's optimiser defaults (not a model field).
OPTIM_KEY = "optim"

#: Where the packaged ``model/<name>.yaml`` files live (the Hydra ``model`` group).
MODEL_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"

_ARCHS = ("llama", "moe")
_ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only transformer.

    Dense models (``arch="llama"``) are Llama 3: RMSNorm, RoPE, grouped-query attention,
    SwiGLU, untied output head. ``arch="moe"`` replaces the feed-forward of every layer from
    ``first_k_dense`` on with a DeepSeek-V3-style mixture of experts: ``num_shared_experts``
    always-on experts plus ``num_experts`` routed ones, ``moe_top_k`` per token, gate computed in
    FP32.
    """

    name: str = "custom"
    arch: str = "llama"
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    #: Llama 3.1 RoPE frequency scaling (long context); ``None`` disables it.
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    #: Longest sequence the RoPE table is built for (the trainer checks ``seq_len`` against it).
    max_seq_len: int = 8192
    init_std: float = 0.02
    #: One projection for q/k/v (``attention.wqkv``) and one for the SwiGLU's gate and up halves
    #: (``w13``), as Megatron-Core and Transformer Engine lay them out, instead of the separate
    #: ``wq/wk/wv`` and ``w1/w3`` of Meta's and Hugging Face's Llama. The same function: fused
    #: weights are the separate ones stacked along the output dimension, and
    #: :func:`~nemo_fp8_recipes.models.llama.fuse_projections_state_dict` converts a state dict.
    #: In FP8 a fused GEMM shares its scaling: per-tensor recipes take one weight scale for the
    #: stacked weight (separate projections: one each); block and group recipes quantise the
    #: same blocks either way when every projection's width is a multiple of the block.
    fused_projections: bool = False
    # ---- mixture of experts (arch="moe") ----
    num_experts: int = 0
    num_shared_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_dim: int = 0
    first_k_dense: int = 0
    router_score: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    # ---- outlier stress (numerics study; off by default) ----
    #: Number of channels of the SwiGLU input (the ``ffn_norm`` output, which feeds ``w1`` and
    #: ``w3``) multiplied by ``outlier_scale`` in every layer: a fixed, non-learned gain that
    #: forces large-magnitude activation channels, as trained LLMs develop on their own. The
    #: channels are evenly spaced (:attr:`outlier_channel_ids`). 0 = off.
    outlier_channels: int = 0
    #: The gain of those channels (> 0).
    outlier_scale: float = 1.0

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"model config {self.name!r}: {msg}")

        need(self.arch in _ARCHS, f"arch must be one of {list(_ARCHS)}, got {self.arch!r}")
        for f in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "max_seq_len"):
            need(int(getattr(self, f)) > 0, f"{f} must be positive, got {getattr(self, f)}")
        need(self.dim % self.num_heads == 0, f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        need(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.arch == "moe":
            need(self.num_experts > 0, "arch=moe needs num_experts > 0")
            need(
                0 < self.moe_top_k <= self.num_experts,
                f"moe_top_k must be in [1, num_experts={self.num_experts}], got {self.moe_top_k}",
            )
            need(self.moe_ffn_dim > 0, "arch=moe needs moe_ffn_dim > 0")
            need(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
            need(
                0 <= self.first_k_dense <= self.num_layers,
                f"first_k_dense must be in [0, num_layers={self.num_layers}]",
            )
            need(
                self.router_score in _ROUTER_SCORES,
                f"router_score must be one of {list(_ROUTER_SCORES)}, got {self.router_score!r}",
            )
            need(self.aux_loss_coef >= 0, "aux_loss_coef must be >= 0")
        for f in ("init_std", "norm_eps", "rope_theta"):
            v = float(getattr(self, f))
            need(math.isfinite(v) and v > 0, f"{f} must be a finite number > 0, got {getattr(self, f)}")
        need(
            0 <= int(self.outlier_channels) <= self.dim,
            f"outlier_channels must be in [0, dim={self.dim}], got {self.outlier_channels}",
        )
        need(
            math.isfinite(float(self.outlier_scale)) and float(self.outlier_scale) > 0,
            f"outlier_scale must be a finite number > 0, got {self.outlier_scale}",
        )

    # ---- derived quantities ----------------------------------------------------------------
    @property
    def outlier_channel_ids(self) -> List[int]:
        """The SwiGLU-input channels scaled by ``outlier_scale``: ``outlier_channels`` channels
        evenly spaced over ``dim``, centred in their strides (``(2j + 1) · dim // (2k)``), so on
        ``dim = 1024`` two channels are 256 and 768 — each in its own 1x128 block and 1x32 group.
        Empty when the stress is off."""
        k = int(self.outlier_channels)
        return [(2 * j + 1) * self.dim // (2 * k) for j in range(k)]

    @property
    def head_dim(self) -> int:
        """Per-head dimension (``dim // num_heads``)."""
        return self.dim // self.num_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) has a MoE feed-forward."""
        return self.arch == "moe" and layer_id >= self.first_k_dense

    def _attention_params(self) -> int:
        kv = self.num_kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv  # wq, wo + wk, wv

    def num_params(self, *, include_embedding: bool = True, active_only: bool = False) -> int:
        """Analytic parameter count (matches ``sum(p.numel())`` of the built model).

        ``include_embedding=False`` drops the input embedding (a lookup, not a GEMM; the output
        head is kept). ``active_only=True`` counts only the experts a token visits (shared +
        ``moe_top_k`` routed), which is what the FLOP estimate needs.
        """
        d = self.dim
        total = 0
        for i in range(self.num_layers):
            total += self._attention_params() + 2 * d  # + attention_norm, ffn_norm
            if self.is_moe_layer(i):
                per_expert = 3 * d * self.moe_ffn_dim
                routed = self.moe_top_k if active_only else self.num_experts
                total += per_expert * routed
                total += 3 * d * self.moe_ffn_dim * self.num_shared_experts
                total += d * self.num_experts  # router
            else:
                total += 3 * d * self.ffn_dim
        total += d  # final norm
        total += self.vocab_size * d  # output head
        if include_embedding:
            total += self.vocab_size * d
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6·N + 12·L·H·Dh·T`` (PaLM appendix B convention).

        ``N`` = active non-embedding parameters; the attention term counts QKᵀ and PV forward and
        backward without the causal halving, as PaLM, Megatron and torchtitan report MFU.
        """
        n = self.num_params(include_embedding=False, active_only=True)
        attn = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * n + attn

    def megatron_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as Megatron-LM and Megatron-Bridge count model TFLOP/s
        (``num_floating_point_operations``): ``6·`` (the GEMM weights a token passes through:
        attention projections, the feed-forward — shared plus ``moe_top_k`` routed experts in MoE
        layers — and the output head; no norms, no router) ``+ 6·L·H·Dh·T``, the attention core
        with the causal half only. Llama 3 8B at sequence 8192 gives 51.47 GFLOP, the figure behind
        Bridge's published 744 TFLOP/s/GPU at 14,451 tokens/s/GPU. Against
        :meth:`flops_per_token` (PaLM's convention, which the trainer's MFU uses) it halves the
        attention core."""
        d = self.dim
        gemm = self.num_params(include_embedding=False, active_only=True) - (2 * self.num_layers + 1) * d
        gemm -= sum(d * self.num_experts for i in range(self.num_layers) if self.is_moe_layer(i))
        return 6.0 * gemm + 6.0 * self.num_layers * self.num_heads * self.head_dim * seq_len

    def replace(self, **overrides: Any) -> "ModelConfig":
        """A copy with ``overrides`` applied (validated); unknown keys list the valid ones."""
        _check_keys(overrides, self.name)
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a mapping (e.g. a Hydra ``model`` node); unknown keys list the valid ones.
        The ``optim`` block of a model config (the size's learning-rate defaults, which the
        trainer's ``trainer.lr`` / ``min_lr`` / ``warmup_steps`` read) is not part of the model."""
        values = dict(values)
        values.pop(OPTIM_KEY, None)
        _check_keys(values, values.get("name", "custom"))
        return cls(**values)

    def to_dict(self) -> Dict[str, Any]:
        """Plain-dict form (for checkpoints and logs).

        The outlier-stress fields appear only when the stress is on, so a checkpoint written
        before they existed still matches a model without them (the trainer compares every key
        of this dict with the checkpoint's). A stressed model also holds the gain in its state
        dict (``layers.<i>.ffn_outliers.gain``), so loading its checkpoint into an unstressed
        model, or the reverse, fails on the missing/unexpected key.
        """
        d = dataclasses.asdict(self)
        if not self.outlier_channels:
            d.pop("outlier_channels")
            d.pop("outlier_scale")
        return d


def _field_names() -> List[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def _check_keys(values: Mapping[str, Any], name: str) -> None:
    valid = _field_names()
    bad = [k for k in values if k not in valid]
    if bad:
        hints = {k: difflib.get_close_matches(k, valid, n=1) for k in bad}
        hint = "; ".join(f"{k!r} -> did you mean {h[0]!r}?" for k, h in hints.items() if h)
        raise ValueError(
            f"unknown model config key(s) {bad} for {name!r}"
            + (f" ({hint})" if hint else "")
            + f". Valid keys: {', '.join(valid)}"
        )


def list_model_configs() -> List[str]:
    """Names of the packaged model configs (the options of the Hydra ``model`` group)."""
    return sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))


def load_model_config(name: str, **overrides: Any) -> ModelConfig:
    """Read the packaged ``configs/model/<name>.yaml`` and apply ``overrides``.

    >>> cfg = load_model_config("llama31_405b", num_layers=2, vocab_size=512)

    Raises ``ValueError`` listing the available names for an unknown ``name``.
    """
    import yaml

    path = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_model_configs())}")
    with open(path, encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    values.update(overrides)
    return ModelConfig.from_dict(values)
