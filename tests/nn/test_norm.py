"""RMSNorm → quantise: the fused RMSNorm kernels against a float64 reference, the quantisation
they start for the FP8 linears that read the norm's output against the reference quantisers
(bit for bit), and the model path that hands it over.

On a GPU the compiled kernels run; on CPU the same kernels run under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), with the module-level gate pointed at them."""

import os

import pytest
import torch
from helpers.fp8_ref import structured

from nemo_fp8_recipes.quant.reference import quantize

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
EPS = 1e-5


@pytest.fixture(scope="module")
def tk():
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")
    from nemo_fp8_recipes.quant import triton_kernels

    return triton_kernels


@pytest.fixture
def fused_on_cpu(monkeypatch, tk):
    """On CPU, let the model's norms take the fused kernels (they run under the interpreter)."""
    import nemo_fp8_recipes.nn.norm as norm

    if not ON_GPU:
        monkeypatch.setattr(norm, "triton_enabled", lambda x, triton=None: True)
    return norm


def _rows(R, D, seed, dtype):
    """Rows with structured outliers (a few channels 100x, one row tiny, one huge)."""
    x = structured(R, D, seed=seed) * 3
    x[:, 5] *= 100.0
    if R > 3:
        x[2] *= 1e-4
        x[3] *= 1e3
    return x.to(DEV, dtype)


def _weight(D, seed):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(D, generator=g)).to(DEV)


def _ref64(x, w):
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return x64 * rstd * w.double(), rstd.squeeze(-1)


def _ulp(v, dtype):
    """One unit in the last place of ``dtype`` at |v| (float64 tensor)."""
    mant = 7 if dtype == torch.bfloat16 else 23
    e = torch.floor(torch.log2(v.abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - mant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 300, 1024])
def test_forward_within_an_ulp_of_float64(tk, dtype, D):
    x, w = _rows(48, D, 1, dtype), _weight(D, 2)
    y, rstd, amax, q = tk.rmsnorm_forward(x, w, EPS)
    y64, r64 = _ref64(x, w)
    assert y.dtype == dtype and amax is None and q is None
    # BF16: its rounding (half an ulp) plus the FP32 math; FP32: the sum of squares, the rstd
    # and the two products, each rounded (a few ulps)
    assert torch.all((y.double() - y64).abs() <= _ulp(y64, dtype) * (1 if dtype == torch.bfloat16 else 8))
    torch.testing.assert_close(rstd.double(), r64, rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "fmt, group, rounding",
    [
        ("e4m3", 128, "pow2"),
        ("e4m3", 128, "fp32"),
        ("e5m2", 128, "fp32"),
        ("e4m3", 32, "e8m0_ceil"),
        ("e4m3", 32, "e8m0_floor"),
    ],
)
def test_row_codes_and_amax_are_the_reference_quantisers_of_y(tk, dtype, fmt, group, rounding):
    """The codes and scales the norm's pass writes are bit-identical to the reference quantiser
    applied to the ``y`` it stores (and to the row kernel's); its amax is ``max|y|``."""
    D = 300  # a partial last group
    x, w = _rows(40, D, 3, dtype), _weight(D, 4)
    x[7, :128] = 0.0  # an all-zero group
    y, _, amax, q = tk.rmsnorm_forward(x, w, EPS, amax=True, rows=(fmt, group, rounding))
    ref = quantize(y, fmt, f"1x{group}", rounding)
    assert torch.equal(q.data.float(), ref.data.float())
    assert torch.equal(q.scale_inv, ref.scale_inv)
    if ref.scale_e8m0 is not None:
        assert torch.equal(q.scale_e8m0.view(torch.uint8), ref.scale_e8m0.view(torch.uint8))
    assert amax.item() == y.float().abs().max().item()
    # the tensorwise pair cast from that amax is the reference's
    a, b = tk.quantize_tensor_dual(y, "e4m3", "fp32", amax=amax)
    ra = quantize(y, "e4m3", "tensor")
    assert torch.equal(a.data.float(), ra.data.float()) and torch.equal(b.data.float(), ra.data.float().t())
    assert torch.equal(a.scale_inv, ra.scale_inv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [300, 4096])
def test_norm_values_do_not_depend_on_what_the_pass_also_does(tk, dtype, D):
    """y and rstd are bit-identical whether the pass also takes the amax or writes row codes
    (on an H200 a version that quantised the register tile changed the sum's order, and so rstd,
    for FP32 rows: the norm's output then depended on the recipe)."""
    x, w = _rows(64, D, 15, dtype), _weight(D, 16)
    y0, r0, _, _ = tk.rmsnorm_forward(x, w, EPS)
    for kw in ({"amax": True}, {"rows": ("e4m3", 128, "pow2")}, {"rows": ("e4m3", 32, "e8m0_ceil")}):
        y, r, _, _ = tk.rmsnorm_forward(x, w, EPS, **kw)
        assert torch.equal(r, r0), kw
        assert torch.equal(y, y0), kw


def test_output_takes_in_place_ops_and_double_backward_says_no(fused_on_cpu):
    """The fused norm's output is an ordinary tensor (in-place ops and in-place dropout work, as
    on the formula's); a second-order gradient through it raises instead of silently dropping
    the norm's term."""
    norm = fused_on_cpu
    x = _rows(8, 64, 17, torch.float32).view(2, 4, 64).requires_grad_()
    w = _weight(64, 18).requires_grad_()
    y = norm.rms_norm(x, w, EPS)
    assert type(y.grad_fn).__name__ == "_RMSNormFnBackward" and y.shape == x.shape
    y.mul_(2.0)
    torch.nn.functional.dropout(y, p=0.1, inplace=True)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    (g,) = torch.autograd.grad(norm.rms_norm(x, w, EPS).pow(2).sum(), x, create_graph=True)
    penalty = (g**2).sum() + (x**2).sum()  # a gradient penalty: the norm's term must not vanish
    with pytest.raises(RuntimeError, match="once_differentiable"):
        penalty.backward()


def test_nan_row_poisons_its_row_and_the_amax(tk):
    x, w = _rows(8, 256, 5, torch.bfloat16), _weight(256, 6)
    x[3, 17] = float("nan")
    y, _, amax, q = tk.rmsnorm_forward(x, w, EPS, amax=True, rows=("e4m3", 128, "pow2"))
    assert torch.isnan(y[3]).all() and torch.isfinite(y[[0, 1, 2, 4, 5, 6, 7]]).all()
    assert torch.isnan(amax).all()
    assert torch.isnan(q.scale_inv[3]).all() and torch.isfinite(q.scale_inv[[0, 1, 2, 4]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R", [1, 40])  # 40: not a multiple of the rows per program
def test_backward_matches_float64_autograd(tk, dtype, R):
    D = 300
    x, w = _rows(R, D, 7, dtype), _weight(D, 8)
    _, rstd, _, _ = tk.rmsnorm_forward(x, w, EPS)
    dy = structured(R, D, seed=9).to(DEV, dtype)
    dx, dw = tk.rmsnorm_backward(dy, x, w, rstd)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w64
    y64.backward(dy.double())
    assert dx.dtype == dtype and dw.dtype == w.dtype
    tol = 2 * _ulp(x64.grad, dtype) + 1e-6 * x64.grad.abs().max()
    assert torch.all((dx.double() - x64.grad).abs() <= tol)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=1e-5, atol=1e-5 * w64.grad.abs().max().item())
    dx2, dw2 = tk.rmsnorm_backward(dy, x, w, rstd, need_dw=False)
    assert dw2 is None and torch.equal(dx, dx2)


def test_limits_are_explicit(tk):
    with pytest.raises(ValueError, match="at most 16384"):
        tk.rmsnorm_forward(torch.zeros(2, 16385, device=DEV), torch.ones(16385, device=DEV), EPS)
    with pytest.raises(ValueError, match="BF16 or FP32"):
        tk.rmsnorm_forward(torch.zeros(2, 8, device=DEV, dtype=torch.float16), torch.ones(8, device=DEV), EPS)
    with pytest.raises(ValueError, match="precomputed amax"):
        tk.quantize_tensor_dual(torch.zeros(4, 4, device=DEV), "e4m3", scale=torch.ones(()), amax=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="one-element float32"):
        tk.quantize_tensor_dual(
            torch.zeros(4, 4, device=DEV), "e4m3", amax=torch.zeros(1, 1, device=DEV, dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="out must be"):
        tk.rmsnorm_forward(
            torch.zeros(2, 8, device=DEV), torch.ones(8, device=DEV), EPS, out=torch.empty(8, 2, device=DEV)
        )


def test_module_fused_matches_formula_and_falls_back(fused_on_cpu):
    """The model's RMSNorm through the fused path: values and gradients as the FP32 formula's
    (to rounding); the formula itself with ``KernelOptions(fused_norm=False)`` (or
    ``triton=False``), for other dtypes, and for subclasses."""
    from nemo_fp8_recipes.models.llama import RMSNorm
    from nemo_fp8_recipes.nn import apply_kernel_options
    from nemo_fp8_recipes.options import KernelOptions

    norm = fused_on_cpu
    m = RMSNorm(256).to(DEV)
    with torch.no_grad():
        m.weight.copy_(_weight(256, 11))
    x = _rows(32, 256, 12, torch.bfloat16).requires_grad_()
    y = m(x.view(2, 16, 256))
    assert type(y.grad_fn).__name__ == "_RMSNormFnBackward"
    dy = structured(2 * 16, 256, seed=13).to(DEV, torch.bfloat16).view(2, 16, 256)
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_()
    w2 = m.weight.detach().clone().requires_grad_()
    y2 = norm.rms_norm_reference(x2.view(2, 16, 256), w2, EPS)
    y2.backward(dy)
    assert (y.float() - y2.float()).abs().max() <= y2.float().abs().max() * 2**-7
    torch.testing.assert_close(m.weight.grad, w2.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(x.grad.float(), x2.grad.float(), rtol=2e-2, atol=1e-2 * x2.grad.abs().max().item())
    assert norm.fused_norm_enabled(x, m.weight)
    assert not norm.fused_norm_enabled(x.half(), m.weight)
    off = KernelOptions(fused_norm=False)
    assert not norm.fused_norm_enabled(x, m.weight, off)
    assert not norm.fused_norm_enabled(x, m.weight, KernelOptions(triton=False))
    apply_kernel_options(m, off)
    assert m.kernel_options is off and m(x).grad_fn.name() != "_RMSNormFnBackward"


def _block(recipe, seed=0):
    from nemo_fp8_recipes.models.config import ModelConfig
    from nemo_fp8_recipes.models.llama import TransformerBlock, precompute_rope
    from nemo_fp8_recipes.nn import convert_model

    cfg = ModelConfig(vocab_size=512, dim=256, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=384, max_seq_len=64)
    torch.manual_seed(seed)
    blk = TransformerBlock(0, cfg)
    with torch.no_grad():
        for n in (blk.attention_norm, blk.ffn_norm):
            n.weight.copy_(_weight(256, 21))
    blk = blk.to(DEV, torch.bfloat16)
    if recipe != "bf16":
        convert_model(blk, recipe, emulate=True)
    return blk, precompute_rope(cfg, device=DEV)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_norm_quantises_for_its_fp8_consumers_bit_identically(recipe, fused_on_cpu, monkeypatch):
    """A transformer block whose norms start their consumers' input quantisation (the amax per
    tensor, the row codes for 1xN groups) gives the same outputs and gradients, bit for bit, as
    the same block whose linears quantise the norms' outputs themselves — and those linears then
    quantise no input of their own (q/k/v and gate/up all take the norm's codes)."""
    from nemo_fp8_recipes.nn.linear import Float8Linear

    norm = fused_on_cpu
    calls = []
    real = Float8Linear._quantize_operand

    def counted(self, i, t, pair=False, gate=None):
        if i == 0:
            calls.append(self.fqn)
        return real(self, i, t, pair=pair, gate=gate)

    monkeypatch.setattr(Float8Linear, "_quantize_operand", counted)
    x = (structured(64, 256, seed=31) * 2).to(DEV, torch.bfloat16).view(1, 64, 256)
    dy = structured(64, 256, seed=32).to(DEV, torch.bfloat16).view(1, 64, 256)

    real_plan = norm.input_prequantization
    handover = [True]
    monkeypatch.setattr(norm, "input_prequantization", lambda mod, t: real_plan(mod, t) if handover[0] else None)

    def run(prequantise):
        handover[0] = prequantise
        blk, rope = _block(recipe)
        xi = x.clone().requires_grad_()
        out, _ = blk(xi, rope)
        out.backward(dy)
        return out, xi.grad, [p.grad for p in blk.parameters()]

    n0 = len(calls)
    out_a, dx_a, g_a = run(True)
    fused_calls = calls[n0:]
    n1 = len(calls)
    out_b, dx_b, g_b = run(False)
    own_calls = calls[n1:]
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))
    # without the handover: one quantisation per norm output (shared by q/k/v and by gate/up)
    # plus the attention output (wo) and the activation (w2); with it only wo and w2 remain
    assert len(own_calls) == 4 and len(fused_calls) == 2
    assert not any(n.endswith(("wq", "wk", "wv", "w1", "w3")) for n in fused_calls)


def test_no_handover_where_it_would_not_be_shared(fused_on_cpu, monkeypatch):
    """Delayed scaling (a scale per module), telemetry, evaluation (no grad) and
    ``KernelOptions(shared_input=False)`` leave the quantisation to the linears; the norm's values stay."""
    from nemo_fp8_recipes.nn import apply_kernel_options, set_telemetry
    from nemo_fp8_recipes.nn.shared_input import input_prequantization
    from nemo_fp8_recipes.options import KernelOptions

    norm = fused_on_cpu
    x = structured(64, 256, seed=41).to(DEV, torch.bfloat16)
    blk, _ = _block("delayed")
    assert input_prequantization(blk.attention.wq, x) is None
    blk, _ = _block("tensorwise")
    assert input_prequantization(blk.attention.wq, x) is not None
    assert input_prequantization(torch.nn.Linear(256, 256), x) is None
    blk.attention.wq.weight.requires_grad_(False)  # frozen: no wgrad copy to hand over
    assert input_prequantization(blk.attention.wq, x) is None
    blk.attention.wq.weight.requires_grad_(True)
    set_telemetry(blk, True)
    assert input_prequantization(blk.attention.wq, x) is None
    set_telemetry(blk, False)
    apply_kernel_options(blk, KernelOptions(shared_input=False))
    assert input_prequantization(blk.attention.wq, x) is None
    apply_kernel_options(blk, KernelOptions())
    seen = []
    monkeypatch.setattr(norm, "share_input_quantization", lambda *a: seen.append(a))
    with torch.no_grad():
        blk.attention_norm(x, consumer=blk.attention.wq)
    assert seen == []
    blk.attention_norm(x.requires_grad_(), consumer=blk.attention.wq)
    assert len(seen) == 1
