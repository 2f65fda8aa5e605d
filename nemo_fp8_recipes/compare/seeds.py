"""Seeds in ``nemo-fp8-compare``: runs that differ only in their seed form a group, each FP8 group
is compared with the baseline seed by seed, and the verdict rests on a 95% interval across seeds.

Why paired by seed: the seed fixes the initialisation and the data order, so an FP8 run and the
BF16 run of the same seed see the same model and the same tokens; their difference is the
recipe's effect plus how far the two trajectories drift apart, while two seeds of BF16 differ by
far more (the noise a single FP8 run against a single BF16 run cannot get rid of).

Definitions (the curves are the compare tool's, smoothed as asked; ``F`` is a run's final loss,
the mean of its curve over its last ``--last`` steps):

- **group**: the runs whose ``config.yaml`` agree in everything but ``trainer.seed`` and the keys
  that do not change what is trained (:data:`NOT_VARIANT`: where the run is written, resume and
  checkpoint settings, the progress bar, launcher blocks). Runs without a ``config.yaml``
  (Megatron-Bridge's) are groups of one. The label is the run's name without its ``-seed<N>``
  part (``bf16-seed1`` → ``bf16``).
- **paired deviation** at seed ``s``: ``(F_G,s - F_B,s) / F_B,s`` with ``B`` the baseline group;
  per step, ``(L_G,s(t) - L_B,s(t)) / L_B,s(t)``.
- **interval**: mean of the paired deviations over the seeds both groups ran, ± t(0.975, n-1) ·
  sd / sqrt(n) (Student's t; n >= 2). Groups that share no seed with the baseline but have two or
  more: Welch's interval for the difference of the mean final losses, relative to the baseline's
  mean (Welch–Satterthwaite degrees of freedom).
- **gate** (``--max-rel-dev X``), by one of two rules (``--gate``):

  - ``within`` (the default; equivalence): a group passes when its whole interval lies within ±X —
    the runs then show, at 95% confidence, that the recipe moves the final loss by less than X.
    An interval reaching beyond ±X fails (the seeds cannot show it within X); one entirely beyond
    fails as shown beyond X.
  - ``regression``: a group fails only when its whole interval lies above +X — the runs show, at
    95% confidence, a final loss more than X above the baseline's. Anything else passes, and the
    verdict says what was shown: within ±X, or not resolved (the interval reaches beyond ±X, so
    the seeds could not have shown a regression of X). A lower loss never fails.

  A group of one seed is judged on that run's largest per-step deviation in the window, whichever
  the rule, and the verdict says it cannot separate the recipe from seed noise.
- **noise floor**: the baseline's seed-to-seed spread (standard deviation of ``F`` over its
  seeds and the largest difference of two seeds, both relative to the mean), and the same-seed rerun
  spread (runs of one group with the same seed) — zero by construction when the runs were
  deterministic (``trainer.deterministic=true``), unknown otherwise unless a rerun is given. Where
  other groups trained the baseline's settings at seeds of their own (they differ from it in
  ``run.tag`` alone, e.g. ``bf16-other`` beside ``bf16``), the seed-to-seed spread is also given
  over all of those seeds together: more seeds, a steadier estimate of the same noise.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "NOT_VARIANT",
    "RUN_LABELS",
    "GroupStats",
    "NoiseFloor",
    "read_run_config",
    "group_label",
    "group_runs",
    "t_quantile",
    "GATE_RULES",
    "shown_within",
    "mean_interval",
    "welch_interval",
    "median",
    "pct",
    "interval_text",
    "seed_key",
    "first_per_seed",
    "group_statistics",
]

#: the gate's rules for groups with an interval (module docstring): equivalence, or a shown regression
GATE_RULES = ("within", "regression")

#: config keys that name a run without changing what it trains, yet keep its group apart (BF16 at
#: other seeds, ``run.tag=other``, is compared with BF16 rather than merged into it); the noise
#: floor pools groups that differ in these alone
RUN_LABELS = ("run.tag",)

#: config keys that do not change what a run trains (besides trainer.seed, the pairing key)
NOT_VARIANT = (
    "trainer.seed",
    "run.root",
    "run.dir",
    "run.sweep",
    "run.tensorboard",
    "hydra",
    "submit",
    "cluster",
    "trainer.progress",
    "trainer.resume",
    "trainer.force_resume",
    "trainer.checkpoint",
    "trainer.ckpt_interval",
    "trainer.ckpt_keep",
    "trainer.memory_check",
    "data.cache_dir",
)


# ---- run metadata ---------------------------------------------------------------------------------
def read_run_config(
    run_dir: Path,
) -> Tuple[Optional[int], Optional[bool], Optional[str], Optional[str], Optional[str]]:
    """``(seed, deterministic, variant, setting, problem)`` from a trainer run's ``config.yaml``: the
    seed, whether it ran deterministically, a digest of everything that defines what it trained
    (:data:`NOT_VARIANT` left out), the same without :data:`RUN_LABELS` (groups that share it
    trained the same settings), and why the file could not be used (None when it could, or when
    there is none: Megatron-Bridge's runs)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None, None, None, None, None
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001 - a damaged file: the run stays a group of its own
        return None, None, None, None, f"{path} cannot be read ({type(e).__name__}); the run is not grouped by seed"
    if not isinstance(cfg, dict) or not isinstance(cfg.get("trainer"), dict):
        return None, None, None, None, None  # not a nemo-fp8-train config
    trainer = cfg["trainer"]
    seed = trainer.get("seed")
    seed = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else None
    det = trainer.get("deterministic")
    det = bool(det) if isinstance(det, bool) else False  # runs before the option existed were not

    def digest(keys) -> str:
        for key in keys:
            head, _, rest = key.partition(".")
            if not rest:
                cfg.pop(head, None)
            elif isinstance(cfg.get(head), dict):
                cfg[head].pop(rest, None)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]

    variant = digest(NOT_VARIANT)
    return seed, det, variant, digest(RUN_LABELS), None


def group_label(name: str, seed: Optional[int]) -> str:
    """A run's name without its ``-seed<N>`` part (``bf16-seed1`` -> ``bf16``, ``a/bf16-seed1`` ->
    ``a/bf16``); the name itself when it has none."""
    if seed is None:
        return name
    head, sep, leaf = name.rpartition("/")
    parts = [p for p in leaf.split("-") if p != f"seed{seed}"]
    if not parts or len(parts) == len(leaf.split("-")):
        return name
    return head + sep + "-".join(parts)


def group_runs(runs: Sequence) -> "Dict[str, List]":
    """Runs -> ``{label: [runs of the group, by seed]}`` in order of first appearance. Runs with the
    same variant (:func:`read_run_config`) are one group; runs without one are groups of one."""
    keyed: Dict[Tuple, List] = {}
    for r in runs:
        key = ("variant", r.variant) if r.variant else ("run", r.name)
        keyed.setdefault(key, []).append(r)
    out: Dict[str, List] = {}
    for members in keyed.values():
        label = group_label(members[0].name, members[0].seed)
        if label in out:  # two configurations whose names differ only in the seed part
            label = members[0].name
        out[label] = sorted(members, key=lambda r: (r.seed is None, r.seed if r.seed is not None else 0))
    return out


# ---- intervals ----------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _incbeta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _incbeta(0.5 * df, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile: the ``t`` with ``P(T <= t) = p`` for ``df`` (> 0, not necessarily
    whole) degrees of freedom; by bisection on the distribution function (1e-12)."""
    if not (0.0 < p < 1.0) or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _mean_sd(xs: Sequence[float]) -> Tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return m, sd


def mean_interval(xs: Sequence[float], level: float = 0.95) -> Tuple[float, Optional[Tuple[float, float]]]:
    """Mean of ``xs`` and its ``level`` Student-t interval (None for fewer than two values)."""
    m, sd = _mean_sd(xs)
    if len(xs) < 2 or not all(math.isfinite(x) for x in xs):
        return m, None
    half = t_quantile(0.5 + level / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
    return m, (m - half, m + half)


def welch_interval(
    a: Sequence[float], b: Sequence[float], level: float = 0.95
) -> Tuple[float, Optional[Tuple[float, float]]]:
    """``mean(a) - mean(b)`` and its Welch interval (None unless both have two values or more, all
    finite)."""
    ma, sa = _mean_sd(a)
    mb, sb = _mean_sd(b)
    diff = ma - mb
    if len(a) < 2 or len(b) < 2 or not all(math.isfinite(v) for v in (*a, *b)):
        return diff, None
    va, vb = sa * sa / len(a), sb * sb / len(b)
    se2 = va + vb
    if se2 == 0:
        return diff, (diff, diff)
    df = se2 * se2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(se2)
    return diff, (diff - half, diff + half)


# ---- results --------------------------------------------------------------------------------------
@dataclass
class GroupStats:
    """One row of the seed table. Deviations are fractions relative to the baseline group.

    ``method``: ``baseline``; ``paired`` (seeds both groups ran; interval over them); ``unpaired``
    (no common seed: Welch); ``one seed`` (no interval). ``final_vs_baseline`` is the mean paired
    deviation (or Welch's difference); ``interval`` its 95% interval; ``per_seed`` the paired
    deviation of each seed; ``mean_abs_dev`` the mean over seeds of each run's mean |rel dev| in the
    gate window (how closely the curve tracks the baseline, step by step) with ``mean_abs_dev_interval``.
    """

    label: str
    baseline: bool
    runs: List[str]
    seeds: List[Optional[int]]
    method: str
    final_loss: Optional[float]
    final_loss_sd: Optional[float]
    final_vs_baseline: Optional[float] = None
    interval: Optional[Tuple[float, float]] = None
    per_seed: Dict[str, float] = field(default_factory=dict)
    mean_abs_dev: Optional[float] = None
    mean_abs_dev_interval: Optional[Tuple[float, float]] = None
    tokens_per_s: Optional[float] = None
    speedup: Optional[float] = None
    deterministic: Optional[bool] = None
    passed: Optional[bool] = None
    reasons: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


@dataclass
class NoiseFloor:
    """What the runs say about noise: the baseline's seed-to-seed spread and same-seed reruns."""

    baseline: str
    seeds: List[int]
    seed_sd: Optional[float] = None  # sd over seeds of the baseline's final loss / its mean
    seed_max_pair: Optional[float] = None  # largest |F_s - F_s'| over two baseline seeds / the mean
    reruns: List[Dict[str, object]] = field(default_factory=list)  # runs of a group sharing a seed
    deterministic: Optional[bool] = None  # every run deterministic (None: not known for some)
    # the baseline's settings over every group that trained them (differing in RUN_LABELS alone),
    # when others did: their labels, all their seeds, and the seed-to-seed spread over them all
    pooled_groups: List[str] = field(default_factory=list)
    pooled_seeds: List[int] = field(default_factory=list)
    pooled_sd: Optional[float] = None
    pooled_max_pair: Optional[float] = None

    def rerun_text(self) -> str:
        """The same-seed rerun floor in words."""
        if self.reruns:
            worst = max(abs(float(r["final_dev"])) for r in self.reruns)
            return f"measured on {len(self.reruns)} rerun pair(s): final loss differs by up to {100 * worst:.3f}%"
        if self.deterministic:
            return "0 (every run deterministic: trainer.deterministic=true repeats a run bit for bit)"
        return (
            "unknown: the runs are not deterministic and no rerun of a seed is given "
            "(trainer.deterministic=true makes it 0)"
        )

    def seed_text(self) -> str:
        """The seed-to-seed floor in words."""
        if self.seed_sd is None:
            text = f"unknown: one {self.baseline} seed (train several: trainer.seed=1,2,3)"
        else:
            text = (
                f"{self.baseline} over {len(self.seeds)} seeds: final loss sd {100 * self.seed_sd:.3f}% of the "
                f"mean, two seeds differ by up to {100 * self.seed_max_pair:.3f}%"
            )
        if self.pooled_sd is not None:
            text += (
                f"; the same settings over all {len(self.pooled_seeds)} seeds ({', '.join(self.pooled_groups)}): "
                f"sd {100 * self.pooled_sd:.3f}%, up to {100 * self.pooled_max_pair:.3f}% apart"
            )
        return text


def seed_key(seed: Optional[int]) -> str:
    """The JSON key of a seed (``"?"`` when not known)."""
    return "?" if seed is None else str(seed)


def pct(x: Optional[float], signed: bool = False) -> str:
    """A fraction in percent, 3 decimals (``—`` for None)."""
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf"
    return f"{100 * x:+.3f}%" if signed else f"{100 * x:.3f}%"


def interval_text(value: Optional[float], interval: Optional[Tuple[float, float]], signed: bool = True) -> str:
    """``+0.120% [-0.050%, +0.290%]`` (the value alone without an interval)."""
    if value is None:
        return "—"
    if interval is None:
        return pct(value, signed)
    return f"{pct(value, signed)} [{pct(interval[0], signed)}, {pct(interval[1], signed)}]"


# ---- the statistics -------------------------------------------------------------------------------
def first_per_seed(members: Sequence) -> Dict[Optional[int], object]:
    """``{seed: the group's first run of that seed}`` (further runs of a seed are reruns)."""
    out: Dict[Optional[int], object] = {}
    for r in members:
        out.setdefault(r.seed, r)
    return out


def _all_known(flags: Sequence[Optional[bool]]) -> Optional[bool]:
    if any(f is None for f in flags):
        return None
    return all(flags)


def median(xs: Sequence[float]) -> Optional[float]:
    """The median of the finite values of ``xs`` (None when there is none)."""
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _rel_curve(curve: Dict[int, float], base: Dict[int, float]) -> Dict[int, float]:
    return {s: ((v - base[s]) / base[s] if base[s] != 0 else math.inf) for s, v in curve.items() if s in base}


def group_statistics(
    groups: Dict[str, List],
    base_label: str,
    curves: Dict[str, Dict[int, float]],
    finals: Dict[str, float],
    run_stats: Dict[str, object],
    *,
    last: int,
    max_rel_dev: Optional[float],
    seeded: bool,
    gate: str = "within",
):
    """The seed table (:class:`GroupStats` per group, baseline first), the :class:`NoiseFloor`,
    the per-step deviation of each group (``{label: (steps, mean, low, high)}``, the interval
    across paired seeds; low = high = mean with one seed) and the baseline's per-step seed spread
    (``(steps, sd / mean)``, empty with one seed). ``run_stats``: each run's
    :class:`~nemo_fp8_recipes.compare.statistics.RunStats` against its paired baseline run."""
    base_seed_runs = first_per_seed(groups[base_label])
    base_finals = [finals[r.name] for r in base_seed_runs.values()]
    base_mean = sum(base_finals) / len(base_finals)
    base_tps = median([run_stats[r.name].tokens_per_s for r in base_seed_runs.values()])
    rows: List[GroupStats] = []
    dev_curves: Dict[str, Tuple[List[int], List[float], List[float], List[float]]] = {}
    base_end = max(r.steps[-1] for r in base_seed_runs.values())
    for label, members in groups.items():
        seed_runs = first_per_seed(members)
        # a run that ended before the baseline (cut short, still running) has no final loss to
        # compare: it stays out of the group's numbers, and the notes say so
        short = {
            s: r
            for s, r in seed_runs.items()
            if label != base_label and r.steps[-1] < (base_seed_runs[s].steps[-1] if s in base_seed_runs else base_end)
        }
        seed_runs = {s: r for s, r in seed_runs.items() if s not in short}
        if not seed_runs:
            seed_runs, short = short, {}  # nothing complete: the table still shows the runs, the gate fails them
        fl_values = [finals[r.name] for r in seed_runs.values()]
        fl, sd = _mean_sd(fl_values)
        tps = median([run_stats[r.name].tokens_per_s for r in seed_runs.values()])
        row = GroupStats(
            label=label,
            baseline=label == base_label,
            runs=[r.name for r in seed_runs.values()],
            seeds=list(seed_runs),
            method="baseline",
            final_loss=fl,
            final_loss_sd=sd if len(fl_values) > 1 else None,
            tokens_per_s=tps,
            speedup=tps / base_tps if tps is not None and base_tps else None,
            deterministic=_all_known([r.deterministic for r in members]),
        )
        rows.append(row)
        for s, r in short.items():
            row.notes.append(
                f"{r.name} ended at step {r.steps[-1]}, before its baseline's last step: left out of the group's "
                "final loss and interval"
            )
        if row.baseline:
            continue
        paired = [s for s in seed_runs if s is not None and s in base_seed_runs]
        judged = [seed_runs[s] for s in paired] or list(seed_runs.values())
        # a group sharing no seed with the baseline is judged by Welch's interval below: its runs
        # lacking a same-seed partner is the design, not a fault (their other reasons still count)
        welch = not paired and len(seed_runs) >= 2 and len(base_seed_runs) >= 2
        for r in judged:
            st = run_stats[r.name]
            row.reasons += [f"{r.name}: {why}" for why in st.reasons if not (welch and why == st.unpaired)]
        if welch:  # what a paired run learns from its partner: the baseline's damaged files, a lost loss
            for rb in base_seed_runs.values():
                row.reasons += [f"baseline {rb.name}: {why}" for why in run_stats[rb.name].reasons]
            if not all(math.isfinite(v) for v in fl_values + base_finals):
                row.reasons.append("a final loss of this group or of the baseline is not finite: no interval")
        for s in paired:
            rb = base_seed_runs[s]
            row.per_seed[seed_key(s)] = (finals[seed_runs[s].name] - finals[rb.name]) / finals[rb.name]
        window_devs = [run_stats[seed_runs[s].name].window_mean_rel_dev for s in paired]
        if len(paired) >= 2:
            row.method = "paired"
            row.final_vs_baseline, row.interval = mean_interval(list(row.per_seed.values()))
            if all(d is not None for d in window_devs):
                row.mean_abs_dev, ci = mean_interval(window_devs)
                row.mean_abs_dev_interval = None if ci is None else (max(0.0, ci[0]), ci[1])  # (|dev| >= 0)
        elif welch:
            row.method = "unpaired"
            diff, ci = welch_interval(fl_values, base_finals)
            row.final_vs_baseline = diff / base_mean
            row.interval = None if ci is None else (ci[0] / base_mean, ci[1] / base_mean)
            row.notes.append(
                "no seed in common with the baseline: Welch's interval over the two groups' seeds "
                "(seed-to-seed noise included; same seeds would pair the runs)"
            )
        else:
            row.method = "one seed"
            if paired:
                row.final_vs_baseline = row.per_seed[seed_key(paired[0])]
                row.mean_abs_dev = window_devs[0]
            else:
                row.final_vs_baseline = (fl - base_mean) / base_mean
            # runs of nemo-fp8-train carry their seed in config.yaml; other frameworks' runs
            # (NeMo 2, Megatron-Bridge) have none, and the advice is in their terms
            ours = any(r.seed is not None for r in members)
            if seeded or len(seed_runs) == 1:
                row.notes.append(
                    "one seed: this comparison cannot separate the recipe from seed noise (train "
                    + (
                        "several seeds, e.g. trainer.seed=1,2,3, for an interval)"
                        if ours
                        else "several seeds with nemo-fp8-train, e.g. trainer.seed=1,2,3, for an interval: runs "
                        "without its config.yaml are compared one run per recipe)"
                    )
                )
            if not row.deterministic:
                row.notes.append(
                    "not deterministic: run-to-run noise is in the deviation too "
                    + (
                        "(trainer.deterministic=true removes it)"
                        if ours
                        else "(unknown for runs without nemo-fp8-train's config.yaml)"
                    )
                )
        # the per-step deviation over the paired seeds
        if paired:
            per = [_rel_curve(curves[seed_runs[s].name], curves[base_seed_runs[s].name]) for s in paired]
            steps = sorted(set.intersection(*(set(p) for p in per)))
            mean, lo, hi = [], [], []
            for t in steps:
                m, ci = mean_interval([p[t] for p in per])
                mean.append(m)
                lo.append(ci[0] if ci else m)
                hi.append(ci[1] if ci else m)
            dev_curves[label] = (steps, mean, lo, hi)
        if max_rel_dev is not None:
            _judge(row, [run_stats[r.name] for r in judged], max_rel_dev, last, gate)
    noise = _noise_floor(groups, base_label, base_seed_runs, base_finals, base_mean, curves, finals, rows)
    spread: Tuple[List[int], List[float]] = ([], [])
    if len(base_seed_runs) >= 2:
        bc = [curves[r.name] for r in base_seed_runs.values()]
        steps = sorted(set.intersection(*(set(c) for c in bc)))
        vals = [_mean_sd([c[t] for c in bc]) for t in steps]
        spread = (steps, [sd / m if m else math.inf for m, sd in vals])
    return rows, noise, dev_curves, spread


def shown_within(interval: Tuple[float, float], x: float) -> bool:
    """The whole 95% ``interval`` lies within ±x: the seeds show the deviation smaller than x."""
    return -x <= interval[0] and interval[1] <= x


def _judge(row: GroupStats, judged_stats: Sequence, x: float, last: int, gate: str = "within") -> None:
    """The gate's verdict on one group (module docstring), with the reason when it fails."""
    if row.interval is not None and gate == "regression":
        lo, hi = row.interval
        span = f"95% interval of the final-loss deviation [{pct(lo, True)}, {pct(hi, True)}]"
        row.passed = lo <= x and not row.reasons
        if lo > x:
            row.reasons.append(f"loss shown more than {pct(x)} above the baseline: {span}")
        elif shown_within(row.interval, x):
            row.notes.append(f"gate (regression): shown within ±{pct(x)}: {span}")
        elif hi < -x:
            row.notes.append(f"gate (regression): loss shown more than {pct(x)} below the baseline: {span}")
        else:
            row.notes.append(
                f"gate (regression): not shown worse than +{pct(x)}, and not shown within ±{pct(x)} either: "
                f"the {span} is wider than the threshold (more seeds or longer runs narrow it)"
            )
        return
    if row.interval is not None:
        lo, hi = row.interval
        inside = shown_within(row.interval, x)
        row.passed = inside and not row.reasons
        if not inside:
            span = f"95% interval of the final-loss deviation [{pct(lo, True)}, {pct(hi, True)}]"
            if lo > x or hi < -x:
                row.reasons.append(f"deviation shown beyond ±{pct(x)}: {span}")
            else:
                row.reasons.append(
                    f"the {span} reaches beyond ±{pct(x)}: these seeds cannot show the deviation "
                    "within it (more seeds or longer runs narrow the interval)"
                )
        return
    run = judged_stats[0] if len(judged_stats) == 1 else None
    if run is None or run.gate_rel_dev is None:
        row.passed = False
        if not row.reasons:
            row.reasons.append("no interval and no single run paired with the baseline to judge")
        return
    row.passed = not row.reasons and run.gate_rel_dev <= x
    if not row.reasons and run.gate_rel_dev > x:
        w = run.gate_window
        row.reasons.append(f"max |rel dev| {pct(run.gate_rel_dev)} over steps {w[0]}..{w[1]} is above {pct(x)}")


def _noise_floor(groups, base_label, base_seed_runs, base_finals, base_mean, curves, finals, rows) -> NoiseFloor:
    noise = NoiseFloor(
        baseline=base_label,
        seeds=[s for s in base_seed_runs if s is not None],
        deterministic=_all_known([r.deterministic for m in groups.values() for r in m]),
    )
    if len(base_finals) >= 2:
        noise.seed_sd = _mean_sd(base_finals)[1] / base_mean
        noise.seed_max_pair = (max(base_finals) - min(base_finals)) / base_mean
    setting = groups[base_label][0].setting
    pooled = [  # the baseline's settings trained by other groups too: their complete runs, one a seed
        row
        for row in rows
        if setting is not None and all(r.setting == setting and r.seed is not None for r in groups[row.label])
    ]
    seeds = [s for row in pooled for s in row.seeds]
    if len(pooled) > 1 and len(seeds) == len(set(seeds)):  # a seed in two groups would count twice
        pooled_finals = [finals[name] for row in pooled for name in row.runs]
        mean, sd = _mean_sd(pooled_finals)
        noise.pooled_groups = [row.label for row in pooled]
        noise.pooled_seeds = sorted(seeds)
        noise.pooled_sd = sd / mean
        noise.pooled_max_pair = (max(pooled_finals) - min(pooled_finals)) / mean
    for label, members in groups.items():
        firsts = first_per_seed(members)
        for r in members:
            a = firsts[r.seed]
            if r is a:
                continue
            devs = _rel_curve(curves[r.name], curves[a.name])
            noise.reruns.append(
                {
                    "group": label,
                    "seed": r.seed,
                    "runs": [a.name, r.name],
                    "final_dev": (finals[r.name] - finals[a.name]) / finals[a.name],
                    "max_rel_dev": max((abs(d) for d in devs.values()), default=None),
                }
            )
    return noise
