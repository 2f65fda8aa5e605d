"""Session 24 probe: the blockwise wgrad GEMM (1x128 x 1x128, FP32 out) through F.scaled_mm (what
``blockwise_matmul`` and the compiled path run) against the package's cuBLASLt binding
(``quant/cublaslt.py``: cuBLAS' operands in the other order) with beta = 0 (a fresh product) and
beta = 1 (the fused accumulation), round-robin in one run, at the Llama 3 8B / 70B / 405B wgrad
shapes (M = 8192 tokens). Results compared bit for bit.

    python docs/results/probe_cublaslt_wgrad_session24.py --out wgrad.json
"""
import argparse
import ctypes
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _timing import bench_interleaved  # noqa: E402
from gemm_tflops import fp8_operands  # noqa: E402

from nemo_fp8_recipes.quant import cublaslt as lt  # noqa: E402
from nemo_fp8_recipes.quant.gemm import blockwise_matmul, outer_major  # noqa: E402
from nemo_fp8_recipes.recipes import get_recipe  # noqa: E402

SHAPES = {"8b": (4096, 14336, 1024), "70b": (8192, 28672, 1024), "405b": (16384, 53248, 1024)}


def lt_matmul(a, sa, b, sb, out, beta):
    """out = a·bᵀ (beta 0) or out += a·bᵀ (beta 1) through the binding's plan for this shape."""
    if beta == 1:
        return lt.fp8_matmul_accumulate(a, sa, b, sb, out, block=True)
    M, K = a.shape
    N = b.shape[0]
    key = (a.device.index if a.device.index is not None else torch.cuda.current_device(), a.dtype, b.dtype, M, N,
           K, True, False)
    plan = lt._PLANS.get(key)
    if plan is None:  # make the plan with one accumulating call into a scratch buffer
        lt.fp8_matmul_accumulate(a, sa, b, sb, torch.zeros(M, N, device=a.device), block=True)
        plan = lt._PLANS[key]
    stream = torch.cuda.current_stream().cuda_stream
    ws = lt._workspace(key[0], stream)
    with lt._LOCK:
        plan.set_scales(sa.data_ptr(), sb.data_ptr())
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        o = ctypes.c_void_p(out.data_ptr())
        lt._check(lt._LIB.cublasLtMatmul(lt._handle(key[0]), plan.desc, ctypes.byref(one), ctypes.c_void_p(b.data_ptr()),
                                         plan.a_layout, ctypes.c_void_p(a.data_ptr()), plan.b_layout,
                                         ctypes.byref(zero), o, plan.d_layout, o, plan.d_layout,
                                         ctypes.byref(plan.heuristic.algo), ctypes.c_void_p(ws.data_ptr()),
                                         ctypes.c_size_t(lt._WORKSPACE_BYTES), ctypes.c_void_p(stream)),
                  "cublasLtMatmul")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8b,70b,405b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    r = get_recipe("blockwise")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for size in a.sizes.split(","):
        d, f, kv = SHAPES[size]
        m = 8192
        for proj, n, k in (("fc1", f, d), ("fc2", d, f), ("wq", d, d), ("wk", kv, d)):
            ops = []
            for s in range(2):
                g = torch.Generator(device="cuda").manual_seed(s)
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                dy = (torch.randn(m, n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
                qa, qb, _, _ = fp8_operands(r, x, w, dy, "wgrad")
                ops.append((qa.data, outer_major(qa.scale_inv.float()), qb.data, outer_major(qb.scale_inv.float())))
                del x, w, dy
            M_, K_ = ops[0][0].shape
            N_ = ops[0][2].shape[0]
            outs = [torch.zeros(M_, N_, device="cuda") for _ in range(2)]
            ref = blockwise_matmul(ops[0][0], ops[0][1], ops[0][2], ops[0][3], False, torch.float32)
            got0 = lt_matmul(*ops[0], torch.empty(M_, N_, device="cuda"), 0)
            acc = torch.zeros(M_, N_, device="cuda")
            got1 = lt_matmul(*ops[0], acc, 1)
            eq0, eq1 = bool(torch.equal(ref, got0)), bool(torch.equal(ref, got1))
            del ref, got0, got1, acc
            fns = {
                "F.scaled_mm": lambda i, ops=ops: blockwise_matmul(ops[i][0], ops[i][1], ops[i][2], ops[i][3], False,
                                                                   torch.float32),
                "cublaslt beta=0": lambda i, ops=ops, outs=outs: lt_matmul(*ops[i], outs[i], 0),
                "cublaslt beta=1": lambda i, ops=ops, outs=outs: lt_matmul(*ops[i], outs[i], 1),
            }
            tm = bench_interleaved(fns, 2, "cuda", rounds=a.rounds, warmup=3, iters=a.iters, window=5, b2b_warmup=1)
            flops = 2.0 * M_ * N_ * K_
            base = tm["F.scaled_mm"]["ms"]
            line = []
            for name, t in tm.items():
                res["rows"].append(dict(size=size, proj=proj, M=M_, N=N_, K=K_, variant=name, ms=t["ms"],
                                        ms_b2b=t["ms_b2b"], tflops=flops / t["ms"] / 1e9, vs_scaled_mm=base / t["ms"],
                                        equal=eq0 if "0" in name else eq1 if "1" in name else True, gpu=t["gpu"]))
                line.append(f"{name} {flops / t['ms'] / 1e9:.0f} ({base / t['ms']:.3f}, b2b {tm['F.scaled_mm']['ms_b2b'] / t['ms_b2b']:.3f})")
            print(f"{size} {proj} wgrad {M_}x{N_}x{K_}: " + "  ".join(line) + f"  equal beta0/beta1: {eq0}/{eq1}",
                  flush=True)
            del ops, outs
            torch.cuda.empty_cache()
            if a.out:
                with open(a.out, "w") as fh:
                    json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
