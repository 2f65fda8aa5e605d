"""Transformer Engine on the GPU, against our numerics: TE's own quantizers and ``te.Linear`` bit
for bit against ``quant/reference.py`` and ``Float8Linear``; a Megatron-Core ``GPTModel`` with the
TE layer spec built from :func:`megatron_config` trains under strict ``TEPrecisionHooks`` and keeps
TE's FP8 state through a checkpoint; the Bridge and Lightning callbacks on real TE modules.

Every test carries the ``te`` marker: it runs where Transformer Engine imports (a CUDA machine
with ``pip install '.[te]'``) and skips elsewhere with the reason (``conftest.py``).
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from helpers.fp8_ref import structured

from nemo_fp8_recipes import PrecisionPolicy, get_recipe
from nemo_fp8_recipes.nn import Float8Linear
from nemo_fp8_recipes.quant.reference import quantize

pytestmark = pytest.mark.te

DEV = "cuda"


def _te():
    import transformer_engine.pytorch as te

    return te


def _tex_dtype(fmt: str):
    import transformer_engine_torch as tex

    return tex.DType.kFloat8E4M3 if fmt == "e4m3" else tex.DType.kFloat8E5M2


def _outlier_input(rows: int = 256, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Structured magnitudes and outlier channels, an all-zero 128-block, a zero row and a NaN."""
    x = structured(rows, cols, seed=seed).to(DEV)
    x[:128, 128:256] = 0.0  # one all-zero 128x128 block (and 1x128 tiles): scale 1
    x[200] = 0.0
    return x


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# ---- (a) quantizers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_te_current_scaling_quantizer_equals_the_reference(fmt, pow2):
    te = _te()
    x = _outlier_input().to(torch.bfloat16)
    q_te = te.Float8CurrentScalingQuantizer(
        _tex_dtype(fmt), torch.device(DEV), rowwise=True, columnwise=True, force_pow_2_scales=pow2
    )(x)
    ours = quantize(x.float(), fmt, "tensor", "pow2" if pow2 else "fp32")
    assert torch.equal(q_te._scale_inv.float().reshape(()), ours.scale_inv.float().reshape(()))
    assert torch.equal(_codes(q_te._data), _codes(ours.data))
    assert torch.equal(
        q_te.dequantize(dtype=torch.float32),
        ours.dequantize() if hasattr(ours, "dequantize") else ours.data.float() * ours.scale_inv,
    )
    if q_te._transpose is not None:  # the columnwise copy: the same codes, transposed
        assert torch.equal(_codes(q_te._transpose), _codes(ours.data).t().contiguous())


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_te_block_quantizer_equals_the_reference(block_dim, pow2):
    te = _te()
    x = _outlier_input().to(torch.bfloat16)
    m, k = x.shape
    q_te = te.Float8BlockQuantizer(
        _tex_dtype("e4m3"), rowwise=True, columnwise=True, force_pow_2_scales=pow2, block_scaling_dim=block_dim
    )(x)
    rounding = "pow2" if pow2 else "fp32"
    gran = "1x128" if block_dim == 1 else "128x128"
    rows = quantize(x.float(), "e4m3", gran, rounding, dim=-1)
    assert torch.equal(_codes(q_te._rowwise_data), _codes(rows.data))
    si = q_te._rowwise_scale_inv.float()
    if block_dim == 1:  # TE: [ceil(K/128), M rounded up to 4], outer-dim major
        assert torch.equal(si[: k // 128, :m].t(), rows.scale_inv.float())
    else:  # TE: [ceil(M/128), ceil(K/128) rounded up to 4]
        assert torch.equal(si[:, : k // 128], rows.scale_inv.float())
    cols = quantize(x.float(), "e4m3", gran, rounding, dim=0)  # the wgrad copy, [K, M]
    assert torch.equal(_codes(q_te._columnwise_data), _codes(cols.data))
    sc = q_te._columnwise_scale_inv.float()
    if block_dim == 1:
        assert torch.equal(sc[: m // 128, :k].t(), cols.scale_inv.float())
    else:
        assert torch.equal(sc[:, : m // 128], cols.scale_inv.float())


def test_te_quantizers_never_hide_a_nan_and_agree_with_the_reference_elsewhere():
    """A NaN input stays NaN in both engines. Where it lands differs, and only there: TE takes a
    group's amax with ``fmaxf``, which skips the NaN, so only that element is NaN and the rest of
    its group is quantised as if the NaN were zero; our contract makes the whole group's scale NaN
    (docs/recipes.md). Every value outside the NaN's group is bit-identical."""
    te = _te()
    x = _outlier_input()
    x[3, 7] = float("nan")
    x = x.to(torch.bfloat16)
    nan = torch.isnan(x)
    x0 = torch.where(nan, torch.zeros_like(x), x)  # TE's view of the group: the NaN skipped

    q_te = te.Float8CurrentScalingQuantizer(_tex_dtype("e4m3"), torch.device(DEV), rowwise=True, columnwise=False)(x)
    deq = q_te.dequantize(dtype=torch.float32)
    assert torch.equal(torch.isnan(deq), nan), "TE's tensorwise quantizer: NaN exactly where the input is NaN"
    ref0 = quantize(x0.float(), "e4m3", "tensor", "fp32")
    assert torch.equal(deq[~nan], (ref0.data.float() * ref0.scale_inv)[~nan])
    ours = quantize(x.float(), "e4m3", "tensor", "fp32")
    assert torch.isnan(ours.data.float() * ours.scale_inv).all()  # one group: the whole tensor

    qb = te.Float8BlockQuantizer(_tex_dtype("e4m3"), rowwise=True, columnwise=False, block_scaling_dim=1)(x)
    deq_b = qb.dequantize(dtype=torch.float32)
    assert torch.equal(torch.isnan(deq_b), nan), "TE's 1x128 quantizer: NaN exactly where the input is NaN"
    rows0 = quantize(x0.float(), "e4m3", "1x128", "pow2")
    assert torch.equal(deq_b[~nan], (rows0.data.float() * rows0.expanded_scale_inv())[~nan])
    rows = quantize(x.float(), "e4m3", "1x128", "pow2")
    ours_b = rows.data.float() * rows.expanded_scale_inv()
    group = torch.zeros_like(nan)
    group[3, :128] = True
    assert torch.equal(torch.isnan(ours_b), group)  # ours: the NaN's whole 1x128 group
    assert torch.equal(ours_b[~group], deq_b[~group])  # and bit-identical everywhere else


# ---- (b) te.Linear vs Float8Linear --------------------------------------------------------------------
def _pair(recipe, in_f=512, out_f=256, seed=0):
    te = _te()
    torch.manual_seed(seed)
    lin = te.Linear(in_f, out_f, bias=False, params_dtype=torch.bfloat16, device=DEV)
    ref = torch.nn.Linear(in_f, out_f, bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
    ours = Float8Linear.from_linear(ref, recipe, emulate=False)
    return lin, ours


def _step(mod, x, dy, te_recipe=None):
    from nemo_fp8_recipes.integrations.te import te_autocast

    x = x.detach().clone().requires_grad_(True)
    mod.zero_grad(set_to_none=True)
    if te_recipe is not None:
        with te_autocast(te_recipe):
            y = mod(x)
    else:
        y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad.detach(), mod.weight.grad.detach()


@pytest.mark.parametrize("key", ["tensorwise", "blockwise", "delayed"])
@pytest.mark.parametrize("triton", ["1", "0"], ids=["triton", "reference"])
def test_te_linear_equals_float8_linear_bit_for_bit(key, triton, monkeypatch):
    """fprop, dgrad and wgrad identical over several steps (delayed: the amax history and the
    weight's re-quantisation each step included), through our Triton kernels and our reference
    quantisers."""
    from nemo_fp8_recipes.integrations.te import to_te_recipe

    monkeypatch.setenv("NEMO_FP8_TRITON", triton)
    recipe = get_recipe(key, amax_history_len=4) if key == "delayed" else get_recipe(key)
    te_recipe = to_te_recipe(recipe)
    lin, ours = _pair(recipe)
    for step in range(4 if key == "delayed" else 2):
        x = (structured(384, 512, seed=10 + step) * (1 + step)).to(DEV, torch.bfloat16)
        dy = (structured(384, 256, seed=20 + step) * 0.01 * (1 + step)).to(DEV, torch.bfloat16)
        a = _step(lin, x, dy, te_recipe)
        b = _step(ours, x, dy)
        for name, u, v in zip(("fprop", "dgrad", "wgrad"), a, b):
            assert u.dtype == v.dtype and torch.equal(u, v), (key, step, name, (u.float() - v.float()).abs().max())


@pytest.mark.parametrize("key", ["tensorwise", "blockwise", "delayed"])
def test_te_grouped_linear_equals_float8_grouped_experts_bit_for_bit(key):
    """``te.GroupedLinear`` and our grouped FP8 experts (``Float8GroupedExperts.grouped_mm``) on the
    same 3-D weight and the same rows per expert: fprop, dgrad and every expert's wgrad identical
    over several steps (delayed: four steps, so each expert's own amax history sets its scales)."""
    from nemo_fp8_recipes.integrations.te import te_autocast, to_te_recipe
    from nemo_fp8_recipes.nn import Float8GroupedExperts, Float8LinearConfig

    te = _te()
    recipe = get_recipe(key, amax_history_len=4) if key == "delayed" else get_recipe(key)
    E, in_f, out_f, sizes = 4, 512, 256, [128, 64, 192, 128]
    torch.manual_seed(0)
    grouped = te.GroupedLinear(E, in_f, out_f, bias=False, params_dtype=torch.bfloat16, device=DEV)
    w = torch.stack([getattr(grouped, f"weight{e}").detach() for e in range(E)])
    ours = Float8GroupedExperts(
        {"weight": torch.nn.Parameter(w.clone())}, Float8LinearConfig(recipe=recipe, emulate=False)
    )
    for step in range(4 if key == "delayed" else 2):
        x = (structured(sum(sizes), in_f, seed=30 + step) * (1 + step)).to(DEV, torch.bfloat16)
        dy = (structured(sum(sizes), out_f, seed=40 + step) * 0.01 * (1 + step)).to(DEV, torch.bfloat16)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        grouped.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        with te_autocast(to_te_recipe(recipe)):
            ya = grouped(xa, sizes)
        ya.backward(dy)
        yb = ours.grouped_mm("weight", xb, sizes)
        yb.backward(dy)
        wa = torch.stack([getattr(grouped, f"weight{e}").grad for e in range(E)])
        for name, u, v in (("fprop", ya, yb), ("dgrad", xa.grad, xb.grad), ("wgrad", wa, ours.weight.grad)):
            assert u.dtype == v.dtype and torch.equal(u, v), (key, step, name, (u.float() - v.float()).abs().max())


def test_te_refuses_mxfp8_on_hopper_and_our_check_says_what_to_do():
    from nemo_fp8_recipes.recipes import check_supported

    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs MXFP8 (SM100+): the refusal is a Hopper check")
    ok, why = check_supported("mxfp8", "cuda")
    assert not ok and "blockwise" in why and "emulate=true" in why
    from transformer_engine.pytorch import is_mxfp8_available

    avail = is_mxfp8_available(return_reason=True)
    assert not (avail[0] if isinstance(avail, tuple) else avail)


# ---- (c) Megatron-Core GPTModel with the TE spec ------------------------------------------------------
def _init_megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def _te_gpt(key: str, policy: PrecisionPolicy, layers: int = 4):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_recipes.integrations.megatron import megatron_config

    _init_megatron()
    torch.manual_seed(0)
    mc = megatron_config(key, policy.with_num_layers(layers))
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=256,
        ffn_hidden_size=1024,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **mc.transformer_config_kwargs(),
    )
    return GPTModel(
        cfg,
        get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=512,
        max_sequence_length=256,
        position_embedding_type="rope",
    ).to(DEV)


_POLICIES = {
    "none": PrecisionPolicy(),
    "first_last_bf16": PrecisionPolicy(first_layers_bf16=1, last_layers_bf16=1),
    "attention_bf16": PrecisionPolicy(attention_projections="bf16"),
}


@pytest.mark.parametrize("policy", list(_POLICIES))
@pytest.mark.parametrize("key", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_megatron_te_gpt_trains_30_steps_under_the_strict_audit(key, policy):
    from nemo_fp8_recipes.integrations.callbacks import TEPrecisionHooks

    if key == "delayed" and policy == "first_last_bf16":
        pytest.skip("Megatron refuses first/last BF16 layers with delayed scaling (megatron_config raises)")
    pol = _POLICIES[policy]
    model = _te_gpt(key, pol)
    hooks = TEPrecisionHooks(get_recipe(key), pol.with_num_layers(4), strict=True)
    hooks.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 512, (4, 129), generator=g).to(DEV)
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(128, device=DEV).unsqueeze(0).expand(4, -1)
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        loss = model(inp, pos, attention_mask=None, labels=labels).float().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    report = hooks.check()  # strict: raises on a violation
    assert not report.violations
    assert losses[-1] < losses[0] - 0.5, losses[::5]
    rows = {r.name: r for r in report.rows}
    core = [r for n, r in rows.items() if "core_attention" in n]
    assert core and all(r.fp8_calls == 0 for r in core)  # the attention core never in FP8
    if key != "bf16":
        fp8 = [r for r in rows.values() if r.decision == "fp8"]
        assert fp8 and all(r.fp8_calls > 0 for r in fp8)
    hooks.detach()


@pytest.mark.parametrize("key", ["delayed", "tensorwise", "blockwise"])
def test_te_fp8_state_survives_a_checkpoint(key, tmp_path, monkeypatch):
    """TE keeps its FP8 state (delayed: amax histories and scales) in each module's extra state:
    a save/load of the whole model restores it, and the loaded model computes the same step."""
    model = _te_gpt(key, PrecisionPolicy())
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, 512, (2, 129), generator=g).to(DEV)
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(128, device=DEV).unsqueeze(0).expand(2, -1)
    for _ in range(3):
        model(inp, pos, attention_mask=None, labels=labels).float().mean().backward()
    path = tmp_path / "te.pt"
    torch.save(model.state_dict(), path)
    assert any(k.endswith("_extra_state") for k in model.state_dict())
    clone = _te_gpt(key, PrecisionPolicy())
    state = torch.load(path, weights_only=False)
    if key == "delayed":
        # TE (and Megatron's TE modules) pickle delayed scaling's state; TE 2.20 refuses to
        # unpickle it on load unless the user opts in for a checkpoint they trust.
        monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
        with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1"):
            _te_gpt(key, PrecisionPolicy()).load_state_dict(state)
        monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    clone.load_state_dict(state)
    if key == "delayed":
        for (n, a), (_, b) in zip(model.named_modules(), clone.named_modules()):
            meta_a, meta_b = getattr(a, "fp8_meta", None), getattr(b, "fp8_meta", None)
            if meta_a and "scaling_fwd" in meta_a:
                assert torch.equal(meta_a["scaling_fwd"].amax_history, meta_b["scaling_fwd"].amax_history), n
                assert torch.equal(meta_a["scaling_fwd"].scale, meta_b["scaling_fwd"].scale), n
    for m in (model, clone):  # Megatron's TE linears cache FP8 weights until told a new step starts
        m.set_is_first_microbatch()
    with torch.no_grad():
        a = model(inp, pos, attention_mask=None, labels=labels)
        b = clone(inp, pos, attention_mask=None, labels=labels)
    assert torch.equal(a, b)


# ---- (d) the callbacks on real TE modules ------------------------------------------------------------
def test_bridge_callback_on_real_te_modules():
    pytest.importorskip("megatron.bridge", reason="Megatron-Bridge is not installed (Python 3.12 + CUDA + TE)")
    from nemo_fp8_recipes.integrations.bridge import expected_model_fields
    from nemo_fp8_recipes.integrations.callbacks import bridge_callback

    model = _te_gpt("tensorwise", PrecisionPolicy())
    cfg_model = SimpleNamespace(**expected_model_fields("tensorwise"))
    cb = bridge_callback(
        "tensorwise", PrecisionPolicy(), expected_model_fields=expected_model_fields("tensorwise"), strict=True
    )
    ctx = SimpleNamespace(
        state=SimpleNamespace(cfg=SimpleNamespace(model=cfg_model), tensorboard_logger=None), model=[model]
    )
    cb.on_train_start(ctx)
    tokens = torch.randint(0, 512, (2, 65), device=DEV)
    pos = torch.arange(64, device=DEV).unsqueeze(0).expand(2, -1)
    model(tokens[:, :-1], pos, attention_mask=None, labels=tokens[:, 1:]).float().mean().backward()
    cb.on_train_step_end(ctx)
    assert cb.audit is not None and not cb.audit.violations and any(r.fp8_calls for r in cb.audit.rows)
    cb.on_train_end(ctx)
    bad = SimpleNamespace(**{**expected_model_fields("tensorwise"), "fp8_recipe": "delayed"})
    cb2 = bridge_callback("tensorwise", expected_model_fields=expected_model_fields("tensorwise"))
    with pytest.raises(RuntimeError, match="does not carry the FP8 recipe"):
        cb2.on_train_start(SimpleNamespace(state=SimpleNamespace(cfg=SimpleNamespace(model=bad)), model=[model]))


def test_lightning_callback_on_real_te_modules():
    pytest.importorskip("lightning", reason="lightning is not installed (NeMo 2.x ships it)")
    from nemo_fp8_recipes.integrations.callbacks import lightning_callback

    model = _te_gpt("blockwise", PrecisionPolicy())
    cb = lightning_callback("blockwise", PrecisionPolicy(), strict=True)
    module = torch.nn.Module()
    module.module = model
    trainer = SimpleNamespace(global_step=1, logger=None)
    cb.setup(trainer, module, stage="fit")
    tokens = torch.randint(0, 512, (2, 65), device=DEV)
    pos = torch.arange(64, device=DEV).unsqueeze(0).expand(2, -1)
    model(tokens[:, :-1], pos, attention_mask=None, labels=tokens[:, 1:]).float().mean().backward()
    cb.on_train_batch_end(trainer, module, None, None, 0)
    rep = cb.hooks.report()
    assert not rep.violations and any(r.fp8_calls for r in rep.rows)


def test_copy_of_a_te_linear_keeps_its_recipe_state():
    """deepcopy of a te.Linear after FP8 steps (what checkpoint-averaging and EMA tools do)."""
    from nemo_fp8_recipes.integrations.te import te_autocast

    te = _te()
    lin = te.Linear(256, 256, params_dtype=torch.bfloat16, device=DEV)
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    with te_autocast("delayed"):
        lin(x)
    twin = copy.deepcopy(lin)
    with torch.no_grad(), te_autocast("delayed"):
        assert torch.equal(lin(x), twin(x))


# ---- the Bridge launcher, for real ----------------------------------------------------------------
@pytest.fixture(scope="module")
def bridge_runs(tmp_path_factory):
    """The launcher trains llama3_tiny (built offline, mock data) for 20 steps per Hopper recipe and
    BF16, the strict audit on: four single-GPU runs side by side on one GPU (the model is tiny)."""
    import subprocess
    import sys

    pytest.importorskip("megatron.bridge", reason="Megatron-Bridge is not installed (Python 3.12 + CUDA + TE)")
    root = tmp_path_factory.mktemp("bridge_runs")
    procs = {}
    for i, key in enumerate(("bf16", "delayed", "tensorwise", "blockwise")):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--master-port",
            str(29541 + i),
            "-m",
            "nemo_fp8_recipes.integrations.bridge",
            "model=llama3_tiny",
            f"recipe={key}",
            "trainer.max_steps=20",
            "trainer.log_interval=1",
            "trainer.seq_len=256",
            "backend.strict_audit=true",
            f"run.root={root}",
        ]
        log = open(root / f"{key}.log", "w")
        procs[key] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=str(root)), log)
    done = {}
    for key, (proc, log) in procs.items():
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        done[key] = SimpleNamespace(returncode=proc.returncode, output=(root / f"{key}.log").read_text())
    return root / "llama3_tiny", done


@pytest.mark.parametrize("key", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_the_bridge_launcher_trains_our_model_offline(bridge_runs, key):
    run_root, done = bridge_runs
    proc = done[key]
    assert proc.returncode == 0, proc.output[-6000:]
    run = run_root / key
    audit = (run / "audit.txt").read_text()
    assert "POLICY VIOLATIONS" not in audit
    if key != "bf16":
        assert "in FP8" in audit and " 0 TE module calls in FP8" not in audit


def test_compare_reads_the_bridge_runs(bridge_runs, tmp_path, capsys):
    from nemo_fp8_recipes.compare import main as compare_main

    run_root, done = bridge_runs
    if any(p.returncode for p in done.values()):
        pytest.skip("a Bridge run failed (see test_the_bridge_launcher_trains_our_model_offline)")
    assert compare_main([str(run_root), "--last", "5", "--out", str(tmp_path), "--no-events"]) == 0
    out = capsys.readouterr().out
    assert "tag `lm loss`" in out and "| bf16 (baseline) |" in out
    assert (tmp_path / "compare.png").is_file()


# ---- the embedded trainer with backend=te -------------------------------------------------------
_BASE = [
    "model=llama3_tiny",
    "trainer.device=cuda",
    "trainer.max_steps=12",
    "trainer.log_interval=2",
    "trainer.val_interval=6",
    "trainer.val_steps=2",
    "trainer.telemetry_interval=4",
    "trainer.ckpt_interval=6",
    "trainer.ckpt_keep=5",
    "trainer.progress=false",
    "data.max_files=100",
]
_TRAIN = _BASE + ["backend=te", "backend.strict_audit=true"]


def _train_te(tmp_path, *extra, backend="te"):
    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.train import train

    base = _TRAIN if backend == "te" else _BASE + [f"backend={backend}"]
    return train(compose_config(base + [f"run.root={tmp_path}", *extra]))


def _tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.parametrize("key", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_trainer_backend_te_trains_with_the_strict_audit(key, tmp_path):
    te = _te()
    res = _train_te(tmp_path, f"recipe={key}", "trainer.global_batch_size=8")  # two micro-batches per step
    assert res.final_step == 12 and res.history[-1]["loss"] < res.history[0]["loss"]
    n_te = sum(isinstance(m, te.Linear) for m in res.model.modules())
    assert n_te == (0 if key == "bf16" else 4 * 7)  # wq wk wv wo w1 w2 w3 of 4 layers
    audit = (res.run_dir / "audit.txt").read_text()
    assert "POLICY VIOLATIONS" not in audit
    out_row = next(line for line in audit.splitlines() if line.startswith("output "))
    assert " bf16 " in out_row and "a PyTorch module" in out_row  # the head stays out of FP8, listed
    if key != "bf16":
        tags = _tags(res.run_dir)
        assert {"fp8/attention/input/amax", "fp8/mlp/input/amax"} <= tags  # the native backend's tags
        if key == "delayed":
            assert {"fp8/mlp/weight/scale", "fp8/mlp/grad_output/scale"} <= tags


def test_trainer_backend_te_resume_reproduces_the_loss_curve(tmp_path):
    full = _train_te(tmp_path / "a", "recipe=delayed")
    ckpt6 = full.run_dir / "checkpoints" / "step_00000006.pt"
    resumed = _train_te(tmp_path / "b", "recipe=delayed", f"trainer.resume={ckpt6}")
    assert resumed.start_step == 6
    for s, loss in resumed.losses.items():
        assert loss == pytest.approx(full.losses[s], rel=1e-6, abs=1e-6), s  # TE's kernels are deterministic here
    from nemo_fp8_recipes.trainer.checkpoint import load_checkpoint

    state = load_checkpoint(ckpt6)
    assert state["backend"] == "te" and any(k.endswith("_extra_state") for k in state["model"])


def test_te_linear_state_is_checkpointed_without_pickle(tmp_path):
    """Our te.Linear writes delayed scaling's state as tensors and numbers: a ``weights_only``
    load restores amax histories and scales exactly, and the restored module computes the same
    output; validation's snapshot/restore puts the state back in place."""
    from nemo_fp8_recipes.integrations.te import te_autocast, to_te_recipe
    from nemo_fp8_recipes.trainer.te_backend import (
        convert_to_te,
        restore_te_state,
        snapshot_te_state,
    )

    recipe = get_recipe("delayed")

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).to(DEV)
        convert_to_te(m, recipe, PrecisionPolicy())
        return m

    model = make()
    x = torch.randn(64, 256, device=DEV)
    for i in range(4):
        with te_autocast(to_te_recipe(recipe)):
            y = model((x * (i + 1)).requires_grad_())
        y.sum().backward()
    lin = model[0]
    torch.save(model.state_dict(), tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=True)  # no pickle inside
    clone = make()
    clone.load_state_dict(state)
    for d in ("fwd", "bwd"):
        a, b = lin.fp8_meta[f"scaling_{d}"], clone[0].fp8_meta[f"scaling_{d}"]
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale), d
    assert lin.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0
    with torch.no_grad(), te_autocast(to_te_recipe(recipe)):
        assert torch.equal(model(x), clone(x))
    snap = snapshot_te_state(model)
    hist = lin.fp8_meta["scaling_fwd"].amax_history.clone()
    with torch.no_grad(), te_autocast(to_te_recipe(recipe)):
        model(x * 100)
    assert not torch.equal(lin.fp8_meta["scaling_fwd"].amax_history, hist)
    restore_te_state(model, snap)
    assert torch.equal(lin.fp8_meta["scaling_fwd"].amax_history, hist)


def test_trainer_checkpoints_cross_backends_only_when_forced(tmp_path):
    from nemo_fp8_recipes.trainer.checkpoint import CheckpointError

    native = _train_te(tmp_path / "n", "recipe=tensorwise", backend="native")
    ckpt = native.run_dir / "checkpoints" / "step_00000006.pt"
    with pytest.raises(CheckpointError, match="written by backend=native.*trainer.force_resume=true"):
        _train_te(tmp_path / "t", "recipe=tensorwise", f"trainer.resume={ckpt}")
    forced = _train_te(tmp_path / "t", "recipe=tensorwise", f"trainer.resume={ckpt}", "trainer.force_resume=true")
    assert forced.start_step == 6 and forced.final_step == 12


def test_trainer_backend_te_mxfp8_on_hopper_names_the_alternatives(tmp_path):
    import subprocess
    import sys

    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs MXFP8")
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_recipes.train", *_TRAIN, "recipe=mxfp8", f"run.root={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "needs SM100" in err and "recipe=blockwise" in err and "backend=native recipe.emulate=true" in err
    assert "Traceback" not in err
