"""Plot a Llama layer's FP8 speed-up over BF16 against model size, ours beside Transformer Engine's.

Reads the JSON that ``benchmarks/layer_fwd_bwd.py --out`` writes (one file per size, or one file
holding several such outputs under ``"runs"``), takes the compiled round, and draws per recipe the
speed-up over our compiled BF16 layer of the same run: solid lines ours, dashed lines
``te.TransformerLayer`` (TE eager, timed in the same round), dotted lines torchao's
``convert_to_float8_training`` (compiled; its ``tensorwise`` and ``rowwise`` recipes) where the
run has them::

    python benchmarks/plot_layer_speedup.py docs/results/layer_te_torchao_h100_2026-12-05.json \\
        --out docs/img/layer_speedup_h100_2026-12-05.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: one colour per recipe, the same in every plot of the docs
RECIPE_COLORS = {
    "bf16": "tab:gray",
    "tensorwise": "tab:blue",
    "blockwise": "tab:green",
    "delayed": "tab:orange",
    "mxfp8": "tab:purple",
    "rowwise": "tab:brown",
}
#: line style and legend label per implementation
IMPLS = {"ours": ("-", "ours, compiled"), "te": ("--", "TE layer, eager"), "torchao": (":", "torchao, compiled")}
SIZES = ("8b", "70b", "405b")


def rows_of(data: dict) -> list:
    """The result rows of one ``layer_fwd_bwd.py`` output, or of every output under ``"runs"``."""
    runs = data.get("runs", [data])
    return [dict(r, device=run.get("device")) for run in runs for r in run.get("results", [])]


def speedups(rows: list, mode: str = "compiled") -> dict:
    """``{(impl, recipe): {size: speed-up over our BF16 of the same run}}``, ``impl`` "ours",
    "te" or "torchao"; a size measured in several runs keeps the last."""
    out: dict = {}
    for r in rows:
        if r.get("mode") != mode or r.get("status") != "ok" or r.get("speedup") is None:
            continue
        v = r["variant"]
        impl, recipe = next(((i, v[len(i) + 1 :]) for i in ("te", "torchao") if v.startswith(i + "-")), ("ours", v))
        if recipe not in RECIPE_COLORS:
            continue
        out.setdefault((impl, recipe), {})[r["size"]] = r["speedup"]
    return out


def plot(rows: list, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = speedups(rows)
    if not sp:
        raise SystemExit("plot_layer_speedup: no compiled rows with a BF16 baseline in the input")
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    sizes = [s for s in SIZES if any(s in v for v in sp.values())]
    xs = {s: i for i, s in enumerate(sizes)}
    for (impl, recipe), by_size in sorted(sp.items()):
        pts = [(xs[s], by_size[s]) for s in sizes if s in by_size]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            color=RECIPE_COLORS[recipe],
            linestyle=IMPLS[impl][0],
            label=f"{recipe} ({IMPLS[impl][1]})",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sizes)), [f"Llama 3 {s.upper()}" for s in sizes])
    ax.set_ylabel("speed-up over our compiled BF16 layer (×)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="layer_fwd_bwd.py JSON outputs")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default=None, help="plot title (default: from the inputs' device and sequence)")
    a = p.parse_args(argv)
    rows, meta = [], {}
    for f in a.inputs:
        data = json.loads(Path(f).read_text())
        rows += rows_of(data)
        first = data.get("runs", [data])[0]
        meta = {"device": first.get("device"), "seq": first.get("seq"), "date": data.get("date")}
    title = a.title or (
        f"Llama 3 layer fwd+bwd, seq {meta['seq']}, real FP8 on {meta['device']}"
        + (f" ({meta['date']})" if meta.get("date") else "")
    )
    plot(rows, Path(a.out), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
