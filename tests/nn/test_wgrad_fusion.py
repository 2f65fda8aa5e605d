"""Fused weight-gradient accumulation (``set_wgrad_accumulation_fusion``): the wgrad GEMM adds
into ``weight.grad`` in place. Semantics on CPU (emulated GEMMs: the same in-place add), the
cuBLASLt accumulating FP8 GEMM against a float64 reference on the GPU (``gpu``-marked)."""

import pytest
import torch
from helpers.fp8_ref import structured

from nemo_fp8_recipes import check_supported, convert_model, get_recipe
from nemo_fp8_recipes.nn import Float8Linear, set_wgrad_accumulation_fusion
from nemo_fp8_recipes.trainer.distributed import DistContext, wrap_model

K, N, M = 256, 128, 64


def _pair(name, device="cpu", emulate=True, seed=0):
    """Two identical Float8Linears, the second with fused accumulation."""
    torch.manual_seed(seed)
    lins = [torch.nn.Linear(K, N, bias=True, device=device) for _ in range(2)]
    lins[1].load_state_dict(lins[0].state_dict())
    mods = [Float8Linear.from_linear(lin, get_recipe(name), emulate=emulate) for lin in lins]
    assert set_wgrad_accumulation_fusion(mods[1]) == 1
    return mods


def _micro_batches(n, device="cpu", dtype=torch.float32, rows=M):
    return [
        (structured(rows, K, seed=i).to(device, dtype), (structured(rows, N, seed=50 + i) * 1e-3).to(device, dtype))
        for i in range(n)
    ]


def _count_calls(monkeypatch, module, fn_name: str) -> list:
    """Wrap ``module.fn_name`` (the real function still runs) and list its calls."""
    calls, real = [], getattr(module, fn_name)

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, fn_name, counted)
    return calls


def _accumulate_grad_inputs(mod) -> list:
    """What autograd hands the weight's AccumulateGrad each backward: a gradient, or none
    (the wgrad GEMM already added it)."""
    got = []
    node = mod.grad_accumulator()
    node.register_prehook(lambda g: got.append("none" if g[0] is None else "gradient"))
    mod.kept_grad_accumulator = node  # the weight holds its node only weakly
    return got


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_fused_accumulation_equals_autograd_accumulation(name):
    plain, fused = _pair(name)
    assert "fuse_wgrad_accumulation" in repr(fused)
    got = _accumulate_grad_inputs(fused)
    for x, dy in _micro_batches(3):
        for mod in (plain, fused):
            xx = x.clone().requires_grad_(True)
            mod(xx).backward(dy)
    # the first micro-batch (no .grad yet) returns its gradient; the later ones were added in place
    assert got == ["gradient", "none", "none"]
    # emulation adds the same FP32 product in place that AccumulateGrad adds: bit for bit
    assert torch.equal(fused.weight.grad, plain.weight.grad)
    assert torch.equal(fused.bias.grad, plain.bias.grad)
    assert fused.gemm_counts == plain.gemm_counts == {"fprop": 3, "dgrad": 3, "wgrad": 3}


def test_fused_accumulation_writes_into_the_existing_gradient():
    _, fused = _pair("tensorwise")
    fused.weight.grad = torch.zeros_like(fused.weight)  # zero_grad(set_to_none=False)
    buf = fused.weight.grad
    got = _accumulate_grad_inputs(fused)
    for x, dy in _micro_batches(2):
        fused(x).backward(dy)
    assert got == ["none", "none"]
    assert fused.weight.grad is buf and buf.abs().sum() > 0


def test_autograd_grad_and_backward_inputs_still_return_the_gradient():
    plain, fused = _pair("tensorwise")
    ((x, dy),) = _micro_batches(1)
    for mod in (plain, fused):
        mod.weight.grad = torch.ones_like(mod.weight)
    # autograd.grad returns the gradient and leaves .grad alone
    (gw_fused,) = torch.autograd.grad(fused(x), [fused.weight], dy)
    (gw_plain,) = torch.autograd.grad(plain(x), [plain.weight], dy)
    assert torch.equal(gw_fused, gw_plain)
    assert torch.equal(fused.weight.grad, torch.ones_like(fused.weight))
    # backward(inputs=...) that leaves the weight out does not touch it
    xx = x.clone().requires_grad_(True)
    fused(xx).backward(dy, inputs=[xx])
    assert torch.equal(fused.weight.grad, torch.ones_like(fused.weight))
    assert xx.grad is not None


def test_first_micro_batch_after_zero_grad_runs_unfused():
    plain, fused = _pair("tensorwise")
    ((x, dy),) = _micro_batches(1)
    for mod in (plain, fused):
        mod.weight.grad = None
        mod(x).backward(dy)
    assert torch.equal(fused.weight.grad, plain.weight.grad)


def test_refusals_name_the_fix():
    plain, fused = _pair("tensorwise")
    ((x, dy),) = _micro_batches(1)
    # BF16 parameters (BF16 gradients, not accumulated in FP32): refused when set ...
    plain.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="accumulates FP32 gradients.*bfloat16; keep FP32 master weights"):
        set_wgrad_accumulation_fusion(plain)
    assert not plain.fuse_wgrad_accumulation
    # ... and in backward when the weights became BF16 afterwards (micro-batch 2: the first has no .grad)
    fused.to(torch.bfloat16)
    fused(x.bfloat16()).backward(dy.bfloat16())
    with pytest.raises(RuntimeError, match="accumulates FP32 gradients.*bfloat16"):
        fused(x.bfloat16()).backward(dy.bfloat16())
    fused.float()
    fused.weight.grad = None
    # gradient hooks on the weight would not see the gradient: refused when set and in backward
    for register in (fused.weight.register_hook, fused.weight.register_post_accumulate_grad_hook):
        handle = register(lambda g: None)
        with pytest.raises(RuntimeError, match="hooks would never see it"):
            set_wgrad_accumulation_fusion(fused)
        fused.weight.grad = None
        fused(x).backward(dy)  # first micro-batch: AccumulateGrad runs, the hook with it
        with pytest.raises(RuntimeError, match=r"register_\w*hook hooks would never see it"):
            fused(x).backward(dy)
        handle.remove()
    fused.weight.grad = None
    model = torch.nn.Sequential(fused)
    with pytest.raises(ValueError, match=r"set_wgrad_accumulation_fusion\(model, False\)"):
        wrap_model(model, "ddp", DistContext(world_size=2))
    assert set_wgrad_accumulation_fusion(model, False) == 1 and not fused.fuse_wgrad_accumulation


def test_refusal_at_conversion_names_the_module():
    """convert_model(..., fuse_wgrad_accumulation=True) on BF16 weights: the error names the
    module by its place in the model, not the class."""
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"^1: fuse_wgrad_accumulation accumulates FP32 gradients"):
        convert_model(model, "tensorwise", fuse_wgrad_accumulation=True)
    assert isinstance(model[1], torch.nn.Linear)  # (refused before the model changed)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_keeps_the_returned_gradient():
    plain, fused = _pair("tensorwise")
    ((x, dy),) = _micro_batches(1)
    got = _accumulate_grad_inputs(fused)
    for mod in (plain, fused):
        mod.weight.grad = torch.zeros_like(mod.weight)
        mod(x).backward(dy, create_graph=True)
    assert got == ["gradient"]
    assert torch.equal(fused.weight.grad, plain.weight.grad)
    for mod in (plain, fused):
        mod.weight.grad = mod.bias.grad = None  # (the reference cycle create_graph makes)


# ---- the cuBLASLt accumulating GEMM (H200) ---------------------------------------------------


def _real_gemms_or_skip(name: str) -> None:
    """Skip, with the hardware check's own reason, where ``name`` has no real FP8 GEMMs."""
    ok, why = check_supported(get_recipe(name), "cuda")
    if not ok:
        pytest.skip(why)


def _f64_dequant(q):
    from nemo_fp8_recipes.quant.reference import dequantize

    return dequantize(q, torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_cublaslt_accumulate_matches_float64(name):
    """``out += dYᵀ·X`` from the cuBLASLt GEMM against float64 of the same codes and scales
    (structured operands: per-group outliers across 1e-3..1e3, so a wrong scale layout shows).
    Hopper's FP8 tensor cores accumulate a K block in reduced precision before each FP32
    promotion: about 2e-4 relative at K = 1024 (measured on the H200), hence 1e-3."""
    _real_gemms_or_skip(name)
    from nemo_fp8_recipes.quant.cublaslt import fp8_matmul_accumulate
    from nemo_fp8_recipes.quant.dispatch import quantize_pair_auto
    from nemo_fp8_recipes.quant.scaled_mm import outer_major

    r = get_recipe(name)
    tokens, n_out, k_in = 1024, 768, 512
    x = structured(tokens, k_in, seed=1).cuda().bfloat16()
    dy = (structured(tokens, n_out, seed=2) * 1e-3).cuda().bfloat16()
    _, qx = quantize_pair_auto(x, r.input_format, r.input_granularity, r.scale_rounding)
    _, qdy = quantize_pair_auto(dy, r.grad_format, r.grad_granularity, r.scale_rounding)
    block = name == "blockwise"
    base = structured(n_out, k_in, seed=3).cuda() * 1e-2
    out = base.clone()
    ref = base.double() + _f64_dequant(qdy) @ _f64_dequant(qx).T
    for q in (qdy, qx):
        assert q.data.shape[1] == tokens
    s = (lambda q: outer_major(q.scale_inv.float())) if block else (lambda q: q.scale_inv.float())
    fp8_matmul_accumulate(qdy.data, s(qdy), qx.data, s(qx), out, block=block)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"{name}: accumulated wgrad vs float64, rel. error {err:.3g}"
    # a second accumulation adds the same product again
    fp8_matmul_accumulate(qdy.data, s(qdy), qx.data, s(qx), out, block=block)
    ref2 = ref + (ref - base.double())
    assert ((out.double() - ref2).norm() / ref2.norm()).item() < 1e-3
    if block:  # the check can tell: the right scales in the wrong places give another product
        wrong = base.clone()
        fp8_matmul_accumulate(qdy.data, s(qdy).flip(0).t().contiguous().t(), qx.data, s(qx), wrong, block=True)
        assert ((wrong.double() - ref).norm() / ref.norm()).item() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise"])
def test_fused_real_gemm_accumulates_like_autograd(name, monkeypatch):
    """Real FP8 linears on the GPU: three micro-batches with fused accumulation give the
    gradient autograd accumulates (one rounding instead of two per add: within 1e-6)."""
    _real_gemms_or_skip(name)
    from nemo_fp8_recipes.quant import cublaslt

    plain, fused = _pair(name, device="cuda", emulate=False)
    got = _accumulate_grad_inputs(fused)
    gemms = _count_calls(monkeypatch, cublaslt, "fp8_matmul_accumulate")
    for x, dy in _micro_batches(3, device="cuda", dtype=torch.bfloat16, rows=512):
        for mod in (plain, fused):
            mod(x).backward(dy)
    assert got == ["gradient", "none", "none"]  # micro-batches 2 and 3 added inside the GEMM ...
    assert [c["block"] for c in gemms] == [name == "blockwise"] * 2  # ... the cuBLASLt one
    err = ((fused.weight.grad - plain.weight.grad).norm() / plain.weight.grad.norm()).item()
    assert err < 1e-6, f"{name}: fused vs autograd accumulation, rel. error {err:.3g}"
    assert fused.gemm_counts["wgrad"] == 3


@pytest.mark.gpu
def test_cublaslt_accumulate_refuses_bad_operands():
    _real_gemms_or_skip("tensorwise")
    from nemo_fp8_recipes.quant.cublaslt import fp8_matmul_accumulate

    a = torch.zeros(128, 256, device="cuda").to(torch.float8_e5m2)
    s = torch.ones(1, 1, device="cuda")
    out = torch.zeros(128, 128, device="cuda")
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8_matmul_accumulate(a, s, a[:128], s, out)
    with pytest.raises(ValueError, match="contiguous float32"):
        fp8_matmul_accumulate(a.to(torch.float8_e4m3fn), s, a[:128], s, out.bfloat16())
    with pytest.raises(ValueError, match="outer-dim major"):
        bad = torch.ones(128, 2, device="cuda")  # row-major, not (1, rows)
        fp8_matmul_accumulate(a.to(torch.float8_e4m3fn), bad, a.to(torch.float8_e4m3fn), bad, out, block=True)
