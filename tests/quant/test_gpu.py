"""On an FP8 GPU (Hopper or newer): the real FP8 GEMM path agrees with the
exact emulation within FP8-accumulation tolerance, for fprop, dgrad and wgrad; MXFP8 on Hopper
raises the clear error unless emulated. Skipped on CPU with the reason."""

import pytest
import torch
from helpers.fp8_ref import structured
from helpers.report import NUMERICS_REPORT

from nemo_fp8_recipes import (
    UnsupportedRecipeError,
    check_supported,
    convert_model,
    get_recipe,
)
from nemo_fp8_recipes.nn import Float8Linear

pytestmark = pytest.mark.gpu


def _pair(name, lin):
    rec = get_recipe(name)
    ok, why = check_supported(rec, "cuda")
    if not ok:
        pytest.skip(why)
    real = Float8Linear.from_linear(lin, rec, emulate=False)
    lin2 = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="cuda")
    lin2.load_state_dict(lin.state_dict())
    emu = Float8Linear.from_linear(lin2, rec, emulate=True)
    return real, emu


def _run(mod, x, dy):
    mod.weight.grad = None
    xx = x.clone().requires_grad_(True)
    y = mod(xx)
    y.backward(dy)
    return y.float(), xx.grad.float(), mod.weight.grad.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("M", [4096, 1000], ids=["M4096", "M1000-padded"])
def test_real_fp8_gemms_match_emulation(name, M):
    K, N = 2048, 1536
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=True, device="cuda")
    real, emu = _pair(name, lin)
    lines = NUMERICS_REPORT.setdefault(
        f"H200: real FP8 GEMMs vs exact emulation ({torch.cuda.get_device_name()}), rel. error",
        [f"{'recipe':<11}{'M':>6}{'step':>5}{'fprop':>10}{'dgrad':>10}{'wgrad':>10}"],
    )
    for step in range(2):  # 2 steps: delayed scaling uses the step-1 history in step 2
        x = structured(M, K, seed=step).to("cuda", torch.bfloat16)
        dy = (structured(M, N, seed=10 + step) * 1e-3).to("cuda", torch.bfloat16)
        got, ref = _run(real, x, dy), _run(emu, x, dy)
        errs = [_rel(g, r) for g, r in zip(got, ref)]
        lines.append(f"{name:<11}{M:>6}{step + 1:>5}" + "".join(f"{e:10.2e}" for e in errs))
        for gemm, e in zip(("fprop", "dgrad", "wgrad"), errs):
            # both paths use identical FP8 codes and scales; they differ only in accumulation
            # order/precision and the BF16 rounding of the output
            assert e < 1e-2, f"{name} {gemm} step {step + 1}: real vs emulated rel. error {e:.3g}"
    if name == "delayed":
        assert torch.equal(real.fp8_scale, emu.fp8_scale)


def test_mxfp8_on_hopper_raises_unless_emulated():
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        pytest.skip(f"Hopper-specific check; found SM{cap[0]}{cap[1]}")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).cuda()
    with pytest.raises(UnsupportedRecipeError, match="mxfp8 needs SM100"):
        convert_model(model, "mxfp8")
    convert_model(model, "mxfp8", emulate=True)
    y = model(torch.randn(64, 256, device="cuda"))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_linears_reading_one_input_share_its_quantisation_on_gpu(name, monkeypatch):
    """q/k/v-like projections of one input with the Triton quantisers and real FP8 GEMMs: one
    quantisation of the input, one saved wgrad copy, and the same bits (outputs, input and
    weight gradients) as three linears each quantising its own copy."""
    rec = get_recipe(name)
    calls = []
    real = Float8Linear._quantize_operand
    monkeypatch.setattr(
        Float8Linear,
        "_quantize_operand",
        lambda self, i, t, pair=False, gate=None: calls.append(i) or real(self, i, t, pair=pair, gate=gate),
    )

    def run(share: bool):
        torch.manual_seed(0)
        mods = [
            Float8Linear.from_linear(torch.nn.Linear(1024, n, bias=False, device="cuda"), rec, emulate=False)
            for n in (1024, 256, 256)
        ]
        leaf = (structured(2048, 1024, seed=5) * 3).to("cuda", torch.bfloat16).requires_grad_()
        x = leaf * 1.0  # an intermediate, like a norm's output
        ys = [m(x if share else x.clone()) for m in mods]
        sum((y.float() * structured(*y.shape, seed=k).cuda()).sum() for k, y in enumerate(ys)).backward()
        return ys, leaf.grad, [m.weight.grad for m in mods]

    ys, dx, dws = run(True)
    assert calls.count(0) == 1
    ys2, dx2, dws2 = run(False)
    assert calls.count(0) == 4
    assert all(torch.equal(a, b) for a, b in zip(ys, ys2))
    assert torch.equal(dx, dx2) and all(torch.equal(a, b) for a, b in zip(dws, dws2))


def test_no_shared_input_quantisation_while_a_cuda_graph_is_captured():
    """Inside a CUDA-graph capture each linear quantises its input itself (the graph must
    contain the quantisation, not reuse codes made before the capture)."""
    import nemo_fp8_recipes.nn.shared_input as lin
    from nemo_fp8_recipes.nn.linear import Float8LinearOperands

    mod = Float8Linear.from_linear(
        torch.nn.Linear(256, 256, bias=False, device="cuda"), get_recipe("tensorwise"), emulate=False
    )
    x = torch.randn(256, 256, device="cuda", requires_grad=True) * 1.0
    quantize = Float8LinearOperands(mod).quantize
    assert lin.input_quantizer(mod, x, quantize) is not quantize  # shared outside a capture
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g):
            inside = lin.input_quantizer(mod, x, quantize)
    assert inside is quantize
