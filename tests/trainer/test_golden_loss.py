"""Golden loss curves: every recipe, trained for a few steps on the CPU, reproduces the per-step
losses stored in ``tests/trainer/golden/<recipe>.txt``.

A refactor of the trainer, the model or a recipe's emulation that changes any number shows up
here as the first step whose loss moved. The runs are tiny (one layer, 8 optimizer steps of two
micro-batches each, validation and FP8 telemetry every 4 steps, a checkpoint at the end) on a
fixed corpus (``tests/trainer/golden/corpus.txt``, so the Python version's standard library does not
enter), with one intra-op thread: the CPU kernels' reduction order can depend on the thread count.

Tolerance: exact on the kind of CPU the files were written on. Repeated runs of every recipe in
one process and in separate processes gave bit-identical losses there, so every step must match
the file to the last bit (``REL_TOL = 0``); a change of the peak lr by 3e-7 (relative) already
fails. The files hold ``repr`` floats, which round-trip exactly, and their header names the CPU
(:func:`cpu_signature`: model name and the SIMD level torch dispatches to). On another CPU the
math libraries pick other kernels and the last bits move, which an FP8 cast can turn into a
neighbouring code (measured: files written on one x86 CPU, run on an AMD EPYC with AVX2 and the
same torch, differ by up to 1.1e-4 relative over the 8 steps in delayed, tensorwise and mxfp8,
1.5e-5 in blockwise, 1.1e-7 in bf16), so there the tolerance is ``REL_TOL_OTHER_CPU`` (1e-3
relative), which still fails a change of the schedule, the data order or a recipe's scaling. Regenerate with
``python tests/trainer/golden/regenerate.py`` and review the diff.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from nemo_fp8_recipes.recipes import list_recipes

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
CORPUS = GOLDEN_DIR / "corpus.txt"
RECIPES = ("bf16", "delayed", "tensorwise", "blockwise", "mxfp8")
#: relative tolerance per step on the CPU the files were written on (0: bit-exact; see the module docstring)
REL_TOL = 0.0
#: on another CPU (other SIMD kernels in the math libraries)
REL_TOL_OTHER_CPU = 1e-3
#: the run every golden file records (plus recipe=<key>, run.root and data.cache_dir)
OVERRIDES = [
    "model=llama3_tiny",
    "model.num_layers=1",
    "trainer.device=cpu",
    "trainer.max_steps=8",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.warmup_steps=2",
    "trainer.log_interval=2",
    "trainer.val_interval=4",
    "trainer.val_steps=2",
    "trainer.telemetry_interval=4",
    "trainer.ckpt_interval=0",
    "trainer.resume=never",
    "trainer.progress=false",
    "data=text",
    "data.paths=[tests/trainer/golden/corpus.txt]",
    "data.val_fraction=0.1",
]
REGENERATE = "python tests/trainer/golden/regenerate.py [recipe ...]"


def run_overrides(recipe: str, workdir: Path) -> List[str]:
    """The full override list of the golden run of ``recipe``, writing under ``workdir``."""
    over = [o if not o.startswith("data.paths=") else f"data.paths=[{CORPUS}]" for o in OVERRIDES]
    return [f"recipe={recipe}", *over, f"run.root={workdir / 'runs'}", f"data.cache_dir={workdir / 'tokens'}"]


def run_losses(recipe: str, workdir: Path) -> Dict[int, float]:
    """Train the golden run of ``recipe`` in this process (one intra-op thread) -> ``{step: loss}``."""
    from nemo_fp8_recipes.config import compose_config
    from nemo_fp8_recipes.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(compose_config(run_overrides(recipe, workdir))).losses
    finally:
        torch.set_num_threads(threads)


def golden_path(recipe: str) -> Path:
    return GOLDEN_DIR / f"{recipe}.txt"


def cpu_signature() -> str:
    """The CPU as its kernels see it: the model name (``/proc/cpuinfo``, else ``platform``) and
    the SIMD level torch dispatches to (``torch.backends.cpu.get_cpu_capability()``)."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} / {torch.backends.cpu.get_cpu_capability()}"


def header(recipe: str) -> str:
    """The first lines of a golden file: the overrides and how to regenerate it, then the CPU."""
    return (
        f"# recipe={recipe} {' '.join(OVERRIDES)} (run.root, data.cache_dir: a temporary directory; "
        f"torch.set_num_threads(1); torch {torch.__version__}). Regenerate: {REGENERATE}\n"
        f"# cpu: {cpu_signature()}"
    )


def format_golden(recipe: str, losses: Dict[int, float]) -> str:
    """A golden file's text: the header, then one ``step loss`` line per step (``repr`` floats)."""
    return header(recipe) + "\n" + "".join(f"{s} {losses[s]!r}\n" for s in sorted(losses))


def golden_cpu(path: Path) -> Optional[str]:
    """The CPU a golden file was written on (its ``# cpu:`` line), None if it does not say."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# cpu:"):
            return line.split(":", 1)[1].strip()
    return None


def tolerance_for(path: Path) -> float:
    """``REL_TOL`` on the CPU ``path`` was written on, ``REL_TOL_OTHER_CPU`` elsewhere."""
    return REL_TOL if golden_cpu(path) == cpu_signature() else REL_TOL_OTHER_CPU


def read_golden(path: Path) -> Dict[int, float]:
    """``{step: loss}`` of a golden file (``#`` lines are comments)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            step, loss = line.split()
            out[int(step)] = float(loss)
    return out


def first_mismatch(got: Dict[int, float], want: Dict[int, float], rel_tol: float) -> Optional[str]:
    """None if the curves agree step by step within ``rel_tol``, else the first difference."""
    if sorted(got) != sorted(want):
        return f"steps differ: ran {sorted(got)}, golden has {sorted(want)}"
    for s in sorted(want):
        if not (got[s] == want[s] or math.isclose(got[s], want[s], rel_tol=rel_tol, abs_tol=0.0)):
            return (
                f"step {s}: loss {got[s]!r}, golden {want[s]!r} "
                f"(relative difference {abs(got[s] - want[s]) / abs(want[s]):.3e}, tolerance {rel_tol})"
            )
    return None


def test_every_recipe_has_a_golden_file():
    assert set(RECIPES) == set(list_recipes())
    for recipe in RECIPES:
        assert golden_path(recipe).is_file(), f"no golden file for {recipe}; run {REGENERATE}"
        assert golden_path(recipe).read_text(encoding="utf-8").startswith("# recipe=")


@pytest.mark.parametrize("recipe", RECIPES)
def test_loss_curve_matches_the_golden_file(recipe, tmp_path):
    want = read_golden(golden_path(recipe))
    got = run_losses(recipe, tmp_path)
    tol = tolerance_for(golden_path(recipe))
    problem = first_mismatch(got, want, tol)
    where = "" if tol == REL_TOL else f" (written on {golden_cpu(golden_path(recipe))}, running on {cpu_signature()})"
    assert problem is None, (
        f"{recipe}: {problem}{where}. If the change is intended, run {REGENERATE} and review the diff"
    )


def test_a_changed_loss_is_reported():
    """The comparison fails on a one-ulp change and on a missing step."""
    want = {1: 6.25, 2: 5.5}
    assert first_mismatch(dict(want), want, REL_TOL) is None
    assert "step 2" in first_mismatch({1: 6.25, 2: math.nextafter(5.5, 0.0)}, want, REL_TOL)
    assert "steps differ" in first_mismatch({1: 6.25}, want, REL_TOL)
    # on another CPU: kernel noise passes, a real change (1%) does not
    assert first_mismatch({1: 6.25 * (1 + 2e-4), 2: 5.5}, want, REL_TOL_OTHER_CPU) is None
    assert "step 1" in first_mismatch({1: 6.25 * (1 + 1e-2), 2: 5.5}, want, REL_TOL_OTHER_CPU)


def test_golden_files_name_their_cpu():
    for recipe in RECIPES:
        assert golden_cpu(golden_path(recipe)), f"{golden_path(recipe)} does not name its CPU; run {REGENERATE}"
