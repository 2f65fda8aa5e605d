"""An FP8 GEMM that adds into an FP32 matrix: ``out += A · Bᵀ`` through cuBLASLt (``beta = 1``).

This is the wgrad GEMM of gradient-accumulation fusion (Megatron's
``gradient_accumulation_fusion``, Transformer Engine's ``fuse_wgrad_accumulation``): the weight
gradient of a micro-batch is added into the FP32 gradient by the GEMM's epilogue instead of being
written as a new FP32 tensor that a separate kernel then adds (one full write and two reads of the
weight's size saved per linear and micro-batch, and no FP32 temporary of the weight's size).
``torch._scaled_mm`` has no accumulating form, so this module calls ``cublasLtMatmul`` itself
through ``ctypes`` — on the library PyTorch already loaded, on PyTorch's current stream (CUDA
graphs capture it), with a workspace per stream.

Operands as everywhere in :mod:`~nemo_fp8_recipes.quant.gemm`: ``a`` ``[M, K]`` and ``b`` ``[N, K]``
row-major FP8 codes with their scaling groups along ``K``; per-tensor scales (``[1, 1]`` FP32
``scale_inv``: delayed, tensorwise) or 1x128 groups on both (``[rows, K/128]`` FP32, outer-dim
major as :func:`~.reference.scale_grid` writes them: blockwise wgrad, Hopper, cuBLAS >= 12.9).
In cuBLAS' column-major terms the row-major ``out [M, N]`` is ``outᵀ = B · Aᵀ``: cuBLAS' first
operand is ``b`` (transposed), its second ``a`` — the "TN" form FP8 requires on Hopper.

Only CUDA; nothing here runs on CPU (the emulated linear adds in PyTorch instead).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

__all__ = ["CublasLtError", "fp8_matmul_accumulate", "library_path"]

# cudaDataType_t / cublasComputeType_t (library_types.h, cublas_api.h)
_CUDA_R = {torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t
_SCALE_SCALAR_32F, _SCALE_VEC128_32F = 0, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 32 * 2**20  # as PyTorch's default cuBLASLt workspace on Hopper

_STATUS = {
    0: "SUCCESS",
    1: "NOT_INITIALIZED",
    3: "ALLOC_FAILED",
    7: "INVALID_VALUE",
    8: "ARCH_MISMATCH",
    11: "MAPPING_ERROR",
    13: "EXECUTION_FAILED",
    14: "INTERNAL_ERROR",
    15: "NOT_SUPPORTED",
    16: "LICENSE_ERROR",
}


class CublasLtError(RuntimeError):
    """A cuBLASLt call failed, or the library could not be loaded."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_LOCK = threading.Lock()
_LIB: Optional[ctypes.CDLL] = None
_LIB_PATH: Optional[str] = None
_HANDLES: Dict[int, ctypes.c_void_p] = {}
_WORKSPACES: Dict[Tuple[int, int], torch.Tensor] = {}
_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_MAX_PLANS = 256  # shapes kept (token counts vary with MoE routing or packing): least recently used go


def _mapped_cublaslt() -> Optional[str]:
    """The path of the libcublasLt this process already mapped (PyTorch's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def library_path() -> str:
    """Load (once) and return the path of the cuBLASLt library used: the one PyTorch mapped, else
    ``libcublasLt.so.13`` / ``.12`` from the loader's search path."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB_PATH
    if not torch.cuda.is_available():
        raise CublasLtError("the accumulating FP8 GEMM needs a CUDA GPU (cuBLASLt); none is available")
    torch.cuda.init()
    tried = []
    for cand in [_mapped_cublaslt(), "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        if not cand:
            continue
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            tried.append(f"{cand}: {e}")
            continue
        _declare(lib)
        _LIB, _LIB_PATH = lib, cand
        return cand
    raise CublasLtError(
        "could not load cuBLASLt (tried " + "; ".join(tried) + "). Fused wgrad accumulation "
        "needs the cuBLAS that PyTorch's CUDA build ships; turn fuse_wgrad_accumulation off"
    )


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            i32,
            ctypes.POINTER(_Heuristic),
            ctypes.POINTER(i32),
        ],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"setting attribute {attr}")


def _handle(device: int) -> ctypes.c_void_p:
    h = _HANDLES.get(device)
    if h is None:
        h = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(_LIB.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        _HANDLES[device] = h
    return h


def _workspace(device: int, stream: int) -> torch.Tensor:
    ws = _WORKSPACES.get((device, stream))
    if ws is None:  # kept for the process's life: a captured graph may point at it
        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        _WORKSPACES[(device, stream)] = ws
    return ws


class _Plan:
    """The descriptors and the heuristic's algorithm for one shape and dtype combination (made
    once; cuBLASLt reads the scale pointers from the descriptor, set per call under the lock)."""

    def __init__(
        self,
        device: int,
        a_dtype,
        b_dtype,
        m: int,
        n: int,
        k: int,
        block: bool,
        fast_accum: bool,
        scale_ptrs: Tuple[int, int],
    ):
        lib = _LIB
        self.desc = ctypes.c_void_p()
        _check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R[torch.float32]),
            "cublasLtMatmulDescCreate",
        )
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(set_desc, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(set_desc, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        if block:  # (per-tensor is the default mode; the attribute exists from cuBLAS 12.8 on)
            _set(set_desc, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
            _set(set_desc, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        self.set_scales(*scale_ptrs)  # (the heuristic refuses block scales without their pointers)
        # column-major: cuBLAS A = b ([K, N] with ld K, transposed), B = a ([K, M], ld K), D [N, M]
        self.a_layout, self.b_layout, self.d_layout = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a_layout), _CUDA_R[b_dtype], k, n, k),
            "cublasLtMatrixLayoutCreate(A)",
        )
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b_layout), _CUDA_R[a_dtype], k, m, k),
            "cublasLtMatrixLayoutCreate(B)",
        )
        _check(
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d_layout), _CUDA_R[torch.float32], n, m, n),
            "cublasLtMatrixLayoutCreate(C/D)",
        )
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        _set(
            lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_WORKSPACE_BYTES)
        )
        self.heuristic = _Heuristic()
        found = ctypes.c_int(0)
        try:
            _check(
                lib.cublasLtMatmulAlgoGetHeuristic(
                    _handle(device),
                    self.desc,
                    self.a_layout,
                    self.b_layout,
                    self.d_layout,
                    self.d_layout,
                    pref,
                    1,
                    ctypes.byref(self.heuristic),
                    ctypes.byref(found),
                ),
                "cublasLtMatmulAlgoGetHeuristic",
            )
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if found.value == 0:
            self.destroy()
            names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
            raise CublasLtError(
                f"cuBLASLt has no kernel for an accumulating FP8 GEMM {names[a_dtype]} [{m}, {k}] x "
                f"{names[b_dtype]} [{n}, {k}]ᵀ -> FP32 with {'1x128' if block else 'per-tensor'} scales on "
                f"{torch.cuda.get_device_name(device)} (block scales need Hopper and cuBLAS >= 12.9); "
                "turn fuse_wgrad_accumulation off"
            )

    def destroy(self) -> None:
        """Free the descriptors (a graph that captured a GEMM of this plan does not need them)."""
        _LIB.cublasLtMatmulDescDestroy(self.desc)
        for layout in (self.a_layout, self.b_layout, self.d_layout):
            _LIB.cublasLtMatrixLayoutDestroy(layout)

    def set_scales(self, a_scale_ptr: int, b_scale_ptr: int) -> None:
        """Point the descriptor at this call's scales: cuBLAS' A is ``b``, its B is ``a``."""
        set_desc = _LIB.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale_ptr))
        _set(set_desc, self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale_ptr))


def _scale_ptr(s: torch.Tensor, rows: int, k: int, block: bool, device: torch.device) -> int:
    if s.dtype != torch.float32:
        raise ValueError(f"scale_inv must be float32, got {s.dtype}")
    if s.device != device:
        raise ValueError(f"scale_inv is on {s.device}, the operands on {device}")
    if not block:
        if s.numel() != 1:
            raise ValueError(f"a per-tensor scale_inv has one element, got shape {tuple(s.shape)}")
        return s.data_ptr()
    kb = -(-k // 128)
    if tuple(s.shape) != (rows, kb) or (kb > 1 and s.stride() != (1, rows)) or (kb == 1 and s.stride(0) != 1):
        raise ValueError(
            f"1x128 scales must be [{rows}, {kb}] with strides (1, {rows}) (outer-dim major), got "
            f"{tuple(s.shape)} with strides {s.stride()}"
        )
    return s.data_ptr()


def fp8_matmul_accumulate(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    *,
    block: bool = False,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``out += (a · bᵀ)`` in FP32, in place, and return ``out``: ``a`` ``[M, K]`` and ``b`` ``[N, K]``
    contiguous FP8 codes (E4M3 or E5M2; not both E5M2), ``out`` a contiguous FP32 ``[M, N]``.
    ``block=False``: per-tensor ``scale_inv`` (one FP32 element each); ``block=True``: 1x128 groups
    along K on both, ``[M, K/128]`` and ``[N, K/128]`` outer-dim major, K a multiple of 128.
    ``fast_accum``: Hopper's fast FP8 accumulation (per-tensor only). The product is accumulated in
    FP32 and added to ``out`` with one rounding (``alpha = beta = 1``)."""
    M, K = a.shape
    N, K2 = b.shape
    if K != K2:
        raise ValueError(f"contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{name} must hold FP8 codes (float8_e4m3fn / float8_e5m2), got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major, K innermost)")
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; the accumulating FP8 GEMM runs on CUDA only")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("E5M2 x E5M2 has no FP8 GEMM; quantise one operand to E4M3")
    if out.dtype != torch.float32 or tuple(out.shape) != (M, N) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 [{M}, {N}] tensor, got {out.dtype} "
            f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if out.device != a.device or b.device != a.device:
        raise ValueError(f"operands on {a.device}, {b.device} and out on {out.device}: one device, please")
    if block and (K % 128 or M % 128 or N % 128):
        raise ValueError(f"1x128-scaled operands need M, N and K in multiples of 128, got M={M} N={N} K={K}")
    if K % 16 or M % 16 or N % 16:
        raise ValueError(f"FP8 GEMMs need M, N and K in multiples of 16, got M={M} N={N} K={K}")
    if block and fast_accum:
        raise ValueError("1x128 block scales do not take fast accumulation (cuBLAS promotes every K block)")
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.data_ptr() % 16:
            raise ValueError(
                f"{name} is not 16-byte aligned (a view at an odd offset into a larger buffer?); "
                "cuBLASLt's FP8 GEMMs need 16-byte aligned operands"
            )
    if M == 0 or N == 0 or K == 0:
        return out
    sa = _scale_ptr(a_scale_inv, M, K, block, a.device)
    sb = _scale_ptr(b_scale_inv, N, K, block, a.device)
    library_path()
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    key = (device, a.dtype, b.dtype, M, N, K, bool(block), bool(fast_accum))
    stream = torch.cuda.current_stream(device).cuda_stream
    with _LOCK, torch.cuda.device(device):
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _Plan(device, a.dtype, b.dtype, M, N, K, bool(block), bool(fast_accum), (sa, sb))
            while len(_PLANS) > _MAX_PLANS:
                _PLANS.popitem(last=False)[1].destroy()
        else:
            _PLANS.move_to_end(key)
        ws = _workspace(device, stream)
        lib = _LIB
        plan.set_scales(sa, sb)
        one = ctypes.c_float(1.0)
        o = ctypes.c_void_p(out.data_ptr())
        _check(
            lib.cublasLtMatmul(
                _handle(device),
                plan.desc,
                ctypes.byref(one),
                ctypes.c_void_p(b.data_ptr()),
                plan.a_layout,
                ctypes.c_void_p(a.data_ptr()),
                plan.b_layout,
                ctypes.byref(one),
                o,
                plan.d_layout,
                o,
                plan.d_layout,
                ctypes.byref(plan.heuristic.algo),
                ctypes.c_void_p(ws.data_ptr()),
                ctypes.c_size_t(_WORKSPACE_BYTES),
                ctypes.c_void_p(stream),
            ),
            "cublasLtMatmul",
        )
    return out
