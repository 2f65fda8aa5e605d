"""Session 24 probe: the Gluon block-scaled GEMM (nemo_fp8_recipes/quant/gluon_gemm.py) against
cuBLAS' (F.scaled_mm, what blockwise_matmul runs) — bit-identity and speed, Llama 3 8B/70B GEMMs.
The kernel was committed as 5578418 (probes a-d) and again with the `tie` option for 256-row tiles
(probe e), each removed in the next commit; run this at 5c4b308 (it has every option), e.g.

    python docs/results/probe_gluon_blockwise_session24.py --sizes 8b,70b --configs p,w3p,h2t,h2tp,h2tfp --out probe.json

Operands are quantised with the package's quantisers exactly as gemm_tflops.py does. Each Gluon
configuration's output is compared with cuBLAS' (torch.equal, max |diff|), the FP32 wgrad's
accumulating form with cuBLASLt's beta = 1 GEMM, and ragged shapes with an FP64 reference. Timing:
bench_interleaved (round-robin, CUDA events, medians).
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _timing import bench_interleaved  # noqa: E402
from gemm_tflops import fp8_operands  # noqa: E402

from nemo_fp8_recipes.quant.gemm import blockwise_matmul  # noqa: E402
from nemo_fp8_recipes.quant.gluon_gemm import gluon_blockwise_matmul  # noqa: E402
from nemo_fp8_recipes.recipes import get_recipe  # noqa: E402

SHAPES = {"8b": (4096, 14336, 1024), "70b": (8192, 28672, 1024)}  # dim, ffn, kv dim


def ref64(qa, qb):
    return qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8b,70b")
    p.add_argument("--configs", default="base,s4,p,s4p,w3,w3p")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    r = get_recipe("blockwise")
    dev = "cuda"
    cfgs = {"base": {}, "s4": {"stages": 4}, "p": {"persistent": True}, "s4p": {"stages": 4, "persistent": True},
            "w3": {"num_wg": 3}, "w3p": {"num_wg": 3, "persistent": True}, "g16": {"group_m": 16},
            "h2t": {"halves": 2, "prefetch": False, "tie": True},
            "h2tp": {"halves": 2, "prefetch": False, "tie": True, "persistent": True},
            "h2tfp": {"halves": 2, "tie": True, "persistent": True}}
    cfgs = {k: cfgs[k] for k in a.configs.split(",")}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "checks": []}

    # correctness on ragged shapes against FP64 and cuBLAS
    g = torch.Generator(device=dev).manual_seed(1)
    for (m, n, k, gemms) in ((300, 1152, 640, ("fprop", "dgrad")), (384, 1152, 640, ("fprop", "dgrad", "wgrad")),
                             (128, 256, 128, ("fprop", "dgrad", "wgrad")), (8192 + 64, 1024, 4096, ("fprop", "dgrad")),
                             (1024, 1040, 1024, ("fprop",))):
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        x[:, 5] *= 300.0  # structured outliers: one hot channel, one hot row
        x[7] *= 50.0
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        dy = (torch.randn(m, n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        for gemm in gemms:
            qa, qb, _, od = fp8_operands(r, x, w, dy, gemm)
            wb = qb.block == (128, 128)
            ref = ref64(qa, qb)
            try:
                cub = blockwise_matmul(qa.data, qa.scale_inv, qb.data, qb.scale_inv, wb, od)
            except Exception as e:  # noqa: BLE001
                print(f"cuBLAS {m}x{n}x{k} {gemm}: {e!r}"[:300])
                cub = None
            for name, kw in cfgs.items():
                if (kw.get("num_wg") == 3 or kw.get("halves") == 2) and not wb:
                    continue
                try:
                    out = gluon_blockwise_matmul(qa.data, qa.scale_inv, qb.data, qb.scale_inv, wb, od, **kw)
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    eq = None if cub is None else bool(torch.equal(out, cub))
                    dmax = None if cub is None else (out.float() - cub.float()).abs().max().item()
                    res["checks"].append(dict(shape=[m, n, k], gemm=gemm, cfg=name, rel_err_vs_fp64=err,
                                              equal_cublas=eq, max_diff_cublas=dmax))
                    print(f"check {m}x{n}x{k} {gemm} {name}: rel err {err:.2e}, equal cuBLAS {eq} ({dmax})", flush=True)
                except Exception as e:  # noqa: BLE001
                    res["checks"].append(dict(shape=[m, n, k], gemm=gemm, cfg=name, error=repr(e)[:500]))
                    print(f"check {m}x{n}x{k} {gemm} {name}: ERROR {e!r}"[:800], flush=True)
            if gemm == "wgrad":  # accumulating form vs cuBLASLt beta = 1
                from nemo_fp8_recipes.quant.cublaslt import fp8_matmul_accumulate
                from nemo_fp8_recipes.quant.gemm import outer_major
                if m % 128 == 0 and n % 128 == 0:
                    c0 = torch.randn(n, k, device=dev, generator=g)
                    c1, c2 = c0.clone(), c0.clone()
                    fp8_matmul_accumulate(qa.data, outer_major(qa.scale_inv.float()), qb.data,
                                          outer_major(qb.scale_inv.float()), c1, block=True)
                    gluon_blockwise_matmul(qa.data, qa.scale_inv, qb.data, qb.scale_inv, False, torch.float32,
                                           out=c2, accumulate=True)
                    eq = bool(torch.equal(c1, c2))
                    res["checks"].append(dict(shape=[m, n, k], gemm="wgrad+=", cfg="base", equal_cublas=eq,
                                              max_diff_cublas=(c1 - c2).abs().max().item()))
                    print(f"check {m}x{n}x{k} wgrad accumulate: equal cuBLASLt {eq}", flush=True)
    write(a.out, res)

    for size in a.sizes.split(","):
        d, f, kv = SHAPES[size]
        m = 8192
        for proj, n, k in (("fc1", f, d), ("fc2", d, f), ("wq", d, d), ("wk", kv, d)):
            sets = []
            for s in range(2):
                g = torch.Generator(device=dev).manual_seed(s)
                sets.append((torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16),
                             (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16),
                             (torch.randn(m, n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)))
            for gemm in ("fprop", "dgrad", "wgrad"):
                ops = [fp8_operands(r, *s, gemm) for s in sets]
                qa, qb, _, od = ops[0]
                wb = qb.block == (128, 128)
                M_, K_ = qa.shape
                N_ = qb.shape[0]
                flops = 2.0 * M_ * N_ * K_
                fns = {"cublas": (lambda i, ops=ops, wb=wb, od=od: blockwise_matmul(
                    ops[i][0].data, ops[i][0].scale_inv, ops[i][1].data, ops[i][1].scale_inv, wb, od))}
                eqs = {}
                ref = fns["cublas"](0)
                for name, kw in cfgs.items():
                    if (kw.get("num_wg") == 3 or kw.get("halves") == 2) and not wb:
                        continue
                    fn = (lambda i, ops=ops, wb=wb, od=od, kw=kw: gluon_blockwise_matmul(
                        ops[i][0].data, ops[i][0].scale_inv, ops[i][1].data, ops[i][1].scale_inv, wb, od, **kw))
                    try:
                        eqs[name] = bool(torch.equal(fn(0), ref))
                        fns[name] = fn
                    except Exception as e:  # noqa: BLE001
                        print(f"{size} {proj} {gemm} {name}: ERROR {e!r}"[:800], flush=True)
                if od == torch.float32:  # the accumulating wgrad, as the layer runs it
                    outs = [torch.zeros(M_, N_, device=dev) for _ in range(2)]
                    from nemo_fp8_recipes.quant.cublaslt import fp8_matmul_accumulate
                    from nemo_fp8_recipes.quant.gemm import outer_major
                    fns["cublaslt+="] = (lambda i, ops=ops, outs=outs: fp8_matmul_accumulate(
                        ops[i][0].data, outer_major(ops[i][0].scale_inv.float()), ops[i][1].data,
                        outer_major(ops[i][1].scale_inv.float()), outs[i], block=True))
                    fns["base+="] = (lambda i, ops=ops, outs=outs: gluon_blockwise_matmul(
                        ops[i][0].data, ops[i][0].scale_inv, ops[i][1].data, ops[i][1].scale_inv, False,
                        torch.float32, out=outs[i], accumulate=True))
                t0 = time.time()
                tm = bench_interleaved(fns, 2, dev, rounds=a.rounds, warmup=3, iters=a.iters, window=5,
                                       b2b_warmup=1, errors={})
                cb = tm["cublas"]["ms"]
                line = []
                for name, t in tm.items():
                    row = dict(size=size, proj=proj, gemm=gemm, M=M_, N=N_, K=K_, variant=name, ms=t["ms"],
                               ms_b2b=t["ms_b2b"], tflops=flops / t["ms"] / 1e9, vs_cublas=cb / t["ms"],
                               equal_cublas=eqs.get(name), gpu=t["gpu"])
                    res["rows"].append(row)
                    line.append(f"{name} {flops / t['ms'] / 1e9:.0f}({cb / t['ms']:.2f}{'' if eqs.get(name, True) else ' NE'})")
                print(f"{size} {proj} {gemm} {M_}x{N_}x{K_}: " + "  ".join(line) + f"  [{time.time() - t0:.1f}s]",
                      flush=True)
                write(a.out, res)
            del sets
            torch.cuda.empty_cache()


def write(path, res):
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
