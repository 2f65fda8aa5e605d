"""NeMo Framework integrations: thin adapters, every third-party import lazy.

- :mod:`.te` — the exact Transformer Engine recipe object per registry recipe
  (:func:`~.te.to_te_recipe`, NVTE_* import-order handling) and ``te.autocast``.
- :mod:`.megatron` — Megatron-Core ``TransformerConfig`` FP8 fields and per-module BF16
  overrides (:func:`~.megatron.megatron_config`); the native FP8 swap for local-spec models
  (:func:`~.megatron.convert_megatron_model`).
- :mod:`.bridge` — Megatron-Bridge ``MixedPrecisionConfig`` per recipe and the Llama / DeepSeek-V3
  launcher (``python -m nemo_fp8_recipes.integrations.bridge``).
- :mod:`.nemo2` — NeMo 2.x ``MegatronMixedPrecision`` arguments and Lightning callbacks.
- :mod:`.callbacks` — run-time policy enforcement, audit and telemetry on TE modules.
- :mod:`.validate` — the pre-launch validator (``nemo-fp8-check``).

Importing this package imports neither Transformer Engine, Megatron, Bridge, NeMo nor Hydra.
"""
