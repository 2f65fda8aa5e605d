"""Session 23 probe (run once on the H200 from the repository root with the package importable:
``python docs/results/probe_cublaslt_algos_session23.py [out.json]``): does cuBLASLt have a faster
algorithm than the one its heuristic ranks first (the one ``torch._scaled_mm`` runs) for the
block-scaled GEMMs of the blockwise recipe (1x128 x 128x128 fprop/dgrad, 1x128 x 1x128 wgrad)?
For each Llama 3 MLP GEMM at M = 8192 tokens it asks the heuristic for up to 32 algorithms, times
each (CUDA events, 3 warm-up + 15 timed calls, median; two operand sets alternated), checks each
result against ``F.scaled_mm``'s, and prints the table. Per-tensor GEMMs are probed the same way
for comparison, and the wgrad also in the swapped orientation (``outᵀ = X̃ᵀ · dỸ``). Not part of
the library."""
import ctypes, json, sys, statistics
import torch
import torch.nn.functional as F
from nemo_fp8_recipes.quant import cublaslt as lt

lt.library_path()
L = lt._LIB
L.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(lt._Algo), ctypes.c_int, ctypes.c_void_p,
                                                   ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
L.cublasLtMatmulAlgoConfigGetAttribute.restype = ctypes.c_int
VEC128, BLK128 = 4, 5
WS = 64 * 2**20
dev = torch.cuda.current_device()
ws = torch.empty(WS, dtype=torch.uint8, device="cuda")
R = {torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}


def algo_cfg(algo):
    out = {}
    for name, attr in (("id", 0), ("tile", 1), ("splitk", 2), ("red", 3), ("swizzle", 4), ("custom", 5),
                       ("stages", 6), ("inner", 7), ("cluster", 8)):
        v = ctypes.c_uint64(0)
        n = ctypes.c_size_t(0)
        if L.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4 if attr != 8 else 4,
                                                  ctypes.byref(n)) == 0:
            out[name] = int(v.value & 0xFFFFFFFF)
    return out


class Gemm:
    """out[M, N] = a[M, K] . b[N, K]^T (cuBLAS: D[N, M] = op_T(b) . a), beta = 0."""

    def __init__(self, a, sa, b, sb, mode_a, mode_b, out_dtype, fast):
        M, K = a.shape
        N = b.shape[0]
        self.a, self.sa, self.b, self.sb, self.M, self.N = a, sa, b, sb, M, N
        self.out = torch.empty(M, N, dtype=out_dtype, device="cuda")
        self.desc = ctypes.c_void_p()
        lt._check(L.cublasLtMatmulDescCreate(ctypes.byref(self.desc), lt._COMPUTE_32F, 0), "desc")
        s = L.cublasLtMatmulDescSetAttribute
        lt._set(s, self.desc, lt._DESC_TRANSA, ctypes.c_int32(1))
        lt._set(s, self.desc, lt._DESC_TRANSB, ctypes.c_int32(0))
        lt._set(s, self.desc, lt._DESC_FAST_ACCUM, ctypes.c_int8(1 if fast else 0))
        if mode_b:  # cuBLAS A is our b
            lt._set(s, self.desc, lt._DESC_A_SCALE_MODE, ctypes.c_int32(mode_b))
        if mode_a:
            lt._set(s, self.desc, lt._DESC_B_SCALE_MODE, ctypes.c_int32(mode_a))
        lt._set(s, self.desc, lt._DESC_A_SCALE_POINTER, ctypes.c_void_p(sb.data_ptr()))
        lt._set(s, self.desc, lt._DESC_B_SCALE_POINTER, ctypes.c_void_p(sa.data_ptr()))
        self.la, self.lb, self.ld = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        lt._check(L.cublasLtMatrixLayoutCreate(ctypes.byref(self.la), R[b.dtype], K, N, K), "la")
        lt._check(L.cublasLtMatrixLayoutCreate(ctypes.byref(self.lb), R[a.dtype], K, M, K), "lb")
        lt._check(L.cublasLtMatrixLayoutCreate(ctypes.byref(self.ld), R[out_dtype], N, M, N), "ld")
        pref = ctypes.c_void_p()
        lt._check(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        lt._set(L.cublasLtMatmulPreferenceSetAttribute, pref, 1, ctypes.c_uint64(WS))
        heur = (lt._Heuristic * 32)()
        found = ctypes.c_int(0)
        lt._check(L.cublasLtMatmulAlgoGetHeuristic(lt._handle(dev), self.desc, self.la, self.lb, self.ld, self.ld,
                                                   pref, 32, heur, ctypes.byref(found)), "heuristic")
        self.algos = [heur[i] for i in range(found.value) if heur[i].state == 0]

    def run(self, h):
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        o = ctypes.c_void_p(self.out.data_ptr())
        lt._check(L.cublasLtMatmul(lt._handle(dev), self.desc, ctypes.byref(one), ctypes.c_void_p(self.b.data_ptr()),
                                   self.la, ctypes.c_void_p(self.a.data_ptr()), self.lb, ctypes.byref(zero), o,
                                   self.ld, o, self.ld, ctypes.byref(h.algo), ctypes.c_void_p(ws.data_ptr()),
                                   ctypes.c_size_t(WS), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
                  "matmul")
        return self.out


def med_ms(fns, warm=3, iters=15):
    for _ in range(warm):
        for f in fns:
            f()
    ts = []
    for i in range(iters):
        f = fns[i % len(fns)]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def p2(shape):
    return torch.exp2(torch.randint(-8, 2, shape, device="cuda").float())


def codes(r, c, dt=torch.float8_e4m3fn):
    x = torch.randn(r, c, device="cuda") * 2
    x[torch.rand(r, c, device="cuda") < 1e-3] *= 40  # a few outliers
    return x.clamp(-400, 400).to(dt)


def operands(kind, M, N, K):
    """kind: 'fprop' (a 1x128, b 128x128), 'wgrad' (both 1x128), 'tensor' (per-tensor)."""
    a, b = codes(M, K), codes(N, K)
    if kind == "tensor":
        return a, torch.tensor([[0.5]], device="cuda"), b, torch.tensor([[0.25]], device="cuda")
    sa = p2((M, K // 128)).t().contiguous().t()  # outer-dim major
    if kind == "wgrad":
        sb = p2((N, K // 128)).t().contiguous().t()
    else:
        kb = K // 128
        l4 = -(-kb // 4) * 4
        sb = p2((N // 128, l4)).contiguous().t()  # (L4, N/128) strides (1, L4)
    return a, sa, b, sb


def torch_ref(kind, a, sa, b, sb, out_dtype):
    if kind == "tensor":
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    rb = F.ScalingType.BlockWise1x128 if kind == "wgrad" else F.ScalingType.BlockWise128x128
    return F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb, rb, output_dtype=out_dtype,
                       use_fast_accum=False)


SIZES = {"8b": (4096, 14336), "70b": (8192, 28672)}
rows = []
M = 8192
for size in sys.argv[2:] or ["8b", "70b"]:
    d, f = SIZES[size]
    cases = [("fc1 fprop", "fprop", M, f, d), ("fc1 dgrad", "fprop", M, d, f), ("fc1 wgrad", "wgrad", f, d, M),
             ("fc2 fprop", "fprop", M, d, f), ("fc2 dgrad", "fprop", M, f, d), ("fc2 wgrad", "wgrad", d, f, M),
             ("fc1 wgrad swapped", "wgrad", d, f, M), ("fc2 wgrad swapped", "wgrad", f, d, M),
             ("fc1 fprop per-tensor", "tensor", M, f, d), ("fc1 wgrad per-tensor", "tensor", f, d, M)]
    for name, kind, m, n, k in cases:
        out_dtype = torch.float32 if "wgrad" in name else torch.bfloat16
        mode_a = 0 if kind == "tensor" else VEC128
        mode_b = 0 if kind == "tensor" else (VEC128 if kind == "wgrad" else BLK128)
        sets = [operands(kind, m, n, k) for _ in range(2)]
        gs = [Gemm(*ops, mode_a, mode_b, out_dtype, fast=False) for ops in sets]
        ref_ms = med_ms([lambda o=ops: torch_ref(kind, *o, out_dtype) for ops in sets])
        ref0 = torch_ref(kind, *sets[0], out_dtype).float()
        flop = 2 * m * n * k
        res = []
        for i, h in enumerate(gs[0].algos):
            hs = [g.algos[i] if i < len(g.algos) else h for g in gs]
            try:
                out = gs[0].run(hs[0]).float()
                err = ((out - ref0).abs().max() / ref0.abs().max().clamp_min(1e-30)).item()
                ms = med_ms([lambda g=g, hh=hh: g.run(hh) for g, hh in zip(gs, hs)])
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                res.append({"rank": i, "error": str(e)})
                continue
            res.append({"rank": i, "ms": ms, "tflops": flop / ms / 1e9, "rel_err_vs_torch": err,
                        "waves": h.wavesCount, "workspace": h.workspaceSize, **algo_cfg(h.algo)})
        best = min((r for r in res if "ms" in r), key=lambda r: r["ms"], default=None)
        row = {"size": size, "gemm": name, "m": m, "n": n, "k": k, "torch_ms": ref_ms,
               "torch_tflops": flop / ref_ms / 1e9, "n_algos": len(gs[0].algos), "algos": res, "best": best}
        rows.append(row)
        print(f"{size} {name:22s} m={m} n={n} k={k}: torch {ref_ms:.3f} ms ({flop / ref_ms / 1e9:.0f} TF/s); "
              f"{len(res)} algos; rank0 {res[0].get('ms', float('nan')):.3f}; best rank {best and best['rank']} "
              f"{best and best['ms']:.3f} ms ({best and best['tflops']:.0f} TF/s) cfg "
              f"{best and {k2: best[k2] for k2 in ('id', 'tile', 'splitk', 'stages', 'cluster', 'swizzle') if k2 in best}}"
              f" err {best and best['rel_err_vs_torch']:.2e}", flush=True)
        for r in res:
            if "ms" in r:
                print(f"    rank {r['rank']:2d} {r['ms']:.3f} ms {r['tflops']:.0f} TF/s id {r.get('id')} tile "
                      f"{r.get('tile')} splitk {r.get('splitk')} stages {r.get('stages')} cluster {r.get('cluster')} "
                      f"swz {r.get('swizzle')} ws {r['workspace']} err {r['rel_err_vs_torch']:.1e}")
            else:
                print(f"    rank {r['rank']:2d} error {r['error']}")
out_path = sys.argv[1] if len(sys.argv) > 1 else "probe_cublaslt_algos_session23.json"
with open(out_path, "w") as fh:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cublaslt": lt._LIB_PATH,
               "rows": rows}, fh, indent=1)
