"""Session 22 probe (run once on the H200, from the repository root with the package importable:
``python docs/results/probe_launch_session22.py``; output: probe_launch_session22.json):
where a direct launch's host time goes (Triton's binder, the compiled kernel's launcher) and
what torch's Inductor static CUDA launcher (``torch._C._StaticCudaLauncher``, private) would
cost instead, on the 1x128 rows kernel with a 256x512 BF16 input. Not part of the library."""
import json, os, time
import torch
from nemo_fp8_recipes.quant import triton_kernels as tk, launch as fl
from nemo_fp8_recipes.quant.reference import Format, scale_grid, quantize

def us(fn, n=4000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e6

x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
q = torch.empty((256, 512), dtype=torch.float8_e4m3fn, device="cuda")
si = scale_grid(256, 4, torch.float32, x.device)
raw = dict(GROUP=128, NG=1, BLOCK_R=64, num_warps=2, MODE=1, FMAX=448.0, EMAX=8,
           TOP_MANT=tk._top_mant(Format.E4M3), IS_E4M3=True, HW_CVT=tk._hw_cvt(x))
args = (x, q, si, si, 256, 512, 4, 512, 4, 4, 4)
K = tk._quant_rows_kernel
for _ in range(3): fl.launch(K, (16,), *args, **raw)
(key, ck), = fl._CACHE[K].items()
dev = torch.cuda.current_device()
binder = K.device_caches[dev][4]
bound, spec, opts = binder(*args, **raw)
vals = tuple(bound.values())
stream = torch._C._cuda_getCurrentRawStream(dev)
src = ck.src
names = src.fn.arg_names
consts = {(names[k[0]] if isinstance(k, tuple) else k) for k in getattr(src, "constants", {})}
tymap = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H", "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
arg_tys, sargs = "", []
for n_ in names:
    ty = src.signature[n_]
    if ty == "constexpr" or n_ in consts: continue
    arg_tys += "O" if ty[0] == "*" else tymap[ty]
    sargs.append(bound[n_])
arg_tys += "OO"; sargs += [None, None]
sargs = tuple(sargs)
out = {"arg_tys": arg_tys, "triton": __import__("triton").__version__, "torch": torch.__version__}
L = getattr(torch._C, "_StaticCudaLauncher", None)
out["have_static"] = L is not None
res = {}
res["torch.empty"] = us(lambda: torch.empty((256, 512), dtype=torch.float8_e4m3fn, device="cuda"))
res["torch.zeros (1,1)"] = us(lambda: torch.zeros((1, 1), dtype=torch.float32, device="cuda"))
res["t.view(int32)"] = us(lambda: si.view(torch.int32))
res["x.data_ptr()"] = us(lambda: x.data_ptr())
res["Triton kernel[grid]"] = us(lambda: K[(16,)](*args, **raw))
res["fl.launch (direct)"] = us(lambda: fl.launch(K, (16,), *args, **raw))
res["binder alone"] = us(lambda: binder(*args, **raw))
res["binder + key + lookup"] = us(lambda: fl._CACHE[K].get((dev, tuple(binder(*args, **raw)[1]), tuple(opts.items()))))
res["compiled.run, args ready"] = us(lambda: ck.run(16, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *vals))
res["ck._run.launch (C), args ready"] = us(lambda: ck._run.launch(16, 1, 1, stream, ck.function, False, False, None, None, ck.packed_metadata, None, None, None, *vals)) if hasattr(ck._run, "launch") else None
if L is not None:
    def st():
        L._launch_kernel(ck.function, 16, 1, 1, ck.metadata.num_warps, ck.metadata.shared, arg_tys, sargs, stream)
    q.zero_()
    st(); torch.cuda.synchronize()
    ref = quantize(x.float(), "e4m3", "1x128", "pow2")
    out["static_ok"] = bool(torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)))
    res["_StaticCudaLauncher._launch_kernel, args ready"] = us(st)
    ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in sargs)
    res["_StaticCudaLauncher, int pointers"] = us(lambda: L._launch_kernel(ck.function, 16, 1, 1, ck.metadata.num_warps, ck.metadata.shared, arg_tys, ptr_args, stream))
out["us"] = res
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_launch_session22.json"), "w"), indent=1)
