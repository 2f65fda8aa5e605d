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
