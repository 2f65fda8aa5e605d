"""Megatron-Bridge with our recipes: the ``mixed_precision`` mapping (:mod:`.precision`), Bridge's
published Llama / DeepSeek recipes (:mod:`.recipes`), the offline provider, ``ConfigContainer``
and ``pretrain()`` launch (:mod:`.launch`), and the launcher's command line (:mod:`.cli`;
``python -m`` / ``torchrun -m nemo_fp8_recipes.integrations.bridge``). Importing it needs neither
Bridge nor a GPU."""

from .cli import main
from .launch import (
    build_bridge_config,
    check_world_size,
    launch_plan,
    provider_kwargs,
    trainer_settings,
)
from .precision import (
    bridge_mixed_precision_config,
    bridge_mixed_precision_kwargs,
    bridge_model_fields,
    expected_model_fields,
)
from .recipes import (
    BRIDGE_RECIPES,
    PERF_SETTINGS,
    PROVIDER_MODES,
    PUBLISHED_RECIPES,
    BridgeLaunchError,
    PerfSettings,
    PublishedRecipe,
    bridge_recipe_name,
    perf_settings,
    provider_mode,
)

__all__ = [
    "BRIDGE_RECIPES",
    "PERF_SETTINGS",
    "PROVIDER_MODES",
    "PUBLISHED_RECIPES",
    "BridgeLaunchError",
    "PerfSettings",
    "PublishedRecipe",
    "bridge_mixed_precision_config",
    "bridge_mixed_precision_kwargs",
    "bridge_model_fields",
    "bridge_recipe_name",
    "build_bridge_config",
    "check_world_size",
    "expected_model_fields",
    "launch_plan",
    "main",
    "perf_settings",
    "provider_kwargs",
    "provider_mode",
    "trainer_settings",
]
