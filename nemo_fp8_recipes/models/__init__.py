"""Models for the embedded trainer: Llama 3 (dense) and a small DeepSeek-V3-style MoE.

>>> from nemo_fp8_recipes.models import build_model, load_model_config
>>> model = build_model(load_model_config("llama3_tiny"))

Sizes come from the packaged Hydra configs (``configs/model/<name>.yaml``); any field can be
overridden (``load_model_config("llama31_405b", num_layers=2)``).
"""

from __future__ import annotations

from typing import Union

import torch

from .config import MODEL_CONFIG_DIR, ModelConfig, list_model_configs, load_model_config
from .llama import (
    ModelOutput,
    MoE,
    OutlierGain,
    RMSNorm,
    Transformer,
    TransformerBlock,
)

__all__ = [
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "TransformerBlock",
    "MoE",
    "OutlierGain",
    "RMSNorm",
    "build_model",
    "load_model_config",
    "list_model_configs",
    "MODEL_CONFIG_DIR",
]


def build_model(
    cfg: Union[ModelConfig, str], device: Union[str, torch.device, None] = None, **overrides
) -> Transformer:
    """Build a :class:`Transformer` from a config (or a packaged config name) on ``device``.

    ``device="meta"`` builds the shapes without allocating memory (for parameter counts and
    planning). FP32 parameters everywhere else: they are the master weights.
    """
    if isinstance(cfg, str):
        cfg = load_model_config(cfg, **overrides)
    elif overrides:
        cfg = cfg.replace(**overrides)
    if device is None:
        return Transformer(cfg)
    with torch.device(device):
        return Transformer(cfg)
