"""A warp-specialised block-scaled FP8 GEMM for Hopper (sm_90), written in Gluon.

``out = A · Bᵀ`` for the blockwise recipe's two GEMM forms (DESIGN §2):

* 1x128 × 128x128 (fprop, dgrad): ``a`` ``[M, K]`` E4M3 codes with one ``scale_inv`` per row and
  128-wide K block, ``b`` ``[N, K]`` with one ``scale_inv`` per 128×128 block;
* 1x128 × 1x128 (wgrad): ``b`` with one ``scale_inv`` per row and K block.

The tensor cores give each 128-wide K block's product exactly in FP32; it is scaled by the
block's ``scale_inv`` of the A row and of the B block (or B row) and added to an FP32
accumulator — DeepSeek-V3's promotion, the function cuBLAS' block-scaled kernels compute. The
scale formula is the one :func:`~.gemm.blockwise_matmul` (cuBLAS) gives bit for bit: ``acc +
part · (sa · sb)`` for weight blocks, ``acc + (part · sa) · sb`` for 1x128 B groups.

Why a kernel of its own: cuBLAS' block-scaled GEMMs run at 794–1222 TFLOP/s on an H200 against
1245–1300 for per-tensor scaling, and plain Triton, which waits for each block's product before
promoting it, reached 58–78% of cuBLAS (docs/benchmarks.md, session 19). Here a CTA has one
loader warp (TMA loads into a ring of ``STAGES`` shared-memory buffers; a buffer is refilled once
every consumer released it: an mbarrier with one arrival per consumer) and ``num_wg`` (2 or 3)
**consumer warp groups of 64 rows each** that never synchronise with each other: while one
promotes its block product on the CUDA cores, another's wgmma keeps the tensor cores busy. With
``halves=2`` each warp group does two 64-row slabs one after the other (a 256-row tile with two
warp groups); ``tie`` makes the second slab's product wait for the first slab's promotion (its
ignored accumulator input computed from the promoted sum), which keeps ptxas from giving that
product fresh registers — without it the 256-row tiles spill. ``persistent``: one CTA per SM, each looping over tiles. The epilogue casts, stores
through shared memory and TMA, and with ``accumulate`` adds the tile into an existing FP32 output
(the fused wgrad accumulation into ``weight.grad``).

EXPERIMENT (session 24): bit-identical to cuBLAS on every shape tried; at best at cuBLAS' speed
(256-row tiles on the 70B MLP GEMMs, where both meet the L2's bandwidth), 57–96% elsewhere
(docs/benchmarks.md); not wired into the recipes.

Gluon (``triton.experimental.gluon``) is imported lazily: the module imports without it, and
:func:`available` says whether this GEMM can run here (a CUDA device of compute capability 9.x
and a Triton with Gluon's Hopper API).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["available", "gluon_blockwise_matmul", "supports"]

BLOCK_M = 128  # two warp groups of wgmma's 64 rows
BLOCK_N = 128  # one 128x128 weight block per tile column
BLOCK_K = 128  # one scaling block of K per step


@functools.lru_cache(maxsize=None)
def _gluon():
    """Gluon's modules, or None where this Triton has no Gluon Hopper API."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        from triton.language.core import _aggregate  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return dict(gluon=gluon, gl=gl, TensorDescriptor=TensorDescriptor)


def available(device: Optional[torch.device] = None) -> bool:
    """Whether the Gluon GEMM can run: Gluon's Hopper API imports and ``device`` (default: the
    current CUDA device) has compute capability 9.x."""
    if _gluon() is None or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9


def supports(M: int, N: int, K: int) -> bool:
    """Shapes the kernel takes: K a multiple of 128 (one scaling block per step) and N a multiple
    of 16 (TMA's 16-byte row alignment of the FP8 codes and a BF16 output); any M."""
    return M > 0 and N > 0 and K > 0 and K % BLOCK_K == 0 and N % 16 == 0


@functools.lru_cache(maxsize=None)
def _kernel():
    if _gluon() is None:
        raise RuntimeError("the Gluon block-scaled GEMM needs a Triton with Gluon's Hopper API "
                           "(triton.experimental.gluon, Triton >= 3.5)")
    from ._gluon_gemm_kernels import blockwise_gemm_kernel

    return blockwise_gemm_kernel


@functools.lru_cache(maxsize=None)
def _num_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _num_sms_cached(device.index if device.index is not None else torch.cuda.current_device())


def _descriptors(a, b, c):
    g = _gluon()
    gl, TD = g["gl"], g["TensorDescriptor"]
    fp8 = gl.float8e4nv if a.dtype == torch.float8_e4m3fn else gl.float8e5
    fp8_b = gl.float8e4nv if b.dtype == torch.float8_e4m3fn else gl.float8e5
    out = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[c.dtype]
    # A in 64-row slabs, one per consumer warp group (TMA boxes have power-of-two sides)
    a_desc = TD.from_tensor(a, [64, BLOCK_K], gl.NVMMASharedLayout.get_default_for([64, BLOCK_K], fp8))
    b_desc = TD.from_tensor(b, [BLOCK_N, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], fp8_b))
    c_desc = TD.from_tensor(c, [64, BLOCK_N], gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], out))
    return a_desc, b_desc, c_desc


def gluon_blockwise_matmul(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor,
                           b_scale_inv: torch.Tensor, weight_blocks: bool, out_dtype: torch.dtype = torch.bfloat16,
                           *, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                           num_wg: int = 2, halves: int = 1, prefetch: bool = True, tie: bool = False, persistent: bool = False,
                           stages: Optional[int] = None,
                           group_m: int = 8, consumer_regs: Optional[int] = None,
                           loader_regs: int = 40) -> torch.Tensor:
    """``A · Bᵀ`` (or ``out += A · Bᵀ`` with ``accumulate``) with block scales, same arguments and
    result as :func:`~.gemm.blockwise_matmul`: ``a_data`` ``[M, K]`` and ``b_data`` ``[N, K]``
    contiguous FP8 codes; ``a_scale_inv`` ``[M, K/128]`` FP32 (any strides); ``b_scale_inv``
    ``[ceil(N/128), K/128]`` (``weight_blocks``) or ``[N, K/128]``. ``out``: an ``[M, N]``
    contiguous output to write (or, with ``accumulate``, an FP32 one to add into)."""
    M, K = a_data.shape
    N, K2 = b_data.shape
    if K != K2:
        raise ValueError(f"contraction dims differ: {tuple(a_data.shape)} x {tuple(b_data.shape)}")
    if not supports(M, N, K):
        raise ValueError(f"the Gluon block-scaled GEMM takes K % 128 == 0 and N % 16 == 0; got M={M}, N={N}, K={K}")
    kb = K // BLOCK_K
    want_b = (-(-N // 128), kb) if weight_blocks else (N, kb)
    if tuple(a_scale_inv.shape) != (M, kb) or tuple(b_scale_inv.shape) != want_b:
        raise ValueError(f"scale grids {tuple(a_scale_inv.shape)} x {tuple(b_scale_inv.shape)} do not match "
                         f"[{M}, {kb}] x [{want_b[0]}, {want_b[1]}]")
    if a_scale_inv.dtype != torch.float32 or b_scale_inv.dtype != torch.float32:
        raise ValueError("block scales are FP32 scale_inv grids")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into `out`; pass the FP32 tensor to add into")
        out = torch.empty(M, N, device=a_data.device, dtype=out_dtype)
    elif tuple(out.shape) != (M, N) or not out.is_contiguous() or (accumulate and out.dtype != torch.float32):
        raise ValueError(f"out must be a contiguous [{M}, {N}] tensor (FP32 to accumulate into); got "
                         f"{out.dtype} {tuple(out.shape)}")
    a_data, b_data = a_data.contiguous(), b_data.contiguous()
    if num_wg not in (2, 3):
        raise ValueError(f"num_wg is 2 or 3 consumer warp groups, got {num_wg}")
    if halves not in (1, 2):
        raise ValueError(f"halves is 1 or 2 64-row slabs per warp group, got {halves}")
    block_m = 64 * num_wg * halves
    if stages is None:
        # shared memory: stages x (A tile + B tile) + one 64x128 output buffer per warp group
        stages = min(6, (232448 - 2048 - num_wg * 64 * BLOCK_N * out.element_size())
                     // ((block_m + BLOCK_N) * BLOCK_K))
    if consumer_regs is None:
        # registers: 65536 per SM for (num_wg + 1) warp groups (the loader warp rounds up to one)
        consumer_regs = 232 if num_wg == 2 else 152
    a_desc, b_desc, c_desc = _descriptors(a_data, b_data, out)
    tiles = triton_cdiv(M, block_m) * triton_cdiv(N, BLOCK_N)
    grid = (min(tiles, _num_sms(a_data.device)) if persistent else tiles,)
    _kernel()[grid](a_desc, b_desc, c_desc, a_scale_inv, b_scale_inv, M, N, K,
                    a_scale_inv.stride(0), a_scale_inv.stride(1), b_scale_inv.stride(0), b_scale_inv.stride(1),
                    WEIGHT_BLOCKS=bool(weight_blocks), ACCUMULATE=bool(accumulate), NUM_WG=num_wg,
                    HALVES=halves, PREFETCH=bool(prefetch), TIE=bool(tie), STAGES=stages,
                    GROUP_M=group_m, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
