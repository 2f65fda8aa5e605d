"""Train a real Megatron-Core GPTModel per recipe, for tokens/s and model TFLOP/s beside the embedded
trainer. Three ways (``--impl``):

- ``te`` — Megatron-Core + Transformer Engine as Megatron trains: the TE layer spec with FP8 from
  ``megatron_config(recipe, policy, backend="te")``, BF16 parameters (``params_dtype=bfloat16``,
  ``bf16=True``, ``Float16Module``), Megatron's ``DistributedDataParallel`` (gradients accumulate in
  its ``main_grad`` buffers, BF16 as Megatron-Bridge's Llama 3 performance recipes set them, FP32
  with ``--grad-reduce-in-fp32``), the distributed optimizer from ``get_megatron_optimizer`` (FP32
  master weights and FP32 Adam moments, gradient clipping 1.0), ``OptimizerParamScheduler`` (linear
  warmup from 0, cosine to 0.1·lr) and Megatron's own schedule (``get_forward_backward_func()``; it
  marks each step's first micro-batch, so TE quantises the weights once per optimizer step).
- ``te-fp32params`` — the same TE model with FP32 parameters under torch BF16 autocast and
  ``torch.optim.AdamW``, as the embedded trainer holds them. Not how Megatron trains: a labelled
  variant, never the Megatron baseline.
- ``native`` (default) — the Megatron path without Transformer Engine: ``get_gpt_layer_local_spec``
  from ``megatron_config(recipe, policy, backend="native")`` fields, its ``ColumnParallelLinear`` /
  ``RowParallelLinear`` layers swapped for FP8 linears per the precision policy
  (``convert_megatron_model``), FP32 parameters under BF16 autocast and AdamW, on the Python
  standard library's text (byte tokens) or random tokens.

Every run audits the policy after the first step (``TEPrecisionHooks(strict=True)`` for the TE
ways, ``audit(strict=True)`` for native): it fails if a module the policy keeps out of FP8 ran an
FP8 GEMM. Each result row says how the parameters were held (``params``) and reports tokens/s, model
TFLOP/s per GPU by Megatron-LM's FLOPs formula (:func:`megatron_flops_per_token`), peak memory and
the losses. The TE ways train each recipe in a process of its own (:func:`run_recipes_apart`).
8B width, 8 layers, sequence 4096, four micro-batches of one (TE needs a CUDA GPU; repo on
PYTHONPATH)::

    PYTHONPATH=$PWD:$PYTHONPATH python benchmarks/megatron_native_train.py --impl te \\
        --recipes bf16,tensorwise,blockwise,delayed --layers 8 --hidden 4096 --ffn 14336 --heads 32 \\
        --kv-heads 8 --seq 4096 --micro-batch 1 --micro-batches 4 --vocab 128256 --data random \\
        --steps 30 --first-layers-bf16 0 --last-layers-bf16 0 --out megatron_te_8b8.json

The native path (one command on the GPU machine)::

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


IMPLS = {
    "native": "local spec + our FP8 linears, FP32 parameters under BF16 autocast, torch AdamW",
    "te": "Megatron-Core + TE as Megatron trains: BF16 parameters, DDP main grads, distributed optimizer "
    "with FP32 master weights and Adam moments, Megatron's schedule and fused RoPE, SwiGLU and cross entropy",
    "te-fp32params": "TE layer spec with FP32 parameters under BF16 autocast and torch AdamW (not how Megatron trains)",
}
# how each way holds the parameters (the ``params`` field of a result row)
PARAMS = {"native": "fp32", "te": "bf16+fp32-master", "te-fp32params": "fp32"}


def _llama3_rope_base() -> int:
    """Llama 3's RoPE base, from the package's model config (Megatron-Core's GPTModel defaults to 10000)."""
    from nemo_fp8_recipes.models.config import load_model_config

    return int(load_model_config("llama3_8b").rope_theta)


def megatron_flops_per_token(
    *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, vocab: int, gated: bool = True
) -> float:
    """Model FLOPs of one training token by Megatron-LM's formula
    (:meth:`~nemo_fp8_recipes.models.ModelConfig.megatron_flops_per_token`: GEMM weights ``6·m·n``,
    the attention core causal-halved, no norms) for this benchmark's Llama shape; ``gated=False``
    (``--arch gpt``: two MLP matrices, not three) takes one ``hidden × ffn`` matrix off."""
    from nemo_fp8_recipes.models import ModelConfig

    m = ModelConfig(
        name="megatron_bench",
        vocab_size=vocab,
        dim=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_dim=ffn,
        max_seq_len=max(seq, 8192),
    )
    return m.megatron_flops_per_token(seq) - (0.0 if gated else 6.0 * layers * hidden * ffn)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="bf16,tensorwise,blockwise", help="comma-separated registry keys")
    p.add_argument(
        "--impl",
        choices=tuple(IMPLS),
        default="native",
        help="; ".join(f"{k}: {v}" for k, v in IMPLS.items()),
    )
    p.add_argument(
        "--grad-reduce-in-fp32",
        action="store_true",
        help="te: FP32 main_grad buffers (Megatron-Bridge's default recipes) instead of the BF16 ones of "
        "its performance recipes (grad_reduce_in_fp32=False)",
    )
    p.add_argument(
        "--grad-accum-fusion",
        choices=("auto", "on", "off"),
        default="auto",
        help="te: gradient_accumulation_fusion (TE writes wgrad straight into main_grad); auto = on where "
        "Transformer Engine and APEX's fused_weight_gradient_mlp_cuda (Megatron's output layer needs it) import",
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


def build_te_model(args, recipe, policy, device: torch.device, *, bf16_params: bool, grad_accum_fusion: bool = False):
    """A GPTModel with Transformer Engine's layer spec and our fields for backend ``te`` (FP8 and the
    first/last BF16 layers through TransformerConfig; per-module overrides through quant_recipe).
    ``bf16_params``: parameters in BF16 (``params_dtype``, ``bf16=True``) as Megatron holds them, else
    FP32; ``grad_accum_fusion``: TE accumulates wgrad into DDP's ``main_grad`` (te only)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_recipes.integrations.megatron import megatron_config

    if args.arch != "llama":
        raise SystemExit("the TE ways build the Llama layer (RMSNorm, SwiGLU, RoPE); use --arch llama")
    mc = megatron_config(recipe, policy, backend="te")
    # Megatron's fused kernels, on as Megatron-LM's Llama scripts and Megatron-Bridge's Llama
    # providers set them (TE's fused RoPE and cross entropy, the fused SwiGLU); the labelled
    # FP32-parameter variant keeps Megatron-Core's defaults
    fusions = (
        dict(
            apply_rope_fusion=True,
            bias_activation_fusion=True,
            masked_softmax_fusion=True,
            persist_layer_norm=True,
            cross_entropy_loss_fusion=True,
            cross_entropy_fusion_impl="te",
        )
        if bf16_params
        else {}
    )
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
        params_dtype=torch.bfloat16 if bf16_params else torch.float32,
        bf16=bf16_params,
        gradient_accumulation_fusion=grad_accum_fusion,
        **fusions,
        **mc.transformer_config_kwargs(),
    )
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
        rotary_base=_llama3_rope_base(),
    )
    return model.to(device)


def grad_accum_fusion_setting(mode: str) -> tuple[bool, str]:
    """(on, why) for ``--grad-accum-fusion``. Megatron's non-TE output layer
    (``tensor_parallel.ColumnParallelLinear``) refuses the fusion without APEX's
    ``fused_weight_gradient_mlp_cuda``, so ``auto`` turns it on only where that and TE import."""
    import importlib.util

    from nemo_fp8_recipes.integrations.te import te_available

    if mode != "auto":
        return mode == "on", f"--grad-accum-fusion {mode}"
    if not te_available()[0]:
        return False, "Transformer Engine is not importable"
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        return False, "APEX's fused_weight_gradient_mlp_cuda is not importable (Megatron's output layer needs it)"
    return True, "Transformer Engine and APEX's fused_weight_gradient_mlp_cuda import"


def wrap_as_megatron(args, model):
    """Wrap ``model`` (BF16 parameters) as Megatron's ``get_model`` and ``setup_model_and_optimizer``
    do: ``Float16Module``, then ``DistributedDataParallel`` with the settings of Megatron-Bridge's
    Llama 3 performance recipes; the distributed optimizer (FP32 master weights, FP32 Adam moments)
    and the LR schedule. Returns ``(ddp_model, optimizer, scheduler)``."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    cfg = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        # overlap and averaging only matter with data parallelism (DP > 1); kept as the recipe sets them
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        average_in_collective=True,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
    )
    ddp = DistributedDataParallel(cfg, ddp_config, Float16Module(cfg, model))
    min_lr = 0.1 * args.lr
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=min_lr,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
        ),
        [ddp],
    )
    # what Megatron's training loop sets on the model config before it trains
    cfg.no_sync_func = ddp.no_sync
    cfg.grad_scale_func = optimizer.scale_loss
    cfg.finalize_model_grads_func = finalize_model_grads  # finish_grad_sync() and the DP reductions
    steps = max(1, args.steps)
    warmup = min(args.warmup, steps - 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=steps,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


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
        **({"rotary_base": _llama3_rope_base()} if llama else {}),
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


def autocast_step_fn(args, model, get, device: torch.device):
    """``step(i) -> (loss, grad_norm)`` for FP32 parameters: ``--micro-batches`` forward/backward
    passes under torch BF16 autocast, gradient clipping 1.0, fused AdamW and a warmup·cosine LR."""
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
    k_micro = max(1, args.micro_batches)

    def step(i: int):
        if args.impl == "te-fp32params":
            # Megatron's TE linears cache their FP8 weights after a forward until told a new
            # optimizer step starts; without this they would run on the first step's weights forever
            model.set_is_first_microbatch()
        lv = 0.0
        for micro in range(k_micro):
            tokens, labels = get(i * k_micro + micro)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                per_token = model(tokens, pos, None, labels=labels)
            loss = per_token.float().mean() / k_micro
            loss.backward()
            lv += float(loss.detach())
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return lv, gn

    return step


def _loss_func(per_token: torch.Tensor):
    """Megatron's loss-function contract: (loss sum, token count, values to report). The schedule
    divides the sum by the count and by the number of micro-batches before the backward pass."""
    total = per_token.float().sum()
    n = torch.tensor(per_token.numel(), dtype=torch.int, device=per_token.device)
    return total, n, {"lm loss": torch.stack([total.detach(), n.float()])}  # stack copies: kept as is


def megatron_step_fn(args, model, get, device: torch.device):
    """``step(i) -> (loss, grad_norm)`` as Megatron's ``train_step``: zero the DDP grad buffers and the
    optimizer, run the micro-batches through ``get_forward_backward_func()`` (it marks the first
    micro-batch for TE's weight cache, skips the gradient sync until the last one and calls
    ``finalize_model_grads``), then ``optimizer.step()`` and the LR schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp, optimizer, scheduler = wrap_as_megatron(args, model)
    forward_backward = get_forward_backward_func()
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    k_micro = max(1, args.micro_batches)

    def forward_step(data_iterator, chunk):
        tokens, labels = next(data_iterator)
        return chunk(tokens, pos, None, labels=labels), _loss_func

    def step(i: int):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([get(i * k_micro + m) for m in range(k_micro)]),
            model=[ddp],
            num_microbatches=k_micro,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        ok, gn, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"step {i + 1}: Megatron's optimizer skipped the update (non-finite gradients)")
        scheduler.step(increment=1)
        lv = float(sum(r["lm loss"][0] / r["lm loss"][1] for r in reported)) / k_micro
        return lv, float(gn) if gn is not None else float("nan")

    ddp.train()
    return step


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
    extra = {}
    if args.impl in ("te", "te-fp32params"):
        from nemo_fp8_recipes.integrations.callbacks import TEPrecisionHooks
        from nemo_fp8_recipes.integrations.te import prepare_te_env

        if recipe.is_fp8:
            prepare_te_env(recipe)  # the NVTE_* switches TE reads at import
        megatron = args.impl == "te"
        fusion, why = grad_accum_fusion_setting(args.grad_accum_fusion) if megatron else (False, "")
        model = build_te_model(args, recipe, policy, device, bf16_params=megatron, grad_accum_fusion=fusion)
        hooks = TEPrecisionHooks(recipe, policy, strict=True)
        hooks.attach(model)
        mode = "no FP8" if not recipe.is_fp8 else "Transformer Engine FP8"
        if megatron:
            extra = {"main_grad": "fp32" if args.grad_reduce_in_fp32 else "bf16", "grad_accum_fusion": fusion}
            print(f"gradient_accumulation_fusion {'on' if fusion else 'off'}: {why}", flush=True)
    else:
        model = build_model(args, recipe, policy, device)
        mode = (
            "no FP8" if not recipe.is_fp8 else ("real FP8 GEMMs" if uses_real_fp8_gemm(recipe, device) else "emulated")
        )
    n_params = sum(p.numel() for p in model.parameters())
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16 if args.impl == "te" else torch.float32}:
        raise RuntimeError(f"--impl {args.impl} should hold {PARAMS[args.impl]} parameters; found {dtypes}")
    print(
        f"\n=== {recipe_name} | {mode} on {describe_device(device)} | {n_params / 1e6:.1f}M params "
        f"({PARAMS[args.impl]}) | {args.layers}x{args.hidden} ffn {args.ffn} heads {args.heads}/{args.kv_heads} "
        f"seq {args.seq} mbs {args.micro_batch} | built+converted in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    flops_per_token = megatron_flops_per_token(
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        heads=args.heads,
        kv_heads=args.kv_heads,
        seq=args.seq,
        vocab=args.vocab,
        gated=args.arch == "llama",
    )
    result = {
        "recipe": recipe_name,
        "impl": args.impl,
        "mode": mode,
        "params": PARAMS[args.impl],
        "n_params": n_params,
        **extra,
        "flops_per_token": flops_per_token,
        "losses": [],
    }
    if args.steps <= 0 and hooks is not None:
        raise SystemExit(f"--impl {args.impl} needs --steps >= 1 (the TE audit records what ran)")
    if args.steps <= 0:
        rep = audit(model)
        result["audit"] = _audit_summary(rep)
        print(rep.table(), flush=True)
        return result

    get = batches(args, device)
    model.train()
    step_fn = megatron_step_fn if args.impl == "te" else autocast_step_fn
    train_step = step_fn(args, model, get, device)
    times = []
    audit_rep = None
    k_micro = max(1, args.micro_batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        ts = time.perf_counter()
        lv, gn = train_step(step)
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
        model_tflops_per_gpu=tok_s * flops_per_token / 1e12,
        audit=_audit_summary(audit_rep) if hooks is None else _te_audit_summary(audit_rep),
    )
    if hooks is not None:
        hooks.detach()
    print(
        f"{recipe_name}: loss {first:.4f} (first {k}) -> {last:.4f} (last {k}), "
        f"{'falls' if last < first else 'DOES NOT FALL'}; {tok_s / 1e3:.1f}k tok/s, "
        f"{result['model_tflops_per_gpu']:.0f} model TFLOP/s; "
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


def run_recipes_apart(argv: list, names: list) -> tuple[int, dict]:
    """Each recipe in a process of its own: ``(returncode, runs)``. The TE ways need it: after a
    run, Megatron's DDP and distributed optimizer stay alive with the model (measured, megatron-core
    0.19.2: one more GPTModel and its optimizer state per recipe, however often gc runs), and at
    8B width a second model does not fit beside them."""
    import subprocess
    import tempfile

    import torch.distributed as dist

    env = dict(os.environ)
    if dist.is_initialized():
        env.pop("MASTER_PORT", None)  # this process listens there: each child picks a free port
    runs, header = {}, {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "run.json"
            # argparse keeps the last occurrence of an option: these override the caller's
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--recipes", name, "--out", str(part)]
            rc = subprocess.run(cmd, env=env).returncode
            if rc != 0:
                print(f"megatron_native_train: recipe {name} failed (exit {rc})", file=sys.stderr)
                return rc, {"runs": runs, **header}
            data = json.loads(part.read_text(encoding="utf-8"))
        runs[name] = data["runs"][name]
        header = {k: data[k] for k in ("torch", "megatron_core", "device")}
    return 0, {"runs": runs, **header}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.impl != "native":
        from nemo_fp8_recipes.integrations.te import te_available

        ok, why = te_available()
        if not ok or device.type != "cuda":
            print(
                f"megatron_native_train: --impl {args.impl} needs Transformer Engine on a CUDA GPU "
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
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    out = {"args": vars(args)}
    if args.impl != "native" and len(names) > 1 and args.steps > 0:
        rc, parts = run_recipes_apart(argv, names)
        out.update(parts)
        if rc != 0:
            return rc
    else:
        if device.type == "cuda":
            torch.cuda.set_device(0)
        init_megatron(device, args.seed)
        import megatron.core

        out.update(
            torch=torch.__version__,
            megatron_core=getattr(megatron.core, "__version__", "?"),
            device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            runs={},
        )
        for name in names:
            out["runs"][name] = train_one(args, name, device)
            # the last recipe's model, gradients and AdamW state sit in reference cycles (TE's and
            # Megatron's modules): collect them before the next build, or two 8B-width models meet
            # in memory (measured: out of memory on the second recipe at 16 layers on the H200)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.steps > 0:
        print(
            "\nrecipe       mode            params            first   last    falls  tok/s     TFLOP/s  "
            "fp8 modules  violations"
        )
        for name, r in out["runs"].items():
            a = r["audit"]
            print(
                f"{name:12s} {r['mode'][:15]:15s} {r['params']:16s}  {r['first_loss_mean']:.4f}  "
                f"{r['last_loss_mean']:.4f}  {str(r['loss_fell']):5s}  {r['tokens_per_s']:8.0f}  "
                f"{r['model_tflops_per_gpu']:7.1f}  {a['fp8_modules']:11d}  {len(a['violations'])}"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
