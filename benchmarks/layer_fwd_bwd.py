"""A full Llama 3 transformer layer (or its MLP) forward + backward: our FP8 recipes vs BF16 vs
torchao, eager and ``torch.compile``, one run.

    python benchmarks/layer_fwd_bwd.py --block layer --sizes 8b,70b,405b --out results/layer.json
    python benchmarks/layer_fwd_bwd.py --block mlp   --sizes 8b,70b,405b --out results/mlp.json

``--block layer``: the package's own ``TransformerBlock`` (``nemo_fp8_recipes.models.llama``):
RMSNorm (FP32), grouped-query attention with RoPE and BF16 SDPA (causal), SwiGLU MLP;
``--block mlp``: its ``FeedForward`` alone (``w2(silu(w1 x) * w3 x)``, e.g. 4096 -> 14336 -> 4096
at 8B). Shapes come from ``configs/model/`` (8b = llama3_8b, 70b = llama3_70b, 405b =
llama31_405b), sequence ``--seq`` 8192, micro-batch ``--batch`` 1. The module sits under the
names the full model gives it (``layers.0.attention.wq``, ``layers.0.feed_forward.w1``, ...).

Variants (``--variants``): ``bf16`` (BF16 autocast); ``tensorwise``, ``delayed``, ``blockwise``
(and ``mxfp8``, skipped with ``check_supported``'s reason where the GPU lacks it): the block
converted by ``convert_model`` with the default precision policy (attention projections and MLP
in FP8; norms and the attention core in BF16/FP32); ``torchao-tensorwise``,
``torchao-rowwise``: the same block converted by torchao's ``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name(...)``, filtered by the same policy so the same linears are
FP8 (rows say ``skipped: torchao not installed`` without torchao). Compiled, our tensorwise and
blockwise linears quantise with the fused Triton kernels as custom operators
(``nemo_fp8_recipes.quant.ops``; blockwise's block-scaled GEMM is one too);
``tensorwise-inductor`` / ``blockwise-inductor`` are the same recipes with
``KernelOptions(triton=False)`` (the reference quantisers, generated and fused by Inductor).
``tensorwise-unfused-swiglu`` / ``delayed-unfused-swiglu``: the same recipe with the fused
SwiGLU (on by default in eager mode, ``Float8Linear.fuses_swiglu``) turned off
(``fused_swiglu=False``: the activation is materialised), for an A/B in one run;
``tensorwise-unshared-input``: each FP8 linear quantises its input itself
(``shared_input=False``; by default ``wq/wk/wv`` and ``w1/w3`` share one quantisation of
their common input in eager mode); ``bf16-unfused-norm`` / ``tensorwise-unfused-norm`` /
``blockwise-unfused-norm``: the RMSNorms as PyTorch's FP32 formula (``fused_norm=False``)
instead of the fused norm (eager mode, default on; for FP8 it also starts the q/k/v and gate/up
input quantisation, ``nemo_fp8_recipes.nn.norm``); ``tensorwise-triton-launch`` /
``blockwise-triton-launch``: the Triton quantisers launched through Triton's own
``kernel[grid](...)`` (``fast_launch=False``) instead of the direct launch of their compiled
kernels (``nemo_fp8_recipes.quant.launch``; same kernels, less host time per launch).

``te-bf16``, ``te-tensorwise``, ``te-delayed``, ``te-blockwise``: Transformer Engine's own layer
(``te.TransformerLayer``: RMSNorm fused into the QKV and FC1 projections, SwiGLU, GQA, RoPE,
cuDNN fused attention; ``te.LayerNormMLP`` for ``--block mlp``) with FP32 parameters under
``te.autocast`` with the TE recipe of each key (``nemo_fp8_recipes.to_te_recipe``; ``te-bf16``
with FP8 off). TE's layer always runs eager (torch.compile does not trace TE's modules): in the
compiled round it is timed eagerly, round-robin beside our compiled layer (mode column
``compiled (TE eager)``), which is how each is used in training. ``vs TE (same recipe)`` is TE's
time over ours for the same recipe in the same round (``bf16`` against ``te-bf16``; > 1: ours is
faster). TE re-quantises its weights in every forward, so compare them with ``--requant-weights``
rows of ours. Without TE (or a GPU) the rows say why they were skipped.

``--projections separate,fused``: our layer (and torchao's) as written by default, with separate
q/k/v and gate/up projections as Hugging Face's Llama has them, and with the fused layout
Megatron-Core and TE use (``model.fused_projections``: one ``wqkv``, one ``w13``; rows
``<variant>+fused``, compared with ``bf16+fused`` and ``torchao-tensorwise+fused`` where they ran).
Per-tensor recipes then take one scale for the stacked weight, as TE's fused projection does.

As the package's trainer runs a layer: FP32 parameters (the master weights) under BF16 autocast,
and an FP32 residual stream (the embedding output is not autocast), so the block's input is FP32
unless ``--input-dtype bf16``; gradients are set to None before every step (``zero_grad``). In
eager mode our FP8 weight copies are quantised once and cached, as between optimizer steps
(torchao casts its weights in every forward); ``--requant-weights`` re-quantises them every step
instead (one micro-batch per optimizer step). Compiled, the traced FP8 linear (tensorwise,
blockwise, mxfp8) quantises its weight in every forward, as torchao does, and so does the traced
delayed linear (with the step's scale). Delayed scaling runs the trainer's ``step`` schedule:
scales fixed within an optimizer step, ``sync_delayed_scaling`` (one vectorised history update
for the block) at the start of every optimizer step, inside the timed step.
``--micro-batches K``: K micro-batches per optimizer step — our FP8 weights are re-quantised
every K-th step, and the compiled FP8 linears read them from their compiled weight cache
(``set_graph_weight_cache``, what the trainer turns on with
``trainer.compile=true`` and gradient accumulation) instead of quantising them in the graph;
torchao still casts its weights in every forward. Peak memory is
``torch.cuda.max_memory_allocated`` after a reset, per
variant and mode, with the model, its gradients and the shared inputs (``--input-sets`` rotating
sets) allocated. A 405B layer is 3.19e9 parameters: 11.9 GiB FP32 + 11.9 GiB FP32 gradients +
~6 GiB BF16/FP8 weight copies + activations — under 60 GiB, so FP32 master weights fit the H200
(AdamW state, not allocated here, would add 23.8 GiB).

Median of ``--iters`` steps after ``--warmup`` (CUDA events, a synchronisation after every step,
so each step also pays the host's latency before its first kernel); "back to back": the median
per-step time of windows of ``--window`` steps queued without synchronising in between, as a
training loop runs them; during each, the GPU's SM clock, power draw and clock-event reasons
(power cap, thermal) are sampled through NVML (``nvidia-ml-py``; JSON ``gpu`` / ``gpu_b2b``).
The first call (compilation included) is reported separately. ``--rounds N`` (N > 1) sets up
every variant of a size first (compiled, warmed up, all kept allocated), then times them
round-robin, N passes each timing every variant in turn, so the GPU's clock drift over the run
hits all of them alike: the GPU then runs at its sustained power draw throughout, as in training,
rather than recovering while the next variant compiles (measured on the H200: 530-690 W in every
variant's timing, against 200-460 W for some variants timed one after the other). ``compiled`` =
``torch.compile(block, dynamic=False)`` (``--compile-mode reduce-overhead``: its graphs replayed as CUDA graphs); our
current-scaling FP8 linears are traced there (no graph break: the quantisers and the
block-scaled GEMM are custom operators, or with ``-inductor`` Inductor generates the quantisers
from the reference and fuses them with the neighbouring ops), and so are the delayed-scaling ones
(their casts take the step's scales); the ``graph_breaks`` column counts the breaks dynamo
reported while compiling the variant (0 = one graph). Ratios are within one size and mode:
speed-up over BF16, and
"vs torchao tw" = torchao tensorwise ms / this variant's ms (> 1: faster than torchao). Results
are rewritten to ``--out`` after every variant, so a run cut short keeps what it measured.
``--cuda-graph``: every variant's whole step is also captured as CUDA graphs (one per input
set, one memory pool, after its peak memory is read) and its replays timed with the other two
timings — the GPU's time alone, without the host's launch and Python time ("CUDA graph"
columns); with ``--micro-batches K`` the compiled weight cache is re-quantised in place before
every K-th replay (a variant whose FP8 weights cannot be refreshed in place is reported as not
captured, with the reason). ``--energy SECONDS``: afterwards each step (and replay) runs back to
back for about SECONDS, round-robin twice, between two refreshes of the board's energy counter
(NVML; ``profiling.nvml.energy_window``): joules per step, mean draw, SM clock — at the power
cap a step's time is its joules over the cap. ``--breakdown`` and ``--peak-report`` use
``profiling.timeline`` and ``profiling.memory``.
``--smoke``: tiny emulated CPU run for CI (compiled with ``aot_eager``; no timing claims).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import traceback
import types

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    bench_interleaved,
    bench_one,
    bench_samples,
    benchmark_device,
    capture_graphs,
    error_status,
    fmt,
    fmt_tflops,
    free_memory,
    gpu_cell,
    gpu_monitor,
    graph_replay,
    recipe_mode,
    table,
    write_json,
)
from _torchao import RECIPES as TORCHAO_RECIPES  # noqa: E402
from _torchao import convert_torchao, torchao_status  # noqa: E402

from nemo_fp8_recipes.config import COMPILE_MODES, CUDA_GRAPH_MODES  # noqa: E402
from nemo_fp8_recipes.models import load_model_config  # noqa: E402
from nemo_fp8_recipes.models.llama import FeedForward, TransformerBlock, precompute_rope  # noqa: E402
from nemo_fp8_recipes.nn import (  # noqa: E402
    Float8Linear,
    apply_kernel_options,
    convert_model,
    invalidate_weight_cache,
    set_delayed_scaling_update,
    set_graph_weight_cache,
    sync_delayed_scaling,
)
from nemo_fp8_recipes.options import KernelOptions  # noqa: E402
from nemo_fp8_recipes.policy import PrecisionPolicy  # noqa: E402
from nemo_fp8_recipes.quant.launch import set_fast_launch  # noqa: E402
from nemo_fp8_recipes.recipes import get_recipe  # noqa: E402

MODELS = {"8b": "llama3_8b", "70b": "llama3_70b", "405b": "llama31_405b"}
TORCHAO = {f"torchao-{r}": r for r in TORCHAO_RECIPES}
#: A/B partners of a recipe, each with one kernel option off (:class:`KernelOptions`; every other
#: variant runs with all options on, whatever the environment says):
#: ``<recipe>-inductor``: ``triton=False`` (compiled mode: the reference quantisers generated and
#: fused by Inductor instead of the Triton custom operators);
#: ``<recipe>-unfused-swiglu``: ``fused_swiglu=False`` (eager mode: the SwiGLU activation
#: materialised; by default the down projection gets the halves, delayed scaling computes the
#: activation inside its one-pass quantiser and both recipes fuse the SwiGLU backward into one kernel);
#: ``tensorwise-unshared-input``: ``shared_input=False`` (eager mode: every FP8 linear quantises its
#: input itself; by default wq/wk/wv and w1/w3 share one quantisation);
#: ``<recipe>-unfused-norm``: ``fused_norm=False`` (eager mode: the RMSNorms run PyTorch's FP32
#: formula; by default one Triton pass, which also takes the amax / the row codes of its output for
#: the FP8 q/k/v and gate/up projections);
#: ``<recipe>-triton-launch``: ``fast_launch=False`` (Triton's own ``kernel[grid](...)`` launch).
OPTION_VARIANTS = {
    "tensorwise-inductor": ("tensorwise", {"triton": False}),
    "blockwise-inductor": ("blockwise", {"triton": False}),
    "tensorwise-unfused-swiglu": ("tensorwise", {"fused_swiglu": False}),
    "delayed-unfused-swiglu": ("delayed", {"fused_swiglu": False}),
    "tensorwise-unshared-input": ("tensorwise", {"shared_input": False}),
    "bf16-unfused-norm": ("bf16", {"fused_norm": False}),
    "tensorwise-unfused-norm": ("tensorwise", {"fused_norm": False}),
    "blockwise-unfused-norm": ("blockwise", {"fused_norm": False}),
    "tensorwise-triton-launch": ("tensorwise", {"fast_launch": False}),
    "blockwise-triton-launch": ("blockwise", {"fast_launch": False}),
}
VARIANT_RECIPE = {v: r for v, (r, _) in OPTION_VARIANTS.items()}  # variant -> its recipe


#: the suffix of a variant built with ``model.fused_projections`` (one ``wqkv`` and one ``w13``
#: projection, as Megatron-Core and TE lay them out; ``--projections fused``)
FUSED = "+fused"


def split_variant(variant: str):
    """``(base variant, fused projections?)``: ``"tensorwise+fused"`` -> ``("tensorwise", True)``."""
    if variant.endswith(FUSED):
        return variant[: -len(FUSED)], True
    return variant, False


def variant_options(variant: str) -> KernelOptions:
    """The kernel options ``variant`` runs with: all on, but its own A/B change."""
    return KernelOptions().replace(**OPTION_VARIANTS.get(split_variant(variant)[0], (None, {}))[1])


#: Transformer Engine's own layer (``te.TransformerLayer``: RMSNorm fused into its QKV and FC1
#: projections, SwiGLU, GQA, RoPE, cuDNN fused attention) in BF16 and under each Hopper recipe
TE_LAYER = {"te-bf16": "bf16", "te-delayed": "delayed", "te-tensorwise": "tensorwise", "te-blockwise": "blockwise"}
#: TE's layer runs eager in every round (torch.compile does not trace Transformer Engine's modules
#: and refuses DelayedScaling; its fused kernels are TE's own): in a compiled round it is timed
#: eagerly beside our compiled layer, round-robin, and its rows say ``ran: eager``
TE_EAGER_NOTE = "TE eager"
#: variants that only differ from their recipe in eager mode, with the reason their compiled row
#: is skipped
_SWIGLU_EAGER = (
    "the SwiGLU fusion is eager-only, so compiled this is the recipe's own row (Inductor fuses "
    "SiLU and the product itself)"
)
_SHARE_EAGER = (
    "the shared input quantisation is eager-only, so compiled this is the recipe's own row (the "
    "compiler de-duplicates the quantisations itself)"
)
_NORM_EAGER = (
    "the fused RMSNorm is eager-only, so compiled this is the recipe's own row (Inductor fuses the norm itself)"
)
EAGER_ONLY = {
    "tensorwise-unfused-swiglu": _SWIGLU_EAGER,
    "delayed-unfused-swiglu": _SWIGLU_EAGER,
    "tensorwise-unshared-input": _SHARE_EAGER,
    "bf16-unfused-norm": _NORM_EAGER,
    "tensorwise-unfused-norm": _NORM_EAGER,
    "blockwise-unfused-norm": _NORM_EAGER,
}


def compiled_skip(variant: str):
    """The status of ``variant``'s compiled row when it only differs from its recipe in eager mode
    (``+fused`` included), else None."""
    reason = EAGER_ONLY.get(split_variant(variant)[0])
    return f"skipped: {reason}" if reason else None


VARIANTS = [
    "bf16",
    "bf16-unfused-norm",
    "tensorwise",
    "tensorwise-inductor",
    "tensorwise-unfused-swiglu",
    "tensorwise-unshared-input",
    "tensorwise-unfused-norm",
    "delayed",
    "delayed-unfused-swiglu",
    "blockwise",
    "blockwise-inductor",
    "blockwise-unfused-norm",
    "tensorwise-triton-launch",
    "blockwise-triton-launch",
    "mxfp8",
    *TORCHAO,
    *TE_LAYER,
]
DEFAULT_VARIANTS = "bf16,tensorwise,delayed,blockwise,torchao-tensorwise,torchao-rowwise"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OneLayer(nn.Module):
    """One decoder layer (``block="layer"``) or its MLP (``"mlp"``) under the fully qualified
    names of the full model (``layers.0.*``), so the precision policy decides as in training."""

    def __init__(self, cfg, block: str) -> None:
        super().__init__()
        self.block = block
        if block == "layer":
            layer = TransformerBlock(0, cfg)
        else:
            layer = nn.Module()
            layer.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.layers = nn.ModuleList([layer])
        self.register_buffer("rope", precompute_rope(cfg), persistent=False)
        with torch.no_grad():  # the trainer's init (Transformer.init_weights)
            for name, m in self.named_modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, dim]`` -> ``[B, T, dim]``."""
        layer = self.layers[0]
        if self.block == "layer":
            return layer(x, self.rope[: x.shape[1]])[0]
        return layer.feed_forward(x)


def model_flops(cfg, block: str, tokens: int, seq: int) -> float:
    """FLOPs of one forward + backward: ``6 · linear params · tokens`` plus, for the layer, the
    attention core ``12 · heads · head_dim · seq`` per token (PaLM convention, no causal halving,
    as the trainer's MFU)."""
    mlp = 3 * cfg.dim * cfg.ffn_dim
    if block == "mlp":
        return 6.0 * mlp * tokens
    lin = mlp + 2 * cfg.dim * cfg.num_heads * cfg.head_dim + 2 * cfg.dim * cfg.num_kv_heads * cfg.head_dim
    return tokens * (6.0 * lin + 12.0 * cfg.num_heads * cfg.head_dim * seq)


def policy_filter(policy: PrecisionPolicy, num_layers: int = 1):
    """torchao's ``module_filter_fn``: exactly the linears our policy puts in FP8 (checked with the
    per-tensor recipe's alignment, as torchao needs dims divisible by 16)."""
    pol = policy.with_num_layers(num_layers)
    r = get_recipe("tensorwise")

    def fn(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and pol.decide(fqn, mod, recipe=r).fp8

    return fn


class TELayer(nn.Module):
    """``te.TransformerLayer`` for one Llama 3 layer (or ``te.LayerNormMLP`` for ``--block mlp``)
    with FP32 parameters, run under ``te.autocast`` with the TE recipe of ``key`` (``bf16``: TE's
    BF16 path, FP8 off). TE re-quantises its weights in every forward (no ``is_first_microbatch``),
    so each step pays the weight casts, as ``--requant-weights`` makes ours do. Input ``[B, T,
    dim]`` (``attn_input_format="bshd"``); RoPE from TE's own ``RotaryPositionEmbedding``."""

    def __init__(self, cfg, block: str, key: str, seq: int) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        from nemo_fp8_recipes.integrations.te import prepare_te_env

        self.key, self.block = key, block
        if key != "bf16":
            prepare_te_env(key)
        common = dict(
            params_dtype=torch.float32,
            bias=False,
            init_method=self._init(cfg.init_std),
            output_layer_init_method=self._init(cfg.init_std),
        )
        if block == "layer":
            self.layer = te.TransformerLayer(
                hidden_size=cfg.dim,
                ffn_hidden_size=cfg.ffn_dim,
                num_attention_heads=cfg.num_heads,
                num_gqa_groups=cfg.num_kv_heads,
                layernorm_epsilon=cfg.norm_eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                normalization="RMSNorm",
                activation="swiglu",
                attn_input_format="bshd",
                fuse_qkv_params=True,
                layer_number=1,
                **common,
            )
            rope = te.attention.RotaryPositionEmbedding(cfg.head_dim, rotary_base=cfg.rope_theta)
            self.register_buffer("freqs", rope(seq), persistent=False)
        else:
            self.layer = te.LayerNormMLP(
                cfg.dim,
                cfg.ffn_dim,
                eps=cfg.norm_eps,
                normalization="RMSNorm",
                activation="swiglu",
                params_dtype=torch.float32,
                bias=False,
                init_method=self._init(cfg.init_std),
                output_layer_init_method=self._init(cfg.init_std),
            )

    @staticmethod
    def _init(std: float):
        return lambda w: nn.init.normal_(w, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from nemo_fp8_recipes.integrations.te import te_autocast

        with te_autocast(self.key if self.key != "bf16" else None, enabled=self.key != "bf16"):
            if self.block == "layer":
                return self.layer(x, rotary_pos_emb=self.freqs[: x.shape[1]])
            return self.layer(x)


def build(cfg, block: str, variant: str, dev: str, smoke: bool, seq: int = 8192) -> nn.Module:
    """The block for ``variant`` on ``dev``, FP32 parameters, converted per variant (a ``+fused``
    variant: the same with ``model.fused_projections``)."""
    variant, fused = split_variant(variant)
    if fused:
        cfg = cfg.replace(fused_projections=True)
    if variant in TE_LAYER:
        with torch.device(dev):
            return TELayer(cfg, block, TE_LAYER[variant], seq)
    with torch.device(dev):
        model = OneLayer(cfg, block)
    policy = PrecisionPolicy()
    if variant in TORCHAO:
        convert_torchao(model, TORCHAO[variant], policy_filter(policy), emulate=smoke)
    if VARIANT_RECIPE.get(variant, variant) != "bf16" and variant not in TORCHAO:
        # (the FP8 linears and the norms: convert_model applies the options to both)
        convert_model(
            model,
            get_recipe(VARIANT_RECIPE.get(variant, variant)),
            policy,
            emulate=True if smoke else None,
            options=variant_options(variant),
        )
        set_delayed_scaling_update(model, "step")  # (delayed scaling: the trainer's schedule)
    else:  # BF16 and torchao: our norms, all options on but the variant's own
        apply_kernel_options(model, variant_options(variant))
    return model


class Inputs:
    """``--input-sets`` rotating block inputs (requiring grad, as inside a model) and output
    gradients, shared by every variant of one size."""

    def __init__(self, cfg, a, dev: str, x_dtype: torch.dtype, y_dtype: torch.dtype) -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (a.batch, a.seq, cfg.dim)
        self.tokens = a.batch * a.seq
        self.n = a.input_sets
        self.xs = [torch.randn(shape, device=dev, generator=g).to(x_dtype).requires_grad_() for _ in range(self.n)]
        self._dys = {y_dtype: [(torch.randn(shape, device=dev, generator=g) * 1e-2).to(y_dtype) for _ in range(self.n)]}
        self._y_dtype = y_dtype

    def grads(self, dtype: torch.dtype):
        """The output gradients in the output's dtype (converted once if a variant differs)."""
        if dtype not in self._dys:
            self._dys[dtype] = [d.to(dtype) for d in self._dys[self._y_dtype]]
        return self._dys[dtype]


def prepare(model: nn.Module, mode: str, inputs: Inputs, a, dev: str, *, reset_dynamo: bool = True):
    """Set ``model`` up for one fwd+bwd step in ``mode`` (eager, or ``torch.compile``) and run its
    first call (compilation included, timed): ``(step, row fields)``; ``step`` is None when that
    failed (an exception, e.g. out of memory, becomes the row's error status). ``reset_dynamo``:
    drop every compiled graph first (False in round-robin runs, whose other variants are kept)."""
    cuda = dev == "cuda"
    params = [q for q in model.parameters() if q.requires_grad]
    out = {"status": "ok", "ms": None, "ms_b2b": None, "first_call_s": None, "peak_gib": None, "graph_breaks": None}
    try:
        for q in params:
            q.grad = None
        if mode == "compiled" and isinstance(model, TELayer):
            fn = model  # (TE's modules run eager; timed beside the compiled variants)
            out["ran"] = "eager"
        elif mode == "compiled":
            # the eager run's cached FP8 weight copies: the traced linears do not use them (they
            # re-quantise in the graph), the eager islands rebuild theirs; left alive they would
            # count in this mode's peak memory (measured: +0.4 GiB at 8B)
            invalidate_weight_cache(model)
            free_memory(dynamo=reset_dynamo)
            # K micro-batches per optimizer step: the traced linears read FP8 weights quantised
            # once per step (set_graph_weight_cache), as the trainer runs them
            set_graph_weight_cache(model, a.micro_batches > 1)
            from torch._dynamo.utils import counters

            counters["graph_break"].clear()
            fn = torch.compile(model, backend=a.compile_backend, dynamic=False, mode=a.compile_mode)
        else:
            fn = model
        if cuda:  # (the peaks of other variants and modes, and of this one's set-up, are behind)
            torch.cuda.reset_peak_memory_stats()

        requant = (a.requant_weights or a.micro_batches > 1) and any(type(m) is Float8Linear for m in model.modules())
        delayed = any(type(m) is Float8Linear and m.recipe.is_delayed for m in model.modules())
        graphs = mode == "compiled" and a.compile_mode in CUDA_GRAPH_MODES
        calls = [0]

        def step(i: int, refresh: bool = True) -> None:
            """One fwd+bwd step on input set ``i``; ``refresh=False``: without the every-K-th-step
            re-quantisation of the FP8 weights (a CUDA graph's capture, which runs it between
            replays instead: :func:`graph_step`)."""
            if graphs:  # CUDA-graph trees: a new training step (the last one's outputs are dead)
                torch.compiler.cudagraph_mark_step_begin()
            x = inputs.xs[i]
            x.grad = None
            for q in params:  # zero_grad(set_to_none=True), as every training step
                q.grad = None
            # the FP8 weights are re-quantised once per optimizer step: every step with one
            # micro-batch per step, every K-th with --micro-batches K
            if refresh:
                new_step = calls[0] % a.micro_batches == 0
                if delayed and new_step:  # the last optimizer step's amaxes into the histories
                    sync_delayed_scaling(model)
                if requant and new_step:
                    invalidate_weight_cache(model)
                calls[0] += 1
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
                y = fn(x)
            y.backward(inputs.grads(y.dtype)[i])

        t0 = time.perf_counter()
        step(0)
        if cuda:
            torch.cuda.synchronize()
        out["first_call_s"] = time.perf_counter() - t0
        if mode == "compiled" and "ran" not in out:
            out["graph_breaks"] = sum(counters["graph_break"].values())
        return step, out
    except Exception as e:  # noqa: BLE001 - record it, go on with the other variants
        traceback.print_exc()
        out.update(status=error_status(e), ms=None)
        for q in params:
            q.grad = None
        return None, out


def take_timings(out: dict, t: dict, dev: str) -> None:
    """A timing's fields (:func:`bench_interleaved`) into a row."""
    out["ms"], out["ms_b2b"], out["gpu"], out["gpu_b2b"] = t["ms"], t["ms_b2b"], t["gpu"], t["gpu_b2b"]
    out["samples"] = t["samples"]
    if t.get("ms_graph") is not None:
        out["ms_graph"] = t["ms_graph"]
    if dev == "cuda" and t["gpu_reason"]:
        out["gpu_reason"] = t["gpu_reason"]


def profile_extras(step, out: dict, inputs: Inputs, a, dev: str, others_bytes: int = 0) -> None:
    """``--peak-report`` and ``--breakdown`` for one prepared variant (after its timings and peak
    memory are read: the profiler's own buffers stay out of them). ``others_bytes``: what the
    other variants of a round-robin run hold, left out of the peak report."""
    cuda = dev == "cuda"
    if a.peak_report and cuda:
        from profiling.memory import peak_memory_report

        out["peak_live"] = peak_memory_report(step, 0, others_bytes=others_bytes)
    if a.breakdown:
        from profiling.timeline import device_time_breakdown, gpu_timeline

        out["breakdown"] = device_time_breakdown(step, inputs.n, cuda=cuda, top=40)
        if cuda:
            out["timeline"] = gpu_timeline(step, inputs.n, steps=4)
            out["timeline_sync"] = gpu_timeline(step, inputs.n, steps=4, sync_each=True)


def measure(model: nn.Module, mode: str, inputs: Inputs, a, dev: str) -> dict:
    """Time one fwd+bwd step of ``model`` (eager or compiled) on its own (``--rounds 1``):
    ``{"status", "ms", "first_call_s", "peak_gib", ...}``; an exception (e.g. out of memory)
    becomes an error status."""
    cuda = dev == "cuda"
    step, out = prepare(model, mode, inputs, a, dev)
    try:
        if step is not None:
            take_timings(
                out,
                bench_one(
                    step,
                    inputs.n,
                    dev,
                    warmup=a.warmup,
                    iters=a.iters,
                    window=a.window,
                    group=a.micro_batches,
                    monitor=gpu_monitor(dev),
                ),
                dev,
            )
            if cuda:
                out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            replay = None
            if a.cuda_graph:  # (after the peak: the graphs' memory pool is not the step's)
                replay = graph_step(step, model, mode, inputs, a, out)
                if replay is not None:  # (whole optimizer steps: K replays per sample)
                    out["ms_graph"] = statistics.median(
                        bench_samples(
                            replay, inputs.n, warmup=2, iters=a.iters, cuda=cuda, window=a.micro_batches, sync_each=True
                        )
                    )
            if a.energy:
                fns = {"step": step, **({"graph": replay} if replay is not None else {})}
                for key, e in measure_energy(fns, inputs, a, dev).items():
                    out["energy" if key == "step" else "energy_graph"] = e
            replay = None
            profile_extras(step, out, inputs, a, dev)
    except Exception as e:  # noqa: BLE001 - record it, go on with the other variants
        traceback.print_exc()
        out.update(status=error_status(e), ms=None)
    finally:
        step = None
        for q in model.parameters():
            q.grad = None
    return out


def measure_energy(fns, inputs: Inputs, a, dev: str, contexts=None) -> dict:
    """``--energy``: :func:`profiling.nvml.energy_window` of ``fns``, or, if that fails (e.g. out of
    memory), an energy record per key with the error as its ``energy_reason`` — the timings stay."""
    from profiling.nvml import energy_window

    try:
        return energy_window(fns, inputs.n, dev, seconds=a.energy, contexts=contexts, group=a.micro_batches)
    except Exception as e:  # noqa: BLE001 - the energy reading fails, not the row
        traceback.print_exc()
        return {
            k: {"ms": None, "j": None, "w": None, "gpu": None, "calls": None, "energy_reason": error_status(e)}
            for k in fns
        }


def graph_step(step, model: nn.Module, mode: str, inputs: Inputs, a, row: dict):
    """``--cuda-graph``: capture ``step`` as one CUDA graph per input set (the whole fwd+bwd:
    forward, backward, the gradients' accumulation; compiled or eager), all from one memory pool,
    and return ``replay(i)``, or None with the reason in ``row["graph_status"]``. With one
    micro-batch per step the weights' re-quantisation is inside the graph; with
    ``--micro-batches K`` (compiled) the graph reads the compiled weight cache, which ``replay``
    re-quantises in place (same buffers) before every K-th replay, as the optimizer step does.
    The GPU's time of the step alone: no host launch or Python time, as a training loop with
    CUDA graphs runs it (Megatron's ``--cuda-graph-impl``, ``torch.compile(mode="reduce-overhead")``)."""
    fp8 = [m for m in model.modules() if type(m) is Float8Linear]
    k = a.micro_batches if fp8 else 1  # (no FP8 weights of ours: nothing re-quantised between replays)
    if k > 1 and not all(m.config.graph_weight_cache and m.traceable() for m in fp8):
        row["graph_status"] = (
            "not captured: with --micro-batches > 1 the FP8 weights are re-quantised between "
            "replays, in place, which only the compiled weight cache of a traced FP8 linear does "
            "(compiled mode, current scaling); an eager cache (eager mode, real MXFP8's island) would "
            "be rebuilt in new memory the graph does not read, and delayed scaling's histories advance "
            "between optimizer steps outside the graph"
        )
        return None
    errors: list = []
    graphs = capture_graphs((lambda i: step(i, refresh=False)) if k > 1 else step, inputs.n, errors, share_pool=True)
    if graphs is None:
        row["graph_status"] = "not captured: " + (errors[0] if errors else "no CUDA device")
        return None
    row["graph_status"] = "ok"
    if k == 1:
        return graph_replay(graphs)
    calls = [0]

    def replay(i: int) -> None:
        if calls[0] % k == 0:  # the optimizer step's re-quantisation, eager, into the same buffers
            invalidate_weight_cache(model)
        calls[0] += 1
        graphs[i].replay()

    return replay


@contextlib.contextmanager
def variant_launch(variant: str):
    """The direct launch of the Triton kernels as ``variant`` runs it (process-wide, so set for
    its turn and restored after)."""
    prev = set_fast_launch(variant_options(variant).fast_launch)
    try:
        yield
    finally:
        set_fast_launch(prev)


def isolate(model: nn.Module, tag: str) -> nn.Module:
    """Give ``model`` a class of its own whose ``forward`` is a new code object, so that
    ``torch.compile`` keeps its compiled graphs apart from every other variant's: dynamo keeps one
    cache per code object (8 entries by default), which all variants of a size would otherwise
    share, and two variants that differ only in a setting read while tracing
    (``KernelOptions.triton``, ...) would share a graph if dynamo's guards missed the option."""
    cls = type(model)
    fwd = cls.forward
    name = f"forward_{''.join(c if c.isalnum() else '_' for c in tag)}"
    renamed = {"co_name": name}
    if sys.version_info >= (3, 11):  # (code objects have a qualified name from 3.11 on)
        renamed["co_qualname"] = f"{cls.__name__}.{name}"
    code = fwd.__code__.replace(**renamed)
    new_fwd = types.FunctionType(code, fwd.__globals__, name, fwd.__defaults__, fwd.__closure__)
    model.__class__ = type(f"{cls.__name__}_{name[8:]}", (cls,), {"forward": new_fwd})
    return model


def _warm_blas_handles(device) -> None:
    """A BF16 GEMM and an FP8 one on the calling thread (its cuBLAS handles and workspaces)."""
    a16 = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    torch.mm(a16, a16)
    f8, one = a16.to(torch.float8_e4m3fn), torch.ones((), device=device)
    torch._scaled_mm(f8, f8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


class _WarmBlas(torch.autograd.Function):
    """Identity whose forward and backward each run :func:`_warm_blas_handles` (the backward on
    autograd's device thread)."""

    @staticmethod
    def forward(ctx, x):
        _warm_blas_handles(x.device)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _warm_blas_handles(g.device)
        return g


def resident_bytes(dev: str) -> int:
    return torch.cuda.memory_allocated() if dev == "cuda" else 0


def _clear_grads(model: nn.Module, inputs: Inputs) -> None:
    for q in model.parameters():
        q.grad = None
    for x in inputs.xs:
        x.grad = None


@contextlib.contextmanager
def _round_block(variant: str, model: nn.Module, inputs: Inputs):
    """One variant's turn in a round: its settings on; its gradients freed when it ends, so the
    timing phase holds one variant's gradients at a time."""
    try:
        with variant_launch(variant):
            yield
    finally:
        _clear_grads(model, inputs)


def run_round_robin(
    size: str, cfg, inputs: Inputs, variants, modes, a, dev: str, res: list, header: dict, ao_reason: str
) -> bool:
    """Every variant of one size, each mode timed round-robin (``--rounds`` passes over all
    variants, :func:`bench_interleaved`), so the GPU's clock drift over the run (warming up,
    meeting its power cap) slows every variant alike. All variants' blocks stay allocated
    meanwhile (gradients only during a variant's own turn). A variant's peak memory is read over
    its first call and warm-up steps (at least one per input set, so that the other sets' input
    gradients are alive as in a one-variant run), less what the other variants hold then: the
    same figure as ``--rounds 1``. A variant that fails (set-up, warm-up or timing) gets an
    error row; the others go on. Returns whether a variant failed."""
    cuda = dev == "cuda"
    failed = False
    if cuda:  # the process's own GPU state before the baseline, so that no variant's peak loses it
        # as memory another variant holds: the cuBLAS / cuBLASLt workspaces, one set per thread
        # (the forward's and autograd's, 96 MiB in all on the H200)
        x = torch.ones(16, 16, device=dev, requires_grad=True)
        _WarmBlas.apply(x).sum().backward()
        del x
        torch.cuda.synchronize()
    base = resident_bytes(dev)
    rows0, models, own = {}, {}, {}
    for variant in variants:
        row0, skip, model = build_row(size, cfg, variant, inputs, a, dev, ao_reason, reset_dynamo=False)
        if model is not None:
            own[variant] = resident_bytes(dev)  # (after the variants before it, this one's params)
            own[variant] -= base + sum(own[v] for v in models)
            models[variant] = isolate(model, f"{size}_{variant}")
        rows0[variant] = (row0, skip)
    for mode in modes:
        for m in models.values():  # (each variant's FP8 weight copies are rebuilt in its own set-up)
            invalidate_weight_cache(m)
        steps, outs, others, held = {}, {}, {}, {}
        for variant in variants:
            row0, skip = rows0[variant]
            row = dict(row0, mode=mode, status=skip, rounds=a.rounds)
            outs[variant] = row
            if variant not in models:
                continue
            if mode == "compiled" and (eager_only := compiled_skip(variant)):
                row["status"] = eager_only
                continue
            model = models[variant]
            _clear_grads(model, inputs)
            free_memory(dynamo=False)  # (collected garbage must not count as another variant's)
            others[variant] = resident_bytes(dev) - base - own[variant]  # (subtracted from its peak)
            with _round_block(variant, model, inputs):
                step, got = prepare(model, mode, inputs, a, dev, reset_dynamo=False)
                row.update(got)
                if step is not None:
                    try:
                        for i in range(max(a.warmup, inputs.n)):
                            step(i % inputs.n)
                        if cuda:
                            torch.cuda.synchronize()
                            row["peak_gib"] = (torch.cuda.max_memory_allocated() - others[variant]) / 2**30
                        steps[variant] = step
                    except Exception as e:  # noqa: BLE001 - record it, go on with the other variants
                        traceback.print_exc()
                        row.update(status=error_status(e), ms=None)
            held[variant] = resident_bytes(dev) - base - others[variant]  # (its params, FP8 weight copies)
        if steps:
            errors = {}
            blocks = {v: (lambda v=v: _round_block(v, models[v], inputs)) for v in steps}
            replays = {}
            if a.cuda_graph:  # (after every variant's peak: the graphs' memory pools are not a step's)
                for variant, step in steps.items():
                    with _round_block(variant, models[variant], inputs):
                        replay = graph_step(step, models[variant], mode, inputs, a, outs[variant])
                    if replay is not None:
                        replays[variant] = replay
            times = bench_interleaved(
                steps,
                inputs.n,
                dev,
                rounds=a.rounds,
                warmup=1,
                iters=a.iters,
                window=a.window,
                b2b_warmup=1,
                graphs=replays,
                contexts=blocks,
                errors=errors,
                group=a.micro_batches,
                monitor=gpu_monitor(dev),
            )
            if a.energy:
                fns = {
                    **{(v, "step"): f for v, f in steps.items() if v not in errors},
                    **{(v, "graph"): f for v, f in replays.items() if v not in errors},
                }
                got = measure_energy(fns, inputs, a, dev, contexts={key: blocks[key[0]] for key in fns})
                for (variant, kind), e in got.items():
                    outs[variant]["energy" if kind == "step" else "energy_graph"] = e
            for variant, step in steps.items():
                row = outs[variant]
                if variant in errors:
                    row.update(status=error_status(errors[variant]), ms=None)
                    continue
                take_timings(row, times[variant], dev)
                try:
                    with _round_block(variant, models[variant], inputs):
                        now_others = resident_bytes(dev) - base - held[variant]
                        for i in range(1, inputs.n):  # (the other input sets' gradients alive, as
                            step(i)  # in a one-variant run's steps)
                        profile_extras(step, row, inputs, a, dev, others_bytes=now_others)
                except Exception as e:  # noqa: BLE001 - record it, go on with the other variants
                    traceback.print_exc()
                    row.update(status=error_status(e), ms=None)
        for variant in variants:
            failed |= report_row(outs[variant], cfg, inputs, a, res, header)
        steps = replays = None  # (the graphs' memory pools go with them, before the next mode)
    models.clear()
    free_memory()
    return failed


def report_row(row: dict, cfg, inputs: Inputs, a, res: list, header: dict) -> bool:
    """Add a finished row to ``res`` (with its TFLOP/s), print its status, refresh the ratios and
    rewrite ``--out`` (a run cut short keeps what it measured); returns whether it failed."""
    if row["ms"] is not None:
        row["tflops"] = model_flops(cfg, a.block, inputs.tokens, a.seq) / row["ms"] / 1e9
    res.append(row)
    took = "" if row["ms"] is None else f" {row['ms']:.2f} ms"
    print(
        f"  {row['size']} {a.block} {row['variant']} {row['mode']}: {row['status']}{took}", file=sys.stderr, flush=True
    )
    _add_ratios(res)
    write_json(a.out, dict(header, results=res))
    return (row["status"] or "").startswith("error")


def build_row(size: str, cfg, variant: str, inputs: Inputs, a, dev: str, ao_reason: str, *, reset_dynamo: bool = True):
    """``(row fields, skip status or None, model or None)`` for one variant of one size."""
    full = variant
    variant, fused = split_variant(variant)
    row0 = {
        "size": size,
        "block": a.block,
        "variant": full,
        "projections": "fused" if fused or variant in TE_LAYER else "separate",
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "tokens": inputs.tokens,
        "fp8_linears": None,
        "ms": None,
        "tflops": None,
        "first_call_s": None,
        "peak_gib": None,
        "graph_breaks": None,
        "ms_graph": None,
    }
    skip = None
    if variant in TORCHAO:
        skip = ao_reason or None
    elif variant in TE_LAYER:
        from nemo_fp8_recipes.integrations.te import te_available

        ok, why = te_available()
        if not ok:
            skip = f"skipped: Transformer Engine not importable ({why})"
        elif dev != "cuda" or a.smoke:
            skip = "skipped: te.TransformerLayer needs a CUDA GPU"
        elif TE_LAYER[variant] != "bf16":
            how, reason = recipe_mode(TE_LAYER[variant], dev)
            skip = f"skipped: {reason}" if how == "skipped" else None
    elif VARIANT_RECIPE.get(variant, variant) != "bf16":
        how, reason = recipe_mode(VARIANT_RECIPE.get(variant, variant), dev)
        skip = f"skipped: {reason}" if how == "skipped" else None
    model = None
    if skip is None:
        try:
            free_memory(dynamo=reset_dynamo)
            model = build(cfg, a.block, full, dev, a.smoke, seq=a.seq)
            row0["fp8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        except Exception as e:  # noqa: BLE001 - record it, go on with the other variants
            traceback.print_exc()
            skip = error_status(e)
    return row0, skip, model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", choices=("layer", "mlp"), default="layer")
    p.add_argument("--sizes", default="8b,70b,405b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--modes", default="eager,compiled", help="comma list of eager,compiled")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of " + ",".join(VARIANTS))
    p.add_argument(
        "--projections",
        default="separate",
        help="comma list of separate,fused: our layer (and torchao's) with separate q/k/v and gate/up "
        "projections as Hugging Face's Llama has them, and/or fused ones (wqkv, w13) as Megatron-Core and "
        "TE have them (model.fused_projections; rows `<variant>+fused`). TE's layer is always fused.",
    )
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--input-dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="dtype of the block's input (fp32: the trainer's residual stream)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--input-sets", type=int, default=2, help="rotating input/gradient sets")
    p.add_argument(
        "--window",
        type=int,
        default=4,
        help="steps queued back to back per timed window for the 'back to back' columns "
        "(no synchronisation between them, as in a training loop; default %(default)s)",
    )
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument(
        "--compile-mode",
        default=None,
        choices=COMPILE_MODES,
        help="torch.compile mode (Inductor only; default: torch's default). reduce-overhead "
        "replays each compiled graph as a CUDA graph (no launch gaps)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        metavar="K",
        help="K micro-batches per optimizer step: our FP8 weights are re-quantised every K-th step "
        "(implies --requant-weights' behaviour for K = 1 steps) and the compiled FP8 linears read "
        "them from their compiled weight cache (set_graph_weight_cache); torchao casts its weights "
        "in every forward regardless (default 1)",
    )
    p.add_argument(
        "--requant-weights",
        action="store_true",
        help="re-quantise our FP8 weights every step (one micro-batch per optimizer "
        "step, as torchao always does) instead of using the cached copies",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also profile each variant and mode (torch.profiler) and report device time "
        "per kernel class (GEMM / Triton quantisers / attention / other) and the "
        "top kernels",
    )
    p.add_argument(
        "--peak-report",
        action="store_true",
        help="also record one step's allocator history per variant and mode (CUDA) and "
        "list the largest blocks alive at its peak, with where each was allocated "
        "(JSON 'peak_live'). Under --compile-mode reduce-overhead the CUDA-graph "
        "replays take their memory from the graphs' pool, which the history does not show",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the variants of each size and mode round-robin: every variant is set "
        "up (compiled) first and kept, then --rounds passes each time every variant "
        "in turn (--iters / rounds samples each), so the GPU's clock drift over the "
        "run (warming up, meeting its power cap) slows all variants alike; a "
        "variant's peak memory is taken over its first call and warm-up, less what "
        "the other variants hold. 1 (default): each variant set up, timed and "
        "dropped in turn (less memory: one variant's block allocated at a time)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also capture every variant's whole step (fwd+bwd, compiled or eager) as CUDA graphs "
        "(one per input set, one memory pool per variant, held until the mode's timings end: about "
        "one more step's activations and gradients per variant) and time their replays: the GPU's "
        "time alone, without the host's launch and Python time (columns 'CUDA graph'; CUDA only; "
        "with --micro-batches K compiled only, the weight cache re-quantised before every K-th "
        "replay)",
    )
    p.add_argument(
        "--energy",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the timings, run every variant's step back to back for about SECONDS, round-robin "
        "twice (and its graph replays with --cuda-graph), between two reads of the board's energy "
        "counter (NVML): joules per step, mean W, SM clock. At the power cap a step's time is its "
        "energy over the cap, so this says what bounds the ratios there (0: off)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here (after every variant)")
    p.add_argument("--smoke", action="store_true", help="tiny emulated CPU run (no timing claims)")
    a = p.parse_args(argv)

    def split(s):
        return [x.strip() for x in s.split(",") if x.strip()]

    sizes, modes, variants = split(a.sizes), split(a.modes), split(a.variants)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    if a.micro_batches < 1:
        p.error(f"--micro-batches must be at least 1, got {a.micro_batches}")
    if not (math.isfinite(a.energy) and a.energy >= 0):
        p.error("--energy is a duration in seconds (0: off)")
    if a.cuda_graph and a.compile_mode in CUDA_GRAPH_MODES and "compiled" in modes:
        p.error(
            f"--cuda-graph captures the whole step itself; --compile-mode {a.compile_mode} already replays "
            "each compiled graph as a CUDA graph (use one or the other)"
        )
    if a.rounds > 1 and a.compile_mode in CUDA_GRAPH_MODES and "compiled" in modes:
        p.error(
            f"--rounds {a.rounds} interleaves the variants, whose CUDA-graph trees "
            f"(--compile-mode {a.compile_mode}) are one per process and would be re-recorded at every "
            "switch; use --rounds 1 with that mode"
        )
    for s in sizes:
        if s not in MODELS:
            p.error(f"unknown size {s!r}; valid: {', '.join(MODELS)}")
    for m in modes:
        if m not in ("eager", "compiled"):
            p.error(f"unknown mode {m!r}; valid: eager, compiled")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # speed-ups are against BF16 in the same run
    projections = split(a.projections)
    for pr in projections:
        if pr not in ("separate", "fused"):
            p.error(f"unknown projections {pr!r}; valid: separate, fused")
    if not projections:
        p.error("--projections needs separate, fused or both")
    variants = [
        v + (FUSED if pr == "fused" and v not in TE_LAYER else "")
        for pr in projections
        for v in variants
        if v not in TE_LAYER or pr == projections[0]  # (TE's layer has one layout, fused: set up once)
    ]
    dev = benchmark_device(a.smoke)
    cuda = dev == "cuda"
    cfgs = {s: load_model_config(MODELS[s]).replace(max_seq_len=a.seq) for s in sizes}
    if a.smoke:
        a.seq, a.batch, a.warmup, a.iters, a.input_sets = 64, 1, 0, 2, 2
        a.compile_backend = "aot_eager"  # Inductor's C++ build alone takes ~10 s per variant on CPU
        cfgs = {
            "tiny": load_model_config("llama3_8b").replace(
                name="tiny", dim=256, num_heads=2, num_kv_heads=1, ffn_dim=384, max_seq_len=a.seq
            )
        }
    ao_version, ao_reason = torchao_status()
    cudnn, cudnn_problem = cudnn_status() if cuda else (None, None)
    if cudnn_problem:
        p.error(cudnn_problem)
    x_dtype = DTYPES[a.input_dtype]
    # the block's output dtype: the residual stream's for a layer, autocast's for the MLP alone
    y_dtype = x_dtype if a.block == "layer" or not cuda else torch.bfloat16
    name = torch.cuda.get_device_name() if cuda else "CPU (emulated FP8, smoke: no timing claims)"
    res = []
    header = {
        "benchmark": "layer_fwd_bwd",
        "block": a.block,
        "device": name,
        "torch": torch.__version__,
        "torchao": ao_version,
        "transformer_engine": _te_version(),
        "cudnn": cudnn,
        "seq": a.seq,
        "batch": a.batch,
        "input_dtype": a.input_dtype,
        "param_dtype": "fp32",
        "autocast": "bf16" if cuda else None,
        "compile_backend": a.compile_backend,
        "compile_mode": a.compile_mode,
        "warmup": a.warmup,
        "iters": a.iters,
        "rounds": a.rounds,
        "requant_weights": a.requant_weights,
        "micro_batches": a.micro_batches,
        "cuda_graph": a.cuda_graph,
        "energy_s": a.energy,
        "projections": projections,
    }
    failed = False

    for size, cfg in cfgs.items():
        free_memory()
        inputs = Inputs(cfg, a, dev, x_dtype, y_dtype)
        if a.rounds > 1:
            failed |= run_round_robin(size, cfg, inputs, variants, modes, a, dev, res, header, ao_reason)
            del inputs
            continue
        for variant in variants:
            row0, skip, model = build_row(size, cfg, variant, inputs, a, dev, ao_reason)
            for mode in modes:
                row = dict(row0, mode=mode, status=skip, rounds=1)
                if model is not None and mode == "compiled" and (eager_only := compiled_skip(variant)):
                    row["status"] = eager_only
                elif model is not None:
                    with variant_launch(variant):
                        row.update(measure(model, mode, inputs, a, dev))
                failed |= report_row(row, cfg, inputs, a, res, header)
            del model
        del inputs
    free_memory()

    _add_ratios(res)
    rows = [
        (
            r["size"],
            r["variant"],
            r["mode"] + (f" ({TE_EAGER_NOTE})" if r.get("ran") == "eager" else ""),
            fmt(r["ms"], ".2f"),
            fmt_tflops(r["tflops"]),
            fmt(r.get("speedup"), ".2f", "x"),
            fmt(r.get("vs_te"), ".3f", "x"),
            fmt(r.get("vs_torchao_tensorwise"), ".2f", "x"),
            fmt(r.get("ms_b2b"), ".2f"),
            fmt(r.get("speedup_b2b"), ".2f", "x"),
            fmt(r.get("vs_torchao_tensorwise_b2b"), ".2f", "x"),
            *(
                (
                    fmt(r.get("ms_graph"), ".2f"),
                    fmt(r.get("speedup_graph"), ".3f", "x"),
                    fmt(r.get("vs_torchao_tensorwise_graph"), ".3f", "x"),
                )
                if a.cuda_graph
                else ()
            ),
            fmt(r["peak_gib"], ".1f"),
            gpu_cell(r.get("gpu")),
            gpu_cell(r.get("gpu_b2b")),
            fmt(r["first_call_s"], ".1f"),
            "-" if r["fp8_linears"] is None else r["fp8_linears"],
            "-" if r.get("graph_breaks") is None else r["graph_breaks"],
            r["status"],
        )
        for r in sorted(
            res, key=lambda r: (list(cfgs).index(r["size"]), modes.index(r["mode"]), variants.index(r["variant"]))
        )
    ]
    wq_note = (
        f"re-quantised every {a.micro_batches} steps ({a.micro_batches} micro-batches per optimizer step; "
        "compiled: the cached FP8 weights)"
        if a.micro_batches > 1
        else "re-quantised every step"
        if a.requant_weights
        else "cached (as between optimizer steps)"
    )
    what = "Llama layer (attention + SwiGLU MLP)" if a.block == "layer" else "SwiGLU MLP"
    print(
        f"{name}, torch {torch.__version__}, torchao {ao_version or 'not installed'}; {what}, "
        f"seq {a.seq} x batch {a.batch}, FP32 params, {a.input_dtype.upper()} input"
        f"{', BF16 autocast' if cuda else ''}, fwd+bwd, median of {a.iters}; our FP8 weights "
        f"{wq_note}\n"
    )
    print(
        table(
            [
                "size",
                "variant",
                "mode",
                "ms (median)",
                "TFLOP/s",
                "vs BF16",
                "vs TE (same recipe)",
                "vs torchao tw",
                f"ms/step, {a.window} back to back",
                "vs BF16, b2b",
                "vs torchao tw, b2b",
                *(("ms, CUDA graph", "vs BF16, graph", "vs torchao tw, graph") if a.cuda_graph else ()),
                "peak GiB",
                "SM clock, power (sync)",
                "SM clock, power (b2b)",
                "first call s",
                "FP8 linears",
                "graph breaks",
                "status",
            ],
            rows,
        )
    )
    not_captured = [r for r in res if a.cuda_graph and r["status"] == "ok" and r.get("graph_status") != "ok"]
    if not_captured:
        print(
            "\nCUDA graph not timed: "
            + "; ".join(
                f"{r['size']} {r['variant']} {r['mode']}: {r.get('graph_status') or 'not captured'}"
                for r in not_captured
            )
        )
    if a.energy:
        print(
            f"\nEnergy: each step back to back for about {a.energy:g} s, round-robin twice (medians); "
            "J vs BF16 = BF16's joules per step / this one's:\n"
        )
        print(energy_table(res, cfgs, modes, variants))
    prof = [r for r in res if r.get("breakdown")]
    if prof:
        from profiling.timeline import breakdown_table, timeline_table

        print(
            "\n"
            + breakdown_table(
                prof, ["size", "variant", "mode"], ("gemm", "quantise (Triton)", "attention", "other"), top=4
            )
        )
        timed = [r for r in res if r.get("timeline")]
        if timed:
            print("\n" + timeline_table(timed, ["size", "variant", "mode"]))
    write_json(a.out, dict(header, results=res))
    return 1 if failed else 0


def cudnn_status():
    """``(cuDNN version as "9.19.0", None)``, or ``(None, why)`` where PyTorch cannot use its cuDNN.
    That happens when the library path holds an older system cuDNN, which the loader takes before
    the one PyTorch ships: PyTorch then disables cuDNN and its SDPA runs other attention kernels,
    while TE's layer still runs cuDNN's, so the two would not be compared on the same attention."""
    try:
        v = torch.backends.cudnn.version()
    except RuntimeError as e:
        v, err = None, str(e).splitlines()[0]
    else:
        err = None if v else "cuDNN is not available to this PyTorch build"
    if v:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}", None
    lib = os.path.join(os.path.dirname(torch.__file__), os.pardir, "nvidia", "cudnn")
    fix = (
        f"export CUDNN_HOME={os.path.realpath(lib)} LD_LIBRARY_PATH={os.path.realpath(lib)}/lib:$LD_LIBRARY_PATH"
        if os.path.isdir(lib)
        else "put PyTorch's cuDNN first on LD_LIBRARY_PATH"
    )
    return None, (
        f"PyTorch cannot use cuDNN here ({err}): its attention would run other kernels than "
        f"te.TransformerLayer's cuDNN attention, and every comparison would time different attention. "
        f"Give it its own cuDNN before starting Python: {fix}"
    )


def _te_version():
    """The installed Transformer Engine version (package metadata, no import), or None."""
    from nemo_fp8_recipes.integrations.te import te_version

    v = te_version()
    return ".".join(map(str, v)) if v else None


def energy_table(res, cfgs, modes, variants) -> str:
    """``--energy``'s table: per row (and per kind: the step, its CUDA-graph replay) the time
    and joules per step, mean draw, SM clock, and the joule ratio to BF16's same kind."""
    out = []
    for r in sorted(
        res, key=lambda r: (list(cfgs).index(r["size"]), modes.index(r["mode"]), variants.index(r["variant"]))
    ):
        for kind, key in (("step", "energy"), ("CUDA graph", "energy_graph")):
            e = r.get(key)
            if not e:
                continue
            gpu = e.get("gpu") or {}
            out.append(
                (
                    r["size"],
                    r["variant"],
                    r["mode"],
                    kind,
                    fmt(e["ms"], ".2f"),
                    fmt(e.get("j"), ".3f"),
                    fmt(e.get("w"), ".0f"),
                    fmt(gpu.get("sm_mhz_median"), ".0f"),
                    fmt(r.get(key + "_vs_bf16"), ".3f", "x"),
                    e.get("energy_reason") or "",
                )
            )
    return table(
        ["size", "variant", "mode", "timed", "ms/step", "J/step", "W", "SM MHz", "J vs BF16", "energy not read"], out
    )


def _add_ratios(res) -> None:
    """Speed-up over BF16 and ratio to torchao tensorwise, within one size and mode."""
    for r in res:
        if r["status"] != "ok":
            continue
        same = {
            o["variant"]: o for o in res if o["size"] == r["size"] and o["mode"] == r["mode"] and o["status"] == "ok"
        }
        # against BF16 and torchao with the same projections where they ran, else the separate ones
        base, fused = split_variant(r["variant"])
        sfx = FUSED if fused else ""
        b = same.get("bf16" + sfx) or same.get("bf16")
        t = same.get("torchao-tensorwise" + sfx) or same.get("torchao-tensorwise")
        r["speedup"] = b["ms"] / r["ms"] if b else None
        # ours over Transformer Engine's layer under the same recipe, timed in the same round
        # (TE eager); for TE's rows, TE's BF16 layer's speed-up over ours
        te = same.get("te-" + VARIANT_RECIPE.get(base, base)) if base not in TE_LAYER else None
        r["vs_te"] = te["ms"] / r["ms"] if te else None
        r["vs_torchao_tensorwise"] = t["ms"] / r["ms"] if t else None
        both = r.get("ms_b2b") is not None
        r["speedup_b2b"] = b["ms_b2b"] / r["ms_b2b"] if b and both and b.get("ms_b2b") else None
        r["vs_torchao_tensorwise_b2b"] = t["ms_b2b"] / r["ms_b2b"] if t and both and t.get("ms_b2b") else None
        g = r.get("ms_graph")
        r["speedup_graph"] = b["ms_graph"] / g if g and b and b.get("ms_graph") else None
        r["vs_torchao_tensorwise_graph"] = t["ms_graph"] / g if g and t and t.get("ms_graph") else None
        for key in ("energy", "energy_graph"):  # BF16's joules per step over this one's
            j, jb = (r.get(key) or {}).get("j"), ((b or {}).get(key) or {}).get("j")
            r[key + "_vs_bf16"] = jb / j if j and jb else None


if __name__ == "__main__":
    raise SystemExit(main())
