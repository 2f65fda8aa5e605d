"""Fused Triton quantisers are bit-identical to the reference quantisers.

On a GPU the compiled kernels run; on CPU, if Triton is installed, the same kernels run under
Triton's interpreter (TRITON_INTERPRET=1). The interpreter's own FP8 conversion of NaN is wrong
(it is a CPU emulation of the cast), so NaN-containing groups are checked on the GPU only; on
CPU they are checked through the dequantised values, which must be non-finite."""

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.fp8_ref import structured

from nemo_fp8_recipes.options import KernelOptions
from nemo_fp8_recipes.quant.dispatch import quantize_pair_auto
from nemo_fp8_recipes.quant.reference import quantize

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="module")
def tk():
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")
    from nemo_fp8_recipes.quant import triton_kernels

    return triton_kernels


def _dual_module():
    """The benchmarks' one-read 1xN pair kernel (``benchmarks/fp8_kernels/quantize_dual.py``), which
    the library does not use; it is built from the library's device functions."""
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        from fp8_kernels import quantize_dual
    finally:
        sys.path.remove(bench)
    return quantize_dual


@pytest.fixture(scope="module")
def quantize_dual(tk):
    return _dual_module().quantize_dual


def _same(a, b, nan_codes=True):
    """Same codes (:func:`_same_codes`) and the same scales. ``nan_codes=False``: where either
    side holds a NaN code, not compared at all (the interpreter's FP8 cast of NaN is numpy's, not
    the hardware's)."""
    assert _same_codes(a.data, b.data, nan_codes)
    assert torch.equal(torch.nan_to_num(a.scale_inv, nan=-1.0), torch.nan_to_num(b.scale_inv, nan=-1.0))
    if b.scale_e8m0 is not None:
        assert torch.equal(a.scale_e8m0.view(torch.uint8), b.scale_e8m0.view(torch.uint8))


def _same_codes(a, b, nan_codes=True):
    """Two FP8 code tensors (e.g. a kernel's transposed copy and the reference's transposed view)
    equal byte for byte, signed zeros included; NaN codes at the same places (their bytes not
    compared: a NaN's sign and payload carry nothing). ``nan_codes=False``: positions where
    either side is NaN are skipped."""
    if a.shape != b.shape:
        return False
    nan, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    if nan_codes and not torch.equal(nan, nan_b):
        return False
    nan = nan | nan_b
    return torch.equal(a.contiguous().view(torch.uint8)[~nan], b.contiguous().view(torch.uint8)[~nan])


def _input(dtype, special):
    x = structured(200, 300, seed=7)
    x[70, :128] = 0.0  # an all-zero group
    x[90, 10] = 1e-30  # deep underflow
    x[11, 40] = 460.0 * 2.0**-3  # near the E8M0 ceil boundary
    if special:
        x[3, 5] = float("nan")
        x[150, 7] = float("inf")
    return x.to(DEV, dtype)


CASES = [
    ("e4m3", 128, "pow2"),
    ("e4m3", 128, "fp32"),
    ("e5m2", 128, "fp32"),
    ("e4m3", 32, "e8m0_ceil"),
    ("e4m3", 32, "e8m0_floor"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt, group, rounding", CASES)
def test_rows_and_transposed_cols(tk, dtype, fmt, group, rounding):
    x = _input(dtype, special=False)
    _same(tk.quantize_rows(x, fmt, group, rounding), quantize(x, fmt, f"1x{group}", rounding))
    _same(tk.quantize_cols_t(x, fmt, group, rounding), quantize(x, fmt, f"1x{group}", rounding, dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_and_tensor(tk, dtype, monkeypatch):
    from nemo_fp8_recipes.quant import dispatch

    if not ON_GPU:  # the dispatch picks the kernels for CUDA tensors; here, through the interpreter
        monkeypatch.setattr(dispatch, "triton_enabled", lambda t, triton=None: triton is not False)
    x = _input(dtype, special=False)
    for rnd in ("pow2", "fp32"):
        ref = quantize(x, "e4m3", "128x128", rnd)
        _same(tk.quantize_blocks128(x, "e4m3", rnd), ref)
        q, qt = tk.quantize_blocks128(x, "e4m3", rnd, transposed=True)  # + the dgrad copy, one pass
        _same(q, ref)
        assert qt.data.shape == (300, 200) and qt.data.is_contiguous()
        _same(qt, ref.t())
        # what the weight's dgrad copy is built from, with and without the kernels
        for triton in (True, False):
            a, b = quantize_pair_auto(x, "e4m3", "128x128", rnd, triton=triton)
            _same(a, ref)
            _same(b, ref.t())
            assert b.data.is_contiguous() is triton  # the kernel's transposed codes, or a view
    for fmt in ("e4m3", "e5m2"):
        _same(tk.quantize_tensor(x, fmt), quantize(x, fmt, "tensor"))
        s = torch.tensor(3.7, device=DEV)
        _same(tk.quantize_tensor(x, fmt, scale=s), quantize(x, fmt, "tensor", scale=s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1536, 2048), (384, 1000)], ids=["12x16-blocks", "ragged"])
def test_weight_blocks_with_their_transposed_copy(tk, dtype, shape):
    """A weight of many 128x128 blocks (an FP32 master weight, as the linear quantises it, and
    BF16), with outlier rows and columns: the kernel's transposed copy is exactly the reference
    codes transposed, and the same pass's row-major codes are unchanged."""
    g = torch.Generator().manual_seed(11)
    w = torch.empty(shape).uniform_(-0.03, 0.03, generator=g)
    w[:, 5] *= 40.0
    w[700 % shape[0]] *= 1e-4
    w = w.to(DEV, dtype)
    for rnd in ("pow2", "fp32"):
        ref = quantize(w, "e4m3", "128x128", rnd)
        q, qt = tk.quantize_blocks128(w, "e4m3", rnd, transposed=True)
        _same(q, ref)
        _same(qt, ref.t())
        assert qt.data.is_contiguous() and not torch.isnan(qt.data.float()).any()


@pytest.mark.parametrize("fmt, group, rounding", CASES)
@pytest.mark.parametrize("groups", [1, 4], ids=["1group", "4groups"])
def test_nan_inf_groups(tk, fmt, group, rounding, groups):
    """NaN/Inf stay in their own group, also when one tile holds several groups (``groups``)."""
    x = _input(torch.float32, special=True)
    with tk.launch_config(f"rows{group}", groups=groups), tk.launch_config(f"cols_t{group}", groups=groups):
        a = tk.quantize_rows(x, fmt, group, rounding)
        c = tk.quantize_cols_t(x, fmt, group, rounding)
    b = quantize(x, fmt, f"1x{group}", rounding)
    _same(a, b, nan_codes=ON_GPU)
    _same(c, quantize(x, fmt, f"1x{group}", rounding, dim=0), nan_codes=ON_GPU)
    deq = a.dequantize()
    assert not torch.isfinite(deq[3, 5]) and not torch.isfinite(deq[150, 7])
    assert torch.isfinite(deq[100:140]).all()


@pytest.mark.parametrize("fmt, group, rounding", CASES)
def test_bf16_tile_amax_keeps_nan_inf_and_tiny_groups(tk, fmt, group, rounding):
    """``bf16_tile`` takes the column amax on BF16's 16-bit magnitudes: groups with NaN, +Inf,
    -Inf, a negative zero, all zeros, only BF16 subnormals (and the smallest one) give the scales
    and codes of the reference (on CPU the tile's BF16 values are converted from their bits: the
    interpreter's own conversion loses subnormals)."""
    x = _input(torch.float32, special=True)
    x[40, 9], x[41, 9] = float("-inf"), -0.0  # -Inf in a group; a negative zero
    x[:, 20] = 1e-40 * torch.arange(200) - 1e-38  # a column of BF16 subnormals only (and zeros)
    x[5, 21] = -(2.0**-133)  # the smallest BF16 subnormal, negative
    x = x.to(DEV, torch.bfloat16)
    assert (x[:, 20].float().abs() < 2.0**-126).all() and (x[:, 20] != 0).sum() > 100
    ref = quantize(x, fmt, f"1x{group}", rounding, dim=0)
    for cfg in ({"bf16_tile": True, "groups": 2, "block_c": 32}, {"bf16_tile": True, "groups": 1, "block_c": 64}):
        with tk.launch_config(f"cols_t{group}", **cfg):
            _same(tk.quantize_cols_t(x, fmt, group, rounding), ref, nan_codes=ON_GPU)


@pytest.mark.parametrize("fmt, group, rounding", CASES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["aligned", "ragged"])
def test_both_copies_from_one_read(quantize_dual, fmt, group, rounding, shape):
    """The benchmarks' one-read pair kernel gives both 1xN copies of the reference."""
    x = structured(*shape, seed=9).to(DEV, torch.bfloat16)
    a, b = quantize_dual(x, fmt, group, rounding)
    _same(a, quantize(x, fmt, f"1x{group}", rounding))
    _same(b, quantize(x, fmt, f"1x{group}", rounding, dim=0))
    assert b.data.is_contiguous() and b.data.shape == (shape[1], shape[0])


@pytest.mark.parametrize("group, rounding", [(128, "pow2"), (32, "e8m0_ceil")])
def test_group_scale_grids_are_written_outer_dim_major(tk, quantize_dual, group, rounding):
    """Every 1xN quantiser (rows, transposed columns, the RMSNorm's row codes, and the benchmarks'
    one-read pair) writes its ``[rows, groups]`` scale grid with strides ``(1, rows)`` — the layout the
    block-scaled GEMM reads — so ``gemm.outer_major`` hands it over without a copy; the values
    are the reference's (the other tests here)."""
    from nemo_fp8_recipes.quant.scaled_mm import outer_major

    x = structured(200, 384, seed=3).to(DEV, torch.bfloat16)
    qs = [
        tk.quantize_rows(x, "e4m3", group, rounding),
        tk.quantize_cols_t(x, "e4m3", group, rounding),
        *quantize_dual(x, "e4m3", group, rounding),
        tk.rmsnorm_forward(x, torch.ones(384, device=DEV), 1e-5, rows=("e4m3", group, rounding))[3],
    ]
    for q in qs:
        rows = q.data.shape[0]
        grids = [q.scale_inv] + ([q.scale_e8m0] if q.scale_e8m0 is not None else [])
        for g in grids:
            assert g.shape == (rows, -(-q.data.shape[1] // group)) and g.stride() == (1, rows), g.stride()
        assert outer_major(q.scale_inv).data_ptr() == q.scale_inv.data_ptr()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_codes_and_transpose_from_one_read(tk, fmt):
    x = structured(200, 300, seed=10).to(DEV, torch.bfloat16)
    for scale in (None, torch.tensor(2.5, device=DEV)):
        a, b = tk.quantize_tensor_dual(x, fmt, scale=scale)
        ref = quantize(x, fmt, "tensor", scale=scale)
        _same(a, ref)
        assert _same_codes(b.data, ref.data.t()) and b.data.is_contiguous()


def _ties_and_neighbours(fmt):
    """Every FP8 value, the exact midpoints between neighbours (round-half-to-even ties), one FP32
    ulp either side of each midpoint, values past the format maximum, and the subnormal range's
    own midpoints — the inputs on which a wrong rounding instruction would differ."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    v = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)]).double()
    mids = (v[1:] + v[:-1]) / 2
    f32 = mids.float()
    up, down = torch.nextafter(f32, torch.full_like(f32, float("inf"))), torch.nextafter(f32, torch.zeros_like(f32))
    fmax = float(v[-1])
    big = torch.tensor([fmax * 1.01, fmax * 1.0625, fmax * 4, 3e38])
    pos = torch.cat([v.float(), f32, up, down, big])
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_ties_subnormals_and_saturation(tk, fmt):
    x = _ties_and_neighbours(fmt)
    n = x.numel()
    x = torch.nn.functional.pad(x, (0, 128 * ((n + 127) // 128) - n)).reshape(-1, 128).to(DEV)
    one = torch.tensor(1.0, device=DEV)
    _same(tk.quantize_tensor(x, fmt, scale=one), quantize(x, fmt, "tensor", scale=one))
    a, b = tk.quantize_tensor_dual(x, fmt, scale=one)
    _same(a, quantize(x, fmt, "tensor", scale=one))
    # the same values through a 1x128 kernel: with each group's amax at the format maximum the
    # pow2 scale is exactly 1, so the ties reach the rounding unchanged
    fmax = 448.0 if fmt == "e4m3" else 57344.0
    xr = x.clamp(-fmax, fmax)
    xr[:, 0] = fmax
    _same(tk.quantize_rows(xr, fmt, 128, "pow2"), quantize(xr, fmt, "1x128", "pow2"))
    assert torch.equal(quantize(xr, fmt, "1x128", "pow2").scale_inv, torch.ones_like(xr[:, :1]))


@pytest.mark.parametrize(
    "kernel, cfg",
    [
        ("rows128", {"block_r": 8, "num_warps": 8}),
        ("rows128", {"block_r": 64, "num_warps": 2}),
        ("rows32", {"block_r": 128}),
        ("cols_t128", {"block_c": 32}),
        ("cols_t32", {"block_c": 128, "num_warps": 8}),
        ("rows32", {"block_r": 16, "groups": 8}),
        ("rows128", {"block_r": 8, "groups": 2}),
        ("cols_t32", {"block_c": 64, "groups": 4}),
        ("cols_t128", {"block_c": 32, "groups": 2}),
        ("blocks128", {"num_warps": 8}),
        ("tensor", {"block": 2048, "num_warps": 8}),
        ("tensor_dual", {"block_r": 32, "block_c": 64}),
        ("tensor_dual", {"block_r": 128, "block_c": 32}),
        ("tensor_dual_delayed", {"fold_amax": False}),
        ("tensor_dual_delayed", {"block_r": 32, "block_c": 64, "num_warps": 4}),
        # tile order: bands of group_r row tiles (3 of 4 row tiles: a partial last band)
        ("rows128", {"group_r": 3}),
        ("rows32", {"group_r": 5}),
        ("cols_t128", {"group_r": 1}),
        ("cols_t32", {"group_r": 2, "block_c": 32}),
        ("blocks128", {"group_r": 1}),
        # the BF16 tile kept in BF16 through the amax (the test's input is BF16)
        ("cols_t128", {"bf16_tile": False}),
        ("cols_t128", {"bf16_tile": True, "groups": 2, "block_c": 32}),
        ("cols_t32", {"bf16_tile": False}),
        ("cols_t32", {"bf16_tile": True, "groups": 4, "block_c": 32}),
        ("tensor_delayed", {"block": 2048, "num_warps": 4}),
        ("tensor_dual_delayed", {"bf16_tile": False}),
        ("tensor_dual_delayed", {"bf16_tile": True, "block_r": 32, "block_c": 256}),
    ],
)
def test_launch_configurations_change_speed_not_bits(tk, kernel, cfg):
    """The tuning knobs of benchmarks/quant_bandwidth.py --sweep: any tile size and tile order
    gives the same codes and scales (ragged shape, so partial tiles are exercised)."""
    x = structured(200, 300, seed=11).to(DEV, torch.bfloat16)
    before = dict(tk.LAUNCH[kernel])
    with tk.launch_config(kernel, **cfg):
        assert all(tk.LAUNCH[kernel][k] == v for k, v in cfg.items())
        if kernel == "rows128":
            _same(tk.quantize_rows(x, "e4m3", 128, "pow2"), quantize(x, "e4m3", "1x128", "pow2"))
        elif kernel == "rows32":
            _same(tk.quantize_rows(x, "e4m3", 32, "e8m0_ceil"), quantize(x, "e4m3", "1x32", "e8m0_ceil"))
        elif kernel == "cols_t128":
            _same(tk.quantize_cols_t(x, "e4m3", 128, "pow2"), quantize(x, "e4m3", "1x128", "pow2", dim=0))
        elif kernel == "cols_t32":
            _same(tk.quantize_cols_t(x, "e4m3", 32, "e8m0_ceil"), quantize(x, "e4m3", "1x32", "e8m0_ceil", dim=0))
        elif kernel == "blocks128":
            _same(tk.quantize_blocks128(x, "e4m3", "pow2"), quantize(x, "e4m3", "128x128", "pow2"))
        elif kernel == "tensor":
            _same(tk.quantize_tensor(x, "e4m3"), quantize(x, "e4m3", "tensor"))
        elif kernel == "tensor_delayed":  # the given-scale cast with its amax folded in
            s = torch.tensor(0.25, device=DEV)
            acc = torch.zeros(1, device=DEV)
            ref = quantize(x, "e5m2", "tensor", scale=s)
            _same(tk.quantize_tensor(x, "e5m2", scale=s, amax_out=acc), ref)
            assert torch.equal(acc, ref.amax.reshape(1))
            # this entry, not current scaling's "tensor", launches the given-scale cast: a block
            # Triton refuses (not a power of 2) fails it, and only it
            with tk.launch_config("tensor_delayed", block=3000):
                _same(tk.quantize_tensor(x, "e5m2"), quantize(x, "e5m2", "tensor"))
                with pytest.raises(Exception, match="power of 2"):
                    tk.quantize_tensor(x, "e5m2", scale=s)
        elif kernel == "tensor_dual_delayed":
            s = torch.tensor(0.25, device=DEV)
            ref = quantize(x, "e5m2", "tensor", scale=s)
            acc = torch.zeros(1, device=DEV)
            a, b = tk.quantize_tensor_dual(x, "e5m2", scale=s, amax_out=acc)
            _same(a, ref)
            assert _same_codes(b.data, ref.data.t())
            assert torch.equal(acc, ref.amax.reshape(1))
        else:
            a, b = tk.quantize_tensor_dual(x, "e5m2")
            ref = quantize(x, "e5m2", "tensor")
            _same(a, ref)
            assert _same_codes(b.data, ref.data.t())
    assert tk.LAUNCH[kernel] == before  # restored


def test_triton_true_asks_for_the_kernels(tk, monkeypatch):
    """``triton=True`` runs the kernels (on CPU: under the interpreter, as the benchmark smoke
    does) and says why it cannot, instead of falling back to the reference."""
    from nemo_fp8_recipes.quant.dispatch import quantize_auto

    x = structured(64, 256, seed=5).to(DEV, torch.bfloat16)
    _same(quantize_auto(x, "e4m3", "1x128", "pow2", dim=0, triton=True), quantize(x, "e4m3", "1x128", "pow2", dim=0))
    a, b = quantize_pair_auto(x, "e4m3", "128x128", "pow2", triton=True)
    assert b.data.is_contiguous()  # the kernel's own transposed copy, not the reference's view
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="CUDA tensors .*TRITON_INTERPRET=1"):
            quantize_auto(x, "e4m3", "1x128", "pow2", triton=True)


def test_launch_config_names_the_valid_choices(tk):
    with pytest.raises(KeyError, match="valid: rows128"):
        with tk.launch_config("rows64", block_r=8):
            pass
    with pytest.raises(KeyError, match="valid: block_r, num_warps"):
        with tk.launch_config("rows128", tile=8):
            pass


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("special", ["nan", "inf", "zeros", "tiny"])
@pytest.mark.parametrize("amax_check", [False, True], ids=["atomic", "check-first"])
def test_per_tensor_special_amax(tk, fmt, special, amax_check):
    """The per-tensor amax pass (atomic max over IEEE bits; ``amax_check``: each program reads
    the accumulator first and skips its atomic unless larger) and the in-kernel scale rule: NaN
    anywhere gives a NaN amax and scale, +/-Inf an infinite amax (scale 0), all zeros scale 1, a
    tiny amax FLT_MAX — each as the reference computes it."""
    with tk.launch_config("tensor", amax_check=amax_check, block=2048):
        _per_tensor_special_amax(tk, fmt, special)


def _per_tensor_special_amax(tk, fmt, special):
    x = structured(200, 300, seed=12).to(DEV, torch.float32)
    if special == "nan":
        x[7, 9] = float("nan")
    elif special == "inf":
        x[150, 3] = float("-inf")
    elif special == "zeros":
        x.zero_()
    else:
        x = torch.full_like(x, 1e-40)
    for rounding in ("fp32", "pow2"):
        ref = quantize(x, fmt, "tensor", rounding)
        got = tk.quantize_tensor(x, fmt, rounding)
        assert torch.equal(torch.nan_to_num(got.amax, nan=-1.0), torch.nan_to_num(ref.amax.reshape(1, 1), nan=-1.0))
        _same(got, ref, nan_codes=ON_GPU or special in ("zeros", "tiny"))
        a, _ = tk.quantize_tensor_dual(x, fmt, rounding)
        _same(a, ref, nan_codes=ON_GPU or special in ("zeros", "tiny"))


def test_per_tensor_strided_and_empty_inputs(tk):
    base = structured(200, 600, seed=13).to(DEV, torch.bfloat16)
    x = base[:, ::2]  # not contiguous along the last dim
    y = base[:, :300]  # unit stride along the last dim, row stride 600
    for t in (x, y):
        _same(tk.quantize_tensor(t, "e4m3"), quantize(t, "e4m3", "tensor"))
    a, b = tk.quantize_tensor_dual(y, "e4m3")
    ref = quantize(y, "e4m3", "tensor")
    _same(a, ref)
    assert _same_codes(b.data, ref.data.t())
    e = tk.quantize_tensor(torch.empty(0, 64, device=DEV), "e4m3")
    assert e.data.shape == (0, 64) and e.scale_inv.item() == 1.0 and e.amax.item() == 0.0


@pytest.mark.parametrize(
    "kernel, cfg",
    [("dual32", {"tile": 128}), ("dual128", {"num_warps": 8}), ("dual128", {"group_r": 1}), ("dual32", {"group_r": 2})],
)
def test_one_read_pair_launch_configurations_change_speed_not_bits(tk, quantize_dual, kernel, cfg):
    """The sweep's knobs of the benchmarks' one-read pair kernel (``dual128`` / ``dual32``)."""
    x = structured(200, 300, seed=11).to(DEV, torch.bfloat16)
    g, r = (32, "e8m0_ceil") if kernel == "dual32" else (128, "pow2")
    with tk.launch_config(kernel, **cfg):
        a, b = quantize_dual(x, "e4m3", g, r)
    _same(a, quantize(x, "e4m3", f"1x{g}", r))
    _same(b, quantize(x, "e4m3", f"1x{g}", r, dim=0))


def test_tensors_beyond_32_bit_offsets_are_refused_with_what_to_do():
    """The kernels index with 32-bit element offsets. A source of 2^31 elements or more (e.g.
    65536 tokens x 53248, a 405B FFN activation at micro-batch 8 x 8192) — or a view whose last
    element lies that far — would make them read and write wrong elements; every wrapper refuses
    it before launching, naming the limit and the ways out. Meta tensors: nothing is allocated."""
    from nemo_fp8_recipes.quant import triton_kernels as tk

    big = torch.empty(65536, 53248, dtype=torch.bfloat16, device="meta")
    wide = torch.empty(2, 2**31, dtype=torch.bfloat16, device="meta")[:, :256]  # 512 elements, row stride 2^31
    calls = [
        lambda t: tk.quantize_rows(t, "e4m3", 128, "pow2"),
        lambda t: tk.quantize_cols_t(t, "e4m3", 128, "pow2"),
        lambda t: tk.quantize_blocks128(t, "e4m3", "pow2"),
        lambda t: tk.quantize_tensor(t, "e4m3"),
        lambda t: tk.quantize_tensor_dual(t, "e4m3"),
        lambda t: _dual_module().quantize_dual(t, "e4m3", 128, "pow2"),  # (the benchmarks' kernel)
        lambda t: tk.rmsnorm_forward(t, torch.ones(t.shape[1], device="meta"), 1e-5),
        lambda t: tk.swiglu_backward(t, t, t),
    ]
    for t in (big, wide):
        for call in calls:
            with pytest.raises(ValueError, match=r"32-bit offsets.*KernelOptions\(triton=False\)"):
                call(t)
    # what fits passes the check: the largest offset just inside, and a view with a large row
    # stride along a non-contiguous last dim (the wrappers copy it first)
    tk.common.require_triton(torch.empty(2**31 - 1, dtype=torch.bfloat16, device="meta"))
    tk.common.require_triton(torch.empty(4, 2**31, device="meta")[:, :1].t())  # shape (1, 4), strides (1, 2^31)
    with pytest.raises(ValueError, match="2,147,483,648 elements"):
        tk.common.require_triton(torch.empty(2**31, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_infinities_with_a_given_scale(tk, fmt):
    """Delayed scaling casts with a given scale, so an infinite element meets the conversion
    itself: E5M2 keeps ±Inf (codes 0x7C / 0xFC), E4M3 has none and gives NaN — as the reference.
    (The GPU's saturating conversion alone would write ±57344 for E5M2.)"""
    x = structured(64, 256, seed=14).to(DEV, torch.float32)
    x[3, 5], x[7, 200], x[9, 9] = float("inf"), float("-inf"), 1e30
    one = torch.tensor(1.0, device=DEV)
    ref = quantize(x, fmt, "tensor", scale=one)
    for got in (tk.quantize_tensor(x, fmt, scale=one), tk.quantize_tensor_dual(x, fmt, scale=one)[0]):
        codes = got.data.view(torch.uint8)
        if fmt == "e5m2":
            assert codes[3, 5].item() == 0x7C and codes[7, 200].item() == 0xFC
        if ON_GPU:  # the codes themselves (the interpreter's cast mangles NaN)
            assert torch.equal(codes, ref.data.view(torch.uint8))
        else:
            _same(got, ref, nan_codes=fmt == "e5m2")
        assert got.data[9, 9].float().item() == (448.0 if fmt == "e4m3" else 57344.0)  # saturated


def _bits(t):
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bf16_tile", [False, True], ids=["fp32-tile", "bf16-tile"])
@pytest.mark.parametrize("amax_check", [False, True], ids=["atomic", "check-first"])
def test_given_scale_cast_folds_the_amax_into_one_pass(tk, fmt, bf16_tile, amax_check):
    """Delayed scaling: the cast with a given scale also takes the tensor's amax (no amax pass)
    and max-accumulates it into ``amax_out`` (NaN sticks); codes and scale_inv as the reference.
    ``bf16_tile``: the pair kernel takes that amax on the BF16 tile's 16-bit magnitudes.
    ``amax_check``: each program reads the accumulator and skips its atomic unless larger
    (small tiles here, so that many programs fold into one accumulator)."""
    with (
        tk.launch_config("tensor_dual_delayed", bf16_tile=bf16_tile, amax_check=amax_check, block_r=32, block_c=64),
        tk.launch_config("tensor_delayed", amax_check=amax_check, block=1024),
    ):
        _given_scale_cast_folds_the_amax(tk, fmt)


def _given_scale_cast_folds_the_amax(tk, fmt):
    x = structured(200, 300, seed=15).to(DEV, torch.bfloat16)
    s = torch.tensor(3.0, device=DEV)
    ref = quantize(x, fmt, "tensor", scale=s)
    for fn in (tk.quantize_tensor, lambda *a, **k: tk.quantize_tensor_dual(*a, **k)[0]):
        got = fn(x, fmt, scale=s)  # a fresh accumulator: this tensor's amax
        _same(got, ref)
        assert torch.equal(got.amax.reshape(()), ref.amax.reshape(()))
        buf = torch.zeros(1, device=DEV)
        got = fn(x, fmt, scale=s, amax_out=buf)
        assert got.amax.data_ptr() == buf.data_ptr() and torch.equal(buf, ref.amax.reshape(1))
        buf.fill_(1e6)
        fn(x, fmt, scale=s, amax_out=buf)
        assert buf.item() == 1e6  # a larger running max stays
        y = x.clone()
        y[5, 6] = float("nan")
        fn(y, fmt, scale=s, amax_out=buf)
        fn(x, fmt, scale=s, amax_out=buf)
        assert torch.isnan(buf).all()  # NaN sticks
    a, b = tk.quantize_tensor_dual(x, fmt, scale=s, amax_out=torch.zeros(1, device=DEV))
    assert _same_codes(b.data, ref.data.t())
    with pytest.raises(ValueError, match="given .delayed. scale"):
        tk.quantize_tensor(x, fmt, amax_out=torch.zeros(1, device=DEV))
    with pytest.raises(ValueError, match="one-element float32"):
        tk.quantize_tensor(x, fmt, scale=s, amax_out=torch.zeros(2, device=DEV))


def test_reference_path_keeps_the_amax_out_contract():
    """``quantize_auto``/``quantize_pair_auto`` without Triton (CPU, or ``triton=False``) follow
    the same ``amax_out`` contract as the kernels."""
    from nemo_fp8_recipes.quant.dispatch import quantize_auto, quantize_pair_auto

    x = structured(64, 256, seed=16)
    s = torch.tensor(2.0)
    buf = torch.zeros(1)
    q = quantize_auto(x, "e4m3", "tensor", scale=s, amax_out=buf, triton=False)
    assert torch.equal(buf, x.abs().amax().reshape(1)) and q.amax.data_ptr() == buf.data_ptr()
    buf.fill_(1e9)
    a, b = quantize_pair_auto(x, "e4m3", "tensor", scale=s, amax_out=buf, triton=False)
    assert buf.item() == 1e9 and _same_codes(b.data, a.data.t())
    with pytest.raises(ValueError, match="per-tensor cast with a given"):
        quantize_auto(x, "e4m3", "1x128", "pow2", amax_out=buf, triton=False)


@pytest.mark.parametrize("L", [1, 7, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_commit_kernel_matches_advance_delayed_scaling(tk, L, algo):
    """The one-kernel history update gives the bits of nn.scaling.advance_delayed_scaling: every
    pending value class (normal, zero, NaN, Inf, subnormal, one so small that fmax/amax
    overflows), flag set or not, margins 0 and 3, E4M3 and E5M2."""
    import dataclasses

    from nemo_fp8_recipes.quant.delayed import advance_delayed_scaling
    from nemo_fp8_recipes.recipes import get_recipe

    g = torch.Generator().manual_seed(L)
    pendings = [3.5, 0.0, float("nan"), float("inf"), 1e-42, 1e-39, 1234.5]
    for margin in (0, 3):
        r = dataclasses.replace(get_recipe("delayed"), amax_compute_algo=algo, margin=margin, amax_history_len=L)
        for fmt in ("e4m3", "e5m2"):
            for k, pend in enumerate(pendings):
                for flag in (0.0, 1.0):
                    hist = torch.rand(L, generator=g) * 10.0
                    if L > 3:
                        hist[2] = 0.0
                        hist[-1] = 50.0 if k % 2 else hist[-1]
                    if k == 0 and L > 1:
                        hist.zero_()  # an all-zero history: amax 0 keeps the old scale
                    scale = torch.tensor([0.75])
                    ref_h, ref_s = advance_delayed_scaling(
                        hist[None, None], scale[None], torch.tensor([[pend]]), torch.tensor([[flag]]), (fmt,), r
                    )
                    h, sc = hist.to(DEV), scale.to(DEV)
                    p, f = torch.tensor([pend], device=DEV), torch.tensor([flag], device=DEV)
                    after = float((k + int(flag)) % 2)  # both values of flag_after, for every class
                    tk.delayed_commit(h, sc, p, f, fmt, algo, margin, flag_after=after)
                    assert torch.equal(_bits(h.cpu()), _bits(ref_h.reshape(L))), (fmt, pend, flag, margin)
                    assert torch.equal(_bits(sc.cpu()), _bits(ref_s.reshape(1))), (fmt, pend, flag, margin)
                    assert p.item() == 0.0 and f.item() == after


def _force_triton(monkeypatch):
    """Run the Float8Linear's Triton paths on CPU tensors through the interpreter (on a GPU they
    run anyway) and count the calls that must happen there."""
    from nemo_fp8_recipes.nn import linear as linear_mod
    from nemo_fp8_recipes.quant import dispatch
    from nemo_fp8_recipes.quant import triton_kernels as tkm

    calls = {"commit": 0, "fold": 0}
    if not ON_GPU:
        monkeypatch.setattr(dispatch, "triton_enabled", lambda x, triton=None: triton is not False)
        monkeypatch.setattr(linear_mod, "triton_enabled", lambda x, triton=None: triton is not False)
    commit, dual = tkm.delayed_commit, tkm.quantize_tensor_dual

    def counting_commit(*a, **k):
        calls["commit"] += 1
        return commit(*a, **k)

    def counting_dual(*a, **k):
        calls["fold"] += k.get("amax_out") is not None
        return dual(*a, **k)

    monkeypatch.setattr(tkm, "delayed_commit", counting_commit)
    monkeypatch.setattr(tkm, "quantize_tensor_dual", counting_dual)
    return calls


@pytest.mark.parametrize("schedule", ["lazy", "step"])
def test_delayed_linear_with_the_fused_kernels_matches_the_reference_path(tk, schedule, monkeypatch):
    """A delayed-scaling Float8Linear trained for a few steps with the Triton path (one-pass
    cast + amax, one-kernel commit) has the same outputs, gradients, amax histories and scales,
    bit for bit, as with the reference quantisers and the PyTorch history update. Two
    micro-batches per step, the second with the smaller amax, so that "max over the step" and
    "latest value" differ."""
    import dataclasses

    from nemo_fp8_recipes.nn import Float8Linear, sync_delayed_scaling
    from nemo_fp8_recipes.recipes import get_recipe

    r = dataclasses.replace(get_recipe("delayed"), amax_history_len=4)

    def run(use_triton):
        calls = None
        if use_triton:
            calls = _force_triton(monkeypatch)
        torch.manual_seed(0)
        lin = torch.nn.Linear(256, 128, bias=False, device=DEV)
        m = Float8Linear.from_linear(lin, r, emulate=not ON_GPU, options=KernelOptions(triton=use_triton))
        m.reconfigure(scaling_update=schedule)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        outs = []
        for step in range(3):
            for micro, gain in enumerate((1 + 3 * step, 0.25)):
                x = (structured(64, 256, seed=20 + 2 * step + micro) * gain).to(DEV).requires_grad_(True)
                y = m(x)
                y.backward(torch.ones_like(y) * 1e-2 * gain)
                outs += [y.detach().clone(), x.grad.clone()]
            outs.append(m.weight.grad.clone())
            opt.step()
            opt.zero_grad()
            if schedule == "step":
                sync_delayed_scaling(m)
        monkeypatch.undo()
        return outs, m.fp8_amax_history.clone(), m.fp8_scale.clone(), m.fp8_amax_pending.clone(), calls

    (o1, h1, s1, p1, calls), (o2, h2, s2, p2, _) = run(True), run(False)
    assert calls["fold"] > 0 and (calls["commit"] > 0) == (schedule == "lazy")  # the fused path ran
    assert torch.equal(h1, h2) and torch.equal(s1, s2) and torch.equal(p1, p2)
    assert (h1 > 0).any()
    for a, b in zip(o1, o2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_delayed_telemetry_reports_each_calls_amax_in_step_mode(tk, use_triton, monkeypatch):
    """With telemetry on, each quantisation's statistics carry its own amax (not the step's
    running max), while the pending amax still accumulates the max (NaN sticks)."""
    from nemo_fp8_recipes.nn import Float8Linear
    from nemo_fp8_recipes.recipes import get_recipe

    if use_triton:
        _force_triton(monkeypatch)
    m = Float8Linear.from_linear(
        torch.nn.Linear(64, 32, bias=False, device=DEV),
        get_recipe("delayed"),
        emulate=not ON_GPU,
        options=KernelOptions(triton=use_triton),
    )
    m.reconfigure(scaling_update="step", telemetry=True)
    xs = [structured(16, 64, seed=1) * 100, structured(16, 64, seed=2), structured(16, 64, seed=3)]
    xs[1][3, 3] = float("nan")
    with torch.no_grad():
        for x in xs:
            m(x.to(DEV))
    got = [float(row[0]) for row in m._telemetry[0]]
    want = [float(x.abs().amax()) for x in xs]
    assert got[0] == want[0] and got[2] == want[2] and got[1] == 0.0  # non-finite amax reported as 0
    assert torch.isnan(m.fp8_amax_pending[0])


def test_delayed_commit_is_undone_when_the_cast_fails(tk, monkeypatch):
    """Lazy schedule: the one-kernel commit leaves the pending flag set for the cast that follows;
    if that cast raises, the flag is cleared again, so the next commit appends no phantom 0."""
    from nemo_fp8_recipes.nn import Float8Linear
    from nemo_fp8_recipes.nn import linear as linear_mod
    from nemo_fp8_recipes.recipes import get_recipe

    calls = _force_triton(monkeypatch)
    m = Float8Linear.from_linear(
        torch.nn.Linear(64, 32, bias=False, device=DEV), get_recipe("delayed"), emulate=not ON_GPU
    )
    x = structured(16, 64, seed=4).to(DEV)
    with torch.no_grad():
        m(x)  # records the first amaxes
    hist = m.fp8_amax_history.clone()

    def broken(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(linear_mod, "quantize", broken)
    monkeypatch.setattr(linear_mod, "quantize_pair_auto", broken)
    with pytest.raises(RuntimeError, match="simulated"), torch.no_grad():
        m(x)
    assert calls["commit"] >= 1
    # the weight is re-quantised first (its FP8 copy follows its history): its commit appended the
    # pending amax, the cast failed, and the flag is cleared again
    w_amax = m.weight.detach().abs().amax()
    assert m.fp8_pending[1].item() == 0.0 and m._pending[1] is False
    assert m.fp8_amax_history[1, 0] == w_amax and torch.equal(m.fp8_amax_history[1, 1:], hist[1, :-1])
    # the input's amax, never reached, is still pending (not lost, not appended twice)
    assert m.fp8_pending[0].item() == 1.0 and m._pending[0] is True and torch.equal(m.fp8_amax_history[0], hist[0])
    monkeypatch.undo()
    calls = _force_triton(monkeypatch)
    with torch.no_grad():
        m(x)  # the next forward commits the input's amax exactly once
    assert m.fp8_amax_history[0, 0] == x.abs().amax() and torch.equal(m.fp8_amax_history[0, 1:], hist[0, :-1])


@pytest.mark.parametrize("fold", [True, False])
def test_delayed_pair_of_a_row_strided_input(tk, fold):
    """A given-scale pair of a row-strided view (unit stride along the row, as a slice of a
    wider tensor): codes, transpose and accumulated amax as the reference, with the amax folded
    into the cast or taken by the separate pass (its PyTorch fallback for strided inputs)."""
    y = structured(200, 600, seed=17).to(DEV, torch.bfloat16)[:, :300]
    s = torch.tensor(0.5, device=DEV)
    ref = quantize(y, "e4m3", "tensor", scale=s)
    acc = torch.zeros(1, device=DEV)
    with tk.launch_config("tensor_dual_delayed", fold_amax=fold):
        a, b = tk.quantize_tensor_dual(y, "e4m3", scale=s, amax_out=acc)
    _same(a, ref)
    assert _same_codes(b.data, ref.data.t()) and torch.equal(acc, ref.amax.reshape(1))


def test_loading_a_sign_bit_nan_pending_amax_keeps_it_nan():
    """The kernels max-accumulate pending amaxes as int32 IEEE bits, where a NaN with the sign
    bit set would lose against any amax: loading a state dict makes pending amaxes non-negative."""
    from nemo_fp8_recipes.nn import Float8Linear
    from nemo_fp8_recipes.recipes import get_recipe

    m = Float8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), get_recipe("delayed"), emulate=True)
    sd = m.state_dict()
    sd["fp8_amax_pending"] = torch.tensor([-float("nan"), -0.0, 2.0])
    m.load_state_dict(sd)
    bits = m.fp8_amax_pending.view(torch.int32)
    assert (bits >= 0).all() and torch.isnan(m.fp8_amax_pending[0])


# ---- ahead-of-time compilation for real GPUs (no GPU needed: Triton's bundled ptxas) ----------
def _aot_report():
    """Run tests/helpers/triton_aot.py without the interpreter (kernels must be real JIT functions to be
    compiled) and return its JSON report; skip where this Triton cannot compile for CUDA."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "helpers" / "triton_aot.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    if rep.get("skip"):
        pytest.skip(rep["skip"])
    return rep


@pytest.fixture(scope="module")
def aot():
    return _aot_report()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_code_uses_one_direct_rounding_on_sm90_only(aot, fmt, monkeypatch):
    """What the hardware-conversion path relies on, checked on the code this Triton generates:
    for sm_90 an FP32 -> FP8 cast is the direct ``cvt.rn.satfinite.<fmt>x2.f32`` (one rounding).
    For sm_89 the lowering depends on the Triton version — Triton 3.6 (the GPU machine's) goes
    through FP16, i.e. two roundings; 3.9 converts directly — so ``cvt_capable`` stays False
    below sm_90 whatever this Triton does there (the explicit rounding is exact everywhere)."""
    assert aot[f"cast_{fmt}_sm90"]["direct_f32_cvt"] and not aot[f"cast_{fmt}_sm90"]["via_f16_cvt"]
    sm89 = aot[f"cast_{fmt}_sm89"]
    assert sm89["error"] is None and (sm89["via_f16_cvt"] or sm89["direct_f32_cvt"])
    from nemo_fp8_recipes.quant import triton_kernels as tk

    try:
        for cap, expect in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=cap: c)
            tk.common.cvt_capable.cache_clear()
            assert tk.common.cvt_capable(0) is expect, cap
    finally:
        tk.common.cvt_capable.cache_clear()


def test_every_kernel_compiles_for_sm90(aot):
    """Each kernel variant the wrappers launch, compiled for Hopper: CI has no GPU, so this is
    where a kernel that the interpreter accepts but the compiler rejects would show."""
    names = [k for k in aot if k.startswith("kernel_")]
    assert len(names) >= 12
    failed = {k: v["error"] for k, v in aot.items() if v.get("error")}
    assert not failed, failed


# ---- SwiGLU -> quantise (the down projection's input from its two halves) ----------------------
def pdt_is_fp32(params: str) -> bool:
    return params == "fp32-autocast"


def _swiglu_halves(dtype, shape=(256, 384), seed=21):
    g = structured(*shape, seed=seed) * 3.0
    g[5, :7] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, -104.0, 40.0])  # exp over/underflow edges
    u = structured(*shape, seed=seed + 1)
    u[9, 3] = 5000.0  # an outlier that sets the amax
    if ON_GPU:  # a subnormal gate (silu(g) subnormal, the product 0.05): does the GPU flush it?
        # (Triton's interpreter converts subnormal BF16 inexactly, so only a GPU can check this)
        g[7, 0], u[7, 0] = 1e-39, 1e38
    return g.to(DEV, dtype).contiguous(), u.to(DEV, dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_swiglu_fused_pair_equals_quantising_the_activation(tk, dtype, fmt):
    """``quantize_tensor_dual(u, gate=g)`` (current scaling: the amax pass computes the activation
    from g and u and writes it, the one-read cast reads it back) gives the codes and scale of
    quantising ``F.silu(g) * u`` as PyTorch computes it; the written activation is PyTorch's,
    bit for bit on the GPU (libdevice's expf, as PyTorch's kernel; the interpreter's NumPy exp
    and its BF16 subnormal stores differ in the last bits, below anything FP8 can represent)."""
    g, u = _swiglu_halves(dtype)
    act = torch.nn.functional.silu(g) * u
    ref = quantize(act, fmt, "tensor")
    a, b = tk.quantize_tensor_dual(u, fmt, gate=g)
    _same(a, ref)
    assert _same_codes(b.data, ref.data.t())
    assert torch.equal(a.amax.reshape(()), ref.amax.reshape(()).float())
    written = torch.full_like(u, float("nan"))
    amax = tk.tensor.tensor_amax(u, gate=g, act_out=written)
    assert torch.equal(amax.reshape(()), ref.amax.reshape(()).float())
    if ON_GPU:
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(written.view(bits), act.view(bits))
    else:
        torch.testing.assert_close(written, act, rtol=2.0**-20, atol=1e-37, equal_nan=True)


@pytest.mark.parametrize("fold", [True, False], ids=["one-pass", "two-pass"])
def test_swiglu_fused_delayed_pair_folds_the_activation_amax(tk, fold):
    """Delayed scaling: a given scale, the activation's amax max-accumulated into ``amax_out``
    (one pass over g and u with ``fold_amax``)."""
    g, u = _swiglu_halves(torch.bfloat16, shape=(200, 300), seed=5)
    act = torch.nn.functional.silu(g) * u
    s = torch.tensor(0.125, device=DEV)
    ref = quantize(act, "e4m3", "tensor", scale=s)
    acc = torch.full((1,), 2.0, device=DEV)  # an earlier use's amax, below this one
    with tk.launch_config("tensor_dual_delayed", fold_amax=fold):
        a, b = tk.quantize_tensor_dual(u, "e4m3", scale=s, amax_out=acc, gate=g)
    _same(a, ref)
    assert _same_codes(b.data, ref.data.t())
    assert torch.equal(acc, ref.amax.reshape(1).float())


def test_swiglu_pair_dispatch_materialises_what_the_kernels_do_not_take(tk, monkeypatch):
    """``quantize_pair_auto(gate=)`` on the Triton path: contiguous BF16/FP32 halves are fused,
    anything else (FP16, transposed views) is materialised first — the same codes, no error."""
    import nemo_fp8_recipes.quant.dispatch as dispatch

    if not ON_GPU:
        monkeypatch.setattr(dispatch, "triton_enabled", lambda x, triton=None: triton is not False)
    g = structured(96, 160, seed=50).to(DEV).clamp(-20, 20)  # FP16-safe magnitudes
    u = structured(96, 160, seed=51).to(DEV).clamp(-100, 100)
    for gg, uu in ((g.half(), u.half()), (g.t(), u.t()), (g.bfloat16(), u.bfloat16())):
        a, b = dispatch.quantize_pair_auto(uu, "e4m3", "tensor", gate=gg)
        ref = quantize(torch.nn.functional.silu(gg) * uu, "e4m3", "tensor")
        _same(a, ref)
        assert _same_codes(b.data, ref.data.t())


def test_swiglu_gate_is_checked(tk):
    g, u = _swiglu_halves(torch.bfloat16, shape=(64, 64))
    with pytest.raises(ValueError, match="gate must match"):
        tk.quantize_tensor_dual(u, "e4m3", gate=g.float())
    with pytest.raises(ValueError, match="contiguous"):
        tk.quantize_tensor_dual(u.t(), "e4m3", gate=g.t())
    with pytest.raises(ValueError, match="BF16 or FP32"):
        tk.quantize_tensor_dual(u.half(), "e4m3", gate=g.half())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_swiglu_backward_kernel_matches_autograd(tk, dtype):
    """One-pass SwiGLU backward vs PyTorch's autograd of ``F.silu(g) * u``: ``du`` bit-identical
    (BF16, and FP32 on a GPU); ``dg`` within one unit in the last place, and no further from the
    float64 derivative."""
    g, u = _swiglu_halves(dtype, shape=(128, 320), seed=3)
    dy = (structured(128, 320, seed=4) * 1e-2).to(DEV, dtype)
    g1, u1 = g.clone().requires_grad_(), u.clone().requires_grad_()
    (torch.nn.functional.silu(g1) * u1).backward(dy)
    dg, du = tk.swiglu_backward(dy, g, u)
    # the interpreter's BF16 store of subnormal results is not exact (g near -88 gives some):
    # there, compare the normal range; a GPU compares everything
    tiny = torch.finfo(torch.float32).tiny

    def normal(t):
        a = t.float().abs()
        return torch.ones_like(a, dtype=torch.bool) if ON_GPU else (a == 0) | (a >= tiny)

    keep_u, keep_g = normal(u1.grad), normal(g1.grad)
    assert int(keep_u.sum()) > 0.99 * du.numel()
    ulp = torch.finfo(dtype).eps
    if ON_GPU or dtype == torch.bfloat16:
        assert torch.equal(du[keep_u], u1.grad[keep_u])
    else:  # FP32 on CPU: PyTorch's vectorised exp and the interpreter's (NumPy) may differ by an ulp
        rel_u = (du.float() - u1.grad.float()).abs() / u1.grad.float().abs().clamp_min(1e-30)
        assert float(rel_u[keep_u].max()) <= 4 * ulp
    if dtype == torch.bfloat16:  # (in FP32 the derivative's cancellation near g = -1.28 makes
        # relative differences meaningless; the float64 comparison below covers it)
        rel = ((dg.float() - g1.grad.float()).abs() / g1.grad.float().abs().clamp_min(1e-30))[keep_g]
        assert float(rel.max()) <= ulp
    gd, ud, dyd = g.double(), u.double(), dy.double()
    sig = torch.sigmoid(gd)
    exact = dyd * ud * sig * (1 + gd * (1 - sig))
    err_fused = (dg.double() - exact)[keep_g].abs().max()
    err_autograd = (g1.grad.double() - exact)[keep_g].abs().max()
    assert err_fused <= err_autograd * (1.01 if dtype == torch.bfloat16 else 2.0) + 1e-30


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("params", ["bf16", "fp32-autocast", "frozen-w2"])
def test_fused_swiglu_mlp_matches_the_unfused_mlp(tk, recipe, params, monkeypatch):
    """``FeedForward`` with FP8 linears: the down projection gets the SwiGLU halves, fuses the
    activation into its input quantisation (delayed scaling) and the SwiGLU backward into one
    kernel (both recipes). Same
    output bits, same delayed-scaling state, the same gradients (w2, w3 and the input within the
    one-ulp rounding of ``dg`` that the fused backward may differ by) as ``KernelOptions(fused_swiglu=False)``.
    ``params``: BF16 parameters; FP32 master weights under BF16 autocast (as the trainer runs);
    a frozen down projection (its input is then quantised once, not as a pair). On CPU the
    fused path is driven through Triton's interpreter with emulated GEMMs."""
    import nemo_fp8_recipes.nn.linear as lin
    import nemo_fp8_recipes.quant.dispatch as dispatch
    from nemo_fp8_recipes.models.llama import FeedForward
    from nemo_fp8_recipes.nn import Float8Linear
    from nemo_fp8_recipes.recipes import get_recipe

    if not ON_GPU:
        monkeypatch.setattr(dispatch, "triton_enabled", lambda x, triton=None: triton is not False)
        monkeypatch.setattr(lin, "triton_enabled", lambda x, triton=None: triton is not False)
    emulate = not ON_GPU
    calls, gated = [], []
    real_bwd, real_dual = tk.swiglu_backward, tk.quantize_tensor_dual
    monkeypatch.setattr(tk, "swiglu_backward", lambda *a: calls.append(1) or real_bwd(*a))
    monkeypatch.setattr(
        tk, "quantize_tensor_dual", lambda *a, **k: gated.append(k.get("gate") is not None) or real_dual(*a, **k)
    )

    def run(fused: bool):
        opts = KernelOptions(fused_swiglu=fused)
        torch.manual_seed(0)
        pdt = torch.float32 if params == "fp32-autocast" else torch.bfloat16
        ff = FeedForward(128, 256).to(DEV, pdt)
        for name in ("w1", "w2", "w3"):
            setattr(
                ff, name, Float8Linear.from_linear(getattr(ff, name), get_recipe(recipe), emulate=emulate, options=opts)
            )
        if params == "frozen-w2":
            ff.w2.weight.requires_grad_(False)
        x = (structured(64, 128, seed=31) * 2).to(DEV, pdt).reshape(2, 32, 128).requires_grad_()
        outs = []
        for step in range(2):  # delayed: the second step uses the history of the first
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=params == "fp32-autocast"):
                y = ff(x)
            y.backward((structured(64, 128, seed=40 + step) * 1e-2).to(DEV, y.dtype).reshape_as(y))
            outs.append(y.detach().clone())
        state = {k: v.clone() for k, v in ff.state_dict().items() if "fp8_" in k}
        grads = {n: p.grad.clone() for n, p in ff.named_parameters() if p.grad is not None}
        return outs, state, grads, x.grad.clone(), ff

    outs_f, state_f, grads_f, dx_f, ff = run(True)
    assert calls, "the fused backward did not run"
    halves = [torch.zeros(32, 256, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    assert ff.w2.fuses_swiglu(*halves)
    default = Float8Linear.from_linear(torch.nn.Linear(256, 128, device=DEV), get_recipe(recipe), emulate=emulate)
    assert KernelOptions().fused_swiglu and default.fuses_swiglu(*halves), "the fused SwiGLU is the default"
    assert ("w2.weight" in grads_f) == (params != "frozen-w2")
    n_fused = len(calls)
    # both recipes quantise the pair from the halves when w2's weight needs its gradient (delayed
    # scaling in its one-pass cast, current scaling in its amax pass); a frozen w2 quantises one
    # copy of the materialised activation
    assert any(gated) == (params != "frozen-w2")
    outs_u, state_u, grads_u, dx_u, _ = run(False)
    assert len(calls) == n_fused  # the unfused run did not use it
    for a, b in zip(outs_f, outs_u):
        assert torch.equal(a, b)
    # delayed-scaling state (delayed only): the forward operands' amaxes are identical; the gate
    # projection's output-gradient amax comes from dg, which may differ in its last bit
    for k in state_u:
        if k.startswith("w1.") and recipe == "delayed" and pdt_is_fp32(params):
            assert torch.allclose(state_f[k], state_u[k], rtol=1e-6, atol=0), k
        else:
            assert torch.equal(state_f[k], state_u[k]), k
    assert set(grads_f) == set(grads_u)
    if "w2.weight" in grads_u:
        assert torch.equal(grads_f["w2.weight"], grads_u["w2.weight"])
    assert torch.equal(grads_f["w3.weight"], grads_u["w3.weight"])
    for n in ("w1.weight",):
        rel = (grads_f[n].float() - grads_u[n].float()).norm() / grads_u[n].float().norm()
        assert float(rel) < 1e-2, (n, float(rel))
    rel = (dx_f.float() - dx_u.float()).norm() / dx_u.float().norm()
    assert float(rel) < 1e-2
