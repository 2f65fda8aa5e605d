"""Train a real Megatron-Core GPTModel per recipe: with the native FP8 backend (local spec, our FP8
linears swapped in; ``--impl native``, the default) or with Transformer Engine (the TE layer spec,
FP8 from ``megatron_config(recipe, policy, backend="te")``; ``--impl te``, what Megatron-Core users
run), for tokens/s beside the embedded trainer.

``--impl te`` keeps FP32 parameters under BF16 autocast, as the embedded trainer does (TE casts and
quantises the weights in every forward, as it does without ``is_first_microbatch``), runs
``--micro-batches`` per optimizer step, and attaches ``TEPrecisionHooks(strict=True)``: the run fails
if a module the policy keeps out of FP8 ran with FP8 on. 8B width, 16 layers, sequence 4096, four
micro-batches (the end-to-end comparison of docs/performance.md)::

    PYTHONPATH=$PWD python benchmarks/megatron_native_train.py --impl te --recipes bf16,delayed,tensorwise,blockwise \
        --layers 16 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --seq 4096 --micro-batch 1 \
        --micro-batches 4 --vocab 128256 --data random --steps 30 --first-layers-bf16 0 --last-layers-bf16 0 \
        --out megatron_te_8b16.json

The Megatron path without Transformer Engine, exercised for real: the model is built with
``get_gpt_layer_local_spec`` from ``megatron_config(recipe, policy, backend="native")`` fields,
its ``ColumnParallelLinear`` / ``RowParallelLinear`` layers are swapped for FP8 linears per the
precision policy (``convert_megatron_model``), and it trains with AdamW under BF16 autocast on
the Python standard library's text (byte tokens) or random tokens. After the first step the audit
table shows per module what ran in FP8 and what the policy kept in high precision; the run fails
if a module the policy keeps out of FP8 ran an FP8 GEMM.

One command on the GPU machine (repo and megatron-core on PYTHONPATH; nothing installed)::

    PYTHONPATH=$PWD:$PYTHONPATH python benchmarks/megatron_native_train.py \\
        --recipes bf16,tensorwise,blockwise --steps 50 --out megatron_native.json

On a CPU the forward pass of the local spec cannot run (Megatron's DotProductAttention allocates
on ``torch.cuda.current_device()``), so ``--steps 0`` builds, converts and audits the decisions
only — which the CPU test suite does.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="bf16,tensorwise,blockwise", help="comma-separated registry keys")
    p.add_argument(
        "--impl",
        choices=("native", "te"),
        default="native",
        help="native: local spec + our FP8 linears; te: Transformer Engine layer spec and TE's FP8",
    )
    p.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)"
    )
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per recipe (0 = build/convert/audit only)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512, help="byte tokens need >= 257; a multiple of 128")
    p.add_argument(
        "--arch",
        choices=("llama", "gpt"),
        default="llama",
        help="llama: RMSNorm, SwiGLU, RoPE, no biases; gpt: LayerNorm, GELU, learned positions, biases",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--first-layers-bf16", type=int, default=1)
    p.add_argument("--last-layers-bf16", type=int, default=1)
    p.add_argument("--data", choices=("stdlib", "random"), default="stdlib")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(device: torch.device, seed: int) -> None:
    """One-rank process group and TP = PP = 1 model-parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_te_model(args, recipe, policy, device: torch.device):
    """A GPTModel with Transformer Engine's layer spec and our fields for backend ``te`` (FP8 and the
    first/last BF16 layers through TransformerConfig; per-module overrides through quant_recipe)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_recipes.integrations.megatron import megatron_config

    if args.arch != "llama":
        raise SystemExit("--impl te builds the Llama layer (RMSNorm, SwiGLU, RoPE); use --arch llama")
    mc = megatron_config(recipe, policy, backend="te")
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=torch.float32,
        **mc.transformer_config_kwargs(),
    )
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    return model.to(device)


def build_model(args, recipe, policy, device: torch.device):
    """A local-spec GPTModel with our Megatron fields (backend native), converted per policy."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_recipes.integrations.megatron import (
        convert_megatron_model,
        megatron_config,
    )

    llama = args.arch == "llama"
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        use_cpu_initialization=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu,
        add_bias_linear=not llama,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        **megatron_config(recipe, policy, backend="native"),
    )
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope" if llama else "learned_absolute",
    )
    model.to(device)
    convert_megatron_model(model, recipe, policy, device=device)
    return model


def batches(args, device: torch.device):
    """``get(step) -> (tokens, labels)`` of shape [micro_batch, seq]."""
    if args.data == "random":
        gen = torch.Generator().manual_seed(args.seed)
        fixed = torch.randint(0, args.vocab, (64, args.seq + 1), generator=gen)

        def get(step):
            w = fixed[(step * args.micro_batch + torch.arange(args.micro_batch)) % fixed.shape[0]].to(device)
            return w[:, :-1], w[:, 1:]

        return get
    from nemo_fp8_recipes.data import (
        ByteTokenizer,
        DataConfig,
        PackedTokens,
        TrainBatches,
        load_corpus,
    )

    corpus = load_corpus(DataConfig(source="stdlib", max_bytes=8_000_000), ByteTokenizer())
    tb = TrainBatches(
        PackedTokens(corpus.train, args.seq, "train"), seed=args.seed, micro_batch_size=args.micro_batch, grad_accum=1
    )
    return lambda step: tb.get(step, 0, device)


def train_one(args, recipe_name: str, device: torch.device) -> dict:
    from nemo_fp8_recipes import PrecisionPolicy, audit, get_recipe
    from nemo_fp8_recipes.hardware import describe_device
    from nemo_fp8_recipes.recipes import uses_real_fp8_gemm

    recipe = get_recipe(recipe_name)
    policy = PrecisionPolicy(
        first_layers_bf16=args.first_layers_bf16, last_layers_bf16=args.last_layers_bf16, num_layers=args.layers
    )
    t0 = time.perf_counter()
    hooks = None
    if args.impl == "te":
        from nemo_fp8_recipes.integrations.callbacks import TEPrecisionHooks
        from nemo_fp8_recipes.integrations.te import prepare_te_env

        if recipe.is_fp8:
            prepare_te_env(recipe)  # the NVTE_* switches TE reads at import
        model = build_te_model(args, recipe, policy, device)
        hooks = TEPrecisionHooks(recipe, policy, strict=True)
        hooks.attach(model)
        mode = "no FP8" if not recipe.is_fp8 else "Transformer Engine FP8"
    else:
        model = build_model(args, recipe, policy, device)
        mode = (
            "no FP8" if not recipe.is_fp8 else ("real FP8 GEMMs" if uses_real_fp8_gemm(recipe, device) else "emulated")
        )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"\n=== {recipe_name} | {mode} on {describe_device(device)} | {n_params / 1e6:.1f}M params | "
        f"{args.layers}x{args.hidden} ffn {args.ffn} heads {args.heads}/{args.kv_heads} seq {args.seq} "
        f"mbs {args.micro_batch} | built+converted in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    result = {"recipe": recipe_name, "impl": args.impl, "mode": mode, "params": n_params, "losses": []}
    if args.steps <= 0 and hooks is not None:
        raise SystemExit("--impl te needs --steps >= 1 (the TE audit records what ran)")
    if args.steps <= 0:
        rep = audit(model)
        result["audit"] = _audit_summary(rep)
        print(rep.table(), flush=True)
        return result

    get = batches(args, device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / max(1, args.warmup))
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
        ),
    )
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    model.train()
    times = []
    audit_rep = None
    k_micro = max(1, args.micro_batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        ts = time.perf_counter()
        lv = 0.0
        for micro in range(k_micro):
            tokens, labels = get(step * k_micro + micro)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                per_token = model(tokens, pos, None, labels=labels)
            loss = per_token.float().mean() / k_micro
            loss.backward()
            lv += float(loss.detach())
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - ts)
        result["losses"].append([step + 1, lv])
        if not math.isfinite(lv):
            raise RuntimeError(f"{recipe_name}: non-finite loss {lv} at step {step + 1}")
        if step == 0:
            # PolicyViolation if a high-precision role ran FP8
            audit_rep = hooks.check() if hooks is not None else audit(model, strict=True)
            print(audit_rep.table(), flush=True)
        if (step + 1) % args.log_interval == 0 or step == 0 or step + 1 == args.steps:
            print(
                f"{recipe_name} step {step + 1:4d} | loss {lv:.4f} | grad_norm {gn:.3f} | {times[-1] * 1e3:.0f} ms",
                flush=True,
            )
    steady = times[1:] or times
    tok_s = args.micro_batch * k_micro * args.seq * len(steady) / sum(steady)
    result["step_ms_median"] = 1e3 * sorted(steady)[len(steady) // 2]
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    k = min(5, len(result["losses"]) // 2 or 1)
    first = sum(loss for _, loss in result["losses"][:k]) / k
    last = sum(loss for _, loss in result["losses"][-k:]) / k
    result.update(
        first_loss_mean=first,
        last_loss_mean=last,
        loss_fell=last < first,
        tokens_per_s=tok_s,
        audit=_audit_summary(audit_rep) if hooks is None else _te_audit_summary(audit_rep),
    )
    if hooks is not None:
        hooks.detach()
    print(
        f"{recipe_name}: loss {first:.4f} (first {k}) -> {last:.4f} (last {k}), "
        f"{'falls' if last < first else 'DOES NOT FALL'}; {tok_s / 1e3:.1f}k tok/s; "
        f"policy {'held' if not audit_rep.violations else 'VIOLATED'}",
        flush=True,
    )
    return result


def _te_audit_summary(rep) -> dict:
    return {
        "violations": rep.violations,
        "fp8_off": rep.fp8_off,
        "fp8_modules": sum(1 for r in rep.rows if r.decision == "fp8"),
        "fp8_calls": sum(r.fp8_calls for r in rep.rows),
        "calls": sum(r.calls for r in rep.rows),
    }


def _audit_summary(rep) -> dict:
    rows = rep.rows
    return {
        "counts": rep.counts,
        "violations": rep.violations,
        "fp8_modules": sum(1 for r in rows if r.precision == "fp8"),
        "high_precision_gemm_modules": sorted(r.name for r in rows if r.precision != "fp8" and r.hp_gemms),
        "emulated": rep.emulated,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if args.impl == "te":
        from nemo_fp8_recipes.integrations.te import te_available

        ok, why = te_available()
        if not ok or device.type != "cuda":
            print(
                f"megatron_native_train: --impl te needs Transformer Engine on a CUDA GPU "
                f"({why if not ok else 'no GPU here'}); pip install '.[te]' there",
                file=sys.stderr,
            )
            return 2
    if device.type != "cuda" and args.steps > 0:
        print(
            "megatron_native_train: the local spec's forward needs CUDA (Megatron's DotProductAttention); "
            "on CPU use --steps 0 (build, convert, audit decisions)",
            file=sys.stderr,
        )
        return 2
    init_megatron(device, args.seed)
    import megatron.core

    out = {
        "args": vars(args),
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "runs": {},
    }
    for name in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        out["runs"][name] = train_one(args, name, device)
        # the last recipe's model, gradients and AdamW state sit in reference cycles (TE's and
        # Megatron's modules): collect them before the next build, or two 8B-width models meet
        # in memory (measured: out of memory on the second recipe at 16 layers on the H200)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.steps > 0:
        print("\nrecipe       mode            first   last    falls  tok/s     fp8 modules  violations")
        for name, r in out["runs"].items():
            a = r["audit"]
            print(
                f"{name:12s} {r['mode'][:15]:15s} {r['first_loss_mean']:.4f}  {r['last_loss_mean']:.4f}  "
                f"{str(r['loss_fell']):5s}  {r['tokens_per_s']:8.0f}  {a['fp8_modules']:11d}  {len(a['violations'])}"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
