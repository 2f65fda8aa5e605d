"""Experiment (session 19): the Triton block-scaled GEMM vs cuBLAS at the 8B MLP shapes: python benchmarks/blockwise_triton_gemm_sweep.py 8b"""
import json, os, sys, itertools, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from _timing import bench
from gemm_tflops import fp8_operands, gemm_shape
from nemo_fp8_recipes.recipes import get_recipe
from nemo_fp8_recipes.quant.gemm import blockwise_matmul
from nemo_fp8_recipes.quant import triton_kernels as tk
r = get_recipe("blockwise")
out = []
CFGS = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, group_m=8, overlap=ov)
        for (bm, bn, w, st, ov) in ((128,128,8,4,False),(128,128,8,4,True),(128,128,8,3,True),(64,128,4,4,True),(128,64,4,4,True),(128,256,8,3,True),(64,256,8,3,True))]
shapes = {"8b": (4096, 14336), "70b": (8192, 28672)}
sizes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["8b"]
full = len(sys.argv) > 2 and sys.argv[2] == "full"
for size in sizes:
    d, f = shapes[size]
    m = 8192
    for proj, n, k in (("fc1", f, d), ("fc2", d, f)):
        g = torch.Generator(device="cuda").manual_seed(0)
        sets = [(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16),
                 (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
                 (torch.randn(m, n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)) for _ in range(2)]
        for gemm in ("fprop", "dgrad", "wgrad"):
            R, C, Kc = gemm_shape(m, n, k, gemm)
            flops = 2.0 * R * C * Kc
            ops = [fp8_operands(r, *s, gemm) for s in sets]
            wb = ops[0][1].block == (128, 128)
            od = ops[0][3]
            cub = lambda i: blockwise_matmul(ops[i][0].data, ops[i][0].scale_inv, ops[i][1].data, ops[i][1].scale_inv, wb, od)
            ref = cub(0).double()
            ms_c = bench(cub, 2, warmup=3, iters=15)
            row = dict(size=size, proj=proj, gemm=gemm, M=R, N=C, K=Kc, cublas_ms=ms_c, cublas_tflops=flops/ms_c/1e9, triton={})
            key = "mm_blocks" if wb else "mm_groups"
            best = None
            for cfg in CFGS:
                name = "{block_m}x{block_n}w{num_warps}s{num_stages}o{overlap:d}".format(**cfg)
                try:
                    with tk.launch_config(key, **cfg):
                        tri = lambda i: tk.blockwise_gemm(ops[i][0].data, ops[i][0].scale_inv, ops[i][1].data, ops[i][1].scale_inv, wb, od)
                        c = tri(0).double()
                        err = ((c - ref).abs().max() / ref.abs().max()).item()
                        ms = bench(tri, 2, warmup=3, iters=15)
                    row["triton"][name] = dict(ms=ms, tflops=flops/ms/1e9, rel_err_vs_cublas=err)
                    if best is None or ms < best[1]:
                        best = (name, ms)
                except Exception as e:
                    row["triton"][name] = dict(error=repr(e)[:300])
            row["best"] = best
            out.append(row)
            print(f"{size} {proj} {gemm} {R}x{C}x{Kc}: cublas {ms_c:.3f} ms {flops/ms_c/1e9:.0f} TF | best triton {best[0] if best else None} {best[1] if best else float('nan'):.3f} ms {flops/best[1]/1e9 if best else 0:.0f} TF", flush=True)
            json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"bw_gemm_sweep_{'_'.join(sizes)}.json"), "w"), indent=1)
        del sets, ops
        torch.cuda.empty_cache()
