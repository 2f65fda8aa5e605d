"""Rewrite the golden loss files ``tests/trainer/golden/<recipe>.txt`` from the current code.

Usage (from the repository root)::

    python tests/trainer/golden/regenerate.py               # every recipe
    python tests/trainer/golden/regenerate.py delayed mxfp8 # only these

Each recipe trains the run defined in ``tests/trainer/test_golden_loss.py`` (``OVERRIDES``) in this
process, with one intra-op thread, in a temporary directory; its per-step losses replace the
file. Review the diff before committing: a golden file changes only when the numbers are meant to.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_golden_loss

from test_golden_loss import RECIPES, format_golden, golden_path, run_losses  # noqa: E402


def main(argv) -> int:
    recipes = list(argv) or list(RECIPES)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        print(f"unknown recipe(s) {', '.join(unknown)}; choose from: {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    for recipe in recipes:
        with tempfile.TemporaryDirectory(prefix=f"golden-{recipe}-") as tmp:
            losses = run_losses(recipe, Path(tmp))
        golden_path(recipe).write_text(format_golden(recipe, losses), encoding="utf-8")
        print(f"{golden_path(recipe)}: {len(losses)} steps, final loss {losses[max(losses)]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
