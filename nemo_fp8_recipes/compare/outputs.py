"""What ``nemo-fp8-compare`` writes: the PNG (loss curves overlaid above the relative deviation),
``compare.{md,csv,json}``, and ``deviation/<run>`` TensorBoard runs with ``compare/rel_dev``, which
fill the deviation chart of the custom-scalars layout (:func:`tensorboard_layout`) that the
trainer writes into every run."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Dict, List, Optional

from .reading import EVENTS_GLOB, CompareError
from .statistics import Comparison

__all__ = [
    "DEVIATION_TAG",
    "DEVIATION_LOW_TAG",
    "DEVIATION_HIGH_TAG",
    "tensorboard_layout",
    "plot",
    "write_outputs",
    "write_deviation_events",
]

DEVIATION_TAG = "compare/rel_dev"
#: with several seeds: the bounds of the 95% interval of a group's mean deviation, per step
DEVIATION_LOW_TAG, DEVIATION_HIGH_TAG = "compare/rel_dev_low", "compare/rel_dev_high"


def tensorboard_layout() -> Dict[str, Dict[str, list]]:
    """The custom-scalars layout (TensorBoard's *Custom Scalars* tab) written into every run:
    one chart per metric with every run overlaid, and the deviation chart that
    ``nemo-fp8-compare`` fills (``deviation/<run>`` runs with ``compare/rel_dev``). Tags are
    regular expressions."""
    return {
        "FP8 recipes (every run overlaid)": {
            "train/loss": ["Multiline", [r"^train/loss$"]],
            "val/loss": ["Multiline", [r"^val/loss$"]],
            "tokens/s": ["Multiline", [r"^tokens_per_s$"]],
            "grad norm": ["Multiline", [r"^grad_norm$"]],
        },
        "FP8 compare (nemo-fp8-compare)": {
            "relative deviation from the baseline, (run - baseline) / baseline": ["Multiline", [r"^compare/rel_dev$"]],
            "relative deviation, mean over seeds with its 95% interval": [
                "Margin",
                [DEVIATION_TAG, DEVIATION_LOW_TAG, DEVIATION_HIGH_TAG],
            ],
        },
    }


def plot(comparison: Comparison, path: Optional[Path] = None):
    """Loss curves overlaid (one line per run, baseline thicker) above the relative deviation from
    the baseline in percent (gate band and window shaded). With several seeds: one line per group
    (its mean over seeds, the seeds' range shaded) and each group's mean paired deviation with its
    95% interval, beside the baseline's seed-to-seed spread. Saves a PNG to ``path`` if given;
    returns the matplotlib Figure (Agg backend, no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("the PNG needs matplotlib: pip install matplotlib (or pass --no-png)") from None

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7.5), dpi=110, layout="constrained")
    ax_loss, ax_dev = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [g.label for g in comparison.groups] if comparison.seeded else [r.name for r in comparison.runs]
    color = {n: colors[i % len(colors)] for i, n in enumerate(names)}
    if comparison.seeded:
        _plot_groups(comparison, ax_loss, ax_dev, color)
    else:
        _plot_runs(comparison, ax_loss, ax_dev, color)
    what = f"{len(comparison.groups)} groups over seeds" if comparison.seeded else f"{len(comparison.runs)} runs"
    ax_loss.set_ylabel(comparison.tag + (f" (smoothed, {comparison.smooth} pts)" if comparison.smooth > 1 else ""))
    ax_loss.set_title(f"{comparison.tag}: {what}, baseline {comparison.baseline}")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper right")
    ax_dev.axhline(0.0, color=color[comparison.baseline], linewidth=1.0)
    if comparison.max_rel_dev is not None:
        g = 100 * comparison.max_rel_dev
        ax_dev.axhspan(-g, g, color="tab:green", alpha=0.08, label=f"gate ±{g:.3g}%")
    windows = [s.gate_window for s in comparison.stats if s.gate_window]
    if windows:
        ax_dev.axvspan(
            min(w[0] for w in windows),
            max(w[1] for w in windows),
            color="tab:olive",
            alpha=0.10,
            label=f"final-loss window (last {comparison.last} steps)",
        )
    ax_dev.set_ylabel(f"rel. deviation from {comparison.baseline} [%]")
    ax_dev.set_xlabel("step")
    ax_dev.grid(alpha=0.3)
    if ax_dev.get_legend_handles_labels()[0]:
        ax_dev.legend(loc="upper right", fontsize="small")
    if path is not None:
        fig.savefig(str(path))
    return fig


def _plot_runs(comparison: Comparison, ax_loss, ax_dev, color) -> None:
    for r in comparison.runs:
        steps, vals = comparison.curve(r.name)
        is_base = r.name == comparison.baseline
        ax_loss.plot(
            steps,
            vals,
            label=f"{r.name} (baseline)" if is_base else r.name,
            color=color[r.name],
            linewidth=3.0 if is_base else 1.4,
            zorder=1 if is_base else 2,
        )
    for s in comparison.stats:
        if s.baseline or s.name not in comparison.deviations:
            continue
        steps, dev = comparison.deviations[s.name]
        ax_dev.plot(steps, [100 * d for d in dev], color=color[s.name], linewidth=1.4, label=s.name)


def _plot_groups(comparison: Comparison, ax_loss, ax_dev, color) -> None:
    for g in comparison.groups:
        curves = [dict(zip(*comparison.curve(r.name))) for r in comparison.group_members(g.label)]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = [[c[t] for c in curves] for t in steps]
        n = len(curves)
        label = f"{g.label} ({n} seed{'s' if n > 1 else ''}{', baseline' if g.baseline else ''})"
        ax_loss.plot(
            steps,
            [sum(v) / n for v in vals],
            label=label,
            color=color[g.label],
            linewidth=3.0 if g.baseline else 1.4,
            zorder=1 if g.baseline else 2,
        )
        if n > 1:
            ax_loss.fill_between(
                steps, [min(v) for v in vals], [max(v) for v in vals], color=color[g.label], alpha=0.15, linewidth=0
            )
    spread_steps, spread = comparison.seed_spread
    if spread_steps:
        ax_dev.fill_between(
            spread_steps,
            [-100 * v for v in spread],
            [100 * v for v in spread],
            color="grey",
            alpha=0.18,
            linewidth=0,
            label=f"{comparison.baseline} seed-to-seed spread (±1 sd)",
        )
    for g in comparison.groups:
        if g.baseline or g.label not in comparison.group_deviations:
            continue
        steps, mean, lo, hi = comparison.group_deviations[g.label]
        ax_dev.plot(steps, [100 * d for d in mean], color=color[g.label], linewidth=1.4, label=g.label)
        if any(a != b for a, b in zip(lo, hi)):
            ax_dev.fill_between(
                steps, [100 * d for d in lo], [100 * d for d in hi], color=color[g.label], alpha=0.2, linewidth=0
            )


def write_deviation_events(comparison: Comparison, out_dir: Path) -> List[Path]:
    """TensorBoard runs ``<out_dir>/deviation/<run>`` with the scalar ``compare/rel_dev`` (a
    fraction) at each aligned step, plus the custom-scalars layout; with several seeds one run per
    group, ``deviation/<group>``, holding the mean over seeds and the interval's bounds
    (``compare/rel_dev_low`` / ``_high``). Old event files there are replaced. Returns the run
    directories written."""
    from torch.utils.tensorboard import SummaryWriter

    if comparison.seeded:
        series = {
            k: {DEVIATION_TAG: (v[0], v[1]), DEVIATION_LOW_TAG: (v[0], v[2]), DEVIATION_HIGH_TAG: (v[0], v[3])}
            for k, v in comparison.group_deviations.items()
        }
    else:
        series = {k: {DEVIATION_TAG: v} for k, v in comparison.deviations.items()}
    written = []
    for name, tags in series.items():
        d = Path(out_dir) / "deviation" / name.replace("/", "__")
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob(EVENTS_GLOB):
            old.unlink()
        w = SummaryWriter(log_dir=str(d))
        w.add_custom_scalars(tensorboard_layout())
        for tag, (steps, values) in tags.items():
            for s, v in zip(steps, values):
                w.add_scalar(tag, v if math.isfinite(v) else float("nan"), global_step=s)
        w.close()
        written.append(d)
    return written


def write_outputs(comparison: Comparison, out_dir: Path, *, png: bool = True, events: bool = True) -> Dict[str, Path]:
    """Write ``compare.{md,csv,json,png}``, ``compare_groups.csv`` (the seed table) and the deviation
    runs into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "compare.md", "csv": out_dir / "compare.csv", "json": out_dir / "compare.json"}
    paths["markdown"].write_text(comparison.to_markdown(), encoding="utf-8")
    paths["csv"].write_text(comparison.to_csv(), encoding="utf-8")
    paths["groups csv"] = out_dir / "compare_groups.csv"
    paths["groups csv"].write_text(comparison.groups_csv(), encoding="utf-8")
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(comparison.to_json(), encoding="utf-8")
    os.replace(tmp, paths["json"])
    if png:
        paths["png"] = out_dir / "compare.png"
        plot(comparison, paths["png"])
    if events:
        write_deviation_events(comparison, out_dir)
        paths["deviation"] = out_dir / "deviation"
    return paths
