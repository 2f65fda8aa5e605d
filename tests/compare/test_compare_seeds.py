"""nemo-fp8-compare over seeds, on real event files of short CPU runs of the embedded trainer.

A session fixture trains bf16, tensorwise and blockwise at seeds 1, 2 and 3 deterministically
(one ``nemo-fp8-train -m`` sweep: the run directories are named by the seed), BF16 at two other
seeds under another tag (a group sharing no seed with the baseline), and BF16 seed 1 again in
another directory (a same-seed rerun). Every number of the seed table is recomputed here with
numpy from the raw event records and Student's t from a printed table.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.events import raw_scalars
from helpers.tiny import TINY_SHAPE

from nemo_fp8_recipes.compare import (
    DEVIATION_HIGH_TAG,
    DEVIATION_LOW_TAG,
    DEVIATION_TAG,
    CompareError,
    Comparison,
    compare_runs,
    group_label,
    load_runs,
    main,
    mean_interval,
    plot,
    t_quantile,
    welch_interval,
)
from nemo_fp8_recipes.train import main as train_main

RECIPES, SEEDS, STEPS, LAST = ("bf16", "tensorwise", "blockwise"), (1, 2, 3), 20, 6
TINY = [
    *TINY_SHAPE,
    "trainer.warmup_steps=4",
    f"trainer.max_steps={STEPS}",
    "trainer.log_interval=2",
    "trainer.val_interval=10",
    "trainer.val_steps=1",
    "trainer.checkpoint=false",
    "data.max_files=20",
    "trainer.deterministic=true",
]
#: Student's t, 97.5% quantile (two-sided 95%), from the printed tables
T975 = {
    1: 12.706204736174705,
    2: 4.302652729911275,
    3: 3.182446305284263,
    4: 2.7764451051977987,
    10: 2.2281388519649385,
    30: 2.0422724563012373,
}


@pytest.fixture(scope="session")
def seeds(tmp_path_factory):
    """The runs (see the module docstring): ``(parent, rerun_dir, other_dirs)``."""
    root = tmp_path_factory.mktemp("seed_runs")
    cache = tmp_path_factory.mktemp("seed_tokens")
    common = [*TINY, f"data.cache_dir={cache}"]
    assert (
        train_main(
            [
                "-m",
                f"recipe={','.join(RECIPES)}",
                f"trainer.seed={','.join(map(str, SEEDS))}",
                f"run.root={root}",
                *common,
            ]
        )
        == 0
    )
    assert train_main(["-m", "recipe=bf16", "trainer.seed=4,5", "run.tag=other", f"run.root={root}", *common]) == 0
    assert (
        train_main(["recipe=bf16", "trainer.seed=1", "run.sweep=[trainer.seed]", f"run.root={root / 'again'}", *common])
        == 0
    )
    parent = root / "llama3_tiny"
    names = sorted(p.name for p in parent.iterdir())
    assert names == sorted([f"{r}-seed{s}" for r in RECIPES for s in SEEDS] + ["bf16-other-seed4", "bf16-other-seed5"])
    return parent, root / "again" / "llama3_tiny" / "bf16-seed1"


def _finals(run_dir: Path, last: int = LAST) -> float:
    raw = raw_scalars(run_dir, "train/loss")
    steps = np.array(sorted(raw))
    return float(np.mean([raw[s] for s in steps if s > steps[-1] - last]))


def _groups_csv(path: Path) -> dict:
    return {row["group"]: row for row in csv.DictReader(io.StringIO(path.read_text()))}


def test_t_quantiles_match_the_printed_table():
    for df, t in T975.items():
        assert t_quantile(0.975, df) == pytest.approx(t, rel=1e-9)
    assert t_quantile(0.025, 4) == pytest.approx(-T975[4], rel=1e-9)
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959963984540054, rel=1e-6)  # the normal limit
    assert T975[2] < t_quantile(0.975, 1.5) < T975[1]  # Welch's fractional degrees of freedom
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_interval_helpers():
    m, ci = mean_interval([0.01, 0.02, 0.03])
    assert m == pytest.approx(0.02) and ci == pytest.approx(
        (0.02 - T975[2] * 0.01 / math.sqrt(3), 0.02 + T975[2] * 0.01 / math.sqrt(3))
    )
    assert mean_interval([0.5])[1] is None
    diff, ci = welch_interval([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert diff == 0 and ci[0] < 0 < ci[1]
    # unequal sizes and variances: SciPy's ttest_ind(equal_var=False).confidence_interval(0.95)
    # gives df 4.0754716981, interval [-6.897975451083, 0.897975451083]
    diff, ci = welch_interval([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0])
    assert diff == -3.0 and ci == pytest.approx((-6.897975451083128, 0.8979754510831279), rel=1e-9)
    assert welch_interval([1.0, float("nan")], [1.0, 2.0])[1] is None  # a lost loss: no interval, no crash
    assert welch_interval([1.0, 2.0], [1.0, float("inf")])[1] is None
    assert group_label("bf16-seed1", 1) == "bf16" and group_label("a/bf16-x-seed12-y", 12) == "a/bf16-x-y"
    assert group_label("bf16", 1) == "bf16" and group_label("bf16-seed2", 1) == "bf16-seed2"


def test_seed_table_matches_an_independent_computation(seeds, tmp_path, capsys):
    parent, rerun = seeds
    out = tmp_path / "out"
    dirs = [str(parent / f"{r}-seed{s}") for r in RECIPES for s in SEEDS]
    assert main([*dirs, "--last", str(LAST), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _groups_csv(out / "compare_groups.csv")
    assert list(rows) == list(RECIPES) and rows["bf16"]["baseline"] == "True"
    base = {s: _finals(parent / f"bf16-seed{s}") for s in SEEDS}
    for r in ("tensorwise", "blockwise"):
        row = rows[r]
        assert row["method"] == "paired" and row["seeds"] == "1 2 3"
        dev = np.array([(_finals(parent / f"{r}-seed{s}") - base[s]) / base[s] for s in SEEDS])
        half = T975[2] * dev.std(ddof=1) / math.sqrt(3)
        assert float(row["final_vs_baseline"]) == pytest.approx(dev.mean(), rel=1e-9, abs=1e-15)
        assert float(row["interval_low"]) == pytest.approx(dev.mean() - half, rel=1e-9, abs=1e-15)
        assert float(row["interval_high"]) == pytest.approx(dev.mean() + half, rel=1e-9, abs=1e-15)
        finals = [_finals(parent / f"{r}-seed{s}") for s in SEEDS]
        assert float(row["final_loss"]) == pytest.approx(np.mean(finals), rel=1e-12)
        assert float(row["final_loss_sd"]) == pytest.approx(np.std(finals, ddof=1), rel=1e-9)
        # each run is compared with the BF16 run of its own seed
        runs = {x["run"]: x for x in csv.DictReader(io.StringIO((out / "compare.csv").read_text()))}
        for s in SEEDS:
            assert runs[f"{r}-seed{s}"]["paired_with"] == f"bf16-seed{s}" and runs[f"{r}-seed{s}"]["passed"] == ""
    b = np.array(list(base.values()))
    data = json.loads((out / "compare.json").read_text())
    assert data["seeded"] is True and data["noise"]["seeds"] == list(SEEDS)
    assert data["noise"]["seed_sd"] == pytest.approx(b.std(ddof=1) / b.mean(), rel=1e-9)
    assert data["noise"]["seed_max_pair"] == pytest.approx((b.max() - b.min()) / b.mean(), rel=1e-9)
    assert data["noise"]["deterministic"] is True and data["noise"]["reruns"] == []
    # no other group trained BF16's settings: nothing pooled (FP8 groups never are)
    assert data["noise"]["pooled_groups"] == [] and data["noise"]["pooled_sd"] is None
    assert "same seed run again, 0 (every run deterministic" in printed
    assert "| bf16 (baseline) | 1, 2, 3 |" in printed


def test_a_rerun_of_a_seed_is_the_measured_rerun_floor(seeds, tmp_path, capsys):
    parent, rerun = seeds
    assert (
        main(
            [
                str(parent / "bf16-seed1"),
                str(parent / "bf16-seed2"),
                str(rerun),
                str(parent / "blockwise-seed1"),
                str(parent / "blockwise-seed2"),
                "--last",
                str(LAST),
                "--out",
                str(tmp_path),
                "--no-png",
            ]
        )
        == 0
    )
    noise = json.loads((tmp_path / "compare.json").read_text())["noise"]
    assert len(noise["reruns"]) == 1 and noise["reruns"][0]["seed"] == 1
    assert noise["reruns"][0]["final_dev"] == 0.0 and noise["reruns"][0]["max_rel_dev"] == 0.0  # deterministic
    assert "measured on 1 rerun pair(s): final loss differs by up to 0.000%" in capsys.readouterr().out


def test_a_group_without_common_seeds_gets_welchs_interval(seeds, tmp_path):
    parent, _ = seeds
    dirs = [parent / f"bf16-seed{s}" for s in SEEDS] + [parent / "bf16-other-seed4", parent / "bf16-other-seed5"]
    assert main([*map(str, dirs), "--last", str(LAST), "--out", str(tmp_path), "--no-png", "--no-events"]) == 0
    row = _groups_csv(tmp_path / "compare_groups.csv")["bf16-other"]
    a = np.array([_finals(parent / f"bf16-other-seed{s}") for s in (4, 5)])
    b = np.array([_finals(parent / f"bf16-seed{s}") for s in SEEDS])
    va, vb = a.var(ddof=1) / 2, b.var(ddof=1) / 3
    df = (va + vb) ** 2 / (va**2 / 1 + vb**2 / 2)
    half = t_quantile(0.975, df) * math.sqrt(va + vb) / b.mean()
    assert row["method"] == "unpaired"
    md = (tmp_path / "compare.md").read_text()  # one note for the group, not a 'no partner' per run
    assert "Welch's interval over the two groups' seeds" in md and "to pair it with" not in md
    assert float(row["final_vs_baseline"]) == pytest.approx((a.mean() - b.mean()) / b.mean(), rel=1e-9)
    assert float(row["interval_high"]) - float(row["final_vs_baseline"]) == pytest.approx(half, rel=1e-9)
    # bf16-other differs from bf16 in run.tag alone: the noise floor also pools the five BF16 seeds
    noise = json.loads((tmp_path / "compare.json").read_text())["noise"]
    both = np.concatenate([b, a])
    assert noise["pooled_groups"] == ["bf16", "bf16-other"] and noise["pooled_seeds"] == [1, 2, 3, 4, 5]
    assert noise["pooled_sd"] == pytest.approx(both.std(ddof=1) / both.mean(), rel=1e-9)
    assert noise["pooled_max_pair"] == pytest.approx((both.max() - both.min()) / both.mean(), rel=1e-9)
    assert noise["seed_sd"] == pytest.approx(b.std(ddof=1) / b.mean(), rel=1e-9)  # the baseline's own, as before
    assert f"the same settings over all 5 seeds (bf16, bf16-other): sd {100 * noise['pooled_sd']:.3f}%" in md
    # the gate judges such a group by Welch's interval: runs without a same-seed partner are the
    # design there, not a fault (a single unpartnered run is still failed: it has no interval)
    reach = max(abs(float(row["interval_low"])), abs(float(row["interval_high"])))
    args = [*map(str, dirs), "--last", str(LAST), "--out", str(tmp_path), "--no-png", "--no-events"]
    assert main(args + ["--max-rel-dev", repr(reach * 1.0001)]) == 0
    assert _groups_csv(tmp_path / "compare_groups.csv")["bf16-other"]["passed"] == "True"
    assert main(args + ["--max-rel-dev", repr(reach * 0.9999)]) == 1
    assert _groups_csv(tmp_path / "compare_groups.csv")["bf16-other"]["passed"] == "False"
    one = [*map(str, dirs[:-1]), "--last", str(LAST), "--out", str(tmp_path), "--no-png", "--no-events"]
    assert main(one + ["--max-rel-dev", "0.99"]) == 1
    row = _groups_csv(tmp_path / "compare_groups.csv")["bf16-other"]
    assert row["passed"] == "False" and "no bf16 run of seed 4 to pair it with" in row["reasons"]
    assert "no bf16 run of seed 4 to pair it with" in (tmp_path / "compare.md").read_text()


def test_the_gate_decides_on_the_interval(seeds, tmp_path, capsys):
    parent, _ = seeds
    dirs = [str(parent / f"{r}-seed{s}") for r in RECIPES for s in SEEDS]
    args = [*dirs, "--last", str(LAST), "--out", str(tmp_path), "--no-png", "--no-events"]
    cmp = compare_runs(load_runs(dirs), last=LAST)
    reach = {g.label: max(abs(g.interval[0]), abs(g.interval[1])) for g in cmp.groups if not g.baseline}
    worst, best = max(reach, key=reach.get), min(reach, key=reach.get)
    assert reach[worst] > reach[best] > 0
    capsys.readouterr()
    assert main(args + ["--max-rel-dev", repr(0.5 * (reach[worst] + reach[best]))]) == 1
    err = capsys.readouterr().err
    assert "GATE FAILED (95% interval over seeds" in err and f"  {worst}: " in err and f"  {best}: " not in err
    assert "cannot show the deviation within it" in err or "deviation shown beyond" in err
    rows = _groups_csv(tmp_path / "compare_groups.csv")
    assert rows[worst]["passed"] == "False" and rows[best]["passed"] == "True"
    assert main(args + ["--max-rel-dev", repr(reach[worst] * 1.0001)]) == 0
    assert "every group's 95% interval over seeds within" in capsys.readouterr().out


def _synthetic(name, seed, factor):
    from nemo_fp8_recipes.compare import RunSeries

    steps = list(range(10, 60, 10))
    values = [(2.0 + 0.1 * seed - 0.01 * t) * factor for t in steps]
    return RunSeries(
        name=f"{name}-seed{seed}",
        path=f"/r/{name}-seed{seed}",
        tag="train/loss",
        steps=steps,
        values=values,
        seed=seed,
        deterministic=True,
        variant=name,
    )


def test_an_interval_entirely_beyond_the_threshold_is_shown_beyond():
    """A group 0.8–1.2% above the baseline at every seed: its interval lies beyond ±0.5% (fails, as
    a deviation shown beyond it) and within ±2% (passes)."""
    runs = [_synthetic("bf16", s, 1.0) for s in SEEDS]
    runs += [_synthetic("worse", s, 1.01 + 0.002 * (s - 2)) for s in SEEDS]
    beyond = compare_runs(runs, last=20, max_rel_dev=0.005)
    g = next(g for g in beyond.groups if g.label == "worse")
    assert 0.005 < g.interval[0] < g.interval[1] < 0.02 and g.passed is False
    assert any("deviation shown beyond ±0.500%" in why for why in g.reasons) and not beyond.passed
    assert compare_runs(runs, last=20, max_rel_dev=0.02).passed


def test_the_regression_rule_fails_only_a_loss_shown_above_the_threshold():
    """``gate="regression"``: worse (+0.8..1.2% at every seed) fails at 0.5% and passes at 2% as shown
    within; noisy (-1%..+1.5%: unresolved at 0.5%) and better (-1% at every seed) pass, each
    verdict saying what the seeds showed; the equivalence rule fails noisy and better at 0.5%."""
    factors = {"worse": lambda s: 1.01 + 0.002 * (s - 2), "noisy": lambda s: (0.99, 1.015, 1.0)[s - 1]}
    factors["better"] = lambda s: 0.99 - 0.001 * (s - 2)
    runs = [_synthetic("bf16", s, 1.0) for s in SEEDS]
    runs += [_synthetic(name, s, f(s)) for name, f in factors.items() for s in SEEDS]
    reg = compare_runs(runs, last=20, max_rel_dev=0.005, gate="regression")
    g = {x.label: x for x in reg.groups}
    assert 0.005 < g["worse"].interval[0] and g["worse"].passed is False and not reg.passed
    assert any("loss shown more than 0.500% above the baseline" in why for why in g["worse"].reasons)
    lo, hi = g["noisy"].interval
    assert lo < -0.005 and 0.005 < hi and g["noisy"].passed is True
    assert any("not shown worse than +0.500%, and not shown within ±0.500% either" in n for n in g["noisy"].notes)
    assert g["better"].interval[1] < -0.005 and g["better"].passed is True
    assert any("more than 0.500% below the baseline" in n for n in g["better"].notes)
    md = reg.to_markdown()
    assert "| noisy | 1, 2, 3 |" in md and "pass (not resolved) |" in md and "**FAIL** |" in md
    assert "(regression) fail only when the 95% interval over seeds" in md
    # the same runs under the equivalence rule: only a group shown within ±X passes
    within = compare_runs(runs, last=20, max_rel_dev=0.005)
    assert [x.label for x in within.groups if x.passed is False] == ["worse", "noisy", "better"]
    wide = compare_runs(runs, last=20, max_rel_dev=0.02, gate="regression")
    assert wide.passed and "pass (within) |" in wide.to_markdown()
    # the rule is a setting of the export: kept on re-import, and changed when asked
    again = Comparison.from_json(reg.to_json())
    assert again.gate == "regression" and again.to_markdown() == md
    assert Comparison.from_json(reg.to_json(), gate="within").to_markdown() == within.to_markdown()
    with pytest.raises(CompareError, match="unknown gate rule 'strict'; choose one of within, regression"):
        compare_runs(runs, last=20, max_rel_dev=0.005, gate="strict")


def test_the_regression_rule_on_real_runs(seeds, tmp_path, capsys):
    """On the CPU runs: at a threshold just above every group's lower bound no group is shown worse,
    so ``--gate regression`` passes and names the groups it could not resolve, while the default
    rule fails at the same threshold; ``--gate`` refuses an unknown rule."""
    parent, _ = seeds
    dirs = [str(parent / f"{r}-seed{s}") for r in RECIPES for s in SEEDS]
    cmp = compare_runs(load_runs(dirs), last=LAST)
    x = max(max(g.interval[0] for g in cmp.groups if not g.baseline), 1e-6) * 1.0001
    args = [*dirs, "--last", str(LAST), "--out", str(tmp_path), "--no-png", "--no-events", "--max-rel-dev", repr(x)]
    capsys.readouterr()
    assert main(args + ["--gate", "regression"]) == 0
    out = capsys.readouterr().out
    assert "gate passed (regression): no group's loss shown more than" in out and "not resolved within" in out
    assert json.loads((tmp_path / "compare.json").read_text())["settings"]["gate"] == "regression"
    assert main(args) == 1
    assert "GATE FAILED (95% interval over seeds within" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(args + ["--gate", "strict"])
    assert e.value.code == 2 and "invalid choice: 'strict'" in capsys.readouterr().err


def test_a_seed_run_cut_short_stays_out_of_its_groups_interval():
    """One seed of a group stopped halfway (cut short, still running): its loss at that point is no
    final loss, so the group's numbers come from the seeds that finished, and the notes name it."""
    from nemo_fp8_recipes.compare import RunSeries

    steps = list(range(10, 110, 10))

    def run(name, seed, factor, upto=None):
        st = [t for t in steps if upto is None or t <= upto]
        return RunSeries(
            name=f"{name}-seed{seed}",
            path=f"/r/{name}-seed{seed}",
            tag="train/loss",
            steps=st,
            values=[(2.0 + 0.1 * seed - 0.01 * t) * factor for t in st],
            seed=seed,
            deterministic=True,
            variant=name,
        )

    runs = [run("bf16", s, 1.0) for s in SEEDS] + [run("fp8", 1, 1.001), run("fp8", 2, 1.002), run("fp8", 3, 1.0, 50)]
    c = compare_runs(runs, last=20, max_rel_dev=0.01)
    g = next(g for g in c.groups if g.label == "fp8")
    assert g.seeds == [1, 2] and set(g.per_seed) == {"1", "2"}
    assert abs(g.final_vs_baseline - 0.0015) < 1e-9 and g.interval is not None
    assert any("fp8-seed3 ended at step 50, before its baseline's last step" in n for n in g.notes)


def test_runs_on_other_tokens_are_not_compared_as_pairs(tmp_path, capsys):
    """BF16 and tensorwise at seed 1 on one corpus path whose text changed between the two runs:
    their configs agree, their summary.json data digests do not, and the gate fails the pair for
    it; on the unchanged corpus it says nothing of the kind."""
    corpus = tmp_path / "corpus.jsonl"

    def write(words: str) -> None:
        corpus.write_text(
            "".join(json.dumps({"text": f"{words} {i} " * 40}) + "\n" for i in range(40)), encoding="utf-8"
        )

    def train(recipe: str, root: Path) -> Path:
        common = [*TINY, "data=jsonl", f"data.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}"]
        assert train_main([f"recipe={recipe}", "trainer.seed=1", f"run.root={root}", *common]) == 0
        return root / "llama3_tiny" / recipe

    write("the first text")
    base, same = train("bf16", tmp_path / "a"), train("tensorwise", tmp_path / "a")
    write("another text altogether")
    other = train("tensorwise", tmp_path / "b")
    digests = [json.loads((d / "summary.json").read_text())["data_sha256"] for d in (base, same, other)]
    assert digests[0] == digests[1] != digests[2]
    args = ["--last", str(LAST), "--max-rel-dev", "0.99", "--no-png", "--no-events"]
    assert main([str(base), str(same), *args, "--out", str(tmp_path / "o1")]) == 0
    assert "trained on other tokens" not in capsys.readouterr().out
    assert main([str(base), str(other), *args, "--out", str(tmp_path / "o2")]) == 1
    printed = capsys.readouterr()
    why = f"trained on other tokens than the baseline bf16 (data sha256 {digests[2][:12]} against {digests[0][:12]})"
    assert why in printed.out + printed.err


def test_one_seed_says_it_cannot_separate_fp8_from_noise(seeds, tmp_path, capsys):
    parent, _ = seeds
    assert (
        main(
            [
                str(parent / "bf16-seed1"),
                str(parent / "tensorwise-seed1"),
                "--last",
                str(LAST),
                "--max-rel-dev",
                "0.5",
                "--out",
                str(tmp_path),
                "--no-png",
                "--no-events",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "one seed: this comparison cannot separate the recipe from seed noise" in out
    assert "this cannot separate FP8 from seed noise" in out  # the gate line says it too


def test_seeded_outputs_reimport_and_draw_bands(seeds, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    parent, _ = seeds
    dirs = [str(parent / f"{r}-seed{s}") for r in RECIPES for s in SEEDS]
    out = tmp_path / "first"
    assert main([*dirs, "--last", str(LAST), "--max-rel-dev", "0.5", "--out", str(out)]) == 0
    again = Comparison.from_json((out / "compare.json").read_text())
    assert again.to_markdown() == (out / "compare.md").read_text()
    assert again.groups_csv() == (out / "compare_groups.csv").read_text()
    # the TensorBoard runs per group: the mean deviation and its interval per step
    cmp = compare_runs(load_runs(dirs), last=LAST)
    for label in ("tensorwise", "blockwise"):
        acc = EventAccumulator(str(out / "deviation" / label))
        acc.Reload()
        steps, mean, lo, hi = cmp.group_deviations[label]
        for tag, want in ((DEVIATION_TAG, mean), (DEVIATION_LOW_TAG, lo), (DEVIATION_HIGH_TAG, hi)):
            assert [e.step for e in acc.Scalars(tag)] == steps
            assert [e.value for e in acc.Scalars(tag)] == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert all(a <= m <= b for a, m, b in zip(lo, mean, hi))
    fig = plot(cmp)
    ax_loss, ax_dev = fig.axes[:2]
    assert sorted(line.get_label() for line in ax_loss.get_lines()) == [
        "bf16 (3 seeds, baseline)",
        "blockwise (3 seeds)",
        "tensorwise (3 seeds)",
    ]
    bands = [c.get_label() for c in ax_dev.collections]
    assert "bf16 seed-to-seed spread (±1 sd)" in bands


def _readme_quick_start_compare() -> list:
    """The arguments of the README quick start's ``nemo-fp8-compare`` line, as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## Quick start: trainer") :]
    block = block[block.index("```bash") : block.index("```", block.index("```bash") + 7)]
    lines = [ln.split("  #", 1)[0].split() for ln in block.splitlines() if ln.startswith("nemo-fp8-compare ")]
    assert len(lines) == 1, lines
    return lines[0][1:]


def test_the_readme_compare_quick_start_gives_the_same_verdict_at_every_seed(seeds, tmp_path, capsys):
    """The quick start trains one run per recipe at one seed and compares them as the README
    writes it: at every seed it exits 0 and says, per FP8 run, that one seed cannot separate the
    recipe from noise (a fixed threshold would pass one seed and fail another)."""
    parent, _ = seeds
    args = _readme_quick_start_compare()
    assert args[0] == "runs/llama3_tiny", args
    verdicts = []
    for s in SEEDS:
        runs = tmp_path / f"seed{s}" / "llama3_tiny"
        for r in RECIPES:  # the quick start's layout: runs/llama3_tiny/<recipe>
            shutil.copytree(parent / f"{r}-seed{s}", runs / r)
        code = main([str(runs), *args[1:], "--out", str(tmp_path / f"out{s}"), "--no-png", "--no-events"])
        out = capsys.readouterr().out
        notes = sorted(
            r for r in RECIPES[1:] if f"**{r}**: one seed: this comparison cannot separate the recipe" in out
        )
        verdicts.append((code, notes))
    assert verdicts == [(0, sorted(RECIPES[1:]))] * len(SEEDS), verdicts
