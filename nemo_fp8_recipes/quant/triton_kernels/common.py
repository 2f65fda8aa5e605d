"""What every kernel family of the package shares on the host: the optional Triton import
(:data:`HAVE_TRITON`), whether kernels run under Triton's CPU interpreter, the scale-rounding
modes and format constants the kernels take, the checks made before a launch (Triton present,
32-bit offsets enough), the tile-order and grid helpers, and the launch-configuration table
:data:`LAUNCH` with :func:`launch_config` to override it."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # Triton is optional: GPU machines have it; CPU CI may install it for the interpreter.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    libdevice = None
    HAVE_TRITON = False

from ...formats import Format, ScaleRounding

#: The scale rule of each rounding, as the kernels' ``MODE`` constexpr (``>= 2``: E8M0 scales).
SCALE_MODE_ID = {ScaleRounding.FP32: 0, ScaleRounding.POW2: 1, ScaleRounding.E8M0_CEIL: 2, ScaleRounding.E8M0_FLOOR: 3}


#: Launch configurations (tile sizes, warps and options) per kernel. They change the speed, never
#: the codes (every configuration gives the same bits: tests/quant/test_triton_kernels.py). The values are
#: the fastest of ``benchmarks/quant_bandwidth.py --sweep all``; docs/internals/kernels.md has the
#: measured times behind each. Override temporarily with :func:`launch_config`. The options:
#:
#: - ``group_r``: the order tiles run in, bands of ``group_r`` row tiles (0: all row tiles of a
#:   column of tiles, row tiles fastest; :func:`tile_ids`);
#: - ``groups``: scaling groups per tile along the grouped dimension (1xN rows and columns);
#: - ``bf16_tile``: a BF16 source's tile stays BF16 through the amax (fewer live registers);
#: - ``amax_check``: kernels folding a per-tensor amax into one address read it first and skip
#:   the atomic where their own amax is not larger;
#: - ``fold_amax`` (delayed pair): the amax is taken inside the cast pass (one read) instead of by
#:   the atomic amax pass first (two reads);
#: - ``elems_per_thread`` (RMSNorm): one row per program, warps = row length / (32 x this);
#:   ``rows_per_program`` (its backward): consecutive rows per program, each writing one partial
#:   weight gradient.
LAUNCH = {
    "rows128": {"block_r": 64, "num_warps": 2, "groups": 1, "group_r": 0},
    "rows32": {"block_r": 16, "num_warps": 4, "groups": 16, "group_r": 0},
    "cols_t128": {"block_c": 64, "num_warps": 2, "groups": 1, "group_r": 0, "bf16_tile": True},
    "cols_t32": {"block_c": 128, "num_warps": 2, "groups": 1, "group_r": 0, "bf16_tile": True},
    "blocks128": {"num_warps": 16, "group_r": 0},
    "tensor": {"block": 8192, "num_warps": 8, "amax_check": True},
    "tensor_delayed": {"block": 4096, "num_warps": 8, "amax_check": True},
    "tensor_dual": {"block_r": 64, "block_c": 256, "num_warps": 8},
    "tensor_dual_delayed": {
        "block_r": 32,
        "block_c": 256,
        "num_warps": 4,
        "fold_amax": True,
        "bf16_tile": True,
        "amax_check": True,
    },
    "rmsnorm": {"elems_per_thread": 8},
    "rmsnorm_bwd": {"elems_per_thread": 8, "rows_per_program": 16},
}


@contextlib.contextmanager
def launch_config(kernel: str, **cfg):
    """Temporarily override a kernel's launch configuration (for tuning sweeps)::

    with launch_config("rows128", block_r=16, num_warps=8):
        quantize_rows(x, "e4m3", 128, "pow2")
    """
    if kernel not in LAUNCH:
        raise KeyError(f"unknown kernel {kernel!r}; valid: {', '.join(LAUNCH)}")
    bad = set(cfg) - set(LAUNCH[kernel])
    if bad:
        raise KeyError(f"{kernel} has no launch option {', '.join(sorted(bad))}; valid: {', '.join(LAUNCH[kernel])}")
    old = dict(LAUNCH[kernel])
    LAUNCH[kernel].update(cfg)
    try:
        yield
    finally:
        LAUNCH[kernel].clear()
        LAUNCH[kernel].update(old)


def interpreting() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``), read at
    each call."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT function: a few µs per Python call)."""
    return -(-a // b)


def hw_cvt(x: torch.Tensor) -> bool:
    """Whether the store's FP8 cast is the GPU's hardware RNE conversion (compiled for CUDA) rather
    than the interpreter's CPU emulation, which needs the explicit rounding of ``round_to_fp8``."""
    if not x.is_cuda or interpreting():
        return False
    return cvt_capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def cvt_capable(index: int) -> bool:
    # Triton lowers an FP32 -> FP8 cast to the direct cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (one
    # rounding) on sm_90+; for sm_89, Triton 3.6 goes through FP16 (two roundings, which can
    # differ from one) while 3.9 converts directly. Below sm_90 the kernels therefore keep the
    # explicit rounding, whose result is exactly representable, so any conversion of it is
    # exact. The sm_90 lowering is checked in CI by compiling the kernels
    # (tests/quant/test_triton_kernels.py).
    return torch.cuda.get_device_capability(index) >= (9, 0)


def tile_group_rows(cfg: dict, n_r: int) -> int:
    """The ``group_r`` of a launch configuration (row tiles per band, :func:`tile_ids`; 0 or
    absent = all of them: row tiles fastest over the whole grid)."""
    g = int(cfg.get("group_r", 0))
    return n_r if g <= 0 else min(g, n_r)


#: The kernels address elements with 32-bit offsets (Triton's default for int arguments and
#: program ids): the largest element offset of every tensor they read or write must fit.
INT32_MAX = 2**31 - 1


def require_triton(*tensors: torch.Tensor):
    """Triton is there, and each of ``tensors`` (the sources; every output a kernel writes has the
    same number of elements or fewer) can be addressed with 32-bit element offsets — else a clear
    error instead of wrapped offsets that would read and write the wrong elements."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed: `pip install triton` (GPU machines ship it)")
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        # a source whose last dim is not contiguous is copied first (then numel is what counts);
        # otherwise the kernels read it through its own strides
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.stride(-1) == 1 else 0
        if t.numel() > INT32_MAX or last > INT32_MAX:
            raise ValueError(
                f"tensor of shape {tuple(t.shape)} ({t.numel():,} elements) is too large for the fused Triton "
                f"quantisers, which index with 32-bit offsets (at most {INT32_MAX:,} elements): use fewer tokens "
                "per micro-batch or shard the layer (tensor parallelism), or run the model with "
                "KernelOptions(triton=False) (trainer: kernels.triton=false) to use the reference quantisers "
                "(same codes, slower)"
            )


def top_mant(fmt: Format) -> int:
    # ceil rule: bump the exponent when amax's significand 1.m exceeds fmax / 2^emax (1.75 E4M3)
    top = fmt.max / float(2**fmt.emax)
    return int(round((top - 1.0) * (1 << 23)))


def e8m0_view(e8: torch.Tensor) -> torch.Tensor:
    """The E8M0 scales the kernels write as ``uint8``, viewed as ``float8_e8m0fnu``."""
    return e8.view(torch.float8_e8m0fnu)
