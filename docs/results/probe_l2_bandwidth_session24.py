"""Session 24 probe: how many bytes per second the H200's L2 cache delivers to the SMs, to judge
whether the Gluon block-scaled GEMM (docs/benchmarks.md, session 24) is held by L2 traffic.

    python docs/results/probe_l2_bandwidth_session24.py --out l2.json

Every program reads its slice of a buffer small enough to stay in L2 (``--mib``, default 24 MiB,
well inside it) ``--passes`` times with L1-bypassing loads (``.cg``) and keeps a
running sum (written once, so nothing is optimised away); bytes read / kernel time (CUDA events,
median of 20 after warm-up). A buffer of 4 GiB, read once the same way, gives the HBM figure for
comparison.
"""
import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, passes, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid * n_per_prog
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(passes):
        for off in range(0, n_per_prog, BLOCK):
            v = tl.load(x_ptr + base + off + tl.arange(0, BLOCK), cache_modifier=".cg")
            acc += v.to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def timed(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=24)
    p.add_argument("--passes", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "sms": sms, "rows": []}
    for progs_per_sm in (1, 2, 4, 8):
        for block, warps in ((2048, 4), (4096, 8)):
            progs = sms * progs_per_sm
            n = (a.mib * 2**20 // 4) // (progs * block) * (progs * block)  # FP32 elements
            x = torch.randn(n, device="cuda")
            out = torch.empty(progs * block, device="cuda")
            per = n // progs
            ms = timed(lambda: _read_kernel[(progs,)](x, out, per, a.passes, BLOCK=block, num_warps=warps))
            tbs = n * 4 * a.passes / ms / 1e9
            res["rows"].append(dict(kind="L2", mib=n * 4 / 2**20, progs=progs, block=block, warps=warps,
                                    passes=a.passes, ms=ms, TBps=tbs))
            print(f"L2 {n * 4 / 2**20:.1f} MiB x {a.passes} passes, {progs} programs, block {block}, "
                  f"{warps} warps: {ms:.3f} ms, {tbs:.2f} TB/s", flush=True)
    n = (4 * 2**30 // 4) // (sms * 8 * 4096) * (sms * 8 * 4096)
    x = torch.randn(n, device="cuda")
    out = torch.empty(sms * 8 * 4096, device="cuda")
    ms = timed(lambda: _read_kernel[(sms * 8,)](x, out, n // (sms * 8), 1, BLOCK=4096, num_warps=8))
    res["rows"].append(dict(kind="HBM", mib=n * 4 / 2**20, progs=sms * 8, ms=ms, TBps=n * 4 / ms / 1e9))
    print(f"HBM {n * 4 / 2**30:.1f} GiB once: {ms:.3f} ms, {n * 4 / ms / 1e9:.2f} TB/s", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
