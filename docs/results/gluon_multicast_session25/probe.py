"""Session 25 probe: build.py's cubins (Triton 3.9 Gluon, a 2-CTA cluster sharing each B tile by a
multicast TMA load) against cuBLAS' block-scaled GEMMs (``blockwise_matmul``), on the H200.

The cubins are launched through the CUDA driver (ctypes: ``cuModuleLoadData``,
``cuTensorMapEncodeTiled``, ``cuLaunchKernelEx`` with the cluster dimension), with the parameter
list, TMA boxes and swizzles build.py recorded — the GPU machine has Triton 3.6, which cannot
compile Gluon's multicast. Checks: ``torch.equal`` with cuBLAS on Llama shapes and ragged ones
(hot-channel / hot-row inputs), relative error against an FP64 reference. Timing:
``bench_interleaved`` (round-robin, CUDA events, medians).

    python docs/results/gluon_multicast_session25/probe.py --cubins DIR --sizes 8b,70b --out probe.json
"""
import argparse
import ctypes
import glob
import json
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _timing import bench_interleaved, energy_window  # noqa: E402
from gemm_tflops import fp8_operands  # noqa: E402

from nemo_fp8_recipes.quant.gemm import blockwise_matmul  # noqa: E402
from nemo_fp8_recipes.recipes import get_recipe  # noqa: E402

SHAPES = {"8b": (4096, 14336, 1024), "70b": (8192, 28672, 1024), "405b": (16384, 53248, 1024)}
TMA_DTYPE_DEVICE_TO_HOST = {i: i for i in range(16)}
TMA_DTYPE_DEVICE_TO_HOST.update({8: 10, 9: 8, 10: 9})


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_cu = ctypes.CDLL("libcuda.so.1")


def _check(res, what):
    if res != 0:
        s = ctypes.c_char_p()
        _cu.cuGetErrorString(res, ctypes.byref(s))
        raise RuntimeError(f"{what}: CUDA error {res} ({s.value.decode() if s.value else '?'})")


class Cubin:
    """One build.py variant, loaded into the current context."""

    def __init__(self, path_json):
        with open(path_json) as f:
            self.meta = json.load(f)
        # "cubin": another assembly of the same PTX (e.g. by an older ptxas), else <name>.cubin
        with open(os.path.join(os.path.dirname(path_json), self.meta.get("cubin", os.path.basename(path_json)[:-5] + ".cubin")),
                  "rb") as f:
            self.image = f.read()
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the primary context is current
        self.mod = ctypes.c_void_p()
        res = _cu.cuModuleLoadData(ctypes.byref(self.mod), self.image)
        self.loaded_from = "cubin"
        if res != 0:  # a driver older than the cubin's ptxas: JIT the PTX with its ISA version lowered
            print(f"cubin not loadable (CUDA error {res}); JIT-compiling the PTX", flush=True)
            with open(path_json[:-5] + ".ptx") as f:
                ptx = f.read()
            ptx = re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, flags=re.M).encode() + b"\0"
            _check(_cu.cuModuleLoadData(ctypes.byref(self.mod), ptx), "cuModuleLoadData (PTX)")
            self.loaded_from = "ptx"
        self.fn = ctypes.c_void_p()
        _check(_cu.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, self.meta["name"].encode()),
               "cuModuleGetFunction")
        _check(_cu.cuFuncSetAttribute(self.fn, 8, self.meta["shared"]), "max dynamic shared memory")
        v = self.meta["variant"]
        self.cluster, self.rows_per_cta = v["cluster"], 64 * v["num_wg"] * v["halves"]
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self._tmaps = {}  # descriptors by (pointer, shape, strides, box): the caching allocator reuses outputs

    def _tmap(self, t, md):
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, tuple(md["block_size"]), md["swizzle"])
        hit = self._tmaps.get(key)
        if hit is not None:
            return hit
        tmap = (ctypes.c_uint64 * 16)()
        rank = t.dim()
        dims = (ctypes.c_uint64 * rank)(*reversed(t.shape))
        strides = (ctypes.c_uint64 * (rank - 1))(*[t.stride(rank - 2 - i) * t.element_size() for i in range(rank - 1)])
        box = (ctypes.c_uint32 * rank)(*reversed(md["block_size"]))
        estr = (ctypes.c_uint32 * rank)(*([1] * rank))
        _check(_cu.cuTensorMapEncodeTiled(tmap, TMA_DTYPE_DEVICE_TO_HOST[md["elem_type"]], rank,
                                          ctypes.c_void_p(t.data_ptr()), dims, strides, box, estr, 0,
                                          md["swizzle"], 2, 0), "cuTensorMapEncodeTiled")
        self._tmaps[key] = tmap
        return tmap

    def __call__(self, a, sa, b, sb, out):
        """``out = A·Bᵀ`` (``out`` BF16 for weight blocks, FP32 for the 1x128 × 1x128 form)."""
        M, K = a.shape
        N = b.shape[0]
        assert K % 128 == 0 and N % 16 == 0, f"K % 128 and N % 16: {M}x{N}x{K}"
        wb = self.meta["variant"]["weight_blocks"]
        # the compiled specialisation: scale grids outer-dim major (stride 1 along M / N for 1x128
        # grids), a contiguous 128x128 grid; sizes and strides divisible by 16
        assert sa.stride(0) == 1 and (sb.stride(1) == 1 if wb else sb.stride(0) == 1), "scale layout"
        ints = [M, N, K, sa.stride(1), sb.stride(0) if wb else sb.stride(1)]
        assert all(i % 16 == 0 for i in ints), f"sizes/strides not divisible by 16: {ints}"
        args = []
        for t, md in zip((a, b, out), self.meta["tensordesc_meta"]):
            args += [self._tmap(t, md), ctypes.c_int32(t.shape[0]), ctypes.c_int32(t.shape[1]),
                     ctypes.c_int64(t.stride(0)), ctypes.c_int64(t.stride(1))]
        args += [ctypes.c_uint64(sa.data_ptr()), ctypes.c_uint64(sb.data_ptr())]
        args += [ctypes.c_int32(i) for i in ints]
        args += [ctypes.c_uint64(0), ctypes.c_uint64(0)]  # global / profile scratch (size 0)
        kinds = [p[0] for p in self.meta["params"]]
        assert len(kinds) == len(args), (kinds, len(args))
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in args])
        tiles = -(-M // (self.rows_per_cta * self.cluster)) * -(-N // 128)
        clusters = min(tiles, self.num_sms // self.cluster)
        attrs = (_LaunchAttr * 2)()
        attrs[0].id = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = self.cluster, 1, 1
        attrs[1].id = 5  # CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
        attrs[1].value[0] = 1  # spread
        cfg = _LaunchConfig(clusters * self.cluster, 1, 1, 32 * self.meta["num_warps"], 1, 1, self.meta["shared"],
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), attrs,
                            2 if self.cluster > 1 else 0)
        _check(_cu.cuLaunchKernelEx(ctypes.byref(cfg), self.fn, ptrs, None), "cuLaunchKernelEx")
        return out


def prep(qa, qb, wb):
    """Scale grids in the compiled layout (outside the timing; the quantisers write 1x128 grids
    so already)."""
    sa = qa.scale_inv.float()
    sa = sa if sa.stride(0) == 1 else sa.t().contiguous().t()
    sb = qb.scale_inv.float()
    if wb:  # contiguous rows, the row stride padded to a multiple of 16 (the compiled alignment)
        ld = -(-sb.shape[1] // 16) * 16
        sb = torch.ones(sb.shape[0], ld, device=sb.device)[:, :sb.shape[1]].copy_(sb)
    else:
        sb = sb if sb.stride(0) == 1 else sb.t().contiguous().t()
    return qa.data.contiguous(), sa, qb.data.contiguous(), sb


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cubins", required=True)
    p.add_argument("--sizes", default="8b,70b")
    p.add_argument("--variants", default="", help="comma-separated cubin names (default: all)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--projs", default="fc1,fc2,wq,wk")
    p.add_argument("--energy", type=float, default=0.0, metavar="SECONDS",
                   help="also each variant back to back for about SECONDS between two reads of the energy counter")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    r = get_recipe("blockwise")
    dev = "cuda"
    kernels = {}
    for f in sorted(glob.glob(os.path.join(a.cubins, "*.json"))):
        name = os.path.basename(f)[:-5]
        if a.variants and name not in a.variants.split(","):
            continue
        try:
            kernels[name] = Cubin(f)
        except Exception as e:  # noqa: BLE001
            print(f"load {name}: {e!r}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "kernels": {k: v.meta for k, v in kernels.items()}, "rows": [], "checks": []}
    print("loaded:", list(kernels), flush=True)

    g = torch.Generator(device=dev).manual_seed(1)
    for (m, n, k, gemms) in ((384, 1152, 640, ("fprop", "dgrad", "wgrad")), (8192 + 512, 1024, 4096, ("fprop", "dgrad")),
                             (1024, 4096, 2048, ("fprop", "dgrad", "wgrad")), (4096, 1536, 1024, ("fprop", "wgrad"))):
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        x[:, 5] *= 300.0  # structured outliers: one hot channel, one hot row
        x[7] *= 50.0
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        dy = (torch.randn(m, n, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        for gemm in gemms:
            qa, qb, _, od = fp8_operands(r, x, w, dy, gemm)
            wb = qb.block == (128, 128)
            ref = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
            cub = blockwise_matmul(qa.data, qa.scale_inv, qb.data, qb.scale_inv, wb, od)
            ad, sa, bd, sb = prep(qa, qb, wb)
            for name, kern in kernels.items():
                if kern.meta["variant"]["weight_blocks"] != wb:
                    continue
                acc = kern.meta["variant"]["accumulate"]
                try:
                    if acc:  # out += A·Bᵀ against C + cuBLAS' FP32 product (one FP32 add, as cuBLASLt's beta = 1)
                        c0 = torch.randn(ad.shape[0], bd.shape[0], device=dev, generator=g)
                        out = kern(ad, sa, bd, sb, c0.clone())
                        cub_c, ref_c = c0 + cub, c0.double() + ref
                    else:
                        out = torch.full((ad.shape[0], bd.shape[0]), float("nan"), device=dev, dtype=od)
                        kern(ad, sa, bd, sb, out)
                        cub_c, ref_c = cub, ref
                    torch.cuda.synchronize()
                    err = ((out.double() - ref_c).abs().max() / ref_c.abs().max()).item()
                    eq = bool(torch.equal(out, cub_c))
                    dmax = (out.float() - cub_c.float()).abs().max().item()
                    res["checks"].append(dict(shape=[m, n, k], gemm=gemm + ("+=" if acc else ""), kernel=name, rel_err_vs_fp64=err,
                                              equal_cublas=eq, max_diff_cublas=dmax))
                    print(f"check {m}x{n}x{k} {gemm} {name}: rel err {err:.2e}, equal cuBLAS {eq} ({dmax})", flush=True)
                except Exception as e:  # noqa: BLE001
                    res["checks"].append(dict(shape=[m, n, k], gemm=gemm, kernel=name, error=repr(e)[:500]))
                    print(f"check {m}x{n}x{k} {gemm} {name}: ERROR {e!r}"[:800], flush=True)
    write(a.out, res)

    for size in a.sizes.split(","):
        d, f, kv = SHAPES[size]
        m = 8192
        for proj, n, k in (("fc1", f, d), ("fc2", d, f), ("wq", d, d), ("wk", kv, d)):
            if proj not in a.projs.split(","):
                continue
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
                ref = fns["cublas"](0)
                eqs = {}
                preps = [prep(o[0], o[1], wb) for o in ops]
                for name, kern in kernels.items():
                    if kern.meta["variant"]["weight_blocks"] != wb:
                        continue
                    if kern.meta["variant"]["accumulate"]:
                        outs = [torch.zeros(M_, N_, device=dev) for _ in range(2)]
                        fns[name] = (lambda i, kern=kern, preps=preps, outs=outs: kern(*preps[i], outs[i]))
                        continue
                    fn = (lambda i, kern=kern, preps=preps, od=od, M_=M_, N_=N_: kern(
                        *preps[i], torch.empty(M_, N_, device=dev, dtype=od)))
                    try:
                        eqs[name] = bool(torch.equal(fn(0), ref))
                        fns[name] = fn
                    except Exception as e:  # noqa: BLE001
                        print(f"{size} {proj} {gemm} {name}: ERROR {e!r}"[:800], flush=True)
                t0 = time.time()
                tm = bench_interleaved(fns, 2, dev, rounds=a.rounds, warmup=3, iters=a.iters, window=5,
                                       b2b_warmup=1, errors={})
                cb = tm["cublas"]["ms"]
                en = energy_window(fns, 2, dev, seconds=a.energy) if a.energy else {}
                line = []
                for name, t in tm.items():
                    row = dict(size=size, proj=proj, gemm=gemm, M=M_, N=N_, K=K_, variant=name, ms=t["ms"],
                               ms_b2b=t["ms_b2b"], tflops=flops / t["ms"] / 1e9, vs_cublas=cb / t["ms"],
                               equal_cublas=eqs.get(name), gpu=t["gpu"])
                    if name in en:
                        e = en[name]
                        row["energy"] = dict(e, tflops=flops / e["ms"] / 1e9,
                                             gflop_per_j=None if e["j"] is None else flops / e["j"] / 1e9)
                    res["rows"].append(row)
                    line.append(f"{name} {flops / t['ms'] / 1e9:.0f}({cb / t['ms']:.2f}/b2b "
                                f"{tm['cublas']['ms_b2b'] / t['ms_b2b']:.2f}{'' if eqs.get(name, True) else ' NE'})")
                    if name in en and en[name]["j"]:
                        e, g = row["energy"], en[name]["gpu"] or {}
                        line[-1] += f"[{e['tflops']:.0f} {e['w']:.0f}W {e['gflop_per_j']:.0f}G/J {g.get('sm_mhz_median')}MHz]"
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
