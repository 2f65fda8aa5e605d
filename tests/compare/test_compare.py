"""nemo-fp8-compare on real event files from short CPU runs of the embedded trainer.

The event files are written once per session by three real training runs (bf16, tensorwise,
blockwise). Every number of the compare tool's table is checked against a computation done here
independently: the events are read with TensorBoard's raw record loader (not the
EventAccumulator the tool uses) and the statistics are recomputed with numpy.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers.events import raw_scalars
from helpers.tiny import TINY_SHAPE

from nemo_fp8_recipes.compare import (
    DEVIATION_TAG,
    CompareError,
    Comparison,
    compare_runs,
    load_runs,
    main,
    moving_average,
    plot,
    tensorboard_layout,
)
from nemo_fp8_recipes.config import compose_config
from nemo_fp8_recipes.train import train

RECIPES = ("bf16", "tensorwise", "blockwise")
STEPS, LOG_EVERY = 30, 2
TINY = [
    *TINY_SHAPE,
    "trainer.warmup_steps=4",
    f"trainer.max_steps={STEPS}",
    f"trainer.log_interval={LOG_EVERY}",
    "trainer.val_interval=10",
    "trainer.val_steps=1",
    "trainer.checkpoint=false",
    "data.max_files=20",
]


@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    """Three real CPU training runs side by side: <root>/llama3_tiny/{bf16,tensorwise,blockwise}."""
    root = tmp_path_factory.mktemp("compare_runs")
    cache = tmp_path_factory.mktemp("compare_token_cache")
    results = {}
    for recipe in RECIPES:
        cfg = compose_config(TINY + [f"recipe={recipe}", f"run.root={root}", f"data.cache_dir={cache}"])
        results[recipe] = train(cfg)
    parent = root / "llama3_tiny"
    assert sorted(p.name for p in parent.iterdir()) == sorted(RECIPES)
    return parent, results


def expected_stats(parent: Path, last: int, smooth: int = 1, baseline: str = "bf16", tag: str = "train/loss"):
    """The table, computed here with numpy from the raw records."""
    curves, tps = {}, {}
    for r in RECIPES:
        raw = raw_scalars(parent / r, tag)
        steps = np.array(sorted(raw))
        vals = np.array([raw[s] for s in steps], dtype=np.float64)
        if smooth > 1:  # trailing moving average, shorter window at the start
            vals = np.array([vals[max(0, i - smooth + 1) : i + 1].mean() for i in range(len(vals))])
        curves[r] = (steps, vals)
        tps[r] = float(np.median(list(raw_scalars(parent / r, "tokens_per_s").values())))
    out = {}
    b_steps, b_vals = curves[baseline]

    def final(steps, vals):
        return float(vals[steps > steps[-1] - last].mean())

    for r in RECIPES:
        steps, vals = curves[r]
        row = {"final_loss": final(steps, vals), "tokens_per_s": tps[r], "speedup": tps[r] / tps[baseline]}
        if r != baseline:
            common, i_r, i_b = np.intersect1d(steps, b_steps, return_indices=True)
            dev = (vals[i_r] - b_vals[i_b]) / b_vals[i_b]
            window = common > common[-1] - last
            row.update(
                max_rel_dev=float(np.abs(dev).max()),
                mean_rel_dev=float(np.abs(dev).mean()),
                gate_rel_dev=float(np.abs(dev[window]).max()),
                final_vs_baseline=(row["final_loss"] - final(b_steps, b_vals)) / final(b_steps, b_vals),
                steps=common,
                dev=dev,
            )
        out[r] = row
    return out


def read_csv(path: Path) -> dict:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    return {row["run"]: row for row in rows}


def test_events_come_from_the_training_runs(sweep):
    """Sanity check of the fixture: the logged train/loss is the trainer's window mean."""
    parent, results = sweep
    for r in RECIPES:
        raw = raw_scalars(parent / r, "train/loss")
        assert sorted(raw) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        hist = results[r].losses
        for s, v in raw.items():
            window = [hist[k] for k in range(s - LOG_EVERY + 1, s + 1)]
            assert v == pytest.approx(np.mean(window), rel=1e-6)


@pytest.mark.parametrize("last", [10, STEPS])
def test_table_matches_an_independent_computation(sweep, tmp_path, capsys, last):
    parent, _ = sweep
    out = tmp_path / "out"
    code = main([str(parent / r) for r in RECIPES] + ["--last", str(last), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    exp = expected_stats(parent, last)
    rows = read_csv(out / "compare.csv")
    assert list(rows) == ["bf16", "tensorwise", "blockwise"]  # baseline first
    assert rows["bf16"]["baseline"] == "True" and rows["bf16"]["max_rel_dev"] == ""
    for r in RECIPES:
        row, e = rows[r], exp[r]
        assert float(row["final_loss"]) == pytest.approx(e["final_loss"], rel=1e-12)
        assert float(row["tokens_per_s"]) == pytest.approx(e["tokens_per_s"], rel=1e-12)
        assert float(row["speedup"]) == pytest.approx(e["speedup"], rel=1e-12)
        if r == "bf16":
            continue
        for k in ("max_rel_dev", "mean_rel_dev", "gate_rel_dev", "final_vs_baseline"):
            assert float(row[k]) == pytest.approx(e[k], rel=1e-9, abs=1e-15), k
        assert int(row["aligned_steps"]) == STEPS // LOG_EVERY
        assert int(row["gate_last_step"]) == STEPS
        assert int(row["gate_first_step"]) == min(s for s in e["steps"] if s > STEPS - last)
        # the Markdown table shows the same numbers, rounded
        md_row = next(line for line in (out / "compare.md").read_text().splitlines() if line.startswith(f"| {r} |"))
        assert f"{e['final_loss']:.4f}" in md_row and f"{100 * e['max_rel_dev']:.3f}%" in md_row
        assert f"{e['speedup']:.2f}×" in md_row
    assert "| bf16 (baseline) |" in printed and "baseline **bf16**" in printed


def test_smoothing_is_a_trailing_moving_average(sweep, tmp_path):
    parent, _ = sweep
    assert moving_average([1, 2, 3, 4, 5], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert main([str(parent), "--smooth", "3", "--last", "10", "--out", str(tmp_path), "--no-png", "--no-events"]) == 0
    rows = read_csv(tmp_path / "compare.csv")
    exp = expected_stats(parent, last=10, smooth=3)
    for r in RECIPES:
        assert float(rows[r]["final_loss"]) == pytest.approx(exp[r]["final_loss"], rel=1e-12)
        if r != "bf16":
            assert float(rows[r]["max_rel_dev"]) == pytest.approx(exp[r]["max_rel_dev"], rel=1e-9)


def test_png_has_one_curve_per_run(sweep, tmp_path):
    import matplotlib.colors as mcolors
    import matplotlib.image as mimage

    parent, _ = sweep
    assert main([str(parent), "--last", "10", "--out", str(tmp_path)]) == 0
    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    comparison = compare_runs(load_runs([str(parent)]), last=10)
    fig = plot(comparison)
    ax_loss, ax_dev = fig.axes[:2]
    lines = ax_loss.get_lines()
    assert sorted(line.get_label() for line in lines) == sorted(["bf16 (baseline)", "tensorwise", "blockwise"])
    for line in lines:  # each curve is the run's loss curve
        name = line.get_label().replace(" (baseline)", "")
        assert list(line.get_xdata()) == comparison.curve(name)[0]
    assert sorted(line.get_label() for line in ax_dev.get_lines() if not line.get_label().startswith("_")) == [
        "blockwise",
        "tensorwise",
    ]
    # and every curve's colour is really drawn in the PNG file
    img = mimage.imread(str(png))[..., :3]
    for line in lines:
        rgb = np.array(mcolors.to_rgb(line.get_color()))
        assert (np.abs(img - rgb).max(axis=-1) < 0.02).sum() > 50, line.get_label()


def test_gate_fails_exactly_when_a_run_exceeds_the_threshold(sweep, tmp_path, capsys):
    parent, _ = sweep
    exp = expected_stats(parent, last=10)
    worst = max(("tensorwise", "blockwise"), key=lambda r: exp[r]["gate_rel_dev"])
    best = min(("tensorwise", "blockwise"), key=lambda r: exp[r]["gate_rel_dev"])
    assert exp[worst]["gate_rel_dev"] > 0
    args = [str(parent), "--last", "10", "--out", str(tmp_path), "--no-png", "--no-events"]

    threshold = 0.5 * (exp[worst]["gate_rel_dev"] + exp[best]["gate_rel_dev"])  # between the two runs
    capsys.readouterr()  # drop anything captured before (e.g. the sweep fixture's training logs)
    assert main(args + ["--max-rel-dev", repr(threshold)]) == 1
    err = capsys.readouterr().err
    # judge the gate's own line (other tests' logging handlers may also write to stderr here)
    gate = _gate_lines(err)
    assert sum(line.startswith("GATE FAILED") for line in gate) == 1
    failed = [line.split(":")[0].strip() for line in gate[1:] if line.startswith("  ")]
    assert failed == [worst]
    rows = read_csv(tmp_path / "compare.csv")
    assert rows[worst]["passed"] == "False" and rows[best]["passed"] == "True"

    assert main(args + ["--max-rel-dev", repr(exp[worst]["gate_rel_dev"] * 1.001)]) == 0
    assert "gate passed" in capsys.readouterr().out
    assert main(args + ["--max-rel-dev", repr(exp[best]["gate_rel_dev"] * 0.999)]) == 1
    # the gate looks only at the window: a threshold above the window's max but below the
    # whole-run max passes when the largest deviation is earlier
    for r in ("tensorwise", "blockwise"):
        assert exp[r]["gate_rel_dev"] <= exp[r]["max_rel_dev"]


def test_json_export_reimports(sweep, tmp_path, capsys):
    parent, _ = sweep
    out = tmp_path / "first"
    assert main([str(parent), "--last", "10", "--max-rel-dev", "0.5", "--out", str(out)]) == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["settings"] == {
        "tag": "train/loss",
        "tokens_tag": "tokens_per_s",
        "baseline": "bf16",
        "smooth": 1,
        "last": 10,
        "max_rel_dev": 0.5,
        "gate": "within",
    }
    assert {r["name"] for r in data["runs"]} == set(RECIPES) and data["passed"] is True

    again = Comparison.from_json((out / "compare.json").read_text())
    assert json.loads(again.to_json()) == data
    assert again.to_markdown() == (out / "compare.md").read_text()

    # re-render with other settings, from the JSON alone (no event files needed)
    out2 = tmp_path / "second"
    capsys.readouterr()
    assert (
        main(
            [
                "--from-json",
                str(out / "compare.json"),
                "--last",
                str(STEPS),
                "--baseline",
                "tensorwise",
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    rows = read_csv(out2 / "compare.csv")
    assert rows["tensorwise"]["baseline"] == "True"
    direct = compare_runs(load_runs([str(parent)]), last=STEPS, baseline="tensorwise", max_rel_dev=0.5)
    assert (out2 / "compare.csv").read_text() == direct.to_csv()
    assert (out2 / "compare.png").is_file()


def test_deviation_runs_and_layout_for_tensorboard(sweep, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    parent, _ = sweep
    assert main([str(parent), "--last", "10", "--out", str(tmp_path), "--no-png"]) == 0
    exp = expected_stats(parent, last=10)
    for r in ("tensorwise", "blockwise"):
        acc = EventAccumulator(str(tmp_path / "deviation" / r))
        acc.Reload()
        events = acc.Scalars(DEVIATION_TAG)
        assert [e.step for e in events] == list(exp[r]["steps"])
        assert [e.value for e in events] == pytest.approx(list(exp[r]["dev"]), rel=1e-6, abs=1e-9)

    # every training run carries the custom-scalars layout TensorBoard reads
    acc = EventAccumulator(str(parent / "bf16"))
    acc.Reload()
    proto = acc.Tensors("custom_scalars__config__")[0].tensor_proto
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["train/loss"] == [r"^train/loss$"] and charts["val/loss"] == [r"^val/loss$"]
    assert any(tags == [f"^{DEVIATION_TAG}$"] for tags in charts.values())
    assert {cat.title for cat in layout.category} == set(tensorboard_layout())


def test_a_parent_directory_stands_for_its_runs_and_outputs_are_not_runs(sweep, tmp_path, capsys):
    parent, _ = sweep
    out = parent / "compare"  # the default output directory, inside the parent
    assert main([str(parent), "--last", "10"]) == 0
    assert (out / "compare.json").is_file() and (out / "deviation" / "tensorwise").is_dir()
    capsys.readouterr()
    assert main([str(parent), "--last", "10"]) == 0  # second time: compare/ is not taken for runs
    rows = read_csv(out / "compare.csv")
    assert sorted(rows) == sorted(RECIPES)


def test_errors_list_what_is_available(sweep, tmp_path, capsys):
    parent, _ = sweep
    assert main([str(parent / "fp32"), str(parent / "bf16")]) == 2
    err = capsys.readouterr().err
    assert "no such run directory" in err and all(r in err for r in RECIPES) and "Traceback" not in err

    assert main([str(parent), "--tag", "train/los", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'train/loss'?" in err and "val/loss" in err and "tokens_per_s" in err

    assert main([str(parent), "--baseline", "fp16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "fp16" in err and all(r in err for r in RECIPES)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err

    with pytest.raises(CompareError, match="--last"):
        compare_runs(load_runs([str(parent)]), last=0)


def test_val_loss_and_an_explicit_baseline(sweep, tmp_path):
    parent, _ = sweep
    assert (
        main(
            [
                str(parent),
                "--tag",
                "val/loss",
                "--baseline",
                "blockwise",
                "--last",
                str(STEPS),
                "--out",
                str(tmp_path),
                "--no-png",
                "--no-events",
            ]
        )
        == 0
    )
    rows = read_csv(tmp_path / "compare.csv")
    assert list(rows)[0] == "blockwise" and rows["blockwise"]["baseline"] == "True"
    val = {r: raw_scalars(parent / r, "val/loss") for r in RECIPES}
    assert sorted(val["bf16"]) == [10, 20, 30]
    for r in ("bf16", "tensorwise"):
        dev = [abs(val[r][s] - val["blockwise"][s]) / val["blockwise"][s] for s in (10, 20, 30)]
        assert float(rows[r]["max_rel_dev"]) == pytest.approx(max(dev), rel=1e-9)
        assert math.isclose(float(rows[r]["final_loss"]), np.mean([val[r][s] for s in (10, 20, 30)]), rel_tol=1e-12)


# ---- runs that ended early, damaged event files, bad arguments ------------------------------------
@pytest.fixture(scope="module")
def early_stop(sweep, tmp_path_factory):
    """A 30-step bf16 baseline (the sweep's, copied) beside a blockwise run of the same settings that
    stopped after 4 steps: the case where a gate anchored at the last common step passed."""
    import shutil

    parent, _ = sweep
    root = tmp_path_factory.mktemp("early_stop")
    shutil.copytree(parent / "bf16", root / "llama3_tiny" / "bf16")
    cfg = compose_config(
        [o for o in TINY if not o.startswith("trainer.max_steps")]
        + ["trainer.max_steps=4", "recipe=blockwise", f"run.root={root}"]
    )
    train(cfg)
    return root / "llama3_tiny"


def _gate_lines(err: str):
    """The GATE FAILED line and the indented per-run lines under it."""
    lines = err.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("GATE FAILED"))
    out = [lines[i]]
    for line in lines[i + 1 :]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def test_a_run_that_ended_before_the_baseline_fails_the_gate(early_stop, tmp_path, capsys):
    capsys.readouterr()
    code = main(
        [str(early_stop), "--last", "5", "--max-rel-dev", "0.02", "--out", str(tmp_path), "--no-png", "--no-events"]
    )
    assert code == 1
    io_ = capsys.readouterr()
    gate = "\n".join(_gate_lines(io_.err))
    assert "blockwise" in gate and "ended at step 4, before the baseline's last step 30" in gate
    rows = read_csv(tmp_path / "compare.csv")
    assert rows["blockwise"]["passed"] == "False" and "ended at step 4" in rows["blockwise"]["reasons"]
    assert "Notes:" in io_.out and "ended at step 4" in io_.out
    # the window is the baseline's last 5 steps, which the short run never reached
    assert rows["blockwise"]["gate_rel_dev"] == ""
    # without a gate the table still says why the run is not comparable
    assert main([str(early_stop), "--last", "5", "--out", str(tmp_path), "--no-png", "--no-events"]) == 0
    assert "ended at step 4" in capsys.readouterr().out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return next(dst.glob("events.out.tfevents.*"))


def test_truncated_and_corrupt_event_files_are_reported_not_read_as_shorter(sweep, tmp_path, capsys):
    from nemo_fp8_recipes.compare import check_event_file

    parent, _ = sweep
    root = tmp_path / "runs"
    _copy_run(parent / "bf16", root / "bf16")
    cut = _copy_run(parent / "blockwise", root / "blockwise")
    flip = _copy_run(parent / "tensorwise", root / "tensorwise")
    assert check_event_file(cut) is None and check_event_file(flip) is None
    data = cut.read_bytes()
    for at in range(int(len(data) * 0.6), len(data)):  # cut inside a record (not at a boundary)
        cut.write_bytes(data[:at])
        if check_event_file(cut) is not None:
            break
    raw = bytearray(flip.read_bytes())
    raw[int(len(raw) * 0.5)] ^= 0xFF  # one flipped byte inside a record
    flip.write_bytes(bytes(raw))
    assert "truncated" in check_event_file(cut)
    assert "corrupt" in check_event_file(flip) and "crc32" in check_event_file(flip)

    capsys.readouterr()
    code = main(
        [str(root), "--last", "10", "--max-rel-dev", "0.5", "--out", str(tmp_path / "out"), "--no-png", "--no-events"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "warning: run blockwise" in err and "truncated" in err
    assert "warning: run tensorwise" in err and "corrupt" in err
    rows = read_csv(tmp_path / "out" / "compare.csv")
    for r in ("blockwise", "tensorwise"):
        assert rows[r]["passed"] == "False" and "damaged event file" in rows[r]["reasons"]
    # a damaged baseline fails every run
    good = tmp_path / "runs2"
    _copy_run(parent / "tensorwise", good / "tensorwise")
    bad_base = _copy_run(parent / "bf16", good / "bf16")
    bad_base.write_bytes(bad_base.read_bytes()[:-7])
    assert (
        main(
            [
                str(good),
                "--last",
                "10",
                "--max-rel-dev",
                "0.5",
                "--out",
                str(tmp_path / "o2"),
                "--no-png",
                "--no-events",
            ]
        )
        == 1
    )
    assert (
        "the baseline bf16 has a damaged event file"
        in read_csv(tmp_path / "o2" / "compare.csv")["tensorwise"]["reasons"]
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["--last", "0"], "--last must be >= 1"),
        (["--smooth", "0"], "--smooth must be >= 1"),
        (["--max-rel-dev", "inf"], "--max-rel-dev must be a finite fraction"),
        (["--max-rel-dev", "nan"], "--max-rel-dev must be a finite fraction"),
        (["--max-rel-dev", "2"], "for 2% give --max-rel-dev 0.02"),  # a percentage typed as such
    ],
)
def test_meaningless_numbers_are_refused_not_reinterpreted(sweep, tmp_path, capsys, args, words):
    parent, _ = sweep
    assert main([str(parent), "--out", str(tmp_path), "--no-png", "--no-events", *args]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "compare.csv").exists()


def test_malformed_json_and_an_out_file_are_usage_errors(sweep, tmp_path, capsys):
    parent, _ = sweep
    for text in ("{not json", "[1, 2]", '{"version": 2, "runs": [{"name": "x"}], "settings": {}}', "\xff\xfe"):
        bad = tmp_path / "bad.json"
        bad.write_bytes(text.encode("latin-1"))
        assert main(["--from-json", str(bad)]) == 2, text
        err = capsys.readouterr().err
        assert "nemo-fp8-compare: error:" in err and "Traceback" not in err
    a_file = tmp_path / "out.txt"
    a_file.write_text("keep me")
    assert main([str(parent), "--out", str(a_file)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert a_file.read_text() == "keep me"


def test_out_is_never_a_run_directory(sweep, tmp_path, capsys):
    """--out on a run (or inside one, or on a directory holding another run) is refused before
    anything is written there: the outputs would make later comparisons skip that run."""
    import shutil

    parent, _ = sweep
    runs = tmp_path / "runs"
    shutil.copytree(parent, runs, ignore=shutil.ignore_patterns("compare"))
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    other = tmp_path / "elsewhere" / "bf16"
    shutil.copytree(parent / "bf16", other)
    for out, words in (
        (runs / "bf16", "is the run directory"),
        (runs / "tensorwise" / "cmp", "is inside the run directory"),
        (other, "holds a run (config.yaml, summary.json)"),
    ):
        assert main([str(runs), "--last", "10", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and "give a directory of its own" in err and "Traceback" not in err, err
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == before
    assert main([str(runs), "--last", "10", "--max-rel-dev", "0.5"]) == 0  # every run still found and judged
    assert sorted(read_csv(runs / "compare" / "compare.csv")) == sorted(RECIPES)


def test_runs_in_two_trees_need_an_out(tmp_path):
    """The default output directory is the runs' common parent's compare/, never /compare or a
    home directory's: runs that share nothing below those need --out."""
    from nemo_fp8_recipes.compare.cli import default_out_dir

    assert default_out_dir([str(tmp_path / "r" / "bf16"), str(tmp_path / "r" / "fp8")]) == (tmp_path / "r" / "compare")
    for paths in (["/data/a/bf16", "/scratch/b/fp8"], [str(Path.home() / "a" / "bf16"), str(Path.home() / "fp8")]):
        with pytest.raises(CompareError, match="share no directory of their own.*give --out DIR"):
            default_out_dir(paths)


def test_a_gate_without_its_baseline_fails_and_says_why(sweep, tmp_path, capsys):
    """The BF16 run died before its first log line (no event files): a gate does not pick an FP8
    run as the baseline in its place; without a gate the comparison still runs, against the first."""
    import shutil

    parent, _ = sweep
    runs = tmp_path / "runs"
    shutil.copytree(parent, runs, ignore=shutil.ignore_patterns("compare"))
    for f in (runs / "bf16").glob("events.out.tfevents.*"):
        f.unlink()
    assert main([str(runs), "--last", "10", "--max-rel-dev", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--max-rel-dev needs a baseline, and no run is named bf16" in err and "give --baseline NAME" in err
    assert "tensorwise" in err and "Traceback" not in err
    assert main([str(runs), "--last", "10", "--max-rel-dev", "0.5", "--baseline", "tensorwise"]) == 0
    assert main([str(runs), "--last", "10"]) == 0


def test_the_baseline_can_be_named_by_its_directory(sweep, tmp_path):
    parent, _ = sweep
    for spelling in (str(parent / "tensorwise") + "/", str((parent / "tensorwise").resolve()), "tensorwise"):
        out = tmp_path / str(abs(hash(spelling)))
        assert (
            main([str(parent), "--baseline", spelling, "--last", "10", "--out", str(out), "--no-png", "--no-events"])
            == 0
        )
        assert read_csv(out / "compare.csv")["tensorwise"]["baseline"] == "True"


def test_megatron_bridge_runs_are_read_by_their_lm_loss_tag(sweep, tmp_path, capsys):
    """Megatron-Bridge logs its training loss as 'lm loss' (``training/losses.py``) with
    ``SummaryWriter.add_scalar``; the compare tool finds it without --tag and compares it with a
    nemo-fp8-train run's train/loss."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    parent, results = sweep
    root = tmp_path / "runs"
    shutil.copytree(parent / "bf16", root / "bf16")
    w = SummaryWriter(log_dir=str(root / "tensorwise-bridge"))
    for step, loss in sorted(results["tensorwise"].losses.items()):
        if step % LOG_EVERY == 0:
            w.add_scalar("lm loss", loss * 1.001, step)
            w.add_scalar("lm loss vs samples", loss, step * 2)
    w.close()
    capsys.readouterr()
    assert main([str(root), "--last", "10", "--out", str(tmp_path / "out"), "--no-png", "--no-events"]) == 0
    out = capsys.readouterr().out
    assert "tag `train/loss / lm loss`" in out and "| tensorwise-bridge |" in out
    rows = read_csv(tmp_path / "out" / "compare.csv")
    assert int(rows["tensorwise-bridge"]["aligned_steps"]) == STEPS // LOG_EVERY


def test_nemo2_runs_are_read_by_their_reduced_train_loss_tag(sweep, tmp_path, capsys):
    """NeMo 2's ``llm.pretrain`` logs its training loss as 'reduced_train_loss' (through Lightning
    and NeMoLogger's TensorBoard); the compare tool finds it without --tag."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    parent, results = sweep
    root = tmp_path / "runs"
    shutil.copytree(parent / "bf16", root / "bf16")
    w = SummaryWriter(log_dir=str(root / "tensorwise-nemo2"))
    for step, loss in sorted(results["tensorwise"].losses.items()):
        if step % LOG_EVERY == 0:
            w.add_scalar("reduced_train_loss", loss * 1.002, step)
            w.add_scalar("lr", 1e-3, step)
    w.close()
    capsys.readouterr()
    assert main([str(root), "--last", "10", "--out", str(tmp_path / "out"), "--no-png", "--no-events"]) == 0
    out = capsys.readouterr().out
    assert "tag `train/loss / reduced_train_loss`" in out and "| tensorwise-nemo2 |" in out
    rows = read_csv(tmp_path / "out" / "compare.csv")
    assert int(rows["tensorwise-nemo2"]["aligned_steps"]) == STEPS // LOG_EVERY
    # its notes speak NeMo 2's terms: no seed or determinism option of our trainer to set there
    note = next(line for line in out.splitlines() if line.startswith("- **tensorwise-nemo2**: one seed"))
    assert "without its config.yaml are compared one run per recipe" in note
    note = next(line for line in out.splitlines() if line.startswith("- **tensorwise-nemo2**: not deterministic"))
    assert "unknown for runs without nemo-fp8-train's config.yaml" in note and "removes it" not in note


def test_a_non_finite_loss_is_blamed_on_the_run_that_logged_it():
    """A NaN in the baseline's curve fails the comparison naming the baseline, not the candidate;
    a NaN in the candidate's names the candidate."""
    from nemo_fp8_recipes.compare import RunSeries, compare_runs

    steps = list(range(1, 11))
    good = [3.0 - 0.1 * s for s in steps]
    nan_at_5 = [math.nan if s == 5 else v for s, v in zip(steps, good)]

    def run(name, values):
        return RunSeries(name=name, path=f"/runs/{name}", tag="train/loss", steps=steps, values=values)

    c = compare_runs([run("bf16", nan_at_5), run("tensorwise", good)], last=10, max_rel_dev=0.5)
    [fp8] = [st for st in c.stats if not st.baseline]
    assert not c.passed and any("the baseline bf16 logged a non-finite loss (nan) at step 5" in r for r in fp8.reasons)
    assert not any(r.startswith("this run") for r in fp8.reasons), fp8.reasons
    c = compare_runs([run("bf16", good), run("tensorwise", nan_at_5)], last=10, max_rel_dev=0.5)
    [fp8] = [st for st in c.stats if not st.baseline]
    assert not c.passed and any(r.startswith("this run logged a non-finite loss (nan) at step 5") for r in fp8.reasons)


def test_runs_deeper_than_the_search_are_named_not_ignored(sweep, tmp_path, capsys):
    """A parent whose runs lie deeper than compare looks: the warning names one and the fix."""
    import shutil

    parent, _ = sweep
    deep = tmp_path / "a" / "b" / "c" / "d"
    shutil.copytree(parent / "tensorwise", deep / "tensorwise")
    shutil.copytree(parent / "bf16", tmp_path / "a" / "bf16")
    assert main([str(tmp_path / "a"), "--last", "10", "--no-png", "--no-events"]) == 0
    err = capsys.readouterr().err
    assert "runs more than 3 levels below" in err and str(deep / "tensorwise") in err and "give their directory" in err
    capsys.readouterr()
    assert main([str(tmp_path / "a"), str(deep / "tensorwise"), "--last", "10", "--no-png", "--no-events"]) == 0


def test_until_compares_the_steps_every_run_reached(sweep, tmp_path, capsys):
    """--until S cuts every curve after step S first: the numbers are those of the curves ending
    there (the final loss is the mean of the window before S), the runs are judged as complete."""
    parent, _ = sweep
    until = STEPS // 2
    out = tmp_path / "cmp"
    assert main([str(parent), "--until", str(until), "--last", "4", "--out", str(out), "--max-rel-dev", "1"]) == 0
    data = json.loads((out / "compare.json").read_text())
    for r in data["runs"]:
        assert max(r["steps"]) <= until and max(r["steps"]) > until - 4
    raw = raw_scalars(parent / "bf16", "train/loss")
    window = [v for s, v in raw.items() if until - 4 < s <= until]
    base = next(st for st in data["results"] if st["baseline"])
    assert math.isclose(base["final_loss"], sum(window) / len(window), rel_tol=1e-6)
    assert main([str(parent), "--until", "0"]) == 2 and "--until must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda runs: runs[1].update(name=runs[0]["name"]), "appear more than once"),
        (lambda runs: runs[0].update(name=5), "name is int, not text"),
        (lambda runs: runs[0].update(steps=[s + 0.5 for s in runs[0]["steps"]]), "steps must be a list of whole"),
        (lambda runs: runs[0].update(steps=runs[0]["steps"][::-1]), "steps must increase"),
        (lambda runs: runs[0].update(values=[str(v) for v in runs[0]["values"]]), "values must be a list of numbers"),
        (lambda runs: runs[0].update(seed="one"), "seed has the wrong type"),
        (lambda runs: runs[0].update(tokens_per_s="fast"), "tokens_per_s has the wrong type"),
    ],
)
def test_a_json_export_with_wrong_types_or_duplicate_names_is_refused(sweep, tmp_path, capsys, damage, words):
    parent, _ = sweep
    out = tmp_path / "first"
    assert main([str(parent), "--last", "10", "--out", str(out), "--no-png", "--no-events"]) == 0
    data = json.loads((out / "compare.json").read_text())
    damage(data["runs"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["--from-json", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "damaged nemo-fp8-compare JSON export" in err and words in err and "Traceback" not in err, err


def test_a_fifo_named_like_an_event_file_is_refused_not_read(sweep, tmp_path, capsys):
    """A FIFO (or device) named events.out.tfevents.* would block the reader for ever: it is
    named and refused at once."""
    import os
    import shutil

    parent, _ = sweep
    run = shutil.copytree(parent / "tensorwise", tmp_path / "runs" / "tensorwise")
    shutil.copytree(parent / "bf16", tmp_path / "runs" / "bf16")
    os.mkfifo(run / "events.out.tfevents.999.host.1.0")
    assert main([str(tmp_path / "runs"), "--last", "10", "--no-png", "--no-events"]) == 2
    err = capsys.readouterr().err
    assert "events.out.tfevents.999.host.1.0 is not a regular file" in err and "Traceback" not in err


def test_the_torn_tail_of_a_resumed_runs_first_segment_is_a_note_not_a_failure(sweep, tmp_path, capsys):
    """A run killed while writing leaves its event file with a torn last record; resumed from its
    checkpoint, it re-logs the later steps in a new file. Every step is there: the gate judges it;
    the torn record is a note. A torn tail in the newest file (nothing continues it) still fails."""
    import shutil

    parent, _ = sweep
    root = tmp_path / "runs"
    shutil.copytree(parent / "bf16", root / "llama3_tiny" / "bf16")
    base = [o for o in TINY if o != "trainer.checkpoint=false"]
    common = base + ["recipe=tensorwise", f"run.root={root}", "trainer.ckpt_interval=10", "trainer.ckpt_keep=5"]
    first = train(compose_config(common))
    run_dir = first.run_dir
    (run_dir / "checkpoints" / f"step_{STEPS:08d}.pt").unlink()
    [events] = list(run_dir.glob("events.out.tfevents.*"))
    data = events.read_bytes()
    events.write_bytes(data[:-7])  # the last record torn
    resumed = train(compose_config(common))
    assert resumed.start_step == 20 and resumed.final_step == STEPS
    capsys.readouterr()
    assert main([str(root / "llama3_tiny"), "--last", "10", "--max-rel-dev", "0.5", "--no-png", "--no-events"]) == 0
    err = capsys.readouterr().err
    assert "is truncated after" in err and "an earlier segment" in err and "nothing of the curve is lost" in err
    newest = sorted(run_dir.glob("events.out.tfevents.*"))[-1]
    newest.write_bytes(newest.read_bytes()[:-7])
    assert main([str(root / "llama3_tiny"), "--last", "10", "--max-rel-dev", "0.5", "--no-png", "--no-events"]) == 1


def test_an_unwritable_out_is_one_line_not_a_traceback(sweep, capsys):
    parent, _ = sweep
    if not Path("/proc").is_dir():
        pytest.skip("needs Linux's /proc")
    assert main([str(parent), "--last", "10", "--out", "/proc/nemo_fp8_compare_out"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the outputs to /proc/nemo_fp8_compare_out" in err and "give a writable --out" in err
    assert "Traceback" not in err
