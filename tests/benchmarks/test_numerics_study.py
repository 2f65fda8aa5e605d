"""The numerics study (benchmarks/numerics_study.py): the runs it plans for the full study, and one
smoke study on CPU — two recipes at two seeds, two runs side by side, compared by
``nemo-fp8-compare`` over seeds and reported — whose report is checked against the runs' own event
files, summaries and the comparison's JSON."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from helpers.benchmarks import import_benchmark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ns():
    return import_benchmark("numerics_study")


def _settings(ns, *argv):
    return ns.settings(ns._parser().parse_args(list(argv)))


def test_full_study_runs(ns, tmp_path):
    """Every recipe at every seed, deterministic, seed by seed; mxfp8 emulated (Hopper has no MXFP8
    GEMMs); the runs named as the trainer's seed sweep names them; 40,960,000 tokens a run; the
    corpus and extra overrides reach every run."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    a = _settings(ns, "--corpus", str(corpus), "trainer.lr=1e-3")
    js = ns.jobs(a)
    assert [j["name"] for j in js[:5]] == [f"{r}-seed1" for r in ns.RECIPES] and len(js) == 15
    assert js[-1]["name"] == "mxfp8-seed3" and js[-1]["dir"] == Path("runs/study/llama3_150m/mxfp8-seed3")
    for j in js:
        for o in (
            "model=llama3_150m",
            "trainer.max_steps=1250",
            "trainer.seq_len=1024",
            "trainer.global_batch_size=32",
            "trainer.deterministic=true",
            "run.sweep=[trainer.seed]",
            "trainer.lr=1e-3",
            "data=jsonl",
            f"data.paths=[{corpus.resolve()}]",
            "trainer.compile_mode=reduce-overhead",
            f"trainer.seed={j['seed']}",
        ):
            assert o in j["argv"], (o, j["argv"])
        assert ("recipe.emulate=true" in j["argv"]) == (j["recipe"] == "mxfp8")
    assert a.global_batch * a.seq_len * a.steps == 40_960_000
    plain, emulated = ns.sweep_commands(a)
    assert plain[:3] == ["-m", "recipe=bf16,tensorwise,blockwise,delayed", "trainer.seed=1,2,3"]
    assert emulated[:4] == ["-m", "recipe=mxfp8", "recipe.emulate=true", "trainer.seed=1,2,3"]
    # the sweep would name its runs exactly as the jobs do
    from nemo_fp8_recipes.config import compose_config, with_sweep_names

    assert [o for o in with_sweep_names(plain) if o.startswith("run.sweep=")] == ["run.sweep=[trainer.seed]"]
    job = js[7]
    assert Path(compose_config(job["argv"]).run.dir) == job["dir"]
    with pytest.raises(ValueError, match="must include bf16"):
        _settings(ns, "--recipes", "tensorwise")
    with pytest.raises(ValueError, match="distinct seeds"):
        _settings(ns, "--seeds", "1,1")
    with pytest.raises(ValueError, match="no such file"):
        _settings(ns, "--corpus", str(tmp_path / "missing.jsonl"))


def test_variants_are_groups_of_their_own(ns):
    """A variant trains at every seed, after the recipes of that seed, with its overrides last (they
    win), named RECIPE-TAG-seed<N> exactly as the trainer names a run of that run.tag; bad variants
    say what the form is."""
    a = _settings(ns, "--recipes", "bf16,delayed", "--seeds", "2,3", "--variant", "delayed-margin8 recipe.margin=8")
    js = ns.jobs(a)
    assert [j["name"] for j in js] == [
        "bf16-seed2",
        "delayed-seed2",
        "delayed-margin8-seed2",
        "bf16-seed3",
        "delayed-seed3",
        "delayed-margin8-seed3",
    ]
    v = js[2]
    assert v["arm"] == "delayed-margin8" and v["recipe"] == "delayed" and v["argv"][-1] == "recipe.margin=8"
    from nemo_fp8_recipes.config import compose_config

    cfg = compose_config(v["argv"])
    assert Path(cfg.run.dir) == v["dir"] and cfg.recipe.margin == 8 and cfg.run.tag == "margin8"
    assert compose_config(js[1]["argv"]).recipe.margin == 0
    assert ns.sweep_commands(a)[-1][:5] == [
        "-m",
        "recipe=delayed",
        "run.tag=margin8",
        "recipe.margin=8",
        "trainer.seed=2,3",
    ]
    for bad, msg in (
        ("delayed recipe.margin=8", "RECIPE-TAG"),
        ("fp4-x recipe.margin=8", "unknown recipe 'fp4'.*valid: bf16"),
        ("delayed-margin8", "Hydra overrides key=value"),
        ("delayed-margin8 margin", "Hydra overrides key=value"),
        ("delayed-a.b recipe.margin=8", "RECIPE-TAG"),
    ):
        with pytest.raises(ValueError, match=msg):
            _settings(ns, "--variant", bad)
    with pytest.raises(ValueError, match="must differ"):
        _settings(ns, "--variant", "delayed-m x=1", "--variant", "delayed-m y=2")


def test_other_seeds_are_a_bf16_group_trained_last(ns):
    """``--other-seeds``: BF16 at seeds of its own, after every seed of the study, named as the
    trainer names a run of run.tag=other; seeds shared with --seeds are refused."""
    a = _settings(ns, "--recipes", "bf16,tensorwise", "--seeds", "1,2", "--other-seeds", "7,8")
    js = ns.jobs(a)
    assert [j["name"] for j in js] == [
        "bf16-seed1",
        "tensorwise-seed1",
        "bf16-seed2",
        "tensorwise-seed2",
        "bf16-other-seed7",
        "bf16-other-seed8",
    ]
    from nemo_fp8_recipes.config import compose_config

    cfg = compose_config(js[-1]["argv"])
    assert Path(cfg.run.dir) == js[-1]["dir"] and cfg.run.tag == "other" and cfg.trainer.seed == 8
    assert cfg.recipe.name == "bf16" and js[-1]["arm"] == "bf16-other"
    assert ["-m", "recipe=bf16", "run.tag=other", "trainer.seed=7,8"] in [c[:4] for c in ns.sweep_commands(a)]
    assert ns.sweep_commands(a)[-1][:4] == ["-m", "recipe=bf16", "run.tag=other", "trainer.seed=7,8"]
    for bad in ("2,3", "7,7", "7", "x"):
        with pytest.raises(ValueError, match="--other-seeds"):
            _settings(ns, "--seeds", "1,2", "--other-seeds", bad)
    with pytest.raises(ValueError, match="name the variant otherwise"):
        _settings(ns, "--other-seeds", "7,8", "--variant", "bf16-other trainer.lr=1e-3")


def test_bad_arguments_exit_2(ns, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ns.main(["--recipes", "bf16,fp4", "--dry-run"])
    assert e.value.code == 2 and "valid: bf16, tensorwise, blockwise, delayed, mxfp8" in capsys.readouterr().err
    assert ns.main(["--report-only", "--root", str(tmp_path)]) == 2
    assert "no complete bf16 run" in capsys.readouterr().err


def test_run_states(ns, tmp_path):
    d = tmp_path / "bf16-seed1"
    assert ns.run_state(d, 10) == "new"
    d.mkdir()
    (d / "events.out.tfevents.1").write_text("x")
    assert ns.run_state(d, 10) == "stale"
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "step_00000005.pt").write_text("x")
    assert ns.run_state(d, 10) == "resumable"
    (d / "summary.json").write_text(json.dumps({"steps": 10}))
    assert ns.run_state(d, 10) == "complete" and ns.run_state(d, 20) == "resumable"


@pytest.fixture(scope="module")
def smoke(ns, tmp_path_factory):
    """The smoke study, run once: (report.json, its directory, what it printed)."""
    root = tmp_path_factory.mktemp("numerics") / "study,1 [x]"  # a name Hydra would misread unquoted
    stale = root / "llama3_tiny" / "tensorwise-seed2"  # an earlier run that died: moved aside, trained again
    stale.mkdir(parents=True)
    (stale / "events.out.tfevents.0.old").write_text("stale")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ns.main(
            [
                "--preset",
                "smoke",
                "--root",
                str(root),
                "--recipes",
                "bf16,tensorwise",
                "--seeds",
                "1,2",
                "--parallel",
                "2",
                "--variant",
                "tensorwise-pow2 recipe.scale_rounding=pow2",
                "--other-seeds",
                "3,4",
            ]
        )
    assert rc == 0, out.getvalue()[-3000:]
    rdir = root / "llama3_tiny"
    return json.loads((rdir / "report.json").read_text()), rdir, out.getvalue()


def _final(run_dir: Path, tag: str, last: int):
    from nemo_fp8_recipes.compare import load_run

    r = load_run(run_dir, tag)
    window = [v for s, v in zip(r.steps, r.values) if s > r.steps[-1] - last]
    return sum(window) / len(window)


def test_smoke_study_reports_what_the_runs_logged(smoke):
    rep, rdir, printed = smoke
    assert "#   nemo-fp8-train -m recipe=bf16,tensorwise trainer.seed=1,2 model=llama3_tiny" in printed
    assert "$ nemo-fp8-compare" in printed and "moved to" in printed
    assert any(p.name.startswith("tensorwise-seed2.incomplete-") for p in rdir.iterdir())
    assert (
        rep["preset"] == "smoke"
        and rep["steps"] == 6
        and rep["last"] == 2
        and set(rep["recipes"]) == {"bf16", "tensorwise", "tensorwise-pow2", "bf16-other"}
    )
    other = rep["recipes"]["bf16-other"]  # BF16 at other seeds: unpaired, Welch's interval
    assert other["unpaired"] and other["complete_seeds"] == [3, 4] and other["goal"] is None
    lo, hi = other["train_interval"]
    assert lo <= other["train_vs_bf16"] <= hi and other["per_seed_train"] == {}
    import yaml

    var = rep["recipes"]["tensorwise-pow2"]
    assert var["variant"] == {"recipe": "tensorwise", "overrides": ["recipe.scale_rounding=pow2"]}
    assert var["complete_seeds"] == [1, 2] and set(var["per_seed_train"]) == {"1", "2"} and var["goal"] is None
    vcfg = yaml.safe_load((rdir / "tensorwise-pow2-seed2" / "config.yaml").read_text())
    assert vcfg["recipe"]["scale_rounding"] == "pow2" and vcfg["run"]["tag"] == "pow2"
    assert yaml.safe_load((rdir / "tensorwise-seed2" / "config.yaml").read_text())["recipe"]["scale_rounding"] is None
    tw = rep["recipes"]["tensorwise"]
    assert tw["complete_seeds"] == [1, 2] and rep["recipes"]["bf16"]["complete_seeds"] == [1, 2]
    for tag, key, last in (("train/loss", "train", 2), ("val/loss", "val", 1)):
        devs = []
        for s in (1, 2):
            base = _final(rdir / f"bf16-seed{s}", tag, last)
            final = _final(rdir / f"tensorwise-seed{s}", tag, last)
            assert math.isclose(tw[f"per_seed_{key}"][str(s)], final / base - 1, rel_tol=1e-9, abs_tol=1e-15)
            devs.append(final / base - 1)
        assert math.isclose(tw[f"{key}_vs_bf16"], sum(devs) / 2, rel_tol=1e-9, abs_tol=1e-15)
        lo, hi = tw[f"{key}_interval"]
        assert lo <= tw[f"{key}_vs_bf16"] <= hi
        assert tw[f"goal_{key}"] in ("met", "missed", "unresolved")
    for s in (1, 2):
        log = (rdir / f"tensorwise-seed{s}" / "stdout.log").read_text()
        assert "deterministic: on" in log
        assert json.loads((rdir / f"tensorwise-seed{s}" / "summary.json").read_text())["deterministic"] is True
    md = (rdir / "report.md").read_text()
    assert md.startswith("# Numerics study (SMOKE") and md in printed
    digest = json.loads((rdir / "bf16-seed1" / "summary.json").read_text())["data_sha256"]
    assert rep["data_sha256"] == [digest] and f"(tokens sha256 {digest[:16]}…, every run)" in md
    row = next(line for line in md.splitlines() if line.startswith("| tensorwise |"))
    assert f"{100 * tw['train_vs_bf16']:+.2f}%" in row and "±0.50%" in row
    assert "tensorwise-pow2: tensorwise with recipe.scale_rounding=pow2 (a variant" in md
    assert "bf16-other: BF16 at seeds 3, 4, compared with BF16 unpaired (Welch's interval" in md
    assert "bf16-other: bf16 with" not in md  # not listed as a variant
    assert "Noise floor (train loss): BF16 seed to seed" in md and "0 (deterministic)" in md
    # the spread over all four BF16 runs (seeds 1, 2 and the other seeds 3, 4), from their own
    # losses: nemo-fp8-compare pools the groups that trained BF16's settings (run.tag apart)
    finals = [_final(rdir / f"bf16-seed{s}", "train/loss", 2) for s in (1, 2)]
    finals += [_final(rdir / f"bf16-other-seed{s}", "train/loss", 2) for s in (3, 4)]
    mean = sum(finals) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in finals) / 3) / mean
    noise = rep["noise"]["train"]
    assert noise["pooled_groups"] == ["bf16", "bf16-other"] and noise["pooled_seeds"] == [1, 2, 3, 4]
    assert math.isclose(noise["pooled_sd"], sd, rel_tol=1e-9)
    assert math.isclose(noise["pooled_max_pair"], (max(finals) - min(finals)) / mean, rel_tol=1e-9)
    assert f"over all 4 BF16 seeds (bf16 and bf16-other): sd {100 * sd:.2f}%" in md
    cmp_md = (rdir / "compare" / "train" / "compare.md").read_text()
    assert f"the same settings over all 4 seeds (bf16, bf16-other): sd {100 * sd:.3f}%" in cmp_md
    for tag in ("train", "val"):
        cmp = json.loads((rdir / "compare" / tag / "compare.json").read_text())
        assert cmp["settings"]["baseline"] == "bf16" and cmp["seeded"] is True
    assert (rdir / "compare" / "train" / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_a_second_call_trains_nothing_again(ns, smoke, capsys):
    rep, rdir, _ = smoke
    before = {p: p.stat().st_mtime for p in rdir.glob("*/events.out.tfevents.*")}
    assert (
        ns.main(["--preset", "smoke", "--root", str(rdir.parent), "--recipes", "bf16,tensorwise", "--seeds", "1,2"])
        == 0
    )
    assert "bf16-seed1: complete, not trained again" in capsys.readouterr().out
    assert {p: p.stat().st_mtime for p in rdir.glob("*/events.out.tfevents.*")} == before


def test_the_gate_rule_reaches_the_report_and_the_exit_status(ns, smoke, capsys):
    """``--max-rel-dev X`` at a threshold just above tensorwise's lower bound: ``--gate regression``
    (nothing shown worse) passes, the default rule (nothing shown within) fails, and report.md and
    report.json say which rule judged."""
    rep, rdir, _ = smoke
    lo, hi = rep["recipes"]["tensorwise"]["train_interval"]
    x = max(lo, 0.0) + 1e-4
    assert hi > x
    common = ["--preset", "smoke", "--root", str(rdir.parent), "--recipes", "bf16,tensorwise", "--seeds", "1,2"]
    common += ["--report-only", "--max-rel-dev", repr(x)]
    assert ns.main([*common, "--gate", "regression"]) == 0
    again = json.loads((rdir / "report.json").read_text())
    assert again["gate"] == "regression" and again["recipes"]["tensorwise"]["gate_passed"] is True
    assert "Gate (regression: fail only when the 95% interval" in (rdir / "report.md").read_text()
    assert ns.main(common) == 1
    md = (rdir / "report.md").read_text()
    assert "Gate (pass when the 95% interval of the training loss's deviation lies within" in md
    assert "tensorwise FAIL" in md
    capsys.readouterr()
