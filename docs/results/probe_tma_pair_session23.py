"""Session 23 probe (run once on the H200 from the repository root with the package importable:
``python docs/results/probe_tma_pair_session23.py [out.json]``): would the per-tensor pair kernel
(codes and their transpose from one read; the delayed pair at 75% of the copy's bandwidth, the
tensorwise pair's cast pass) be faster if its two stores went through the Hopper TMA unit
(Triton host-side tensor descriptors) instead of pointer stores? Same math as
``_cast_dual_kernel`` (it calls the library's own jit helpers), only the stores differ. For each
tile configuration it times the library kernel and the TMA variant back to back (CUDA events
around 40 queued launches, median of 7 repetitions, alternated), checks codes, transposed codes,
scale_inv and amax byte for byte, and times a device copy of the same tensor the same way. Not
part of the library."""
import json, statistics, sys
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from nemo_fp8_recipes.quant import triton_kernels as tk
from nemo_fp8_recipes.quant.triton_kernels import (_tensor_scale, _f32_bits_of_bits16, _abs_bits16, _fold_amax_bits,
                                                   _bf16_to_f32, _load_act, _fold_amax_2d, _fp8_cast, _round_fp8,
                                                   _trans_codes)
from nemo_fp8_recipes.quant.reference import Format


@triton.jit
def _cast_dual_tma_kernel(x_ptr, g_ptr, amax_ptr, s_ptr, si_ptr, q_desc, qt_desc, R, C, stride_x,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FMAX: tl.constexpr,
                          IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr, HAS_SCALE: tl.constexpr,
                          MODE: tl.constexpr, AMAX_OUT: tl.constexpr, GATED: tl.constexpr,
                          LIBDEVICE: tl.constexpr, IN_BF16: tl.constexpr, BF16_TILE: tl.constexpr,
                          AMAX_CHECK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    s = _tensor_scale(amax_ptr, s_ptr, si_ptr, (pr == 0) & (pc == 0), HAS_SCALE, MODE, FMAX)
    if BF16_TILE:
        xb = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
        _fold_amax_bits(amax_ptr, _f32_bits_of_bits16(tl.max(tl.max(_abs_bits16(xb), axis=1), axis=0)), AMAX_CHECK)
        x = _bf16_to_f32(xb, not HW_CVT)
    else:
        x = _load_act(x_ptr, g_ptr, rows[:, None] * stride_x + cols[None, :], m, GATED, LIBDEVICE, IN_BF16)
        if AMAX_OUT:
            _fold_amax_2d(amax_ptr, x, AMAX_CHECK)
    codes = _fp8_cast(_round_fp8(x * s, FMAX, IS_E4M3, HW_CVT), OUT_DTYPE, IS_E4M3)
    q_desc.store([pr * BLOCK_R, pc * BLOCK_C], codes)
    qt_desc.store([pc * BLOCK_C, pr * BLOCK_R], _trans_codes(codes))


def library_pair(x, scale, amax_acc, q, qt, si, br, bc, warps, delayed):
    R, C = x.shape
    tk._launch(tk._cast_dual_kernel, (triton.cdiv(R, br), triton.cdiv(C, bc)), x, None,
               amax_acc.view(torch.int32) if delayed else amax_acc, scale if delayed else amax_acc, si, q, qt,
               R, C, x.stride(0), BLOCK_R=br, BLOCK_C=bc, FMAX=448.0, num_warps=warps, IS_E4M3=True,
               HW_CVT=True, HAS_SCALE=delayed, MODE=0, AMAX_OUT=delayed, **tk._gate_args(x, None),
               BF16_TILE=delayed, AMAX_CHECK=delayed)


def tma_pair(x, scale, amax_acc, q, qt, si, br, bc, warps, delayed):
    R, C = x.shape
    qd = TensorDescriptor(q, [R, C], [C, 1], [br, bc])
    qtd = TensorDescriptor(qt, [C, R], [R, 1], [bc, br])
    _cast_dual_tma_kernel[(triton.cdiv(R, br), triton.cdiv(C, bc))](
        x, None, amax_acc.view(torch.int32) if delayed else amax_acc, scale if delayed else amax_acc, si, qd, qtd,
        R, C, x.stride(0), BLOCK_R=br, BLOCK_C=bc, FMAX=448.0, num_warps=warps, IS_E4M3=True, HW_CVT=True,
        HAS_SCALE=delayed, MODE=0, AMAX_OUT=delayed, **tk._gate_args(x, None), BF16_TILE=delayed,
        AMAX_CHECK=delayed, OUT_DTYPE=tl.float8e4nv)


def timed(fn, n=40, reps=7):
    fn(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record(); torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / n)
    return statistics.median(out)


R, C = 8192, 14336
torch.manual_seed(0)
xs = [torch.randn(R, C, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2)]
for x in xs:
    x[torch.rand(R, C, device="cuda") < 1e-4] *= 1000  # outliers
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-40, -1e-38, 448.0, -57344.0, 3e-3])
copy_dst = torch.empty_like(xs[0])
ctr = [0]


def rot():
    ctr[0] += 1
    return xs[ctr[0] % 2]


configs = [(32, 256, 4), (64, 256, 8), (64, 128, 4), (128, 128, 8), (64, 256, 4), (128, 64, 4), (32, 128, 4)]
rows = []
copy_ms = timed(lambda: copy_dst.copy_(rot()))
print(f"copy {copy_ms:.4f} ms = {4 * R * C / copy_ms / 1e9:.0f} GB/s (read+write)", flush=True)
for delayed in (True, False):
    scale = torch.tensor([[0.37]], device="cuda")
    for br, bc, w in configs:
        bufs = {}
        for name, fn in (("library", library_pair), ("tma", tma_pair)):
            q = torch.empty(R, C, dtype=torch.float8_e4m3fn, device="cuda")
            qt = torch.empty(C, R, dtype=torch.float8_e4m3fn, device="cuda")
            si = torch.empty(1, 1, device="cuda")
            amax = torch.zeros(1, 1, device="cuda")
            if not delayed:  # the cast pass of current scaling reads the amax pass's result
                tk._tensor_amax(xs[0], amax)
            try:
                fn(xs[0], scale, amax, q, qt, si, br, bc, w, delayed)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a probe: record and go on
                bufs[name] = str(e).splitlines()[0][:200]
                continue
            bufs[name] = (q.view(torch.uint8).clone(), qt.view(torch.uint8).clone(), si.clone(), amax.clone())

            def call(fn=fn, q=q, qt=qt, si=si, amax=amax):
                if delayed:  # a fresh accumulator per call, as a training step has (else the
                    amax.zero_()  # amax check would skip every atomic after the first call)
                fn(rot(), scale, amax, q, qt, si, br, bc, w, delayed)
            bufs[name + "_call"] = call
        row = {"delayed": delayed, "block_r": br, "block_c": bc, "warps": w}
        if all(isinstance(bufs.get(k), tuple) for k in ("library", "tma")):
            a, b = bufs["library"], bufs["tma"]
            row["same_bits"] = all(torch.equal(u, v) for u, v in zip(a, b))
            t = {"library": [], "tma": []}
            for _ in range(3):  # alternated
                for k in ("library", "tma"):
                    t[k].append(timed(bufs[k + "_call"]))
            row.update({f"{k}_ms": min(v) for k, v in t.items()})
            row.update({f"{k}_pct_copy": copy_ms / min(v) * 100 for k, v in t.items()})
        else:
            row["error"] = {k: v for k, v in bufs.items() if isinstance(v, str)}
        rows.append(row)
        print(row, flush=True)
with open(sys.argv[1] if len(sys.argv) > 1 else "probe_tma_pair_session23.json", "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "shape": [R, C], "copy_ms": copy_ms, "rows": rows}, f, indent=1)
