"""The numerics study (benchmarks/numerics_study.py): the whole pipeline in its --smoke mode on CPU
(trainer runs, telemetry table and plot, nemo-fp8-compare, activation probe, report, export and
re-report), the deadline/resume path, and the pieces that turn events into numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "numerics_study.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FP8 = ("delayed", "tensorwise", "blockwise", "mxfp8")


@pytest.fixture(scope="module")
def ns():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import numerics_study

        yield numerics_study
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def _png(path: Path):
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000, path


# ---- end to end ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory):
    """The whole smoke study, run once: (root, export dir, the process result)."""
    tmp = tmp_path_factory.mktemp("numerics")
    root, export = tmp / "study", tmp / "export"
    proc = _run("--smoke", "--root", str(root), "--jobs", "2", "--export", str(export))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, export, proc


def test_smoke_pipeline_end_to_end(smoke_study):
    root, export, _ = smoke_study
    rep = json.loads((root / "report" / "report.json").read_text())
    assert rep["smoke"] and not rep["incomplete"]

    main, stress = rep["parts"]["main"], rep["parts"]["stress"]
    assert set(main["final"]) == {"bf16", "bf16-seed2", *FP8}
    assert set(stress["final"]) == {"bf16", "tensorwise", "blockwise"}
    for part in (main, stress):
        for key, f in part["final"].items():
            assert _finite(f["train_loss"]) and _finite(f["val_loss"]) and f["steps"] >= 6, (key, f)
            if key != "bf16":
                assert _finite(f["train_vs_bf16"]) and _finite(f["val_vs_bf16"]), (key, f)
    # the goal check: every FP8 recipe, its goal, a verdict, and the seed-noise ratio
    assert _finite(main["seed_noise"]["train"]) and _finite(main["seed_noise"]["val"])
    goals = {g["run"]: g for g in main["goals"]}
    assert set(goals) == set(FP8)
    assert goals["blockwise"]["goal"] == goals["mxfp8"]["goal"] == 0.0025
    assert goals["delayed"]["goal"] == goals["tensorwise"]["goal"] == 0.005
    for g in goals.values():
        assert isinstance(g["train_met"], bool) and isinstance(g["val_met"], bool) and _finite(g["val_vs_noise"])
    assert all(g["goal"] is None for g in stress["goals"])  # the goals are for the main runs

    # telemetry: every FP8 run x role, finite statistics; BF16 has none
    for key in FP8:
        rows = [r for r in main["telemetry"][key] if r["group"] == "all"]
        assert {r["role"] for r in rows} == {"activations", "weights", "gradients"}, key
        for r in rows:
            assert r["points"] >= 2 and r["nonfinite"] == 0
            for st in ("sqnr_db", "underflow_frac", "saturated_frac", "amax"):
                assert _finite(r[f"{st}_mean"]) and _finite(r[f"{st}_worst"]), (key, st)
            assert 10 < r["sqnr_db_mean"] < 60 and r["sqnr_db_worst"] <= r["sqnr_db_mean"] + 1e-9
    assert main["telemetry"]["bf16"] == [] and main["telemetry"]["bf16-seed2"] == []

    # probe: every run, three sites; the stress shows per-tensor scaling losing the bulk of the
    # SwiGLU input while 1x32 groups (two outlier channels of 256 -> 2 of 8 groups) keep it
    for part, keys in ((main, main["final"]), (stress, stress["final"])):
        for key in keys:
            sites = {r["site"]: r for r in part["probe"][key]}
            assert set(sites) == {"attn_in", "swiglu_in", "down_in"}
            for r in sites.values():
                for q in r["quantisers"].values():
                    assert _finite(q["median_channel_sqnr_db"]) and _finite(q["sqnr_db"])
    sw = {r["site"]: r for r in stress["probe"]["bf16"]}["swiglu_in"]
    assert sw["channel_rms_ratio"] > 1000
    q = sw["quantisers"]
    assert q["1x32"]["median_channel_sqnr_db"] > q["per-tensor"]["median_channel_sqnr_db"] + 5

    # the files: compare (train + val, both parts), telemetry table and plots, report
    rdir = root / "report"
    for part in ("main", "stress"):
        for tag in ("train", "val"):
            _png(rdir / f"compare_{part}" / tag / "compare.png")
            cmp = json.loads((rdir / f"compare_{part}" / tag / "compare.json").read_text())
            assert cmp["settings"]["baseline"] == "bf16"
    _png(rdir / "telemetry.png")
    _png(rdir / "telemetry_stress.png")
    tel = json.loads((rdir / "telemetry.json").read_text())
    assert {"stress/tensorwise", "stress/blockwise", *FP8} <= set(tel)
    assert (rdir / "telemetry.csv").read_text().startswith("run,group,operand,role")
    md = (rdir / "report.md").read_text()
    assert "SMOKE" in md and "seed noise" in md and "Outlier stress" in md
    for key in ("bf16-seed2", *FP8):
        assert f"| {key} |" in md



def test_export_reports_on_its_own_and_complete_runs_are_not_trained_again(smoke_study):
    root, export, _ = smoke_study
    main = json.loads((root / "report" / "report.json").read_text())["parts"]["main"]
    # the export holds everything but checkpoints, and reports on its own
    assert (export / "study.json").is_file() and (export / "report" / "report.md").is_file()
    assert not list(export.rglob("*.pt"))
    proc = _run("--report-only", "--root", str(export))
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((export / "report" / "report.json").read_text())
    assert again["parts"]["main"]["final"] == main["final"]

    # a second call finds everything complete: nothing is trained again
    proc = _run("--smoke", "--root", str(root), "--part", "main", "--recipes", "bf16")
    assert proc.returncode == 0 and "[skip] bf16: complete" in proc.stdout


def test_a_diverged_run_is_reported_as_such_not_as_a_final_loss(smoke_study, tmp_path, ns):
    """The state the study records when the trainer stops a run on a non-finite loss (exit 3)."""
    import shutil

    _, export, _ = smoke_study
    root = tmp_path / "study"
    shutil.copytree(export, root)
    run = root / "stress" / "llama3_tiny" / "tensorwise"
    (run / "summary.json").unlink()  # the trainer writes none when it stops on a NaN
    log = run / "study_train.log"
    log.write_text(log.read_text() + "nemo-fp8-train: error: non-finite loss (nan) at step 4; last good "
                   "checkpoint: none\n")
    job = ns._Job(spec=next(r for r in ns.plan_from_manifest(ns.load_manifest(root)) if r.label == "stress/tensorwise"),
                  proc=None, log=None, started=0.0, slot=0, state_before=("absent", 0))
    rec = ns._finish_log(job, ns._EXIT_NONFINITE, root)
    assert rec["state"] == "diverged" and rec["diverged_at"] == 4
    assert ns.run_state(job.spec, root) == ("diverged", 4)
    proc = _run("--report-only", "--root", str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stress = json.loads((root / "report" / "report.json").read_text())["parts"]["stress"]
    assert stress["diverged"] == {"tensorwise": 4}
    assert stress["final"]["tensorwise"]["train_loss"] is None and stress["final"]["tensorwise"]["diverged_at"] == 4
    assert "**DIVERGED at step 4**" in (root / "report" / "report.md").read_text()
    # and a later call does not train it again
    proc = _run("--smoke", "--root", str(root), "--part", "stress", "--recipes", "tensorwise", "--no-probe")
    assert proc.returncode == 0 and "[skip] stress/tensorwise: diverged" in proc.stdout


def test_deadline_stops_and_the_same_command_resumes(tmp_path):
    """A call whose deadline leaves no time to start a run exits 3 and says to run the same
    command again, which then trains it. (Deterministic: the deadline is already past when the
    first run would start. The SIGINT-at-the-deadline path mid-run depends on timing, so CI does
    not test it; the trainer's own interrupt-then-resume is tested in tests/test_train.py.)"""
    root = tmp_path / "study"
    args = ["--smoke", "--root", str(root), "--part", "main", "--recipes", "tensorwise", "--no-probe"]
    first = _run(*args, "--max-wall-s", "1e-6")
    assert first.returncode == 3, first.stdout[-2000:] + first.stderr[-2000:]
    assert "not started" in first.stdout and "run the same command" in first.stderr
    assert not (root / "main" / "llama3_tiny" / "tensorwise" / "summary.json").exists()
    second = _run(*args)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "still to run" in second.stdout  # the other runs of the plan; no report yet
    summary = json.loads((root / "main" / "llama3_tiny" / "tensorwise" / "summary.json").read_text())
    assert summary["steps"] == 8
    # incomplete studies report only on request, and say what is missing
    proc = _run("--report-only", "--root", str(root))
    assert proc.returncode == 2 and "incomplete runs" in proc.stderr and "--allow-partial" in proc.stderr


def test_changed_settings_on_an_existing_root_are_refused(tmp_path, ns):
    a = ns.resolve_settings(ns._parser().parse_args(["--smoke"]))
    ns.ensure_manifest(tmp_path, ns._manifest(ns.build_plan(a), a))
    b = ns.resolve_settings(ns._parser().parse_args(["--smoke", "--steps", "10"]))
    with pytest.raises(ns.StudyError, match="other settings.*trainer.max_steps=10"):
        ns.ensure_manifest(tmp_path, ns._manifest(ns.build_plan(b), b))
    ns.ensure_manifest(tmp_path, ns._manifest(ns.build_plan(a), a))  # the same plan is fine


# ---- the plan and the budget ------------------------------------------------------------------------
def test_full_plan_runs_every_recipe_and_the_noise_floor_within_the_gpu_budget(ns):
    a = ns.resolve_settings(ns._parser().parse_args([]))
    plan = ns.build_plan(a)
    assert [r.label for r in plan] == ["bf16", "bf16-seed2", "delayed", "tensorwise", "blockwise", "mxfp8",
                                       "stress/bf16", "stress/tensorwise", "stress/blockwise"]
    by = {r.label: r for r in plan}
    assert "model=llama3_150m" in by["bf16"].overrides and "trainer.device=cuda" in by["bf16"].overrides
    assert "recipe.emulate=true" in by["mxfp8"].overrides
    assert "trainer.seed=4321" in by["bf16-seed2"].overrides and "run.tag=seed2" in by["bf16-seed2"].overrides
    assert "model.outlier_channels=2" in by["stress/tensorwise"].overrides
    assert by["bf16"].run_dir(Path("/r")) == Path("/r/main/llama3_150m/bf16")
    tokens = a.global_batch * a.seq_len
    assert tokens * by["bf16"].steps == 4_915_200
    est = {r.label: ns.expected_seconds(r, tokens) for r in plan}
    assert sum(est.values()) < 20 * 60  # the whole study in ~20 GPU-minutes
    # the documented split: each call well under the 10-minute limit
    for call in (("delayed", "mxfp8"), ("bf16", "bf16-seed2", "tensorwise", "blockwise"),
                 ("stress/bf16", "stress/tensorwise", "stress/blockwise")):
        assert sum(est[k] for k in call) < 8 * 60, call


def test_run_selection_names_the_valid_keys(ns):
    a = ns.resolve_settings(ns._parser().parse_args(["--smoke"]))
    plan = ns.build_plan(a)
    assert [r.label for r in ns.select_runs(plan, "stress", ["tensorwise"])] == ["stress/tensorwise"]
    assert len(ns.select_runs(plan, "all", ["bf16"])) == 2
    with pytest.raises(ns.StudyError, match="valid: bf16, tensorwise, blockwise"):
        ns.select_runs(plan, "stress", ["mxfp8"])
    with pytest.raises(ns.StudyError, match="must include bf16"):
        ns.resolve_settings(ns._parser().parse_args(["--stress-recipes", "tensorwise"]))


def test_report_only_without_a_study_is_a_clear_error(tmp_path):
    proc = _run("--report-only", "--root", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "not a numerics-study root" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_full_size_study_without_a_gpu_says_so(tmp_path):
    proc = _run("--root", str(tmp_path / "s"), "--part", "main", "--recipes", "bf16")
    assert proc.returncode == 2 and "CUDA GPU" in proc.stderr and "--smoke" in proc.stderr
    assert not (tmp_path / "s").exists()  # nothing written


# ---- numbers ---------------------------------------------------------------------------------------
def test_telemetry_summary_mean_worst_and_nonfinite(ns):
    tel = {
        ("attention", "input", "sqnr_db"): [(10, 30.0), (20, 28.0)],
        ("mlp", "input", "sqnr_db"): [(10, 26.0), (20, float("nan"))],
        ("attention", "input", "underflow_frac"): [(10, 0.01), (20, 0.03)],
        ("attention", "input", "amax"): [(10, 5.0), (20, 7.0)],
        ("mlp", "grad_output", "saturated_frac"): [(10, 0.0), (20, 0.002)],
    }
    rows = {(r["group"], r["operand"]): r for r in ns.summarize_telemetry(tel)}
    att = rows[("attention", "input")]
    assert att["role"] == "activations" and att["sqnr_db_mean"] == 29.0
    assert (att["sqnr_db_worst"], att["sqnr_db_worst_step"]) == (28.0, 20)
    assert att["underflow_frac_worst"] == 0.03 and att["amax_worst"] == 7.0 and att["nonfinite"] == 0
    pooled = rows[("all", "input")]
    assert pooled["sqnr_db_mean"] == pytest.approx(28.0) and pooled["nonfinite"] == 1
    assert math.isnan(pooled["sqnr_db_worst"]) and pooled["sqnr_db_worst_step"] == 20  # NaN is the worst
    grads = rows[("mlp", "grad_output")]
    assert grads["role"] == "gradients" and grads["saturated_frac_worst"] == 0.002
    assert ("attention", "weight") not in rows  # nothing logged, no row


def test_goal_check_against_the_goals_and_the_seed_noise(ns):
    train = {"bf16-seed2": {"final_vs_baseline": 0.002}, "blockwise": {"final_loss": 2.0, "final_vs_baseline": 0.003},
             "tensorwise": {"final_loss": 2.0, "final_vs_baseline": -0.004}}
    val = {"bf16-seed2": {"final_vs_baseline": -0.001}, "blockwise": {"final_loss": 2.1, "final_vs_baseline": 0.001},
           "tensorwise": {"final_loss": 2.1, "final_vs_baseline": 0.006}}
    rows, noise = ns.goal_rows(train, val, ["blockwise", "tensorwise"], ns.GOALS)
    assert noise == {"train": 0.002, "val": -0.001}
    bw, tw = rows
    assert (bw["train_met"], bw["val_met"]) == (False, True)  # 0.3% > 0.25%; 0.1% <= 0.25%
    assert (tw["train_met"], tw["val_met"]) == (True, False)  # |-0.4%| <= 0.5%; 0.6% > 0.5%
    assert bw["train_vs_noise"] == pytest.approx(1.5) and tw["val_vs_noise"] == pytest.approx(6.0)


def test_probe_sees_outlier_channels_that_whole_tensor_sqnr_hides(ns):
    torch.manual_seed(0)
    x = torch.randn(512, 1024)
    plain = ns.probe_tensor(x)
    for q in plain["quantisers"].values():  # E4M3 on a Gaussian: ~31.5 dB whatever the grouping
        assert 30 < q["median_channel_sqnr_db"] < 33 and 30 < q["sqnr_db"] < 33
    x[:, [256, 768]] *= 3e4  # two outlier channels, as model.outlier_channels=2 on dim 1024
    out = ns.probe_tensor(x)
    assert out["channel_rms_ratio"] > 1e4
    pt, bw, mx = (out["quantisers"][k] for k in ("per-tensor", "1x128", "1x32"))
    assert pt["sqnr_db"] > 30  # the whole-tensor number looks fine ...
    assert pt["median_channel_sqnr_db"] < 25  # ... the bulk of the channels is not
    # 1x128 and 1x32 groups without an outlier channel keep their own scale
    assert bw["median_channel_sqnr_db"] > 30 and mx["median_channel_sqnr_db"] > 30
    assert pt["underflow_frac"] > 10 * mx["underflow_frac"]


def test_gpu_slots_one_per_gpu_unless_shared(ns, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    slots = ns._slots(2, "cuda")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in slots] == ["3", "5"]
    with pytest.raises(ns.StudyError, match="--share-gpus"):
        ns._slots(3, "cuda")
    shared = ns._slots(3, "cuda", share_gpus=True)
    assert [s["CUDA_VISIBLE_DEVICES"] for s in shared] == ["3", "5", "3"]
    assert {s[ns._RUNS_PER_GPU] for s in shared} == {"2"}


def test_tokens_per_s_of_runs_that_shared_a_gpu_are_marked(smoke_study, tmp_path):
    import shutil

    _, export, _ = smoke_study
    root = tmp_path / "study"
    shutil.copytree(export, root)
    hist_path = root / "main" / "llama3_tiny" / "delayed" / "study_run.json"
    hist = json.loads(hist_path.read_text())
    hist[-1]["runs_per_gpu"] = 6
    hist_path.write_text(json.dumps(hist))
    proc = _run("--report-only", "--root", str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (root / "report" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| delayed |"))
    assert "†" in row and "shared by up to 6 runs" in md
    assert "†" not in next(line for line in md.splitlines() if line.startswith("| tensorwise |"))


# ---- combining studies (--combine) -----------------------------------------------------------------
def _copy_roots(smoke_study, tmp_path, *names):
    import shutil

    _, export, _ = smoke_study
    roots = [tmp_path / n for n in names]
    for r in roots:
        shutil.copytree(export, r)
    return roots


def _set_main_seeds(root: Path, seed: int, seed2: int):
    """Rewrite the main runs' ``trainer.seed`` in ``study.json``: ``seed2`` for bf16-seed2, ``seed`` otherwise."""
    p = root / "study.json"
    m = json.loads(p.read_text())
    for r in m["runs"]:
        if r["part"] == "main":
            s = seed2 if r["key"] == "bf16-seed2" else seed
            r["overrides"] = [f"trainer.seed={s}" if o.startswith("trainer.seed=") else o for o in r["overrides"]]
    p.write_text(json.dumps(m, indent=2) + "\n")


def _set_finals(root: Path, finals: dict):
    """Put controlled final losses into the root's report.json (what --combine reads):
    ``{key: (train, val)}``, ``None`` for a run that diverged (at step 6)."""
    p = root / "report" / "report.json"
    rep = json.loads(p.read_text())
    for key, v in finals.items():
        f = rep["parts"]["main"]["final"][key]
        if v is None:
            f.update(train_loss=None, val_loss=None, diverged_at=6)
        else:
            f.update(train_loss=v[0], val_loss=v[1], diverged_at=None)
    p.write_text(json.dumps(rep, indent=2) + "\n")


# BF16 pool relative std: train 0.258%, val 0.357% -> between the 0.25% and the 0.5% goals
FINALS_A = {"bf16": (5.000, 5.100), "bf16-seed2": (5.020, 5.130), "delayed": (5.003, 5.105),
            "tensorwise": (5.060, 5.180), "blockwise": (5.001, 5.101), "mxfp8": (5.007, 5.108)}
FINALS_B = {"bf16": (4.990, 5.090), "bf16-seed2": (5.010, 5.120), "delayed": (4.995, 5.098),
            "tensorwise": (5.070, 5.170), "blockwise": (5.012, 5.115), "mxfp8": None}


def test_combine_pools_bf16_and_tests_each_recipe_against_it(smoke_study, tmp_path):
    import shutil
    import statistics as st

    a, b = _copy_roots(smoke_study, tmp_path, "A", "B")
    _set_main_seeds(b, 4321, 1234)  # root B: the seeds swapped (A has the defaults 1234 / 4321)
    shutil.rmtree(b / "stress")  # a root may lack its stress part
    _set_finals(a, FINALS_A)
    _set_finals(b, FINALS_B)
    out = tmp_path / "combined"
    proc = _run("--combine", str(a), str(b), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "combined.md").read_text()
    assert proc.stdout.startswith(md.rstrip("\n")) and md.startswith("# Numerics study, combined")
    _png(out / "combined.png")
    c = json.loads((out / "combined.json").read_text())
    assert [r["report_built"] for r in c["roots"]] == [False, False]  # the (edited) reports were read as they are
    assert c["roots"][1]["seeds"]["bf16"] == 4321 and c["roots"][1]["diverged"] == {"mxfp8": 6}

    def close(x, y):
        assert x is not None and abs(x - y) <= 1e-9, (x, y)

    # the BF16 pool: four runs with their seeds
    pool = [("A", "bf16", 1234, FINALS_A["bf16"]), ("A", "bf16-seed2", 4321, FINALS_A["bf16-seed2"]),
            ("B", "bf16", 4321, FINALS_B["bf16"]), ("B", "bf16-seed2", 1234, FINALS_B["bf16-seed2"])]
    assert [(p["root"], p["key"], p["seed"]) for p in c["bf16_pool"]["runs"]] == [x[:3] for x in pool]
    mean, sd = {}, {}
    for i, mt in enumerate(("train", "val")):
        xs = [x[3][i] for x in pool]
        mean[mt], sd[mt] = st.mean(xs), st.stdev(xs)
        got = c["bf16_pool"][mt]
        assert got["n"] == 4
        close(got["mean"], mean[mt]), close(got["std"], sd[mt]), close(got["rel_std"], sd[mt] / mean[mt])
    assert 0.0025 < sd["train"] / mean["train"] < 0.005 and 0.0025 < sd["val"] / mean["val"] < 0.005

    # same-seed reruns: seed 1234 = A bf16 and B bf16-seed2, seed 4321 = A bf16-seed2 and B bf16
    same = {e["seed"]: e for e in c["same_seed"]}
    assert set(same) == {1234, 4321}
    reruns = ((1234, ("A", "bf16", FINALS_A["bf16"]), ("B", "bf16-seed2", FINALS_B["bf16-seed2"])),
              (4321, ("A", "bf16-seed2", FINALS_A["bf16-seed2"]), ("B", "bf16", FINALS_B["bf16"])))
    for seed, (ra, ka, fa), (rb, kb, fb) in reruns:
        (pair,) = same[seed]["pairs"]
        assert (pair["a"], pair["b"]) == ({"root": ra, "key": ka}, {"root": rb, "key": kb})
        close(pair["train_rel_diff"], (fb[0] - fa[0]) / fa[0])
        close(pair["val_rel_diff"], (fb[1] - fa[1]) / fa[1])
    # cross-seed: within each root, bf16-seed2 vs bf16; across the per-seed means
    within = {x["root"]: x for x in c["cross_seed"]["within_root"]}
    close(within["A"]["train_rel_diff"], FINALS_A["bf16-seed2"][0] / FINALS_A["bf16"][0] - 1)
    close(within["B"]["val_rel_diff"], FINALS_B["bf16-seed2"][1] / FINALS_B["bf16"][1] - 1)
    m1234 = st.mean([FINALS_A["bf16"][0], FINALS_B["bf16-seed2"][0]])
    m4321 = st.mean([FINALS_A["bf16-seed2"][0], FINALS_B["bf16"][0]])
    close(c["cross_seed"]["train_rel_std"], st.stdev([m1234, m4321]) / st.mean([m1234, m4321]))

    # each FP8 recipe: paired deviations, mean vs the pool, Welch t, verdict
    for key, goal in (("delayed", 0.005), ("tensorwise", 0.005), ("blockwise", 0.0025), ("mxfp8", 0.0025)):
        r = c["recipes"][key]
        assert r["goal"] == goal
        pairs = [(FINALS_A[key], FINALS_A["bf16"])] + ([(FINALS_B[key], FINALS_B["bf16"])] if FINALS_B[key] else [])
        assert [x["seed"] for x in r["runs"]] == [1234, 4321]
        for i, mt in enumerate(("train", "val")):
            got = r[mt]
            xs = [f[i] for f, _ in pairs]
            devs = [f[i] / bb[i] - 1 for f, bb in pairs]
            assert got["n"] == len(xs)
            close(got["mean"], st.mean(xs))
            close(got["mean_paired_dev"], st.mean(devs))
            for x, d in zip(r["runs"], devs):
                close(x[f"{mt}_paired_dev"], d)
            diff = st.mean(xs) - mean[mt]
            s_fp8 = st.stdev(xs) if len(xs) > 1 else sd[mt]  # one run: BF16's std on its side too
            se = math.sqrt(s_fp8 ** 2 / len(xs) + sd[mt] ** 2 / 4)
            close(got["vs_pool"], diff / mean[mt])
            close(got["se"], se)
            close(got["t"], diff / se)
            assert got["std_source"] == ("own runs" if len(xs) > 1 else "bf16 pool (one fp8 run)")
            assert got["within_2std"] == (abs(diff) <= 2 * sd[mt])
            # Welch-Satterthwaite df (one FP8 run: the pool's n - 1) and the 5% two-sided test
            if len(xs) > 1:
                a_, b_ = st.stdev(xs) ** 2 / len(xs), sd[mt] ** 2 / 4
                df = (a_ + b_) ** 2 / (a_ ** 2 / (len(xs) - 1) + b_ ** 2 / 3)
            else:
                df = 3.0
            close(got["df"], df)
            crit = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}[int(df)]
            assert got["t_crit95"] == crit and got["significant"] == (abs(diff / se) >= crit)
            rel_2se = 2 * se / mean[mt]
            close(got["rel_2se"], rel_2se)
            assert got["resolvable"] == (rel_2se < goal)
            if got["resolvable"]:
                assert got["verdict"].startswith(f"resolvable (2 SE = {100 * rel_2se:.2f}% < goal {100 * goal:.2f}%)")
            else:
                assert got["verdict"].startswith(f"not resolvable with these runs (2 SE = {100 * rel_2se:.2f}% ≥ "
                                                 f"goal {100 * goal:.2f}%")
            assert ("differs from BF16 at the 5% level" in got["verdict"]) == got["significant"]
            assert ("indistinguishable from BF16" in got["verdict"]) == (not got["significant"])
    assert r["runs"][1]["diverged_at"] == 6 and r["runs"][1]["train_paired_dev"] is None  # B's mxfp8
    assert not c["recipes"]["tensorwise"]["train"]["within_2std"] and c["recipes"]["delayed"]["train"]["within_2std"]
    assert c["recipes"]["tensorwise"]["train"]["significant"] and not c["recipes"]["delayed"]["train"]["significant"]
    # the fixture spans both verdicts: some goals resolvable with these runs, some not
    res = {(k, mt): c["recipes"][k][mt]["resolvable"] for k in c["recipes"] for mt in ("train", "val")
           if c["recipes"][k].get(mt)}
    assert any(res.values()) and not all(res.values())
    summary = md.split("\n")[2]
    assert summary.startswith("**Summary:** BF16 alone, 4 runs over 2 seed(s) in 2 root(s)")
    assert f"{100 * sd['train'] / mean['train']:.2f}% (train)" in summary
    assert "different from BF16 at the 5% level (Welch's t-test): tensorwise (train), tensorwise (val)" in summary
    assert "Not resolvable with these runs" in summary and "mxfp8 (train)" in summary
    assert "‡ one run of this recipe" in md

    # other seeds in B: no seed has two bf16 runs, so no same-seed entry
    _set_main_seeds(b, 7, 8)
    proc = _run("--combine", str(a), str(b), "--out", str(tmp_path / "combined2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    c2 = json.loads((tmp_path / "combined2" / "combined.json").read_text())
    assert c2["same_seed"] == [] and "No seed has two bf16 runs" in proc.stdout
    assert c2["bf16_pool"]["train"] == c["bf16_pool"]["train"]
    assert len(c2["cross_seed"]["seed_means"]) == 4


def test_combine_builds_a_missing_report_from_the_runs(smoke_study, tmp_path):
    import shutil

    root, _, _ = smoke_study
    expected = json.loads((root / "report" / "report.json").read_text())["parts"]["main"]["final"]
    a, b = _copy_roots(smoke_study, tmp_path, "A", "B")
    shutil.rmtree(a / "report")
    _set_main_seeds(b, 4321, 1234)
    proc = _run("--combine", str(a), str(b))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (a / "report" / "report.json").is_file()
    c = json.loads((a / "combined" / "combined.json").read_text())  # the default --out
    assert [r["report_built"] for r in c["roots"]] == [True, False]
    got = {(p["root"], p["key"]): p for p in c["bf16_pool"]["runs"]}
    for key in ("bf16", "bf16-seed2"):
        for mt in ("train", "val"):
            assert abs(got[("A", key)][f"{mt}_loss"] - expected[key][f"{mt}_loss"]) <= 1e-12
    assert abs(c["recipes"]["blockwise"]["runs"][0]["train_paired_dev"] - expected["blockwise"]["train_vs_bf16"]) < 1e-9
    assert {e["seed"] for e in c["same_seed"]} == {1234, 4321}


def test_combine_refuses_roots_that_cannot_be_pooled(smoke_study, tmp_path):
    a, b = _copy_roots(smoke_study, tmp_path, "A", "B")
    p = b / "study.json"
    m = json.loads(p.read_text())
    m["tokens_per_step"] *= 2
    p.write_text(json.dumps(m))
    proc = _run("--combine", str(a), str(b))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("numerics_study: error:") and "tokens_per_step" in proc.stderr
    assert f"{m['tokens_per_step'] // 2} in {a}" in proc.stderr and f"{m['tokens_per_step']} in {b}" in proc.stderr
    assert not (a / "combined").exists()

    m["tokens_per_step"] //= 2  # the same again, but another learning rate for one run
    next(r for r in m["runs"] if r["key"] == "delayed")["overrides"].append("trainer.lr=1e-3")
    p.write_text(json.dumps(m))
    proc = _run("--combine", str(a), str(b))
    assert proc.returncode == 2 and "overrides of delayed" in proc.stderr and "trainer.lr=1e-3" in proc.stderr

    for args, msg in (([str(a), str(tmp_path / "nothing")], "not a directory"),
                      ([str(a), str(a)], "given twice"),
                      ([str(tmp_path)], "not a numerics-study root")):
        proc = _run("--combine", *args)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr[-2000:])

    # a main run that is not complete (the stress part may be missing, the main part may not)
    c = _copy_roots(smoke_study, tmp_path, "C")[0]
    (c / "main" / "llama3_tiny" / "delayed" / "summary.json").unlink()
    proc = _run("--combine", str(a), str(c))
    assert proc.returncode == 2 and "main runs not complete: delayed" in proc.stderr
