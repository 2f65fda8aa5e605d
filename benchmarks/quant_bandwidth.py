"""Quantiser bandwidth: fused Triton kernels vs the eager reference vs a device-to-device copy.

    python benchmarks/quant_bandwidth.py --rows 8192 --cols 14336 --out results/quant.json

Bytes counted = source read once (BF16) + FP8 codes written + scales written (both copies for the
"one read" variant); the copy moves the same BF16 tensor (read + write). Per-tensor current
scaling cannot avoid a second read (the scale needs the whole tensor's amax before any code is
written), so its "bytes moved" columns count the bytes it has to move (5 per element instead of 3).
"ms" is what a caller sees (CUDA events around the Python call: launch and allocation overhead
included); "GPU-only" replays the same calls from CUDA graphs, i.e. the kernels' own time. Each is
a fraction of the copy timed the same way (caller time against the copy's caller time, GPU-only
against the copy's own replays). The "one read" 1x128 row is the benchmarks' own kernel
(``fp8_kernels/quantize_dual.py``), which the library does not use. The last rows
compare SwiGLU -> quantise fused (the activation computed inside the quantisers from its halves)
and unfused, forward and backward (:func:`swiglu_rows`), and RMSNorm -> quantise
(:func:`norm_rows`, on ``[rows, --norm-dim]``). All variants run in one process, CUDA events, median of
``--iters`` after warm-up, inputs rotated over 4 buffers. ``--smoke``: tiny CPU run for CI.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import bench, bench_graph, host_us, table, write_json  # noqa: E402
from fp8_kernels.quantize_dual import quantize_dual  # noqa: E402

from nemo_fp8_recipes.quant.dispatch import quantize_pair_auto as quantize_pair  # noqa: E402
from nemo_fp8_recipes.quant.reference import quantize  # noqa: E402

VARIANTS = [
    # name, granularity, fmt, rounding, dim, kind (one | delayed | pair | delayed-pair | dual: the
    # one-read 1xN kernel | then-t: one copy, then its codes transposed by PyTorch; then-t-inductor:
    # the same compiled, the kernel as its custom operator and the transpose Inductor's). Delayed =
    # a given scale; its cast also folds the amax for the history.
    ("per-tensor (amax + cast)", "tensor", "e4m3", "fp32", -1, "one"),
    ("per-tensor cast + amax, scale given (delayed)", "tensor", "e4m3", "fp32", -1, "delayed"),
    ("per-tensor both copies: amax + one-read cast (tensorwise pair)", "tensor", "e4m3", "fp32", -1, "pair"),
    (
        "per-tensor both copies + amax, scale given, one read (delayed pair)",
        "tensor",
        "e4m3",
        "fp32",
        -1,
        "delayed-pair",
    ),
    ("1x128 rows", "1x128", "e4m3", "pow2", -1, "one"),
    ("1x128 cols + transpose (wgrad copy)", "1x128", "e4m3", "pow2", 0, "one"),
    ("1x128 rows + cols^T, two kernels (dispatch)", "1x128", "e4m3", "pow2", -1, "pair"),
    ("1x128 rows + cols^T from one read", "1x128", "e4m3", "pow2", -1, "dual"),
    ("128x128 blocks", "128x128", "e4m3", "pow2", -1, "one"),
    ("128x128 blocks, then the transposed codes copied (weight dgrad copy)", "128x128", "e4m3", "pow2", -1, "then-t"),
    (
        "128x128 blocks, then the transposed codes copied by Inductor (compiled)",
        "128x128",
        "e4m3",
        "pow2",
        -1,
        "then-t-inductor",
    ),
    ("128x128 blocks + transposed codes from one pass (weight pair)", "128x128", "e4m3", "pow2", -1, "pair"),
    ("1x32 E8M0 rows", "1x32", "e4m3", "e8m0_ceil", -1, "one"),
    ("1x32 E8M0 cols + transpose", "1x32", "e4m3", "e8m0_ceil", 0, "one"),
]
#: Bytes each variant must move at least, over the bytes counted (read once + codes + scales):
#: per-tensor current scaling reads the source twice (amax, then cast) -> 5 of 3 bytes/element.
MIN_TRAFFIC = {
    "per-tensor (amax + cast)": 5 / 3,
    "per-tensor both copies: amax + one-read cast (tensorwise pair)": 6 / 4,
}


#: ``--sweep``: the launch configurations tried per kernel (tile sizes x warps); see
#: ``nemo_fp8_recipes.quant.triton_kernels.LAUNCH`` for the defaults (``dual128`` / ``dual32``:
#: ``fp8_kernels/quantize_dual.py``).
SWEEP = {
    # groups: scaling groups per tile along the grouped dim (tiles of at most 16-32K elements)
    "rows128": [
        {"block_r": b, "num_warps": w, "groups": g}
        for g in (1, 2, 4)
        for b in (8, 16, 32, 64)
        for w in (2, 4, 8)
        if b * g * 128 <= 16384
    ],
    "rows32": [
        {"block_r": b, "num_warps": w, "groups": g}
        for g in (1, 4, 8, 16)
        for b in (8, 16, 32, 64)
        for w in (4, 8)
        if b * g * 32 <= 16384
    ],
    "cols_t128": [
        {"block_c": b, "num_warps": w, "groups": g}
        for g in (1, 2)
        for b in (32, 64, 128)
        for w in (2, 4, 8)
        if b * g * 128 <= 16384
    ],
    "cols_t32": [
        {"block_c": b, "num_warps": w, "groups": g}
        for g in (1, 2, 4, 8)
        for b in (32, 64, 128)
        for w in (2, 4, 8)
        if b * g * 32 <= 16384
    ],
    "blocks128": [{"num_warps": w} for w in (4, 8, 16)],
    # the column kernels with the loaded tile kept in BF16 through the amax (bf16_tile), and without
    "cols_t128_bf16": [
        {"bf16_tile": b16, "block_c": b, "num_warps": w, "groups": g}
        for b16 in (True, False)
        for b in (32, 64, 128)
        for w in (2, 4)
        for g in (1, 2)
        if b * g <= 128
    ],
    "cols_t32_bf16": [
        {"bf16_tile": b16, "block_c": b, "num_warps": w, "groups": g}
        for b16 in (True, False)
        for b in (64, 128)
        for w in (2, 4)
        for g in (1, 2, 4)
    ],
    "tensor_dual_delayed_bf16": [
        {"bf16_tile": b16, "block_r": r, "block_c": c, "num_warps": w}
        for b16 in (True, False)
        for r, c, w in (
            (32, 256, 4),
            (64, 256, 8),
            (64, 256, 4),
            (64, 128, 4),
            (32, 128, 2),
            (128, 128, 8),
            (32, 512, 8),
        )
    ],
    # the per-tensor cast with a given scale (delayed scaling, the amax folded in: one read)
    "tensor_delayed": [
        {"block": b, "num_warps": w}
        for b in (2048, 4096, 8192, 16384, 32768)
        for w in (4, 8, 16)
        if b // (w * 32) <= 128
    ],
    "tensor": [{"block": b, "num_warps": w} for b in (2048, 4096, 8192, 16384) for w in (4, 8, 16)],
    # the per-tensor amax folds with and without the accumulator read before the atomic
    # (amax_check): current scaling's amax pass, the delayed cast, the delayed pair
    "tensor_check": [{"amax_check": c, "block": b, "num_warps": 8} for c in (True, False) for b in (4096, 8192, 16384)],
    "tensor_delayed_check": [
        {"amax_check": c, "block": b, "num_warps": 8} for c in (True, False) for b in (2048, 4096, 8192)
    ],
    "tensor_dual_delayed_check": [
        {"amax_check": ck, "block_r": r, "block_c": c, "num_warps": w}
        for ck in (True, False)
        for r, c, w in ((64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (32, 128, 2))
    ]
    + [
        {"amax_check": True, "block_r": r, "block_c": c, "num_warps": w}
        for r, c, w in (
            (32, 256, 8),
            (32, 512, 4),
            (32, 512, 8),
            (16, 512, 4),
            (16, 256, 2),
            (16, 256, 4),
            (64, 256, 4),
            (64, 128, 2),
            (32, 128, 4),
            (16, 1024, 8),
        )
    ],
    "dual128": [{"num_warps": w} for w in (4, 8, 16)],
    "dual32": [{"tile": t, "num_warps": w} for t in (64, 128) for w in (4, 8, 16)],
    "tensor_dual": [
        {"block_r": r, "block_c": c, "num_warps": w}
        for r, c in (
            (32, 256),
            (64, 64),
            (64, 128),
            (128, 64),
            (128, 128),
            (64, 256),
            (256, 64),
            (128, 256),
            (256, 128),
        )
        for w in (4, 8)
    ],
    "tensor_dual_delayed": [
        {"block_r": r, "block_c": c, "num_warps": w, "fold_amax": f}
        for f in (True, False)
        for r, c, w in ((64, 256, 8), (64, 128, 4), (128, 64, 4), (128, 128, 8), (256, 64, 8), (32, 256, 4))
    ],
}
#: sweep families that tune another entry of ``LAUNCH`` (the kernel they time)
SWEEP_KERNEL = {
    "cols_t128_bf16": "cols_t128",
    "cols_t32_bf16": "cols_t32",
    "tensor_dual_delayed_bf16": "tensor_dual_delayed",
    "tensor_check": "tensor",
    "tensor_delayed_check": "tensor_delayed",
    "tensor_dual_delayed_check": "tensor_dual_delayed",
}
#: the tile order of the tiled kernels (bands of group_r row tiles; the default 0 = row tiles
#: fastest over the whole grid), tried with each kernel's default tile configuration
for _k in ("rows128", "rows32", "cols_t128", "cols_t32", "blocks128", "dual128", "dual32"):
    SWEEP[_k] = SWEEP[_k] + [{"group_r": g} for g in (1, 2, 4, 8, 16)]


def _sweep_call(tk, family):
    """(callable on a BF16 input, bytes it moves) for one sweep family."""
    kernel = SWEEP_KERNEL.get(family, family)
    if kernel == "tensor_delayed":  # a given scale, the amax folded into an accumulator (one read)
        # a fresh zero accumulator per call, as the table's delayed rows and as a training step
        # (whose history update resets it): one kept across calls would already hold the amax, and
        # amax_check would then skip every atomic
        return (lambda x: tk.quantize_tensor(x, "e4m3", scale=_SWEEP_SCALE[x.device])), (3, None, 1)
    if kernel == "rows128":
        return (lambda x: tk.quantize_rows(x, "e4m3", 128, "pow2")), (3, 128, 1)
    if kernel == "rows32":
        return (lambda x: tk.quantize_rows(x, "e4m3", 32, "e8m0_ceil")), (3, 32, 1)
    if kernel == "cols_t128":
        return (lambda x: tk.quantize_cols_t(x, "e4m3", 128, "pow2")), (3, 128, 1)
    if kernel == "cols_t32":
        return (lambda x: tk.quantize_cols_t(x, "e4m3", 32, "e8m0_ceil")), (3, 32, 1)
    if kernel == "blocks128":
        return (lambda x: tk.quantize_blocks128(x, "e4m3", "pow2")), (3, 128 * 128, 1)
    if kernel == "tensor":
        return (lambda x: tk.quantize_tensor(x, "e4m3")), (5, None, 1)
    if kernel == "dual128":
        return (lambda x: quantize_dual(x, "e4m3", 128, "pow2")), (4, 128, 2)
    if kernel == "dual32":
        return (lambda x: quantize_dual(x, "e4m3", 32, "e8m0_ceil")), (4, 32, 2)
    if kernel == "tensor_dual":
        return (lambda x: tk.quantize_tensor_dual(x, "e4m3")), (6, None, 2)
    if kernel == "tensor_dual_delayed":  # bytes: one read (fold_amax=False reads twice)
        return (lambda x: tk.quantize_tensor_dual(x, "e4m3", scale=_SWEEP_SCALE[x.device])), (4, None, 2)
    raise KeyError(kernel)


class _Scales(dict):
    """One delayed-scaling scale tensor per device, made outside any CUDA-graph capture."""

    def __missing__(self, device):
        self[device] = torch.tensor(0.5, device=device)
        return self[device]


_SWEEP_SCALE = _Scales()


def _codes(out):
    """Everything a quantisation wrote: codes, scales and (MX) the E8M0 scale bytes."""
    outs = out if isinstance(out, tuple) else (out,)
    return [
        (
            o.data.view(torch.uint8).clone(),
            torch.cat(
                [
                    torch.as_tensor(o.scale_inv).float().reshape(-1).view(torch.uint8).clone(),
                    o.scale_e8m0.view(torch.uint8).reshape(-1).clone()
                    if o.scale_e8m0 is not None
                    else torch.empty(0, dtype=torch.uint8, device=o.data.device),
                ]
            ),
        )
        for o in outs
    ]


def sweep(xs, iters: int, copy_bw: float, kernels, warmup: int = 5) -> list:
    """Every configuration of :data:`SWEEP` for ``kernels``: GPU-only time (CUDA graphs), the
    caller-seen time, and whether its codes and scales equal the default configuration's.
    ``copy_bw``: the device copy's GPU-only bandwidth, of which ``graph_of_copy`` is the fraction."""
    from nemo_fp8_recipes.quant import triton_kernels as tk

    n = xs[0].numel()
    out = []
    for family in kernels:
        kernel = SWEEP_KERNEL.get(family, family)
        fn, (bytes_per_el, group, copies) = _sweep_call(tk, family)
        nbytes = bytes_per_el * n + copies * 4 * (n // group if group else 1)
        ref = _codes(fn(xs[0]))
        default = dict(tk.LAUNCH[kernel])
        for cfg in SWEEP[family]:
            with tk.launch_config(kernel, **cfg):
                try:
                    same = all(
                        torch.equal(a, b) and torch.equal(sa, sb) for (a, sa), (b, sb) in zip(_codes(fn(xs[0])), ref)
                    )
                    gms = bench_graph(lambda i: fn(xs[i]), len(xs), iters=iters) if xs[0].is_cuda else None
                    ms = bench(lambda i: fn(xs[i]), len(xs), warmup=warmup, iters=iters)
                    err = None
                except Exception as e:  # noqa: BLE001 - e.g. out of registers/shared memory: reported
                    same, gms, ms, err = None, None, None, f"{type(e).__name__}: {str(e)[:120]}"
            out.append(
                {
                    "kernel": kernel,
                    "config": cfg,
                    "default": {**default, **cfg} == default,
                    "same_bits": same,
                    "graph_ms": gms,
                    "ms": ms,
                    "bytes_moved": nbytes,
                    "graph_of_copy": (nbytes / gms / 1e9 / copy_bw) if gms and copy_bw else None,
                    "error": err,
                }
            )
            r = out[-1]
            head = f"  {kernel:<12} {str(cfg):<34} {'default' if r['default'] else '':<7} "
            if err:
                print(head + f"failed: {err}", flush=True)
            else:
                of_copy = f" ({r['graph_of_copy']:.0%} of copy)" if r["graph_of_copy"] else ""
                gpu = f"GPU {gms:.3f} ms{of_copy}, " if gms else ""
                print(head + f"{gpu}caller {ms:.3f} ms, same bits: {same}", flush=True)
    return out


def _have_triton() -> bool:
    from nemo_fp8_recipes.quant import triton_kernels as tk

    return tk.HAVE_TRITON


def host_overhead(dev: str, calls: int, rounds: int = 2) -> list:
    """Host (CPU) microseconds per call of the quantiser wrappers and of their parts, on a tiny
    256x512 BF16 input, so that the GPU never holds the host back: ``perf_counter`` over ``calls``
    calls, one synchronisation at the end. This is what separates "caller" from "GPU-only" time:
    a call's kernels cannot start before the host has launched them."""
    from nemo_fp8_recipes.quant import triton_kernels as tk
    from nemo_fp8_recipes.quant.dispatch import quantize_auto
    from nemo_fp8_recipes.quant.launch import launch, set_fast_launch
    from nemo_fp8_recipes.quant.reference import Format, scale_grid

    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    q = torch.empty((256, 512), dtype=torch.float8_e4m3fn, device=dev)
    si = scale_grid(256, 4, torch.float32, x.device)
    s, acc = torch.tensor(0.5, device=dev), torch.zeros(1, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    # the 1x128 rows kernel launched directly, every argument precomputed: Triton's own launch cost
    raw = dict(
        GROUP=128,
        NG=1,
        BLOCK_R=64,
        num_warps=2,
        MODE=1,
        FMAX=448.0,
        EMAX=8,
        TOP_MANT=tk.common.top_mant(Format.E4M3),
        IS_E4M3=True,
        HW_CVT=tk.common.hw_cvt(x),
    )
    cases = [
        ("torch.empty (one FP8 output)", lambda: torch.empty((256, 512), dtype=torch.float8_e4m3fn, device=dev)),
        ("a PyTorch element-wise op (x + 1), for scale", lambda: x.add(1)),
        (
            "Triton launch alone (1x128 rows kernel, arguments ready)",
            lambda: tk.groups.quant_rows_kernel[(16,)](x, q, si, si, 256, 512, 4, 512, 4, 4, 4, **raw),
        ),
        (
            "direct launch alone (the same kernel through quant.launch's cache)",
            lambda: launch(tk.groups.quant_rows_kernel, (16,), x, q, si, si, 256, 512, 4, 512, 4, 4, 4, **raw),
        ),
        ("quantize_rows 1x128 (1 kernel)", lambda: tk.quantize_rows(x, "e4m3", 128, "pow2")),
        ("quantize_cols_t 1x128 (1 kernel)", lambda: tk.quantize_cols_t(x, "e4m3", 128, "pow2")),
        ("quantize_auto 1x128 (dispatch + 1 kernel)", lambda: quantize_auto(x, "e4m3", "1x128", "pow2")),
        ("quantize_pair_auto 1x128 (dispatch + 2 kernels)", lambda: quantize_pair(x, "e4m3", "1x128", "pow2")),
        ("quantize_pair_auto 128x128 (dispatch + 1 kernel)", lambda: quantize_pair(x, "e4m3", "128x128", "pow2")),
        ("quantize_tensor_dual, current scaling (2 kernels)", lambda: tk.quantize_tensor_dual(x, "e4m3")),
        ("quantize_tensor_dual, delayed (1 kernel)", lambda: tk.quantize_tensor_dual(x, "e4m3", scale=s, amax_out=acc)),
    ]
    # the same pair as the compiled FP8 linear runs it: the custom operator eagerly (dispatch),
    # and inside a compiled graph against the same graph without it — the difference is what one
    # operator call costs the host there (Inductor on a GPU; aot_eager under the CPU interpreter)
    from nemo_fp8_recipes.quant import ops

    backend = "inductor" if dev == "cuda" else "aot_eager"
    scaled = torch.compile(lambda t: t * 1.5, backend=backend, dynamic=False)
    scaled_pair = torch.compile(lambda t: ops.tensor_pair(t * 1.5, "e4m3", "fp32"), backend=backend, dynamic=False)
    cases += [
        (
            "nemo_fp8_recipes::tensor_pair operator, eager (custom-op dispatch + 2 kernels)",
            lambda: ops.tensor_pair(x, "e4m3", "fp32"),
        ),
        ("compiled graph: x * 1.5", lambda: scaled(x)),
        ("compiled graph: x * 1.5 -> tensor_pair operator", lambda: scaled_pair(x)),
    ]
    # each case with Triton's own launch path and with the direct launch, alternated ``rounds``
    # times in this process (the lowest mean of each: host noise only adds time)
    rows = []
    for name, fn in cases:
        t = {"triton": [], "direct": []}
        for _ in range(rounds):
            for path in ("triton", "direct"):
                prev = set_fast_launch(path == "direct")
                try:
                    t[path].append(host_us(fn, calls, sync))
                finally:
                    set_fast_launch(prev)
        rows.append({"what": name, "host_us": min(t["direct"]), "host_us_triton_launch": min(t["triton"])})
    return rows


def swiglu_rows(a, dev: str) -> list:
    """SwiGLU -> quantise, fused vs unfused, on ``[rows, cols]`` BF16 halves g and u: the forward
    (the down projection's per-tensor input pair, current and delayed scaling) and the backward
    (``(dg, du)`` from the output gradient). Unfused = PyTorch's SiLU and multiply (backward: the
    three autograd kernels, SiLU's output saved as autograd saves it), then the Triton pair
    kernels; fused = :func:`quantize_tensor_dual` with ``gate`` / :func:`swiglu_backward`. Bytes
    counted: what the fused kernels must move (halves read once, codes written; backward: three
    reads, two writes); per-tensor current scaling moves 10 of those 6 bytes per element (its amax
    pass reads the halves and writes the activation, which the cast reads back)."""
    import torch.nn.functional as F

    from nemo_fp8_recipes.quant.dispatch import quantize_pair_auto

    n = a.rows * a.cols
    gs = [torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16) * 2 for _ in range(2)]
    us = [torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16) * 1e-2 for _ in range(2)]
    ss = [F.silu(g) for g in gs]
    scale = torch.tensor(0.5, device=dev)
    accs = [torch.zeros(1, device=dev) for _ in range(2)]
    cuda = dev == "cuda"

    def unfused_bwd(i):  # autograd's kernels for F.silu(g) * u (SiLU's output saved)
        return torch.ops.aten.silu_backward(dys[i] * us[i], gs[i]), dys[i] * ss[i]

    if cuda:
        from nemo_fp8_recipes.quant.triton_kernels import swiglu_backward

        fused_bwd = lambda i: swiglu_backward(dys[i], gs[i], us[i])  # noqa: E731
    else:  # smoke (CPU): no kernels to time, the row runs the unfused ops; the tests check the kernel
        fused_bwd = unfused_bwd
    fwd = 6 * n + 8  # g, u read; codes + transposed codes written; scale
    cases = [
        (
            "SwiGLU -> tensorwise pair",
            "unfused (SiLU, multiply, pair kernels)",
            lambda i: quantize_pair_auto(F.silu(gs[i]) * us[i], "e4m3", "tensor"),
            fwd,
            10 / 6,
        ),
        (
            "SwiGLU -> tensorwise pair",
            "fused (amax pass reads g, u and writes the activation; cast)",
            lambda i: quantize_pair_auto(us[i], "e4m3", "tensor", gate=gs[i]),
            fwd,
            10 / 6,
        ),
        (
            "SwiGLU -> delayed pair (scale given, amax folded)",
            "unfused (SiLU, multiply, pair kernel)",
            lambda i: quantize_pair_auto(F.silu(gs[i]) * us[i], "e4m3", "tensor", scale=scale, amax_out=accs[i]),
            fwd,
            1.0,
        ),
        (
            "SwiGLU -> delayed pair (scale given, amax folded)",
            "fused (one pass over g, u)",
            lambda i: quantize_pair_auto(us[i], "e4m3", "tensor", scale=scale, amax_out=accs[i], gate=gs[i]),
            fwd,
            1.0,
        ),
        ("SwiGLU backward (dg, du)", "unfused (autograd: 3 kernels)", unfused_bwd, 10 * n, 1.0),
        ("SwiGLU backward (dg, du)", "fused (one kernel)", fused_bwd, 10 * n, 1.0),
    ]
    out = []
    for name, impl, call, nbytes, factor in cases:
        ms = bench(call, 2, warmup=a.warmup, iters=a.iters)
        gms = bench_graph(call, 2, iters=a.iters) if cuda else None
        out.append(
            {
                "variant": name,
                "impl": impl,
                "ms": ms,
                "TB/s": nbytes / ms / 1e9,
                "graph_ms": gms,
                "graph_TB/s": nbytes / gms / 1e9 if gms else None,
                "bytes_counted": nbytes,
                "min_traffic_factor": factor,
            }
        )
    return out


def norm_rows(a, dev: str) -> list:
    """RMSNorm and RMSNorm -> quantise on ``[rows, --norm-dim]`` BF16 (the norm before the q/k/v
    and gate/up projections; FP32 weight): the norm alone, forward and backward, PyTorch's FP32
    formula in eager mode (as the model runs it without the fused kernel) against the fused
    kernels (:mod:`nemo_fp8_recipes.nn.norm`); then the norm followed by its consumers' input
    pair — tensorwise (amax + codes + transposed codes), blockwise 1x128 and mxfp8 1x32 (rows +
    transposed columns) — three ways: the formula then the quantisers; the fused norm then the
    quantisers; the fused norm doing the first step itself (the amax, or the row codes), then the
    rest. Bytes counted: what the norm must move (x read, y written; backward dy, x read, dx
    written) plus the codes and scales; the pair's second read of ``y`` is the extra traffic
    (8 of 6 bytes per element). GPU only for the fused rows (the CPU smoke times the formula)."""
    from nemo_fp8_recipes.nn.norm import rms_norm_reference

    R, D = a.rows, a.norm_dim
    n = R * D
    xs = [torch.randn(R, D, device=dev, dtype=torch.bfloat16) * 3 for _ in range(2)]
    dys = [torch.randn(R, D, device=dev, dtype=torch.bfloat16) * 1e-2 for _ in range(2)]
    w = (1.0 + 0.1 * torch.randn(D, device=dev)).requires_grad_()
    xgs = [x.clone().requires_grad_() for x in xs]
    eps = 1e-5
    cuda = dev == "cuda"
    if cuda:
        from nemo_fp8_recipes.quant import triton_kernels as tk

    def formula_bwd(i):
        y = rms_norm_reference(xgs[i], w, eps)  # forward outside the timed region would keep the graph
        return torch.autograd.grad(y, (xgs[i], w), dys[i])

    rounding = {"tensor": "fp32", "1x128": "pow2", "1x32": "e8m0_ceil"}  # per tensor, blockwise, mxfp8

    def pair_of(y, gran):
        return quantize_pair(y, "e4m3", gran, rounding[gran])

    cases = [
        ("RMSNorm forward", "PyTorch FP32 formula (eager)", lambda i: rms_norm_reference(xs[i], w, eps), 4 * n, 1.0)
    ]
    bwd_formula = (
        "RMSNorm forward + backward (dx, dw)",
        "PyTorch FP32 formula + autograd (eager)",
        formula_bwd,
        10 * n,
        1.0,
    )
    pairs = []
    for gran, label, g in (
        ("tensor", "tensorwise pair", 0),
        ("1x128", "1x128 rows + cols^T (blockwise)", 128),
        ("1x32", "1x32 E8M0 rows + cols^T (mxfp8)", 32),
    ):
        nbytes = 6 * n + (8 if gran == "tensor" else 2 * 4 * (n // g))
        pairs.append(
            (
                f"RMSNorm -> {label}",
                "formula, then the quantisers",
                lambda i, gran=gran: pair_of(rms_norm_reference(xs[i], w, eps), gran),
                nbytes,
                8 / 6,
            )
        )
        if cuda:

            def plain(i, gran=gran):
                return pair_of(tk.rmsnorm_forward(xs[i], w, eps)[0], gran)

            def fused(i, gran=gran, g=g):
                rnd = rounding[gran]
                if gran == "tensor":
                    y, _, amax, _ = tk.rmsnorm_forward(xs[i], w, eps, amax=True)
                    return tk.quantize_tensor_dual(y, "e4m3", rnd, amax=amax)
                y, _, _, q = tk.rmsnorm_forward(xs[i], w, eps, rows=("e4m3", g, rnd))
                return q, tk.quantize_cols_t(y, "e4m3", g, rnd)

            pairs.append((f"RMSNorm -> {label}", "fused norm, then the quantisers", plain, nbytes, 8 / 6))
            pairs.append(
                (
                    f"RMSNorm -> {label}",
                    "fused norm + " + ("amax" if gran == "tensor" else "row codes") + " in one pass, then the rest",
                    fused,
                    nbytes,
                    8 / 6,
                )
            )
    if cuda:

        def fused_bwd(i):
            y, rstd, _, _ = tk.rmsnorm_forward(xs[i], w, eps)
            return tk.rmsnorm_backward(dys[i], xs[i], w, rstd)

        cases.append(
            ("RMSNorm forward", "fused (one kernel)", lambda i: tk.rmsnorm_forward(xs[i], w, eps)[0], 4 * n, 1.0)
        )
        cases += [bwd_formula, ("RMSNorm forward + backward (dx, dw)", "fused (two kernels)", fused_bwd, 10 * n, 1.0)]
    else:
        cases.append(bwd_formula)
    out = []
    for name, impl, call, nbytes, factor in cases + pairs:
        ms = bench(call, 2, warmup=a.warmup, iters=a.iters)
        gms = bench_graph(call, 2, iters=a.iters) if cuda else None
        out.append(
            {
                "variant": f"{name} [{R}x{D}]",
                "impl": impl,
                "ms": ms,
                "TB/s": nbytes / ms / 1e9,
                "graph_ms": gms,
                "graph_TB/s": nbytes / gms / 1e9 if gms else None,
                "bytes_counted": nbytes,
                "min_traffic_factor": factor,
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=14336)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--norm-dim",
        type=int,
        default=4096,
        help="row length of the RMSNorm rows (model dim: 4096 = Llama 3 8B, 8192 = 70B, 16384 = 405B)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (no timing claims)")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="KERNELS",
        help="also time the launch configurations of these kernels (comma list, or 'all': "
        f"{', '.join(SWEEP)}); GPU only",
    )
    p.add_argument(
        "--host-overhead",
        action="store_true",
        help="also measure the host (CPU) microseconds per quantiser call and per part of one "
        "(allocation, Triton's launch, the wrappers, the custom operator eagerly and inside a "
        "compiled graph) on a tiny input: what caller time adds; each with Triton's own launch "
        "path and with the direct launch of the cached compiled kernels (quant.launch)",
    )
    p.add_argument(
        "--sweep-order-only",
        action="store_true",
        help="with --sweep: only the tile-order configurations (group_r) and the default",
    )
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = []
    if a.sweep:
        kernels = list(SWEEP) if a.sweep == "all" else [k for k in a.sweep.split(",") if k]
        bad = [k for k in kernels if k not in SWEEP]
        if bad:
            p.error(f"--sweep: unknown kernel(s) {', '.join(bad)}; valid: all, {', '.join(SWEEP)}")
        if dev != "cuda" and not a.smoke:
            p.error("--sweep times GPU kernels: it needs a CUDA GPU (--smoke checks it on CPU)")
    if a.host_overhead and (not _have_triton() or (dev != "cuda" and os.environ.get("TRITON_INTERPRET") != "1")):
        p.error(
            "--host-overhead launches the Triton kernels: it needs Triton and a CUDA GPU (or "
            "TRITON_INTERPRET=1 for a CPU check of the mechanics)"
        )
    a.warmup = 5  # warm-up calls before each timing
    if a.smoke:  # (the smoke run's kernels go through Triton's interpreter: few calls)
        a.rows, a.cols, a.iters, a.norm_dim, a.warmup = 256, 384, 2, 256, 1
    xs = [torch.randn(a.rows, a.cols, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    n = a.rows * a.cols
    res = []
    copy_ms = bench(lambda i: xs[i].clone(), 4, warmup=a.warmup, iters=a.iters)
    copy_bw = 2 * 2 * n / copy_ms / 1e9
    # the copy replayed from CUDA graphs too: the GPU-only columns are fractions of this
    copy_gms = bench_graph(lambda i: xs[i].clone(), 4, iters=a.iters) if dev == "cuda" else None
    if dev == "cuda" and copy_gms is None:  # no like-for-like baseline: no GPU-only percentages at all
        print(
            "WARNING: the device copy could not be captured in a CUDA graph: GPU-only percentages are left out",
            file=sys.stderr,
        )
    copy_graph_bw = 2 * 2 * n / copy_gms / 1e9 if copy_gms else None
    res.append(
        {
            "variant": "device copy (BF16 read + write)",
            "impl": "torch",
            "ms": copy_ms,
            "TB/s": copy_bw,
            "graph_ms": copy_gms,
            "graph_TB/s": copy_graph_bw,
        }
    )
    impls = [
        (
            "reference (eager PyTorch)",
            lambda x, g, f, r, d, sc: quantize(x, f, g, r, dim=d, scale=sc),
            lambda x, g, f, r, sc: quantize_pair(x, f, g, r, scale=sc, triton=False),
        )
    ]
    # the kernels: on the GPU, or in the CPU smoke run under Triton's interpreter (CI checks that
    # every Triton row runs; its times mean nothing)
    interp = a.smoke and dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _have_triton()
    if dev == "cuda" or interp:
        from nemo_fp8_recipes.quant.dispatch import quantize_auto

        impls.append(
            (
                "triton",
                lambda x, g, f, r, d, sc: quantize_auto(x, f, g, r, dim=d, scale=sc, triton=True),
                lambda x, g, f, r, sc: quantize_pair(x, f, g, r, scale=sc, triton=True),
            )
        )
    scale = torch.tensor(0.5, device=dev)
    for name, g, f, r, d, kind in VARIANTS:
        group = {"tensor": n, "1x128": 128, "128x128": 128 * 128, "1x32": 32}[g]
        copies = 2 if kind in ("pair", "delayed-pair", "dual", "then-t", "then-t-inductor") else 1
        nbytes = 2 * n + copies * (n + 4 * (n // group))
        sc = scale if kind in ("delayed", "delayed-pair") else None
        for iname, fn, pair in impls:
            if kind in ("dual", "then-t", "then-t-inductor") and iname != "triton":
                continue  # the reference has no one-read variant: its pair row is the comparison
            if kind == "pair" and g == "128x128" and iname != "triton":
                continue  # the reference's pair is a transposed view (no second copy written)
            if kind == "dual":
                call = lambda i: quantize_dual(xs[i], f, int(g.split("x")[1]), r)  # noqa: E731
            elif kind == "then-t-inductor":
                from nemo_fp8_recipes.quant import ops

                blocks_t = torch.compile(
                    lambda x, f=f, r=r: (lambda q, s: (q, q.t().contiguous(), s))(*ops.blocks128(x, f, r)),
                    dynamic=False,
                )
                call = lambda i: blocks_t(xs[i])  # noqa: E731
            elif kind == "then-t":
                call = lambda i: (lambda q: (q, q.data.t().contiguous()))(fn(xs[i], g, f, r, d, sc))  # noqa: E731
            elif kind in ("pair", "delayed-pair"):
                call = lambda i: pair(xs[i], g, f, r, sc)  # noqa: E731
            else:
                call = lambda i: fn(xs[i], g, f, r, d, sc)  # noqa: E731
            ms = bench(call, 4, warmup=a.warmup, iters=a.iters)
            gms = bench_graph(call, 4, iters=a.iters) if iname == "triton" and dev == "cuda" else None
            res.append(
                {
                    "variant": name,
                    "impl": iname,
                    "ms": ms,
                    "TB/s": nbytes / ms / 1e9,
                    "graph_ms": gms,
                    "graph_TB/s": nbytes / gms / 1e9 if gms else None,
                    "bytes_counted": nbytes,
                    "min_traffic_factor": MIN_TRAFFIC.get(name, 1.0),
                }
            )
    res += swiglu_rows(a, dev)
    res += norm_rows(a, dev)

    def pct(v, base, factor=1.0):
        return "—" if v is None or base is None else f"{v * factor / base:.0%}"

    # caller columns against the copy's caller time, GPU-only columns against the copy's GPU-only
    # time (both replayed from CUDA graphs: like for like)
    rows = [
        (
            r["variant"],
            r["impl"],
            f"{r['ms']:.3f}",
            f"{r['TB/s']:.2f}",
            pct(r["TB/s"], copy_bw),
            pct(r["TB/s"], copy_bw, r.get("min_traffic_factor", 1.0)),
            "—" if r.get("graph_ms") is None else f"{r['graph_ms']:.3f}",
            pct(r.get("graph_TB/s"), copy_graph_bw),
            pct(r.get("graph_TB/s"), copy_graph_bw, r.get("min_traffic_factor", 1.0)),
        )
        for r in res
    ]
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, input {a.rows}x{a.cols} BF16\n")
    print(
        table(
            [
                "variant",
                "impl",
                "ms (median)",
                "TB/s",
                "of copy",
                "of copy, bytes moved",
                "GPU-only ms (CUDA graph)",
                "GPU-only of copy",
                "GPU-only, bytes moved",
            ],
            rows,
        )
    )
    host = []
    if a.host_overhead:
        host = host_overhead(dev, 1, rounds=1) if a.smoke else host_overhead(dev, 2000)  # smoke: mechanics only
        print(f"\nhost time per call (256x512 BF16 input, {'CPU interpreter: no meaning' if dev != 'cuda' else dev}):")
        from nemo_fp8_recipes.quant.launch import fast_launch_status

        print(f"direct launch: {fast_launch_status()}")
        print(
            table(
                ["what", "host µs, direct launch", "host µs, Triton's launch", "saved"],
                [
                    (
                        h["what"],
                        f"{h['host_us']:.1f}",
                        f"{h['host_us_triton_launch']:.1f}",
                        f"{h['host_us_triton_launch'] - h['host_us']:.1f}",
                    )
                    for h in host
                ],
            )
        )
    swept = []
    if kernels:
        if a.sweep_order_only:
            for k in kernels:
                SWEEP[k] = [{}] + [c for c in SWEEP[k] if "group_r" in c]
        if a.smoke:  # CPU check of the mechanics: the default and one alternative (the last) per kernel
            for k in kernels:
                SWEEP[k] = [{}, SWEEP[k][-1]]
        print(f"\nlaunch-configuration sweep ({', '.join(kernels)}):")
        swept = sweep(xs, a.iters, copy_graph_bw, kernels, warmup=a.warmup)
        best = {}
        for r in swept:
            if (
                r["same_bits"]
                and r["graph_ms"]
                and (r["kernel"] not in best or r["graph_ms"] < best[r["kernel"]]["graph_ms"])
            ):
                best[r["kernel"]] = r
        if best:
            print()
            print(
                table(
                    ["kernel", "default GPU ms", "best config", "best GPU ms", "best of copy (bytes moved)"],
                    [
                        (
                            k,
                            next((f"{r['graph_ms']:.3f}" for r in swept if r["kernel"] == k and r["default"]), "—"),
                            str(b["config"]),
                            f"{b['graph_ms']:.3f}",
                            f"{b['graph_of_copy']:.0%}" if b["graph_of_copy"] else "—",
                        )
                        for k, b in best.items()
                    ],
                )
            )
        if any(r["same_bits"] is False for r in swept):
            print("ERROR: a launch configuration changed the codes (see 'same bits' above)", file=sys.stderr)
            return 1
    write_json(
        a.out,
        {
            "device": name,
            "torch": torch.__version__,
            "shape": [a.rows, a.cols],
            "results": res,
            "host_overhead": host,
            "sweep": swept,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
