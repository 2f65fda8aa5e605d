"""The numerics study (issue 7): every recipe trained on real text for one token budget, compared
with BF16 and with BF16's own seed-to-seed noise, plus quantisation telemetry per tensor role and
an activation-outlier stress.

One command runs it all (``--smoke`` is the same pipeline, tiny, on CPU)::

    PYTHONPATH=$PWD python benchmarks/numerics_study.py                  # ~15 min on one H200
    python benchmarks/numerics_study.py --smoke --root /tmp/ns --jobs 2  # ~1 min on a CPU

What it does
------------
1. **Main runs** (``--part main``): ``llama3_150m`` (152M parameters, byte vocabulary) on the
   local standard-library corpus, 600 optimizer steps x 8 sequences x 1024 tokens =
   **4,915,200 tokens per run**, with ``bf16``, ``delayed``, ``tensorwise``, ``blockwise`` and
   ``mxfp8`` (``recipe.emulate=true``: Hopper has no MXFP8 tensor cores) at seed 1234, and
   ``bf16`` at seed 4321 (``bf16-seed2``: the noise floor; the seed sets the initialisation and
   the data order). Trainer defaults otherwise (AdamW, lr 3e-3, 20 warm-up steps, cosine to
   3e-4, clip 1.0, BF16 autocast). FP8 telemetry every 20 steps, validation every 100 steps on
   16 fixed micro-batches (131k held-out tokens), checkpoints every 200 steps.
2. **Outlier stress** (``--part stress``): ``bf16``, ``tensorwise``, ``blockwise`` for 300 steps
   (2,457,600 tokens) with ``model.outlier_channels=2 model.outlier_scale=10000``: two channels
   of every layer's SwiGLU input (256 and 768 of 1024) multiplied by 1e4, so a per-tensor scale
   is set by them while 6 of the 8 1x128 blocks of each row (30 of 32 1x32 groups) hold no
   outlier (:class:`nemo_fp8_recipes.models.OutlierGain`). ``--stress-overrides`` replaces the
   variant, e.g. ``"trainer.lr=1e-2"`` for a learning-rate stress.
3. Each run is a real ``python -m nemo_fp8_recipes.train`` subprocess with
   ``trainer.resume=auto``; its run directory is ``<root>/<part>/<model>/<recipe>[-<tag>]``.
4. After each run, an **activation probe** on its final checkpoint: one validation micro-batch
   through the trained model (BF16 autocast on GPU, no FP8), the inputs of every layer's
   ``wq`` (attention input), ``w1`` (SwiGLU input) and ``w2`` (down-projection input) captured
   and quantised with the per-tensor (tensorwise), 1x128 (blockwise) and 1x32 (mxfp8) input
   quantisers. Whole-tensor SQNR is dominated by the largest values, so the probe also reports
   the median over channels of the per-channel SQNR — the number that shows the bulk of a tensor
   losing precision to a few outlier channels. Written to ``probe.json`` in the run directory.
5. **Report** (``<root>/report``), once every planned run is complete (or ``--report-only``):
   ``nemo-fp8-compare`` over the main runs (train loss, mean of the last 100 steps; and the final
   validation loss) and over the stress runs — PNG + Markdown/CSV/JSON each; the goal check
   (final loss of blockwise and mxfp8 within 0.25% of BF16, tensorwise and delayed within 0.5%,
   next to the BF16 seed-to-seed deviation); the telemetry summary per recipe and tensor role
   (activations = ``input``, weights = ``weight``, gradients = ``grad_output``): SQNR, fraction
   flushed to zero, fraction saturated and amax, mean and worst over training, from the
   ``fp8/<group>/<operand>/<stat>`` TensorBoard scalars, with a plot over steps; the probe
   table. ``report.md`` + ``report.json`` (and ``telemetry.{md,csv,json,png}``).

Budget (one H200, eager; tokens/s measured for this model and batch in docs/benchmarks.md:
bf16 132k, delayed 31k, tensorwise 47k, blockwise 78k, mxfp8 emulated 32k). Training time plus
an estimated ~25 s per run of start-up, Triton compilation, validation, checkpoints (1.8 GB
each) and the probe:

=============  =====================  ==========  ======================
run            tokens                 training    expected wall time
=============  =====================  ==========  ======================
bf16           4.9M (600 steps)       37 s        ~1.0 min
bf16-seed2     4.9M                   37 s        ~1.0 min
delayed        4.9M                   159 s       ~3.1 min
tensorwise     4.9M                   105 s       ~2.2 min
blockwise      4.9M                   63 s        ~1.5 min
mxfp8 (emul.)  4.9M                   154 s       ~3.0 min
stress bf16    2.5M (300 steps)       19 s        ~0.7 min
stress tw      2.5M                   52 s        ~1.3 min
stress bw      2.5M                   32 s        ~0.9 min
=============  =====================  ==========  ======================

about 15 minutes in all. ``--dry-run`` prints the plan, the commands and these estimates.

Splitting across calls (each well under 10 minutes; docs/numerics.md has the three used on the
H200: ``--part main --recipes delayed,mxfp8`` ~6 min, ``--part main --recipes
bf16,bf16-seed2,tensorwise,blockwise`` ~6 min, ``--part stress`` ~3.5 min with the report):
``--part`` and ``--recipes`` pick runs;
``--max-wall-s S`` stops starting runs when fewer than ``--min-start-s`` seconds are left and
interrupts a running one at the deadline with SIGINT (the trainer then writes a checkpoint if it
is between steps; otherwise the last periodic one, at most 200 steps back, is kept); the same
command again resumes it (``trainer.resume=auto``). Complete runs are skipped. ``--report-only``
builds the report from existing run directories (no GPU needed); ``--export DIR`` copies
everything but checkpoints (events, configs, logs, probes, report) to DIR, which
``--report-only --root DIR`` accepts as well. The plan is written to ``<root>/study.json``; a
later call with other settings is refused (use another ``--root``). A run the trainer stops on a
non-finite loss or gradient (its exit status 3) is a result: it is reported as diverged at that
step, never as a final loss, and not retried. ``--jobs N`` runs N at a time (one GPU each);
with ``--share-gpus`` more runs than GPUs share them round-robin — the FP8 runs of this small
model are host-bound, so on one H200 ``--jobs 6 --share-gpus`` trained the six main runs in
281 s instead of ~12 minutes one after another. Their tokens/s are then marked † in the report
(not speed figures).

Combining studies (``--combine ROOT [ROOT ...] [--out DIR]``, no GPU): one run per recipe cannot
resolve the goals when BF16 itself moves by more than them from run to run (on the H200, BF16
rerun with the same seed differed by 1.3-3.8% in final loss: non-deterministic GPU kernels,
amplified over 600 steps at lr 3e-3). So run the main part again under other roots, e.g. with the
seeds swapped (``--root runs/numerics_seed4321 --seed 4321 --seed2 1234 --part main``: every bf16
seed then runs twice), and pool them::

    python benchmarks/numerics_study.py --combine runs/numerics runs/numerics_seed4321

The roots must share model, tokens per step, steps, train-loss window and every main run's
overrides other than ``trainer.seed`` (else exit 2 naming the difference); their stress part may
be missing. Each root's final losses are those of its ``report/report.json`` (built first, as
``--report-only --allow-partial`` would, when it is missing or older than the main runs). Written
to ``--out`` (default ``<first root>/combined``): ``combined.md`` (printed), ``combined.json`` and
``combined.png`` (final train and val loss per recipe, a dot per run, the BF16 pool mean with
± std and ± 2 std bands, the goals around it), with

* the **BF16 pool**: every ``bf16`` and ``bf16-seed2`` run with its seed; mean and sample std
  (relative to the mean: the noise of one run); **same-seed reruns** (every seed with two or more
  bf16 runs: their relative differences, the run-to-run floor) and the **cross-seed** spread;
* per FP8 recipe: each run's deviation from the bf16 run of its own root (paired: same seed and
  data order) and their mean; the recipe's mean vs the BF16 pool mean, relative and in standard
  errors (Welch: t = diff / sqrt(s_fp8²/n_fp8 + s_bf16²/n_bf16); one FP8 run takes BF16's std);
  the goal; the verdict: *resolvable* when two standard errors of the difference are below the
  goal (else "not resolvable with these runs", with the runs a goal-sized difference would need),
  and Welch's t-test at the two-sided 5% level (Welch–Satterthwaite degrees of freedom):
  "differs from BF16" or "indistinguishable from BF16";
* a plain-language summary line on top.

Exit status: 0 done, 1 a run failed (its log is printed; the next call retries it), 2 bad
arguments or a report that cannot be built, 3 runs left incomplete by ``--max-wall-s`` (run the
same command again).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _timing import table  # noqa: E402  (the benchmarks' Markdown table)

MANIFEST_VERSION = 1
RECIPES = ("bf16", "delayed", "tensorwise", "blockwise", "mxfp8")
MAIN_KEYS = ("bf16", "bf16-seed2", "delayed", "tensorwise", "blockwise", "mxfp8")
STRESS_RECIPES = ("bf16", "tensorwise", "blockwise")
#: Goal: |final loss / BF16 final loss - 1| at most this (issue 7; DeepSeek-V3 reports < 0.25%).
GOALS = {"blockwise": 0.0025, "mxfp8": 0.0025, "tensorwise": 0.005, "delayed": 0.005}
#: The trainer's telemetry operands -> tensor roles.
ROLES = {"input": "activations", "weight": "weights", "grad_output": "gradients"}
#: Telemetry statistics summarised, with the direction of "worst".
STATS = {"sqnr_db": min, "underflow_frac": max, "saturated_frac": max, "amax": max}
STAT_LABELS = {"sqnr_db": "SQNR [dB]", "underflow_frac": "flushed to zero [%]",
               "saturated_frac": "saturated [%]", "amax": "amax"}
#: Quantisers of the activation probe: (label, recipe whose input quantiser is applied).
PROBE_QUANTISERS = (("per-tensor", "tensorwise"), ("1x128", "blockwise"), ("1x32", "mxfp8"))
#: Probe sites: label -> (module path under ``layers.<i>``, what it is).
PROBE_SITES = {"attn_in": ("attention.wq", "attention input (wq/wk/wv)"),
               "swiglu_in": ("feed_forward.w1", "SwiGLU input (w1/w3)"),
               "down_in": ("feed_forward.w2", "down-projection input (w2)")}
#: Measured on one H200 (docs/benchmarks.md, llama3_150m, micro-batch 8 x 1024, eager).
H200_TOKENS_PER_S = {"bf16": 132e3, "delayed": 31e3, "tensorwise": 47e3, "blockwise": 78e3, "mxfp8": 32e3}
OVERHEAD_S = 25.0  # start-up, Triton compilation, validation, checkpoints, probe (estimate)

FULL = dict(model="llama3_150m", steps=600, stress_steps=300, seq_len=1024, micro_batch=8, global_batch=8,
            log_interval=10, telemetry_interval=20, val_interval=100, val_steps=16, ckpt_interval=200,
            last=100, device="cuda", extra=(),
            stress_overrides=("model.outlier_channels=2", "model.outlier_scale=10000"))
SMOKE = dict(model="llama3_tiny", steps=8, stress_steps=6, seq_len=64, micro_batch=2, global_batch=2,
             log_interval=1, telemetry_interval=2, val_interval=4, val_steps=2, ckpt_interval=4,
             last=4, device="cpu", extra=("model.num_layers=1", "data.max_files=20"),
             stress_overrides=("model.outlier_channels=2", "model.outlier_scale=10000"))


class StudyError(RuntimeError):
    """A study that cannot go on as asked; the message says why and what to do."""


# ---- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    """One training run of the study: ``part`` (main | stress), ``key`` (what ``--recipes``
    selects), the trainer ``overrides`` (without ``run.root`` / ``trainer.resume``, which depend
    on where the study lives) and the run directory relative to the study root."""

    part: str
    key: str
    recipe: str
    steps: int
    overrides: Tuple[str, ...]
    rel_dir: str

    @property
    def label(self) -> str:
        """Unique name across parts (``stress/tensorwise``)."""
        return self.key if self.part == "main" else f"{self.part}/{self.key}"

    @property
    def name(self) -> str:
        """The run directory leaf (``bf16-seed2``), also the name ``nemo-fp8-compare`` gives it."""
        return Path(self.rel_dir).name

    def run_dir(self, root: Path) -> Path:
        """Absolute run directory under ``root``."""
        return Path(root) / self.rel_dir


def build_plan(s: argparse.Namespace) -> List[RunSpec]:
    """Every run of the study, main part first, from the resolved settings ``s``."""
    common = [
        f"model={s.model}",
        "trainer.max_steps={steps}",
        f"trainer.seq_len={s.seq_len}",
        f"trainer.micro_batch_size={s.micro_batch}",
        f"trainer.global_batch_size={s.global_batch}",
        f"trainer.log_interval={s.log_interval}",
        f"trainer.telemetry_interval={s.telemetry_interval}",
        f"trainer.val_interval={s.val_interval}",
        f"trainer.val_steps={s.val_steps}",
        f"trainer.ckpt_interval={s.ckpt_interval}",
        "trainer.ckpt_keep=1",
        "trainer.progress=false",
        f"trainer.device={s.device}",
    ]

    def spec(part: str, key: str, recipe: str, steps: int, seed: int, tag: Optional[str], extra: Sequence[str]):
        ov = [f"recipe={recipe}"] + [c.replace("{steps}", str(steps)) for c in common] + [f"trainer.seed={seed}"]
        if recipe == "mxfp8" and s.emulate_mxfp8:
            ov.append("recipe.emulate=true")
        if tag:
            ov.append(f"run.tag={tag}")
        ov += list(s.extra) + list(extra)
        leaf = f"{recipe}-{tag}" if tag else recipe
        return RunSpec(part=part, key=key, recipe=recipe, steps=steps, overrides=tuple(ov),
                       rel_dir=f"{part}/{s.model}/{leaf}")

    plan = []
    for key in MAIN_KEYS:
        if key == "bf16-seed2":
            plan.append(spec("main", key, "bf16", s.steps, s.seed2, "seed2", ()))
        else:
            plan.append(spec("main", key, key, s.steps, s.seed, None, ()))
    for recipe in s.stress_recipes:
        plan.append(spec("stress", recipe, recipe, s.stress_steps, s.seed, None, s.stress_overrides))
    return plan


def select_runs(plan: Sequence[RunSpec], part: str, recipes: Optional[Sequence[str]]) -> List[RunSpec]:
    """The runs of ``part`` (main | stress | all) whose key is in ``recipes`` (all if None)."""
    pool = [r for r in plan if part in ("all", r.part)]
    if recipes is None:
        return pool
    valid = sorted({r.key for r in pool}, key=lambda k: [r.key for r in pool].index(k))
    bad = [k for k in recipes if k not in valid]
    if bad:
        raise StudyError(f"--recipes {','.join(bad)}: not a run of --part {part}; valid: {', '.join(valid)}")
    return [r for r in pool if r.key in recipes]


def expected_seconds(spec: RunSpec, tokens_per_step: int) -> Optional[float]:
    """Expected wall time of ``spec`` on one H200 (the measured tokens/s plus the overhead)."""
    tps = H200_TOKENS_PER_S.get(spec.recipe)
    return None if tps is None else spec.steps * tokens_per_step / tps + OVERHEAD_S


def _manifest(plan: Sequence[RunSpec], s: argparse.Namespace) -> dict:
    return {
        "version": MANIFEST_VERSION,
        "model": s.model,
        "tokens_per_step": s.global_batch * s.seq_len,
        "last": s.last,
        "stress_last": s.stress_last,
        "stress_overrides": list(s.stress_overrides),
        "smoke": bool(s.smoke),
        "runs": [asdict(r) for r in plan],
    }


def load_manifest(root: Path) -> dict:
    """``<root>/study.json``; a clear error when the root holds no study."""
    p = Path(root) / "study.json"
    if not p.is_file():
        raise StudyError(f"{p} not found: {root} is not a numerics-study root (run the study first, "
                         "or pass --root to the directory holding study.json)")
    m = json.loads(p.read_text(encoding="utf-8"))
    if m.get("version") != MANIFEST_VERSION:
        raise StudyError(f"{p}: study manifest version {m.get('version')!r}, expected {MANIFEST_VERSION}")
    return m


def plan_from_manifest(m: dict) -> List[RunSpec]:
    """The :class:`RunSpec` list stored in a manifest."""
    return [RunSpec(**{**r, "overrides": tuple(r["overrides"])}) for r in m["runs"]]


def ensure_manifest(root: Path, manifest: dict) -> None:
    """Write ``study.json`` for a new study, or check that an existing one has the same plan
    (the trainer would resume runs of another plan with mixed settings otherwise)."""
    p = Path(root) / "study.json"
    manifest = json.loads(json.dumps(manifest))  # tuples -> lists, as read back
    if p.is_file():
        old = json.loads(p.read_text(encoding="utf-8"))
        if old != manifest:
            diffs = [k for k in sorted(set(old) | set(manifest)) if old.get(k) != manifest.get(k)]
            detail = []
            if "runs" in diffs:
                o = {r["rel_dir"]: r for r in old.get("runs", [])}
                for r in manifest["runs"]:
                    if r["rel_dir"] not in o:
                        detail.append(f"new run {r['rel_dir']}")
                    elif o[r["rel_dir"]] != r:
                        changed = sorted(set(o[r["rel_dir"]]["overrides"]) ^ set(r["overrides"])) or sorted(
                            k for k in r if o[r["rel_dir"]].get(k) != r[k])
                        detail.append(f"{r['rel_dir']}: {', '.join(changed)}")
            raise StudyError(
                f"{root} holds a study with other settings ({', '.join(diffs)}"
                + (f": {'; '.join(detail[:6])}" if detail else "")
                + "); use another --root, or delete that directory to start over"
            )
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


# ---- run state ----------------------------------------------------------------------------------
def _checkpoint_step(run_dir: Path) -> Optional[int]:
    d = run_dir / "checkpoints"
    steps = []
    if d.is_dir():
        for p in d.glob("step_*.pt"):
            try:
                steps.append(int(p.stem.split("_", 1)[1]))
            except ValueError:
                continue
    return max(steps) if steps else None


def run_state(spec: RunSpec, root: Path) -> Tuple[str, int]:
    """``("complete" | "diverged" | "partial" | "absent", steps)``: complete when the trainer's
    ``summary.json`` (written when a run ends normally) reports the planned steps; diverged when
    the trainer stopped it on a non-finite loss or gradient norm (exit 3; a result, not
    retried: delete the run directory to retry); partial when a checkpoint exists short of the
    planned steps."""
    d = spec.run_dir(root)
    summary = d / "summary.json"
    done = 0
    if summary.is_file():
        try:
            done = int(json.loads(summary.read_text(encoding="utf-8")).get("steps", 0))
        except (ValueError, json.JSONDecodeError):
            done = 0
    if done >= spec.steps:
        return "complete", done
    hist = d / "study_run.json"
    if hist.is_file():
        last = json.loads(hist.read_text(encoding="utf-8"))[-1]
        if last.get("state") == "diverged":
            return "diverged", int(last.get("diverged_at") or last.get("steps_after") or 0)
    ck = _checkpoint_step(d)
    if ck is not None:
        return "partial", ck
    return "absent", done


# ---- running ------------------------------------------------------------------------------------
@dataclass
class _Job:
    spec: RunSpec
    proc: subprocess.Popen
    log: io.TextIOBase
    started: float
    slot: int
    state_before: Tuple[str, int]
    interrupted: bool = False
    sigint_at: Optional[float] = None


def _slots(jobs: int, device: str, share_gpus: bool = False) -> List[Dict[str, str]]:
    """Environment for each of ``jobs`` parallel slots: one GPU each on CUDA (with
    ``share_gpus``, more slots than GPUs, assigned round-robin), a share of the cores each on
    CPU. Each slot also carries ``_RUNS_PER_GPU``: how many slots share its GPU."""
    if jobs == 1:
        return [{}]
    if device == "cpu":
        threads = str(max(1, (os.cpu_count() or 1) // jobs))
        return [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} for _ in range(jobs)]
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [x for x in visible.split(",") if x.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        raise StudyError("no CUDA GPU is visible")
    if len(ids) < jobs and not share_gpus:
        raise StudyError(f"--jobs {jobs} runs one job per GPU but {len(ids)} GPU(s) are visible; "
                         f"use --jobs {max(1, len(ids))}, or add --share-gpus to run several on one GPU")
    per_gpu = -(-jobs // len(ids))
    return [{"CUDA_VISIBLE_DEVICES": ids[i % len(ids)], _RUNS_PER_GPU: str(per_gpu)} for i in range(jobs)]


#: Slot key (not passed to the trainer's environment) recording how many runs share a GPU.
_RUNS_PER_GPU = "_RUNS_PER_GPU"


_NONFINITE_RE = re.compile(r"non-finite .*? at step (\d+)")
_EXIT_NONFINITE = 3  # nemo-fp8-train's exit status for NonFiniteLossError


def _finish_log(job: _Job, rc: int, root: Path, runs_per_gpu: int = 1) -> dict:
    d = job.spec.run_dir(root)
    state, step = run_state(job.spec, root)
    rec = {"run": job.spec.label, "rc": rc, "wall_s": round(time.time() - job.started, 1),
           "runs_per_gpu": runs_per_gpu,
           "steps_before": job.state_before[1], "steps_after": step, "state": state,
           "interrupted": job.interrupted, "host": socket.gethostname(),
           "date": _dt.datetime.now().isoformat(timespec="seconds")}
    if rc == _EXIT_NONFINITE and not job.interrupted and state != "complete":
        tail = (d / "study_train.log").read_text(encoding="utf-8", errors="replace")[-4000:]
        found = _NONFINITE_RE.findall(tail)
        rec["state"] = "diverged"
        rec["diverged_at"] = int(found[-1]) if found else None
        rec["error"] = tail.strip().splitlines()[-1] if tail.strip() else ""
    elif rc != 0 and not job.interrupted and state != "complete":
        rec["state"] = "failed"  # retried by the next call, from its last checkpoint
        rec["error"] = (d / "study_train.log").read_text(encoding="utf-8", errors="replace")[-3000:]
    hist_path = d / "study_run.json"
    hist = json.loads(hist_path.read_text(encoding="utf-8")) if hist_path.is_file() else []
    hist.append(rec)
    hist_path.write_text(json.dumps(hist, indent=2) + "\n", encoding="utf-8")
    return rec


def execute(specs: Sequence[RunSpec], root: Path, *, jobs: int, device: str, max_wall_s: Optional[float],
            min_start_s: float, grace_s: float, probe: bool, echo: bool = True,
            share_gpus: bool = False) -> List[dict]:
    """Run ``specs`` (skipping complete and diverged ones) as trainer subprocesses, ``jobs`` at a
    time, until done or until the ``max_wall_s`` deadline; probe each completed run. Returns one
    record per run (``state`` complete | diverged | partial | absent | failed, ``rc``,
    ``wall_s``, ...); each run directory's ``study_run.json`` keeps the history of its calls."""
    t0 = time.time()
    deadline = t0 + max_wall_s if max_wall_s else None
    queue = []
    records: List[dict] = []
    for spec in specs:
        state = run_state(spec, root)
        if state[0] in ("complete", "diverged"):
            rec = {"run": spec.label, "state": state[0], "rc": 0, "skipped": True, "steps_after": state[1]}
            if state[0] == "complete" and probe and not (spec.run_dir(root) / "probe.json").is_file():
                _probe_or_report(spec, root, device, {}, rec, echo)
            records.append(rec)
            if echo:
                print(f"[skip] {spec.label}: {state[0]} ({state[1]} steps)"
                      + ("; delete its run directory to train it again" if state[0] == "diverged" else ""), flush=True)
            continue
        queue.append((spec, state))
    slots = _slots(jobs, device, share_gpus) if queue else []
    free = list(range(len(slots)))
    active: List[_Job] = []
    try:
        while queue or active:
            now = time.time()
            while queue and free:
                left = None if deadline is None else deadline - now
                if left is not None and left < min_start_s:
                    for spec, state in queue:
                        records.append({"run": spec.label, "state": state[0], "rc": None, "not_started": True,
                                        "steps_after": state[1]})
                        if echo:
                            print(f"[wait] {spec.label}: not started ({left:.0f} s left < --min-start-s "
                                  f"{min_start_s:.0f}); run the same command again", flush=True)
                    queue = []
                    break
                spec, state = queue.pop(0)
                slot = free.pop(0)
                d = spec.run_dir(root)
                d.mkdir(parents=True, exist_ok=True)
                log = open(d / "study_train.log", "a", encoding="utf-8")
                cmd = [sys.executable, "-m", "nemo_fp8_recipes.train", *spec.overrides,
                       f"run.root={Path(root).resolve() / spec.part}", "trainer.resume=auto"]
                log.write(f"\n==== {_dt.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n")
                log.flush()
                env = {**os.environ, **{k: v for k, v in slots[slot].items() if k != _RUNS_PER_GPU},
                       "PYTHONUNBUFFERED": "1"}
                env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
                # own session: only this script decides when a run is interrupted (one SIGINT,
                # so the trainer's checkpoint-on-interrupt is not itself interrupted)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                        start_new_session=True)
                active.append(_Job(spec, proc, log, time.time(), slot, state))
                if echo:
                    where = f" [{', '.join(f'{k}={v}' for k, v in slots[slot].items())}]" if slots[slot] else ""
                    print(f"[run ] {spec.label}: {state[0]} at step {state[1]} -> {spec.steps}{where}; "
                          f"log {d / 'study_train.log'}", flush=True)
            time.sleep(0.2)
            now = time.time()
            for job in list(active):
                rc = job.proc.poll()
                if rc is None:
                    if deadline is not None and now >= deadline and not job.interrupted:
                        job.interrupted, job.sigint_at = True, now
                        job.proc.send_signal(signal.SIGINT)  # the trainer checkpoints between steps
                        if echo:
                            print(f"[stop] {job.spec.label}: --max-wall-s reached; interrupting "
                                  "(the trainer saves a checkpoint if it is between steps)", flush=True)
                    elif job.sigint_at is not None and now - job.sigint_at > grace_s:
                        job.proc.kill()
                        job.sigint_at = None
                    continue
                job.log.close()
                active.remove(job)
                free.append(job.slot)
                rec = _finish_log(job, rc, root, int(slots[job.slot].get(_RUNS_PER_GPU, 1)))
                if rec["state"] == "diverged":
                    if echo:
                        print(f"[warn] {job.spec.label} diverged (non-finite loss/gradient) at step "
                              f"{rec['diverged_at']}: reported as such, not retried", flush=True)
                elif rec["state"] == "complete" and probe:
                    _probe_or_report(job.spec, root, device, slots[job.slot], rec, echo)
                records.append(rec)
                if echo:
                    tag = "done" if rec["state"] == "complete" else ("stop" if job.interrupted else rec["state"])
                    print(f"[{tag:>4}] {job.spec.label}: "
                          f"step {rec['steps_after']}/{job.spec.steps}, {rec['wall_s']} s"
                          + (f", rc {rc}" if rc else ""), flush=True)
                    if rec["state"] == "failed":
                        print(rec["error"], file=sys.stderr, flush=True)
    except BaseException:
        for job in active:  # never leave orphans behind: interrupt (checkpoint), then kill
            if job.proc.poll() is None and not job.interrupted:
                job.proc.send_signal(signal.SIGINT)
        for job in active:
            try:
                job.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                job.proc.kill()
        raise
    return records


def _probe_or_report(spec: RunSpec, root: Path, device: str, slot_env: Dict[str, str], rec: dict, echo: bool) -> None:
    d = spec.run_dir(root)
    try:
        dev = device
        if device != "cpu" and slot_env.get("CUDA_VISIBLE_DEVICES") is not None:
            dev = _cuda_index_for(slot_env["CUDA_VISIBLE_DEVICES"])
        res = probe_run(d, dev)
        _free_cuda()
        (d / "probe.json").write_text(json.dumps(_finite(res), indent=2) + "\n", encoding="utf-8")
        rec["probe"] = True
    except Exception as e:  # noqa: BLE001 - reported: the run itself is complete
        rec["probe"] = False
        rec["probe_error"] = f"{type(e).__name__}: {e}"
        if echo:
            print(f"[warn] probe of {spec.label} failed: {rec['probe_error']}", file=sys.stderr, flush=True)


def _free_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # leave the GPU to the next trainer run


def _cuda_index_for(visible_id: str) -> str:
    """The device string in this process for the GPU a slot's ``CUDA_VISIBLE_DEVICES`` names."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in mine.split(",")] if mine else None
    if ids is None:
        return f"cuda:{int(visible_id)}"
    return f"cuda:{ids.index(visible_id)}"


# ---- activation probe ---------------------------------------------------------------------------
def _channel_sqnr_median(x, deq):
    import torch

    sig = x.pow(2).sum(0)
    err = (x - deq).pow(2).sum(0)
    keep = sig > 0
    if not bool(keep.any()):
        return float("nan")
    per = 10.0 * torch.log10(sig[keep] / err[keep].clamp_min(1e-30))
    return float(per.median())


def probe_tensor(x) -> dict:
    """Quantisation of one activation ``x`` ``[tokens, channels]`` by every probe quantiser:
    ``channel_rms_ratio`` (largest over median channel RMS: the outlier strength), ``amax`` and,
    per quantiser, whole-tensor ``sqnr_db``, ``median_channel_sqnr_db`` and ``underflow_frac``."""
    from nemo_fp8_recipes.quant.reference import quantization_stats, quantize
    from nemo_fp8_recipes.recipes import get_recipe

    x = x.detach().float().reshape(-1, x.shape[-1])
    rms = x.pow(2).mean(0).sqrt()
    med = float(rms.median())
    out = {"channel_rms_ratio": float(rms.max()) / med if med > 0 else float("inf"),
           "amax": float(x.abs().max()), "quantisers": {}}
    for label, recipe in PROBE_QUANTISERS:
        r = get_recipe(recipe)
        q = quantize(x, r.input_format, r.input_granularity, r.scale_rounding)
        st = quantization_stats(x, q).tolist()
        out["quantisers"][label] = {
            "sqnr_db": st[4],
            "median_channel_sqnr_db": _channel_sqnr_median(x, q.dequantize()),
            "underflow_frac": st[2],
        }
    return out


def probe_run(run_dir: Path, device: str = "cpu") -> dict:
    """Activation probe of a finished run (see the module docstring): load its final checkpoint
    into a plain (unconverted) model, run one validation micro-batch, and quantise the inputs of
    ``wq``, ``w1`` and ``w2`` of every layer with each probe quantiser."""
    import torch
    from omegaconf import OmegaConf

    from nemo_fp8_recipes.checkpoint import load_checkpoint
    from nemo_fp8_recipes.data import ByteTokenizer, DataConfig, PackedTokens, ValBatches, load_corpus
    from nemo_fp8_recipes.models import ModelConfig, Transformer

    run_dir = Path(run_dir)
    step = _checkpoint_step(run_dir)
    if step is None:
        raise StudyError(f"{run_dir}: no checkpoint to probe")
    ckpt = load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt", map_location="cpu")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    mcfg = ModelConfig.from_dict(ckpt["model_config"])
    dev = torch.device(device)
    with torch.device(dev):
        model = Transformer(mcfg)
    state = {k: v for k, v in ckpt["model"].items()
             if not k.rsplit(".", 1)[-1].startswith(("fp8_", "_extra_state"))}
    model.load_state_dict(state, strict=True)  # every weight of the trained model, nothing else
    del ckpt
    model.eval()
    dcfg = DataConfig.from_dict(OmegaConf.to_container(cfg.data, resolve=True))
    corpus = load_corpus(dcfg, ByteTokenizer())
    seq_len, mb = int(cfg.trainer.seq_len), int(cfg.trainer.micro_batch_size)
    x, _ = next(ValBatches(PackedTokens(corpus.val, seq_len, "validation"), micro_batch_size=mb,
                           num_batches=1).iter(dev))
    results: Dict[str, List[dict]] = {k: [] for k in PROBE_SITES}
    hooks = []
    for i, layer in enumerate(model.layers):
        for site, (path, _) in PROBE_SITES.items():
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                continue  # e.g. an MoE layer has no feed_forward.w1

            def hook(m, args, site=site, i=i):
                results[site].append({"layer": i, **probe_tensor(args[0])})

            hooks.append(mod.register_forward_pre_hook(hook))
    if dev.type == "cuda":  # as the trainer runs it
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = torch.autocast("cpu", enabled=False)
    try:
        with torch.no_grad(), autocast:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return {"run_dir": str(run_dir), "step": step, "device": str(dev), "tokens": int(x.numel()),
            "outlier_channels": mcfg.outlier_channel_ids, "outlier_scale": mcfg.outlier_scale,
            "sites": results}


def summarize_probe(probe: dict) -> List[dict]:
    """One row per site: mean over layers of every probe number, and the worst layer (lowest
    median-channel SQNR) per quantiser."""
    rows = []
    for site, layers in probe["sites"].items():
        if not layers:
            continue
        row = {"site": site, "layers": len(layers),
               "channel_rms_ratio": _mean([l["channel_rms_ratio"] for l in layers]),
               "amax": max(l["amax"] for l in layers), "quantisers": {}}
        for label, _ in PROBE_QUANTISERS:
            vals = [l["quantisers"][label] for l in layers]
            worst = min(range(len(vals)), key=lambda j: _nan_high(vals[j]["median_channel_sqnr_db"]))
            row["quantisers"][label] = {
                "sqnr_db": _mean([v["sqnr_db"] for v in vals]),
                "median_channel_sqnr_db": _mean([v["median_channel_sqnr_db"] for v in vals]),
                "worst_median_channel_sqnr_db": vals[worst]["median_channel_sqnr_db"],
                "worst_layer": layers[worst]["layer"],
                "underflow_frac": _mean([v["underflow_frac"] for v in vals]),
            }
        rows.append(row)
    return rows


# ---- telemetry ----------------------------------------------------------------------------------
def read_scalars(run_dir: Path, prefix: str = "") -> Dict[str, List[Tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the run's TensorBoard scalars starting with ``prefix``
    (one value per step: a later write of a step wins, as after a resume)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 1, "images": 1,
                                                        "histograms": 1, "audio": 1, "compressedHistograms": 1})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        if tag.startswith(prefix):
            by_step = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
            out[tag] = sorted(by_step.items())
    return out


def read_telemetry(run_dir: Path) -> Dict[Tuple[str, str, str], List[Tuple[int, float]]]:
    """The trainer's FP8 telemetry ``fp8/<group>/<operand>/<stat>`` as
    ``{(group, operand, stat): [(step, value), ...]}`` (empty for a BF16 run)."""
    out = {}
    for tag, series in read_scalars(run_dir, "fp8/").items():
        parts = tag.split("/")
        if len(parts) == 4 and parts[2] in ROLES:
            out[(parts[1], parts[2], parts[3])] = series
    return out


def _worst(series: Sequence[Tuple[int, float]], pick) -> Tuple[float, int]:
    """(value, step) of the worst point; a non-finite value is the worst of all."""
    bad = -math.inf if pick is min else math.inf
    step, value = pick(series, key=lambda sv: sv[1] if math.isfinite(sv[1]) else bad)
    return value, step


def summarize_telemetry(tel: Dict[Tuple[str, str, str], List[Tuple[int, float]]]) -> List[dict]:
    """Rows ``{group, operand, role, points, nonfinite, <stat>_mean, <stat>_worst,
    <stat>_worst_step}`` for every (group, operand), plus group ``all`` per operand (every group
    and step pooled). Mean over finite points; worst = lowest SQNR, highest flushed / saturated
    fraction, highest amax, a non-finite point being the worst (and counted in ``nonfinite``)."""
    rows = []
    groups = sorted({g for g, _, _ in tel})
    for op in ROLES:
        for g in groups + ["all"]:
            stats = {st: [p for (gg, o, s_), v in tel.items() if o == op and s_ == st and g in ("all", gg) for p in v]
                     for st in STATS}
            if not any(stats.values()):
                continue
            row = {"group": g, "operand": op, "role": ROLES[op],
                   "points": max(len(v) for v in stats.values()), "nonfinite": 0}
            for st, pick in STATS.items():
                series = stats[st]
                finite = [v for _, v in series if math.isfinite(v)]
                row["nonfinite"] += len(series) - len(finite)
                row[f"{st}_mean"] = _mean(finite)
                row[f"{st}_worst"], row[f"{st}_worst_step"] = _worst(series, pick) if series else (None, None)
            rows.append(row)
    return rows


def plot_telemetry(runs: Dict[str, Dict[Tuple[str, str, str], List[Tuple[int, float]]]], path: Path,
                   title: str) -> None:
    """PNG: rows SQNR / flushed / saturated / amax, columns activations / weights / gradients;
    one colour per run, solid = attention group, dashed = mlp group (dotted: any other group)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(15, 12), dpi=100, layout="constrained")
    axes = fig.subplots(len(STATS), len(ROLES), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"attention": "-", "mlp": "--"}
    for ri, run in enumerate(runs):
        for (g, op, st), series in runs[run].items():
            if st not in STATS:
                continue
            ax = axes[list(STATS).index(st)][list(ROLES).index(op)]
            xs = [s for s, _ in series]
            ys = [v * 100 if st.endswith("_frac") else v for _, v in series]
            ax.plot(xs, ys, color=colors[ri % len(colors)], linestyle=styles.get(g, ":"), linewidth=1.3)
    for i, st in enumerate(STATS):
        for j, op in enumerate(ROLES):
            ax = axes[i][j]
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"{ROLES[op]} ({op})")
            if j == 0:
                ax.set_ylabel(STAT_LABELS[st])
            if i == len(STATS) - 1:
                ax.set_xlabel("step")
            if st == "amax":
                ax.set_yscale("log")
            elif st.endswith("_frac"):
                ax.set_yscale("symlog", linthresh=1e-4)
    handles = [Line2D([], [], color=colors[i % len(colors)], label=r) for i, r in enumerate(runs)]
    handles += [Line2D([], [], color="black", linestyle=s, label=f"group {g}") for g, s in styles.items()]
    fig.suptitle(title)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(8, len(handles)))
    fig.savefig(str(path))


# ---- compare ------------------------------------------------------------------------------------
def run_compare(run_dirs: Sequence[Path], out: Path, *, tag: str, last: int) -> dict:
    """Run ``nemo-fp8-compare`` (its command-line entry point, in this process: the package is
    already imported) on ``run_dirs`` with baseline ``bf16``; return its ``compare.json``. Its
    printed table is kept in ``compare_stdout.txt``."""
    import contextlib

    from nemo_fp8_recipes import compare

    argv = [*[str(d) for d in run_dirs], "--baseline", "bf16", "--tag", tag, "--last", str(last), "--out", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = compare.main(argv)
    if rc != 0:
        raise StudyError(f"nemo-fp8-compare {' '.join(argv)} failed (exit {rc}): {stderr.getvalue()[-3000:]}")
    Path(out, "compare_stdout.txt").write_text(stdout.getvalue(), encoding="utf-8")
    return json.loads((Path(out) / "compare.json").read_text(encoding="utf-8"))


def _results_by_name(cmp: dict) -> Dict[str, dict]:
    return {r["name"]: r for r in cmp["results"]}


# ---- the report ---------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> Optional[float]:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _nan_high(x) -> float:
    return math.inf if x is None or not math.isfinite(x) else x


def _finite(obj):
    """Non-finite floats as None, for JSON (the compare tool's rule)."""
    from nemo_fp8_recipes.compare import _finite as finite

    return finite(obj)


def _pct(x: Optional[float], signed: bool = True, digits: int = 3) -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    return f"{100 * x:+.{digits}f}%" if signed else f"{100 * x:.{digits}f}%"


def _num(x: Optional[float], spec: str = ".4f") -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _stat_cell(row: dict, st: str) -> Tuple[str, str]:
    m, w = row.get(f"{st}_mean"), row.get(f"{st}_worst")
    if st == "sqnr_db":
        return _num(m, ".2f"), _num(w, ".2f")
    if st.endswith("_frac"):
        return _pct(m, signed=False, digits=4), _pct(w, signed=False, digits=4)
    return _num(m, ".4g"), _num(w, ".4g")


def telemetry_table(per_run: Dict[str, List[dict]], groups: Sequence[str] = ("all",)) -> str:
    """Markdown: one row per run x role (x group), mean / worst over training of each statistic."""
    head = ["run", "role (operand)", "group", "points", "SQNR dB mean", "SQNR dB worst", "flushed mean",
            "flushed worst", "saturated mean", "saturated worst", "amax mean", "amax max", "non-finite"]
    rows = []
    for run, trows in per_run.items():
        if not trows:
            rows.append([run, "— (no FP8: no telemetry)"] + [""] * (len(head) - 2))
            continue
        for r in trows:
            if r["group"] not in groups:
                continue
            cells = [c for st in STATS for c in _stat_cell(r, st)]
            rows.append([run, f"{r['role']} ({r['operand']})", r["group"], r["points"], *cells, r["nonfinite"]])
    return table(head, rows)


def probe_table(per_run: Dict[str, List[dict]]) -> str:
    """Markdown: one row per run x probe site; per quantiser the median-channel SQNR (mean over
    layers, worst layer) and the whole-tensor SQNR."""
    head = ["run", "site", "max/median channel RMS"]
    for label, _ in PROBE_QUANTISERS:
        head += [f"{label}: median-channel SQNR dB (worst layer)", f"{label}: tensor SQNR dB",
                 f"{label}: flushed"]
    rows = []
    for run, prow in per_run.items():
        if prow is None:
            rows.append([run, "— (no probe.json: diverged, --no-probe, or the probe failed)"]
                        + [""] * (len(head) - 2))
            continue
        for r in prow:
            cells = [run, f"{r['site']} ({PROBE_SITES[r['site']][1]})", _num(r["channel_rms_ratio"], ".1f")]
            for label, _ in PROBE_QUANTISERS:
                q = r["quantisers"][label]
                worst = _num(q["worst_median_channel_sqnr_db"], ".2f")
                cells += [f"{_num(q['median_channel_sqnr_db'], '.2f')} ({worst}, layer {q['worst_layer']})",
                          _num(q["sqnr_db"], ".2f"),
                          _pct(q["underflow_frac"], signed=False, digits=3)]
            rows.append(cells)
    return table(head, rows)


def goal_rows(train: Dict[str, dict], val: Dict[str, dict], recipes: Sequence[str],
              goals: Dict[str, float]) -> Tuple[List[dict], dict]:
    """The goal check: per FP8 recipe the final train and validation loss relative to BF16, the
    goal (``goals``; none for a recipe not in it), whether it is met, and the ratio of the
    deviation to the BF16 seed-to-seed deviation (``bf16-seed2``; ``None`` without that run)."""
    noise = {"train": train.get("bf16-seed2", {}).get("final_vs_baseline"),
             "val": val.get("bf16-seed2", {}).get("final_vs_baseline")}
    rows = []
    for key in recipes:
        t, v = train.get(key, {}), val.get(key, {})
        goal = goals.get(key)
        row = {"run": key, "train_final": t.get("final_loss"), "train_dev": t.get("final_vs_baseline"),
               "val_final": v.get("final_loss"), "val_dev": v.get("final_vs_baseline"), "goal": goal}
        for m in ("train", "val"):
            dev, n = row[f"{m}_dev"], noise[m]
            row[f"{m}_met"] = None if goal is None or dev is None else abs(dev) <= goal
            row[f"{m}_vs_noise"] = abs(dev) / abs(n) if dev is not None and n not in (None, 0) else None
        rows.append(row)
    return rows, noise


def build_report(root: Path, *, allow_partial: bool = False) -> Dict[str, Path]:
    """Compare, telemetry, probe and goal check from the run directories under ``root`` into
    ``<root>/report`` (see the module docstring). Raises :class:`StudyError` when a planned run
    is missing or incomplete, unless ``allow_partial`` (the report then names those runs)."""
    root = Path(root)
    m = load_manifest(root)
    plan = plan_from_manifest(m)
    states = {r.label: run_state(r, root) for r in plan}
    incomplete = [f"{lbl} ({st}, {n} steps)" for lbl, (st, n) in states.items()
                  if st not in ("complete", "diverged")]
    diverged = {lbl: n for lbl, (st, n) in states.items() if st == "diverged"}
    if incomplete and not allow_partial:
        raise StudyError(f"incomplete runs: {', '.join(incomplete)}. Run them first (the same study command "
                         "with the same --root), or pass --allow-partial to report what exists")
    out = root / "report"
    out.mkdir(parents=True, exist_ok=True)
    with_events = [r for r in plan if list(r.run_dir(root).glob("events.out.tfevents.*"))]
    report: dict = {"generated": _dt.datetime.now().isoformat(timespec="seconds"), "root": str(root),
                    "model": m["model"], "tokens_per_step": m["tokens_per_step"], "smoke": m["smoke"],
                    "incomplete": incomplete, "diverged": diverged, "parts": {}}
    md: List[str] = []
    tps = m["tokens_per_step"]
    main = [r for r in plan if r.part == "main"]
    stress = [r for r in plan if r.part == "stress"]
    env = _environment(plan, root)
    report["environment"] = env

    smoke = " (SMOKE: tiny CPU pipeline check, not a result)" if m["smoke"] else ""
    md.append(f"# Numerics study: {m['model']}{smoke}")
    md.append("")
    md.append(f"Generated {report['generated']} by `benchmarks/numerics_study.py` from `{root}`. "
              f"Trainer runs: {env}.")
    if main:
        s_steps = stress[0].steps if stress else 0
        md.append(f"Main runs: {main[0].steps} steps x {tps} tokens = **{main[0].steps * tps:,} tokens per run**; "
                  f"stress runs: {s_steps} steps ({s_steps * tps:,} tokens).")
    if incomplete:
        md.append("")
        md.append(f"**Incomplete runs (report built with --allow-partial): {', '.join(incomplete)}.**")

    files: Dict[str, Path] = {}
    parts = [(part, runs, last, [r for r in runs if r in with_events])
             for part, runs, last in (("main", main, m["last"]), ("stress", stress, m["stress_last"]))]
    compare_jobs = []
    for part, runs, last, have in parts:
        if not have:
            continue
        if not any(r.key == "bf16" for r in have):
            raise StudyError(f"{part}: the bf16 baseline run has no events; run it first")
        if f"{part}/bf16".replace("main/", "") in diverged:
            raise StudyError(f"{part}: the bf16 baseline diverged; there is nothing to compare against "
                             "(lower trainer.lr or change the stress)")
        for tag, tag_last in (("train/loss", last), ("val/loss", 1)):
            # a run that diverged early may not have logged a tag at all: compare those that did
            with_tag = [r for r in have if tag in read_scalars(r.run_dir(root), tag.split("/")[0] + "/")]
            if any(r.key == "bf16" for r in with_tag):
                compare_jobs.append(((part, tag), ([r.run_dir(root) for r in with_tag],
                                                   out / f"compare_{part}" / tag.split("/")[0], tag, tag_last)))
    compared = {key: run_compare(dirs, o, tag=tag, last=n) for key, (dirs, o, tag, n) in compare_jobs}
    for part, runs, last, have in parts:
        if not have:
            continue
        info: dict = {"runs": [r.label for r in runs], "missing": [r.label for r in runs if r not in have]}
        div = {r.key: diverged[r.label] for r in have if r.label in diverged}
        info["diverged"] = div
        cmps = {tag: c for (p_, tag), c in compared.items() if p_ == part}
        if "train/loss" not in cmps:
            raise StudyError(f"{part}: the bf16 run logged no train/loss")
        cmp_val = cmps.get("val/loss")
        name_to_key = {r.name: r.key for r in have}
        by_key = {r.key: r for r in have}
        train_k = {name_to_key[n]: v for n, v in _results_by_name(cmps["train/loss"]).items()}
        val_k = {name_to_key[n]: v for n, v in _results_by_name(cmp_val).items()} if cmp_val else {}
        for k in div:  # the last logged values of a diverged run are not final losses
            train_k[k] = {**train_k.get(k, {}), "final_loss": None, "final_vs_baseline": None}
            val_k[k] = {**val_k.get(k, {}), "final_loss": None, "final_vs_baseline": None}
        fp8_keys = [r.key for r in have if r.recipe != "bf16"]
        goals, noise = goal_rows(train_k, val_k, fp8_keys, GOALS if part == "main" else {})
        for g in goals:
            if g["run"] in div:
                g.update(diverged_at=div[g["run"]], train_met=False if g["goal"] else None,
                         val_met=False if g["goal"] else None)
        info.update({"compare_train": str(out / f"compare_{part}" / "train" / "compare.json"),
                     "compare_val": str(out / f"compare_{part}" / "val" / "compare.json") if cmp_val else None,
                     "final": {k: {"train_loss": train_k[k].get("final_loss"),
                                   "train_vs_bf16": train_k[k].get("final_vs_baseline"),
                                   "val_loss": val_k.get(k, {}).get("final_loss"),
                                   "val_vs_bf16": val_k.get(k, {}).get("final_vs_baseline"),
                                   "tokens_per_s": train_k[k].get("tokens_per_s"), "steps": train_k[k].get("last_step"),
                                   "diverged_at": div.get(k), "wall_s": _wall_s(root / by_key[k].rel_dir)}
                               for k in train_k},
                     "seed_noise": noise, "goals": goals})
        # telemetry
        tel = {r.key: read_telemetry(r.run_dir(root)) for r in have}
        tsum = {k: summarize_telemetry(v) for k, v in tel.items()}
        info["telemetry"] = tsum
        fp8_tel = {k: v for k, v in tel.items() if v}
        if fp8_tel:
            png = out / ("telemetry.png" if part == "main" else f"telemetry_{part}.png")
            plot_telemetry(fp8_tel, png, f"FP8 quantisation telemetry over training ({part} runs, {m['model']})")
            files[f"telemetry_png_{part}"] = png
        # probe
        probes = {}
        for r in have:
            p = r.run_dir(root) / "probe.json"
            probes[r.key] = summarize_probe(json.loads(p.read_text(encoding="utf-8"))) if p.is_file() else None
        info["probe"] = probes
        report["parts"][part] = info

        # ---- markdown for this part ----
        md.append("")
        if part == "main":
            md.append("## Final loss vs BF16 (goal check)")
            md.append("")
            md.append(f"Train loss: mean of the logged `train/loss` over the last {last} steps; validation loss: the "
                      "last `val/loss` (fixed held-out batches, identical for every run). Deviation = "
                      "(run − bf16) / bf16. Seed noise = the same deviation for `bf16-seed2` (other initialisation "
                      "and data order); the FP8 runs share bf16's seed, so the noise floor is conservative.")
        else:
            md.append("## Outlier stress")
            md.append("")
            md.append(f"Overrides: `{' '.join(m['stress_overrides'])}`; baseline: the stressed bf16 run. Train loss: "
                      f"mean over the last {last} steps.")
        md.append("")
        rows = []
        for r in have:
            k = r.key
            t = train_k.get(k, {})
            v = val_k.get(k, {})
            g = next((x for x in goals if x["run"] == k), None)
            if r.key == "bf16":
                role = "baseline"
            elif r.key == "bf16-seed2":
                role = "seed noise"
            else:
                role = f"goal ±{100 * GOALS[k]:.2f}%" if part == "main" and k in GOALS else "—"
            verdict = "—"
            if k in div:
                verdict = f"**DIVERGED at step {div[k]}**"
            elif g is not None and part == "main" and g["goal"] is not None:
                verdict = " / ".join(f"{m_}: {'met' if g[f'{m_}_met'] else 'MISSED'}" for m_ in ("train", "val")
                                     if g[f"{m_}_met"] is not None)
            xn = g["val_vs_noise"] if g else None
            rows.append([k, role, _num(t.get("final_loss")), _pct(t.get("final_vs_baseline")),
                         _num(v.get("final_loss")), _pct(v.get("final_vs_baseline")),
                         _num(xn, ".2f") + "×" if xn is not None else "—", verdict,
                         _num(t.get("tokens_per_s"), ",.0f") + ("†" if _runs_per_gpu(r.run_dir(root)) > 1 else ""),
                         _num(_wall_s(r.run_dir(root)), ".0f")])
        md.append(table(["run", "role", f"train loss (last {last})", "vs bf16", "val loss (final)", "vs bf16",
                          "\\|val dev\\| / seed noise", "goal verdict (train / val)", "tokens/s",
                          "wall s (study)"], rows))
        shared = {r.key: _runs_per_gpu(r.run_dir(root)) for r in have}
        if any(v > 1 for v in shared.values()):
            md.append("")
            md.append(f"† the GPU was shared by up to {max(shared.values())} runs at once (`--share-gpus`): "
                      "these tokens/s are not speed figures (docs/benchmarks.md has those).")
        md.append("")
        md.append(f"Loss curves (nemo-fp8-compare): `{out / f'compare_{part}' / 'train' / 'compare.png'}`"
                  + (f", validation: `{out / f'compare_{part}' / 'val' / 'compare.png'}`" if cmp_val else ""))
        md.append("")
        md.append("### Telemetry " + ("(main runs)" if part == "main" else "(stress runs)"))
        md.append("")
        md.append("Per tensor role, pooled over layer groups (attention, mlp) and training (every "
                  "`trainer.telemetry_interval` steps); worst = lowest SQNR / highest fraction / largest amax. "
                  "Per-group rows: `telemetry.md`.")
        md.append("")
        md.append(telemetry_table(tsum))
        if fp8_tel:
            md.append("")
            md.append(f"Plot over steps: `{files[f'telemetry_png_{part}']}`")
        md.append("")
        md.append("### Activation probe " + ("(main runs)" if part == "main" else "(stress runs)"))
        md.append("")
        md.append("The final checkpoint's activations (one validation micro-batch, no FP8) quantised with each "
                  "recipe's input quantiser; median-channel SQNR is the median over channels of the per-channel "
                  "SQNR (mean over layers; worst layer in brackets).")
        md.append("")
        md.append(probe_table(probes))

    # telemetry files (all parts, every group)
    all_tel = {f"{part}/{k}" if part != "main" else k: rows_
               for part, info in report["parts"].items() for k, rows_ in info["telemetry"].items()}
    (out / "telemetry.json").write_text(json.dumps(_finite(all_tel), indent=2) + "\n", encoding="utf-8")
    (out / "telemetry.md").write_text(
        "# FP8 telemetry per run, role and layer group\n\n"
        + telemetry_table(all_tel, groups=("attention", "mlp", "experts", "shared_expert", "all")) + "\n",
        encoding="utf-8")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = ["run", "group", "operand", "role", "points", "nonfinite"] + [
        f"{st}_{k}" for st in STATS for k in ("mean", "worst", "worst_step")]
    w.writerow(cols)
    for run, rows_ in all_tel.items():
        for r in rows_:
            w.writerow([run] + ["" if r.get(c) is None else r.get(c) for c in cols[1:]])
    (out / "telemetry.csv").write_text(buf.getvalue(), encoding="utf-8")
    files.update({"telemetry_md": out / "telemetry.md", "telemetry_csv": out / "telemetry.csv",
                  "telemetry_json": out / "telemetry.json"})
    report_json = out / "report.json"
    report_md = out / "report.md"
    report_json.write_text(json.dumps(_finite(report), indent=2) + "\n", encoding="utf-8")
    report_md.write_text("\n".join(md) + "\n", encoding="utf-8")
    files.update({"report_md": report_md, "report_json": report_json})
    return files


def _runs_per_gpu(run_dir: Path) -> int:
    """Most runs that shared this run's GPU in any call (``--share-gpus``), 1 when it had one alone."""
    p = Path(run_dir) / "study_run.json"
    if not p.is_file():
        return 1
    return max([int(h.get("runs_per_gpu") or 1) for h in json.loads(p.read_text(encoding="utf-8"))] + [1])


def _wall_s(run_dir: Path) -> Optional[float]:
    """Seconds the study spent on a run (every call together, from ``study_run.json``)."""
    p = Path(run_dir) / "study_run.json"
    if not p.is_file():
        return None
    walls = [h.get("wall_s") for h in json.loads(p.read_text(encoding="utf-8")) if h.get("wall_s") is not None]
    return float(sum(walls)) if walls else None


def _environment(plan: Sequence[RunSpec], root: Path) -> str:
    """Device and versions as the trainer logged them (first run log that names them)."""
    for r in plan:
        log = r.run_dir(root) / "study_train.log"
        if log.is_file():
            for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
                if " | device " in line and " | recipe " in line:
                    dev = line.split(" | device ", 1)[1].split(" | ", 1)[0]
                    return f"device {dev}"
    return "device not recorded (no trainer log)"


# ---- export -------------------------------------------------------------------------------------
def export(root: Path, dest: Path) -> Path:
    """Copy the study (manifest, run directories without checkpoints, report) to ``dest``;
    ``--report-only --root <dest>`` works on the copy."""
    root, dest = Path(root), Path(dest)
    if not (root / "study.json").is_file():
        raise StudyError(f"nothing to export: {root}/study.json not found")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / "study.json", dest / "study.json")
    for sub in ("main", "stress", "report"):
        if (root / sub).is_dir():
            shutil.copytree(root / sub, dest / sub, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("checkpoints", "*.pt", ".tmp-*"))
    return dest


# ---- combining studies ---------------------------------------------------------------------------
BF16_KEYS = ("bf16", "bf16-seed2")
METRICS = ("train", "val")
_SEED_RE = re.compile(r"^trainer\.seed=(-?\d+)$")


def _seed_of(spec: RunSpec) -> Optional[int]:
    """The run's ``trainer.seed`` (the last such override wins, as in Hydra)."""
    seeds = [int(mt.group(1)) for mt in (_SEED_RE.match(o) for o in spec.overrides) if mt]
    return seeds[-1] if seeds else None


def _main_signature(m: dict) -> Dict[str, object]:
    """What two roots must share for their main runs to be pooled: model, tokens per step, steps,
    the train-loss window, the main runs, and each main run's overrides other than its seed."""
    main = [r for r in plan_from_manifest(m) if r.part == "main"]
    sig: Dict[str, object] = {"model": m.get("model"), "tokens_per_step": m.get("tokens_per_step"),
                              "steps": sorted({r.steps for r in main}), "last": m.get("last"),
                              "main runs": [r.key for r in main]}
    for r in main:
        sig[f"overrides of {r.key}"] = sorted(o for o in r.overrides if not _SEED_RE.match(o))
    return sig


def _check_same_settings(roots: Sequence[Path], manifests: Sequence[dict]) -> None:
    ref = _main_signature(manifests[0])
    for root, m in zip(roots[1:], manifests[1:]):
        sig = _main_signature(m)
        for name in list(ref) + [k for k in sig if k not in ref]:
            a, b = ref.get(name), sig.get(name)
            if a == b:
                continue
            if name.startswith("overrides of ") and isinstance(a, list) and isinstance(b, list):
                what = (f"only in {roots[0]}: {' '.join(sorted(set(a) - set(b))) or '—'}; "
                        f"only in {root}: {' '.join(sorted(set(b) - set(a))) or '—'}")
            else:
                show = lambda v: v[0] if isinstance(v, list) and len(v) == 1 else v  # noqa: E731
                what = f"{show(a)} in {roots[0]}, {show(b)} in {root}"
            raise StudyError(f"--combine: the studies differ in {name} ({what}); only studies with the same "
                             "model, tokens per step, steps and settings (seeds aside) can be pooled")


def _report_current(p: Path, main: Sequence[RunSpec], root: Path, states: Dict[str, Tuple[str, int]]) -> bool:
    """Whether ``report.json`` at ``p`` covers every main run and is newer than their results."""
    if not p.is_file():
        return False
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    final = rep.get("parts", {}).get("main", {}).get("final", {})
    if any(r.key not in final for r in main if states[r.key][0] != "diverged"):
        return False
    if any(str(x).split(" ", 1)[0] in states for x in rep.get("incomplete", [])):
        return False  # built with --allow-partial before the main part was done
    results = [f for r in main
               for f in [r.run_dir(root) / "summary.json", *r.run_dir(root).glob("events.out.tfevents.*")]
               if f.is_file()]
    return not results or p.stat().st_mtime >= max(f.stat().st_mtime for f in results)


def main_finals(root: Path) -> Tuple[dict, Dict[str, dict], bool]:
    """The manifest and the main runs' final losses of one study root, ``{key: {seed, train_loss,
    val_loss, diverged_at}}``, as its ``report/report.json`` has them (``parts.main.final``: train
    loss = mean of the last ``last`` steps, val loss = the final validation). The report is built
    first (:func:`build_report` with ``allow_partial``: the stress part may be missing) when there is
    none, when it lacks a main run or when a main run's events or summary are newer; the third
    value says whether it was. :class:`StudyError` when a main run is incomplete."""
    root = Path(root)
    m = load_manifest(root)
    main = [r for r in plan_from_manifest(m) if r.part == "main"]
    if not main or not any(r.key == "bf16" for r in main):
        raise StudyError(f"{root}/study.json plans no main bf16 run: nothing to combine")
    states = {r.key: run_state(r, root) for r in main}
    bad = [f"{k} ({st}, {n} steps)" for k, (st, n) in states.items() if st not in ("complete", "diverged")]
    if bad:
        raise StudyError(f"{root}: main runs not complete: {', '.join(bad)}; --combine needs every main run "
                         f"(only the stress part may be missing): finish them with the study command and --root {root}")
    p = root / "report" / "report.json"
    built = not _report_current(p, main, root, states)
    if built:
        build_report(root, allow_partial=True)
    final = json.loads(p.read_text(encoding="utf-8")).get("parts", {}).get("main", {}).get("final", {})
    finals = {}
    for r in main:
        f = final.get(r.key)
        div = (f or {}).get("diverged_at")
        if div is None and states[r.key][0] == "diverged":
            div = states[r.key][1]
        if f is None and div is None:
            raise StudyError(f"{p}: no final loss of the main run {r.key}")
        ok = div is None
        finals[r.key] = {"seed": _seed_of(r), "diverged_at": div,
                         "train_loss": f.get("train_loss") if ok else None,
                         "val_loss": f.get("val_loss") if ok else None}
    return m, finals, built


def _spread(xs: Sequence[Optional[float]]) -> Optional[dict]:
    """``{n, mean, std, rel_std}`` of the finite values (sample std, ``None`` below two values)."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None
    mean = statistics.fmean(xs)
    std = statistics.stdev(xs) if len(xs) > 1 else None
    return {"n": len(xs), "mean": mean, "std": std, "rel_std": std / mean if std is not None and mean else None}


def _rel(x: Optional[float], base: Optional[float]) -> Optional[float]:
    return (x - base) / base if x is not None and base not in (None, 0) else None


def _root_label(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


#: Two-sided 5% critical values of Student's t for 1..30 degrees of freedom (then 1.96).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def _t_crit95(df: float) -> float:
    """Two-sided 5% critical value of Student's t at ``df`` degrees of freedom (rounded down:
    conservative for a fractional Welch df)."""
    k = max(1, int(math.floor(df)))
    return _T95[k - 1] if k <= len(_T95) else 1.96


def _fp8_stats(xs: Sequence[Optional[float]], devs: Sequence[Optional[float]], pool: dict,
               goal: Optional[float]) -> Optional[dict]:
    """One FP8 recipe, one metric: its mean vs the BF16 pool mean, Welch's t-test at 5% (df by
    Welch-Satterthwaite), and whether the experiment resolves the goal: two standard errors of
    the difference below it."""
    sp = _spread(xs)
    if sp is None or pool is None or pool["std"] is None:
        return None
    own = sp["std"] is not None
    s_fp8 = sp["std"] if own else pool["std"]  # one run: its noise is taken to be BF16's
    a, b = s_fp8 ** 2 / sp["n"], pool["std"] ** 2 / pool["n"]
    se = math.sqrt(a + b)
    if own:
        den = (a * a / (sp["n"] - 1) if a else 0.0) + (b * b / (pool["n"] - 1) if b else 0.0)
        df = (a + b) ** 2 / den if den > 0 else float(sp["n"] + pool["n"] - 2)
    else:
        df = float(pool["n"] - 1)  # the only variance estimate is the pool's
    diff = sp["mean"] - pool["mean"]
    devs = [d for d in devs if d is not None]
    t = diff / se if se > 0 else None
    crit = _t_crit95(df)
    out = {**sp, "std_for_se": s_fp8, "std_source": "own runs" if own else "bf16 pool (one fp8 run)",
           "mean_paired_dev": statistics.fmean(devs) if devs else None, "diff": diff,
           "vs_pool": diff / pool["mean"], "se": se, "rel_2se": 2 * se / pool["mean"], "t": t, "df": df,
           "t_crit95": crit, "significant": (abs(t) >= crit) if t is not None else None,
           "within_2std": abs(diff) <= 2 * pool["std"], "resolvable": None, "runs_needed": None}
    if t is None:
        band = f"mean {_pct(out['vs_pool'], digits=2)} vs BF16"
    else:
        band = (f"mean {_pct(out['vs_pool'], digits=2)} vs BF16, t = {t:+.2f} (Welch, df {df:.1f}); "
                + (f"|t| ≥ {crit:.2f}: differs from BF16 at the 5% level" if out["significant"]
                   else f"|t| < {crit:.2f}: indistinguishable from BF16 at the 5% level"))
    if goal is None:
        out["verdict"] = f"no goal; {band}"
        return out
    out["resolvable"] = out["rel_2se"] < goal
    # runs per side for a goal-sized difference to be 2 standard errors with BF16's std on both sides
    out["runs_needed"] = math.ceil(8 * (pool["rel_std"] / goal) ** 2)
    res = (f"2 SE = {_pct(out['rel_2se'], signed=False, digits=2)} {'<' if out['resolvable'] else '≥'} goal "
           f"{_pct(goal, signed=False, digits=2)}")
    if out["resolvable"]:
        met = abs(out["vs_pool"]) <= goal
        out["verdict"] = f"resolvable ({res}); {'within' if met else 'OUTSIDE'} the goal; {band}"
    else:
        out["verdict"] = (f"not resolvable with these runs ({res}; BF16's run-to-run std "
                          f"{_pct(pool['rel_std'], signed=False, digits=2)}); {band}")
    return out


def combine(roots: Sequence[Path], out: Optional[Path] = None) -> Dict[str, Path]:
    """Pool the main part of several study roots (same model, tokens per step, steps and settings;
    seeds may differ) into ``out`` (default ``<first root>/combined``): ``combined.json``,
    ``combined.md`` and ``combined.png`` (see the module docstring). Returns the files written."""
    roots = [Path(r) for r in roots]
    if not roots:
        raise StudyError("--combine needs at least one study root")
    seen: Dict[Path, Path] = {}
    for r in roots:
        if not r.is_dir():
            raise StudyError(f"--combine: {r} is not a directory")
        if r.resolve() in seen:
            raise StudyError(f"--combine: {r} is given twice (as {seen[r.resolve()]}); its runs would count twice")
        seen[r.resolve()] = r
    _check_same_settings(roots, [load_manifest(r) for r in roots])
    loaded = [(_root_label(i), r, *main_finals(r)) for i, r in enumerate(roots)]
    m0 = loaded[0][2]
    main0 = [r for r in plan_from_manifest(m0) if r.part == "main"]
    steps, tps = main0[0].steps, m0["tokens_per_step"]
    fp8_keys = [r.key for r in main0 if r.key not in BF16_KEYS]

    roots_info = [{"label": lab, "root": str(r), "report_built": built,
                   "seeds": {k: f["seed"] for k, f in finals.items()},
                   "diverged": {k: f["diverged_at"] for k, f in finals.items() if f["diverged_at"] is not None}}
                  for lab, r, _, finals, built in loaded]
    # ---- the BF16 pool
    pool_runs = [{"root": lab, "key": k, "seed": finals[k]["seed"], "train_loss": finals[k]["train_loss"],
                  "val_loss": finals[k]["val_loss"]}
                 for lab, _, _, finals, _ in loaded for k in BF16_KEYS
                 if k in finals and finals[k]["diverged_at"] is None]
    excluded = [{"root": lab, "key": k, "diverged_at": finals[k]["diverged_at"]}
                for lab, _, _, finals, _ in loaded for k in BF16_KEYS
                if k in finals and finals[k]["diverged_at"] is not None]
    pool = {mt: _spread([p[f"{mt}_loss"] for p in pool_runs]) for mt in METRICS}
    if pool["train"] is None or pool["train"]["std"] is None:
        raise StudyError("--combine: the BF16 pool has fewer than two runs with a final train loss; "
                         "there is no run-to-run spread to compare with")
    by_seed: Dict[Optional[int], List[dict]] = {}
    for p in pool_runs:
        by_seed.setdefault(p["seed"], []).append(p)
    same_seed = []
    for seed, runs in by_seed.items():
        if len(runs) < 2:
            continue
        pairs = [{"a": {"root": a["root"], "key": a["key"]}, "b": {"root": b["root"], "key": b["key"]},
                  **{f"{mt}_rel_diff": _rel(b[f"{mt}_loss"], a[f"{mt}_loss"]) for mt in METRICS}}
                 for i, a in enumerate(runs) for b in runs[i + 1:]]
        entry = {"seed": seed, "runs": [{"root": x["root"], "key": x["key"]} for x in runs], "pairs": pairs}
        for mt in METRICS:
            ds = [abs(pp[f"{mt}_rel_diff"]) for pp in pairs if pp[f"{mt}_rel_diff"] is not None]
            entry[f"{mt}_max_abs_rel_diff"] = max(ds) if ds else None
        same_seed.append(entry)
    seed_means = [{"seed": s, "n": len(runs),
                   **{mt: (_spread([x[f"{mt}_loss"] for x in runs]) or {}).get("mean") for mt in METRICS}}
                  for s, runs in by_seed.items()]
    cross = {"seed_means": seed_means, "within_root": []}
    for mt in METRICS:
        sp = _spread([x[mt] for x in seed_means])
        vals = [x[mt] for x in seed_means if x[mt] is not None]
        cross[f"{mt}_rel_std"] = sp["rel_std"] if sp else None
        cross[f"{mt}_rel_range"] = (max(vals) - min(vals)) / sp["mean"] if sp and len(vals) > 1 else None
    for lab, _, _, finals, _ in loaded:
        b, s2 = finals.get("bf16"), finals.get("bf16-seed2")
        if b and s2 and s2["diverged_at"] is None and b["seed"] != s2["seed"]:
            cross["within_root"].append({"root": lab, "seeds": [b["seed"], s2["seed"]],
                                         **{f"{mt}_rel_diff": _rel(s2[f"{mt}_loss"], b[f"{mt}_loss"])
                                            for mt in METRICS}})
    # ---- the FP8 recipes
    recipes = {}
    for key in fp8_keys:
        runs = []
        for lab, _, _, finals, _ in loaded:
            f, b = finals[key], finals["bf16"]
            runs.append({"root": lab, "seed": f["seed"], "bf16_seed": b["seed"], "diverged_at": f["diverged_at"],
                         **{f"{mt}_loss": f[f"{mt}_loss"] for mt in METRICS},
                         **{f"{mt}_paired_dev": _rel(f[f"{mt}_loss"], b[f"{mt}_loss"]) for mt in METRICS}})
        goal = GOALS.get(key)
        recipes[key] = {"goal": goal, "runs": runs,
                        **{mt: _fp8_stats([x[f"{mt}_loss"] for x in runs], [x[f"{mt}_paired_dev"] for x in runs],
                                          pool[mt], goal) for mt in METRICS}}
    data = {"generated": _dt.datetime.now().isoformat(timespec="seconds"), "model": m0["model"],
            "smoke": any(x[2].get("smoke") for x in loaded), "tokens_per_step": tps, "steps": steps,
            "tokens_per_run": steps * tps, "last": m0["last"], "roots": roots_info,
            "bf16_pool": {"runs": pool_runs, "excluded": excluded, **pool},
            "same_seed": same_seed, "cross_seed": cross, "recipes": recipes}
    data["summary"] = _combined_summary(data)

    out = Path(out) if out is not None else roots[0] / "combined"
    out.mkdir(parents=True, exist_ok=True)
    files = {"combined_json": out / "combined.json", "combined_md": out / "combined.md",
             "combined_png": out / "combined.png"}
    plot_combined(data, files["combined_png"])
    files["combined_json"].write_text(json.dumps(_finite(data), indent=2) + "\n", encoding="utf-8")
    files["combined_md"].write_text(_combined_md(data, files["combined_png"]) + "\n", encoding="utf-8")
    return files


def _combined_summary(d: dict) -> str:
    """The plain-language line at the top of ``combined.md``."""
    pool, rec = d["bf16_pool"], d["recipes"]
    seeds = {p["seed"] for p in pool["runs"]}

    def rs(mt):
        return _pct(pool[mt]["rel_std"], signed=False, digits=2) if pool.get(mt) and pool[mt]["rel_std"] else "—"

    s = (f"BF16 alone, {len(pool['runs'])} runs over {len(seeds)} seed(s) in {len(d['roots'])} root(s), varies by "
         f"{rs('train')} (train) / {rs('val')} (val) from run to run (sample std of the final loss)")
    diffs = [abs(pp[f"{mt}_rel_diff"]) for e in d["same_seed"] for pp in e["pairs"] for mt in METRICS
             if pp[f"{mt}_rel_diff"] is not None]
    if diffs:
        s += (f"; the same seed run again differs by {_pct(min(diffs), signed=False, digits=2)}–"
              f"{_pct(max(diffs), signed=False, digits=2)} (run-to-run non-determinism)")
    stats = [(k, mt, r[mt]) for k, r in rec.items() for mt in METRICS if r.get(mt) and r[mt]["resolvable"] is not None]
    goals = ", ".join(f"{k} ±{_pct(rec[k]['goal'], signed=False, digits=2)}" for k in rec if rec[k]["goal"])
    if stats and not any(x["resolvable"] for _, _, x in stats):
        need = max(x["runs_needed"] for _, _, x in stats)
        s += (f". No goal ({goals}) is resolvable with these runs: two standard errors of every FP8-vs-BF16 "
              f"difference exceed its goal (a goal-sized difference would be 2 standard errors only with ~{need} "
              "runs of each recipe and as many of BF16, at this std)")
    elif stats:
        for word, want in (("resolvable", True), ("not resolvable with these runs", False)):
            which = [f"{k} ({mt})" for k, mt, x in stats if x["resolvable"] is want]
            if which:
                s += f". {word[0].upper() + word[1:]} (2 SE {'below' if want else 'not below'} the goal): " \
                     + ", ".join(which)
    parts = []
    for k, r in rec.items():
        cells = [f"{_pct(r[mt]['vs_pool'], digits=2)} (t {r[mt]['t']:+.1f})" if r.get(mt) and r[mt]["t"] is not None
                 else "—" for mt in METRICS]
        parts.append(f"{k} {' / '.join(cells)}")
    s += ". FP8 mean vs the BF16 pool mean (train / val; t in standard errors): " + "; ".join(parts)
    differ = [f"{k} ({mt})" for k, r in rec.items() for mt in METRICS if r.get(mt) and r[mt]["significant"]]
    if differ:
        s += f"; different from BF16 at the 5% level (Welch's t-test): {', '.join(differ)}."
    else:
        s += "; none differs from BF16 at the 5% level (Welch's t-test)."
    return s


def _combined_md(d: dict, png: Path) -> str:
    pool = d["bf16_pool"]
    md = [f"# Numerics study, combined: {d['model']}" + (" (SMOKE: not a result)" if d["smoke"] else ""), "",
          f"**Summary:** {d['summary']}", "",
          f"Generated {d['generated']} by `benchmarks/numerics_study.py --combine`. Main runs: {d['steps']} steps x "
          f"{d['tokens_per_step']} tokens = {d['tokens_per_run']:,} tokens per run; train loss = mean of the last "
          f"{d['last']} steps, val loss = the final validation. Roots:", ""]
    for r in d["roots"]:
        seeds = ", ".join(f"{k} {s}" for k, s in r["seeds"].items())
        md.append(f"- **{r['label']}** `{r['root']}` (seeds: {seeds}; report "
                  + ("built now" if r["report_built"] else "read as it was")
                  + (f"; diverged: {r['diverged']}" if r["diverged"] else "") + ")")
    md += ["", "## BF16 pool", "",
           "Every bf16-recipe run (`bf16` and `bf16-seed2` of each root). Std = sample standard deviation; "
           "relative = over the mean. This is the noise of one run.", ""]
    rows = [[f"{p['root']} {p['key']}", p["seed"], _num(p["train_loss"]), _num(p["val_loss"])] for p in pool["runs"]]
    rows.append(["**mean**", "", *[_num((pool[mt] or {}).get("mean")) for mt in METRICS]])
    rows.append(["**std (relative)**", "", *[
        f"{_num(pool[mt]['std'], '.4f')} ({_pct(pool[mt]['rel_std'], signed=False, digits=2)})"
        if pool[mt] and pool[mt]["std"] is not None else "—" for mt in METRICS]])
    md.append(table(["run", "seed", "train loss", "val loss"], rows))
    if pool["excluded"]:
        md += ["", "Left out (diverged): " + ", ".join(f"{x['root']} {x['key']} (step {x['diverged_at']})"
                                                    for x in pool["excluded"])]
    md += ["", "### Same-seed reruns (the run-to-run floor: same seed, same data order)", ""]
    if d["same_seed"]:
        rows = [[e["seed"], f"{pp['a']['root']} {pp['a']['key']}", f"{pp['b']['root']} {pp['b']['key']}",
                 _pct(pp["train_rel_diff"], digits=2), _pct(pp["val_rel_diff"], digits=2)]
                for e in d["same_seed"] for pp in e["pairs"]]
        md.append(table(["seed", "run a", "run b", "train (b − a) / a", "val (b − a) / a"], rows))
    else:
        md.append("No seed has two bf16 runs across these roots (rerun a study with `--seed`/`--seed2` swapped "
                  "to measure it).")
    cs = d["cross_seed"]
    md += ["", "### Cross-seed", ""]
    if cs["within_root"]:
        md.append(table(["root", "seeds (bf16, bf16-seed2)", "train (seed2 − bf16) / bf16", "val"],
                         [[x["root"], f"{x['seeds'][0]}, {x['seeds'][1]}", _pct(x["train_rel_diff"], digits=2),
                           _pct(x["val_rel_diff"], digits=2)] for x in cs["within_root"]]))
        md.append("")
    md.append(table(["seed", "bf16 runs", "mean train loss", "mean val loss"],
                     [[x["seed"], x["n"], _num(x["train"]), _num(x["val"])] for x in cs["seed_means"]]))
    if len(cs["seed_means"]) > 1:
        md += ["", "Across the seed means: relative std " + " / ".join(
            _pct(cs[f"{mt}_rel_std"], signed=False, digits=2) for mt in METRICS)
            + ", range (max − min) / mean " + " / ".join(_pct(cs[f"{mt}_rel_range"], signed=False, digits=2)
                                                         for mt in METRICS) + " (train / val)."]
    md += ["", "## FP8 recipes vs BF16", "",
           "Paired deviation = (run − the bf16 run of the same root) / that bf16 run (same seed and data order).", ""]
    rows = []
    for k, r in d["recipes"].items():
        for x in r["runs"]:
            div = f" (diverged at {x['diverged_at']})" if x["diverged_at"] is not None else ""
            rows.append([k, x["root"] + div, x["seed"], _num(x["train_loss"]), _pct(x["train_paired_dev"], digits=2),
                         _num(x["val_loss"]), _pct(x["val_paired_dev"], digits=2)])
    md.append(table(["recipe", "root", "seed", "train loss", "paired dev", "val loss", "paired dev"], rows))
    md += ["", "Per recipe: mean over its runs vs the BF16 pool mean; SE = sqrt(s_fp8²/n_fp8 + s_bf16²/n_bf16) "
           "(Welch), t = (mean_fp8 − mean_bf16) / SE, tested at the two-sided 5% level with the Welch–Satterthwaite "
           "degrees of freedom. The goal is resolvable when two standard errors of the difference are below it.", ""]
    rows = []
    one_run = False
    for k, r in d["recipes"].items():
        for mt in METRICS:
            x = r.get(mt)
            if not x:
                rows.append([k, mt, _pct(r["goal"], signed=False, digits=2) if r["goal"] else "—"] + ["—"] * 7)
                continue
            mark = "‡" if x["std_source"] != "own runs" else ""
            one_run = one_run or bool(mark)
            rows.append([k, mt, _pct(r["goal"], signed=False, digits=2) if r["goal"] else "—", x["n"],
                         _num(x["mean"]), _pct(x["mean_paired_dev"], digits=2), _pct(x["vs_pool"], digits=2),
                         _num(x["se"], ".4f") + mark, _num(x["t"], "+.2f"), x["verdict"]])
    md.append(table(["recipe", "loss", "goal", "n", "mean loss", "mean paired dev", "mean vs BF16 pool", "SE",
                      "t", "verdict"], rows))
    if one_run:
        md += ["", "‡ one run of this recipe: its std is taken to be the BF16 pool's."]
    md += ["", f"Plot (final losses per run, BF16 pool mean ± std and ± 2 std, goals around the BF16 mean): `{png}`"]
    return "\n".join(md)


def plot_combined(d: dict, path: Path) -> None:
    """PNG: final train and val loss, one column per recipe (BF16 pool first), a dot per run
    (colour = root), the BF16 pool mean with ± std and ± 2 std bands, each recipe's mean (black
    bar) and goal (dashed, around the BF16 mean)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = [r["label"] for r in d["roots"]]
    fig = Figure(figsize=(12, 5), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(METRICS), squeeze=False)[0]
    cols = ["bf16 pool", *d["recipes"]]
    for ax, mt in zip(axes, METRICS):
        pool = d["bf16_pool"][mt]
        if pool and pool["std"] is not None:
            mu, sd = pool["mean"], pool["std"]
            ax.axhspan(mu - 2 * sd, mu + 2 * sd, color="tab:gray", alpha=0.12, label="BF16 ± 2 std")
            ax.axhspan(mu - sd, mu + sd, color="tab:gray", alpha=0.3, label="BF16 ± std")
            ax.axhline(mu, color="black", linewidth=1, label="BF16 pool mean")
            goal_drawn = False
            for i, k in enumerate(d["recipes"], start=1):
                g = d["recipes"][k]["goal"]
                if g:
                    for y in (mu * (1 - g), mu * (1 + g)):
                        ax.hlines(y, i - 0.35, i + 0.35, colors="tab:red", linestyles="--", linewidth=1,
                                  label=None if goal_drawn else "goal (around the BF16 mean)")
                        goal_drawn = True
        pts = [(0, p["root"], p[f"{mt}_loss"]) for p in d["bf16_pool"]["runs"]]
        pts += [(i, x["root"], x[f"{mt}_loss"]) for i, k in enumerate(d["recipes"], start=1)
                for x in d["recipes"][k]["runs"]]
        for j, lab in enumerate(labels):
            mine = [(i, y) for i, lb, y in pts if lb == lab and y is not None]
            off = (j - (len(labels) - 1) / 2) * 0.08
            ax.scatter([i + off for i, _ in mine], [y for _, y in mine], color=colors[j % len(colors)], zorder=3,
                       s=30, label=f"root {lab}")
        for i, k in enumerate(d["recipes"], start=1):
            x = d["recipes"][k].get(mt)
            if x:
                ax.hlines(x["mean"], i - 0.2, i + 0.2, colors="black", linewidth=2.5, zorder=4,
                          label="recipe mean" if i == 1 else None)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_xlim(-0.6, len(cols) - 0.4)
        ax.set_title(f"final {mt} loss" + (f" (train: mean of the last {d['last']} steps)" if mt == "train" else ""))
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3, axis="y")
    handles, lbls = axes[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="outside lower center", ncols=min(8, len(handles)))
    fig.suptitle(f"{d['model']}: FP8 final losses vs BF16's run-to-run spread ({len(d['roots'])} roots)")
    fig.savefig(str(path))


# ---- command line --------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/numerics", help="study directory (default runs/numerics)")
    p.add_argument("--part", choices=["all", "main", "stress"], default="all", help="which runs to train")
    p.add_argument("--recipes", default=None,
                   help=f"comma-separated run keys within --part: {','.join(MAIN_KEYS)} (main), "
                        f"{','.join(STRESS_RECIPES)} (stress); default all")
    p.add_argument("--smoke", action="store_true", help="tiny CPU version of the whole pipeline (tests, CI)")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=None, help="main-run optimizer steps (default 600)")
    p.add_argument("--stress-steps", type=int, default=None, help="stress-run optimizer steps (default 300)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seed2", type=int, default=4321, help="seed of the bf16-seed2 noise-floor run")
    p.add_argument("--telemetry-interval", type=int, default=None)
    p.add_argument("--val-interval", type=int, default=None)
    p.add_argument("--val-steps", type=int, default=None)
    p.add_argument("--ckpt-interval", type=int, default=None)
    p.add_argument("--last", type=int, default=None, help="final train-loss window in steps (default 100)")
    p.add_argument("--stress-recipes", default=",".join(STRESS_RECIPES))
    p.add_argument("--stress-overrides", default=None,
                   help="space-separated Hydra overrides of the stress variant (default "
                        f"'{' '.join(FULL['stress_overrides'])}')")
    p.add_argument("--emulate-mxfp8", action=argparse.BooleanOptionalAction, default=True,
                   help="run mxfp8 with recipe.emulate=true (needed on Hopper; --no-emulate-mxfp8 on Blackwell)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (CUDA: one GPU each unless --share-gpus; CPU: the cores shared)")
    p.add_argument("--share-gpus", action="store_true",
                   help="allow more --jobs than GPUs (round-robin): the FP8 runs of this small model are "
                        "host-bound, so several fill one GPU; their tokens/s are then not speed figures")
    p.add_argument("--max-wall-s", type=float, default=None,
                   help="deadline for this call: no run starts after it, a running one is interrupted (resumable)")
    p.add_argument("--min-start-s", type=float, default=None,
                   help="do not start a run with less than this left before --max-wall-s (default 60; smoke 0)")
    p.add_argument("--grace-s", type=float, default=120.0, help="time a run gets to checkpoint after SIGINT")
    p.add_argument("--no-probe", action="store_true", help="skip the activation probe")
    p.add_argument("--report-only", action="store_true", help="build the report from the existing runs")
    p.add_argument("--allow-partial", action="store_true", help="report even when runs are missing/incomplete")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="afterwards, copy the study without checkpoints to DIR (e.g. $OUT/numerics)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, commands and expected times only")
    p.add_argument("--combine", nargs="+", default=None, metavar="ROOT",
                   help="pool the main part of several study roots (same model, tokens per step, steps and "
                        "settings; seeds may differ): BF16 run-to-run spread (same-seed reruns, cross-seed), each "
                        "FP8 recipe vs the BF16 pool (paired deviation, Welch t, goal resolvable or not); writes "
                        "combined.{md,json,png} to --out and prints combined.md. Trains nothing")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory of --combine (default <first ROOT>/combined)")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.lr=1e-3)")
    return p


def resolve_settings(a: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the full-size or the smoke defaults."""
    base = SMOKE if a.smoke else FULL
    for k in ("model", "steps", "stress_steps", "seq_len", "micro_batch", "global_batch", "telemetry_interval",
              "val_interval", "val_steps", "ckpt_interval", "last"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    a.log_interval = base["log_interval"]
    a.stress_last = min(a.last, max(1, a.stress_steps // 2))  # the stress runs are shorter
    a.device = base["device"]
    a.extra = tuple(base["extra"]) + tuple(a.extra)
    if a.stress_overrides is None:
        a.stress_overrides = base["stress_overrides"]
    else:
        a.stress_overrides = tuple(a.stress_overrides.split())
    a.stress_recipes = tuple(x for x in a.stress_recipes.split(",") if x)
    if a.min_start_s is None:
        a.min_start_s = 0.0 if a.smoke else 60.0
    bad = [r for r in a.stress_recipes if r not in RECIPES]
    if bad:
        raise StudyError(f"--stress-recipes {','.join(bad)}: unknown recipe; valid: {', '.join(RECIPES)}")
    if "bf16" not in a.stress_recipes:
        raise StudyError("--stress-recipes must include bf16 (the stress baseline)")
    for k in ("steps", "stress_steps", "seq_len", "micro_batch", "global_batch", "jobs"):
        if getattr(a, k) < 1:
            raise StudyError(f"--{k.replace('_', '-')} must be >= 1")
    if a.global_batch % a.micro_batch:
        raise StudyError("--global-batch must be a multiple of --micro-batch")
    return a


def _print_plan(plan: Sequence[RunSpec], selected: Sequence[RunSpec], root: Path, tokens_per_step: int) -> None:
    total = 0.0
    print(f"study root {root}; {tokens_per_step} tokens per step")
    for r in plan:
        est = expected_seconds(r, tokens_per_step)
        mark = "*" if r in selected else " "
        state, n = run_state(r, root)
        if r in selected and est:
            total += est
        print(f" {mark} {r.label:<18} {r.steps:>5} steps {r.steps * tokens_per_step:>11,} tokens  "
              f"~{est / 60 if est else float('nan'):.1f} min on one H200  [{state}, {n} steps]")
        print(f"     python -m nemo_fp8_recipes.train {' '.join(r.overrides)} run.root={root / r.part} "
              "trainer.resume=auto")
    print(f"selected (*): ~{total / 60:.1f} min expected on one H200 (measured tokens/s + {OVERHEAD_S:.0f} s per run)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (see the module docstring)."""
    a = _parser().parse_args(argv)

    def on_term(signum, frame):  # e.g. a job scheduler's timeout: stop the runs cleanly
        raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        if a.combine:
            if a.extra:
                raise StudyError(f"--combine takes study roots only; unexpected: {' '.join(a.extra)} "
                                 "(put the roots after --combine)")
            files = combine(a.combine, Path(a.out) if a.out else None)
            print(files["combined_md"].read_text(encoding="utf-8"))
            for k, v in files.items():
                print(f"{k + ':':22s} {v}")
            return 0
        if a.out:
            raise StudyError("--out is the output directory of --combine (to copy a study, use --export)")
        root = Path(a.root)
        if a.report_only:
            files = build_report(root, allow_partial=a.allow_partial)
            print((root / "report" / "report.md").read_text(encoding="utf-8"))
            for k, v in files.items():
                print(f"{k + ':':22s} {v}")
            if a.export:
                print(f"exported to {export(root, Path(a.export))}")
            return 0
        a = resolve_settings(a)
        plan = build_plan(a)
        recipes = [x for x in a.recipes.split(",") if x] if a.recipes else None
        selected = select_runs(plan, a.part, recipes)
        manifest = _manifest(plan, a)
        if a.dry_run:
            _print_plan(plan, selected, root, a.global_batch * a.seq_len)
            return 0
        if a.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise StudyError("the full study trains on a CUDA GPU (trainer.device=cuda) and none is visible; "
                                 "use --smoke for the CPU pipeline check")
        ensure_manifest(root, manifest)
        records = execute(selected, root, jobs=a.jobs, device=a.device, max_wall_s=a.max_wall_s,
                          min_start_s=a.min_start_s, grace_s=a.grace_s, probe=not a.no_probe,
                          share_gpus=a.share_gpus)
        failed = [r for r in records if r["state"] == "failed"]
        pending = [r for r in records if r["state"] not in ("complete", "diverged", "failed")]
        states = {r.label: run_state(r, root) for r in plan}
        missing = [lbl for lbl, (st, _) in states.items() if st not in ("complete", "diverged")]
        code = 1 if failed else (3 if pending else 0)
        if not failed and not missing:
            try:
                files = build_report(root)
                print((root / "report" / "report.md").read_text(encoding="utf-8"))
                for k, v in files.items():
                    print(f"{k + ':':22s} {v}")
            except StudyError as e:  # the runs are done: still export them
                print(f"numerics_study: error: the report could not be built: {e}", file=sys.stderr)
                code = 2
        elif not failed:
            print(f"\n{len(plan) - len(missing)}/{len(plan)} runs complete; still to run: {', '.join(missing)}. "
                  "The report is built when all are complete (or: --report-only --allow-partial).")
        if failed:
            print(f"FAILED: {', '.join(r['run'] for r in failed)} (logs: <run dir>/study_train.log)", file=sys.stderr)
        if pending:
            print(f"incomplete after --max-wall-s: {', '.join(r['run'] for r in pending)}; run the same command "
                  "again to resume", file=sys.stderr)
        if a.export:
            print(f"exported to {export(root, Path(a.export))}")
        return code
    except StudyError as e:
        print(f"numerics_study: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":
    raise SystemExit(main())
