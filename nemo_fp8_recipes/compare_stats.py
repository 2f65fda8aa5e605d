"""The numbers of ``nemo-fp8-compare``: smoothing, the baseline, relative deviation, final loss,
throughput and the pass/fail gate (:func:`compare_runs`, every definition in the docstring of
:mod:`nemo_fp8_recipes.compare`), and the :class:`Comparison` they make, with its Markdown, CSV
and JSON forms (:meth:`Comparison.from_json` re-imports the JSON and computes everything again)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .compare_io import TOKENS_TAG, CompareError, RunSeries

__all__ = [
    "JSON_VERSION",
    "RunStats",
    "Comparison",
    "moving_average",
    "compare_runs",
]

JSON_VERSION = 2
_JSON_VERSIONS = (1, 2)  # 1: before event-file checks and gate reasons; still re-imported


def moving_average(values: Sequence[float], n: int) -> List[float]:
    """Trailing moving average over the last ``n`` points (shorter window at the start); n <= 1:
    the values unchanged."""
    if n <= 1:
        return [float(v) for v in values]
    out, acc = [], 0.0
    window: List[float] = []
    for v in values:
        window.append(float(v))
        acc += float(v)
        if len(window) > n:
            acc -= window.pop(0)
        out.append(acc / len(window))
    return out


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _abs_max(xs: Sequence[float]) -> Optional[float]:
    if not xs:
        return None
    return max(abs(x) if math.isfinite(x) else math.inf for x in xs)


@dataclass
class RunStats:
    """One row of the table (fractions, not percent). ``None`` = not applicable (baseline) or
    not available (no tokens/s logged, no aligned steps). ``reasons``: why the run cannot be
    judged in full (it ended before the baseline, damaged event files, ...) or failed the gate."""

    name: str
    path: str
    baseline: bool
    last_step: Optional[int]
    aligned_steps: int
    final_loss: Optional[float]
    final_vs_baseline: Optional[float]
    max_rel_dev: Optional[float]
    mean_rel_dev: Optional[float]
    gate_rel_dev: Optional[float]
    gate_window: Optional[Tuple[int, int]]
    tokens_per_s: Optional[float]
    speedup: Optional[float]
    passed: Optional[bool]
    reasons: List[str] = field(default_factory=list)


@dataclass
class Comparison:
    """The result of :func:`compare_runs`: settings, the runs' curves, per-run stats and the
    per-step deviations ``{run: (steps, rel_dev)}``."""

    tag: str
    baseline: str
    smooth: int
    last: int
    max_rel_dev: Optional[float]
    runs: List[RunSeries]
    stats: List[RunStats]
    deviations: Dict[str, Tuple[List[int], List[float]]]
    tokens_tag: str = TOKENS_TAG

    @property
    def passed(self) -> bool:
        """No run failed the gate (always True without ``max_rel_dev``)."""
        return all(s.passed is not False for s in self.stats)

    @property
    def failures(self) -> List[RunStats]:
        """The runs that failed the gate."""
        return [s for s in self.stats if s.passed is False]

    def curve(self, name: str) -> Tuple[List[int], List[float]]:
        """The (smoothed) curve of run ``name`` as used for every number."""
        r = next(r for r in self.runs if r.name == name)
        return r.steps, moving_average(r.values, self.smooth)

    # ---- tables ----
    def settings_line(self) -> str:
        """One line describing how the numbers were computed."""
        sm = "none" if self.smooth <= 1 else f"trailing moving average over {self.smooth} points"
        gate = (f"max |rel dev| over the baseline's last {self.last} steps <= {_pct(self.max_rel_dev)}, "
                "every run reaching the baseline's last step"
                if self.max_rel_dev is not None else "off (--max-rel-dev)")
        return (f"tag `{self.tag}`, baseline **{self.baseline}**, smoothing: {sm}, final loss: mean over "
                f"the last {self.last} steps, gate: {gate}")

    def to_markdown(self) -> str:
        """The table as Markdown (deviations in percent)."""
        head = ["run", "final loss", "final vs baseline", "max \\|rel dev\\|", "mean \\|rel dev\\|",
                f"max \\|rel dev\\| last {self.last}", "tokens/s", "speedup", "gate"]
        lines = [self.settings_line(), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in self.stats:
            name = f"{s.name} (baseline)" if s.baseline else s.name
            gate = "—" if s.passed is None else ("pass" if s.passed else "**FAIL**")
            row = [name, _num(s.final_loss, 4), _pct(s.final_vs_baseline, signed=True), _pct(s.max_rel_dev),
                   _pct(s.mean_rel_dev), _pct(s.gate_rel_dev), _num(s.tokens_per_s, 0, thousands=True),
                   "—" if s.speedup is None else f"{s.speedup:.2f}×", gate]
            lines.append("| " + " | ".join(row) + " |")
        notes = [f"- **{s.name}**: {why}" for s in self.stats for why in s.reasons]
        if notes:
            lines += ["", "Notes:", *notes]
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """The table as CSV, full precision, fractions (not percent); empty cells = n/a."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = ["run", "path", "baseline", "last_step", "aligned_steps", "final_loss", "final_vs_baseline",
                "max_rel_dev", "mean_rel_dev", "gate_rel_dev", "gate_first_step", "gate_last_step",
                "tokens_per_s", "speedup", "passed", "reasons"]
        w.writerow(cols)
        for s in self.stats:
            d = asdict(s)
            gw = d.pop("gate_window") or (None, None)
            d["gate_first_step"], d["gate_last_step"] = gw
            d["run"] = d.pop("name")
            d["reasons"] = "; ".join(d["reasons"]) or None
            w.writerow(["" if d[c] is None else repr(d[c]) if isinstance(d[c], float) else d[c] for c in cols])
        return buf.getvalue()

    def to_dict(self) -> dict:
        """Everything needed to re-render: settings, raw curves, results."""
        return {
            "version": JSON_VERSION,
            "settings": {"tag": self.tag, "tokens_tag": self.tokens_tag, "baseline": self.baseline,
                         "smooth": self.smooth, "last": self.last, "max_rel_dev": self.max_rel_dev},
            "runs": [asdict(r) for r in self.runs],
            "results": [asdict(s) for s in self.stats],
            "deviations": {k: {"steps": v[0], "rel_dev": v[1]} for k, v in self.deviations.items()},
            "passed": self.passed,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON (non-finite numbers as null)."""
        return json.dumps(_finite(self.to_dict()), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, **changes) -> "Comparison":
        """Re-import :meth:`to_json` output. The stored curves are re-analysed, with any of
        ``baseline``, ``smooth``, ``last``, ``max_rel_dev`` changed (``None`` keeps the stored one).
        Text that is not such an export raises :class:`CompareError` saying what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise CompareError(f"not valid JSON ({e}); give a compare.json written by nemo-fp8-compare") from None
        if not isinstance(data, dict) or data.get("version") not in _JSON_VERSIONS or "runs" not in data:
            raise CompareError(f"not a nemo-fp8-compare JSON export (a version {JSON_VERSION} object with 'runs')")
        try:
            st = dict(data["settings"])
            for k, v in changes.items():
                if v is not None:
                    st[k] = v
            fields = {f.name for f in dataclasses.fields(RunSeries)}
            runs = []
            for r in data["runs"]:
                if not isinstance(r, dict) or not {"name", "path", "tag", "steps", "values"} <= set(r):
                    raise CompareError("a run entry lacks name/path/tag/steps/values")
                r = {k: v for k, v in r.items() if k in fields}
                r["values"] = [math.nan if v is None else float(v) for v in r["values"]]
                r["steps"] = [int(v) for v in r["steps"]]
                if len(r["steps"]) != len(r["values"]):
                    raise CompareError(f"run {r['name']}: {len(r['steps'])} steps but {len(r['values'])} values")
                runs.append(RunSeries(**r))
            baseline, smooth, last, mrd = st["baseline"], st["smooth"], st["last"], st["max_rel_dev"]
            tokens_tag = st.get("tokens_tag", TOKENS_TAG)
        except CompareError as e:
            raise CompareError(f"damaged nemo-fp8-compare JSON export: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CompareError(f"damaged nemo-fp8-compare JSON export ({type(e).__name__}: {e}); "
                               "write it again from the run directories") from None
        return compare_runs(runs, baseline=baseline, smooth=smooth, last=last, max_rel_dev=mrd,
                            tokens_tag=tokens_tag)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _pct(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf"
    return f"{100 * x:+.3f}%" if signed else f"{100 * x:.3f}%"


def _num(x: Optional[float], digits: int, thousands: bool = False) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.{digits}f}" if thousands else f"{x:.{digits}f}"


def _pick_baseline(runs: Sequence[RunSeries], baseline: Optional[str]) -> RunSeries:
    if baseline is not None:
        for r in runs:
            if baseline in (r.name, r.path) or Path(r.path).name == baseline:
                return r
        try:
            want = Path(baseline).expanduser().resolve()
        except (OSError, RuntimeError):
            want = None
        for r in runs:
            if want is not None and Path(r.path).expanduser().resolve() == want:
                return r
        raise CompareError(f"--baseline {baseline!r} is not one of the runs (give a run's name or its "
                           f"directory): {', '.join(f'{r.name} ({r.path})' for r in runs)}")
    for r in runs:
        if r.name == "bf16" or Path(r.path).name == "bf16":
            return r
    for r in runs:
        if Path(r.path).name.startswith("bf16-"):
            return r
    return runs[0]


def compare_runs(runs: Sequence[RunSeries], *, baseline: Optional[str] = None, smooth: int = 1, last: int = 100,
                 max_rel_dev: Optional[float] = None, tokens_tag: str = TOKENS_TAG) -> Comparison:
    """Compute the table (see the module docstring for every definition)."""
    if not runs:
        raise CompareError("no runs to compare")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise CompareError(f"--smooth must be an integer >= 1 (1 = off), got {smooth!r}")
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise CompareError(f"--last must be an integer >= 1 (training steps), got {last!r}")
    if max_rel_dev is not None and not (math.isfinite(max_rel_dev) and max_rel_dev >= 0):
        raise CompareError(f"--max-rel-dev must be a finite fraction >= 0 (0.01 = 1%), got {max_rel_dev}; "
                           "leave it out to compare without a gate")
    base = _pick_baseline(runs, baseline)
    for r in runs:
        if not r.steps:
            raise CompareError(f"run {r.name} ({r.path}) has no {r.tag} values"
                               + (f" ({'; '.join(r.problems)})" if r.problems else ""))
    curves = {r.name: dict(zip(r.steps, moving_average(r.values, smooth))) for r in runs}
    base_curve = curves[base.name]
    base_tps = _median(base.tokens_per_s)
    base_end = base.steps[-1]

    def final(r: RunSeries) -> float:
        c = curves[r.name]
        end = r.steps[-1]
        window = [c[s] for s in r.steps if s > end - last] or [c[end]]
        return sum(window) / len(window)

    base_final = final(base)
    stats: List[RunStats] = []
    deviations: Dict[str, Tuple[List[int], List[float]]] = {}
    for r in runs:
        c = curves[r.name]
        tps = _median(r.tokens_per_s)
        speedup = tps / base_tps if (tps is not None and base_tps) else None
        fl = final(r)
        if r is base:
            stats.append(RunStats(name=r.name, path=r.path, baseline=True, last_step=r.steps[-1],
                                  aligned_steps=len(r.steps), final_loss=fl, final_vs_baseline=None,
                                  max_rel_dev=None, mean_rel_dev=None, gate_rel_dev=None, gate_window=None,
                                  tokens_per_s=tps, speedup=1.0 if tps is not None else None,
                                  passed=None, reasons=[f"damaged event file: {p}" for p in r.problems]))
            continue
        aligned = [s for s in r.steps if s in base_curve]
        dev = [(c[s] - base_curve[s]) / base_curve[s] if base_curve[s] != 0 else math.inf for s in aligned]
        deviations[r.name] = (aligned, dev)
        # The gate window is anchored at the baseline's last step, so a run that stopped early
        # (or whose events were cut short) is never judged on its first steps only.
        in_window = [(s, d) for s, d in zip(aligned, dev) if s > base_end - last]
        if in_window:
            gate_dev = _abs_max([d for _, d in in_window])
            window = (in_window[0][0], in_window[-1][0])
        else:
            gate_dev, window = None, None
        mean_dev = (sum(abs(d) if math.isfinite(d) else math.inf for d in dev) / len(dev)) if dev else None
        reasons = [f"damaged event file: {p}" for p in r.problems]
        if base.problems:
            reasons.append(f"the baseline {base.name} has a damaged event file")
        if r.steps[-1] < base_end:
            reasons.append(f"ended at step {r.steps[-1]}, before the baseline's last step {base_end} "
                           "(stopped early, or its event file was cut short): only a run that reaches it is judged")
        if not in_window:
            reasons.append(f"no step of the gate window (steps > {base_end - last}, the baseline's last {last}) "
                           "was logged by both runs")
        passed = None
        if max_rel_dev is not None:
            passed = not reasons and gate_dev is not None and gate_dev <= max_rel_dev
            if not reasons and gate_dev is not None and gate_dev > max_rel_dev:
                reasons.append(f"max |rel dev| {_pct(gate_dev)} over steps {window[0]}..{window[1]} is above "
                               f"{_pct(max_rel_dev)}")
        stats.append(RunStats(
            name=r.name, path=r.path, baseline=False, last_step=r.steps[-1], aligned_steps=len(aligned),
            final_loss=fl, final_vs_baseline=(fl - base_final) / base_final if base_final else None,
            max_rel_dev=_abs_max(dev), mean_rel_dev=mean_dev, gate_rel_dev=gate_dev, gate_window=window,
            tokens_per_s=tps, speedup=speedup, passed=passed, reasons=reasons,
        ))
    stats.sort(key=lambda st: not st.baseline)  # baseline row first, the rest in the order given
    tags = list(dict.fromkeys(r.tag for r in runs))  # one per trainer when runs of both are compared
    return Comparison(tag=" / ".join(tags), baseline=base.name, smooth=smooth, last=last, max_rel_dev=max_rel_dev,
                      runs=list(runs), stats=stats, deviations=deviations, tokens_tag=tokens_tag)
