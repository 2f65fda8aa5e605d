"""The two FLOP counts of a model config: PaLM's (the trainer's MFU) and Megatron's (model
TFLOP/s as Megatron-LM and Megatron-Bridge log them), checked against hand-computed values."""

from __future__ import annotations

from nemo_fp8_recipes.models.config import load_model_config


def test_megatron_flops_per_token_is_bridges_figure_for_llama3_8b():
    """51.47 GFLOP per token at sequence 8192: Bridge's published 744 TFLOP/s/GPU at 14,451
    tokens/s/GPU (H100, FP8 current scaling) is 744e12 / 14451 = 51.48e9."""
    m = load_model_config("llama3_8b")
    f = m.megatron_flops_per_token(8192)
    h, ffn, L, kv, v, s = 4096, 14336, 32, 1024, 128256, 8192
    gemm = L * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * v
    assert f == 6.0 * gemm + 6.0 * L * h * s == 51_470_401_536
    assert abs(744e12 / 14451 - f) / f < 1e-3
    # the attention core is half of PaLM's convention (causal), everything else the same GEMMs
    assert m.flops_per_token(s) - f == 6.0 * L * h * s + 6.0 * (2 * L + 1) * h
    # an 8-layer cut of the width at 4096: 14.43 GFLOP, logits a fifth of it
    assert round(m.replace(num_layers=8).megatron_flops_per_token(4096) / 1e9, 2) == 14.43


def test_megatron_flops_per_token_counts_the_experts_a_token_visits():
    """MoE layers: shared plus ``moe_top_k`` routed experts, no router (Megatron's formula)."""
    m = load_model_config("moe_tiny")
    d, s = m.dim, 256
    per_layer_attn = m._attention_params()
    total = 0
    for i in range(m.num_layers):
        total += per_layer_attn
        if m.is_moe_layer(i):
            total += 3 * d * m.moe_ffn_dim * (m.moe_top_k + m.num_shared_experts)
        else:
            total += 3 * d * m.ffn_dim
    total += m.vocab_size * d
    assert m.megatron_flops_per_token(s) == 6.0 * total + 6.0 * m.num_layers * m.num_heads * m.head_dim * s
