"""convert_model, the policy and the audit on grouped MoE experts: a real Hugging Face Mixtral's
experts module (tiny config built offline; transformers 5 holds each layer's experts as one module
with 3-D weights) against its own high-precision forward, and grouped-weight modules of other
classes. Whole Hugging Face MoE models trained under every recipe, with transformers 5 and 4.x:
tests/nn/test_hf_moe.py."""

import pytest
import torch
import torch.nn as nn

from nemo_fp8_recipes import PolicyViolation, PrecisionPolicy, audit, convert_model
from nemo_fp8_recipes.nn import Float8GroupedExperts, Float8Linear, grouped_fp8_modules

pytest.importorskip("transformers", reason="needs transformers (pip install '.[dev]')")

from helpers.hf_moe import EXPERTS as E  # noqa: E402
from helpers.hf_moe import tiny_mixtral, transformers_major  # noqa: E402

GROUPED = transformers_major() >= 5


@pytest.mark.skipif(not GROUPED, reason="transformers 5 grouped experts (installed: transformers 4)")
def test_grouped_experts_keep_parameters_and_match_high_precision():
    import copy

    model = tiny_mixtral()
    experts = model.model.layers[0].mlp.experts
    ref = copy.deepcopy(experts)
    params = (experts.gate_up_proj, experts.down_proj)
    convert_model(model, "blockwise", PrecisionPolicy())
    new = model.model.layers[0].mlp.experts
    assert isinstance(new, Float8GroupedExperts)
    assert (new.gate_up_proj, new.down_proj) == params  # the same Parameter objects
    assert set(grouped_fp8_modules(model)) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    g = torch.Generator().manual_seed(3)
    h = torch.randn(48, 128, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(48)])
    wts = torch.rand(48, 2, generator=g).softmax(-1)
    with torch.no_grad():
        a, b = new(h, idx, wts), ref(h, idx, wts)
    # FP8 experts vs the model's own FP32 experts: close, not equal
    rel = float((a - b).norm() / b.norm())
    assert 0 < rel < 0.1
    idx[:5, 0] = E  # transformers' mark for an expert held on another rank: contributes nothing
    with torch.no_grad():
        c = new(h, idx, wts)
    assert torch.equal(c[5:], a[5:]) and not torch.equal(c[:5], a[:5])


class PackedExperts(nn.Module):
    """A grouped-experts module in a layout convert_model does not know: w [E, out, in]."""

    def __init__(self, e=E, d=128):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, d, d) * 0.02)

    def forward(self, x, expert_of_token):
        return torch.einsum("td,tod->to", x, self.w[expert_of_token])


class PackedFP8(Float8GroupedExperts):
    """Its FP8 form through swaps=: the same layout, its GEMM through grouped_mm."""

    def forward(self, x, expert_of_token):
        order = torch.argsort(expert_of_token, stable=True)
        sizes = torch.bincount(expert_of_token, minlength=self.num_experts).tolist()
        y = self.grouped_mm("w", x[order], sizes)
        return torch.empty_like(y).index_copy_(0, order, y)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(128, E, bias=False)
        self.experts = PackedExperts()

    def forward(self, x):
        return self.experts(x, self.router(x).argmax(-1))


@pytest.mark.filterwarnings("ignore:recipe tensorwise. no GEMM of the model runs in FP8")
def test_unknown_grouped_layout_is_reported_and_fails_strict_audit():
    model = nn.Sequential(MoE())
    convert_model(model, "tensorwise", PrecisionPolicy())
    model(torch.randn(16, 128)).sum().backward()
    report = audit(model)
    row = {r.name: r for r in report.rows}["0.experts"]
    assert (row.role, row.precision) == ("mlp", "bf16")
    assert "PackedExperts" in row.reason and "swaps=" in row.reason
    assert row.hp_gemms["fprop"] == 1 and row.hp_gemms["wgrad"] == 1
    assert list(report.unplaced) == ["0.experts"]
    assert "GROUPED GEMMs NOT CONVERTED" in report.table()
    with pytest.raises(PolicyViolation, match="0.experts"):
        audit(model, strict=True)
    # kept out of FP8 on purpose, it is placed: no failure
    model = nn.Sequential(MoE())
    convert_model(model, "tensorwise", PrecisionPolicy(exclude=["*.experts"]))
    assert not audit(model, strict=True).unplaced


def test_grouped_layout_through_swaps():
    model = nn.Sequential(MoE())
    ref = PackedExperts()
    ref.load_state_dict(model[0].experts.state_dict())
    factory = lambda fqn, m, d, cfg: PackedFP8({"w": m.w}, cfg)  # noqa: E731
    convert_model(model, "tensorwise", PrecisionPolicy(), swaps={PackedExperts: factory})
    assert isinstance(model[0].experts, PackedFP8) and isinstance(model[0].router, nn.Linear)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    y = model(x)
    y.sum().backward()
    with torch.no_grad():
        hp = ref(x, model[0].router(x).argmax(-1))
    assert float((y.detach() - hp).norm() / hp.norm()) < 0.1
    report = audit(model, strict=True)
    rows = {r.name: r for r in report.rows}
    assert rows["0.experts"].precision == "fp8" and rows["0.experts"].fp8_gemms["fprop"] >= 1
    assert rows["0.router"].precision == "fp32" and not isinstance(model[0].router, Float8Linear)


@pytest.mark.filterwarnings("ignore:recipe blockwise. no GEMM of the model runs in FP8")
def test_grouped_shape_check_names_the_weight():
    model = nn.Sequential(MoE())
    model[0].experts.w = nn.Parameter(torch.randn(E, 200, 128))
    convert_model(model, "blockwise", PrecisionPolicy())
    row = {r.name: r for r in audit(model).rows}["0.experts"]
    assert row.precision == "bf16" and row.reason.startswith("w: out_features=200")
    assert not audit(model, strict=True).unplaced  # a recorded policy decision, not a failure


def test_a_convolution_is_no_grouped_gemm():
    """A Conv1d's kernel is 3-D too (a Mamba or audio layer; here with dims the FP8 shape check
    accepts): not a grouped GEMM module, so it is neither converted nor reported as unplaced, and
    the strict audit passes on the linears."""
    model = nn.Sequential(nn.Linear(128, 128), nn.Conv1d(128, 128, kernel_size=16))
    convert_model(model, "tensorwise", PrecisionPolicy())
    y = model[0](torch.randn(32, 128))
    model[1](y.t().unsqueeze(0)).sum().backward()
    report = audit(model, strict=True)
    assert not report.unplaced
    assert {r.name for r in report.rows if r.precision == "fp8"} == {"0"}
