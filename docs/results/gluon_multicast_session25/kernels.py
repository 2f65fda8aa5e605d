"""Session 25 experiment: session 24's warp-specialised block-scaled FP8 GEMM (Gluon), ported to
Triton 3.9's Gluon and run as a cluster of two CTAs along M that share each B tile through one
**multicast** TMA load (Triton 3.6's Gluon emits no multicast; 3.9's ``tma.async_load(...,
multicast=True)`` does).

Written at the cluster level (Gluon's ``num_ctas``): a slab of ``64 * CLUSTER_M`` rows is split
over the cluster's CTAs (64 rows each, ``cga_layout [[1, 0]]``: CTA 1 holds the second half), the B tile is replicated
(``cga_layout [[0, 0]]``) and loaded once by CTA 0 for both. Each CTA's loader waits for its own
consumers (``empty``: A and B stages of this CTA) and, in CTA 0, for both CTAs' consumers
(``empty_b``: a barrier in CTA 0 that every CTA's consumers arrive on), because CTA 0 writes the
B stage of both.

Compiled on a CPU machine with Triton 3.9 (``build.py``) and launched on the H200 through the
CUDA driver (``probe.py``), since the GPU machine has Triton 3.6. Not library code.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate


@aggregate
class Args:
    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    c_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    c_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    empty_b: gl.shared_memory_descriptor
    done: gl.shared_memory_descriptor
    sa_ptr: gl.tensor
    sb_ptr: gl.tensor
    M: gl.tensor
    N: gl.tensor
    num_k: gl.tensor
    stride_sam: gl.tensor
    stride_sak: gl.tensor
    stride_sbn: gl.tensor
    stride_sbk: gl.tensor
    WEIGHT_BLOCKS: gl.constexpr
    ACCUMULATE: gl.constexpr
    GROUP_M: gl.constexpr
    NUM_WG: gl.constexpr
    HALVES: gl.constexpr
    TIE: gl.constexpr
    CLUSTER_M: gl.constexpr
    PREFETCH: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, empty_b, done, sa_ptr, sb_ptr,
                 M, N, num_k, stride_sam, stride_sak, stride_sbn, stride_sbk, WEIGHT_BLOCKS, ACCUMULATE, GROUP_M,
                 NUM_WG, HALVES, TIE, CLUSTER_M, PREFETCH):
        self.a_desc = a_desc
        self.b_desc = b_desc
        self.c_desc = c_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.c_bufs = c_bufs
        self.ready = ready
        self.empty = empty
        self.empty_b = empty_b
        self.done = done
        self.sa_ptr = sa_ptr
        self.sb_ptr = sb_ptr
        self.M = M
        self.N = N
        self.num_k = num_k
        self.stride_sam = stride_sam
        self.stride_sak = stride_sak
        self.stride_sbn = stride_sbn
        self.stride_sbk = stride_sbk
        self.WEIGHT_BLOCKS = gl.constexpr(WEIGHT_BLOCKS)
        self.ACCUMULATE = gl.constexpr(ACCUMULATE)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.NUM_WG = gl.constexpr(NUM_WG)
        self.HALVES = gl.constexpr(HALVES)
        self.TIE = gl.constexpr(TIE)
        self.CLUSTER_M = gl.constexpr(CLUSTER_M)
        self.PREFETCH = gl.constexpr(PREFETCH)


@gluon.jit
def _num_tiles(p):
    BLOCK_M: gl.constexpr = 64 * p.CLUSTER_M * p.NUM_WG * p.HALVES
    BLOCK_N: gl.constexpr = p.b_desc.block_type.shape[0]
    return gl.cdiv(p.M, BLOCK_M) * gl.cdiv(p.N, BLOCK_N)


@gluon.jit
def _tile(p, t):
    """Cluster tile ``t``'s ``(off_m, off_n)``, in bands of GROUP_M row tiles."""
    BLOCK_M: gl.constexpr = 64 * p.CLUSTER_M * p.NUM_WG * p.HALVES
    BLOCK_N: gl.constexpr = p.b_desc.block_type.shape[0]
    num_pid_m = gl.cdiv(p.M, BLOCK_M)
    width = p.GROUP_M * gl.cdiv(p.N, BLOCK_N)
    first_m = (t // width) * p.GROUP_M
    group = gl.minimum(num_pid_m - first_m, p.GROUP_M)
    return (first_m + (t % width) % group) * BLOCK_M, ((t % width) // group) * BLOCK_N


@gluon.jit
def _a_scale(p, rows, i):
    return gl.load(p.sa_ptr + rows * p.stride_sam + i * p.stride_sak, mask=rows < p.M, other=0.0)


@gluon.jit
def _b_scale(p, off_n, cols, i):
    if p.WEIGHT_BLOCKS:
        sb = gl.load(p.sb_ptr + (off_n // 128) * p.stride_sbn + i * p.stride_sbk)
    else:
        sb = gl.load(p.sb_ptr + cols * p.stride_sbn + i * p.stride_sbk, mask=cols < p.N, other=0.0)
    return sb


@gluon.jit
def _promote(p, acc, part, sa, sb):
    """``acc + part·scale``, rounded as cuBLAS' block-scaled kernels round it."""
    if p.WEIGHT_BLOCKS:
        out = acc + part * (gl.expand_dims(sa, 1) * sb)
    else:
        out = acc + (part * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)
    return out


@gluon.jit
def _store_rows(p, acc, layout: gl.constexpr, c_buf, done, row, off_n, phase):
    if p.ACCUMULATE:
        mbarrier.expect(done, p.c_desc.block_type.nbytes // p.CLUSTER_M)
        tma.async_load(p.c_desc, [row, off_n], done, c_buf)
        mbarrier.wait(done, phase)
        acc = acc + c_buf.load(layout)
        gl.barrier()
    c_buf.store(acc.to(p.c_desc.dtype))
    fence_async_shared()
    tma.async_store(p.c_desc, [row, off_n], c_buf)
    tma.store_wait(0)


@gluon.jit
def _consumer(p, WG: gl.constexpr):
    STAGES: gl.constexpr = p.b_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = p.b_desc.block_type.shape[0]
    SLAB: gl.constexpr = 64 * p.CLUSTER_M
    H: gl.constexpr = p.HALVES
    SLABS: gl.constexpr = p.NUM_WG * H
    if p.CLUSTER_M == 2:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32], cga_layout=[[1, 0]])
    else:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
    rs = gl.arange(0, SLAB, layout=gl.SliceLayout(1, mma_layout))
    cn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    part = gl.zeros((SLAB, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    it = 0
    tc = 0
    for t in range(gl.program_id(0), _num_tiles(p), gl.num_programs(0)):
        off_m, off_n = _tile(p, t)
        row0 = off_m + WG * H * SLAB
        rows0 = row0 + rs
        rows1 = rows0 + SLAB
        cols = off_n + cn
        acc0 = gl.zeros((SLAB, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        acc1 = gl.zeros((SLAB, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        if p.PREFETCH:
            sa = _a_scale(p, rows0, 0)
            sb = _b_scale(p, off_n, cols, 0)
        for i in range(p.num_k):
            s = it % STAGES
            if not p.PREFETCH:
                sb = _b_scale(p, off_n, cols, i)
                sa = _a_scale(p, rows0, i)
            mbarrier.wait(p.ready.index(s), (it // STAGES) & 1)
            part = warpgroup_mma(p.a_bufs.index(s * SLABS + WG * H), p.b_bufs.index(s).permute((1, 0)), part,
                                 use_acc=False, is_async=True)
            if p.PREFETCH:  # the next K tile's scales load while this block product runs
                nxt = gl.minimum(i + 1, p.num_k - 1)
                sa_n = _a_scale(p, rows0, nxt)
                sb_n = _b_scale(p, off_n, cols, nxt)
            part = warpgroup_mma_wait(0, deps=(part, ))
            if H == 1:
                mbarrier.arrive(p.empty.index(s), count=1)
                if p.CLUSTER_M == 2:
                    mbarrier.arrive(p.empty_b.index(s), count=1)
            acc0 = _promote(p, acc0, part, sa, sb)
            if H == 2:
                sa1 = _a_scale(p, rows1, i)
                if p.TIE:
                    part = gl.inline_asm_elementwise("fma.rn.f32 $0, $2, 0f00000000, $1;", "=r,r,r", [part, acc0],
                                                     dtype=gl.float32, is_pure=True, pack=1)
                part = warpgroup_mma(p.a_bufs.index(s * SLABS + WG * H + 1), p.b_bufs.index(s).permute((1, 0)),
                                     part, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(0, deps=(part, ))
                mbarrier.arrive(p.empty.index(s), count=1)
                if p.CLUSTER_M == 2:
                    mbarrier.arrive(p.empty_b.index(s), count=1)
                acc1 = _promote(p, acc1, part, sa1, sb)
            if p.PREFETCH:
                sa = sa_n
                sb = sb_n
            it += 1
        c_buf = p.c_bufs.index(WG)
        done = p.done.index(WG)
        _store_rows(p, acc0, mma_layout, c_buf, done, row0, off_n, (tc * H) & 1)
        if H == 2:
            _store_rows(p, acc1, mma_layout, c_buf, done, row0 + SLAB, off_n, (tc * H + 1) & 1)
        tc += 1


@gluon.jit
def _loader(p, WG: gl.constexpr):
    STAGES: gl.constexpr = p.b_bufs.type.shape[0]
    SLAB: gl.constexpr = 64 * p.CLUSTER_M
    SLABS: gl.constexpr = p.NUM_WG * p.HALVES
    # bytes landing in each CTA per stage: its 64 rows of every slab, the whole B tile
    A_BYTES: gl.constexpr = p.a_desc.block_type.nbytes // p.CLUSTER_M
    B_BYTES: gl.constexpr = p.b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), _num_tiles(p), gl.num_programs(0)):
        off_m, off_n = _tile(p, t)
        for i in range(p.num_k):
            s = it % STAGES
            ph = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(p.empty.index(s), ph)
            if p.CLUSTER_M == 2:
                mbarrier.wait(p.empty_b.index(s), ph)  # CTA 0 only: both CTAs released the B stage
            bar = p.ready.index(s)
            mbarrier.expect(bar, SLABS * A_BYTES + B_BYTES)
            for w in gl.static_range(SLABS):
                tma.async_load(p.a_desc, [off_m + w * SLAB, i * 128], bar, p.a_bufs.index(s * SLABS + w))
            tma.async_load(p.b_desc, [off_n, i * 128], bar, p.b_bufs.index(s), multicast=p.CLUSTER_M == 2)
            it += 1


@gluon.jit
def blockwise_gemm_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                          stride_sam, stride_sak, stride_sbn, stride_sbk,
                          WEIGHT_BLOCKS: gl.constexpr, ACCUMULATE: gl.constexpr, NUM_WG: gl.constexpr,
                          HALVES: gl.constexpr, TIE: gl.constexpr, CLUSTER_M: gl.constexpr, PREFETCH: gl.constexpr,
                          STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          LOADER_REGS: gl.constexpr):
    SLABS: gl.constexpr = NUM_WG * HALVES
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * SLABS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [NUM_WG] + c_desc.block_type.shape, c_desc.layout)
    if CLUSTER_M == 2:
        per_cta: gl.constexpr = mbarrier.MBarrierLayout.multicta(2)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 2], per_cta)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 2], per_cta)
        done = gl.allocate_shared_memory(gl.int64, [NUM_WG, 2], per_cta)
        # one barrier, in CTA 0, that every CTA's consumers arrive on (init count x 2)
        empty_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout(cga_layout=[[0]]))
    else:
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        empty_b = empty
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NUM_WG)
        if CLUSTER_M == 2:
            mbarrier.init(empty_b.index(s), count=NUM_WG)
    for s in gl.static_range(NUM_WG):
        mbarrier.init(done.index(s), count=1)
    fence_async_shared()

    p = Args(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, empty_b, done,
             sa_ptr, sb_ptr, gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(K // 128),
             gl.to_tensor(stride_sam), gl.to_tensor(stride_sak), gl.to_tensor(stride_sbn),
             gl.to_tensor(stride_sbk), WEIGHT_BLOCKS, ACCUMULATE, GROUP_M, NUM_WG, HALVES, TIE, CLUSTER_M, PREFETCH)
    if NUM_WG == 2:
        gl.warp_specialize([(_consumer, (p, 0)), (_consumer, (p, 1)), (_loader, (p, 2))], [4, 1],
                           [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([(_consumer, (p, 0)), (_consumer, (p, 1)), (_consumer, (p, 2)), (_loader, (p, 3))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
