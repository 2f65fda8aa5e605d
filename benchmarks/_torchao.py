"""torchao's float8 training: the PyTorch-native peer the benchmarks measure against (docs/performance.md).

torchao is optional and imported only inside these functions, never at module import, so every
benchmark runs without it and reports its rows as ``skipped: torchao not installed``. One
conversion for every benchmark: ``Float8LinearConfig.from_recipe_name(name)`` and
``convert_to_float8_training(model, config=..., module_filter_fn=...)`` — torchao's own recipes,
unchanged except ``emulate=True`` for the CPU smoke runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch.nn as nn

#: torchao recipe names measured by the benchmarks (``Float8LinearConfig.from_recipe_name``)
RECIPES = ("tensorwise", "rowwise")
NOT_INSTALLED = "skipped: torchao not installed"


def torchao_status() -> Tuple[Optional[str], str]:
    """``(version, "")`` when ``torchao.float8`` imports, else ``(None, reason)`` — the reason is
    the row status the benchmarks print in place of a measurement."""
    try:
        import torchao
        import torchao.float8  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "torchao":
            return None, NOT_INSTALLED
        return None, f"skipped: torchao failed to import ({e})"
    except Exception as e:  # noqa: BLE001 - a broken install must not end the benchmark
        return None, f"skipped: torchao failed to import ({type(e).__name__}: {e})"
    return getattr(torchao, "__version__", "unknown"), ""


def convert_torchao(
    model: nn.Module, recipe: str, module_filter_fn: Callable[[nn.Module, str], bool], emulate: bool = False
) -> nn.Module:
    """Convert ``model``'s linears chosen by ``module_filter_fn(module, fqn)`` to torchao
    ``Float8Linear`` with torchao's ``recipe`` (``tensorwise`` or ``rowwise``); in place,
    returns the model. ``emulate=True``: torchao's emulated FP8 GEMMs (CPU smoke runs)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown torchao recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
