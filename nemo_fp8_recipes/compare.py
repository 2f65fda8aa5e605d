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
  for usage/data errors.
- **Throughput**: the median of each run's ``tokens_per_s`` scalar; ``speedup`` = run tokens/s /
  baseline tokens/s (``n/a`` when a run did not log it).

Outputs in ``--out`` (default ``<common parent of the runs>/compare``): ``compare.png`` (loss
curves overlaid + relative-deviation panel), ``compare.md``, ``compare.csv``, ``compare.json``
(settings, every run's raw curve and tokens/s, and the results; ``--from-json`` re-imports it and
re-renders everything, with new ``--smooth``/``--last``/``--max-rel-dev``/``--baseline`` if given)
and ``deviation/<run>/`` TensorBoard runs holding the scalar ``compare/rel_dev``, so that
``tensorboard --logdir <parent>`` shows the deviation chart of the custom-scalars layout
(:func:`tensorboard_layout`, written into every training run by the trainer) next to the overlay.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import json
import math
import os
import sys
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "DEFAULT_TAG",
    "LOSS_TAGS",
    "TOKENS_TAG",
    "DEVIATION_TAG",
    "CompareError",
    "RunSeries",
    "RunStats",
    "Comparison",
    "tensorboard_layout",
    "find_runs",
    "resolve_run_dirs",
    "check_event_file",
    "load_run",
    "load_runs",
    "moving_average",
    "compare_runs",
    "plot",
    "write_outputs",
    "write_deviation_events",
    "main",
]

DEFAULT_TAG = "train/loss"
#: The training loss as each trainer logs it: nemo-fp8-train, Megatron-Bridge / Megatron-LM.
LOSS_TAGS = (DEFAULT_TAG, "lm loss")
TOKENS_TAG = "tokens_per_s"
DEVIATION_TAG = "compare/rel_dev"
JSON_VERSION = 2
_JSON_VERSIONS = (1, 2)  # 1: before event-file checks and gate reasons; still re-imported
_EVENTS_GLOB = "events.out.tfevents.*"
_MARKER = "compare.json"  # an output directory of this tool: never a run


class CompareError(ValueError):
    """A run, tag or baseline that cannot be used; the message lists what is available."""


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
            "relative deviation from the baseline, (run - baseline) / baseline": [
                "Multiline", [r"^compare/rel_dev$"]],
        },
    }


# ---- finding and reading runs ---------------------------------------------------------------------
def _has_events(d: Path) -> bool:
    return d.is_dir() and any(d.glob(_EVENTS_GLOB))


def find_runs(parent: Path, max_depth: int = 3) -> List[Path]:
    """Directories under ``parent`` (itself included, ``max_depth`` levels down) that hold
    TensorBoard event files, sorted; output directories of this tool are skipped."""
    parent = Path(parent)
    found: List[Path] = []

    def walk(d: Path, depth: int) -> None:
        if (d / _MARKER).is_file():
            return
        if _has_events(d):
            found.append(d)
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for c in children:
            walk(c, depth + 1)

    if parent.is_dir():
        walk(parent, 0)
    return found


def _listing(parent: Path) -> str:
    runs = find_runs(parent)
    if not parent.is_dir():
        return f"{parent} does not exist either"
    if not runs:
        return f"no runs (directories with {_EVENTS_GLOB} files) under {parent}"
    return f"runs found under {parent}: " + ", ".join(str(r.relative_to(parent)) or "." for r in runs)


def resolve_run_dirs(paths: Sequence[str]) -> List[Path]:
    """Command-line run arguments -> run directories. A directory with event files is a run; one
    without stands for every run below it. Errors list the runs found under the parent."""
    out: List[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise CompareError(f"no such run directory: {p}. {_listing(p.parent)}")
        if not p.is_dir():
            raise CompareError(f"{p} is not a directory (give run directories, not event files). {_listing(p.parent)}")
        if _has_events(p):
            out.append(p)
            continue
        below = find_runs(p)
        if not below:
            raise CompareError(f"no TensorBoard event files in {p} or below it. {_listing(p.parent)}")
        out.extend(below)
    seen, unique = set(), []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    if not unique:
        raise CompareError("no runs given")
    return unique


@dataclass
class RunSeries:
    """One run's curve: ``steps`` (ascending) and ``values`` of ``tag``; ``tokens_per_s`` values
    (empty when not logged); ``tags``: every scalar tag of the run; ``problems``: damaged event
    files (:func:`check_event_file`), one line each."""

    name: str
    path: str
    tag: str
    steps: List[int]
    values: List[float]
    tokens_per_s: List[float] = field(default_factory=list)
    tags: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 1, "images": 1,
                                                     "histograms": 1, "audio": 1, "compressedHistograms": 1})
    acc.Reload()
    return acc


def check_event_file(path: Path) -> Optional[str]:
    """Walk every record of one event file with TensorBoard's own record reader (length header,
    masked CRC32C of the header and of the data). ``None`` if the file is whole; else one line
    saying where it breaks and how many records were readable before that. TensorBoard's
    ``EventAccumulator`` stops quietly at such a record, so a damaged file reads as a shorter run."""
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    path = Path(path)
    try:
        size = path.stat().st_size
        reader = PyRecordReader_New(str(path))
    except (OSError, errors.OpError) as e:
        return f"{path.name}: cannot be read ({e})"
    n = 0
    try:
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                return None
            n += 1
    except errors.DataLossError as e:
        msg = str(getattr(e, "message", "") or e)
        what = "truncated" if "truncat" in msg.lower() else "corrupt"
        return (f"{path.name} is {what} after {n} readable record(s) ({size} bytes): {msg.strip()}; the steps "
                "after that point are missing")
    finally:
        try:
            reader.file_handle.close()
        except Exception:  # noqa: BLE001 - best effort
            pass


def load_run(path: Path, tag: Optional[str] = None, tokens_tag: str = TOKENS_TAG, name: Optional[str] = None) -> RunSeries:
    """Read ``tag`` (and ``tokens_tag`` if present) from the event files of run directory ``path``;
    every event file is checked record by record first (:func:`check_event_file`). ``tag=None``:
    the run's training loss under the name its trainer logs it (:data:`LOSS_TAGS`)."""
    path = Path(path)
    problems = [p for f in sorted(path.glob(_EVENTS_GLOB)) for p in [check_event_file(f)] if p]
    acc = _accumulator(path)
    tags = sorted(acc.Tags().get("scalars", []))
    name = name or path.name
    if tag is None:
        tag = next((t for t in LOSS_TAGS if t in tags), DEFAULT_TAG)
    if tag not in tags:
        hint = difflib.get_close_matches(tag, tags, n=1)
        raise CompareError(
            f"tag {tag!r} not found in run {name} ({path})."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Available scalar tags: {', '.join(tags) if tags else '(none)'}"
        )
    by_step: Dict[int, float] = {}
    for e in acc.Scalars(tag):  # wall-time order; a later write of the same step wins
        by_step[int(e.step)] = float(e.value)
    steps = sorted(by_step)
    tps = [float(e.value) for e in acc.Scalars(tokens_tag)] if tokens_tag in tags else []
    return RunSeries(name=name, path=str(path), tag=tag, steps=steps, values=[by_step[s] for s in steps],
                     tokens_per_s=tps, tags=tags, problems=problems)


def _run_names(paths: Sequence[Path]) -> List[str]:
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    names = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def load_runs(paths: Sequence[str], tag: Optional[str] = None, tokens_tag: str = TOKENS_TAG) -> List[RunSeries]:
    """:func:`resolve_run_dirs` + :func:`load_run` for each, with unique names."""
    dirs = resolve_run_dirs(paths)
    return [load_run(d, tag, tokens_tag, name=n) for d, n in zip(dirs, _run_names(dirs))]


# ---- the numbers ----------------------------------------------------------------------------------
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
    names = [r.name for r in runs]
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


# ---- outputs ----------------------------------------------------------------------------------------
def plot(comparison: Comparison, path: Optional[Path] = None):
    """Loss curves overlaid (one line per run, baseline thicker) above the relative deviation from
    the baseline in percent (gate band and window shaded). Saves a PNG to ``path`` if given;
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
    color = {r.name: colors[i % len(colors)] for i, r in enumerate(comparison.runs)}
    for r in comparison.runs:
        steps, vals = comparison.curve(r.name)
        is_base = r.name == comparison.baseline
        ax_loss.plot(steps, vals, label=f"{r.name} (baseline)" if is_base else r.name, color=color[r.name],
                     linewidth=3.0 if is_base else 1.4, zorder=1 if is_base else 2)
    ax_loss.set_ylabel(comparison.tag + (f" (smoothed, {comparison.smooth} pts)" if comparison.smooth > 1 else ""))
    ax_loss.set_title(f"{comparison.tag}: {len(comparison.runs)} runs, baseline {comparison.baseline}")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper right")

    ax_dev.axhline(0.0, color=color[comparison.baseline], linewidth=1.0)
    for s in comparison.stats:
        if s.baseline or s.name not in comparison.deviations:
            continue
        steps, dev = comparison.deviations[s.name]
        ax_dev.plot(steps, [100 * d for d in dev], color=color[s.name], linewidth=1.4, label=s.name)
    if comparison.max_rel_dev is not None:
        g = 100 * comparison.max_rel_dev
        ax_dev.axhspan(-g, g, color="tab:green", alpha=0.08, label=f"gate ±{g:.3g}%")
    windows = [s.gate_window for s in comparison.stats if s.gate_window]
    if windows:
        ax_dev.axvspan(min(w[0] for w in windows), max(w[1] for w in windows), color="grey", alpha=0.12,
                       label=f"gate window (last {comparison.last} steps)")
    ax_dev.set_ylabel(f"rel. deviation from {comparison.baseline} [%]")
    ax_dev.set_xlabel("step")
    ax_dev.grid(alpha=0.3)
    if ax_dev.get_legend_handles_labels()[0]:
        ax_dev.legend(loc="upper right", fontsize="small")
    if path is not None:
        fig.savefig(str(path))
    return fig


def write_deviation_events(comparison: Comparison, out_dir: Path) -> List[Path]:
    """TensorBoard runs ``<out_dir>/deviation/<run>`` with the scalar ``compare/rel_dev`` (a
    fraction) at each aligned step, plus the custom-scalars layout; old event files there are
    replaced. Returns the run directories written."""
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for name, (steps, dev) in comparison.deviations.items():
        d = Path(out_dir) / "deviation" / name.replace("/", "__")
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob(_EVENTS_GLOB):
            old.unlink()
        w = SummaryWriter(log_dir=str(d))
        w.add_custom_scalars(tensorboard_layout())
        for s, v in zip(steps, dev):
            w.add_scalar(DEVIATION_TAG, v if math.isfinite(v) else float("nan"), global_step=s)
        w.close()
        written.append(d)
    return written


def write_outputs(comparison: Comparison, out_dir: Path, *, png: bool = True, events: bool = True) -> Dict[str, Path]:
    """Write ``compare.{md,csv,json,png}`` and the deviation runs into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "compare.md", "csv": out_dir / "compare.csv", "json": out_dir / "compare.json"}
    paths["markdown"].write_text(comparison.to_markdown(), encoding="utf-8")
    paths["csv"].write_text(comparison.to_csv(), encoding="utf-8")
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
            "  gate         fails a run whose max |rel dev| over the steps both logged in the baseline's\n"
            "               last --last steps (step > S - N, S = the baseline's last step) exceeds\n"
            "               --max-rel-dev; also a run that ended before S, or whose event files (or the\n"
            "               baseline's) are truncated or corrupt, with the reason\n"
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
    p.add_argument("runs", nargs="*", metavar="RUN_DIR",
                   help="run directories (holding events.out.tfevents.*), or a parent of several runs")
    p.add_argument("--baseline", metavar="RUN", default=None,
                   help="run to compare against (name or path); default: the run named bf16, else the first")
    p.add_argument("--tag", default=None, help=f"scalar to compare (default: the training loss, {DEFAULT_TAG} of "
                   "nemo-fp8-train runs or 'lm loss' of Megatron-Bridge runs; e.g. val/loss)")
    p.add_argument("--tokens-tag", default=None, help=f"throughput scalar (default {TOKENS_TAG})")
    p.add_argument("--smooth", type=int, default=None, metavar="N",
                   help="trailing moving average over N logged points before everything (default 1 = off)")
    p.add_argument("--last", type=int, default=None, metavar="N",
                   help="final-loss and gate window in training steps (default 100)")
    p.add_argument("--max-rel-dev", type=float, default=None, metavar="X",
                   help="gate: fail (exit 1) when a run's max |rel dev| in the window exceeds X (0.01 = 1%%)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: <common parent of the runs>/compare, or the JSON's directory)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="re-import a compare.json instead of reading event files, and re-render")
    p.add_argument("--no-png", action="store_true", help="skip the PNG")
    p.add_argument("--no-events", action="store_true", help="skip the deviation/<run> TensorBoard runs")
    return p


def _default_out(paths: Sequence[str]) -> Path:
    parents = {str(Path(p).resolve().parent) for p in paths}
    try:
        common = Path(os.path.commonpath(list(parents)))
    except ValueError:
        return Path("compare")
    return common / "compare"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``nemo-fp8-compare`` (also ``python -m nemo_fp8_recipes.compare``)."""
    args = _parser().parse_args(argv)
    try:
        for flag, value, minimum in (("--smooth", args.smooth, 1), ("--last", args.last, 1)):
            if value is not None and value < minimum:
                raise CompareError(f"{flag} must be >= {minimum}, got {value}"
                                   + (" (1 = no smoothing)" if flag == "--smooth" else " (training steps)"))
        if args.max_rel_dev is not None and not (math.isfinite(args.max_rel_dev) and args.max_rel_dev >= 0):
            raise CompareError(f"--max-rel-dev must be a finite fraction >= 0 (0.01 = 1%), got {args.max_rel_dev}; "
                               "leave it out to compare without a gate")
        if args.from_json:
            if args.runs:
                raise CompareError("give either RUN_DIRs or --from-json, not both")
            src = Path(args.from_json)
            if not src.is_file():
                raise CompareError(f"--from-json {src}: no such file")
            if args.tag is not None or args.tokens_tag is not None:
                raise CompareError("--tag/--tokens-tag cannot change a JSON export (it holds one tag); "
                                   "compare the run directories again instead")
            try:
                text = src.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CompareError(f"--from-json {src}: cannot be read as text ({e})") from None
            comparison = Comparison.from_json(text, baseline=args.baseline,
                                              smooth=args.smooth, last=args.last, max_rel_dev=args.max_rel_dev)
            out = Path(args.out) if args.out else src.parent
        else:
            if not args.runs:
                _parser().print_usage(sys.stderr)
                raise CompareError("give at least one RUN_DIR (or --from-json FILE)")
            dirs = resolve_run_dirs(args.runs)
            tag = args.tag  # None: each run's training loss (train/loss, or Megatron-Bridge's "lm loss")
            tokens_tag = args.tokens_tag or TOKENS_TAG
            runs = [load_run(d, tag, tokens_tag, name=n) for d, n in zip(dirs, _run_names(dirs))]
            comparison = compare_runs(runs, baseline=args.baseline, smooth=1 if args.smooth is None else args.smooth,
                                      last=100 if args.last is None else args.last, max_rel_dev=args.max_rel_dev,
                                      tokens_tag=tokens_tag)
            out = Path(args.out) if args.out else _default_out([str(d) for d in dirs])
        if out.exists() and not out.is_dir():
            raise CompareError(f"--out {out} is a file; give a directory (it receives compare.md, .csv, .json, "
                               ".png and deviation/)")
        for r in comparison.runs:
            for problem in r.problems:
                print(f"nemo-fp8-compare: warning: run {r.name}: {problem}", file=sys.stderr)
        paths = write_outputs(comparison, out, png=not args.no_png, events=not args.no_events)
    except CompareError as e:
        print(f"nemo-fp8-compare: error: {e}", file=sys.stderr)
        return 2
    print(comparison.to_markdown())
    for kind, p in paths.items():
        print(f"{kind + ':':10s} {p}")
    if "deviation" in paths:
        try:
            logdir = os.path.commonpath([str(Path(r.path).resolve().parent) for r in comparison.runs]
                                        + [str(out.resolve())])
        except ValueError:
            logdir = str(out)
        print(f"TensorBoard: tensorboard --logdir {logdir}   (Custom Scalars tab: overlay + deviation)")
    if not comparison.passed:
        lines = "\n".join(f"  {s.name}: {'; '.join(s.reasons) or _pct(s.gate_rel_dev)}" for s in comparison.failures)
        print(f"GATE FAILED (max |rel dev| <= {_pct(comparison.max_rel_dev)} over the baseline's last "
              f"{comparison.last} steps):\n{lines}", file=sys.stderr)
        return 1
    if comparison.max_rel_dev is not None:
        print(f"gate passed: every run within {_pct(comparison.max_rel_dev)} of {comparison.baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
