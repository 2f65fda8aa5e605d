"""The numbers of ``nemo-fp8-compare``: smoothing, the baseline, relative deviation, final loss,
throughput and the pass/fail gate (:func:`compare_runs`, every definition in the docstring of
:mod:`nemo_fp8_recipes.compare.cli`), and the :class:`Comparison` they make, with its Markdown, CSV
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

from .reading import TOKENS_TAG, CompareError, RunSeries
from .seeds import (
    GATE_RULES,
    GroupStats,
    NoiseFloor,
    first_per_seed,
    group_label,
    group_runs,
    group_statistics,
    interval_text,
    median,
    pct,
    shown_within,
)

__all__ = [
    "JSON_VERSION",
    "RunStats",
    "Comparison",
    "moving_average",
    "compare_runs",
]

JSON_VERSION = 3
_JSON_VERSIONS = (1, 2, 3)  # 1: before event-file checks and gate reasons; 2: before seeds; still re-imported


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


def _abs_max(xs: Sequence[float]) -> Optional[float]:
    if not xs:
        return None
    return max(abs(x) if math.isfinite(x) else math.inf for x in xs)


@dataclass
class RunStats:
    """One row of the per-run table (fractions, not percent). ``None`` = not applicable (baseline)
    or not available (no tokens/s logged, no aligned steps, no baseline run of its seed).
    ``paired_with``: the baseline run it is compared with (the baseline group's run of the same
    seed, or the baseline run). ``reasons``: why the run cannot be judged in full (it ended before
    the baseline, damaged event files, ...) or failed the gate. ``unpaired``: the reason among
    them that the baseline has no run of its seed — no fault of a group that shares no seed with
    the baseline, which Welch's interval judges instead (:mod:`~nemo_fp8_recipes.compare.seeds`)."""

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
    seed: Optional[int] = None
    group: Optional[str] = None
    paired_with: Optional[str] = None
    window_mean_rel_dev: Optional[float] = None
    unpaired: Optional[str] = None


@dataclass
class Comparison:
    """The result of :func:`compare_runs`: settings, the runs' curves, per-run stats and the
    per-step deviations ``{run: (steps, rel_dev)}``; with several seeds of a configuration
    (``seeded``), the seed table ``groups``, the ``noise`` floor, each group's per-step deviation
    with its interval ``group_deviations`` and the baseline's per-step ``seed_spread``."""

    tag: str
    baseline: str
    smooth: int
    last: int
    max_rel_dev: Optional[float]
    runs: List[RunSeries]
    stats: List[RunStats]
    deviations: Dict[str, Tuple[List[int], List[float]]]
    tokens_tag: str = TOKENS_TAG
    groups: List[GroupStats] = field(default_factory=list)
    noise: Optional[NoiseFloor] = None
    group_deviations: Dict[str, Tuple[List[int], List[float], List[float], List[float]]] = field(default_factory=dict)
    seed_spread: Tuple[List[int], List[float]] = field(default_factory=lambda: ([], []))
    seeded: bool = False
    gate: str = "within"

    @property
    def passed(self) -> bool:
        """No run (with several seeds: no group) failed the gate (always True without ``max_rel_dev``)."""
        judged = self.groups if self.seeded else self.stats
        return all(s.passed is not False for s in judged)

    @property
    def failures(self) -> List[Tuple[str, str]]:
        """``(name, why)`` of each run (with several seeds: each group) that failed the gate."""
        if self.seeded:
            return [(g.label, "; ".join(g.reasons)) for g in self.groups if g.passed is False]
        return [(s.name, "; ".join(s.reasons) or pct(s.gate_rel_dev)) for s in self.stats if s.passed is False]

    def curve(self, name: str) -> Tuple[List[int], List[float]]:
        """The (smoothed) curve of run ``name`` as used for every number."""
        r = next(r for r in self.runs if r.name == name)
        return r.steps, moving_average(r.values, self.smooth)

    def group_members(self, label: str) -> List[RunSeries]:
        """The runs of group ``label`` (one per seed, by seed)."""
        g = next(g for g in self.groups if g.label == label)
        return [next(r for r in self.runs if r.name == n) for n in g.runs]

    # ---- tables ----
    def settings_line(self) -> str:
        """One line describing how the numbers were computed."""
        sm = "none" if self.smooth <= 1 else f"trailing moving average over {self.smooth} points"
        if self.max_rel_dev is None:
            gate = "off (--max-rel-dev)"
        elif self.seeded:
            gate = (
                f"the 95% interval over seeds of the final-loss deviation within ±{pct(self.max_rel_dev)} "
                if self.gate == "within"
                else f"(regression) fail only when the 95% interval over seeds of the final-loss deviation lies "
                f"above +{pct(self.max_rel_dev)} "
            ) + (
                "(one seed: max |rel dev| over the baseline's last steps), every run reaching the baseline's last step"
            )
        else:
            gate = (
                f"max |rel dev| over the baseline's last {self.last} steps <= {pct(self.max_rel_dev)}, "
                "every run reaching the baseline's last step"
            )
        return (
            f"tag `{self.tag}`, baseline **{self.baseline}**, smoothing: {sm}, final loss: mean over "
            f"the last {self.last} steps, gate: {gate}"
        )

    def _run_table(self) -> List[str]:
        seeds = self.seeded
        head = [
            "run",
            *(["seed"] if seeds else []),
            "final loss",
            "final vs baseline",
            "max \\|rel dev\\|",
            "mean \\|rel dev\\|",
            f"max \\|rel dev\\| last {self.last}",
            "tokens/s",
            "speedup",
            *([] if seeds else ["gate"]),
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in self.stats:
            name = f"{s.name} (baseline)" if s.baseline else s.name
            gate = "—" if s.passed is None else ("pass" if s.passed else "**FAIL**")
            row = [
                name,
                *([str(s.seed) if s.seed is not None else "?"] if seeds else []),
                _num(s.final_loss, 4),
                pct(s.final_vs_baseline, signed=True),
                pct(s.max_rel_dev),
                pct(s.mean_rel_dev),
                pct(s.gate_rel_dev),
                _num(s.tokens_per_s, 0, thousands=True),
                "—" if s.speedup is None else f"{s.speedup:.2f}×",
                *([] if seeds else [gate]),
            ]
            lines.append("| " + " | ".join(row) + " |")
        return lines

    def _group_table(self) -> List[str]:
        head = [
            "run group",
            "seeds",
            "final loss (mean ± sd)",
            "final vs baseline [95% interval]",
            f"mean \\|rel dev\\| last {self.last} [95% interval]",
            "tokens/s",
            "speedup",
            "gate",
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in self.groups:
            name = f"{g.label} (baseline)" if g.baseline else g.label
            seeds = ", ".join("?" if s is None else str(s) for s in g.seeds)
            if not g.baseline and g.method not in ("paired", "one seed"):
                seeds += f" ({g.method})"
            fl = _num(g.final_loss, 4) + (f" ± {g.final_loss_sd:.4f}" if g.final_loss_sd is not None else "")
            gate = "—" if g.passed is None else ("pass" if g.passed else "**FAIL**")
            if g.passed and self.gate == "regression" and g.interval is not None:
                gate += " (within)" if shown_within(g.interval, self.max_rel_dev) else " (not resolved)"
            row = [
                name,
                seeds,
                fl,
                "—" if g.baseline else interval_text(g.final_vs_baseline, g.interval),
                "—" if g.baseline else interval_text(g.mean_abs_dev, g.mean_abs_dev_interval, signed=False),
                _num(g.tokens_per_s, 0, thousands=True),
                "—" if g.speedup is None else f"{g.speedup:.2f}×",
                gate,
            ]
            lines.append("| " + " | ".join(row) + " |")
        return lines

    def to_markdown(self) -> str:
        """The tables as Markdown (deviations in percent): with several seeds the seed table, the
        noise floor and the per-run table (each run against the baseline run of its seed)."""
        lines = [self.settings_line(), ""]
        if self.seeded:
            lines += self._group_table()
            lines += [
                "",
                f"Noise floor: seed to seed, {self.noise.seed_text()}; same seed run again, {self.noise.rerun_text()}.",
                "",
                "Per run, against the baseline run of the same seed:",
                "",
            ]
        lines += self._run_table()
        notes = [
            f"- **{g.label}**: {why}" for g in self.groups for why in (g.reasons + g.notes if self.seeded else g.notes)
        ]
        # a group judged by Welch's interval has its own note for why its runs have no same-seed partner
        welch = {g.label for g in self.groups if g.method == "unpaired"}
        notes += [
            f"- **{s.name}**: {why}"
            for s in self.stats
            for why in s.reasons
            if not (s.group in welch and why == s.unpaired)
        ]
        if notes:
            lines += ["", "Notes:", *dict.fromkeys(notes)]
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """The per-run table as CSV, full precision, fractions (not percent); empty cells = n/a."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = [
            "run",
            "path",
            "baseline",
            "seed",
            "group",
            "paired_with",
            "last_step",
            "aligned_steps",
            "final_loss",
            "final_vs_baseline",
            "max_rel_dev",
            "mean_rel_dev",
            "window_mean_rel_dev",
            "gate_rel_dev",
            "gate_first_step",
            "gate_last_step",
            "tokens_per_s",
            "speedup",
            "passed",
            "reasons",
        ]
        w.writerow(cols)
        for s in self.stats:
            d = asdict(s)
            gw = d.pop("gate_window") or (None, None)
            d["gate_first_step"], d["gate_last_step"] = gw
            d["run"] = d.pop("name")
            d["reasons"] = "; ".join(d["reasons"]) or None
            w.writerow([_cell(d[c]) for c in cols])
        return buf.getvalue()

    def groups_csv(self) -> str:
        """The seed table as CSV (one row per group; fractions; interval bounds in their own columns)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = [
            "group",
            "baseline",
            "method",
            "seeds",
            "runs",
            "final_loss",
            "final_loss_sd",
            "final_vs_baseline",
            "interval_low",
            "interval_high",
            "mean_abs_dev",
            "mean_abs_dev_low",
            "mean_abs_dev_high",
            "tokens_per_s",
            "speedup",
            "deterministic",
            "passed",
            "reasons",
            "notes",
        ]
        w.writerow(cols)
        for g in self.groups:
            iv, mv = g.interval or (None, None), g.mean_abs_dev_interval or (None, None)
            w.writerow(
                [
                    _cell(v)
                    for v in (
                        g.label,
                        g.baseline,
                        g.method,
                        " ".join("?" if x is None else str(x) for x in g.seeds),
                        " ".join(g.runs),
                        g.final_loss,
                        g.final_loss_sd,
                        g.final_vs_baseline,
                        iv[0],
                        iv[1],
                        g.mean_abs_dev,
                        mv[0],
                        mv[1],
                        g.tokens_per_s,
                        g.speedup,
                        g.deterministic,
                        g.passed,
                        "; ".join(g.reasons) or None,
                        "; ".join(g.notes) or None,
                    )
                ]
            )
        return buf.getvalue()

    def to_dict(self) -> dict:
        """Everything needed to re-render: settings, raw curves, results."""
        return {
            "version": JSON_VERSION,
            "settings": {
                "tag": self.tag,
                "tokens_tag": self.tokens_tag,
                "baseline": self.baseline,
                "smooth": self.smooth,
                "last": self.last,
                "max_rel_dev": self.max_rel_dev,
                "gate": self.gate,
            },
            "runs": [asdict(r) for r in self.runs],
            "results": [asdict(s) for s in self.stats],
            "deviations": {k: {"steps": v[0], "rel_dev": v[1]} for k, v in self.deviations.items()},
            "seeded": self.seeded,
            "groups": [asdict(g) for g in self.groups],
            "noise": asdict(self.noise) if self.noise else None,
            "group_deviations": {
                k: {"steps": v[0], "mean": v[1], "low": v[2], "high": v[3]} for k, v in self.group_deviations.items()
            },
            "passed": self.passed,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON (non-finite numbers as null)."""
        return json.dumps(_finite(self.to_dict()), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, **changes) -> "Comparison":
        """Re-import :meth:`to_json` output. The stored curves are re-analysed, with any of
        ``baseline``, ``smooth``, ``last``, ``max_rel_dev``, ``gate`` changed (``None`` keeps the stored one).
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
            runs = [_run_from_json(r) for r in data["runs"]]
            names = [r.name for r in runs]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise CompareError(f"run name(s) {', '.join(dup)} appear more than once")
            baseline, smooth, last, mrd = st["baseline"], st["smooth"], st["last"], st["max_rel_dev"]
            tokens_tag = st.get("tokens_tag", TOKENS_TAG)
            gate = st.get("gate", "within")  # exports written before the rule was a setting: within
        except CompareError as e:
            raise CompareError(f"damaged nemo-fp8-compare JSON export: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CompareError(
                f"damaged nemo-fp8-compare JSON export ({type(e).__name__}: {e}); "
                "write it again from the run directories"
            ) from None
        return compare_runs(
            runs, baseline=baseline, smooth=smooth, last=last, max_rel_dev=mrd, tokens_tag=tokens_tag, gate=gate
        )


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _run_from_json(r) -> RunSeries:
    """One run entry of a JSON export, every field of the type the export writes, or CompareError."""
    if not isinstance(r, dict) or not {"name", "path", "tag", "steps", "values"} <= set(r):
        raise CompareError("a run entry lacks name/path/tag/steps/values")
    name = r["name"]
    for key in ("name", "path", "tag"):
        if not isinstance(r[key], str):
            raise CompareError(f"run {name!r}: {key} is {type(r[key]).__name__}, not text")
    steps, values = r["steps"], r["values"]
    if not isinstance(steps, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in steps):
        raise CompareError(f"run {name}: steps must be a list of whole numbers")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise CompareError(f"run {name}: steps must increase")
    if not isinstance(values, list) or not all(v is None or _is_num(v) for v in values):
        raise CompareError(f"run {name}: values must be a list of numbers (null for non-finite)")
    if len(steps) != len(values):
        raise CompareError(f"run {name}: {len(steps)} steps but {len(values)} values")
    checks = {
        "tokens_per_s": lambda v: isinstance(v, list) and all(x is None or _is_num(x) for x in v),
        "tags": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "problems": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "seed": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
        "deterministic": lambda v: v is None or isinstance(v, bool),
        "variant": lambda v: v is None or isinstance(v, str),
        "setting": lambda v: v is None or isinstance(v, str),
        "data_sha256": lambda v: v is None or isinstance(v, str),
    }
    for key, ok in checks.items():
        if key in r and not ok(r[key]):
            raise CompareError(f"run {name}: {key} has the wrong type ({type(r[key]).__name__})")
    fields = {f.name for f in dataclasses.fields(RunSeries)}
    out = {k: v for k, v in r.items() if k in fields}
    out["values"] = [math.nan if v is None else float(v) for v in values]
    if "tokens_per_s" in out:
        out["tokens_per_s"] = [math.nan if v is None else float(v) for v in out["tokens_per_s"]]
    return RunSeries(**out)


def _cell(v):
    return "" if v is None else repr(v) if isinstance(v, float) else v


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _num(x: Optional[float], digits: int, thousands: bool = False) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.{digits}f}" if thousands else f"{x:.{digits}f}"


def _pick_baseline(
    groups: Dict[str, List[RunSeries]], label_of: Dict[str, str], baseline: Optional[str], gate: bool = False
) -> str:
    """The baseline group's label: the group ``baseline`` names (its label, or one of its runs by
    name or directory); by default the group labelled ``bf16``, else one whose label starts with
    ``bf16-``, else the first — but with a gate (``gate``) never a run that merely comes first: a
    gate judged against an FP8 run would pass on less than it claims. ``label_of``: each run's
    group label by run name."""
    runs = [r for members in groups.values() for r in members]
    if baseline is not None:
        if baseline in groups:
            return baseline
        for r in runs:
            if baseline in (r.name, r.path) or Path(r.path).name == baseline:
                return label_of[r.name]
        try:
            want = Path(baseline).expanduser().resolve()
        except (OSError, RuntimeError):
            want = None
        for r in runs:
            if want is not None and Path(r.path).expanduser().resolve() == want:
                return label_of[r.name]
        for r in runs:  # a run's name without its seed (bf16 for bf16-seed1)
            if group_label(r.name, r.seed) == baseline:
                return label_of[r.name]
        named = ", ".join(f"{r.name} ({r.path})" for r in runs)
        extra = [g for g in groups if g not in label_of]
        raise CompareError(
            f"--baseline {baseline!r} is not one of the runs (give a run's name or its "
            f"directory{', or a group: ' + ', '.join(extra) if extra else ''}): {named}"
        )
    for label, members in groups.items():
        if label == "bf16" or any(
            Path(r.path).name == "bf16" or group_label(r.name, r.seed) == "bf16" for r in members
        ):
            return label
    for label, members in groups.items():
        if label.rsplit("/", 1)[-1].startswith("bf16-"):
            return label
    if gate:
        raise CompareError(
            "--max-rel-dev needs a baseline, and no run is named bf16 among "
            + ", ".join(f"{r.name} ({r.path})" for members in groups.values() for r in members)
            + ": give --baseline NAME, or check that the BF16 run logged (a directory without "
            "events.out.tfevents.* files, e.g. of a run that died before its first log line, is not a run)"
        )
    return next(iter(groups))


def check_gate(rule: str) -> None:
    """The gate's rule is one of :data:`~nemo_fp8_recipes.compare.seeds.GATE_RULES`."""
    if rule not in GATE_RULES:
        raise CompareError(
            f"unknown gate rule {rule!r}; choose one of {', '.join(GATE_RULES)} (within: pass only when the "
            "95% interval lies within ±X; regression: fail only when it lies above +X)"
        )


def check_max_rel_dev(x: Optional[float]) -> None:
    """The gate's threshold is a fraction in [0, 1]: 0.02 = 2%. A larger one is almost surely a
    percentage typed as such (2 for 2%), which would pass anything: refused, with the fraction."""
    if x is None:
        return
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
        raise CompareError(
            f"--max-rel-dev must be a finite fraction >= 0 (0.01 = 1%), got {x}; leave it out to compare without a gate"
        )
    if x > 1:
        raise CompareError(
            f"--max-rel-dev is a fraction (0.02 = 2%), and {x:g} would allow {100 * x:g}%: for {x:g}% give "
            f"--max-rel-dev {x / 100:g}"
        )


def compare_runs(
    runs: Sequence[RunSeries],
    *,
    baseline: Optional[str] = None,
    smooth: int = 1,
    last: int = 100,
    max_rel_dev: Optional[float] = None,
    tokens_tag: str = TOKENS_TAG,
    gate: str = "within",
) -> Comparison:
    """Compute the tables (see the docstrings of :mod:`nemo_fp8_recipes.compare.cli` and, for seeds,
    :mod:`nemo_fp8_recipes.compare.seeds` for every definition)."""
    if not runs:
        raise CompareError("no runs to compare")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise CompareError(f"--smooth must be an integer >= 1 (1 = off), got {smooth!r}")
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise CompareError(f"--last must be an integer >= 1 (training steps), got {last!r}")
    check_max_rel_dev(max_rel_dev)
    check_gate(gate)
    for r in runs:
        if not r.steps:
            raise CompareError(
                f"run {r.name} ({r.path}) has no {r.tag} values" + (f" ({'; '.join(r.problems)})" if r.problems else "")
            )
    groups = group_runs(runs)
    seeded = any(len(members) > 1 for members in groups.values())
    if not seeded:  # one run per configuration: each is known by its own name
        groups = {members[0].name: members for members in groups.values()}
    label_of = {r.name: label for label, members in groups.items() for r in members}
    base_label = _pick_baseline(groups, label_of, baseline, gate=max_rel_dev is not None)
    base_runs = groups[base_label]
    base_by_seed = first_per_seed(base_runs)
    curves = {r.name: dict(zip(r.steps, moving_average(r.values, smooth))) for r in runs}

    def final(r: RunSeries) -> float:
        c = curves[r.name]
        end = r.steps[-1]
        window = [c[s] for s in r.steps if s > end - last] or [c[end]]
        return sum(window) / len(window)

    finals = {r.name: final(r) for r in runs}
    tps = {r.name: median(r.tokens_per_s) for r in runs}
    stats: List[RunStats] = []
    deviations: Dict[str, Tuple[List[int], List[float]]] = {}
    for r in runs:
        common = dict(
            name=r.name,
            path=r.path,
            last_step=r.steps[-1],
            final_loss=finals[r.name],
            tokens_per_s=tps[r.name],
            seed=r.seed,
            group=label_of[r.name],
        )
        if label_of[r.name] == base_label:
            partner = base_by_seed[r.seed]
            stats.append(
                RunStats(
                    **common,
                    baseline=True,
                    aligned_steps=len(r.steps),
                    final_vs_baseline=None,
                    max_rel_dev=None,
                    mean_rel_dev=None,
                    gate_rel_dev=None,
                    gate_window=None,
                    speedup=1.0 if tps[r.name] is not None else None,
                    passed=None,
                    paired_with=None if partner is r else partner.name,
                    reasons=[f"damaged event file: {p}" for p in r.problems],
                )
            )
            continue
        base = base_by_seed.get(r.seed) if seeded else base_runs[0]
        if base is None:
            unpaired = f"no {base_label} run of seed {r.seed} to pair it with"
            stats.append(
                RunStats(
                    **common,
                    baseline=False,
                    aligned_steps=0,
                    final_vs_baseline=None,
                    max_rel_dev=None,
                    mean_rel_dev=None,
                    gate_rel_dev=None,
                    gate_window=None,
                    speedup=None,
                    passed=None,
                    reasons=[f"damaged event file: {p}" for p in r.problems] + [unpaired],
                    unpaired=unpaired,
                )
            )
            continue
        row, deviations[r.name] = _run_stats(
            r, base, curves, finals, tps, last, None if seeded else max_rel_dev, common
        )
        stats.append(row)
    stats.sort(key=lambda st: not st.baseline)  # baseline rows first, the rest in the order given
    by_name = {s.name: s for s in stats}
    group_rows, noise, group_devs, spread = group_statistics(
        groups, base_label, curves, finals, by_name, last=last, max_rel_dev=max_rel_dev, seeded=seeded, gate=gate
    )
    tags = list(dict.fromkeys(r.tag for r in runs))  # one per trainer when runs of both are compared
    return Comparison(
        tag=" / ".join(tags),
        baseline=base_label,
        smooth=smooth,
        last=last,
        max_rel_dev=max_rel_dev,
        runs=list(runs),
        stats=stats,
        deviations=deviations,
        tokens_tag=tokens_tag,
        groups=group_rows,
        noise=noise,
        group_deviations=group_devs,
        seed_spread=spread,
        seeded=seeded,
        gate=gate,
    )


def _run_stats(
    r: RunSeries, base: RunSeries, curves, finals, tps, last: int, max_rel_dev: Optional[float], common: dict
) -> Tuple[RunStats, Tuple[List[int], List[float]]]:
    """One run against its baseline run ``base`` (the per-run gate only when ``max_rel_dev``), and
    its per-step deviation ``(steps, rel_dev)``."""
    c, base_curve, base_end = curves[r.name], curves[base.name], base.steps[-1]
    aligned = [s for s in r.steps if s in base_curve]
    dev = [(c[s] - base_curve[s]) / base_curve[s] if base_curve[s] != 0 else math.inf for s in aligned]
    # The gate window is anchored at the baseline's last step, so a run that stopped early
    # (or whose events were cut short) is never judged on its first steps only.
    in_window = [(s, d) for s, d in zip(aligned, dev) if s > base_end - last]
    if in_window:
        gate_dev = _abs_max([d for _, d in in_window])
        window = (in_window[0][0], in_window[-1][0])
        window_mean = sum(abs(d) if math.isfinite(d) else math.inf for _, d in in_window) / len(in_window)
    else:
        gate_dev, window, window_mean = None, None, None
    mean_dev = (sum(abs(d) if math.isfinite(d) else math.inf for d in dev) / len(dev)) if dev else None
    reasons = [f"damaged event file: {p}" for p in r.problems]
    if base.problems:
        reasons.append(f"the baseline {base.name} has a damaged event file")
    if r.data_sha256 and base.data_sha256 and r.data_sha256 != base.data_sha256:
        reasons.append(
            f"trained on other tokens than the baseline {base.name} (data sha256 {r.data_sha256[:12]} against "
            f"{base.data_sha256[:12]}): not a like-for-like comparison (did the corpus change between the runs?)"
        )
    for who, curve in ((f"the baseline {base.name}", base_curve), ("this run", c)):
        bad = [s for s in aligned if not math.isfinite(curve[s])]
        if bad:
            reasons.append(
                f"{who} logged a non-finite loss ({curve[bad[0]]}) at step {bad[0]}"
                + (f" and {len(bad) - 1} more step(s)" if len(bad) > 1 else "")
                + (": the deviation there says nothing about this run" if who != "this run" else "")
            )
    if r.steps[-1] < base_end:
        reasons.append(
            f"ended at step {r.steps[-1]}, before the baseline's last step {base_end} "
            "(stopped early, or its event file was cut short): only a run that reaches it is judged"
        )
    if not in_window:
        reasons.append(
            f"no step of the gate window (steps > {base_end - last}, the baseline's last {last}) "
            "was logged by both runs"
        )
    passed = None
    if max_rel_dev is not None:
        passed = not reasons and gate_dev is not None and gate_dev <= max_rel_dev
        if not reasons and gate_dev is not None and gate_dev > max_rel_dev:
            reasons.append(
                f"max |rel dev| {pct(gate_dev)} over steps {window[0]}..{window[1]} is above {pct(max_rel_dev)}"
            )
    fl, base_final = finals[r.name], finals[base.name]
    tps_r, tps_b = tps[r.name], tps[base.name]
    out = RunStats(
        **common,
        baseline=False,
        aligned_steps=len(aligned),
        final_vs_baseline=(fl - base_final) / base_final if base_final else None,
        max_rel_dev=_abs_max(dev),
        mean_rel_dev=mean_dev,
        gate_rel_dev=gate_dev,
        gate_window=window,
        speedup=tps_r / tps_b if (tps_r is not None and tps_b) else None,
        passed=passed,
        reasons=reasons,
        paired_with=base.name,
        window_mean_rel_dev=window_mean,
    )
    return out, (aligned, dev)
