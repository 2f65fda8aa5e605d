"""The numerics study (benchmarks/numerics_study.py): the trainer's multirun commands it builds for
the full study, and one smoke study on CPU — two recipes trained by one ``nemo-fp8-train -m``,
compared by ``nemo-fp8-compare`` and reported — whose report is checked against the runs' own
event files and summaries."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ns():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import numerics_study

        yield numerics_study
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _settings(ns, *argv):
    return ns.settings(ns._parser().parse_args(list(argv)))


def test_full_study_commands(ns):
    """Every recipe at the study seed, mxfp8 in its own multirun with emulation (Hopper has no
    MXFP8 GEMMs), the BF16 noise-floor seed tagged into its own run directory; the budget is
    600 steps x 8 x 1024 = 4,915,200 tokens per run; extra overrides reach every run."""
    a = _settings(ns, "trainer.lr=1e-3")
    main, emulated, noise = ns.commands(a)
    assert main[:3] == ["-m", "recipe=bf16,delayed,tensorwise,blockwise", "trainer.seed=1234"]
    assert emulated[:4] == ["-m", "recipe=mxfp8", "recipe.emulate=true", "trainer.seed=1234"]
    assert noise[:4] == ["-m", "recipe=bf16", "trainer.seed=4321", "run.tag=seed${trainer.seed}"]
    for cmd in (main, emulated, noise):
        for o in ("model=llama3_150m", "trainer.max_steps=600", "trainer.seq_len=1024", "trainer.global_batch_size=8",
                  "trainer.val_steps=16", "run.root=runs/numerics", "trainer.lr=1e-3"):
            assert o in cmd, (o, cmd)
    assert a.global_batch * a.seq_len * a.steps == 4_915_200
    dirs = ns.run_dirs(a)
    assert dirs["bf16-seed4321"] == Path("runs/numerics/llama3_150m/bf16-seed4321")
    assert set(dirs) == {*ns.RECIPES, "bf16-seed4321"}
    one = ns.commands(_settings(ns, "--recipes", "bf16,blockwise", "--noise-seeds", ""))
    assert len(one) == 1 and one[0][1] == "recipe=bf16,blockwise"  # nothing emulated, no noise floor
    with pytest.raises(ValueError, match="must include bf16"):
        _settings(ns, "--recipes", "tensorwise")


def test_bad_arguments_exit_2(ns, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ns.main(["--recipes", "bf16,fp4", "--dry-run"])
    assert e.value.code == 2 and "valid: bf16, delayed, tensorwise, blockwise, mxfp8" in capsys.readouterr().err
    assert ns.main(["--report-only", "--root", str(tmp_path)]) == 2
    assert "no bf16 run" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smoke(ns, tmp_path_factory):
    """The smoke study, run once: (report.json, its directory, what it printed)."""
    root = tmp_path_factory.mktemp("numerics")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ns.main(["--smoke", "--root", str(root), "--recipes", "bf16,tensorwise", "--noise-seeds", ""])
    assert rc == 0, out.getvalue()[-3000:]
    rdir = root / "llama3_tiny"
    return json.loads((rdir / "report.json").read_text()), rdir, out.getvalue()


def _final(run_dir: Path, tag: str, last: int):
    from nemo_fp8_recipes.compare import load_run

    r = load_run(run_dir, tag)
    window = [v for s, v in zip(r.steps, r.values) if s > r.steps[-1] - last]
    return dict(zip(r.steps, r.values)), sum(window) / len(window)


def test_smoke_study_reports_what_the_runs_logged(smoke):
    rep, rdir, printed = smoke
    assert "$ nemo-fp8-train -m recipe=bf16,tensorwise trainer.seed=1234 model=llama3_tiny" in printed
    assert "$ nemo-fp8-compare" in printed
    assert rep["smoke"] and rep["steps"] == 4 and rep["last"] == 2 and set(rep["runs"]) == {"bf16", "tensorwise"}
    for tag, key in (("train/loss", "train"), ("val/loss", "val")):
        base_curve, base = _final(rdir / "bf16", tag, rep["last"])
        curve, final = _final(rdir / "tensorwise", tag, rep["last"])
        assert math.isclose(rep["runs"]["bf16"][f"{key}_loss"], base, rel_tol=1e-12)
        assert math.isclose(rep["runs"]["tensorwise"][f"{key}_loss"], final, rel_tol=1e-12)
        assert math.isclose(rep["runs"]["tensorwise"][f"{key}_vs_bf16"], final / base - 1, rel_tol=1e-9)
        devs = [abs(v / base_curve[s] - 1) for s, v in curve.items() if s in base_curve]
        assert len(devs) >= 2 and math.isclose(rep["runs"]["tensorwise"][f"{key}_max_rel_dev"], max(devs),
                                               rel_tol=1e-9)
        assert rep["runs"]["bf16"][f"{key}_vs_bf16"] is None
    cmp = {r["name"]: r for r in json.loads((rdir / "compare" / "train" / "compare.json").read_text())["results"]}
    for name, r in rep["runs"].items():
        summary = json.loads((rdir / name / "summary.json").read_text())
        assert r["complete"] and r["steps"] == summary["steps"] == 4
        assert r["tokens_per_s"] == cmp[name]["tokens_per_s"] > 0
    tw = rep["runs"]["tensorwise"]
    assert tw["goal"] == 0.005 and tw["within_goal"] == (abs(tw["train_vs_bf16"]) <= 0.005)
    assert rep["runs"]["bf16"]["goal"] is None and rep["noise_floor"] == {}
    md = (rdir / "report.md").read_text()
    assert md.startswith("# Numerics study (SMOKE") and md in printed
    row = next(line for line in md.splitlines() if line.startswith("| tensorwise |"))
    assert f"{tw['train_loss']:.4f}" in row and f"{100 * tw['train_vs_bf16']:+.3f}%" in row and "±0.50%" in row
    for tag in ("train", "val"):
        cmp = json.loads((rdir / "compare" / tag / "compare.json").read_text())
        assert cmp["settings"]["baseline"] == "bf16" and cmp["settings"]["last"] == 2
    assert (rdir / "compare" / "train" / "compare.png").read_bytes()[:8] == PNG_MAGIC
