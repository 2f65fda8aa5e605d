"""``nemo-fp8-train`` and ``python -m nemo_fp8_recipes.train``: the embedded trainer's public entry
points, :func:`train` (a composed config -> :class:`~nemo_fp8_recipes.trainer.TrainResult`) and
:func:`main` (the command line). They live in :mod:`nemo_fp8_recipes.trainer`; this module is
the path the console script and ``python -m`` keep."""

import sys

from .trainer import main, train  # noqa: F401 - the public path of both

if __name__ == "__main__":
    sys.exit(main())
