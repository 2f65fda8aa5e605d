"""FP8 GEMM TFLOP/s by recipe vs BF16 ``torch.mm`` at Llama 3 MLP shapes (GEMM only).

    python benchmarks/gemm_tflops.py --sizes 8b,70b,405b --out results/gemm_tflops.json

For each model size (``dim``, ``ffn_dim`` read from ``configs/model/``) and M = 8192 tokens, the
two MLP projections and their three GEMMs (docs/recipes.md, ``Y = X·Wᵀ``):

==========  ================  ============================  ===========================
projection  weight ``[N,K]``  GEMM                          shape ``out = A·Bᵀ``
==========  ================  ============================  ===========================
fc1         gate or up        fprop ``X·Wᵀ``                 [M, ffn] = [M, d]·[ffn, d]ᵀ
            (d -> ffn)        dgrad ``dY·W``                 [M, d] = [M, ffn]·[d, ffn]ᵀ
                              wgrad ``dYᵀ·X``                [ffn, d] = [ffn, M]·[d, M]ᵀ
fc2         down (ffn -> d)   the same three, N = d, K = ffn
==========  ================  ============================  ===========================

fc1 is **one** of the two separate gate (``w1``) and up (``w3``) projections of the package's
Llama (they are separate ``nn.Linear``s there; a training step runs that GEMM twice);
``--fc1 fused`` times the fused gate+up GEMM (N = 2·ffn) that Megatron/TE use instead.

Variants: ``bf16`` (``torch.mm`` on BF16 tensors, BF16 out, the GEMMs autograd runs for
``F.linear``); ``per-tensor`` (the ``tensorwise`` and ``delayed`` recipes share it: one FP32 scale
per operand, E4M3 X/W, E5M2 dY, fast accumulation in fprop only); ``blockwise`` (1x128 X/dY tiles
x 128x128 W blocks; 1x128 x 1x128 for wgrad; FP32 promotion); ``mxfp8`` (1x32 E8M0; real only on
Blackwell — elsewhere a row says skipped, with ``check_supported``'s reason). Operands are
quantised before timing with the package's quantisers (``quantize_auto``: the Triton kernels on
CUDA), exactly as ``Float8Linear`` lays them out, so only ``scaled_matmul`` is timed (it includes
the few-microsecond scale-layout copies it makes per call). Output dtypes are the package's:
BF16 for fprop/dgrad, FP32 for the FP8 wgrad (the FP32 master gradient). One process, CUDA events,
median of ``--iters`` after ``--warmup``, two rotating operand sets. JSON rows give each GEMM as
``M`` x ``N`` output with contraction ``K``. A variant that raises becomes an error row (the
run goes on, exit status 1). ``--smoke``: tiny emulated CPU run for CI (no timing claims).

``--energy SECONDS``: after the timing of each GEMM, every variant also runs back to back for
about SECONDS, round-robin twice, between two reads of the board's energy counter (NVML):
joules per call, the mean draw, GFLOP per joule and the SM clock. At the GPU's power cap a
GEMM's throughput is ``cap / (J per FLOP)``, so this says which kernels the cap holds and by how
much (``energy`` in each JSON row; a second table).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    bench,
    benchmark_device,
    error_status,
    fmt,
    fmt_tflops,
    recipe_mode,
    table,
    write_json,
)

from nemo_fp8_recipes.models import load_model_config  # noqa: E402
from nemo_fp8_recipes.nn.gemms import contiguous_codes  # noqa: E402
from nemo_fp8_recipes.quant import scaled_matmul  # noqa: E402
from nemo_fp8_recipes.quant.dispatch import quantize_auto  # noqa: E402
from nemo_fp8_recipes.recipes import get_recipe  # noqa: E402

MODELS = {"8b": "llama3_8b", "70b": "llama3_70b", "405b": "llama31_405b"}
#: benchmark variant -> the registry recipe whose GEMM it times (None: BF16 torch.mm)
VARIANTS = {"bf16": None, "per-tensor": "tensorwise", "blockwise": "blockwise", "mxfp8": "mxfp8"}
PASSES = ("fprop", "dgrad", "wgrad")
N_SETS = 2


def fp8_operands(recipe, x, w, dy, gemm: str):
    """``(A, B, fast_accum, out_dtype)`` of one FP8 GEMM ``A·Bᵀ``, each operand quantised along
    the GEMM's contraction dim with the recipe's format, group and scale rule."""
    r = recipe

    def q(t, f, g, dim):
        # contiguous codes, scales as the quantiser wrote them: what Float8Linear hands the GEMM
        return contiguous_codes(quantize_auto(t, f, g, r.scale_rounding, dim=dim))

    if gemm == "fprop":  # X [M,K] · W [N,K]ᵀ, contraction K
        return (
            q(x, r.input_format, r.input_granularity, -1),
            q(w, r.weight_format, r.weight_granularity, -1),
            r.fprop.fast_accum,
            torch.bfloat16,
        )
    if gemm == "dgrad":  # dY [M,N] · (Wᵀ [K,N])ᵀ, contraction N
        return (
            q(dy, r.grad_format, r.grad_granularity, -1),
            q(w, r.weight_format, r.weight_granularity, 0),
            r.dgrad.fast_accum,
            torch.bfloat16,
        )
    # wgrad: dYᵀ [N,M] · (Xᵀ [K,M])ᵀ, contraction M (tokens); FP32 out like Float8Linear
    return (
        q(dy, r.grad_format, r.grad_granularity, 0),
        q(x, r.input_format, r.input_granularity, 0),
        r.wgrad.fast_accum,
        torch.float32,
    )


def bf16_gemm(x, w, dy, gemm: str):
    """The BF16 GEMM autograd runs for ``F.linear`` (transposes are views, no copies)."""
    if gemm == "fprop":
        return torch.mm(x, w.t())
    if gemm == "dgrad":
        return torch.mm(dy, w)
    return torch.mm(dy.t(), x)


def gemm_shape(m: int, n: int, k: int, gemm: str):
    """``(rows, cols, contraction)`` of the GEMM's output for a linear ``[M,K] -> [M,N]``."""
    return {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[gemm]


def _gemm_fn(variant: str, mode: str, sets, gemm: str):
    """``(fn(i), note)``: the timed call on operand set ``i`` and a note on how it runs. FP8
    operands are quantised here, before timing."""
    recipe = VARIANTS[variant]
    if recipe is None:
        return (lambda i: bf16_gemm(*sets[i], gemm)), "torch.mm, BF16 out"
    ops = [fp8_operands(get_recipe(recipe), *s, gemm) for s in sets]
    emulate = mode == "emulated"

    def run(i):
        qa, qb, fast, out_dtype = ops[i]
        return scaled_matmul(qa, qb, emulate=emulate, out_dtype=out_dtype, fast_accum=fast)

    _, _, fast, out_dtype = ops[0]
    note = f"{mode}, {'BF16' if out_dtype == torch.bfloat16 else 'FP32'} out{', fast accum' if fast else ''}"
    return run, note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8b,70b,405b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--tokens", type=int, default=8192, help="M, tokens per GEMM")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS))
    p.add_argument(
        "--fc1",
        choices=("separate", "fused"),
        default="separate",
        help="separate: one of gate/up (N = ffn, as the package's Llama); fused: N = 2*ffn",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--energy",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run each variant back to back for about SECONDS (round-robin, twice) and "
        "read the board's energy counter: J per call, W, GFLOP/J, SM clock (0: off)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny emulated CPU run (no timing claims)")
    a = p.parse_args(argv)
    if not (math.isfinite(a.energy) and a.energy >= 0):
        p.error("--energy is a duration in seconds (0: off)")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # every ratio is against BF16 on the same shape
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in MODELS:
            p.error(f"unknown size {s!r}; valid: {', '.join(MODELS)}")
    dev = benchmark_device(a.smoke)
    shapes = {s: (load_model_config(MODELS[s]).dim, load_model_config(MODELS[s]).ffn_dim) for s in sizes}
    if a.smoke:
        shapes, a.tokens, a.warmup, a.iters = {"tiny": (256, 384)}, 256, 1, 2
    cuda = dev == "cuda"

    modes = {v: recipe_mode(VARIANTS[v] or "bf16", dev) for v in variants}
    name = torch.cuda.get_device_name() if cuda else "CPU (emulated FP8, smoke: no timing claims)"
    header = {
        "benchmark": "gemm_tflops",
        "device": name,
        "torch": torch.__version__,
        "tokens": a.tokens,
        "fc1": a.fc1,
        "warmup": a.warmup,
        "iters": a.iters,
        "energy_s": a.energy,
    }
    res = []
    failed = False
    for v in variants:
        mode, reason = modes[v]
        if mode == "skipped":
            res.append(
                {
                    "size": "all",
                    "gemm": "all",
                    "pass": "all",
                    "variant": v,
                    "recipe": VARIANTS[v],
                    "status": f"skipped: {reason}",
                    "ms": None,
                    "tflops": None,
                    "speedup": None,
                }
            )
    fc1_label = "fc1 (gate+up fused)" if a.fc1 == "fused" else "fc1 (gate or up)"
    for size, (d, f) in shapes.items():
        m = a.tokens
        for proj, n, k in ((fc1_label, 2 * f if a.fc1 == "fused" else f, d), ("fc2 (down)", d, f)):
            g = torch.Generator(device=dev).manual_seed(0)
            sets = [
                (
                    torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16),
                    (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16),
                    (torch.randn(m, n, device=dev, generator=g) * 1e-3).to(torch.bfloat16),
                )
                for _ in range(N_SETS)
            ]
            for gemm in PASSES:
                out_r, out_c, contr = gemm_shape(m, n, k, gemm)
                flops = 2.0 * out_r * out_c * contr
                base_ms = None
                runs, rows_here = {}, {}
                for v in variants:
                    mode, reason = modes[v]
                    if mode == "skipped":
                        continue
                    row = {
                        "size": size,
                        "gemm": proj,
                        "pass": gemm,
                        "M": out_r,
                        "N": out_c,
                        "K": contr,
                        "variant": v,
                        "recipe": VARIANTS[v],
                        "mode": mode,
                    }
                    try:
                        run, note = _gemm_fn(v, mode, sets, gemm)
                        ms = bench(run, N_SETS, warmup=a.warmup, iters=a.iters, cuda=cuda)
                        base_ms = ms if VARIANTS[v] is None else base_ms
                        row.update(
                            status="ok",
                            note=note,
                            ms=ms,
                            tflops=flops / ms / 1e9,
                            speedup=None if base_ms is None else base_ms / ms,
                        )
                        if a.energy:
                            runs[v], rows_here[v] = run, row
                    except Exception as e:  # noqa: BLE001 - record it, go on with the others
                        traceback.print_exc()
                        failed = True
                        row.update(status=error_status(e), ms=None, tflops=None, speedup=None)
                    run = None
                    res.append(row)
                    write_json(a.out, dict(header, results=res))
                if runs:  # every variant that ran, back to back, round-robin, at the sustained draw
                    from profiling.nvml import energy_window

                    for v, e in energy_window(runs, N_SETS, dev, seconds=a.energy).items():
                        e["tflops"] = flops / e["ms"] / 1e9
                        e["gflop_per_j"] = None if e["j"] is None else flops / e["j"] / 1e9
                        rows_here[v]["energy"] = e
                    runs = None
                    write_json(a.out, dict(header, results=res))
            del sets
            if cuda:
                torch.cuda.empty_cache()

    measured = [v for v in variants if modes[v][0] != "skipped"]
    headers = ["size", "GEMM", "pass", "out [rows x cols], contraction", "bf16 ms", "bf16 TFLOP/s"]
    headers += [f"{v} TFLOP/s (vs BF16)" for v in measured if v != "bf16"]
    rows = []
    ok = [r for r in res if r["status"] == "ok"]
    keys = list(dict.fromkeys((r["size"], r["gemm"], r["pass"]) for r in ok))
    for key in keys:
        by_v = {r["variant"]: r for r in ok if (r["size"], r["gemm"], r["pass"]) == key}
        b = by_v.get("bf16") or next(iter(by_v.values()))
        bf = by_v.get("bf16", {})
        row = [*key, f"{b['M']} x {b['N']}, {b['K']}", fmt(bf.get("ms"), ".3f"), fmt_tflops(bf.get("tflops"))]
        for v in measured:
            if v != "bf16":
                rv = by_v.get(v)
                row.append("-" if rv is None else f"{fmt_tflops(rv['tflops'])} ({fmt(rv['speedup'], '.2f', 'x')})")
        rows.append(row)
    print(
        f"{name}, torch {torch.__version__}, M = {a.tokens} tokens, GEMM only (operands "
        f"pre-quantised), median of {a.iters}\n"
    )
    print(table(headers, rows))
    if a.energy:
        print(
            f"\nEnergy: each variant back to back for about {a.energy:g} s, round-robin twice (medians); "
            "TFLOP/s, mean draw, GFLOP per joule, SM clock\n"
        )
        e_rows = []
        for key in keys:
            by_v = {r["variant"]: r for r in ok if (r["size"], r["gemm"], r["pass"]) == key and "energy" in r}
            row = list(key)
            for v in measured:
                e = by_v.get(v, {}).get("energy")
                if e is None:
                    row.append("-")
                    continue
                g = e.get("gpu") or {}
                row.append(
                    f"{fmt_tflops(e['tflops'])}, {fmt(e['w'], '.0f', ' W')}, "
                    f"{fmt(e['gflop_per_j'], '.0f', ' GFLOP/J')}, {fmt(g.get('sm_mhz_median'), '.0f', ' MHz')}"
                )
            e_rows.append(row)
        print(table(["size", "GEMM", "pass"] + list(measured), e_rows))
        reasons = sorted({r["energy"]["energy_reason"] for r in ok if r.get("energy", {}).get("energy_reason")})
        if reasons:
            print("energy not read: " + "; ".join(reasons))
    other = [r for r in res if r["status"] != "ok"]
    if other:
        print()
        print(
            table(
                ["size", "GEMM", "pass", "variant", "status"],
                [(r["size"], r["gemm"], r["pass"], r["variant"], r["status"]) for r in other],
            )
        )
    write_json(a.out, dict(header, results=res))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
