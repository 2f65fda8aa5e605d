"""Hugging Face MoE models in FP8 (issue 49's CPU acceptance): a tiny Mixtral and a tiny
DeepSeek-V3 built offline from their configs convert under every FP8 recipe (emulated), train a
few steps, and their strict audits list every expert GEMM in FP8 and the router in FP32.

Under transformers 5 (the dev extra) each layer's experts are one module with 3-D weights, which
becomes a ``Float8GroupedExperts``; under transformers 4.x they are ``nn.Linear`` modules, one
``Float8Linear`` per projection. CI installs transformers 4.57 into a directory of its own and
names it in ``NEMO_FP8_TRANSFORMERS4`` (``.ci/run``): the last test runs this file's model tests
again in a subprocess with that directory first on ``PYTHONPATH``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_fp8_recipes import PrecisionPolicy, audit, convert_model, list_recipes
from nemo_fp8_recipes.nn import Float8GroupedExperts, Float8Linear, grouped_fp8_modules

pytest.importorskip("transformers", reason="needs transformers (pip install '.[dev]')")

from helpers.hf_moe import HF_MOE_MODELS, train_hf, transformers_major  # noqa: E402

STEPS = 2
FP8 = [r for r in list_recipes() if r != "bf16"]
GROUPED = transformers_major() >= 5
TRANSFORMERS4 = os.environ.get("NEMO_FP8_TRANSFORMERS4")


def _num_experts(config) -> int:
    """Routed experts per MoE layer (Mixtral: ``num_local_experts``, DeepSeek: ``n_routed_experts``)."""
    n = getattr(config, "n_routed_experts", None)
    return int(n if n is not None else config.num_local_experts)


def _count_expert_hits(model) -> dict:
    """Per grouped-experts module, the experts that received tokens summed over its calls, read
    from the ``top_k_index`` its MoE block hands it: the fprop GEMMs per weight its audit row must count."""
    hits = {}

    def hook(mod, args, kwargs):
        idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
        hits[mod.fqn] = hits.get(mod.fqn, 0) + int(torch.unique(idx[idx < mod.num_experts]).numel())

    for m in grouped_fp8_modules(model).values():
        m.register_forward_pre_hook(hook, with_kwargs=True)
    return hits


@pytest.mark.parametrize("recipe", FP8)
@pytest.mark.parametrize("arch", sorted(HF_MOE_MODELS))
def test_hf_moe_experts_in_fp8_router_in_fp32(arch, recipe):
    model = convert_model(HF_MOE_MODELS[arch](), recipe, PrecisionPolicy())
    hits = _count_expert_hits(model)
    losses = train_hf(model, STEPS)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    report = audit(model, strict=True)
    assert not report.unplaced and not report.violations
    rows = {r.name: r for r in report.rows}
    modules = dict(model.named_modules())
    E = _num_experts(model.config)

    routers = [r for r in report.rows if r.role == "router"]
    moe_layers = sum(1 for m in modules.values() if type(m).__name__.endswith(("SparseMoeBlock", "MoE")))
    assert len(routers) == moe_layers > 0
    for r in routers:  # the gate: FP32 weights, its GEMM counted in high precision every step
        assert r.precision == "fp32" and r.fp8_gemms == {}, r
        # forward, dgrad and wgrad every step (a gate that returns its integer top-k indices first
        # still counts its backward GEMMs: transformers 4's DeepSeek-V3)
        assert r.hp_gemms == {"fprop": STEPS, "dgrad": STEPS, "wgrad": STEPS}, r
        assert not isinstance(modules[r.name], Float8Linear)
        assert modules[r.name].weight.dtype == torch.float32
        block = r.name.rpartition(".")[0]
        if GROUPED:  # one module, one FP8 GEMM per expert that received tokens and per weight
            row = rows[f"{block}.experts"]
            assert isinstance(modules[row.name], Float8GroupedExperts)
            assert (row.role, row.precision, row.hp_gemms) == ("mlp", "fp8", {}), row
            n = 2 * hits[row.name]  # gate_up_proj and down_proj
            assert n > 0 and row.fp8_gemms == {"fprop": n, "dgrad": n, "wgrad": n}, (row, hits)
        else:  # one Float8Linear per expert projection, each counted on its own
            experts = [x for x in report.rows if x.name.startswith(f"{block}.experts.")]
            assert len(experts) == 3 * E, [x.name for x in experts]
            per_expert = {}
            for x in experts:
                assert isinstance(modules[x.name], Float8Linear)
                assert (x.role, x.precision, x.hp_gemms) == ("mlp", "fp8", {}), x
                f = x.fp8_gemms["fprop"]
                assert x.fp8_gemms == {"fprop": f, "dgrad": f, "wgrad": f} and f <= STEPS, x
                per_expert.setdefault(x.name.rsplit(".", 1)[0], set()).add(f)
            assert all(len(c) == 1 for c in per_expert.values()), per_expert  # gate, up, down alike
            assert sum(c.pop() for c in per_expert.values()) >= STEPS  # tokens reached experts every step
    # every other GEMM (attention, dense MLP, shared experts) is FP8 too: the dims allow it
    hp = [r.name for r in report.rows if r.role in ("mlp", "attention_projection", "linear") and r.precision != "fp8"]
    assert not hp, hp
    table = report.table()
    assert all(r.name in table for r in routers) and "fp32" in table


@pytest.mark.slow
@pytest.mark.skipif(not GROUPED, reason="the installed transformers is 4.x: the tests above ran its nn.Linear experts")
@pytest.mark.skipif(
    not TRANSFORMERS4,
    reason="transformers 4.x not found: set NEMO_FP8_TRANSFORMERS4 to a directory holding it "
    "(pip install --target DIR transformers==4.57.6, as .ci/run does) to run the MoE tests with nn.Linear experts",
)
def test_transformers4_linear_experts_in_a_subprocess():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TRANSFORMERS4, os.environ.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    probe = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    version = probe.stdout.strip()
    assert probe.returncode == 0 and version.startswith("4."), (
        f"NEMO_FP8_TRANSFORMERS4={TRANSFORMERS4} does not give transformers 4.x: {version or probe.stderr[-2000:]}"
    )
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_hf_moe_experts"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    n = len(HF_MOE_MODELS) * len(FP8)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and f"{n} passed" in run.stdout and "skipped" not in run.stdout, (
        f"transformers {version}:\n{out[-6000:]}"
    )
