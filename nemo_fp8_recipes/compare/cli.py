"""``nemo-fp8-compare``: loss curves from TensorBoard event files, overlaid across recipes, with a
table of deviation from the BF16 run and of throughput, and a pass/fail gate.

::

    nemo-fp8-compare runs/llama3_tiny                       # every run under it (bf16 = baseline)
    nemo-fp8-compare runs/llama3_tiny/{bf16,tensorwise,blockwise} --last 50 --max-rel-dev 0.01
    nemo-fp8-compare --from-json runs/llama3_tiny/compare/compare.json --smooth 5   # re-render

What it computes (all from the same, optionally smoothed, curves; :func:`compare_runs`):

- **Runs** are directories holding ``events.out.tfevents.*`` files (the trainer's run directories
  ``runs/<model>/<recipe>[-<tag>]``); a directory without event files stands for every run below
  it. A run is named by its directory (``recipe[-tag]``), with the parent added when two share it.
- **Curves**: the scalar ``--tag`` (default ``train/loss``) by step, read with TensorBoard's
  ``EventAccumulator`` (resumed runs: the trainer purges the steps it re-runs, so one value per step).
- **Smoothing** (``--smooth N``, default 1 = off): a trailing moving average over the last N
  logged points of each run (the window is shorter at the start). Plots, deviations and final
  losses all use the smoothed curves.
- **Baseline**: ``--baseline NAME``; by default the run named ``bf16`` (else one named
  ``bf16-<tag>``), else the first run.
- **Relative deviation** at each step logged by both the run and the baseline (steps are aligned
  by value; steps only one of them logged are ignored): ``(run - baseline) / baseline``.
  ``max |rel dev|`` and ``mean |rel dev|`` are over all aligned steps.
- **Final loss**: the mean of a run's curve over its last ``--last N`` training steps (the points
  with ``step > last_step - N``; at least the last point). ``final vs baseline`` is the relative
  difference of the two final losses.
- **Gate** (``--max-rel-dev X``): a run fails when ``max |rel dev|`` over the *gate window* — the
  aligned steps with ``step > S - N``, ``S`` the **baseline's** last step, ``N = --last`` —
  exceeds X (a fraction: 0.01 = 1%). It also fails, with the reason, when the run ended before
  ``S`` (stopped early, or its event file was cut short), when no step of the window was logged
  by both, or when an event file of the run or of the baseline is truncated or corrupt (a record
  that fails TensorBoard's length/CRC check: everything after it would be silently missing).
  The early, fast-falling part of the curve is left out on purpose: there the relative deviation
  measures the warm-up, not the recipe. The exit status is 1 when any run fails, 0 otherwise, 2
  for usage/data errors. Recipes run at several seeds are judged as groups on the 95% interval
  of their final-loss deviation, paired by seed, by the rule ``--gate`` names: ``within`` (the
  default: pass only when the interval lies within ±X) or ``regression`` (fail only when it lies
  above +X) — :mod:`.seeds` defines both.
- **Up to a step** (``--until S``): every curve is cut after step ``S`` first, so runs still
  training (or stopped early) are compared over the steps all of them reached, as if they had
  ended there.
- **Throughput**: the median of each run's ``tokens_per_s`` scalar; ``speedup`` = run tokens/s /
  baseline tokens/s (``n/a`` when a run did not log it).

Outputs in ``--out`` (default ``<common parent of the runs>/compare``): ``compare.png`` (loss
curves overlaid + relative-deviation panel), ``compare.md``, ``compare.csv``, ``compare.json``
(settings, every run's raw curve and tokens/s, and the results; ``--from-json`` re-imports it and
re-renders everything, with new ``--smooth``/``--last``/``--max-rel-dev``/``--baseline`` if given)
and ``deviation/<run>/`` TensorBoard runs holding the scalar ``compare/rel_dev``, so that
``tensorboard --logdir <parent>`` shows the deviation chart of the custom-scalars layout
(:func:`tensorboard_layout`, written into every training run by the trainer) next to the overlay.

This module is the command line; the code behind it: reading runs (:mod:`.reading`), the
numbers and their tables (:mod:`.statistics`), the seed groups (:mod:`.seeds`), the files
written (:mod:`.outputs`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .outputs import write_outputs
from .reading import (
    DEFAULT_TAG,
    EVENTS_GLOB,
    OUTPUT_MARKER,
    TOKENS_TAG,
    CompareError,
    load_run,
    resolve_run_dirs,
    run_names,
    up_to_step,
)
from .seeds import GATE_RULES, pct, shown_within
from .statistics import Comparison, check_max_rel_dev, compare_runs

__all__ = ["main"]


# ---- command line -----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nemo-fp8-compare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Compare loss curves of training runs from their TensorBoard event files: a PNG (curves\n"
            "overlaid + relative deviation from the baseline), a Markdown and a CSV table (final loss,\n"
            "max/mean relative deviation, tokens/s, speedup), a JSON export, and a pass/fail gate."
        ),
        epilog=(
            "definitions:\n"
            "  rel dev      (run - baseline) / baseline at every step both runs logged\n"
            "  final loss   mean of the curve over the last --last steps of the run\n"
            "  gate         one seed per run: fails a run whose max |rel dev| over the steps both logged\n"
            "               in the baseline's last --last steps (step > S - N, S = the baseline's last\n"
            "               step) exceeds --max-rel-dev; also a run that ended before S, or whose event\n"
            "               files (or the baseline's) are truncated or corrupt, with the reason.\n"
            "               Several seeds per recipe (runs differing only in trainer.seed): judged on the\n"
            "               95% interval over seeds of the final-loss deviation, paired by seed;\n"
            "               --gate within passes a group only when the interval lies within +-X,\n"
            "               --gate regression fails it only when the interval lies above +X\n"
            "  tokens/s     median of the run's tokens_per_s scalar; speedup = over the baseline's\n"
            "  smoothing    trailing moving average over --smooth logged points (1 = off), applied\n"
            "               before every number above\n\n"
            "examples:\n"
            "  nemo-fp8-compare runs/llama3_tiny\n"
            "  nemo-fp8-compare runs/llama3_tiny/bf16 runs/llama3_tiny/blockwise --last 50 --max-rel-dev 0.02\n"
            "  nemo-fp8-compare --from-json runs/llama3_tiny/compare/compare.json --smooth 5\n\n"
            "exit status: 0 ok, 1 a run failed the gate, 2 bad arguments or unreadable runs"
        ),
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN_DIR",
        help="run directories (holding events.out.tfevents.*), or a parent of several runs",
    )
    p.add_argument(
        "--baseline",
        metavar="RUN",
        default=None,
        help="run to compare against (name or path); default: the run named bf16, else the first",
    )
    p.add_argument(
        "--tag",
        default=None,
        help=f"scalar to compare (default: the training loss, {DEFAULT_TAG} of "
        "nemo-fp8-train runs, 'lm loss' of Megatron-Bridge runs or 'reduced_train_loss' of NeMo 2 runs; "
        "e.g. val/loss)",
    )
    p.add_argument("--tokens-tag", default=None, help=f"throughput scalar (default {TOKENS_TAG})")
    p.add_argument(
        "--smooth",
        type=int,
        default=None,
        metavar="N",
        help="trailing moving average over N logged points before everything (default 1 = off)",
    )
    p.add_argument(
        "--last", type=int, default=None, metavar="N", help="final-loss and gate window in training steps (default 100)"
    )
    p.add_argument(
        "--until",
        type=int,
        default=None,
        metavar="STEP",
        help="compare the curves up to this training step only (runs still training, or cut short)",
    )
    p.add_argument(
        "--max-rel-dev",
        type=float,
        default=None,
        metavar="X",
        help="gate: fail (exit 1) when a run's max |rel dev| in the window exceeds X (0.01 = 1%%); with "
        "several seeds per recipe, by the rule of --gate on the 95%% interval over seeds",
    )
    p.add_argument(
        "--gate",
        choices=GATE_RULES,
        default=None,
        help="the gate's rule for recipes run at several seeds: within (default) passes a recipe only when "
        "the 95%% interval of its final-loss deviation lies within +-X (the seeds show it equivalent); "
        "regression fails it only when the interval lies above +X (the seeds show it worse), and passes "
        "what they cannot resolve, saying so",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory (default: <common parent of the runs>/compare, or the JSON's directory)",
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="re-import a compare.json instead of reading event files, and re-render",
    )
    p.add_argument("--no-png", action="store_true", help="skip the PNG")
    p.add_argument("--no-events", action="store_true", help="skip the deviation/<run> TensorBoard runs")
    return p


def default_out_dir(paths: Sequence[str]) -> Path:
    """``<common parent of the runs>/compare``; an error when the runs share no directory but the
    file system's root or a home directory (outputs must not land in ``/compare``)."""
    parents = {str(Path(p).resolve().parent) for p in paths}
    try:
        common = Path(os.path.commonpath(list(parents)))
    except ValueError:
        common = None
    if common is None or common == Path(common.anchor) or common in (Path.home(), Path.home().parent):
        raise CompareError(
            f"the runs share no directory of their own (only {common or 'nothing'}): give --out DIR for the outputs"
        )
    return common / "compare"


def _check_out_is_no_run(out: Path, run_dirs: Sequence[Path]) -> None:
    """``--out`` must not be (or lie inside) a run: the outputs mark their directory as this tool's
    (compare.json), and later comparisons would skip the run there without a word."""
    target = out.resolve()
    for d in run_dirs:
        d = d.resolve()
        if target == d or d in target.parents:
            raise CompareError(
                f"--out {out} is {'the' if target == d else 'inside the'} run directory {d}: the outputs there "
                "would make later comparisons skip that run; give a directory of its own (the default is "
                "<common parent of the runs>/compare)"
            )
    if out.is_dir() and not (out / OUTPUT_MARKER).is_file():
        held = [n for n in ("config.yaml", "summary.json", "checkpoints") if (out / n).exists()]
        if held or any(out.glob(EVENTS_GLOB)):
            raise CompareError(
                f"--out {out} holds a run ({', '.join(held) or 'TensorBoard event files'}): the outputs there would "
                "make later comparisons skip it; give a directory of its own"
            )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``nemo-fp8-compare`` (also ``python -m nemo_fp8_recipes.compare``)."""
    args = _parser().parse_args(argv)
    try:
        checks = (("--smooth", args.smooth, 1), ("--last", args.last, 1), ("--until", args.until, 1))
        for flag, value, minimum in checks:
            if value is not None and value < minimum:
                raise CompareError(
                    f"{flag} must be >= {minimum}, got {value}"
                    + (" (1 = no smoothing)" if flag == "--smooth" else " (training steps)")
                )
        check_max_rel_dev(args.max_rel_dev)
        if args.from_json:
            if args.runs:
                raise CompareError("give either RUN_DIRs or --from-json, not both")
            src = Path(args.from_json)
            if not src.is_file():
                raise CompareError(f"--from-json {src}: no such file")
            if args.tag is not None or args.tokens_tag is not None or args.until is not None:
                raise CompareError(
                    "--tag/--tokens-tag/--until cannot change a JSON export (it holds one tag, as compared); "
                    "compare the run directories again instead"
                )
            try:
                text = src.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CompareError(f"--from-json {src}: cannot be read as text ({e})") from None
            comparison = Comparison.from_json(
                text,
                baseline=args.baseline,
                smooth=args.smooth,
                last=args.last,
                max_rel_dev=args.max_rel_dev,
                gate=args.gate,
            )
            out = Path(args.out) if args.out else src.parent
        else:
            if not args.runs:
                _parser().print_usage(sys.stderr)
                raise CompareError("give at least one RUN_DIR (or --from-json FILE)")
            dirs = resolve_run_dirs(args.runs)
            tag = args.tag  # None: each run's training loss (train/loss, Bridge's "lm loss", NeMo 2's)
            tokens_tag = args.tokens_tag or TOKENS_TAG
            runs = [load_run(d, tag, tokens_tag, name=n) for d, n in zip(dirs, run_names(dirs))]
            if args.until is not None:
                runs = [up_to_step(r, args.until) for r in runs]
            comparison = compare_runs(
                runs,
                baseline=args.baseline,
                smooth=1 if args.smooth is None else args.smooth,
                last=100 if args.last is None else args.last,
                max_rel_dev=args.max_rel_dev,
                tokens_tag=tokens_tag,
                gate=args.gate or "within",
            )
            out = Path(args.out) if args.out else default_out_dir([str(d) for d in dirs])
        if out.exists() and not out.is_dir():
            raise CompareError(
                f"--out {out} is a file; give a directory (it receives compare.md, .csv, .json, .png and deviation/)"
            )
        _check_out_is_no_run(out, [Path(r.path) for r in comparison.runs if r.path])
        for r in comparison.runs:
            for problem in r.problems:
                print(f"nemo-fp8-compare: warning: run {r.name}: {problem}", file=sys.stderr)
        try:
            paths = write_outputs(comparison, out, png=not args.no_png, events=not args.no_events)
        except OSError as e:  # a read-only or full file system, a missing mount
            raise CompareError(
                f"cannot write the outputs to {out} ({e.strerror or e}"
                + (f": {e.filename}" if getattr(e, "filename", None) else "")
                + "): give a writable --out"
            ) from None
    except CompareError as e:
        print(f"nemo-fp8-compare: error: {e}", file=sys.stderr)
        return 2
    print(comparison.to_markdown())
    for kind, p in paths.items():
        print(f"{kind + ':':10s} {p}")
    if "deviation" in paths:
        try:
            logdir = os.path.commonpath(
                [str(Path(r.path).resolve().parent) for r in comparison.runs] + [str(out.resolve())]
            )
        except ValueError:
            logdir = str(out)
        print(f"TensorBoard: tensorboard --logdir {logdir}   (Custom Scalars tab: overlay + deviation)")
    if not comparison.passed:
        lines = "\n".join(f"  {name}: {why}" for name, why in comparison.failures)
        rule = (
            (
                f"95% interval over seeds within ±{pct(comparison.max_rel_dev)}"
                if comparison.gate == "within"
                else f"regression: 95% interval over seeds above +{pct(comparison.max_rel_dev)} fails"
            )
            if comparison.seeded
            else f"max |rel dev| <= {pct(comparison.max_rel_dev)} over the baseline's last {comparison.last} steps"
        )
        print(f"GATE FAILED ({rule}):\n{lines}", file=sys.stderr)
        return 1
    if comparison.max_rel_dev is not None:
        if comparison.seeded and comparison.gate == "regression":
            unresolved = [
                g.label
                for g in comparison.groups
                if not g.baseline and g.interval is not None and not shown_within(g.interval, comparison.max_rel_dev)
            ]
            print(
                f"gate passed (regression): no group's loss shown more than {pct(comparison.max_rel_dev)} above "
                f"{comparison.baseline}"
                + (
                    f"; not resolved within ±{pct(comparison.max_rel_dev)} either: {', '.join(unresolved)} "
                    "(more seeds or longer runs narrow their intervals)"
                    if unresolved
                    else f"; every group shown within ±{pct(comparison.max_rel_dev)}"
                )
            )
        elif comparison.seeded:
            print(
                f"gate passed: every group's 95% interval over seeds within ±{pct(comparison.max_rel_dev)} of "
                f"{comparison.baseline}"
            )
        else:
            print(
                f"gate passed: every run within {pct(comparison.max_rel_dev)} of {comparison.baseline} "
                "(one seed each: this cannot separate FP8 from seed noise; see the notes)"
            )
    return 0
