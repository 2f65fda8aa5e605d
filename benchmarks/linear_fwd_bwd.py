"""FP8 linear fwd+bwd vs BF16 at Llama 3 MLP shapes (8192 tokens), quantisation included.

    python benchmarks/linear_fwd_bwd.py --sizes 8b,70b,405b --out results/linear.json

For each size the up-projection (d -> ffn) and down-projection (ffn -> d) GEMMs run forward and
backward: BF16 ``nn.Linear`` under autocast vs ``Float8Linear`` per recipe (real FP8 GEMMs, the
weight quantised once and cached as in training between optimizer steps). One process, CUDA
events, median, inputs rotated, ratios from the same run; peak memory per variant. The
variants are timed round-robin (``--rounds`` passes, each timing every variant in turn), so a
GPU whose clock drifts during the run (warming up, meeting its power cap) slows them alike
rather than penalising the ones measured last; all variants stay resident meanwhile (at 405B
about 14 GiB of FP32 weights and gradients each). Two timings:
"ms (median)" synchronises after every step (so each step also pays the host's latency before
its first kernel), "back to back" queues ``--window`` steps between two events and synchronises
once, as a training loop that does not wait on the GPU every step (median over windows).
Delayed scaling runs in two schedules: ``delayed`` (the module default, ``lazy``: each operand
updates its amax history right before its next quantisation, one kernel) and ``delayed-step``
(what the embedded trainer uses: histories advance once per optimizer step in
``sync_delayed_scaling``, which is part of the timed step here).
``--breakdown`` also profiles each variant (``torch.profiler``) and prints where a step's time
goes: GEMM kernels, the Triton quantisers, everything else (ReLU, gradient accumulation,
copies), with the most expensive kernels by name — the measured counterpart of the bytes/FLOPs
account in docs/internals/kernels.md — and, on a GPU, the kernel timeline of six steps queued back to
back (busy vs idle time per step: the first step's idle is the host's head start, the later
steps' idle is where the GPU still waited for the host; kernels per step), of six steps with a
synchronisation after each as "ms (median)" runs them (the lead from the synchronisation to the
first kernel, the gaps inside the step and the kernel pairs around them), and with
``--cuda-graph`` of the graph replays. While each timing runs, the GPU's SM clock, power draw and any
clock-event reasons (power cap, thermal) are sampled through NVML (``nvidia-ml-py``; columns
"SM clock, power", JSON ``gpu`` / ``gpu_b2b``), so a slower run can be told apart from a
throttled GPU.
``--cuda-graph`` adds a third timing: each step (forward, backward, gradient accumulation, for
every variant including BF16) captured once per input set into a CUDA graph and replayed — the
GPU's time alone, without the host's Python, autograd and launch overhead, as a training loop
with CUDA graphs (Megatron's ``--enable-cuda-graph``, ``torch.compile(mode="reduce-overhead")``)
runs it. It separates what the host costs from what the kernels cost; a variant that cannot be
captured says why instead of giving a number.
``--fused-wgrad`` adds, for BF16 and every recipe, a variant ``<name>+fused`` whose weight
gradients accumulate inside the wgrad GEMM (Megatron's ``gradient_accumulation_fusion``): the FP8
linears through :func:`nemo_fp8_recipes.nn.set_wgrad_accumulation_fusion` (cuBLASLt FP8 GEMM with
``beta = 1`` into the FP32 ``weight.grad``), BF16 through ``torch.addmm(..., out_dtype=float32)``
into it. The step keeps accumulating into the same gradients (as micro-batches of one optimizer
step do), so every step after the first pays the accumulation: unfused, as a separate kernel over
the FP32 gradient. "vs BF16" stays the ratio to plain BF16; the column "vs BF16+fused" compares
with the fused BF16 baseline, like for like.
``--smoke``: tiny emulated CPU run for CI (no timing claims).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    bench_interleaved,
    capture_graphs,
    gpu_cell,
    gpu_monitor,
    table,
    write_json,
)

from nemo_fp8_recipes.nn import (  # noqa: E402
    Float8Linear,
    set_wgrad_accumulation_fusion,
    sync_delayed_scaling,
)
from nemo_fp8_recipes.recipes import check_supported, get_recipe  # noqa: E402

SHAPES = {"8b": (4096, 14336), "70b": (8192, 28672), "405b": (16384, 53248)}
FUSED = "+fused"


class _BF16FusedLinearFn(torch.autograd.Function):
    """BF16 ``x · Wᵀ`` (the FP32 weight cast to BF16, as autocast casts it) whose weight gradient
    is added into an existing FP32 ``weight.grad`` by the GEMM (``addmm`` with an FP32 output):
    the BF16 baseline with gradient-accumulation fusion."""

    @staticmethod
    def forward(ctx, x, weight):
        w16 = weight.to(x.dtype)
        ctx.save_for_backward(x, w16)
        ctx.weight = weight
        return x @ w16.t()

    @staticmethod
    def backward(ctx, dy):
        x, w16 = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        g = ctx.weight.grad
        dx = dy @ w16 if ctx.needs_input_grad[0] else None
        if g is None:
            return dx, torch.mm(dy2.t(), x2, out_dtype=torch.float32) if dy2.is_cuda else dy2.t().float() @ x2.float()
        if dy2.dtype == g.dtype:
            g.addmm_(dy2.t(), x2)
        else:
            torch.addmm(g, dy2.t(), x2, out_dtype=torch.float32, out=g)
        return dx, None


class _BF16FusedLinear(torch.nn.Linear):
    def forward(self, x):
        return _BF16FusedLinearFn.apply(x, self.weight)


def run_size(a, dev: str, size: str, d: int, f: int) -> list:
    """The rows of one size: phase 1 builds every variant, takes its peak memory and captures its
    graphs; phase 2 times them round-robin; then the profiles. Everything it builds is freed when
    it returns (before the next size's baseline is read)."""
    res = []
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    xs = [torch.randn(a.tokens, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
    dys = [torch.randn(a.tokens, d, device=dev, dtype=dt) * 1e-3 for _ in range(3)]

    def make(recipe):
        fused = recipe.endswith(FUSED)
        recipe = recipe.removesuffix(FUSED)
        cls = _BF16FusedLinear if fused and recipe == "bf16" else torch.nn.Linear
        up = cls(d, f, bias=False, device=dev)
        down = cls(f, d, bias=False, device=dev)
        if recipe == "bf16":
            return up, down
        r = get_recipe(recipe.removesuffix("-step"))
        emulate = not check_supported(r, dev)[0] or dev == "cpu"
        mods = (Float8Linear.from_linear(up, r, emulate=emulate), Float8Linear.from_linear(down, r, emulate=emulate))
        if recipe.endswith("-step"):
            for m in mods:
                m.reconfigure(scaling_update="step")
        if fused:
            set_wgrad_accumulation_fusion(torch.nn.ModuleList(mods))
        return mods

    # phase 1, one variant at a time: build it, its peak memory (as if it were alone: the
    # variants built before it stay resident for the interleaved timing and are subtracted),
    # its CUDA graphs
    for x in xs:  # the inputs' gradients, accumulated by every variant, count as inputs
        x.grad = torch.zeros_like(x)
    if dev == "cuda":
        torch.cuda.synchronize()
    inputs_bytes = torch.cuda.memory_allocated() if dev == "cuda" else 0
    steps, graphs, info = {}, {}, {}
    for recipe in variants(a):
        others = 0
        if dev == "cuda":
            torch.cuda.synchronize()
            others = torch.cuda.memory_allocated() - inputs_bytes  # the variants built before
        up, down = make(recipe)
        model = torch.nn.ModuleList([up, down])
        state = {"capturing": False}

        def step(
            i, up=up, down=down, model=model, state=state, step_sync=recipe != "bf16" and recipe.endswith("-step")
        ):
            # (no autocast weight-cast cache while a graph captures: its cached copies would be
            # allocated inside the capture)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda", cache_enabled=not state["capturing"]):
                y = down(torch.relu(up(xs[i])))
            y.backward(dys[i])
            if step_sync:
                sync_delayed_scaling(model)

        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(5):
            step(i % 3)
        if dev == "cuda":
            torch.cuda.synchronize()
        # the peak of the eager steps, read before any graph capture adds its private pool
        peak = (torch.cuda.max_memory_allocated() - others) / 2**30 if dev == "cuda" else float("nan")
        graph_err = []
        if a.cuda_graph and dev == "cuda":
            state["capturing"] = True
            graphs[recipe] = capture_graphs(step, 3, errors=graph_err)
            state["capturing"] = False
        steps[recipe] = step
        info[recipe] = {"peak": peak, "graph_err": graph_err}
    # phase 2: the timings, every variant in each of --rounds round-robin passes
    times = bench_interleaved(
        steps,
        3,
        dev,
        rounds=a.rounds,
        warmup=5,
        iters=a.iters,
        window=a.window,
        b2b_warmup=2,
        graphs=graphs,
        monitor=gpu_monitor(dev),
    )
    base = times["bf16"]
    base_fused = times.get("bf16" + FUSED)
    for recipe, step in steps.items():
        t = times[recipe]
        ms, ms_b2b, graph_ms = t["ms"], t["ms_b2b"], t["ms_graph"]
        flops = 3 * 2 * 2 * a.tokens * d * f
        res.append(
            {
                "size": size,
                "recipe": recipe,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "speedup": base["ms"] / ms,
                "ms_b2b": ms_b2b,
                "speedup_b2b": base["ms_b2b"] / ms_b2b,
                "speedup_vs_bf16_fused": base_fused["ms"] / ms if base_fused else None,
                "speedup_b2b_vs_bf16_fused": base_fused["ms_b2b"] / ms_b2b if base_fused else None,
                "peak_gib": info[recipe]["peak"],
                "gpu": t["gpu"],
                "gpu_b2b": t["gpu_b2b"],
                "gpu_reason": t["gpu_reason"],
                "samples": t["samples"],
                "rounds": a.rounds,
            }
        )
        if a.cuda_graph:
            graph_err = info[recipe]["graph_err"]
            res[-1].update(
                ms_graph=graph_ms,
                speedup_graph=(base["ms_graph"] / graph_ms if graph_ms and base["ms_graph"] else None),
                graph_status="ok" if graph_ms else (graph_err[0] if graph_err else "CUDA only"),
            )
        if a.breakdown:
            from profiling.timeline import device_time_breakdown, gpu_timeline

            res[-1]["breakdown"] = device_time_breakdown(step, 3, cuda=dev == "cuda", top=30)
            res[-1]["timeline"] = gpu_timeline(step, 3) if dev == "cuda" else None
            res[-1]["timeline_sync"] = gpu_timeline(step, 3, sync_each=True) if dev == "cuda" else None
            g = graphs.get(recipe)
            res[-1]["timeline_graph"] = gpu_timeline(lambda i, g=g: g[i].replay(), 3) if g else None
    return res


def parse_shape(size: str) -> tuple:
    """``8b`` -> its Llama 3 MLP shape; ``768x2048`` -> (768, 2048)."""
    if size in SHAPES:
        return SHAPES[size]
    d, sep, f = size.lower().partition("x")
    if sep and d.isdigit() and f.isdigit() and int(d) > 0 and int(f) > 0:
        return int(d), int(f)
    raise ValueError(f"--sizes: {size!r} is neither one of {', '.join(SHAPES)} nor DxF (e.g. 768x2048)")


def variants(a) -> list:
    """BF16 first, then the recipes; with --fused-wgrad each followed by its fused variant."""
    names = ["bf16"] + [r for r in a.recipes.split(",") if r]
    return [v for n in names for v in ((n, n + FUSED) if a.fused_wgrad else (n,))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        default="8b,70b,405b",
        help="Llama 3 MLP shapes (8b, 70b, 405b) or any 'DxF' (model width x FFN width, "
        "e.g. 768x2048 for llama3_150m), comma-separated (default: %(default)s)",
    )
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument(
        "--recipes",
        default="tensorwise,delayed,delayed-step,blockwise",
        help="FP8 recipes to time against BF16; 'delayed-step' = delayed scaling with the "
        "once-per-step history update (default: %(default)s)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--window",
        type=int,
        default=4,
        help="steps queued back to back per timed window for the 'back to back' columns "
        "(no synchronisation between them, as in a training loop; default %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="round-robin passes over the variants: each pass times every variant in turn "
        "(--iters / rounds samples each), so clock drift over the run (the GPU warming "
        "up, meeting its power cap) slows every variant alike; 1 = one variant after "
        "the other (default %(default)s)",
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time each step replayed from a CUDA graph (GPU time without host overhead; "
        "CUDA only). Every variant's three graphs stay resident with their memory pools "
        "during the round-robin timing: at 405B time fewer --recipes per run",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also profile each variant and report device time per kernel class "
        "(GEMM / Triton quantisers / other) and the top kernels, and trace the GPU's "
        "timeline (busy and idle time per step, back to back and synchronised)",
    )
    p.add_argument(
        "--fused-wgrad",
        action="store_true",
        help="also time every variant (BF16 included) with its weight-gradient accumulation "
        "fused into the wgrad GEMM ('<name>+fused'; see above)",
    )
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.fused_wgrad and torch.torch_version.TorchVersion(torch.__version__) < (2, 8):
        p.error(
            f"--fused-wgrad needs torch >= 2.8 (its BF16 baseline uses mm/addmm with out_dtype); "
            f"this is {torch.__version__}"
        )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        shapes = {k: parse_shape(k) for k in a.sizes.split(",") if k}
    except ValueError as e:
        p.error(str(e))
    if a.smoke:
        shapes, a.tokens, a.iters = {"tiny": (256, 512)}, 256, 2
    res, failed = [], {}
    for size, (d, f) in shapes.items():
        try:
            res += run_size(a, dev, size, d, f)
        except torch.cuda.OutOfMemoryError as e:
            # every variant (and with --cuda-graph its graphs' memory pools) stays resident while
            # the variants are timed round-robin: say so, go on with the next size
            failed[size] = (
                f"out of memory with all {len(variants(a))} variants resident"
                f"{' and their CUDA graphs' if a.cuda_graph else ''}: time fewer --recipes per run"
                f"{' or leave out --cuda-graph' if a.cuda_graph else ''} "
                f"({str(e).splitlines()[0][:160]})"
            )
            print(f"size {size}: {failed[size]}", file=sys.stderr)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    if not res:
        print("nothing was timed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()), file=sys.stderr)
        return 1
    rows = [
        (
            r["size"],
            r["recipe"],
            f"{r['ms']:.2f}",
            f"{r['tflops']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['ms_b2b']:.2f}",
            f"{r['speedup_b2b']:.2f}x",
        )
        + ((f"{r['speedup_b2b_vs_bf16_fused']:.2f}x",) if a.fused_wgrad else ())
        + (
            (
                ("-" if r["ms_graph"] is None else f"{r['ms_graph']:.2f}"),
                ("-" if r["speedup_graph"] is None else f"{r['speedup_graph']:.2f}x"),
            )
            if a.cuda_graph
            else ()
        )
        + (f"{r['peak_gib']:.1f}", gpu_cell(r["gpu"]), gpu_cell(r["gpu_b2b"]))
        for r in res
    ]
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (emulated, smoke)"
    last = res[-1]
    no_gpu_log = "" if last["gpu"] or dev != "cuda" else f"; GPU clocks/power not recorded: {last['gpu_reason']}"
    print(f"{name}, torch {torch.__version__}, {a.tokens} tokens, up+down MLP projections fwd+bwd{no_gpu_log}\n")
    print(
        table(
            [
                "size",
                "recipe",
                "ms (median)",
                "TFLOP/s",
                "vs BF16",
                f"ms/step, {a.window} back to back",
                "vs BF16, back to back",
            ]
            + (["vs BF16+fused, back to back"] if a.fused_wgrad else [])
            + (["ms, CUDA graph", "vs BF16, CUDA graph"] if a.cuda_graph else [])
            + ["peak GiB", "SM clock, power (sync)", "SM clock, power (b2b)"],
            rows,
        )
    )
    failed_graphs = [r for r in res if a.cuda_graph and r["graph_status"] != "ok"]
    if failed_graphs:
        print(
            "\nno CUDA-graph time for: "
            + "; ".join(f"{r['size']} {r['recipe']}: {r['graph_status']}" for r in failed_graphs)
        )
    if a.breakdown:
        from profiling.timeline import breakdown_table, timeline_table

        print("\n" + breakdown_table(res, ["size", "recipe"], ("gemm", "quantise (Triton)", "other")))
        timed = [r for r in res if r.get("timeline")]
        if timed:
            print("\n" + timeline_table(timed, ["size", "recipe"], graph=a.cuda_graph))
    write_json(
        a.out, {"device": name, "torch": torch.__version__, "tokens": a.tokens, "results": res, "failed_sizes": failed}
    )
    if failed:
        print("\nnot timed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
