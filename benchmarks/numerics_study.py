"""The numerics study: every recipe trained for one token budget, compared with BF16 and with a
second BF16 seed (the run-to-run noise floor a deviation must beat to mean anything).

It is three steps, each an ordinary tool, printed before it runs::

    python benchmarks/numerics_study.py                    # llama3_150m, 600 steps, one GPU
    python benchmarks/numerics_study.py --dry-run          # print the commands only
    python benchmarks/numerics_study.py --smoke --root /tmp/ns --recipes bf16,tensorwise  # CPU

1. **Train** with the trainer's Hydra multirun, one job per recipe, all in ``<root>/<model>/``::

       nemo-fp8-train -m recipe=bf16,delayed,tensorwise,blockwise trainer.seed=1234 ...
       nemo-fp8-train -m recipe=mxfp8 recipe.emulate=true trainer.seed=1234 ...   # --emulate
       nemo-fp8-train -m recipe=bf16 trainer.seed=4321 run.tag=seed${trainer.seed} ...  # --noise-seeds

   Defaults: ``llama3_150m`` on the standard-library corpus, 600 optimizer steps x 8 sequences
   x 1024 tokens = 4,915,200 tokens per run (about 12 minutes for the six runs on one H200,
   docs/numerics.md), validation every 100 steps on 16 held-out micro-batches. The runs
   land in ``<root>/<model>/<recipe>`` and ``<root>/<model>/bf16-seed<N>``; ``trainer.resume=auto``
   (the trainer's default) makes the same command continue an interrupted study; a run the
   trainer stops (a non-finite loss: exit status 3) ends its multirun, and the report marks
   the runs that did not complete. Hydra
   overrides after the flags go to every run: ``model.outlier_channels=2
   model.outlier_scale=10000`` for the outlier stress (docs/numerics.md), ``hydra/launcher=
   submitit_nemo hydra.launcher.partition=...`` to train on SLURM (configs/hydra/launcher/).
2. **Compare** with ``nemo-fp8-compare`` over the run directories (baseline ``bf16``), for the
   training loss and the validation loss: ``<root>/<model>/compare/{train,val}/`` (PNG,
   Markdown, CSV, JSON). ``--max-rel-dev X`` passes its gate on.
3. **Report**: ``<root>/<model>/report.md`` and ``report.json`` — per run the final training
   loss (mean over the last ``--last`` steps) and validation loss, their deviation from BF16,
   the largest per-step deviation from BF16 (over all steps, and over the last ``--last``), the
   tokens/s, and the goal (final loss within 0.25% of BF16 for blockwise and mxfp8, 0.5% for
   tensorwise and delayed) beside the BF16 noise floor.

``--report-only`` runs steps 2 and 3 on existing runs. Exit status: 0 done, 1 a training
command failed or a run failed the ``--max-rel-dev`` gate, 2 bad arguments or no BF16 run to
compare against.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

RECIPES = ("bf16", "delayed", "tensorwise", "blockwise", "mxfp8")
#: |final loss / BF16 final loss - 1| at most this (DeepSeek-V3 reports < 0.25% for fine-grained FP8)
GOALS = {"blockwise": 0.0025, "mxfp8": 0.0025, "tensorwise": 0.005, "delayed": 0.005}
#: Settings of the study and of its CPU smoke version: flags, then the trainer overrides
FULL = dict(model="llama3_150m", steps=600, seq_len=1024, micro_batch=8, global_batch=8, last=100,
            overrides=("trainer.log_interval=10", "trainer.val_interval=100", "trainer.val_steps=16",
                       "trainer.ckpt_interval=200", "trainer.telemetry_interval=20"))
SMOKE = dict(model="llama3_tiny", steps=4, seq_len=64, micro_batch=2, global_batch=2, last=2,
             overrides=("model.num_layers=1", "data.max_files=20", "trainer.device=cpu", "trainer.log_interval=1",
                        "trainer.val_interval=2", "trainer.val_steps=2", "trainer.checkpoint=false",
                        "trainer.telemetry_interval=0", "trainer.progress=false"))


def _split(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def settings(a: argparse.Namespace) -> argparse.Namespace:
    """The flags with the preset (``--smoke`` or the full study) filled in where not given."""
    preset = SMOKE if a.smoke else FULL
    for key, value in preset.items():
        if key != "overrides" and getattr(a, key) is None:
            setattr(a, key, value)
    a.recipes, a.emulate = _split(a.recipes), _split(a.emulate)
    a.noise_seeds = [int(s) for s in _split(a.noise_seeds)]
    a.overrides = [*preset["overrides"], *a.extra]
    bad = [r for r in a.recipes + a.emulate if r not in RECIPES]
    if bad:
        raise ValueError(f"unknown recipe(s) {', '.join(bad)}; valid: {', '.join(RECIPES)}")
    if "bf16" not in a.recipes:
        raise ValueError("--recipes must include bf16: every recipe is compared with it")
    return a


def commands(a: argparse.Namespace) -> List[List[str]]:
    """The trainer's multirun commands (argv after ``nemo-fp8-train``): the recipes that run as
    they are, those of ``--emulate`` with ``recipe.emulate=true``, the BF16 noise-floor seeds."""
    common = [f"model={a.model}", f"trainer.max_steps={a.steps}", f"trainer.seq_len={a.seq_len}",
              f"trainer.micro_batch_size={a.micro_batch}", f"trainer.global_batch_size={a.global_batch}",
              f"run.root={a.root}", *a.overrides]
    plain = [r for r in a.recipes if r not in a.emulate]
    emulated = [r for r in a.recipes if r in a.emulate]
    out = [["-m", f"recipe={','.join(plain)}", f"trainer.seed={a.seed}", *common]]
    if emulated:
        out.append(["-m", f"recipe={','.join(emulated)}", "recipe.emulate=true", f"trainer.seed={a.seed}", *common])
    if a.noise_seeds:
        out.append(["-m", "recipe=bf16", f"trainer.seed={','.join(map(str, a.noise_seeds))}",
                    "run.tag=seed${trainer.seed}", *common])
    return out


def run_dirs(a: argparse.Namespace) -> Dict[str, Path]:
    """Run name -> directory, as the trainer names them (``<root>/<model>/<recipe>[-seed<N>]``)."""
    base = Path(a.root) / a.model
    dirs = {r: base / r for r in a.recipes}
    dirs.update({f"bf16-seed{s}": base / f"bf16-seed{s}" for s in a.noise_seeds})
    return dirs


def compare(dirs: Sequence[Path], out: Path, tag: str, last: int, max_rel_dev: Optional[float]) -> Optional[dict]:
    """``nemo-fp8-compare`` over ``dirs`` for ``tag`` into ``out`` (printed, then run in this
    process); its JSON export, or None when it could not compare (its message is printed)."""
    from nemo_fp8_recipes.compare import main as compare_main

    argv = [*map(str, dirs), "--tag", tag, "--last", str(last), "--baseline", "bf16", "--out", str(out),
            "--no-events", *(["--max-rel-dev", str(max_rel_dev)] if max_rel_dev is not None else [])]
    print(f"\n$ nemo-fp8-compare {shlex.join(argv)}", flush=True)
    rc = compare_main(argv)
    path = out / "compare.json"
    return json.loads(path.read_text()) if rc in (0, 1) and path.is_file() else None


def build_report(a: argparse.Namespace, dirs: Dict[str, Path], cmp: Dict[str, Optional[dict]]) -> dict:
    """The report's content: per run its final losses, deviations from BF16 and tokens/s (from
    the comparisons), whether it ran all its steps (its ``summary.json``), its goal."""
    res = {tag: {r["name"]: r for r in (c or {}).get("results", [])} for tag, c in cmp.items()}
    runs = {}
    for name, d in dirs.items():
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
        tr, va = res["train"].get(name, {}), res["val"].get(name, {})
        recipe = name.split("-seed")[0]
        goal = GOALS.get(recipe) if name == recipe else None
        dev = tr.get("final_vs_baseline")
        runs[name] = {
            "recipe": recipe, "dir": str(d), "complete": summary is not None and summary.get("steps") == a.steps,
            "steps": (summary or {}).get("steps"),
            "train_loss": tr.get("final_loss"), "train_vs_bf16": dev,
            "train_max_rel_dev": tr.get("max_rel_dev"), "train_max_rel_dev_last": tr.get("gate_rel_dev"),
            "val_loss": va.get("final_loss"), "val_vs_bf16": va.get("final_vs_baseline"),
            "val_max_rel_dev": va.get("max_rel_dev"),
            "tokens_per_s": tr.get("tokens_per_s"), "goal": goal,
            "within_goal": None if goal is None or dev is None else abs(dev) <= goal,
            "gate_passed": tr.get("passed")}
    noise = {n: r["train_vs_bf16"] for n, r in runs.items() if n.startswith("bf16-seed")}
    return {"model": a.model, "steps": a.steps, "tokens_per_step": a.global_batch * a.seq_len, "seed": a.seed,
            "last": a.last, "smoke": a.smoke, "overrides": a.overrides, "runs": runs, "noise_floor": noise,
            "compare": {tag: str(Path(a.root) / a.model / "compare" / tag) for tag in cmp if cmp[tag]}}


def _pct(x: Optional[float], signed: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{100 * x:+.3f}%" if signed else f"{100 * x:.3f}%"


def _num(x: Optional[float], spec: str) -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def report_markdown(rep: dict) -> str:
    """``report.md``: the settings, one table row per run, the noise floor, the comparisons."""
    def goal_cell(r):
        if r["goal"] is None:
            return "—"
        met = "—" if r["within_goal"] is None else "yes" if r["within_goal"] else "**no**"
        return f"±{100 * r['goal']:.2f}%: {met}"

    last, tokens = rep["last"], rep["tokens_per_step"]
    lines = [f"# Numerics study{' (SMOKE: tiny CPU run, no conclusions)' if rep['smoke'] else ''}", "",
             f"{rep['model']}, {rep['steps']} steps x {tokens:,} tokens = {rep['steps'] * tokens:,} tokens per run, "
             f"seed {rep['seed']}; final losses = mean over the last {last} steps (val: the validations there); "
             "deviations relative to bf16; tokens/s = the median of the logged values.", "",
             "| run | train loss | vs bf16 | max \\|rel dev\\| | max \\|rel dev\\| last "
             f"{last} | val loss | vs bf16 (val) | goal: within | tokens/s | complete |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rep["runs"].items():
        lines.append(f"| {name} | {_num(r['train_loss'], '.4f')} | {_pct(r['train_vs_bf16'])} | "
                     f"{_pct(r['train_max_rel_dev'], False)} | {_pct(r['train_max_rel_dev_last'], False)} | "
                     f"{_num(r['val_loss'], '.4f')} | {_pct(r['val_vs_bf16'])} | {goal_cell(r)} | "
                     f"{_num(r['tokens_per_s'], ',.0f')} | {'yes' if r['complete'] else '**no**'} |")
    if rep["noise_floor"]:
        floor = ", ".join(f"{n} {_pct(v)}" for n, v in rep["noise_floor"].items())
        lines += ["", f"BF16 noise floor (another seed, final train loss vs bf16): {floor}. A recipe's deviation "
                  "below it cannot be told apart from BF16 by these runs."]
    lines += ["", "Loss curves and per-step deviations: " + ", ".join(f"`{p}`" for p in rep["compare"].values())]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/numerics", help="run root (default %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list, bf16 included (default: all)")
    p.add_argument("--emulate", default="mxfp8",
                   help="recipes trained with recipe.emulate=true, e.g. mxfp8 on Hopper (default %(default)s)")
    p.add_argument("--noise-seeds", default="4321",
                   help="seeds of extra bf16 runs, the noise floor (comma list; '' for none; default %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="seed of every recipe's run (default %(default)s)")
    p.add_argument("--model", default=None, help="model config (default llama3_150m; smoke llama3_tiny)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 600)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--last", type=int, default=None, help="final-loss window in steps (default 100)")
    p.add_argument("--max-rel-dev", type=float, default=None, metavar="X",
                   help="nemo-fp8-compare's gate on the training loss: exit 1 when a run's max |rel dev| over the "
                        "last --last steps exceeds X (0.01 = 1%%)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU version (llama3_tiny, 4 steps): tests, CI")
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
    failed = False
    for cmd in [] if a.report_only else commands(a):
        print(f"$ nemo-fp8-train {shlex.join(cmd)}", flush=True)
        if not a.dry_run:
            rc = subprocess.run([sys.executable, "-m", "nemo_fp8_recipes.train", *cmd]).returncode
            if rc != 0:
                print(f"numerics_study: the training command exited with {rc} (the trainer's message is above); "
                      "the runs it did not reach are marked incomplete: the same command again resumes them, "
                      "--recipes leaves out a run that stopped", file=sys.stderr)
                failed = True
    if a.dry_run:
        return 0
    dirs = run_dirs(a)
    found = [d for d in dirs.values() if any(d.glob("events.out.tfevents.*"))]  # (runs that logged)
    if dirs["bf16"] not in found:
        print(f"numerics_study: error: no bf16 run in {dirs['bf16']} to compare against", file=sys.stderr)
        return 2
    out = Path(a.root) / a.model
    cmp = {"train": compare(found, out / "compare" / "train", "train/loss", a.last, a.max_rel_dev),
           "val": compare(found, out / "compare" / "val", "val/loss", a.last, None)}
    if cmp["train"] is None:
        print("numerics_study: error: the training losses could not be compared (see above)", file=sys.stderr)
        return 2
    rep = build_report(a, dirs, cmp)
    md = report_markdown(rep)
    (out / "report.md").write_text(md, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    print("\n" + md + f"\nreport: {out / 'report.md'}, {out / 'report.json'}")
    return 1 if failed or cmp["train"].get("passed") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
