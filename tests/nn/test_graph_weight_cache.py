"""FP8 weight caching across micro-batches under ``torch.compile`` (``set_graph_weight_cache``):
the compiled forward reads the FP8 weight from module buffers, re-quantised after each optimizer
step, ``load_state_dict``, ``.to()`` and ``invalidate_weight_cache`` — with the eager path's
numbers bit for bit (CPU: emulated FP8, ``aot_eager``), one quantisation per optimizer step, and
a stale cache reported by ``audit``. GPU (``gpu`` marker, H200): real GEMMs under Inductor give
the same bits with and without the cache."""

import copy
import io

import pytest
import torch
from helpers.traced import TRACED, SwiGLU, batch, fp8_linears, fwd_bwd, gpu_pair, gpu_recipe, make_pair

from nemo_fp8_recipes.nn import (
    Float8Linear,
    audit,
    convert_model,
    invalidate_weight_cache,
    set_graph_weight_cache,
)
from nemo_fp8_recipes.recipes import get_recipe


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _equal(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]))


@pytest.mark.parametrize("recipe", TRACED)
def test_cached_compiled_equals_eager_over_micro_batches_and_steps(recipe):
    """Two optimizer steps (AdamW, fused into foreach updates that do not bump the weights'
    version counters) of three micro-batches each: the compiled model with the cache gives the
    eager model's outputs and gradients bit for bit at every micro-batch — the step's new
    weights are seen, the micro-batches between steps reuse the cache."""
    model, ref = make_pair(recipe)
    assert set_graph_weight_cache(model) == 2
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, ref)]
    for step in range(2):
        for mb in range(3):
            x, dy = batch(3 * step + mb)
            got, want = fwd_bwd(compiled, model, x, dy), fwd_bwd(ref, ref, x, dy)
            assert _equal(got, want), (step, mb)
        for o in opts:
            o.step()
    assert audit(model, strict=True).stale_weight_caches == []
    for m in fp8_linears(model):
        assert m.gemm_counts == {"fprop": 6, "dgrad": 6, "wgrad": 6}, m.fqn


def test_the_compiled_forward_reads_the_cache_and_quantises_once_per_step(monkeypatch):
    """What the cache changes: the weight quantiser runs once per optimizer step (eagerly, in the
    step's hook), not in each micro-batch's graph; and the compiled forward really reads the
    buffers — overwriting them changes its output until the next refresh."""
    import nemo_fp8_recipes.nn.autograd as autograd_mod
    import nemo_fp8_recipes.nn.linear as lin

    model, ref = make_pair("tensorwise")
    set_graph_weight_cache(model)
    calls = []
    real = lin.quantize_weight
    for mod in (lin, autograd_mod):  # (the cache's refresh, the traced forward)
        monkeypatch.setattr(mod, "quantize_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, dy = batch(0)
    for _ in range(3):
        fwd_bwd(compiled, model, x, dy)
    assert calls == []  # traced without quantising a weight (the buffers are graph inputs)
    opt.step()
    assert len(calls) == 2  # one refresh per FP8 linear whose weight the optimizer updated
    y_before = compiled(x)
    w = model.w1._fp8_wcache_fprop_data
    w.copy_(torch.zeros_like(w))  # clobber the cached fprop codes of w1
    assert not torch.equal(compiled(x), y_before)
    model.w1.refresh_graph_weight_cache()
    assert torch.equal(compiled(x), y_before)


def test_other_optimizers_weights_are_not_requantised():
    """An optimizer step re-quantises only the cached weights among its own parameters."""
    model, _ = make_pair("blockwise")
    set_graph_weight_cache(model)
    opt1 = torch.optim.SGD([model.w1.weight], lr=0.1)
    x, dy = batch(0)
    fwd_bwd(model, model, x, dy)
    v2 = model.w2._graph_wcache_version
    before = model.w2._fp8_wcache_fprop_data.clone()
    with torch.no_grad():
        model.w2.weight.add_(1.0)  # a write the cache does not see (w2 is not in opt1)
    opt1.step()
    assert model.w2._graph_wcache_version == v2 and torch.equal(model.w2._fp8_wcache_fprop_data, before)
    report = audit(model)
    assert report.stale_weight_caches == ["w2"] and "STALE compiled FP8 weight cache" in report.table()
    with pytest.raises(RuntimeError, match="invalidate_weight_cache"):
        audit(model, strict=True)
    invalidate_weight_cache(model)
    assert audit(model, strict=True).stale_weight_caches == []


def test_load_state_dict_to_and_deepcopy_refresh_the_cache():
    """``load_state_dict`` (new weights), ``.to(dtype)`` and a deep copy: the compiled forward
    gives the eager model's numbers after each, and the copy's cache follows its own optimizer."""
    model, ref = make_pair("tensorwise")
    set_graph_weight_cache(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, dy = batch(1)
    torch.manual_seed(5)
    other = SwiGLU()
    convert_model(other, get_recipe("tensorwise"), emulate=True)
    buf = io.BytesIO()
    torch.save(other.state_dict(), buf)
    for m in (model, ref):
        buf.seek(0)
        m.load_state_dict(torch.load(buf))
    assert _equal(fwd_bwd(compiled, model, x, dy), fwd_bwd(ref, ref, x, dy))
    assert "_fp8_wcache_fprop_data" not in "".join(model.state_dict())  # buffers are not saved

    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    fwd_bwd(twin, twin, x, dy)
    opt.step()
    assert not twin.w1.graph_weight_cache_stale()
    torch._dynamo.reset()
    ref_twin = copy.deepcopy(twin)
    set_graph_weight_cache(ref_twin, False)
    assert _equal(fwd_bwd(torch.compile(twin, backend="aot_eager"), twin, x, dy), fwd_bwd(ref_twin, ref_twin, x, dy))

    model.double()
    assert model.w1._fp8_wcache_fprop_scale.dtype == torch.float32  # re-quantised, not cast
    assert not any(m.graph_weight_cache_stale() for m in fp8_linears(model))
    # deferred initialisation: on the meta device there is nothing to quantise; materialised and
    # initialised again, the cache follows the new weights
    model.to("meta")
    model.to_empty(device="cpu")
    for m in fp8_linears(model):
        m.reset_parameters()
    ref_fresh = copy.deepcopy(model)
    set_graph_weight_cache(ref_fresh, False)
    torch._dynamo.reset()
    x64 = x.double()
    assert torch.equal(torch.compile(model, backend="aot_eager")(x64), ref_fresh(x64))


def test_turning_it_off_drops_the_buffers_and_delayed_is_left_alone():
    model, _ = make_pair("tensorwise")
    set_graph_weight_cache(model)
    assert any(n.startswith("_fp8_wcache") for n, _ in model.w1.named_buffers())
    # each rank quantises its own copy: DDP must not broadcast the buffers from rank 0 every forward
    assert {f"{m}.{b}" for m in ("w1", "w2") for b in Float8Linear.GRAPH_WEIGHT_CACHE_BUFFERS} <= set(
        model._ddp_params_and_buffers_to_ignore
    )
    assert set_graph_weight_cache(model, False) == 2
    assert not any(n.startswith("_fp8_wcache") for n, _ in model.w1.named_buffers())
    delayed, _ = make_pair("delayed")
    assert set_graph_weight_cache(delayed) == 0  # quantised with the step's delayed scale
    with pytest.raises(ValueError, match="step's delayed scale"):
        delayed.w1.set_graph_weight_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_gpu_cached_compiled_is_bit_identical_to_uncached(recipe):
    """H200, real FP8 GEMMs, Inductor, BF16 autocast, FP32 master weights: the compiled model
    with the cache gives the same bits as without it over two steps of two micro-batches."""
    rec, why = gpu_recipe(recipe)
    if why is not None:
        pytest.skip(why)
    models = gpu_pair(rec, emulate=False)
    cached = models[0]
    assert set_graph_weight_cache(cached) == 2
    fns = [torch.compile(m, fullgraph=True, dynamic=False) for m in models]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]
    for step in range(2):
        for mb in range(2):
            g = torch.Generator(device="cuda").manual_seed(10 * step + mb)
            x = torch.randn(2048, 1024, device="cuda", generator=g)
            dy = torch.randn(2048, 1024, device="cuda", generator=g) * 1e-2
            res = []
            for fn, mod in zip(fns, models):
                xx = x.clone().requires_grad_(True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fn(xx)
                y.backward(dy.to(y.dtype))
                res.append([y, xx.grad, *(p.grad.clone() for p in mod.parameters())])
            assert all(torch.equal(a, b) for a, b in zip(*res)), (step, mb)
        for o, mod in zip(opts, models):
            o.step()
            o.zero_grad(set_to_none=True)
