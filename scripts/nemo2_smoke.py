#!/usr/bin/env python3
"""NeMo 2 smoke run: ``llm.pretrain`` on a tiny Llama with mock data, on one GPU, offline, once per
recipe, with this package's ``MegatronMixedPrecision`` plugin and strict-audit Lightning callback.

Each recipe runs in its own process (NeMo and Megatron keep global state) and logs TensorBoard
through ``NeMoLogger`` into ``<root>/<recipe>``; the script then compares the loss curves with
``nemo-fp8-compare`` (NeMo 2 logs the loss as ``reduced_train_loss``).

What it checks, per run: NeMo builds the model and trains ``--steps`` steps; the callback's audit
saw TE modules and, for an FP8 recipe, at least one ran in FP8 and none the policy keeps in high
precision did (strict); for bf16, none ran in FP8. Files per run: TensorBoard events,
``audit.txt`` / ``audit.json``, ``smoke.json`` (versions, device, losses, time), ``smoke.log``
(the whole NeMo output).

Recipes: NeMo 2.7.3 has presets for bf16, delayed (``bf16_with_fp8_mixed``), tensorwise
(``bf16_with_fp8_current_scaling_mixed``), blockwise (``bf16_with_fp8_subchannel_scaling_mixed``)
and mxfp8 (``bf16_with_mxfp8_mixed``); megatron-core 0.15.3 builds tensorwise with Transformer
Engine >= 2.2 and blockwise with >= 2.3. The Hopper set (the default) is bf16, delayed,
tensorwise, blockwise; mxfp8 needs Blackwell and is refused on Hopper, as is a recipe the
installed NeMo / megatron-core / TE cannot build.

Environment (NeMo 2 cannot share one with Megatron-Bridge): ``scripts/nemo2_prepare.sh`` here,
then on the GPU machine, with Transformer Engine installed, ``bash .nemo2/install.sh DIR`` and
``export PYTHONPATH=DIR:$PYTHONPATH`` (docs/megatron.md, "How to run it on a GPU").

Without a GPU it goes as far as NeMo gets (imports, plugin, model construction), stops at the
first CUDA call and says so (exit status 3): a check of the install, not a run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("nemo_fp8_recipes") is None:
    sys.path.insert(0, str(REPO))

# Recipe key -> NeMo 2.7.3's preset in nemo/collections/llm/recipes/precision/mixed_precision.py.
NEMO2_PRESETS = {
    "bf16": "bf16_mixed",
    "delayed": "bf16_with_fp8_mixed",
    "tensorwise": "bf16_with_fp8_current_scaling_mixed",
    "blockwise": "bf16_with_fp8_subchannel_scaling_mixed",
    "mxfp8": "bf16_with_mxfp8_mixed",
}
HOPPER_RECIPES = ("bf16", "delayed", "tensorwise", "blockwise")
LOSS_TAG = "reduced_train_loss"
PREFIX = "[nemo2_smoke]"
PREPARE_HINT = (
    "prepare it with scripts/nemo2_prepare.sh (from the project root; it fills .nemo2/), then "
    "`bash .nemo2/install.sh DIR` and `export PYTHONPATH=DIR:$PYTHONPATH` (NeMo's folder first)"
)
NO_GPU_HINT = (
    "nemo2_smoke needs one CUDA GPU (Hopper, sm_90, for the FP8 recipes); run it on the GPU machine "
    "(docs/megatron.md, 'How to run it on a GPU')"
)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3

# Model and batch: small enough for seconds per run, FP8-friendly (every GEMM dim a multiple of 128).
SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH, VOCAB = 256, 2, 4, 1024


def say(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_versions() -> Dict[str, Optional[str]]:
    """Installed versions of the packages this run depends on (None: absent)."""
    return {
        "nemo_toolkit": _version("nemo_toolkit"),
        "megatron-core": _version("megatron-core") or _version("megatron_core"),
        "transformer_engine": _version("transformer_engine") or _version("transformer-engine"),
        "lightning": _version("lightning"),
        "torch": _version("torch"),
    }


def nemo_install_problem(versions: Dict[str, Optional[str]]) -> Optional[str]:
    """Why the installed stack cannot run NeMo 2's ``llm.pretrain`` (None: it looks right)."""
    from nemo_fp8_recipes.versions import version_tuple

    nemo = versions.get("nemo_toolkit")
    if nemo is None:
        return f"NeMo 2 (nemo_toolkit 2.x) is not installed here; {PREPARE_HINT}"
    if not (2, 3) <= version_tuple(nemo) < (2, 8):
        return (
            f"nemo_toolkit {nemo} is installed; this smoke run needs NeMo 2 with FP8 recipes, 2.3 to 2.7 "
            f"(3.x has no nemo.collections.llm); {PREPARE_HINT}"
        )
    mcore = versions.get("megatron-core")
    if mcore is None:
        return f"megatron-core is not installed (NeMo 2.7 trains with 0.15.x); {PREPARE_HINT}"
    if version_tuple(mcore) >= (0, 17):
        return (
            f"megatron-core {mcore} is installed; nemo.collections.llm 2.7 needs 0.15.x (0.17 removed a module it "
            f"imports; a Megatron-Bridge install must come after NeMo's folder on PYTHONPATH); {PREPARE_HINT}"
        )
    if version_tuple(mcore) >= (0, 16):
        return (
            f"megatron-core {mcore} is installed; NeMo 2.7's optimizer setup passes no_weight_decay_cond to "
            f"get_megatron_optimizer, which megatron-core 0.16 removed (the model builds, training stops with a "
            f"TypeError): install megatron-core 0.15.x; {PREPARE_HINT}"
        )
    return None


def recipe_problem(key: str, versions: Dict[str, Optional[str]]) -> Optional[str]:
    """Why the installed NeMo / megatron-core / TE cannot run ``key`` (None: they can). The GPU
    check is separate (:func:`nemo_fp8_recipes.check_supported`, in the run itself)."""
    if key not in NEMO2_PRESETS:
        return f"NeMo 2 has no preset for {key!r}; it offers {', '.join(NEMO2_PRESETS)}"
    te = versions.get("transformer_engine")
    if te is None:
        return (
            "the run needs Transformer Engine (NeMo's TE layers, which the audit checks): run "
            "`bash .te/install.sh` first (shared/device/te/prepare.sh)"
        )
    if key == "bf16":
        return None
    from nemo_fp8_recipes import get_recipe
    from nemo_fp8_recipes.integrations.validate_checks import te_min_version
    from nemo_fp8_recipes.versions import version_tuple

    need = te_min_version(get_recipe(key))
    if version_tuple(te) < need:
        return f"megatron-core builds {key} only with Transformer Engine >= {'.'.join(map(str, need))}; found {te}"
    return None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="nemo2_smoke.py",
        description=(
            "NeMo 2 smoke run on one GPU: llm.pretrain of a tiny Llama (2 layers, hidden 256, mock data, "
            "offline) per recipe, with nemo_fp8_recipes' MegatronMixedPrecision plugin and its strict "
            "precision-audit callback; TensorBoard into ROOT/<recipe>, then nemo-fp8-compare over the runs."
        ),
        epilog=(
            "Recipes NeMo 2.7 offers: bf16, delayed, tensorwise, blockwise (Hopper) and mxfp8 (Blackwell only). "
            "Set up: scripts/nemo2_prepare.sh here; on the GPU machine, with Transformer Engine installed, "
            "`bash .nemo2/install.sh DIR && export PYTHONPATH=DIR:$PYTHONPATH`. Exit status: 0 all runs "
            "passed, 1 a run failed, 2 usage or a refused recipe, 3 no GPU (stopped at the first CUDA call)."
        ),
    )
    p.add_argument(
        "--recipes",
        default=",".join(HOPPER_RECIPES),
        help=f"comma-separated recipe keys, run in this order (default: {','.join(HOPPER_RECIPES)})",
    )
    p.add_argument("--steps", type=int, default=20, help="training steps per recipe (default 20)")
    p.add_argument(
        "--root", default="runs/nemo2_smoke", help="run directories go to ROOT/<recipe> (default %(default)s)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run directory that already holds a run")
    p.add_argument("--verbose", action="store_true", help="stream NeMo's whole output (it always goes to smoke.log)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _recipes(spec: str) -> List[str]:
    from nemo_fp8_recipes import list_recipes

    keys = [k.strip() for k in spec.split(",") if k.strip()]
    if not keys:
        raise ValueError("--recipes is empty; give e.g. --recipes bf16,tensorwise")
    for k in keys:
        if k not in list_recipes():
            raise ValueError(f"unknown recipe {k!r}; the recipes are {', '.join(list_recipes())}")
        if k not in NEMO2_PRESETS:
            raise ValueError(f"NeMo 2 has no preset for {k!r}; it offers {', '.join(NEMO2_PRESETS)}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"--recipes names a recipe twice: {spec}")
    return keys


def _has_events(d: Path) -> bool:
    return any(d.glob("events.out.tfevents.*"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    try:
        keys = _recipes(args.recipes)
    except ValueError as e:
        print(f"nemo2_smoke: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.steps < 1:
        print(f"nemo2_smoke: --steps must be at least 1 (20 for the smoke run), got {args.steps}", file=sys.stderr)
        return EXIT_USAGE
    versions = stack_versions()
    why = nemo_install_problem(versions)
    if why:
        print(f"nemo2_smoke: {why}", file=sys.stderr)
        return EXIT_USAGE
    root = Path(args.root)
    for k in keys:
        d = root / k
        if d.is_dir() and _has_events(d) and not args.overwrite:
            print(f"nemo2_smoke: {d} already holds a run; pass --overwrite or another --root", file=sys.stderr)
            return EXIT_USAGE
    say("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in versions.items()))
    import torch

    if not torch.cuda.is_available():
        say(f"no CUDA GPU here: {NO_GPU_HINT}. Going as far as NeMo gets without one (imports, plugin, model).")
    else:
        say(f"GPU: {torch.cuda.get_device_name(0)} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))})")
    results: Dict[str, str] = {}
    done: List[Path] = []
    for i, k in enumerate(keys, 1):
        why = recipe_problem(k, versions)
        if why and torch.cuda.is_available():
            say(f"[{i}/{len(keys)}] {k}: refused: {why}")
            results[k] = "refused"
            continue
        d = root / k
        if d.exists() and args.overwrite:
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        say(f"[{i}/{len(keys)}] {k}: {args.steps} steps -> {d} (NeMo's output: {d / 'smoke.log'})")
        t0 = time.time()
        rc = _run_child(k, args, d)
        took = time.time() - t0
        if rc == EXIT_OK:
            results[k] = "passed"
            done.append(d)
            say(f"[{i}/{len(keys)}] {k}: passed in {took:.0f} s")
        elif rc == EXIT_NO_GPU:
            results[k] = "no GPU"
            say(f"[{i}/{len(keys)}] {k}: stopped at the first CUDA call after {took:.0f} s: {NO_GPU_HINT}")
            break  # the other recipes would stop at the same place
        elif rc == EXIT_USAGE:
            results[k] = "refused"
            say(f"[{i}/{len(keys)}] {k}: refused (see above)")
        else:
            results[k] = f"failed (exit status {rc})"
            say(f"[{i}/{len(keys)}] {k}: FAILED (exit status {rc}) after {took:.0f} s; the end of {d / 'smoke.log'}:")
            for line in _tail(d / "smoke.log", 25):
                print("    " + line, flush=True)
    say("summary: " + ", ".join(f"{k} {v}" for k, v in results.items()))
    if done:
        _compare(done, root)
    if any(v == "no GPU" for v in results.values()):
        return EXIT_NO_GPU
    if any(v.startswith("failed") for v in results.values()):
        return EXIT_FAILED
    if any(v == "refused" for v in results.values()):
        return EXIT_USAGE
    return EXIT_OK


def _tail(path: Path, n: int) -> List[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _run_child(key: str, args: argparse.Namespace, run_dir: Path) -> int:
    """One recipe in a fresh process; its whole output to ``smoke.log``, our lines to the console."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--steps", str(args.steps)]
    cmd += ["--root", str(args.root)]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("WANDB_MODE", "disabled")):
        env.setdefault(k, v)
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONPATH"] = path
    with open(run_dir / "smoke.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if args.verbose or line.startswith(PREFIX):
                print(("    " if not args.verbose else "") + line.rstrip("\n"), flush=True)
        return proc.wait()


def _compare(dirs: List[Path], root: Path) -> None:
    cmd = ["nemo-fp8-compare", *map(str, dirs), "--tag", LOSS_TAG, "--last", "5", "--out", str(root / "compare")]
    say("compare: " + " ".join(shlex.quote(c) for c in cmd))
    try:
        from nemo_fp8_recipes.compare import main as compare_main
    except Exception as e:  # noqa: BLE001 - e.g. tensorboard or matplotlib missing
        say(f"nemo-fp8-compare is not importable here ({type(e).__name__}: {e}); run the line above")
        return
    rc = compare_main(cmd[1:])
    say(f"nemo-fp8-compare exit status {rc}")


# ---------------------------------------------------------------------------------------------
# One recipe (the child process)


def child_main(args: argparse.Namespace) -> int:
    key = args.child
    run_dir = Path(args.root) / key
    versions = stack_versions()
    import torch

    from nemo_fp8_recipes import PrecisionPolicy, check_supported, get_recipe

    gpu = torch.cuda.is_available()
    why = recipe_problem(key, versions)
    if why and gpu:
        say(f"{key}: refused: {why}")
        return EXIT_USAGE
    recipe = get_recipe(key)
    if gpu and recipe.is_fp8:
        ok, reason = check_supported(recipe)
        if not ok:
            say(f"{key}: refused: {reason}")
            return EXIT_USAGE
    policy = PrecisionPolicy()
    state: Dict[str, object] = {}
    t0 = time.time()
    try:
        cb, model = _pretrain(recipe, policy, args.steps, run_dir, gpu, state)
    except Exception as e:  # noqa: BLE001 - classified below
        traceback.print_exc()  # into smoke.log
        if not gpu and _is_cuda_error(e):
            built = state.get("model")
            n = _n_params(built) if built is not None else 0
            where = _where(e)
            stage = f"got through model construction ({n:,} parameters) and " if n else ""
            say(f"{key}: {stage}stopped at the first CUDA call: {type(e).__name__}: {_first_line(e)} ({where})")
            say(f"{key}: {NO_GPU_HINT}")
            return EXIT_NO_GPU
        say(f"{key}: failed: {type(e).__name__}: {_first_line(e)} ({_where(e)})")
        return EXIT_FAILED
    return _verify(key, recipe, cb, state, versions, run_dir, time.time() - t0, args.steps)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else ""


def _where(e: BaseException) -> str:
    """``pkg/module.py:line`` of the innermost frame outside torch (where the library called it)."""
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if "/torch/" not in f.filename] or list(tb)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno}"


def _is_cuda_error(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a CUDA / NCCL error, i.e. the run needed a GPU."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, ImportError):
            msg = f"{type(e).__name__} {e}".lower()
            if any(w in msg for w in ("torch not compiled with cuda", "cuda", "nccl", "nvidia driver")):
                return True
        e = e.__cause__ or e.__context__
    return False


def _n_params(model) -> int:
    mod = getattr(model, "module", None)
    if mod is None:
        return 0
    return sum(p.numel() for p in mod.parameters())


def _progress_callback(steps: int, state: dict):
    """Lightning callback: one line per step (loss, step time) and ``tokens_per_s`` to TensorBoard."""
    from lightning.pytorch import Callback

    class Progress(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.t = None
            self.losses: List[List[float]] = []

        def _sync(self) -> None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def on_fit_start(self, trainer, pl_module) -> None:
            state["model"] = pl_module

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._sync()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._sync()
            dt = time.perf_counter() - (self.t or time.perf_counter())
            step = int(trainer.global_step)
            loss = trainer.callback_metrics.get(LOSS_TAG)
            loss = float(loss) if loss is not None else float("nan")
            self.losses.append([step, loss, dt])
            tb = getattr(getattr(trainer, "logger", None), "experiment", None)
            if tb is not None and hasattr(tb, "add_scalar") and dt > 0:
                tb.add_scalar("tokens_per_s", GLOBAL_BATCH * SEQ_LEN / dt, step)
            say(f"step {step}/{steps} {LOSS_TAG} {loss:.4f} ({dt * 1000:.0f} ms)")

    return Progress()


def _pretrain(recipe, policy, steps: int, run_dir: Path, gpu: bool, state: dict):
    """``llm.pretrain`` of the tiny Llama; returns (our callback, progress callback)."""
    from nemo_fp8_recipes.integrations import nemo2

    plugin = nemo2.megatron_mixed_precision(recipe, policy)  # sets NVTE_* before TE is imported
    say(f"{recipe.name}: MegatronMixedPrecision({_plugin_summary(plugin)})")
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.collections.llm.gpt.model.llama import Llama3Config

    cfg = Llama3Config(
        num_layers=2,
        hidden_size=256,
        ffn_hidden_size=768,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=SEQ_LEN,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        make_vocab_size_divisible_by=128,
        # Without a GPU, build the weights on the CPU so the check gets past model construction.
        use_cpu_initialization=not gpu,
    )
    if importlib.util.find_spec("transformer_engine") is None:
        # Only on the CPU check (the GPU run refuses without TE): megatron-core's local spec then
        # uses torch's LayerNorm, which has no persistent kernel.
        cfg.persist_layer_norm = False
    for k, v in nemo2.nemo2_model_overrides(recipe, policy).items():
        setattr(cfg, k, v)
    tokenizer = NullTokenizer(vocab_size=VOCAB)
    model = llm.LlamaModel(cfg, tokenizer=tokenizer)
    state["model"] = model
    data = llm.MockDataModule(
        seq_length=SEQ_LEN,
        tokenizer=tokenizer,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=GLOBAL_BATCH,
        num_train_samples=GLOBAL_BATCH * steps * 2,
        num_val_samples=GLOBAL_BATCH,
        num_test_samples=GLOBAL_BATCH,
        num_workers=0,
        pin_memory=gpu,
    )
    opt = nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam",
            lr=3e-4,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
        )
    )
    (audit_cb,) = nemo2.nemo2_callbacks(recipe, policy, strict=True)
    progress = _progress_callback(steps, state)
    trainer = nl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        num_nodes=1,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        strategy=nl.MegatronStrategy(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            ckpt_load_optimizer=False,
            # NeMo 2.7.3's async checkpoint IO imports a module megatron-core 0.16 no longer has
            # (dist_checkpointing.strategies.tensorstore); a smoke run saves nothing.
            ckpt_async_save=False,
        ),
        plugins=plugin,
        callbacks=[audit_cb, progress],
    )
    log = nl.NeMoLogger(
        explicit_log_dir=str(run_dir),
        tensorboard=TensorBoardLogger(save_dir=str(run_dir), name="", version=""),
        update_logger_directory=False,
    )
    say(f"{recipe.name}: llm.pretrain (Llama3Config 2 layers, hidden 256, seq {SEQ_LEN}, global batch {GLOBAL_BATCH})")
    llm.pretrain(model=model, data=data, trainer=trainer, log=log, optim=opt)
    state["progress"] = progress
    return audit_cb, progress


def _plugin_summary(plugin) -> str:
    dc = getattr(plugin, "dtype_config", None)
    keys = ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "num_layers_at_start_in_bf16")
    if dc is None:
        return "?"
    return ", ".join(f"{k}={getattr(dc, k, None)!r}" for k in keys)


def _verify(key, recipe, cb, state, versions, run_dir: Path, took: float, steps: int) -> int:
    """The run's checks; writes audit.txt / audit.json / smoke.json into ``run_dir``."""
    from nemo_fp8_recipes.integrations.callbacks import write_audit

    progress = state.get("progress")
    losses = list(getattr(progress, "losses", []))
    problems: List[str] = []
    rep = cb.audit or cb.hooks.report()
    write_audit(rep, run_dir)
    say(f"{key}: audit\n" + "\n".join(f"{PREFIX}   {line}" for line in rep.table().splitlines()))
    fp8_calls = sum(r.fp8_calls for r in rep.rows)
    if not rep.rows:
        problems.append("the callback hooked no Transformer Engine module")
    if recipe.is_fp8 and fp8_calls == 0:
        problems.append("no TE module ran in FP8")
    if not recipe.is_fp8 and fp8_calls:
        problems.append(f"{fp8_calls} TE module calls ran in FP8 under bf16")
    if rep.violations:
        problems.append("policy violations: " + ", ".join(rep.violations))
    if rep.fp8_off:
        problems.append("FP8 expected but off: " + ", ".join(rep.fp8_off))
    if len(losses) < steps:
        problems.append(f"{len(losses)} of {steps} steps ran")
    finite = [v for _, v, _ in losses if v == v and abs(v) != float("inf")]
    if len(finite) != len(losses):
        problems.append("a loss was not finite (or not logged)")
    import torch

    summary = {
        "recipe": key,
        "steps": steps,
        "seconds": round(took, 1),
        "versions": versions,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "nvte_env": {k: v for k, v in os.environ.items() if k.startswith("NVTE_")},
        "losses": losses,
        "te_module_calls": sum(r.calls for r in rep.rows),
        "te_fp8_calls": fp8_calls,
        "problems": problems,
    }
    (run_dir / "smoke.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if losses:
        say(f"{key}: {LOSS_TAG} step {losses[0][0]} {losses[0][1]:.4f} -> step {losses[-1][0]} {losses[-1][1]:.4f}")
    if problems:
        say(f"{key}: FAILED: " + "; ".join(problems))
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
