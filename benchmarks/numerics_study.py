"""The numerics study: every recipe trained at several seeds, deterministically, compared with BF16
seed by seed, with 95% intervals that tell FP8 error from noise.

One command trains, compares and reports::

    python benchmarks/numerics_study.py --corpus /data/study_corpus/corpus.jsonl --parallel 3
    python benchmarks/numerics_study.py --dry-run                 # print the trainer commands only
    python benchmarks/numerics_study.py --preset smoke --root /tmp/ns --recipes bf16,tensorwise  # CPU

1. **Train** one run per recipe and seed, ``--parallel`` of them side by side on the GPU. Each is
   an ordinary trainer run, the job the sweep ``nemo-fp8-train -m recipe=bf16,tensorwise,...
   trainer.seed=1,2,3 trainer.deterministic=true ...`` would run (it lands in the same directory,
   ``<root>/<model>/<recipe>-seed<N>``, its output in ``stdout.log`` there, beside the trainer's
   ``train.log``); recipes of ``--emulate`` (mxfp8 on Hopper) get ``recipe.emulate=true``. Seeds
   run in order, all recipes of a seed together, so a study cut short still pairs every seed it
   finished. A complete run is not trained again; an interrupted one resumes from its checkpoint,
   or, without one, is moved aside (``<dir>.incomplete-<time>``) and trained again. With
   ``--parallel N`` on a GPU the trainer's memory estimate for N runs must fit the card.
2. **Compare** with ``nemo-fp8-compare`` (baseline ``bf16``), which groups the runs by seed: the
   training loss (final loss = the mean over the last ``--last`` steps) into
   ``<root>/<model>/compare/train/`` and the validation loss (the last validation) into
   ``.../compare/val/``: PNG, Markdown, CSV, JSON, TensorBoard. ``--max-rel-dev X`` is the gate:
   a recipe passes when the 95% interval of its final-loss deviation lies within ±X, or, with
   ``--gate regression``, fails only when that interval lies above +X (its loss shown worse).
3. **Report**: ``<root>/<model>/report.md`` and ``report.json``: per recipe the paired final-loss
   deviation from BF16 (training and validation) with its 95% interval, how closely the curve
   tracks BF16 step by step (mean |relative deviation| over the final window), the goal (within
   0.25% for blockwise and mxfp8, 0.5% for tensorwise and delayed: met when the interval lies
   inside it, missed when outside, unresolved otherwise), the noise floor, and the answer to "does
   fine-grained scaling track BF16 more closely than per-tensor scaling": the difference of the
   two recipes' tracking, paired by seed, with its interval. No tokens/s: runs that share a GPU
   (``--parallel``) are not speed measurements (the compare outputs keep each run's, for what it
   is worth).

``--variant "delayed-margin8 recipe.margin=8"`` adds a recipe with overrides of its own as one more
group (runs ``delayed-margin8-seed<N>``, the trainer's ``run.tag``), trained at every seed and compared
with BF16 like the recipes, e.g. a deliberately degraded run for the gate. ``--other-seeds 4,5,6``
trains BF16 at seeds of its own as the group ``bf16-other`` (runs ``bf16-other-seed<N>``, after
the others), compared with BF16 unpaired (Welch's interval): BF16 against itself, what a comparison
without seed pairing resolves and whether the gate passes it (reported; not part of the exit
status, which judges the recipes and variants). ``--report-only`` runs steps
2 and 3 on existing runs. Hydra overrides after the flags go to every
run (``model.outlier_channels=2 model.outlier_scale=10000`` for the outlier stress,
docs/numerics.md). Exit status: 0 done, 1 a run failed or a recipe or variant failed the gate, 2 bad
arguments, a study that does not fit the GPU, or no BF16 run to compare against.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

RECIPES = ("bf16", "tensorwise", "blockwise", "delayed", "mxfp8")
#: |final loss / BF16 final loss - 1| at most this (DeepSeek-V3 reports < 0.25% for fine-grained FP8)
GOALS = {"blockwise": 0.0025, "mxfp8": 0.0025, "tensorwise": 0.005, "delayed": 0.005}
#: the question of NVIDIA's NeMo FP8 study: fine-grained against per-tensor scaling
FINE, PER_TENSOR = ("blockwise", "mxfp8"), ("tensorwise", "delayed")
#: the presets: flags, then the trainer overrides of every run
PRESETS = {
    # llama3_150m, 1250 steps x 32 sequences x 1024 tokens = 40,960,000 tokens a run; AdamW
    # (0.9/0.95, weight decay 0.1), peak lr 1.5e-3 after 100 warm-up steps, cosine to 1.5e-4
    "full": dict(
        model="llama3_150m",
        steps=1250,
        seq_len=1024,
        micro_batch=16,
        global_batch=32,
        last=250,
        overrides=(
            "trainer.warmup_steps=100",
            "trainer.log_interval=10",
            "trainer.val_interval=250",
            "trainer.val_steps=8",
            "trainer.telemetry_interval=0",
            "trainer.ckpt_interval=250",
            "trainer.ckpt_keep=1",
            "trainer.compile=true",
            "trainer.compile_mode=reduce-overhead",
        ),
    ),
    "smoke": dict(
        model="llama3_tiny",
        steps=6,
        seq_len=32,
        micro_batch=2,
        global_batch=4,
        last=2,
        overrides=(
            "model.num_layers=1",
            "model.dim=128",
            "model.num_heads=2",
            "model.num_kv_heads=1",
            "model.ffn_dim=128",
            "data.max_files=20",
            "trainer.device=cpu",
            "trainer.warmup_steps=2",
            "trainer.log_interval=1",
            "trainer.val_interval=3",
            "trainer.val_steps=1",
            "trainer.checkpoint=false",
            "trainer.telemetry_interval=0",
        ),
    ),
}


def _split(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_variant(text: str) -> Dict[str, object]:
    """``"RECIPE-TAG override ..."`` -> ``{name, recipe, tag, overrides}``; ValueError when malformed."""
    words = shlex.split(text)
    recipe, sep, tag = (words[0] if words else "").partition("-")
    example = '--variant "delayed-margin8 recipe.margin=8"'
    if not sep or not tag or not tag.replace("_", "").isalnum():
        raise ValueError(
            f"--variant {text!r}: the first word is RECIPE-TAG (a recipe, a dash, then letters, digits or "
            f"underscores), then the overrides, e.g. {example}"
        )
    if recipe not in RECIPES:
        raise ValueError(f"--variant {text!r}: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    bad = [w for w in words[1:] if "=" not in w or w.startswith("=")]
    if bad or len(words) == 1:
        raise ValueError(
            f"--variant {text!r}: after RECIPE-TAG come Hydra overrides key=value (got {bad or 'none'}), e.g. {example}"
        )
    return {"name": words[0], "recipe": recipe, "tag": tag, "overrides": words[1:]}


def settings(a: argparse.Namespace) -> argparse.Namespace:
    """The flags with the preset filled in where not given; ValueError for bad values."""
    preset = PRESETS[a.preset]
    for key, value in preset.items():
        if key != "overrides" and getattr(a, key) is None:
            setattr(a, key, value)
    a.recipes, a.emulate = _split(a.recipes), _split(a.emulate)
    bad = [r for r in a.recipes + a.emulate if r not in RECIPES]
    if bad:
        raise ValueError(f"unknown recipe(s) {', '.join(bad)}; valid: {', '.join(RECIPES)}")
    a.variants = [parse_variant(v) for v in a.variant]
    names = [v["name"] for v in a.variants]
    if len(set(names)) != len(names):
        raise ValueError(f"--variant names must differ, got {', '.join(names)}")
    #: the study's groups: each recipe as it is, then each variant ({name, recipe, tag, overrides})
    a.arms = [{"name": r, "recipe": r, "tag": None, "overrides": []} for r in a.recipes] + a.variants
    if "bf16" not in a.recipes:
        raise ValueError("--recipes must include bf16: every recipe is compared with it")
    try:
        a.seeds = [int(s) for s in _split(a.seeds)]
    except ValueError:
        raise ValueError(f"--seeds takes whole numbers separated by commas, got {a.seeds!r}") from None
    if not a.seeds or len(set(a.seeds)) != len(a.seeds):
        raise ValueError(f"--seeds needs distinct seeds (three or more for intervals), got {a.seeds}")
    try:
        other = [int(x) for x in _split(a.other_seeds or "")]
    except ValueError:
        raise ValueError(f"--other-seeds takes whole numbers separated by commas, got {a.other_seeds!r}") from None
    if len(set(other)) != len(other) or set(other) & set(a.seeds) or len(other) == 1:
        raise ValueError(
            f"--other-seeds needs two or more distinct seeds (an interval needs two) that are not in --seeds "
            f"{a.seeds}, got {other}"
        )
    if other and "bf16-other" in names:
        raise ValueError("--variant bf16-other is the name --other-seeds gives its group: name the variant otherwise")
    if other:  # BF16 at seeds of its own: compared unpaired (Welch), the noise an unpaired comparison must beat
        a.arms.append({"name": "bf16-other", "recipe": "bf16", "tag": "other", "overrides": [], "seeds": other})
    if a.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {a.parallel}")
    from nemo_fp8_recipes.config import override_value

    data = ["data=jsonl", f"data.paths=[{override_value(Path(a.corpus).resolve())}]"] if a.corpus else []
    if a.corpus and not Path(a.corpus).is_file():
        raise ValueError(f"--corpus {a.corpus}: no such file (build one with benchmarks/study_corpus.py)")
    a.overrides = [*preset["overrides"], *data, *a.extra]
    return a


def common_overrides(a: argparse.Namespace) -> List[str]:
    """The overrides every run gets (model, budget, determinism, run root, the preset, yours)."""
    from nemo_fp8_recipes.config import override_value

    return [
        f"model={a.model}",
        f"trainer.max_steps={a.steps}",
        f"trainer.seq_len={a.seq_len}",
        f"trainer.micro_batch_size={a.micro_batch}",
        f"trainer.global_batch_size={a.global_batch}",
        "trainer.deterministic=true",
        f"run.root={override_value(a.root)}",
        *a.overrides,
    ]


def sweep_commands(a: argparse.Namespace) -> List[List[str]]:
    """The same runs as ``nemo-fp8-train -m`` sweeps (one process after the other; argv after
    ``nemo-fp8-train``): the recipes that run as they are, and those of ``--emulate`` emulated."""
    seeds = f"trainer.seed={','.join(map(str, a.seeds))}"
    plain = [r for r in a.recipes if r not in a.emulate]
    emulated = [r for r in a.recipes if r in a.emulate]
    out = [["-m", f"recipe={','.join(plain)}", seeds, *common_overrides(a)]]
    if emulated:
        out.append(["-m", f"recipe={','.join(emulated)}", "recipe.emulate=true", seeds, *common_overrides(a)])
    for v in a.arms:  # the tagged groups: the variants, then BF16 at --other-seeds (seeds of its own)
        if not v["tag"]:
            continue
        emulate = ["recipe.emulate=true"] if v["recipe"] in a.emulate else []
        out.append(
            [
                "-m",
                f"recipe={v['recipe']}",
                *emulate,
                f"run.tag={v['tag']}",
                *v["overrides"],
                f"trainer.seed={','.join(map(str, v['seeds']))}" if "seeds" in v else seeds,
                *common_overrides(a),
            ]
        )
    return out


def jobs(a: argparse.Namespace) -> List[Dict[str, object]]:
    """One job per seed and group (recipes, then variants), seed by seed, then BF16 at
    ``--other-seeds``: its name, group (``arm``), run directory and trainer arguments."""
    out = []
    order = [(seed, arm) for seed in a.seeds for arm in a.arms if "seeds" not in arm]
    order += [(seed, arm) for arm in a.arms if "seeds" in arm for seed in arm["seeds"]]
    for seed, arm in order:
        r = arm["recipe"]
        name = f"{arm['name']}-seed{seed}"
        argv = [
            f"recipe={r}",
            *(["recipe.emulate=true"] if r in a.emulate else []),
            *([f"run.tag={arm['tag']}"] if arm["tag"] else []),
            f"trainer.seed={seed}",
            "run.sweep=[trainer.seed]",
            *common_overrides(a),
            *arm["overrides"],
        ]
        out.append(
            {
                "name": name,
                "arm": arm["name"],
                "recipe": r,
                "seed": seed,
                "dir": Path(a.root) / a.model / name,
                "argv": argv,
            }
        )
    return out


def run_state(run_dir: Path, steps: int) -> str:
    """``complete`` (its summary says all steps), ``resumable`` (an unfinished run with a
    checkpoint), ``stale`` (an unfinished run without one: its event files would mix with a new
    run's) or ``new``."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            if json.loads(summary.read_text()).get("steps") == steps:
                return "complete"
        except (OSError, ValueError):
            pass
    if not run_dir.exists():
        return "new"
    if any((run_dir / "checkpoints").glob("step_*.pt")):
        return "resumable"
    return "stale" if any(run_dir.iterdir()) else "new"


def check_parallel_fits(a: argparse.Namespace) -> Optional[str]:
    """On a GPU: None if ``--parallel`` runs fit the card by the trainer's memory estimate, else
    why not and how many do. (The CPU, and a machine without a readable GPU, are not checked.)"""
    import torch

    if a.parallel == 1 or not torch.cuda.is_available() or "trainer.device=cpu" in a.overrides:
        return None
    from omegaconf import OmegaConf

    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.models import ModelConfig
    from nemo_fp8_recipes.trainer.memory import estimate_training_memory, format_bytes

    cfg = compose_config([j for j in jobs(a)[0]["argv"] if not j.startswith("data.paths")])
    mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    est = max(
        estimate_training_memory(
            mcfg, tokens_per_micro_batch=a.micro_batch * a.seq_len, fp8=fp8, activation_bytes=2, cpu=False
        ).total
        for fp8 in (False, True)
    )
    total = torch.cuda.get_device_properties(0).total_memory
    fits = int(0.9 * total // est)
    if fits >= a.parallel:
        return None
    return (
        f"--parallel {a.parallel}: each run needs about {format_bytes(est)} by the trainer's estimate, and "
        f"{a.parallel} of them do not fit in 90% of this GPU's {format_bytes(total)}; use --parallel "
        f"{max(1, fits)}"
    )


def train_all(a: argparse.Namespace) -> List[str]:
    """Run every job not complete yet, ``--parallel`` at a time; returns the names of those that failed."""
    todo, failed = [], []
    for j in jobs(a):
        state = run_state(j["dir"], a.steps)
        if state == "complete":
            print(f"{j['name']}: complete, not trained again", flush=True)
            continue
        if state == "stale":
            aside = j["dir"].with_name(f"{j['dir'].name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}")
            j["dir"].rename(aside)
            print(f"{j['name']}: an unfinished run without a checkpoint was there; moved to {aside}", flush=True)
        todo.append(j)
    running: List[tuple] = []
    t0 = time.time()
    while todo or running:
        while todo and len(running) < a.parallel:
            j = todo.pop(0)
            j["dir"].mkdir(parents=True, exist_ok=True)
            log = open(j["dir"] / "stdout.log", "a", encoding="utf-8")
            print(f"$ nemo-fp8-train {shlex.join(j['argv'])}   # -> {j['dir'] / 'stdout.log'}", flush=True)
            proc = subprocess.Popen(
                [sys.executable, "-m", "nemo_fp8_recipes.train", *j["argv"]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            running.append((j, proc, log, time.time()))
        time.sleep(0.5)
        for item in list(running):
            j, proc, log, started = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see its stdout.log)"
            if proc.returncode:
                failed.append(j["name"])
            print(
                f"{j['name']}: {status} in {time.time() - started:.0f} s ({len(todo)} waiting, {len(running)} "
                f"running, {time.time() - t0:.0f} s so far)",
                flush=True,
            )
    return failed


def compare(
    dirs: Sequence[Path], out: Path, tag: str, last: int, max_rel_dev: Optional[float], gate: str = "within"
) -> Optional[dict]:
    """``nemo-fp8-compare`` over ``dirs`` for ``tag`` into ``out`` (printed, then run in this
    process); its JSON export, or None when it could not compare (its message is printed)."""
    from nemo_fp8_recipes.compare import main as compare_main

    argv = [
        *map(str, dirs),
        "--tag",
        tag,
        "--last",
        str(last),
        "--baseline",
        "bf16",
        "--out",
        str(out),
        *(["--max-rel-dev", str(max_rel_dev), "--gate", gate] if max_rel_dev is not None else []),
    ]
    print(f"\n$ nemo-fp8-compare {shlex.join(argv)}", flush=True)
    rc = compare_main(argv)
    path = out / "compare.json"
    return json.loads(path.read_text()) if rc in (0, 1) and path.is_file() else None


def _interval(xs: Sequence[float]):
    from nemo_fp8_recipes.compare import mean_interval

    return mean_interval(list(xs)) if xs else (None, None)


def _verdict(interval, goal: float) -> str:
    if interval is None:
        return "unresolved (one seed)"
    lo, hi = interval
    if -goal <= lo and hi <= goal:
        return "met"
    if lo > goal or hi < -goal:
        return "missed"
    return "unresolved"


def build_report(a: argparse.Namespace, cmp: Dict[str, Optional[dict]]) -> dict:
    """The report's content from the two comparisons' JSON and the runs' summaries."""
    groups = {tag: {g["label"]: g for g in (c or {}).get("groups", [])} for tag, c in cmp.items()}
    results = {r["name"]: r for r in (cmp["train"] or {}).get("results", [])}

    def group_of(tag: str, recipe: str):  # (a group is named by its runs' name without the seed, or, with
        for g in groups[tag].values():  # one seed each, by the run's own name)
            if any(n.rsplit("-seed", 1)[0] == recipe for n in g["runs"]):
                return g
        return None

    recipes = {}
    for arm in a.arms:
        r = arm["name"]
        tr, va = group_of("train", r), group_of("val", r)
        seeds = arm.get("seeds", a.seeds)
        runs = {s: results.get(f"{r}-seed{s}") for s in seeds}
        complete = [s for s in seeds if run_state(Path(a.root) / a.model / f"{r}-seed{s}", a.steps) == "complete"]
        goal = GOALS.get(r)
        recipes[r] = {
            "seeds": (tr or {}).get("seeds", []),
            "complete_seeds": complete,
            "train_loss": (tr or {}).get("final_loss"),
            "val_loss": (va or {}).get("final_loss"),
            "train_vs_bf16": (tr or {}).get("final_vs_baseline"),
            "train_interval": (tr or {}).get("interval"),
            "val_vs_bf16": (va or {}).get("final_vs_baseline"),
            "val_interval": (va or {}).get("interval"),
            "tracking": (tr or {}).get("mean_abs_dev"),
            "tracking_interval": (tr or {}).get("mean_abs_dev_interval"),
            "per_seed_train": (tr or {}).get("per_seed", {}),
            "per_seed_val": (va or {}).get("per_seed", {}),
            "tracking_per_seed": {
                str(s): (runs[s] or {}).get("window_mean_rel_dev")
                for s in seeds
                if runs[s] and not runs[s].get("baseline")
            },
            "goal": goal,
            "goal_train": _verdict((tr or {}).get("interval"), goal) if goal and tr else None,
            "goal_val": _verdict((va or {}).get("interval"), goal) if goal and va else None,
            "gate_passed": (tr or {}).get("passed"),
            "variant": None if not arm["tag"] else {"recipe": arm["recipe"], "overrides": arm["overrides"]},
            "unpaired": "seeds" in arm,
        }
    # fine-grained against per-tensor scaling: the difference of the two recipes' tracking, paired by seed
    contrasts = []
    for fine in FINE:
        for pt in PER_TENSOR:
            if fine not in recipes or pt not in recipes:
                continue
            f, p = recipes[fine]["tracking_per_seed"], recipes[pt]["tracking_per_seed"]
            seeds = [s for s in f if s in p and f[s] is not None and p[s] is not None]
            diff, ci = _interval([f[s] - p[s] for s in seeds])
            fa, pa = recipes[fine]["per_seed_val"], recipes[pt]["per_seed_val"]
            vseeds = [s for s in fa if s in pa]
            vdiff, vci = _interval([abs(fa[s]) - abs(pa[s]) for s in vseeds])
            contrasts.append(
                {
                    "fine": fine,
                    "per_tensor": pt,
                    "seeds": seeds,
                    "tracking_diff": diff,
                    "tracking_interval": ci,
                    "val_abs_diff": vdiff,
                    "val_abs_interval": vci,
                }
            )
    # (with --other-seeds the compare tool pools bf16 and bf16-other, BF16's settings at six seeds)
    noise = {tag: (c or {}).get("noise") for tag, c in cmp.items()}
    return {
        "model": a.model,
        "steps": a.steps,
        "tokens_per_run": a.steps * a.global_batch * a.seq_len,
        "seeds": a.seeds,
        "last": a.last,
        "preset": a.preset,
        "corpus": a.corpus or _corpus_of(a),
        # the token digests the compared runs recorded (compare read them from summary.json), each once
        "data_sha256": list(dict.fromkeys(r["data_sha256"] for r in cmp["train"]["runs"] if r.get("data_sha256"))),
        "overrides": a.overrides,
        "emulated": a.emulate,
        "recipes": recipes,
        "contrasts": contrasts,
        "noise": noise,
        "max_rel_dev": a.max_rel_dev,
        "gate": a.gate,
        "compare": {tag: str(Path(a.root) / a.model / "compare" / tag) for tag in cmp if cmp[tag]},
    }


def _corpus_of(a: argparse.Namespace) -> Optional[str]:
    """The training text the BF16 runs recorded (``data`` block of a config.yaml), for the report."""
    import yaml

    for j in jobs(a):
        cfg_path = j["dir"] / "config.yaml"
        if j["arm"] == "bf16" and cfg_path.is_file():
            data = (yaml.safe_load(cfg_path.read_text()) or {}).get("data") or {}
            return f"data={data.get('name')} {data.get('paths') or ''}".strip()
    return None


def _digest_text(digests: Sequence[str]) -> str:
    if not digests:
        return ""
    if len(digests) == 1:
        return f" (tokens sha256 {digests[0][:16]}…, every run)"
    return (
        f" (WARNING: the runs trained on {len(digests)} different token streams, sha256 "
        + ", ".join(d[:12] + "…" for d in digests)
        + ": the corpus changed between runs; compare/ fails the pairs that differ)"
    )


def _pct(x, signed: bool = True) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{100 * x:+.2f}%" if signed else f"{100 * x:.2f}%"


def _ci(x, ci, signed: bool = True) -> str:
    if x is None:
        return "—"
    return _pct(x, signed) + (f" [{_pct(ci[0], signed)}, {_pct(ci[1], signed)}]" if ci else "")


def report_markdown(rep: dict) -> str:
    """``report.md``: the settings, one row per recipe, the noise floor, the contrasts."""
    smoke = rep["preset"] == "smoke"
    lines = [
        f"# Numerics study{' (SMOKE: tiny CPU run, no conclusions)' if smoke else ''}",
        "",
        f"{rep['model']}, {rep['steps']} steps, {rep['tokens_per_run']:,} tokens per run, seeds "
        f"{', '.join(map(str, rep['seeds']))}, deterministic; deviations are FP8 minus BF16 at the same seed, "
        f"relative to BF16, mean over seeds [95% interval]; train loss = mean over the last {rep['last']} steps, "
        "val loss = the last validation; tracking = mean |relative deviation| of the training loss over the "
        f"last {rep['last']} steps. Corpus: {rep['corpus'] or 'the trainer default (data=stdlib)'}"
        + _digest_text(rep.get("data_sha256") or [])
        + ".",
        "",
        "| recipe | seeds | train loss | vs bf16 (train) | val loss | vs bf16 (val) | tracking | goal | "
        "met (train / val) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rep["recipes"].items():
        base = name == "bf16"
        goal = "—" if r["goal"] is None else f"±{100 * r['goal']:.2f}%"
        met = "—" if r["goal"] is None or r["goal_train"] is None else f"{r['goal_train']} / {r['goal_val']}"
        lines.append(
            f"| {name}{' (baseline)' if base else ''} | {', '.join(map(str, r['complete_seeds'])) or 'none'} | "
            f"{'—' if r['train_loss'] is None else format(r['train_loss'], '.4f')} | "
            f"{'—' if base else _ci(r['train_vs_bf16'], r['train_interval'])} | "
            f"{'—' if r['val_loss'] is None else format(r['val_loss'], '.4f')} | "
            f"{'—' if base else _ci(r['val_vs_bf16'], r['val_interval'])} | "
            f"{'—' if base else _ci(r['tracking'], r['tracking_interval'], False)} | {goal} | {met} |"
        )
    if rep.get("max_rel_dev") is not None:
        judged = {n: r["gate_passed"] for n, r in rep["recipes"].items() if n != "bf16"}
        x = _pct(rep["max_rel_dev"], False)
        rule = (
            f"pass when the 95% interval of the training loss's deviation lies within ±{x}"
            if rep["gate"] == "within"
            else f"regression: fail only when the 95% interval of the training loss's deviation lies above +{x}"
        )
        lines += [
            "",
            f"Gate ({rule}): "
            + "; ".join(f"{n} {'pass' if ok else 'FAIL' if ok is False else '—'}" for n, ok in judged.items())
            + " (compare/train/compare.md gives each verdict's reason)",
        ]
    other = rep["recipes"].get("bf16-other")
    if other:
        lines += [
            "",
            f"bf16-other: BF16 at seeds {', '.join(map(str, other['complete_seeds'])) or 'none complete'}, "
            "compared with BF16 unpaired (Welch's interval, seed-to-seed noise included): what a comparison "
            "without seed pairing can resolve"
            + (
                "" if other["gate_passed"] is None else f"; the gate {'passes' if other['gate_passed'] else 'fails'} it"
            ),
        ]
    variants = [
        (name, r["variant"]) for name, r in rep["recipes"].items() if r.get("variant") and not r.get("unpaired")
    ]
    if variants:
        lines += [""] + [
            f"{name}: {v['recipe']} with {' '.join(v['overrides'])} (a variant: no goal of its own)"
            for name, v in variants
        ]
    for tag in ("train", "val"):
        n = rep["noise"].get(tag)
        if n:
            sd = "—" if n.get("seed_sd") is None else _pct(n["seed_sd"], False)
            pair = "—" if n.get("seed_max_pair") is None else _pct(n["seed_max_pair"], False)
            lines += [
                "",
                f"Noise floor ({tag} loss): BF16 seed to seed, sd {sd} of the mean, two seeds differ by up "
                f"to {pair}; the same seed run again: "
                + ("0 (deterministic)" if n.get("deterministic") and not n.get("reruns") else "see compare/" + tag),
            ]
            if n.get("pooled_sd") is not None:
                lines[-1] += (
                    f"; over all {len(n['pooled_seeds'])} BF16 seeds ({' and '.join(n['pooled_groups'])}): sd "
                    f"{_pct(n['pooled_sd'], False)}, up to {_pct(n['pooled_max_pair'], False)} apart"
                )
    if rep["contrasts"]:
        lines += [
            "",
            "Fine-grained against per-tensor scaling (paired by seed; negative = the fine-grained recipe "
            "tracks BF16 more closely):",
            "",
            "| recipes | seeds | tracking difference [95% interval] | \\|val deviation\\| difference | answer |",
            "|---|---|---|---|---|",
        ]
        for c in rep["contrasts"]:
            ci = c["tracking_interval"]
            if ci is None:
                answer = "one seed: not resolved"
            elif ci[1] < 0:
                answer = f"{c['fine']} tracks BF16 more closely"
            elif ci[0] > 0:
                answer = f"{c['per_tensor']} tracks BF16 more closely"
            else:
                answer = "not resolved: the difference is within what these seeds resolve"
            lines.append(
                f"| {c['fine']} vs {c['per_tensor']} | {', '.join(c['seeds'])} | "
                f"{_ci(c['tracking_diff'], ci)} | {_ci(c['val_abs_diff'], c['val_abs_interval'])} | "
                f"{answer} |"
            )
    if rep.get("unfinished"):
        lines += ["", f"Not compared (unfinished): {', '.join(rep['unfinished'])}."]
    lines += [
        "",
        "Loss curves, per-step deviations with their intervals, and every number at full precision: "
        + ", ".join(f"`{p}`" for p in rep["compare"].values()),
    ]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/study", help="run root (default %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list, bf16 included (default: all)")
    p.add_argument("--seeds", default="1,2,3", help="comma list of seeds, every recipe at each (default %(default)s)")
    p.add_argument(
        "--emulate",
        default="mxfp8",
        help="recipes trained with recipe.emulate=true, e.g. mxfp8 on Hopper (default %(default)s)",
    )
    p.add_argument(
        "--corpus",
        default=None,
        metavar="JSONL",
        help="the training text (benchmarks/study_corpus.py builds one); default the trainer's (stdlib)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="runs side by side on the device (default 1; checked against the GPU's memory)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="full",
        help="full: llama3_150m, 40,960,000 tokens a run, one GPU; smoke: a tiny CPU run for tests",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='"RECIPE-TAG OVERRIDE..."',
        help="one more group: RECIPE with these Hydra overrides, its runs named RECIPE-TAG-seed<N> "
        '(repeatable), e.g. --variant "delayed-margin8 recipe.margin=8"',
    )
    p.add_argument(
        "--other-seeds",
        default=None,
        metavar="SEEDS",
        help="BF16 also at these seeds (two or more, none of --seeds), as the group bf16-other compared "
        "with BF16 unpaired: the gate on BF16 against itself, reported but not in the exit status (e.g. 4,5,6)",
    )
    p.add_argument("--model", default=None, help="model config (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--last", type=int, default=None, help="final-loss window in steps (default: the preset's)")
    p.add_argument(
        "--max-rel-dev",
        type=float,
        default=None,
        metavar="X",
        help="gate on the training loss: fail (exit 1) a recipe whose 95%% interval of the final-loss "
        "deviation reaches beyond ±X (0.005 = 0.5%%); with --gate regression, only one whose interval lies "
        "above +X",
    )
    p.add_argument(
        "--gate",
        choices=("within", "regression"),
        default="within",
        help="the gate's rule (nemo-fp8-compare --gate): within (default) passes a recipe only when the seeds "
        "show it within ±X; regression fails it only when they show its loss more than X above BF16's",
    )
    p.add_argument("--dry-run", action="store_true", help="print the training commands only")
    p.add_argument("--report-only", action="store_true", help="compare and report existing runs (no training)")
    p.add_argument("extra", nargs="*", help="Hydra overrides for every run (e.g. trainer.lr=1e-3)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Train (unless ``--report-only``), compare and report; the exit status of the docstring."""
    p = _parser()
    a = p.parse_args(argv)
    try:
        a = settings(a)
    except ValueError as e:
        p.error(str(e))
    print("# the runs, as nemo-fp8-train sweeps (this script runs each job itself, --parallel at a time):")
    for cmd in sweep_commands(a):
        print(f"#   nemo-fp8-train {shlex.join(cmd)}")
    if a.dry_run:
        for j in jobs(a):
            print(f"$ nemo-fp8-train {shlex.join(j['argv'])}")
        return 0
    failed: List[str] = []
    if not a.report_only:
        problem = check_parallel_fits(a)
        if problem:
            print(f"numerics_study: error: {problem}", file=sys.stderr)
            return 2
        failed = train_all(a)
    out = Path(a.root) / a.model
    states = [(j, run_state(j["dir"], a.steps)) for j in jobs(a)]
    done = [j for j, state in states if state == "complete"]
    unfinished = [j["name"] for j, state in states if state != "complete" and j["dir"].exists()]
    if unfinished:
        print(
            f"numerics_study: not compared, unfinished: {', '.join(unfinished)} (the same command again finishes them)",
            file=sys.stderr,
        )
    dirs = [j["dir"] for j in done]
    if not any(j["arm"] == "bf16" for j in done):
        print(f"numerics_study: error: no complete bf16 run under {out} to compare against", file=sys.stderr)
        return 2
    cmp = {
        "train": compare(dirs, out / "compare" / "train", "train/loss", a.last, a.max_rel_dev, a.gate),
        "val": compare(dirs, out / "compare" / "val", "val/loss", 1, None),
    }
    if cmp["train"] is None:
        print("numerics_study: error: the training losses could not be compared (see above)", file=sys.stderr)
        return 2
    rep = build_report(a, cmp)
    rep["unfinished"] = unfinished
    md = report_markdown(rep)
    (out / "report.md").write_text(md, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    print("\n" + md + f"\nreport: {out / 'report.md'}, {out / 'report.json'}")
    if failed:
        print(
            f"numerics_study: {len(failed)} run(s) failed: {', '.join(failed)}; the same command again resumes "
            "or retrains them",
            file=sys.stderr,
        )
    # the gate's verdict on BF16 at other seeds is reported, not counted: it measures the comparison
    gate_failed = any(r["gate_passed"] is False for r in rep["recipes"].values() if not r.get("unpaired"))
    return 1 if failed or gate_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
