"""Fused Triton quantisers are bit-identical to the reference quantisers.

On a GPU the compiled kernels run; on CPU, if Triton is installed, the same kernels run under
Triton's interpreter (TRITON_INTERPRET=1). The interpreter's own FP8 conversion of NaN is wrong
(it is a CPU emulation of the cast), so NaN-containing groups are checked on the GPU only; on
CPU they are checked through the dequantised values, which must be non-finite."""

import os

import pytest
import torch

from fp8_ref import structured
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


def _same(a, b, nan_codes=True):
    fa, fb = a.data.float(), b.data.float()
    if nan_codes:
        assert torch.equal(torch.nan_to_num(fa, nan=1e9), torch.nan_to_num(fb, nan=1e9))
    assert torch.equal(torch.nan_to_num(a.scale_inv, nan=-1.0), torch.nan_to_num(b.scale_inv, nan=-1.0))
    if b.scale_e8m0 is not None:
        assert torch.equal(a.scale_e8m0.view(torch.uint8), b.scale_e8m0.view(torch.uint8))


def _input(dtype, special):
    x = structured(200, 300, seed=7)
    x[70, :128] = 0.0          # an all-zero group
    x[90, 10] = 1e-30          # deep underflow
    x[11, 40] = 460.0 * 2.0**-3  # near the E8M0 ceil boundary
    if special:
        x[3, 5] = float("nan")
        x[150, 7] = float("inf")
    return x.to(DEV, dtype)


CASES = [("e4m3", 128, "pow2"), ("e4m3", 128, "fp32"), ("e5m2", 128, "fp32"),
         ("e4m3", 32, "e8m0_ceil"), ("e4m3", 32, "e8m0_floor")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt, group, rounding", CASES)
def test_rows_and_transposed_cols(tk, dtype, fmt, group, rounding):
    x = _input(dtype, special=False)
    _same(tk.quantize_rows(x, fmt, group, rounding), quantize(x, fmt, f"1x{group}", rounding))
    _same(tk.quantize_cols_t(x, fmt, group, rounding), quantize(x, fmt, f"1x{group}", rounding, dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_and_tensor(tk, dtype):
    x = _input(dtype, special=False)
    for rnd in ("pow2", "fp32"):
        _same(tk.quantize_blocks128(x, "e4m3", rnd), quantize(x, "e4m3", "128x128", rnd))
    for fmt in ("e4m3", "e5m2"):
        _same(tk.quantize_tensor(x, fmt), quantize(x, fmt, "tensor"))
        s = torch.tensor(3.7, device=DEV)
        _same(tk.quantize_tensor(x, fmt, scale=s), quantize(x, fmt, "tensor", scale=s))


@pytest.mark.parametrize("fmt, group, rounding", CASES)
def test_nan_inf_groups(tk, fmt, group, rounding):
    x = _input(torch.float32, special=True)
    a = tk.quantize_rows(x, fmt, group, rounding)
    b = quantize(x, fmt, f"1x{group}", rounding)
    _same(a, b, nan_codes=ON_GPU)
    deq = a.dequantize()
    assert not torch.isfinite(deq[3, 5]) and not torch.isfinite(deq[150, 7])
    assert torch.isfinite(deq[100:140]).all()


@pytest.mark.parametrize("fmt, group, rounding", CASES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["aligned", "ragged"])
def test_both_copies_from_one_read(tk, fmt, group, rounding, shape):
    x = structured(*shape, seed=9).to(DEV, torch.bfloat16)
    a, b = tk.quantize_dual(x, fmt, group, rounding)
    _same(a, quantize(x, fmt, f"1x{group}", rounding))
    _same(b, quantize(x, fmt, f"1x{group}", rounding, dim=0))
    assert b.data.is_contiguous() and b.data.shape == (shape[1], shape[0])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_codes_and_transpose_from_one_read(tk, fmt):
    x = structured(200, 300, seed=10).to(DEV, torch.bfloat16)
    for scale in (None, torch.tensor(2.5, device=DEV)):
        a, b = tk.quantize_tensor_dual(x, fmt, scale=scale)
        ref = quantize(x, fmt, "tensor", scale=scale)
        _same(a, ref)
        assert torch.equal(b.data.float(), ref.data.float().t()) and b.data.is_contiguous()
