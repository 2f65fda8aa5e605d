"""Llama 3 and a DeepSeek-V3-style mixture of experts, in plain PyTorch.

The module tree uses the names the precision policy recognises (``nemo_fp8_recipes.policy``)::

    tok_embeddings                      nn.Embedding                 BF16 (embedding)
    layers.<i>.attention_norm           RMSNorm                      FP32 compute
    layers.<i>.attention.wq|wk|wv|wo    nn.Linear (no bias)          FP8 (attention projections)
                     .wqkv              (model.fused_projections: q, k, v stacked)
    layers.<i>.attention  -> SDPA       scaled_dot_product_attention BF16 (attention core)
    layers.<i>.ffn_norm                 RMSNorm                      FP32 compute
    layers.<i>.ffn_outliers             OutlierGain (stress only)    FP32 element-wise gain
    layers.<i>.feed_forward.w1|w3|w2    nn.Linear (gate, up, down)   FP8 (MLP)
                           .w13         (model.fused_projections: gate, up stacked)
    layers.<i>.feed_forward.router      nn.Linear d -> experts       FP32 (MoE gate)
    layers.<i>.feed_forward.experts     GroupedExperts (3-D weights) FP8 (grouped experts)
    layers.<i>.feed_forward.shared_expert.w1|w3|w2                   FP8 (shared expert)
    norm                                RMSNorm                      FP32 compute
    output                              nn.Linear (untied)           BF16 GEMM, FP32 logits

Parameters are FP32 (the master weights); the trainer runs the forward under BF16 autocast on
GPU, and ``convert_model`` swaps the FP8-eligible linears for FP8 ones. Everything precision
sensitive is explicit here: RMSNorm and RoPE compute in FP32, the router upcasts its input and
weight and disables autocast, and the logits are cast to FP32 before the loss.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention`` with
``enable_gqa`` so the GPU picks the flash / cuDNN kernels and K/V are never materialised per
query head. The MoE's routed experts are one module with 3-D weights in Hugging Face
transformers 5's layout (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``), so
``convert_model`` runs them as it runs a transformers Mixtral's or DeepSeek-V3's: one
:class:`~nemo_fp8_recipes.nn.Float8GroupedExperts`, every expert GEMM in FP8. In high precision
they are written for clarity: tokens sorted by expert, a loop over experts, an ``index_add_``
scatter (fine for the small models it exists for; it exercises the router policy and the grouped
FP8 GEMMs, not expert-parallel speed).
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn.grouped import Float8GroupedExperts, experts_forward
from ..nn.norm import rms_norm
from ..options import default_kernel_options
from .config import ModelConfig

__all__ = [
    "RMSNorm",
    "Attention",
    "FeedForward",
    "OutlierGain",
    "GroupedExperts",
    "init_expert_weights",
    "MoE",
    "TransformerBlock",
    "Transformer",
    "ModelOutput",
    "precompute_rope",
    "apply_rope",
    "fuse_projections_state_dict",
]


class ModelOutput(NamedTuple):
    """What :meth:`Transformer.forward` returns.

    ``logits`` are FP32. With targets: ``ce_loss`` is the language-model cross entropy (what is
    logged and compared across recipes), ``aux_loss`` the raw MoE load-balancing loss (0 for a
    dense model) and ``loss = ce_loss + aux_loss_coef * aux_loss`` what to back-propagate.
    """

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    ce_loss: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in FP32 whatever the input dtype (output in input dtype).
    In eager mode on CUDA one fused Triton pass (:func:`nemo_fp8_recipes.nn.norm.rms_norm`) unless
    its ``kernel_options`` (:class:`~nemo_fp8_recipes.options.KernelOptions`; set for the whole
    model by :func:`~nemo_fp8_recipes.nn.apply_kernel_options`) turn ``fused_norm`` off."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel_options = default_kernel_options()

    def forward(self, x: torch.Tensor, consumer: Optional[nn.Module] = None) -> torch.Tensor:
        """Normalise the last dim of ``x``. ``consumer``: the (first) linear that reads the
        result — an FP8 linear's input quantisation can then start inside the norm's pass
        (RMSNorm → quantise); the result is the same either way."""
        return rms_norm(x, self.weight, self.eps, consumer, self.kernel_options)

    def reset_parameters(self) -> None:
        """Weights to one."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _llama31_scale_freqs(freqs: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1 long-context RoPE scaling (from Meta's reference implementation)."""
    factor = float(cfg.rope_scaling_factor)
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_seq_len
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def precompute_rope(cfg: ModelConfig, device=None) -> torch.Tensor:
    """RoPE table ``[max_seq_len, head_dim // 2, 2]`` holding (cos, sin), FP32, θ = rope_theta."""
    hd = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd))
    if cfg.rope_scaling_factor:
        freqs = _llama31_scale_freqs(freqs, cfg)
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, Dh]`` by ``rope`` ``[T, Dh/2, 2]`` in FP32 (Meta's interleaved
    pairs: (x0, x1), (x2, x3), ...); returns ``x``'s dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos = rope[None, :, None, :, 0]
    sin = rope[None, :, None, :, 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention: ``wq/wk/wv/wo`` projections (no bias), or ``wqkv`` and
    ``wo`` with ``model.fused_projections`` (q, k, v stacked in that order along the output
    dimension), RoPE, and the attention core through SDPA (BF16 under autocast; never an FP8
    GEMM)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fused = cfg.fused_projections
        if self.fused:
            self.qkv_split = (q_dim, kv_dim, kv_dim)
            self.wqkv = nn.Linear(cfg.dim, q_dim + 2 * kv_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q_dim, bias=False)
            self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
            self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False)

    @property
    def input_projection(self) -> nn.Module:
        """The first projection that reads the block's normalised input (``wqkv`` or ``wq``): the
        consumer the fused norm starts quantising for."""
        return self.wqkv if self.fused else self.wq

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, dim]`` -> ``[B, T, dim]``."""
        bsz, seqlen, _ = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).split(self.qkv_split, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.reshape(bsz, seqlen, self.num_heads, self.head_dim)
        k = k.reshape(bsz, seqlen, self.num_kv_heads, self.head_dim)
        v = v.reshape(bsz, seqlen, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if v.dtype != q.dtype:  # FP8 / autocast paths can leave V in another dtype than Q, K
            v = v.to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        o = o.transpose(1, 2).reshape(bsz, seqlen, self.num_heads * self.head_dim)
        return self.wo(o)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` with ``w1`` = gate, ``w3`` = up, ``w2`` = down; with
    ``fused=True`` one ``w13`` projection holds the gate rows, then the up rows."""

    def __init__(self, dim: int, hidden_dim: int, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        # (registration order = initialisation order: w1, w2, w3 as always, so seeds keep their models)
        if fused:
            self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
            self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden_dim, bias=False)
            self.w2 = nn.Linear(hidden_dim, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    @property
    def input_projection(self) -> nn.Module:
        """The first projection that reads the MLP's input (``w13`` or ``w1``)."""
        return self.w13 if self.fused else self.w1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to the last dim. An FP8 down projection that fuses the SwiGLU
        (``Float8Linear.fuses_swiglu``; eager, on by default) gets the halves unmultiplied, ``w2(u, gate=g)``, so
        the activation is computed inside its quantisation — its forward hooks then see ``u``
        (and ``gate`` in the keyword arguments) instead of the activation; otherwise ``w2`` is
        called with the activation as usual. The halves of ``w13``'s output are strided views,
        which that kernel does not take: fused projections materialise the activation in eager
        mode (under ``torch.compile`` Inductor fuses it either way)."""
        if self.fused:
            g, u = self.w13(x).chunk(2, dim=-1)
        else:
            g, u = self.w1(x), self.w3(x)
        fuses = getattr(self.w2, "fuses_swiglu", None)
        if fuses is not None and fuses(g, u):
            return self.w2(u, gate=g)
        return self.w2(F.silu(g) * u)


class OutlierGain(nn.Module):
    """Outlier stress for numerics studies (``model.outlier_channels``, off by default).

    Multiplies the channels ``cfg.outlier_channel_ids`` of its input by ``cfg.outlier_scale``
    (FP32 element-wise, in the input's dtype). Placed on the SwiGLU input (the ``ffn_norm``
    output that ``w1`` and ``w3`` consume), it gives every token a few channels that are orders
    of magnitude above the rest — the "massive activation" pattern of trained LLMs — so a
    per-tensor FP8 scale is set by the outliers and the bulk of the tensor lands in E4M3's
    subnormal range, while 1x128 / 1x32 groups without an outlier keep their own scale. The
    gain is a fixed buffer, not a parameter; the model can still adapt around it (``ffn_norm``
    weights, ``w1``/``w3`` columns). In an MoE layer the same tensor also feeds the router. The
    gain is in the state dict, so checkpoints of stressed and unstressed models never load into
    each other.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.channels = list(cfg.outlier_channel_ids)
        self.scale = float(cfg.outlier_scale)
        self.register_buffer("gain", torch.empty(cfg.dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gain 1 everywhere, ``outlier_scale`` on the outlier channels (also after ``to_empty``)."""
        self.gain.fill_(1.0)
        self.gain[self.channels] = self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x * gain`` along the last dim."""
        return (x.float() * self.gain.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, scale={self.scale:g}"


@torch.no_grad()
def init_expert_weights(experts: nn.Module, std: float, out_std: float) -> None:
    """Initialise grouped experts (a :class:`GroupedExperts` or its FP8 form) as the model
    initialises linears: Normal(0, std) for ``gate_up_proj`` (the gate and up projections),
    Normal(0, out_std) for ``down_proj`` (a residual-branch output, like ``w2``)."""
    nn.init.normal_(experts.gate_up_proj, mean=0.0, std=std)
    nn.init.normal_(experts.down_proj, mean=0.0, std=out_std)


class GroupedExperts(nn.Module):
    """The routed experts of an MoE layer as one module with 3-D weights, in Hugging Face
    transformers 5's layout (``MixtralExperts``, ``DeepseekV3Experts``): ``gate_up_proj [E, 2F, D]``
    holds expert ``e``'s gate (``w1``) rows then its up (``w3``) rows, ``down_proj [E, D, F]`` its
    down projection (``w2``); SwiGLU, no bias. ``convert_model`` turns it into a
    :class:`~nemo_fp8_recipes.nn.Float8GroupedExperts` sharing the Parameters, whose forward
    computes the same with every expert GEMM in FP8."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.act_fn = F.silu
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert's weights as ``nn.Linear`` initialises its own, U(-1/sqrt(in), 1/sqrt(in)),
        so the module is usable on its own; :meth:`Transformer.init_weights` then draws the
        model's init (:func:`init_expert_weights`)."""
        for w in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def grouped_mm(self, name: str, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """``x [T, in]`` (rows sorted by expert, ``sizes[e]`` rows for expert ``e``) times
        ``weight[e]ᵀ`` per expert for the 3-D weight ``name``: ``[T, out]``.

        In BF16 (the weights, or autocast's dtype where autocast is on, as ``F.linear`` would
        run) one grouped GEMM, ``F.grouped_mm``: on Hopper and Blackwell PyTorch's BF16 grouped
        kernel, 2.5× one ``F.linear`` per expert at Mixtral widths (docs/performance.md); on the
        CPU PyTorch's loop over the experts, the same bits as ``F.linear``. In other dtypes
        (PyTorch's grouped GEMM traces only BF16 under ``torch.compile``), or where a row's width
        in bytes is not a multiple of 16 (the grouped kernel's alignment): one ``F.linear`` per
        expert, the same product."""
        w = getattr(self, name)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        aligned = all(n * w.element_size() % 16 == 0 for n in w.shape[1:])
        if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not aligned:
            return torch.cat([F.linear(xe, w[e]) for e, xe in enumerate(x.split(list(sizes)))])
        offs = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=x.device)
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``hidden_states [N, dim]``, each token's experts ``top_k_index [N, k]`` and routing
        weights ``top_k_weights [N, k]`` -> ``sum_s weight[s] * expert[index[s]](x)`` per token,
        in ``hidden_states``' dtype (the routing weights multiply in their own precision, FP32):
        the routing of :func:`~nemo_fp8_recipes.nn.grouped.experts_forward`, which the FP8 form
        shares, over :meth:`grouped_mm`."""
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        e, f2, d = self.gate_up_proj.shape
        return f"experts={e}, dim={d}, hidden_dim={f2 // 2}"


class MoE(nn.Module):
    """DeepSeek-V3-style mixture of experts: shared expert(s) + top-k routed experts.

    The gate (``router``, an ``nn.Linear`` d -> num_experts) runs in FP32 with autocast off;
    scores are ``softmax`` or ``sigmoid`` of the logits; the top-k scores are renormalised
    (``norm_topk_prob``) and multiplied by ``route_scale``. The routed experts are one
    :class:`GroupedExperts`; their outputs are combined with the FP32 routing weights in the
    residual stream's precision (FP32). The switch-style load-balancing loss
    ``E · Σ_j f_j · P_j`` (f_j = share of routed slots given to expert j, P_j = its mean score) is
    returned raw; the model weights it by ``aux_loss_coef``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.moe_top_k
        self.score_func = cfg.router_score
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = cfg.route_scale
        self.compute_aux = cfg.aux_loss_coef > 0
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        fused = cfg.fused_projections
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared_expert = (
            FeedForward(cfg.dim, cfg.moe_ffn_dim * cfg.num_shared_experts, fused)
            if cfg.num_shared_experts > 0
            else None
        )

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP32 gate for tokens ``x`` ``[N, dim]``: ``(weights [N, k], expert ids [N, k],
        scores [N, E])``, all FP32."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x32 = x.float()
            w = self.router.weight
            if w.dtype == torch.float32:
                logits = self.router(x32)  # through the module, so hooks and audits see it
            else:  # parameters cast to a low precision: upcast explicitly
                logits = F.linear(x32, w.float())
            logits = logits.float()
            scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
            top_w, top_i = scores.topk(self.top_k, dim=-1)
            if self.norm_topk_prob and self.top_k > 1:
                top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(1e-20)
            top_w = top_w * self.route_scale
        return top_w, top_i, scores

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, dim]`` -> (output ``[B, T, dim]``, raw aux loss scalar)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        top_w, top_i, scores = self.route(xf)
        out = self.experts(xf, top_i, top_w).float()  # (combined in xf's dtype: FP32, the residual stream's)
        if self.shared_expert is not None:
            out = out + self.shared_expert(xf).float()
        if self.compute_aux and self.training:
            counts = torch.zeros(self.num_experts, device=x.device, dtype=torch.float32)
            counts.scatter_add_(0, top_i.reshape(-1), torch.ones_like(top_i, dtype=torch.float32).reshape(-1))
            frac = counts / top_i.numel()
            probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
            aux = self.num_experts * (frac * probs.mean(0)).sum()
        else:
            aux = torch.zeros((), device=x.device, dtype=torch.float32)
        return out.to(x.dtype).view(shape), aux


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h))``
    (``ffn(ffn_outliers(ffn_norm(h)))`` under the outlier stress, ``model.outlier_channels``)."""

    def __init__(self, layer_id: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_outliers = OutlierGain(cfg) if cfg.outlier_channels else None
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.feed_forward = MoE(cfg) if self.is_moe else FeedForward(cfg.dim, cfg.ffn_dim, cfg.fused_projections)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden states, raw MoE aux loss or 0)."""
        h = x + self.attention(self.attention_norm(x, consumer=self.attention.input_projection), rope)
        if self.ffn_outliers is not None:  # outlier stress on the SwiGLU input
            z = self.ffn_outliers(self.ffn_norm(h))
        else:
            z = self.ffn_norm(h, consumer=None if self.is_moe else self.feed_forward.input_projection)
        if self.is_moe:
            f, aux = self.feed_forward(z)
        else:
            f = self.feed_forward(z)
            aux = torch.zeros((), device=x.device, dtype=torch.float32)
        return h + f, aux


class Transformer(nn.Module):
    """Llama 3 decoder (dense) or DeepSeek-style MoE decoder, by ``cfg.arch``.

    Build big shapes on the meta device to count parameters without memory::

        with torch.device("meta"):
            model = Transformer(load_model_config("llama3_70b"))
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, cfg) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, rebuilt on load, kept out of checkpoints.
        self.register_buffer("rope_cache", precompute_rope(cfg), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for embeddings, linears and experts, residual-branch outputs
        (``wo``, ``w2``, the experts' ``down_proj``) scaled by ``1/sqrt(2·num_layers)`` (GPT-2),
        norms to one, outlier-stress gains to their values; rebuilds the RoPE table (use after
        ``to_empty`` when materialising a meta-device model)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, m in self.named_modules():
            if isinstance(m, (GroupedExperts, Float8GroupedExperts)):
                init_expert_weights(m, std, out_std)
            elif isinstance(m, nn.Linear):
                leaf = name.rsplit(".", 1)[-1]
                nn.init.normal_(m.weight, mean=0.0, std=out_std if leaf in ("wo", "w2") else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, (RMSNorm, OutlierGain)):
                m.reset_parameters()
        self.rope_cache = precompute_rope(self.config, device=self.rope_cache.device)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> ModelOutput:
        """``tokens`` ``[B, T]`` int64 -> :class:`ModelOutput` (FP32 logits ``[B, T, vocab]``;
        losses when ``targets`` ``[B, T]`` are given; target ``-100`` is ignored)."""
        seqlen = tokens.shape[1]
        if seqlen > self.rope_cache.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len={self.rope_cache.shape[0]}")
        rope = self.rope_cache[:seqlen].float()
        h = self.tok_embeddings(tokens)
        aux_total = torch.zeros((), device=h.device, dtype=torch.float32)
        for layer in self.layers:
            h, aux = layer(h, rope)
            aux_total = aux_total + aux
        logits = self.output(self.norm(h)).float()
        if targets is None:
            return ModelOutput(logits)
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        loss = ce + self.config.aux_loss_coef * aux_total if self.config.aux_loss_coef else ce
        return ModelOutput(logits, loss, ce, aux_total)

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters of the built model (works on the meta device)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_embedding else n - self.tok_embeddings.weight.numel()


def fuse_projections_state_dict(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, fused: bool
) -> Dict[str, torch.Tensor]:
    """A :class:`Transformer` state dict in the other projection layout (``model.fused_projections``).

    ``fused=True`` stacks every ``attention.wq/wk/wv.weight`` into ``attention.wqkv.weight`` and
    every ``w1/w3.weight`` (gate, up) into ``w13.weight``; ``fused=False`` splits them back, with
    the widths of ``cfg``. Everything else is passed through, so the result loads with
    ``load_state_dict(strict=True)`` into the model of the other layout and computes the same
    function. Takes the plain model's state dict (before ``convert_model``). Raises ``KeyError``
    naming a projection whose partners are missing."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # (separate projections in stacking order, fused name, split widths or None for halves,
    # whether they sit under an ``attention`` module: the MLP's under feed-forwards and experts)
    layouts = (
        (("wq", "wk", "wv"), "wqkv", (q_dim, kv_dim, kv_dim), True),
        (("w1", "w3"), "w13", None, False),
    )
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        base, _, rest = key.rpartition(".")
        prefix, _, name = base.rpartition(".")
        prefix = f"{prefix}." if prefix else ""
        for parts, joined, widths, attention in layouts:
            if rest != "weight" or attention != prefix.endswith("attention."):
                continue
            if fused and name in parts:
                keys = [f"{prefix}{p}.weight" for p in parts]
                missing = [k for k in keys if k not in state]
                if missing:
                    raise KeyError(f"{missing[0]}: needed with {key} to build {prefix}{joined}.weight")
                if name == parts[0]:
                    out[f"{prefix}{joined}.weight"] = torch.cat([state[k] for k in keys], 0)
                break
            if not fused and name == joined:
                sizes = widths or (value.shape[0] // 2,) * 2
                for p, chunk in zip(parts, value.split(sizes, 0)):
                    out[f"{prefix}{p}.weight"] = chunk.clone()
                break
        else:
            out[key] = value
    return out
