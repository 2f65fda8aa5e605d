"""Host (CPU) time of one FP8 MLP step, and where it goes: the Python and launch overhead that
GPU-side timings do not show.

    python benchmarks/profiling/host_profile.py --recipes tensorwise,delayed,blockwise --out results/host.json

The up (d -> ffn) and down (ffn -> d) projections of ``linear_fwd_bwd.py`` run forward and
backward (BF16 autocast, ``Float8Linear`` with the Triton quantisers and real FP8 GEMMs) on so
few tokens (``--tokens``, default 256) that the GPU finishes every kernel before the host has
launched the next: the step time is then the host's. Reported per recipe: microseconds per step
(``perf_counter`` over ``--steps`` steps, one synchronisation at the end), and a ``cProfile`` of
another ``--steps`` steps — the functions with the most time of their own (``--top``), per step.
The FP8 weights are quantised once and cached, as between two optimizer steps (a micro-batch
of gradient accumulation, the same as ``linear_fwd_bwd.py``). Compare with that benchmark's
GPU-side step at 8192 tokens (and its ``--cuda-graph`` column, the GPU time without the host).
Host timings differ between machines; compare recipes and code versions within one run.
``--smoke``: CPU, emulated FP8, tiny shapes (no timing claims).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from _timing import host_us, table, write_json  # noqa: E402

from nemo_fp8_recipes.nn import Float8Linear  # noqa: E402
from nemo_fp8_recipes.recipes import check_supported, get_recipe, list_recipes  # noqa: E402


def profile_recipe(recipe: str, d: int, f: int, tokens: int, steps: int, top: int, dev: str) -> dict:
    emulate = dev != "cuda"
    up = Float8Linear.from_linear(torch.nn.Linear(d, f, bias=False, device=dev), get_recipe(recipe), emulate=emulate)
    down = Float8Linear.from_linear(torch.nn.Linear(f, d, bias=False, device=dev), get_recipe(recipe), emulate=emulate)
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16) * 1e-3
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = down(torch.relu(up(x)))
        y.backward(dy)

    us = host_us(step, steps, sync)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(
        ((tt, nc, f"{os.path.basename(k[0])}:{k[1]}({k[2]})") for k, (cc, nc, tt, ct, _) in stats.items()), reverse=True
    )[:top]
    return {
        "recipe": recipe,
        "host_us_per_step": us,
        "top_own_time": [
            {"function": name, "calls_per_step": nc / steps, "us_per_step": tt / steps * 1e6} for tt, nc, name in rows
        ],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="tensorwise,delayed,blockwise", help="comma list of FP8 recipes")
    p.add_argument("--dim", type=int, default=4096, help="d (default: Llama 3 8B)")
    p.add_argument("--ffn", type=int, default=14336, help="ffn (default: Llama 3 8B)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per step: few, so the host is the bottleneck")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--top", type=int, default=12, help="functions listed per recipe")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="CPU, emulated, tiny shapes (no timing claims)")
    a = p.parse_args(argv)
    recipes = [r.strip() for r in a.recipes.split(",") if r.strip()]
    fp8 = [k for k in list_recipes() if k != "bf16"]
    for r in recipes:
        if r not in fp8:
            p.error(f"unknown FP8 recipe {r!r}; valid: {', '.join(fp8)}")
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if dev != "cuda" and not a.smoke:
        p.error("host_profile.py measures the host in front of a GPU: it needs CUDA (--smoke checks it on CPU)")
    if a.smoke:
        a.dim, a.ffn, a.tokens, a.steps = 128, 256, 32, 2
    if dev == "cuda":
        for r in recipes:
            ok, reason = check_supported(get_recipe(r), dev)
            if not ok:
                p.error(f"recipe {r}: {reason}")
    res = [profile_recipe(r, a.dim, a.ffn, a.tokens, a.steps, a.top, dev) for r in recipes]
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (emulated, smoke: no timing claims)"
    print(
        f"{name}, torch {torch.__version__}, d {a.dim}, ffn {a.ffn}, {a.tokens} tokens: host µs per "
        f"up+down fwd+bwd step\n"
    )
    print(table(["recipe", "host µs per step"], [(r["recipe"], f"{r['host_us_per_step']:.0f}") for r in res]))
    for r in res:
        print(f"\n{r['recipe']}: own time per step (cProfile)\n")
        print(
            table(
                ["function", "calls per step", "µs per step"],
                [(t["function"], f"{t['calls_per_step']:g}", f"{t['us_per_step']:.1f}") for t in r["top_own_time"]],
            )
        )
    write_json(
        a.out,
        {
            "device": name,
            "torch": torch.__version__,
            "dim": a.dim,
            "ffn": a.ffn,
            "tokens": a.tokens,
            "steps": a.steps,
            "results": res,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
