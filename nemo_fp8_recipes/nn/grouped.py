"""FP8 grouped expert GEMMs: the experts of an MoE layer held as 3-D weights ``[experts, out, in]``.

Hugging Face transformers 5 keeps each MoE layer's experts (Mixtral, Qwen2/Qwen3-MoE,
DeepSeek-V3) in one module with two 3-D weights, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, and runs them as a grouped matrix product over the tokens routed to each
expert. Here each expert's slice is one GEMM of the FP8 linear (:mod:`~nemo_fp8_recipes.nn.gemms`,
the same quantisers and GEMM dispatch): the tokens are sorted by expert, and each expert's rows and
its weight are quantised with the recipe's granularity on their own — per tensor per expert
(delayed, tensorwise), 1x128 tiles and 128x128 blocks (blockwise), 1x32 blocks (mxfp8) — so
fprop, dgrad and wgrad of expert ``e`` are exactly those of a :class:`~nemo_fp8_recipes.nn.Float8Linear`
holding ``weight[e]`` and fed that expert's tokens. Delayed scaling keeps an amax history per
weight, expert and operand, advanced on either schedule (``lazy`` before each quantisation,
``step`` by :func:`~nemo_fp8_recipes.nn.sync_delayed_scaling`, as the trainer runs it). Real FP8
GEMMs run one ``torch._scaled_mm`` per expert through the same dispatch, each expert's rows padded
to the recipe's alignment; there is no fused grouped kernel. The router, its top-k and the combine
(routing weight times expert output, summed per token) stay in the precision the model computes
them in. Telemetry records the statistics a :class:`~nemo_fp8_recipes.nn.Float8Linear` records,
per weight, expert and operand (:meth:`Float8GroupedExperts.pop_telemetry`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..quant.delayed import advance_delayed_scaling
from ..quant.reference import quantization_stats, summarize_stats
from .config import Float8LinearConfig
from .gemms import (
    GO,
    IN,
    OPERANDS,
    W,
    check_device,
    fprop,
    grads,
    output_dtype,
    quantize_current,
    quantize_delayed,
    quantize_weight,
)
from .linear import fp8_modules

__all__ = [
    "Float8GroupedExperts",
    "GroupedOperands",
    "experts_forward",
    "fp8_state_modules",
    "grouped_fp8_modules",
    "grouped_layout_problem",
]

#: The weights of transformers 5's experts modules, each ``[experts, out_features, in_features]``.
HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def grouped_layout_problem(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not in the grouped-experts layout :class:`Float8GroupedExperts` runs in
    FP8 (transformers 5's: 3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, gate and
    up concatenated, not transposed, no bias, an ``act_fn``), or None if it is."""
    ws = [getattr(module, n, None) for n in HF_EXPERT_WEIGHTS]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in ws):
        return (
            "its 3-D weights are not gate_up_proj [experts, 2*intermediate, hidden] and "
            "down_proj [experts, hidden, intermediate]"
        )
    gu, down = ws
    if gu.shape[0] != down.shape[0] or gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
        return f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not pair as [E, 2I, H] / [E, H, I]"
    for flag, want in (("is_transposed", False), ("has_bias", False), ("has_gate", True), ("is_concatenated", True)):
        if getattr(module, flag, want) is not want:
            return f"{flag}={getattr(module, flag)} (supported: {flag}={want})"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    return None


class GroupedOperands:
    """What the grouped autograd function needs of a :class:`Float8GroupedExperts`: the config,
    the operand quantiser of one (weight, expert) pair (current scaling, or delayed scaling with
    the module's per-expert scales), the GEMM counters and the lazy delayed-scaling commits."""

    def __init__(self, module: "Float8GroupedExperts", p: int):
        self.config: Float8LinearConfig = module.config
        self.fqn = module.fqn
        self.module, self.p = module, p

    def quantizer(self, e: int):
        """``quantize_operand(i, t, pair=False)`` for expert ``e``. With telemetry on, each
        quantisation's statistics are recorded for (weight, expert, operand), from the reference
        quantisers (the same codes; the fused 1x128 / 128x128 kernels return no amax)."""
        cfg = self.config
        m, p = self.module, self.p
        tel = cfg.telemetry
        triton = cfg.kernel_options.triton and not tel
        if cfg.recipe.is_delayed:

            def quantize(i, t, pair):
                q = quantize_delayed(cfg.recipe, m.fp8_scale[p, e], i, t, pair=pair, triton=triton)
                amax = (q[0] if pair else q).amax.reshape(())
                with torch.no_grad():
                    m.fp8_amax_pending[p, e, i] = torch.maximum(m.fp8_amax_pending[p, e, i], amax)
                    m.fp8_pending[p, e, i] = 1.0
                return q

        else:

            def quantize(i, t, pair):
                return quantize_current(cfg.recipe, i, t, pair=pair, triton=triton)

        if not tel:
            return lambda i, t, pair=False: quantize(i, t, pair)

        def quantize_recorded(i, t, pair=False):
            q = quantize(i, t, pair)
            m.record_telemetry(p, e, i, quantization_stats(t.detach(), q[0] if pair else q))
            return q

        return quantize_recorded

    def commit(self, operands: Sequence[int]) -> None:
        """Delayed scaling, ``lazy`` schedule: fold the pending amaxes of ``operands`` into the
        histories before they are quantised again."""
        if self.config.recipe.is_delayed and self.config.scaling_update == "lazy":
            self.module.advance_delayed_scaling(operands, p=self.p)

    def count(self, gemm: str, n: int) -> None:
        """Count ``n`` expert GEMMs run in FP8."""
        self.module.gemm_counts_add(gemm, n)


class GroupedMMFn(torch.autograd.Function):
    """``y[rows of expert e] = x[rows of expert e] · weight[e]ᵀ`` for rows sorted by expert
    (``sizes``: rows per expert), each expert's three GEMMs in FP8 as :func:`fprop` /
    :func:`grads` compute them for one linear."""

    @staticmethod
    def forward(ctx, x, weight, sizes: Tuple[int, ...], ops: GroupedOperands, out_dtype, grad_enabled: bool):
        cfg = ops.config
        check_device(x, cfg.emulate, ops.fqn)
        ops.commit((IN, W))
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
        y = x.new_empty(x.shape[0], weight.shape[1], dtype=out_dtype)
        subs, to_save, start, n = [], [], 0, 0
        for e, m in enumerate(sizes):
            if m == 0:
                subs.append(None)
                continue
            q = ops.quantizer(e)
            sub = SimpleNamespace(needs_input_grad=need)
            weights = quantize_weight(weight[e].detach(), cfg.recipe, cfg.emulate, q)
            ye, saved = fprop(
                sub,
                x[start : start + m],
                None,
                weights,
                recipe=cfg.recipe,
                emulate=cfg.emulate,
                row_multiple=cfg.row_multiple,
                out_dtype=out_dtype,
                quantize_operand=q,
                grad_enabled=grad_enabled,
            )
            y[start : start + m] = ye
            sub.n_saved = len(saved)
            subs.append(sub)
            to_save += saved
            start += m
            n += 1
        ops.count("fprop", n)
        ctx.save_for_backward(*to_save)
        ctx.subs, ctx.sizes, ctx.ops = subs, sizes, ops
        ctx.w_shape, ctx.w_dtype, ctx.x_dtype = weight.shape, weight.dtype, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        ops, cfg = ctx.ops, ctx.ops.config
        ops.commit((GO,))
        saved = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = None
        dxs, dw = [], torch.zeros(ctx.w_shape, dtype=torch.float32, device=dy.device) if need_dw else None
        start, k, nd, nw = 0, 0, 0, 0
        for e, m in enumerate(ctx.sizes):
            sub = ctx.subs[e]
            if sub is None:
                continue
            dxe, dwe, _ = grads(
                sub,
                dy[start : start + m],
                saved[k : k + sub.n_saved],
                recipe=cfg.recipe,
                emulate=cfg.emulate,
                w_dtype=torch.float32,
                quantize_operand=ops.quantizer(e),
                need_dx=need_dx,
            )
            if dxe is not None:
                dxs.append(dxe)
                nd += 1
            if dwe is not None:
                dw[e] = dwe
                nw += 1
            k += sub.n_saved
            start += m
        ops.count("dgrad", nd)
        ops.count("wgrad", nw)
        if need_dx:
            dx = torch.cat(dxs) if dxs else dy.new_zeros(0, ctx.w_shape[2], dtype=ctx.x_dtype)
        return dx, (dw.to(ctx.w_dtype) if dw is not None else None), None, None, None, None


class Float8GroupedExperts(nn.Module):
    """An MoE layer's experts with 3-D weights, every expert GEMM in FP8.

    The built-in layout is transformers 5's experts module (``MixtralExperts``,
    ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...):
    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` with
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (:func:`grouped_layout_problem`).
    Build it with :meth:`from_experts`, which shares the module's Parameter objects. Other
    layouts subclass it, name their 3-D weights in ``weight_names`` and call :meth:`grouped_mm`
    from their ``forward``.

    Counts: every expert that received tokens runs one fprop, dgrad and wgrad per weight, each
    counted as one GEMM (:attr:`gemm_counts`, reported by :func:`~nemo_fp8_recipes.nn.audit`).
    Run-time settings (telemetry, the delayed-scaling schedule and amax reduction) change through
    :meth:`reconfigure`, as a Float8Linear's do.
    """

    def __init__(self, weights: Dict[str, nn.Parameter], config: Float8LinearConfig, act_fn=None):
        super().__init__()
        if not isinstance(config, Float8LinearConfig):
            raise TypeError(f"config must be a Float8LinearConfig, got {type(config).__name__}")
        shapes = {n: tuple(w.shape) for n, w in weights.items()}
        if not weights or any(len(s) != 3 for s in shapes.values()):
            raise ValueError(f"grouped expert weights must be 3-D [experts, out, in], got {shapes}")
        experts = {s[0] for s in shapes.values()}
        if len(experts) != 1:
            raise ValueError(f"grouped expert weights disagree on the number of experts: {shapes}")
        for n, w in weights.items():
            self.register_parameter(n, w)
        self.weight_names: Tuple[str, ...] = tuple(weights)
        self.num_experts = experts.pop()
        self.config = config
        self.act_fn = act_fn
        self.fqn, self.role = "", "mlp"
        self._counts = {"fprop": 0, "dgrad": 0, "wgrad": 0}
        self._telemetry: Dict[Tuple[int, int, int], List[torch.Tensor]] = {}
        if config.recipe.is_delayed:
            P, E, L = len(weights), self.num_experts, config.recipe.amax_history_len
            dev = next(iter(weights.values())).device
            self.register_buffer("fp8_amax_history", torch.zeros(P, E, 3, L, device=dev))
            self.register_buffer("fp8_scale", torch.ones(P, E, 3, device=dev))
            self.register_buffer("fp8_amax_pending", torch.zeros(P, E, 3, device=dev))
            self.register_buffer("fp8_pending", torch.zeros(P, E, 3, device=dev))

    @classmethod
    def from_experts(cls, module: nn.Module, config: Float8LinearConfig) -> "Float8GroupedExperts":
        """The FP8 form of a transformers 5 experts module (same Parameter objects)."""
        problem = grouped_layout_problem(module)
        if problem:
            raise TypeError(
                f"{type(module).__name__} is not in the grouped-experts layout Float8GroupedExperts runs: {problem}"
            )
        return cls({n: getattr(module, n) for n in HF_EXPERT_WEIGHTS}, config, act_fn=module.act_fn)

    # ---- counters and delayed scaling ----------------------------------------------------------
    @property
    def recipe(self):
        return self.config.recipe

    @property
    def gemm_counts(self) -> Dict[str, int]:
        """fprop/dgrad/wgrad expert GEMMs run in FP8 since construction or :meth:`reset_gemm_counts`."""
        return dict(self._counts)

    def gemm_counts_add(self, gemm: str, n: int) -> None:
        """Add ``n`` expert GEMMs to the ``gemm`` counter."""
        self._counts[gemm] += n

    def reset_gemm_counts(self) -> None:
        """Zero the GEMM counters."""
        self._counts = {k: 0 for k in self._counts}

    def reconfigure(self, **changes) -> Float8LinearConfig:
        """Replace the config with ``self.config.replace(**changes)`` and return it, as
        :meth:`Float8Linear.reconfigure <nemo_fp8_recipes.nn.Float8Linear.reconfigure>` does:
        ``telemetry`` (off drops the statistics not yet collected), ``scaling_update`` and
        ``amax_reduce_fn`` (pending amaxes carry over: neither schedule loses one),
        ``kernel_options``. The compiled weight cache and fused wgrad accumulation do not apply
        (the experts' weights are quantised in every forward and their gradients returned)."""
        new = self.config.replace(**changes)
        self.config = new
        if not new.telemetry:
            self._telemetry = {}
        return new

    def record_telemetry(self, p: int, e: int, i: int, stats: torch.Tensor) -> None:
        """Keep one quantisation's statistics (:func:`~nemo_fp8_recipes.quant.reference.quantization_stats`)
        of operand ``i`` of weight ``p``'s expert ``e``."""
        self._telemetry.setdefault((p, e, i), []).append(stats)

    def pop_telemetry(self, per_expert: bool = False) -> Dict:
        """The statistics recorded since the last call, then reset. Default, per operand: what a
        :meth:`Float8Linear.pop_telemetry <nemo_fp8_recipes.nn.Float8Linear.pop_telemetry>` gives
        (``amax`` the max, ``scale``, ``underflow_frac``, ``saturated_frac``, ``sqnr_db`` the mean
        over every quantisation of every expert and weight) and the worst expert's
        ``underflow_frac_worst``, ``saturated_frac_worst`` (the max over (weight, expert) of
        its mean) and ``sqnr_db_worst`` (the min): a mean over many experts hides the one whose
        scale went wrong, e.g. a rarely routed expert. ``per_expert=True``:
        ``{weight name: {expert: {operand: {stat: mean (amax: max)}}}}`` for the experts that ran."""
        tel, self._telemetry = self._telemetry, {}
        means: Dict[Tuple[int, int, int], Dict[str, float]] = {}
        pooled: Dict[int, List[torch.Tensor]] = {}
        for (p, e, i), stats in sorted(tel.items()):
            if not stats:
                continue
            st = torch.stack(stats)
            means[(p, e, i)] = summarize_stats(st)
            pooled.setdefault(i, []).append(st)
        if per_expert:
            out: Dict = {}
            for (p, e, i), v in means.items():
                out.setdefault(self.weight_names[p], {}).setdefault(e, {})[OPERANDS[i]] = v
            return out
        out = {}
        for i, sts in pooled.items():
            v = summarize_stats(torch.cat(sts))
            per = [m for (_, _, j), m in means.items() if j == i]
            v["underflow_frac_worst"] = max(m["underflow_frac"] for m in per)
            v["saturated_frac_worst"] = max(m["saturated_frac"] for m in per)
            v["sqnr_db_worst"] = min(m["sqnr_db"] for m in per)
            out[OPERANDS[i]] = v
        return out

    def graph_weight_cache_stale(self) -> bool:
        """Always False: the expert weights are quantised in every forward (no cache)."""
        return False

    @torch.no_grad()
    def advance_delayed_scaling(self, operands: Sequence[int], p: Optional[int] = None, reduce: bool = True) -> None:
        """Fold the pending amaxes of ``operands`` (of weight ``p``, or all) into the amax
        histories and recompute the scales (:func:`~nemo_fp8_recipes.quant.delayed.advance_delayed_scaling`;
        max-reduced first by the config's ``amax_reduce_fn`` if set and ``reduce``;
        :func:`~nemo_fp8_recipes.nn.sync_delayed_scaling` reduces them itself)."""
        sel = slice(None) if p is None else slice(p, p + 1)
        pend, flag = self.fp8_amax_pending[sel], self.fp8_pending[sel].clone()
        keep = torch.zeros(3, dtype=torch.bool, device=flag.device)
        keep[list(operands)] = True
        flag = flag * keep
        if not bool(flag.any()):
            return
        if reduce and self.config.amax_reduce_fn is not None:
            pend = self.config.amax_reduce_fn(pend.clone())
        r = self.recipe
        hist, scale = advance_delayed_scaling(
            self.fp8_amax_history[sel],
            self.fp8_scale[sel],
            pend,
            flag,
            (r.input_format, r.weight_format, r.grad_format),
            r,
        )
        self.fp8_amax_history[sel] = hist
        self.fp8_scale[sel] = scale
        self.fp8_amax_pending[sel] = torch.where(flag > 0, torch.zeros_like(pend), self.fp8_amax_pending[sel])
        self.fp8_pending[sel] = torch.where(flag > 0, torch.zeros_like(flag), self.fp8_pending[sel])

    # ---- the GEMMs -----------------------------------------------------------------------------
    # Eager islands, as Float8Linear's eager path: under torch.compile each call is a graph break
    # (the rows per expert are read on the host, the quantisers and the state updates stay exact
    # Python-side).
    @torch.compiler.disable
    def grouped_mm(self, name: str, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """``x [T, in]`` (rows sorted by expert, ``sizes[e]`` rows for expert ``e``) times
        ``weight[e]ᵀ`` per expert for the 3-D weight ``name``: ``[T, out]``, every expert GEMM in FP8."""
        w = getattr(self, name)
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != self.num_experts or sum(sizes) != x.shape[0]:
            raise ValueError(
                f"{self.fqn or 'Float8GroupedExperts'}: sizes {sizes} must give the rows of each of "
                f"{self.num_experts} experts and sum to {x.shape[0]}"
            )
        ops = GroupedOperands(self, self.weight_names.index(name))
        return GroupedMMFn.apply(x, w, sizes, ops, output_dtype(x), torch.is_grad_enabled())

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """transformers 5's experts forward (:func:`experts_forward`), every expert GEMM in FP8."""
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(getattr(self, n).shape)}" for n in self.weight_names)
        mode = "emulated" if self.config.emulate else "real FP8"
        return f"{shapes}, recipe={self.recipe.name} ({mode})"


def experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers 5's experts forward over ``experts.grouped_mm(name, x, sizes)`` (rows sorted by
    expert) and ``experts.act_fn``: route each token to its top-k experts, run
    ``down_proj(act(gate) * up)`` per expert, and sum the outputs weighted by the routing weights
    (in the routing weights' precision, FP32 for transformers' routers). One routing for the FP8
    experts and the trainer's high-precision ``GroupedExperts``; only their GEMMs differ."""
    E, k = experts.num_experts, top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    valid = flat < E  # (transformers marks tokens of experts on other ranks with E)
    order = torch.argsort(torch.where(valid, flat, E), stable=True)
    order = order[: int(valid.sum())]
    token = order // k
    sizes = torch.bincount(flat[order], minlength=E).tolist()
    x = hidden_states[token]
    gate, up = experts.grouped_mm("gate_up_proj", x, sizes).chunk(2, dim=-1)
    h = experts.grouped_mm("down_proj", experts.act_fn(gate) * up, sizes)
    h = h * top_k_weights.reshape(-1)[order, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token, h.to(out.dtype))


def grouped_fp8_modules(model: nn.Module) -> Dict[str, Float8GroupedExperts]:
    """All :class:`Float8GroupedExperts` of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8GroupedExperts)}


def fp8_state_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """Every module that runs its own FP8 GEMMs and keeps FP8 state, by name: the FP8 linears,
    then the grouped experts (both have the same telemetry, counter and scaling interface)."""
    return {**fp8_modules(model), **grouped_fp8_modules(model)}
