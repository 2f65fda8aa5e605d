"""Train one model with every recipe through the embedded trainer and tabulate tokens/s and loss.

One command runs the whole sweep in one process tree, so the ratios come from one machine and
one session:

    python benchmarks/train_throughput.py --model llama3_150m --steps 300 --seq-len 1024 \
        --micro-batch 8 --compile both --out results/train_throughput.json

Each run is a real ``python -m nemo_fp8_recipes.train`` (mxfp8 with ``recipe.emulate=true`` on
GPUs without MXFP8). Tokens/s is the median of the trainer's logged ``tokens_per_s`` over the
second half of the run (warm-up, compilation and the first validation excluded); loss is read
from the TensorBoard events. ``--smoke`` runs a tiny CPU version for CI (no timing claims).

Data-parallel scaling (``--nproc 1,2``): each recipe runs once per process count under
``torchrun`` with the same global batch (``--global-batch``, default micro-batch x the largest
count, so one process accumulates gradients over what the ranks run side by side). The table adds
the scaling efficiency (tokens/s over ``nproc`` x the 1-process tokens/s) and the largest relative
deviation of the per-step training loss from the 1-process run::

    python benchmarks/train_throughput.py --model llama3_150m --steps 60 --micro-batch 8 --nproc 1,2

CUDA graphs for the whole compiled model (``--compile compiled,graphs``): each recipe runs with
torch.compile's default mode and again with ``trainer.compile_mode=reduce-overhead`` (one GPU), and
"vs bf16" compares within a mode; where the host's launch overhead bounds a small model's step::

    python benchmarks/train_throughput.py --model llama3_150m --steps 100 --seq-len 1024 --micro-batch 8 \
        --compile compiled,graphs --recipes bf16,tensorwise,blockwise,delayed

The cost of ``trainer.deterministic=true`` (``--deterministic both``): each recipe and mode runs
without and then with deterministic kernels, one after the other, and a table gives the
deterministic run's tokens/s over the default's (its losses repeat bit for bit; the default's do
not)::

    python benchmarks/train_throughput.py --model llama3_150m --steps 100 --seq-len 1024 --micro-batch 16 \
        --compile compiled --recipes bf16,tensorwise,blockwise --deterministic both

The trainer's two backends side by side (``--backends native,te``): every recipe also runs with
``backend=te`` (Transformer Engine modules, eager; mxfp8 left out on Hopper), a table gives native /
TE tokens/s and both final losses per recipe, and ``nemo-fp8-compare`` overlays all the runs' loss
curves against the native BF16 run (``<root>/<model>/compare/``)::

    python benchmarks/train_throughput.py --model llama3_150m --steps 30 --seq-len 1024 --micro-batch 8 \
        --compile compiled --recipes bf16,tensorwise,blockwise,delayed --backends native,te

Megatron-Core + Transformer Engine beside it (``--megatron-te``): after the embedded trainer's runs,
the same model shape, sequence, micro-batch and micro-batches per step train as a Megatron-Core
``GPTModel`` with the TE layer spec as Megatron trains it (``benchmarks/megatron_native_train.py
--impl te``: BF16 parameters, Megatron's DDP and distributed optimizer with FP32 master weights,
its forward-backward schedule, which re-quantises the weights once per step; strict audit), one
run per recipe (``--megatron-main-grads bf16,fp32``: once with the BF16 main gradients of Bridge's
performance recipes and once with the FP32 ones of its default recipes); the table adds its tokens/s,
step time and peak memory, and ours / TE. The
end-to-end comparison of the docs (8B width, 16 layers, sequence 4096, four micro-batches)::

    python benchmarks/train_throughput.py --model llama3_8b --steps 30 --seq-len 4096 --micro-batch 1 \
        --global-batch 4 --compile compiled --recipes bf16,delayed,tensorwise,blockwise --megatron-te \
        --out results/e2e_8b16.json model.num_layers=16

Megatron-Bridge's own ``pretrain()`` beside it (``--bridge``): the same shapes through our Bridge
launcher (one process under ``torchrun``, the model built offline, mock data) with Bridge's H100
Llama 3 8B performance settings (``backend.perf=llama3_8b_h100``, docs/megatron.md), one run per
Hopper recipe; the table adds Bridge's tokens/s (from its logged iteration time), its model
TFLOP/s/GPU (Bridge's formula, as it logs it), both peak memories and ours / Bridge::

    python benchmarks/train_throughput.py --model llama3_8b --steps 60 --seq-len 4096 --micro-batch 1 \
        --global-batch 4 --compile compiled --recipes bf16,tensorwise,blockwise,delayed --bridge \
        --out results/e2e_8b8_bridge.json model.num_layers=8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

RECIPES = ["bf16", "delayed", "tensorwise", "blockwise", "mxfp8"]
MODES = ("eager", "compiled", "graphs")
BACKENDS = ("native", "te")
DETERMINISTIC = {"off": (False,), "on": (True,), "both": (False, True)}


def read_scalars(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_one(
    args, recipe: str, mode: str, root: Path, nproc: int = 1, backend: str = "native", deterministic: bool = False
) -> dict:
    """One trainer run; ``mode``: eager, compiled (torch.compile's default mode) or graphs
    (``trainer.compile_mode=reduce-overhead``: the compiled graphs replayed as CUDA graphs);
    ``deterministic``: with ``trainer.deterministic=true``."""
    from nemo_fp8_recipes.config import override_value

    compile_ = mode != "eager"
    tag = (
        ("te-" if backend == "te" else "")
        + mode
        + (f"-dp{nproc}" if args.nproc_list != [1] else "")
        + ("-det" if deterministic else "")
    )
    overrides = [
        f"backend={backend}",
        f"recipe={recipe}",
        f"model={args.model}",
        f"trainer.max_steps={args.steps}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={args.global_batch or args.micro_batch}",
        f"trainer.compile={str(compile_).lower()}",
        *(["trainer.compile_mode=reduce-overhead"] if mode == "graphs" else []),
        f"trainer.deterministic={str(deterministic).lower()}",
        f"trainer.val_interval={args.steps}",
        "trainer.checkpoint=false",  # (a throughput run needs no checkpoint: 21 GB for a 4-layer 8B)
        "trainer.progress=false",
        f"trainer.log_interval={max(1, args.steps // 30)}",
        f"trainer.telemetry_interval={args.telemetry_interval}",
        f"run.root={override_value(root)}",
        f"run.tag={tag}",
        "trainer.resume=never",
    ] + list(args.extra)
    if recipe == "mxfp8" and args.emulate_mxfp8:
        overrides.append("recipe.emulate=true")
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "-m", "nemo_fp8_recipes.train", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    run_dir = root / args.model / f"{recipe}-{tag}"
    res = {
        "recipe": recipe,
        "backend": backend,
        "compile": compile_,
        "mode": mode,
        "nproc": nproc,
        "deterministic": deterministic,
        "wall_s": round(wall, 1),
        "run_dir": str(run_dir),
        "returncode": proc.returncode,
        "cmd": " ".join(cmd),
    }
    if proc.returncode != 0:
        res["error"] = (proc.stderr or proc.stdout)[-3000:]
        return res
    sc = read_scalars(run_dir)
    tps = [v for s, v in sc.get("tokens_per_s", []) if s > args.steps // 2]
    loss = sc.get("train/loss", [])
    val = sc.get("val/loss", [])
    summary = run_dir / "summary.json"
    if summary.exists():  # (graphs: how many compiled graphs ran without CUDA graphs; 0 = all captured)
        done = json.loads(summary.read_text())
        res["cuda_graph_skips"] = done.get("cuda_graph_skips")
        res["peak_memory_gib"] = done.get("peak_memory_gib")  # (torch.cuda.max_memory_allocated; None on CPU)
    res.update(
        {
            "tokens_per_s": statistics.median(tps) if tps else None,
            "first_loss": loss[0][1] if loss else None,
            "last_loss": statistics.mean(v for _, v in loss[-3:]) if loss else None,
            "val_loss": val[-1][1] if val else None,
            "loss_steps": sc.get("train/loss_step", []),
            "mfu": statistics.median(v for s, v in sc.get("perf/mfu", []) if s > args.steps // 2)
            if sc.get("perf/mfu")
            else None,
        }
    )
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_150m")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated registry keys")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--compile",
        default="eager",
        help="comma list of trainer modes: eager, compiled (torch.compile, default mode), graphs "
        "(compiled with trainer.compile_mode=reduce-overhead: every compiled graph replayed as a "
        "CUDA graph, one GPU); both = eager,compiled (default %(default)s)",
    )
    p.add_argument("--telemetry-interval", type=int, default=0)
    p.add_argument(
        "--emulate-mxfp8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run mxfp8 with recipe.emulate=true (needed on Hopper)",
    )
    p.add_argument("--root", default="runs/bench")
    p.add_argument("--out", default=None, help="write results as JSON here")
    p.add_argument(
        "--nproc", default="1", help="comma-separated process counts (one GPU each under torchrun), e.g. 1,2"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: micro-batch x the largest --nproc)",
    )
    p.add_argument(
        "--megatron-te",
        action="store_true",
        help="also train the same shapes as Megatron-Core + Transformer Engine (one run per recipe)",
    )
    p.add_argument(
        "--megatron-main-grads",
        default="bf16",
        help="main-gradient precision of the Megatron-Core + TE runs, a comma list: bf16 (Bridge's performance "
        "recipes, grad_reduce_in_fp32=False), fp32 (Megatron-Bridge's default recipes); each recipe runs once per "
        "entry (default %(default)s)",
    )
    p.add_argument(
        "--bridge",
        action="store_true",
        help="also train the same shapes with Megatron-Bridge's pretrain() through our launcher, with "
        "Bridge's H100 Llama 3 8B performance settings (backend.perf=llama3_8b_h100; one run per Hopper recipe)",
    )
    p.add_argument(
        "--bridge-fp8-param-gather",
        choices=("preset", "true", "false"),
        default="preset",
        help="FP8 primary weights in the Bridge runs: as Bridge's mixed-precision preset of the recipe sets them "
        "(preset: on for tensorwise and delayed, off for blockwise), or on / off for every FP8 recipe",
    )
    p.add_argument(
        "--backends",
        default="native",
        help="comma-separated trainer backends: native, te (Transformer Engine modules, eager; "
        "Hopper recipes). With both, a table puts them side by side per recipe and "
        "nemo-fp8-compare overlays their loss curves",
    )
    p.add_argument(
        "--deterministic",
        choices=DETERMINISTIC,
        default="off",
        help="trainer.deterministic for every run (off, on), or both: each run without, then with it, "
        "and a table of the cost (default %(default)s)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU run for CI: 3 steps, tiny model")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.seq_len, args.micro_batch = "llama3_tiny", 4, 64, 2
        args.extra = list(args.extra) + ["model.num_layers=1", "data.max_files=20", "trainer.device=cpu"]
    args.nproc_list = sorted({int(n) for n in str(args.nproc).split(",")})
    args.megatron_main_grads_list = [g.strip() for g in args.megatron_main_grads.split(",") if g.strip()]
    bad = [g for g in args.megatron_main_grads_list if g not in ("bf16", "fp32")]
    if bad or not args.megatron_main_grads_list:
        p.error(f"unknown --megatron-main-grads {', '.join(bad) or '(empty)'}; valid: bf16, fp32")
    if args.global_batch is None:
        args.global_batch = args.micro_batch * max(args.nproc_list)
    if args.smoke and max(args.nproc_list) > 1:
        args.extra = list(args.extra) + ["trainer.log_interval=1"]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; valid: {', '.join(BACKENDS)}")
    modes = [m.strip() for m in ("eager,compiled" if args.compile == "both" else args.compile).split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown --compile mode {m!r}; valid: {', '.join(MODES)}, both")
    root = Path(args.root)
    results = []
    recipes = args.recipes.split(",")
    dets = DETERMINISTIC[args.deterministic]
    runs = [
        ("native", c, recipe, n, d)
        for c in modes
        for recipe in recipes
        for n in args.nproc_list
        for d in dets
        if "native" in backends
    ]
    # Transformer Engine's modules run eager (the trainer refuses trainer.compile=true with them);
    # mxfp8 has no TE GEMMs on Hopper, so it runs on the native backend only
    runs += [
        ("te", "eager", recipe, n, d)
        for recipe in recipes
        for n in args.nproc_list
        for d in dets
        if "te" in backends and recipe != "mxfp8"
    ]
    for backend, mode, recipe, nproc, det in runs:
        r = run_one(args, recipe, mode, root, nproc, backend, det)
        results.append(r)
        write_out(args, results)  # (after every run: a sweep cut short keeps what it measured)
        status = "ok" if r["returncode"] == 0 else "FAILED"
        print(
            f"[{status}] {backend:<6} {recipe:<11} {mode:<9} x{nproc}{' det' if det else ''} "
            f"wall {r['wall_s']:>6}s "
            f"tok/s {r.get('tokens_per_s') or 0:>10.0f}  loss {r.get('first_loss') or 0:.3f} -> "
            f"{r.get('last_loss') or 0:.3f}"
            + (f"  graphs run without CUDA graphs: {r['cuda_graph_skips']}" if r.get("cuda_graph_skips") else ""),
            flush=True,
        )
        if r["returncode"] != 0:
            print(r["error"], file=sys.stderr)

    def key(r) -> tuple:
        return r["backend"], r["recipe"], r["mode"], r["deterministic"]

    single = {key(r): r for r in results if r["nproc"] == 1}
    for r in results:  # data-parallel scaling against the 1-process run of the same recipe/mode
        one = single.get(key(r))
        if r["nproc"] > 1 and one and r.get("tokens_per_s") and one.get("tokens_per_s"):
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["nproc"] * one["tokens_per_s"])
            ref = dict(one.get("loss_steps", []))
            devs = [abs(v - ref[s]) / abs(ref[s]) for s, v in r.get("loss_steps", []) if ref.get(s)]
            r["max_rel_loss_dev_vs_1proc"] = max(devs) if devs else None
    flops = megatron_flops_per_token(args)
    for r in results:
        if r.get("tokens_per_s"):  # per GPU, as Bridge reports it
            r["model_tflops_per_gpu"] = r["tokens_per_s"] * flops / 1e12 / r["nproc"]
    base = {
        (r["backend"], r["mode"], r["nproc"], r["deterministic"]): r.get("tokens_per_s")
        for r in results
        if r["recipe"] == "bf16"
    }
    print(
        "\n| backend | recipe | mode | procs | deterministic | tokens/s | vs bf16 | model TFLOP/s/GPU | MFU | peak GiB "
        "| loss first -> last | val loss | DP efficiency | loss dev vs 1 proc |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r.get("tokens_per_s")
        b = base.get((r["backend"], r["mode"], r["nproc"], r["deterministic"]))
        ratio = f"{t / b:.2f}x" if t and b else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        peak = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") is not None else "-"
        eff = f"{r['scaling_efficiency']:.1%}" if r.get("scaling_efficiency") else "-"
        dev = f"{r['max_rel_loss_dev_vs_1proc']:.1e}" if r.get("max_rel_loss_dev_vs_1proc") is not None else "-"
        emulated = " (emulated)" if r["recipe"] == "mxfp8" and args.emulate_mxfp8 else ""
        print(
            f"| {r['backend']} | {r['recipe']}{emulated} | "
            f"{r['mode']} | {r['nproc']} | {'on' if r['deterministic'] else 'off'} | "
            f"{t or 0:.0f} | {ratio} | {r.get('model_tflops_per_gpu') or 0:.0f} | {mfu} | {peak} | "
            f"{r.get('first_loss') or float('nan'):.3f} -> {r.get('last_loss') or float('nan'):.3f} | "
            f"{r.get('val_loss') or float('nan'):.3f} | {eff} | {dev} |"
        )
    cost = deterministic_cost(results) if args.deterministic == "both" else []
    compared = compare_backends(results, root, args) if len(backends) > 1 else {}
    te_rows: list = []
    bridge_rows: list = []

    def save() -> None:  # after every Megatron-Core or Bridge row too: a sweep cut short keeps them
        write_out(args, results, backends=compared, megatron_te=te_rows, bridge=bridge_rows, deterministic_cost=cost)

    if args.megatron_te:
        run_megatron_te(args, root, te_rows, save)
    if te_rows:
        print_te_table([r for r in results if r["backend"] == "native"], te_rows)
    if args.bridge:
        run_bridge(args, root, bridge_rows, save)
    if bridge_rows:
        print_bridge_table([r for r in results if r["backend"] == "native"], bridge_rows)
    save()
    return (
        0
        if (
            all(r["returncode"] == 0 for r in results)
            and all(r.get("ok", True) for r in te_rows)
            and all(r.get("ok", True) for r in bridge_rows)
            and compared.get("returncode", 0) == 0
        )
        else 1
    )


def deterministic_cost(results: list) -> list:
    """``--deterministic both``: per backend, recipe, mode and process count, the deterministic
    run's tokens/s over the default run's (< 1: deterministic kernels cost that fraction)."""
    pairs: dict = {}
    for r in results:
        pairs.setdefault((r["backend"], r["recipe"], r["mode"], r["nproc"]), {})[r["deterministic"]] = r
    rows = []
    print("\n| backend | recipe | mode | procs | tokens/s default | tokens/s deterministic | deterministic / default |")
    print("|---|---|---|---|---|---|---|")
    for (backend, recipe, mode, nproc), by in pairs.items():
        off, on = (by.get(False) or {}).get("tokens_per_s"), (by.get(True) or {}).get("tokens_per_s")
        ratio = on / off if on and off else None
        rows.append(
            {
                "backend": backend,
                "recipe": recipe,
                "mode": mode,
                "nproc": nproc,
                "tokens_per_s_default": off,
                "tokens_per_s_deterministic": on,
                "deterministic_over_default": ratio,
            }
        )
        print(
            f"| {backend} | {recipe} | {mode} | {nproc} | {off or 0:.0f} | {on or 0:.0f} | "
            + (f"{ratio:.3f}x |" if ratio else "- (a run failed) |")
        )
    return rows


def write_out(args, results: list, **more) -> None:
    """``--out``: the arguments, the runs so far and any further tables, as JSON."""
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, **more}, f, indent=2)


def compare_backends(results: list, root: Path, args) -> dict:
    """The native backend (its last mode run) beside the TE backend, per recipe (one process), and
    ``nemo-fp8-compare`` over every run of both (baseline: the native BF16 run), which writes the
    overlaid curves (``compare.png``) and the deviation table under ``<root>/<model>/compare``."""
    by = {}
    for r in results:
        if r["nproc"] == 1 and r["returncode"] == 0:
            by[(r["backend"], r["recipe"])] = r

    def cell(v, f=".0f"):
        return "-" if v is None else format(v, f)

    print("\n| recipe | native tok/s | te tok/s | native / te | native loss (last) | te loss (last) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in results):
        n, t = by.get(("native", recipe)), by.get(("te", recipe))
        if not n and not t:
            continue
        nt, tt = (n or {}).get("tokens_per_s"), (t or {}).get("tokens_per_s")
        rows.append(
            {
                "recipe": recipe,
                "native_tokens_per_s": nt,
                "te_tokens_per_s": tt,
                "native_over_te": nt / tt if nt and tt else None,
                "native_last_loss": (n or {}).get("last_loss"),
                "te_last_loss": (t or {}).get("last_loss"),
            }
        )
        ratio = cell(nt / tt if nt and tt else None, ".2f") + ("x" if nt and tt else "")
        print(
            f"| {recipe} | {cell(nt)} | {cell(tt)} | {ratio} | "
            f"{cell((n or {}).get('last_loss'), '.3f')} | {cell((t or {}).get('last_loss'), '.3f')} |"
        )
    dirs = [r["run_dir"] for r in by.values()]
    if len(dirs) < 2:
        return {"rows": rows}
    out = root / args.model / "compare"
    base = by.get(("native", "bf16"), next(iter(by.values())))["run_dir"]
    cmd = [
        sys.executable,
        "-m",
        "nemo_fp8_recipes.compare",
        *dirs,
        "--baseline",
        base,
        "--out",
        str(out),
        "--last",
        str(max(1, args.steps // 2)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-4000:], flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return {"rows": rows, "compare_cmd": " ".join(cmd), "compare_dir": str(out), "returncode": proc.returncode}


def _model_overrides(args) -> list:
    """The ``model.*`` overrides among ``extra`` (every system of the sweep builds the same shape)."""
    return [e for e in args.extra if e.split("=", 1)[0].startswith("model.")]


def _model_config(args):
    """``--model`` with the ``model.*`` overrides of ``extra``, as the trainer builds it."""
    from omegaconf import OmegaConf

    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.models import ModelConfig

    m = compose_config([f"model={args.model}", *_model_overrides(args)]).model
    return ModelConfig.from_dict(OmegaConf.to_container(m, resolve=True))


def megatron_flops_per_token(args) -> float:
    """Model FLOPs per token of the swept model at ``--seq-len`` by Megatron-LM's and
    Megatron-Bridge's formula (:meth:`~nemo_fp8_recipes.models.ModelConfig.megatron_flops_per_token`),
    so every row's model TFLOP/s compares with what Bridge logs and publishes."""
    return _model_config(args).megatron_flops_per_token(args.seq_len)


def _model_shape(args) -> dict:
    """Layers, width, heads and vocabulary of the swept model."""
    m = _model_config(args)
    return {
        "layers": m.num_layers,
        "hidden": m.dim,
        "ffn": m.ffn_dim,
        "heads": m.num_heads,
        "kv_heads": m.num_kv_heads,
        "vocab": m.vocab_size,
    }


def run_megatron_te(args, root: Path, rows: list, saved: Callable[[], None]) -> list:
    """One ``megatron_native_train.py --impl te`` run per recipe (mxfp8 left out: Hopper has no
    MXFP8 GEMMs in TE), appended to ``rows`` (``saved()`` after each); rows say why they were
    skipped where TE does not run."""
    from nemo_fp8_recipes.integrations.te import te_available

    ok, why = te_available()
    recipes = [r for r in args.recipes.split(",") if r != "mxfp8"]
    if not ok:
        rows.extend(
            {"recipe": r, "main_grad": g, "ok": True, "status": f"skipped: Transformer Engine not importable ({why})"}
            for g in args.megatron_main_grads_list
            for r in recipes
        )
        saved()
        return rows
    shape = _model_shape(args)
    micro = max(1, (args.global_batch or args.micro_batch) // args.micro_batch)
    for recipe, main_grad in [(r, g) for g in args.megatron_main_grads_list for r in recipes]:
        out = root / (f"megatron_te_{recipe}.json" if main_grad == "bf16" else f"megatron_te_{recipe}_fp32grad.json")
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("megatron_native_train.py")),
            "--impl",
            "te",
            "--recipes",
            recipe,
            "--steps",
            str(args.steps),
            "--seq",
            str(args.seq_len),
            "--micro-batch",
            str(args.micro_batch),
            "--micro-batches",
            str(micro),
            "--data",
            "random",
            "--first-layers-bf16",
            "0",
            "--last-layers-bf16",
            "0",
            "--log-interval",
            str(max(1, args.steps // 10)),
            "--layers",
            str(shape["layers"]),
            "--hidden",
            str(shape["hidden"]),
            "--ffn",
            str(shape["ffn"]),
            "--heads",
            str(shape["heads"]),
            "--kv-heads",
            str(shape["kv_heads"]),
            "--vocab",
            str(shape["vocab"]),
            "--out",
            str(out),
        ] + (["--grad-reduce-in-fp32"] if main_grad == "fp32" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        row = {"recipe": recipe, "main_grad": main_grad, "cmd": " ".join(cmd), "ok": proc.returncode == 0}
        if proc.returncode == 0:
            r = json.loads(out.read_text())["runs"][recipe]
            row.update(
                {
                    k: r.get(k)
                    for k in (
                        "tokens_per_s",
                        "step_ms_median",
                        "peak_gib",
                        "first_loss_mean",
                        "last_loss_mean",
                        "audit",
                    )
                }
            )
            row["status"] = "ok"
        else:
            row["status"] = "failed"
            row["error"] = (proc.stderr or proc.stdout)[-3000:]
            print(row["error"], file=sys.stderr)
        rows.append(row)
        saved()
        print(
            f"[{row['status']}] Megatron-Core + TE {recipe:<11} {main_grad} main grads "
            f"tok/s {row.get('tokens_per_s') or 0:>10.0f}",
            flush=True,
        )
    return rows


_BRIDGE_ITER = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
    r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|)?(?:.*?lm loss: ([\d.Ee+-]+) \|)?"
)


def parse_bridge_log(text: str) -> list:
    """``[(iteration, ms, tflops or None, loss or None)]`` from Megatron-Bridge's per-iteration log
    lines (``training/utils/train_utils.py: training_log``)."""
    rows = []
    for m in _BRIDGE_ITER.finditer(text):
        it, ms, tf, loss = m.groups()
        rows.append((int(it), float(ms), float(tf) if tf else None, float(loss) if loss else None))
    return rows


def run_bridge(args, root: Path, rows: list, saved: Callable[[], None]) -> list:
    """One Megatron-Bridge ``pretrain()`` run per Hopper recipe through our launcher
    (``python -m nemo_fp8_recipes.integrations.bridge``, one process under ``torchrun``): the
    model built offline from ``--model`` and its ``model.*`` overrides, the same sequence,
    micro-batch and global batch as the trainer's runs, mock data, Bridge's H100 Llama 3 8B
    performance settings (``backend.perf=llama3_8b_h100``; FP8 primary weights where Bridge's
    preset keeps them), strict audit. Tokens/s from Bridge's logged iteration time (median over the
    second half), model TFLOP/s/GPU as Bridge logs it (its formula), peak memory from the
    launcher's ``summary.json``. Rows are appended to ``rows`` (``saved()`` after each); each keeps
    every iteration's time (``iteration_ms``: warm-up visible) and the path of the run's whole
    output (``log``: ``bridge.log`` in its run directory)."""
    from nemo_fp8_recipes.config import override_value

    recipes = [r for r in args.recipes.split(",") if r != "mxfp8"]
    gbs = args.global_batch or args.micro_batch
    for recipe in recipes:
        fp8_param_gather = None if recipe == "bf16" else args.bridge_fp8_param_gather
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "nemo_fp8_recipes.integrations.bridge",
            "backend=megatron_bridge",
            "backend.provider=ours",
            "backend.perf=llama3_8b_h100",
            "backend.strict_audit=true",
            *([f"backend.fp8_param_gather={fp8_param_gather}"] if fp8_param_gather not in (None, "preset") else []),
            f"recipe={recipe}",
            f"model={args.model}",
            *_model_overrides(args),
            f"trainer.max_steps={args.steps}",
            f"trainer.seq_len={args.seq_len}",
            f"trainer.micro_batch_size={args.micro_batch}",
            f"trainer.global_batch_size={gbs}",
            f"trainer.val_interval={args.steps}",
            "trainer.val_steps=1",
            "trainer.checkpoint=false",
            "trainer.log_interval=1",
            f"run.root={override_value(root)}",
            "logger.log_throughput=true",
        ]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = (proc.stdout or "") + (proc.stderr or "")
        row = {"recipe": recipe, "cmd": " ".join(cmd), "ok": proc.returncode == 0, "wall_s": round(time.time() - t0, 1)}
        row["fp8_param_gather"] = fp8_param_gather
        parsed = parse_bridge_log(text)
        its = [r for r in parsed if r[0] > args.steps // 2]
        m = re.search(r"run directory: (.+?)(?: \(TensorBoard events[^\n]*)?$", text, re.MULTILINE)
        run_dir = Path(m.group(1)) if m and Path(m.group(1)).is_dir() else None
        summary = run_dir / "summary.json" if run_dir is not None else None
        log = run_dir / "bridge.log" if run_dir is not None else root / f"bridge-{recipe}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text, encoding="utf-8")
        row["log"] = str(log)
        row["iteration_ms"] = [[it, ms] for it, ms, _, _ in parsed]
        if proc.returncode == 0 and its:
            ms = statistics.median(r[1] for r in its)
            tfs = [r[2] for r in its if r[2] is not None]
            losses = [r[3] for r in its if r[3] is not None]
            row.update(
                {
                    "status": "ok",
                    "step_ms_median": ms,
                    "tokens_per_s": gbs * args.seq_len * 1000.0 / ms,
                    "model_tflops_per_gpu": statistics.median(tfs) if tfs else None,
                    "last_loss": losses[-1] if losses else None,
                    "iterations_timed": len(its),
                    "peak_gib": json.loads(summary.read_text()).get("peak_memory_gib")
                    if summary is not None and summary.is_file()
                    else None,
                }
            )
        else:
            row["ok"] = False
            row["status"] = "failed" if proc.returncode else "no iteration lines in the log"
            row["error"] = text[-3000:]
            print(row["error"], file=sys.stderr)
        rows.append(row)
        saved()
        print(f"[{row['status']}] Megatron-Bridge {recipe:<11} tok/s {row.get('tokens_per_s') or 0:>10.0f}", flush=True)
    return rows


def print_bridge_table(results: list, rows: list) -> None:
    """Ours (the last mode run, one process) beside Megatron-Bridge's ``pretrain()``."""
    ours = {r["recipe"]: r for r in results if r["nproc"] == 1 and r.get("tokens_per_s")}
    print(
        "\n| recipe | embedded trainer tok/s | its model TFLOP/s/GPU | Megatron-Bridge tok/s "
        "| Bridge model TFLOP/s/GPU (as logged) | Bridge step ms | Bridge peak GiB | ours peak GiB | ours / Bridge |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        o = ours.get(row["recipe"], {})
        t = row.get("tokens_per_s")
        if t is None:
            print(
                f"| {row['recipe']} | {o.get('tokens_per_s') or 0:.0f} | {o.get('model_tflops_per_gpu') or 0:.0f} | "
                f"{row['status']} | - | - | - | - | - |"
            )
            continue
        op = o.get("peak_memory_gib")
        print(
            f"| {row['recipe']} | {o.get('tokens_per_s') or 0:.0f} | "
            f"{o.get('model_tflops_per_gpu') or 0:.0f} | {t:.0f} | "
            f"{row.get('model_tflops_per_gpu') or 0:.0f} | "
            f"{row['step_ms_median']:.0f} | {row.get('peak_gib') or 0:.1f} | {op or 0:.1f} | "
            f"{(o.get('tokens_per_s') or 0) / t:.2f}x |"
        )


def print_te_table(results: list, te_rows: list) -> None:
    """Ours (the last mode run, one process) beside Megatron-Core + TE (one row per recipe and
    main-gradient precision), with the ratios; "vs its bf16" within the same main gradients."""
    ours = {}
    for r in results:
        if r["nproc"] == 1 and r.get("tokens_per_s"):
            ours[r["recipe"]] = r
    te = {(r["recipe"], r.get("main_grad", "bf16")): r for r in te_rows if r.get("tokens_per_s")}
    print(
        "\n| recipe | embedded trainer tok/s | vs its bf16 | Megatron-Core + TE main grads | tok/s | vs its bf16 | "
        "TE step ms | TE peak GiB | ours / TE |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ob = ours.get("bf16", {}).get("tokens_per_s")
    for row in te_rows:
        k, g = row["recipe"], row.get("main_grad", "bf16")
        o = ours.get(k, {}).get("tokens_per_s")
        t, tb = te.get((k, g), {}).get("tokens_per_s"), te.get(("bf16", g), {}).get("tokens_per_s")
        mine = f"| {k} | {o or 0:.0f} | {o / ob if o and ob else 0:.2f}x | {g} |"
        if t is None:
            print(f"{mine} {row['status']} | - | - | - | - |")
            continue
        print(
            f"{mine} {t:.0f} | {t / tb if tb else 0:.2f}x | "
            f"{row.get('step_ms_median') or 0:.0f} | {row.get('peak_gib') or 0:.1f} | "
            f"{o / t if o else 0:.2f}x |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
