"""Compile kernels.py's GEMM for sm_90a with Triton 3.9 on a machine without a GPU.

Writes, per variant, ``<name>.cubin`` and ``<name>.json`` (kernel name, shared memory, warps,
CTAs per cluster, the parameter list of the PTX entry, the TMA descriptors' boxes and swizzles)
into ``--out``; ``probe.py`` loads them through the CUDA driver. ``ptxas -v``'s spill lines are
printed per variant.

    python docs/results/gluon_multicast_session25/build.py --out /tmp/mc_cubins
"""
import argparse
import json
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver as drv


class _CompileOnlyDriver(CudaDriver):
    """Triton's CUDA driver with the target fixed to sm_90 and no device behind it."""

    def __init__(self):
        self.utils = None
        self.launcher_cls = None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    @staticmethod
    def is_active():
        return True


drv.set_active(_CompileOnlyDriver())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import blockwise_gemm_kernel  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

SMEM = 232448  # bytes of shared memory per block on sm_90 (opt-in)


def variant_name(v):
    return "mc{cluster}_wg{num_wg}_h{halves}_{form}{acc}{pf}".format(pf="" if v.get("prefetch", True) else "_nopf",
        cluster=v["cluster"], num_wg=v["num_wg"], halves=v["halves"],
        form="wb" if v["weight_blocks"] else "wgrad", acc="_acc" if v["accumulate"] else "")


def compile_variant(v):
    cl, num_wg, halves = v["cluster"], v["num_wg"], v["halves"]
    M, N, K = 8192, 4096, 4096  # any shape: only the specialisation (alignment) matters
    out_dtype = torch.float32 if (v["accumulate"] or not v["weight_blocks"]) else torch.bfloat16
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    sa = torch.empty(K // 128, M).t()
    sb = torch.empty(-(-N // 128), K // 128) if v["weight_blocks"] else torch.empty(K // 128, N).t()
    c = torch.empty(M, N, dtype=out_dtype)
    slab = 64 * cl
    cga_rows = [[1, 0]] if cl == 2 else None
    cga_bcast = [[0, 0]] if cl == 2 else None
    fp8 = gl.float8e4nv
    out_gl = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float32
    a_desc = TensorDescriptor.from_tensor(a, [slab, 128], gl.NVMMASharedLayout.get_default_for([slab, 128], fp8, cga_layout=cga_rows))
    b_desc = TensorDescriptor.from_tensor(b, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], fp8, cga_layout=cga_bcast))
    c_desc = TensorDescriptor.from_tensor(c, [slab, 128], gl.NVMMASharedLayout.get_default_for([slab, 128], out_gl, cga_layout=cga_rows))
    rows_per_cta = 64 * num_wg * halves
    stages = v.get("stages") or min(6, (SMEM - 2048 - num_wg * 64 * 128 * c.element_size()) // ((rows_per_cta + 128) * 128))
    cregs = v.get("consumer_regs") or (232 if num_wg == 2 else 152)
    k = blockwise_gemm_kernel.warmup(
        a_desc, b_desc, c_desc, sa, sb, M, N, K, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        WEIGHT_BLOCKS=v["weight_blocks"], ACCUMULATE=v["accumulate"], NUM_WG=num_wg, HALVES=halves,
        TIE=v.get("tie", halves == 2), CLUSTER_M=cl, PREFETCH=v.get("prefetch", True), STAGES=stages, GROUP_M=8, CONSUMER_REGS=cregs,
        LOADER_REGS=40, num_warps=4, num_ctas=cl, grid=(1,))
    return k, stages


def entry_params(ptx):
    """The PTX entry's parameters in order: ``("tmap", 128)`` for a by-value CUtensorMap,
    ``("u64", 8)`` / ``("u32", 4)`` for pointers and integers."""
    head = ptx[ptx.index(".entry"):]
    head = head[:head.index(")")]
    params = []
    for line in head.splitlines():
        m = re.search(r"\.param\s+(.*?)\s+(\w+)(\[(\d+)\])?,?$", line.strip())
        if not m:
            continue
        spec, _, _, arr = m.groups()
        if arr:
            params.append(["bytes", int(arr), int(re.search(r"\.align (\d+)", spec).group(1))])
        elif ".u64" in spec or ".b64" in spec:
            params.append(["u64", 8, 8])
        elif ".u32" in spec or ".b32" in spec:
            params.append(["u32", 4, 4])
        else:
            raise ValueError(f"unknown PTX parameter: {line}")
    return params


VARIANTS = [
    dict(cluster=1, num_wg=2, halves=2, weight_blocks=True, accumulate=False),
    dict(cluster=2, num_wg=2, halves=2, weight_blocks=True, accumulate=False),
    dict(cluster=2, num_wg=2, halves=2, weight_blocks=True, accumulate=False, prefetch=False),
    dict(cluster=1, num_wg=3, halves=1, weight_blocks=True, accumulate=False),
    dict(cluster=2, num_wg=3, halves=1, weight_blocks=True, accumulate=False),
    dict(cluster=1, num_wg=2, halves=1, weight_blocks=False, accumulate=False),
    dict(cluster=2, num_wg=2, halves=1, weight_blocks=False, accumulate=False),
    dict(cluster=2, num_wg=2, halves=1, weight_blocks=False, accumulate=True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the cubins and their JSON")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--ptxas", default="", help="also assemble each PTX with this ptxas (its ISA version lowered "
                    "to --ptx-version), written as <name>_<tag>.cubin with its own JSON")
    ap.add_argument("--ptx-version", default="8.7")
    ap.add_argument("--tag", default="p128", help="name suffix of the --ptxas build")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import subprocess
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for v in VARIANTS:
        name = variant_name(v)
        if args.only and name not in args.only.split(","):
            continue
        k, stages = compile_variant(v)
        ptx = k.asm["ptx"]
        with open(os.path.join(args.out, name + ".cubin"), "wb") as f:
            f.write(k.asm["cubin"])
        with open(os.path.join(args.out, name + ".ptx"), "w") as f:
            f.write(ptx)
        md = k.metadata
        meta = dict(variant=v, name=md.name, shared=md.shared, num_warps=md.num_warps, num_ctas=md.num_ctas,
                    stages=stages, params=entry_params(ptx), tensordesc_meta=md.tensordesc_meta,
                    global_scratch_size=md.global_scratch_size, profile_scratch_size=md.profile_scratch_size,
                    triton=triton.__version__)
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(meta, f, indent=1)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(args.out, name + ".ptx"), "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
        info = [ln.strip() for ln in res.splitlines() if "spill" in ln or "C75" in ln or "registers" in ln]
        print(name, "stages", stages, "smem", md.shared, "multicast" if "multicast::cluster" in ptx else "",
              "|", " | ".join(info))
        if args.ptxas:
            low = re.sub(r"^\.version \d+\.\d+", ".version " + args.ptx_version, ptx, flags=re.M)
            lp = os.path.join(args.out, f"{name}_{args.tag}.ptx")
            with open(lp, "w") as f:
                f.write(low)
            res = subprocess.run([args.ptxas, "-arch=sm_90a", "-v", lp, "-o", lp[:-4] + ".cubin"],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{args.ptxas} failed on {name}: {res.stderr[-2000:]}")
            os.remove(lp)
            with open(lp[:-4] + ".json", "w") as f:
                json.dump(dict(meta, cubin=os.path.basename(lp[:-4]) + ".cubin", ptxas=args.ptxas), f, indent=1)
            print("  ", f"{name}_{args.tag}", "|", " | ".join(ln.strip() for ln in res.stderr.splitlines()
                                                            if "spill" in ln or "C75" in ln or "Used" in ln))


if __name__ == "__main__":
    main()
