"""The routed experts of one Mixtral-style MoE layer, forward + backward: our grouped FP8 experts
per recipe vs BF16 vs torchao's FP8 grouped GEMM vs Transformer Engine's ``te.GroupedLinear``,
every variant in one run, round-robin.

    python benchmarks/moe_fwd_bwd.py                       # 8 experts, top-2, 4096 -> 14336 -> 4096
    python benchmarks/moe_fwd_bwd.py --tokens 16384 --routing skewed --out results/moe.json
    python benchmarks/moe_fwd_bwd.py --smoke               # tiny, CPU, emulated: the code path only

**What is timed.** The experts of one layer in transformers 5's layout (Mixtral 8x7B's widths by
default: ``--experts 8 --top-k 2 --hidden 4096 --intermediate 14336``): for ``--tokens`` tokens,
``tokens x top-k`` routed rows already sorted by expert, ``gate_up = x W_gu[e]^T`` (gate and up
stacked, ``[E, 2I, H]``), ``h = silu(gate) * up``, ``y = h W_d[e]^T`` (``[E, H, I]``), then the
backward of ``y`` (dgrad into the routed rows, wgrad into both weights); gradients are set to None
before each step. The router, its top-k, the permutation of the tokens and the weighted combine are
the same for every variant and left out. ``--routing balanced`` gives every expert the same number
of rows; ``skewed`` draws the shares from a Dirichlet(1) (seeded), every size a multiple of 16 (what
the FP8 grouped GEMMs of torchao and TE require).

**Variants** (``--variants``; the parameters are FP32 master weights under BF16 autocast, as the
trainer runs them, unless said otherwise):

Our variants, torchao's and the BF16 ones share one set of FP32 weights; TE's modules hold their own.

- ``bf16-grouped-mm``: the trainer's ``GroupedExperts`` (``nemo_fp8_recipes.models.llama``) under
  BF16 autocast: PyTorch's BF16 grouped GEMM (``F.grouped_mm``) on BF16 copies of the weights cast
  in every step (what autocast does for a linear): the fast BF16 path, the baseline of the speedup
  column.
- ``bf16-loop``: one ``F.linear`` per expert under autocast, as experts held as ``nn.Linear``
  modules run (transformers 4).
- ``tensorwise``, ``blockwise``, ``delayed`` (``mxfp8`` skipped with the reason where the GPU lacks
  it): ``GroupedExperts`` converted by ``convert_model`` into a ``Float8GroupedExperts``: every
  expert's rows and weight quantised with the recipe's granularity, one ``torch._scaled_mm`` per
  expert and GEMM (fprop, dgrad, wgrad), weights re-quantised in every step; delayed scaling on the
  trainer's ``step`` schedule (``sync_delayed_scaling`` at the start of every step, timed).
- ``torchao-rowwise``: torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (its FP8 MoE training
  path: E4M3 with row-wise power-of-2 scales, ``torch._scaled_grouped_mm``) for both GEMMs, on the
  same FP32 weights and BF16 rows (skipped without torchao).
- ``te-bf16``, ``te-tensorwise``, ``te-delayed``, ``te-blockwise``: two ``te.GroupedLinear``
  (gate/up, down; FP32 parameters) under ``te.autocast`` with the TE recipe of each key
  (``nemo_fp8_recipes.to_te_recipe``); ``vs TE`` is TE's time over ours for the same recipe.

Median of ``--iters`` synchronised steps after ``--warmup``, CUDA events, ``--rounds`` round-robin
passes over the variants (:func:`_timing.bench_interleaved`), and the back-to-back median. Model
TFLOP/s counts the six GEMMs: ``18 x rows x hidden x intermediate`` per step. ``rel. error`` is each
variant's output against an FP32 computation of the same experts (the norm of the difference over
the norm of the reference), taken on the fourth step (delayed scaling's first step runs on scales
of 1, before any amax is recorded): about 0.5% for BF16 and a few percent for FP8; a broken path
shows here before its time means anything. ``step GiB``: what one step allocates at its peak above
what was resident before it (the shared FP32 weights, TE's own copies and the inputs): activations,
FP8 copies, gradients. torchao's grouped GEMM accumulates in fast (FP8-precision) mode in all three
GEMMs, as torchao ships it; our recipes and TE's use split accumulation for dgrad and wgrad.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    bench_interleaved,
    benchmark_device,
    error_status,
    fmt,
    fmt_tflops,
    free_memory,
    recipe_mode,
    table,
    write_json,
)
from _torchao import torchao_status  # noqa: E402

from nemo_fp8_recipes.models.llama import GroupedExperts  # noqa: E402
from nemo_fp8_recipes.nn import Float8GroupedExperts, convert_model, sync_delayed_scaling  # noqa: E402

OURS = ("tensorwise", "blockwise", "delayed", "mxfp8")
TE = ("te-bf16", "te-tensorwise", "te-delayed", "te-blockwise")
VARIANTS = ("bf16-grouped-mm", "bf16-loop", *OURS, "torchao-rowwise", *TE)
DEFAULT = "bf16-grouped-mm,bf16-loop,tensorwise,blockwise,delayed,mxfp8,torchao-rowwise," + ",".join(TE)
FULL = dict(experts=8, top_k=2, hidden=4096, intermediate=14336, tokens=8192)  # Mixtral 8x7B's experts
SMOKE = dict(experts=4, top_k=2, hidden=128, intermediate=256, tokens=64)


def expert_sizes(rows: int, experts: int, routing: str, seed: int = 0) -> List[int]:
    """Rows per expert summing to ``rows``, each a multiple of 16 (``rows`` must be one):
    ``balanced`` equal shares, ``skewed`` Dirichlet(1) shares (seeded), rounded to 16 with the
    remainder given to the largest."""
    if rows % 16:
        raise SystemExit(
            f"tokens x top-k = {rows} routed rows must be a multiple of 16 (the FP8 grouped GEMMs' alignment)"
        )
    units = rows // 16
    if routing == "balanced":
        if units % experts:
            raise SystemExit(
                f"{rows} routed rows do not split into {experts} equal multiples of 16 (--routing balanced)"
            )
        return [rows // experts] * experts
    g = torch.Generator().manual_seed(seed)
    w = -torch.log(torch.rand(experts, generator=g, dtype=torch.float64))  # Dirichlet(1) = normalised Exp(1)
    shares = w / w.sum()
    u = [int(math.floor(float(s) * units)) for s in shares]
    u[int(torch.argmax(shares))] += units - sum(u)
    return [16 * x for x in u]


class Problem:
    """The shared inputs: FP32 master weights, BF16 routed rows and the output gradient."""

    def __init__(self, a, device: str) -> None:
        torch.manual_seed(0)
        self.device = device
        self.E, self.H, self.I = a.experts, a.hidden, a.intermediate
        self.rows = a.tokens * a.top_k
        self.sizes = a.sizes
        # the model's init: Normal(0, 0.02), the residual-branch output scaled (GroupedExperts' layout)
        self.gate_up = torch.randn(self.E, 2 * self.I, self.H, device=device) * 0.02
        self.down = torch.randn(self.E, self.H, self.I, device=device) * (0.02 / math.sqrt(2 * 32))
        # one set of FP32 master weights for every variant that reads them (none updates them;
        # each step sets their gradients to None before and after): one copy in memory, not one each
        self._params = {"gate_up_proj": nn.Parameter(self.gate_up), "down_proj": nn.Parameter(self.down)}
        self.x = [torch.randn(self.rows, self.H, device=device).to(torch.bfloat16) for _ in range(a.input_sets)]
        self.dy = [torch.randn(self.rows, self.H, device=device).to(torch.bfloat16) * 1e-3 for _ in range(a.input_sets)]
        self.offs = torch.tensor(self.sizes, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)

    def flops(self) -> float:
        return 18.0 * self.rows * self.H * self.I

    def reference(self) -> torch.Tensor:
        """The experts in FP32 on input set 0 (the error column's reference)."""
        ys = []
        for e, x in enumerate(self.x[0].float().split(self.sizes)):
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            ys.append(F.linear(F.silu(gate) * up, self.down[e]))
        return torch.cat(ys)

    def params(self) -> Dict[str, nn.Parameter]:
        """The shared FP32 master weights (the same Parameter objects for every variant)."""
        return dict(self._params)


def swiglu_experts(gemm_gu: Callable, gemm_d: Callable, x: torch.Tensor) -> torch.Tensor:
    gate, up = gemm_gu(x).chunk(2, dim=-1)
    return gemm_d(F.silu(gate) * up)


class Variant:
    """One variant: ``forward(i)`` (the experts' output on input set ``i``), its parameters, the
    context it runs in and what to do at the start of every step."""

    def __init__(self, name: str, forward, params: Sequence[nn.Parameter], context=None, on_step=None) -> None:
        self.name, self._forward, self.params = name, forward, list(params)
        self.context = context or contextlib.nullcontext
        self.on_step = on_step

    def step(self, p: Problem, i: int) -> torch.Tensor:
        for w in self.params:
            w.grad = None
        if self.on_step is not None:
            self.on_step()
        x = p.x[i % len(p.x)].detach().requires_grad_(True)
        with self.context():
            y = self._forward(x)
        y.backward(p.dy[i % len(p.dy)])
        for w in self.params:  # (the weights are shared: the next variant must not find these)
            w.grad = None
        return y


def autocast(device: str):
    return lambda: torch.autocast(device_type=device, dtype=torch.bfloat16)


def build_bf16_loop(p: Problem, device: str) -> Variant:
    w = p.params()

    def gemm(name):
        return lambda x: torch.cat([F.linear(xe, w[name][e]) for e, xe in enumerate(x.split(p.sizes))])

    fwd = lambda x: swiglu_experts(gemm("gate_up_proj"), gemm("down_proj"), x)  # noqa: E731
    return Variant("bf16-loop", fwd, w.values(), autocast(device))


def build_grouped(p: Problem, name: str, device: str) -> Variant:
    """``bf16-grouped-mm``: the trainer's ``GroupedExperts`` (built on the meta device, then given
    the shared weights); a recipe: the same module converted by ``convert_model`` (emulated off a
    GPU). Both run the experts through the module's own ``grouped_mm``."""
    holder = nn.Module()
    with torch.device("meta"):
        holder.experts = GroupedExperts(p.E, p.H, p.I)
    for wname, w in p.params().items():
        setattr(holder.experts, wname, w)
    on_step = None
    if name != "bf16-grouped-mm":
        convert_model(holder, name, emulate=device != "cuda", scaling_update="step")
        if not isinstance(holder.experts, Float8GroupedExperts):
            raise RuntimeError(f"convert_model left the experts as {type(holder.experts).__name__}")
        if name == "delayed":
            on_step = lambda: sync_delayed_scaling(holder)  # noqa: E731 - the trainer's step schedule
    m = holder.experts

    def fwd(x):
        return swiglu_experts(
            lambda t: m.grouped_mm("gate_up_proj", t, p.sizes), lambda t: m.grouped_mm("down_proj", t, p.sizes), x
        )

    return Variant(name, fwd, m.parameters(), autocast(device), on_step)


def build_torchao(p: Problem) -> Variant:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as ao_mm

    w = p.params()

    def gemm(name):
        # B_t [E, in, out], per-group column-major: the transpose of the [E, out, in] weight
        return lambda x: ao_mm(
            x, w[name].transpose(-2, -1), p.offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
        )

    return Variant("torchao-rowwise", lambda x: swiglu_experts(gemm("gate_up_proj"), gemm("down_proj"), x), w.values())


def build_te(p: Problem, key: str, device: str) -> Variant:
    import transformer_engine.pytorch as te

    from nemo_fp8_recipes.integrations.te import te_autocast, to_te_recipe

    recipe = key.split("-", 1)[1]
    te_recipe = to_te_recipe(recipe) if recipe != "bf16" else None  # built once, as a training loop does
    mods = {}
    for name, (n_in, n_out) in {"gate_up_proj": (p.H, 2 * p.I), "down_proj": (p.I, p.H)}.items():
        mod = te.GroupedLinear(p.E, n_in, n_out, bias=False, params_dtype=torch.float32, device=device)
        src = getattr(p, "gate_up" if name == "gate_up_proj" else "down")
        with torch.no_grad():
            for e in range(p.E):
                getattr(mod, f"weight{e}").copy_(src[e])
        mods[name] = mod

    def fwd(x):
        with te_autocast(te_recipe, enabled=te_recipe is not None):
            return swiglu_experts(
                lambda t: mods["gate_up_proj"](t, p.sizes), lambda t: mods["down_proj"](t, p.sizes), x
            )

    params = [w for m in mods.values() for w in m.parameters()]
    return Variant(key, fwd, params, autocast(device))


def te_version() -> Optional[str]:
    """The installed Transformer Engine's version (looked up without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def variant_skip(name: str, device: str, ao_reason: str) -> Optional[str]:
    """Why ``name`` cannot run here (``skipped: ...``), or None."""
    if name in OURS:
        how, reason = recipe_mode(name, device)
        return f"skipped: {reason}" if how == "skipped" else None
    if name == "torchao-rowwise":
        if ao_reason:
            return ao_reason
        if device != "cuda":
            return "skipped: torchao's FP8 grouped GEMM needs a CUDA GPU (torch._scaled_grouped_mm)"
        return None
    if name in TE:
        from nemo_fp8_recipes.integrations.te import te_available

        ok, why = te_available()
        if not ok:
            return f"skipped: Transformer Engine not importable ({why})"
        if device != "cuda":
            return "skipped: te.GroupedLinear needs a CUDA GPU"
    return None


def build(name: str, p: Problem, device: str) -> Variant:
    if name == "bf16-loop":
        return build_bf16_loop(p, device)
    if name == "bf16-grouped-mm" or name in OURS:
        return build_grouped(p, name, device)
    if name == "torchao-rowwise":
        return build_torchao(p)
    return build_te(p, name, device)


def peak_bytes(v: Variant, p: Problem, device: str) -> Optional[int]:
    """What one step allocates above what was resident before it (weights of every variant and
    inputs): activations, FP8 copies, gradients; None on a CPU."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    v.step(p, 0)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=None, help="number of experts (default 8; --smoke: 4)")
    ap.add_argument("--top-k", type=int, default=None, help="experts per token (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="model width H (default 4096, Mixtral 8x7B's)")
    ap.add_argument("--intermediate", type=int, default=None, help="expert FFN width I (default 14336)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens routed, rows = tokens x top-k (default 8192)")
    ap.add_argument("--routing", choices=("balanced", "skewed"), default="balanced")
    ap.add_argument("--variants", default=DEFAULT, help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="round-robin passes over the variants")
    ap.add_argument("--window", type=int, default=4, help="steps per back-to-back sample")
    ap.add_argument("--input-sets", type=int, default=2, help="rotating input sets (L2 cache)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, FP8 emulated: the code path only")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    if a.rounds < 1 or a.iters < 1:
        ap.error("--rounds and --iters must be at least 1")
    a.variants = variants
    for k, v in (SMOKE if a.smoke else FULL).items():  # the shapes not given
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.smoke:
        a.warmup, a.iters, a.rounds, a.window = 1, 2, 1, 2
    if min(a.experts, a.top_k, a.hidden, a.intermediate, a.tokens) < 1 or a.top_k > a.experts:
        ap.error("--experts, --top-k, --hidden, --intermediate and --tokens must be positive, --top-k <= --experts")
    try:  # the rows per expert, checked once here: Problem takes them from a.sizes
        a.sizes = expert_sizes(a.tokens * a.top_k, a.experts, a.routing, seed=0)
    except SystemExit as e:
        ap.error(str(e))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device = benchmark_device(a.smoke)
    p = Problem(a, device)
    ao_version, ao_reason = torchao_status()
    ref = p.reference()
    rows: Dict[str, dict] = {}
    built: Dict[str, Variant] = {}
    for name in a.variants:
        row = rows[name] = {"variant": name, "status": "ok"}
        skip = variant_skip(name, device, ao_reason)
        if skip:
            row["status"] = skip
            continue
        try:
            v = build(name, p, device)
            for i in range(3):  # warm-up steps; delayed scaling's history is filled after the first
                v.step(p, i + 1)
            y = v.step(p, 0).detach()
            row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
            row["step_gib"] = None if (b := peak_bytes(v, p, device)) is None else b / 2**30
            built[name] = v
        except Exception as e:  # noqa: BLE001 - one variant's failure is its row, not the run's end
            row["status"] = error_status(e)
            free_memory(dynamo=False)
    t0 = time.time()
    errors: Dict[str, BaseException] = {}
    timings = bench_interleaved(
        {k: (lambda i, v=v: v.step(p, i)) for k, v in built.items()},
        a.input_sets,
        device,
        rounds=a.rounds,
        warmup=a.warmup,
        iters=a.iters,
        window=a.window,
        errors=errors,
    )
    for k, e in errors.items():
        rows[k]["status"] = error_status(e)
    for k, t in timings.items():
        rows[k].update(ms=t["ms"], ms_b2b=t["ms_b2b"], tflops=p.flops() / (t["ms"] * 1e-3) / 1e12)
    base = rows.get("bf16-grouped-mm", {}).get("ms")
    for k, row in rows.items():
        if "ms" not in row:
            continue
        row["vs_bf16"] = base / row["ms"] if base else None
        te_key = "te-" + ("bf16" if k in ("bf16-loop", "bf16-grouped-mm") else k)
        te_ms = rows.get(te_key, {}).get("ms")
        row["vs_te"] = te_ms / row["ms"] if te_ms and not k.startswith("te-") else None
    header = {
        "experts": a.experts,
        "top_k": a.top_k,
        "hidden": a.hidden,
        "intermediate": a.intermediate,
        "tokens": a.tokens,
        "rows": p.rows,
        "routing": a.routing,
        "sizes": p.sizes,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "torchao": ao_version,
        "transformer_engine": te_version(),
        "smoke": a.smoke,
        "seconds": round(time.time() - t0, 1),
    }
    print(
        f"MoE experts fwd+bwd: {a.experts} experts, top-{a.top_k}, {a.hidden} -> {a.intermediate} -> {a.hidden}, "
        f"{a.tokens} tokens ({p.rows} rows, {a.routing}: {p.sizes}), {header['device']}"
        + ("  [smoke: CPU, emulated, no timing claims]" if a.smoke else "")
    )
    print(
        table(
            [
                "variant",
                "ms",
                "ms back to back",
                "model TFLOP/s",
                "vs bf16-grouped-mm",
                "vs TE",
                "step GiB",
                "rel. error",
                "status",
            ],
            [
                [
                    r["variant"],
                    fmt(r.get("ms"), ".3f"),
                    fmt(r.get("ms_b2b"), ".3f"),
                    fmt_tflops(r.get("tflops")),
                    fmt(r.get("vs_bf16"), ".2f", "×"),
                    fmt(r.get("vs_te"), ".2f", "×"),
                    fmt(r.get("step_gib"), ".2f"),
                    fmt(None if r.get("rel_err") is None else 100 * r["rel_err"], ".2f", "%"),
                    r["status"],
                ]
                for r in rows.values()
            ],
        )
    )
    write_json(a.out, {"header": header, "results": list(rows.values())})
    failed = [k for k, r in rows.items() if not (r["status"] == "ok" or r["status"].startswith("skipped"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
