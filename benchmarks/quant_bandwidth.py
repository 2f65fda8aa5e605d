"""Quantiser bandwidth: fused Triton kernels vs the eager reference vs a device-to-device copy.

    python benchmarks/quant_bandwidth.py --rows 8192 --cols 14336 --out results/quant.json

Bytes counted = source read once (BF16) + FP8 codes written + scales written; the copy moves the
same BF16 tensor (read + write). All variants run in one process, CUDA events, median of
``--iters`` after warm-up, inputs rotated over 4 buffers. ``--smoke``: tiny CPU run for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import bench, table  # noqa: E402

from nemo_fp8_recipes.quant.reference import quantize  # noqa: E402

VARIANTS = [
    # name, granularity, fmt, rounding, dim
    ("per-tensor (amax + cast)", "tensor", "e4m3", "fp32", -1),
    ("1x128 rows", "1x128", "e4m3", "pow2", -1),
    ("1x128 cols + transpose (wgrad copy)", "1x128", "e4m3", "pow2", 0),
    ("128x128 blocks", "128x128", "e4m3", "pow2", -1),
    ("1x32 E8M0 rows", "1x32", "e4m3", "e8m0_ceil", -1),
    ("1x32 E8M0 cols + transpose", "1x32", "e4m3", "e8m0_ceil", 0),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=14336)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (no timing claims)")
    a = p.parse_args(argv)
    if a.smoke:
        a.rows, a.cols, a.iters = 256, 384, 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    xs = [torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    n = a.rows * a.cols
    res = []
    copy_ms = bench(lambda i: xs[i].clone(), 4, iters=a.iters)
    copy_bw = 2 * 2 * n / copy_ms / 1e9
    res.append({"variant": "device copy (BF16 read + write)", "impl": "torch", "ms": copy_ms, "TB/s": copy_bw})
    impls = [("reference (eager PyTorch)", lambda x, g, f, r, d: quantize(x, f, g, r, dim=d))]
    if dev == "cuda":
        from nemo_fp8_recipes.quant.dispatch import quantize_auto

        impls.append(("triton", lambda x, g, f, r, d: quantize_auto(x, f, g, r, dim=d)))
    for name, g, f, r, d in VARIANTS:
        group = {"tensor": n, "1x128": 128, "128x128": 128 * 128, "1x32": 32}[g]
        nbytes = 2 * n + n + 4 * (n // group)
        for iname, fn in impls:
            ms = bench(lambda i: fn(xs[i], g, f, r, d), 4, iters=a.iters)
            res.append({"variant": name, "impl": iname, "ms": ms, "TB/s": nbytes / ms / 1e9})
    rows = [(r["variant"], r["impl"], f"{r['ms']:.3f}", f"{r['TB/s']:.2f}", f"{r['TB/s'] / copy_bw:.0%}")
            for r in res]
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, input {a.rows}x{a.cols} BF16\n")
    print(table(["variant", "impl", "ms (median)", "TB/s", "of copy"], rows))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        json.dump({"device": name, "torch": torch.__version__, "shape": [a.rows, a.cols], "results": res},
                  open(a.out, "w"), indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
