"""``python -m`` / ``torchrun -m nemo_fp8_recipes.integrations.bridge <overrides>``: the launcher."""

import sys

from .cli import main

sys.exit(main())
