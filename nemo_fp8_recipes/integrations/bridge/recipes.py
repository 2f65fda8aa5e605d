"""What Megatron-Bridge publishes and how a launch picks its model: Bridge's Llama 3 pretraining
recipes and the parallel layouts they are written for, our model names' recipe functions, and
``backend.provider``. No Bridge import: the validator and the launcher both read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = [
    "BRIDGE_RECIPES",
    "BridgeLaunchError",
    "PROVIDER_MODES",
    "PUBLISHED_RECIPES",
    "PublishedRecipe",
    "bridge_recipe_name",
    "provider_mode",
]


class BridgeLaunchError(ValueError):
    """A Bridge launch that cannot run as configured; the message says what to change."""


@dataclass(frozen=True)
class PublishedRecipe:
    """A Megatron-Bridge pretraining recipe function and the parallel layout it is written for
    (Megatron-Bridge 0.6.2, ``recipes/llama/h100/llama3.py``)."""

    fn: str
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    virtual_pipeline: Optional[int]
    seq_length: int

    @property
    def gpus(self) -> int:
        """GPUs one model replica needs (TP x PP x CP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


#: Bridge's published Llama 3 pretraining recipes (what ``backend.provider=auto`` uses for them).
PUBLISHED_RECIPES = {
    "llama3_8b": PublishedRecipe("llama3_8b_pretrain_config", 1, 1, 2, None, 8192),
    "llama3_70b": PublishedRecipe("llama3_70b_pretrain_config", 4, 4, 2, 5, 8192),
    "llama31_405b": PublishedRecipe("llama31_405b_pretrain_config", 8, 8, 4, 2, 131072),
}
PROVIDER_MODES = ("auto", "recipe", "ours")

#: Our model name -> Megatron-Bridge pretrain recipe function (``megatron.bridge.recipes``).
BRIDGE_RECIPES = {
    "llama3_8b": "llama3_8b_pretrain_config",
    "llama3_70b": "llama3_70b_pretrain_config",
    "llama31_405b": "llama31_405b_pretrain_config",
    "deepseek_v3": "deepseek_v3_pretrain_config",  # MoE: router policy (moe_router_dtype=fp32)
}


def bridge_recipe_name(model: str, override: Optional[str] = None) -> str:
    """The Bridge recipe function for our ``model=`` name (or ``backend.recipe_fn``)."""
    if override:
        return str(override)
    if model not in BRIDGE_RECIPES:
        raise ValueError(
            f"model={model} has no Megatron-Bridge pretraining recipe; choose one of "
            f"{', '.join(k for k in BRIDGE_RECIPES if k != 'deepseek_v3')}, or name a Bridge recipe function "
            "with backend.recipe_fn=<name> (e.g. backend.recipe_fn=deepseek_v3_pretrain_config for the MoE "
            "router policy)"
        )
    return BRIDGE_RECIPES[model]


def provider_mode(model: str, provider: str = "auto", recipe_fn: Optional[str] = None) -> str:
    """``"recipe"`` (a Bridge recipe function builds the model) or ``"ours"`` (built from our model
    config): ``backend.recipe_fn`` forces ``recipe``; ``auto`` is ``recipe`` for the sizes Bridge
    publishes a recipe for (:data:`PUBLISHED_RECIPES`) and ``ours`` for the rest."""
    provider = str(provider or "auto")
    if provider not in PROVIDER_MODES:
        raise BridgeLaunchError(
            f"backend.provider={provider!r} is not valid; choose one of: {', '.join(PROVIDER_MODES)}"
        )
    if recipe_fn:
        if provider == "ours":
            raise BridgeLaunchError(
                "backend.recipe_fn names a Bridge recipe function, which builds its own model; "
                "with backend.provider=ours leave it unset"
            )
        return "recipe"
    if provider == "auto":
        return "recipe" if model in PUBLISHED_RECIPES else "ours"
    if provider == "recipe" and model not in BRIDGE_RECIPES:
        try:
            bridge_recipe_name(model)
        except ValueError as e:  # lists what exists
            raise BridgeLaunchError(str(e)) from None
    return provider
