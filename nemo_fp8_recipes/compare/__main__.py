"""``python -m nemo_fp8_recipes.compare``: the same as ``nemo-fp8-compare``."""

import sys

from .cli import main

sys.exit(main())
