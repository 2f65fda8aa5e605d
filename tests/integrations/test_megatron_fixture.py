"""Real (CPU) Megatron-Core GPTModel construction: dense and MoE, local (non-TE) layer spec."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers.megatron_utils import build_tiny_gpt_model, megatron_available, teardown_megatron  # noqa: E402

_OK, _WHY = megatron_available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)

L, H, FFN, HEADS, GROUPS, VOCAB, SEQ, E = 4, 128, 256, 4, 2, 512, 64, 4


@pytest.fixture(scope="module")
def dense_model():
    yield build_tiny_gpt_model()


@pytest.fixture(scope="module")
def moe_model():
    yield build_tiny_gpt_model(moe=True)


@pytest.fixture(scope="module", autouse=True)
def _megatron_state():
    """Model-parallel state is created lazily by the builder; destroy it after this module."""
    yield
    if _OK:
        teardown_megatron()


def _classes(model):
    return {name: type(mod).__name__ for name, mod in model.named_modules()}


def _expected_params(moe: bool) -> int:
    """Closed-form parameter count for the local spec with add_bias_linear=True (the default)."""
    kv = H // HEADS
    ln = 2 * H  # LayerNorm weight + bias
    qkv = H * (HEADS + 2 * GROUPS) * kv + (HEADS + 2 * GROUPS) * kv
    proj = H * H + H
    mlp = (H * FFN + FFN) + (FFN * H + H)
    if moe:
        mlp = E * mlp + (E * H + E)  # E experts + router weight [E, H] and bias [E]
    layer = ln + qkv + proj + ln + mlp
    embedding = VOCAB * H + SEQ * H  # word + learned absolute position embeddings
    output_layer = VOCAB * H  # untied, no bias
    return embedding + L * layer + ln + output_layer


def test_dense_builds_with_expected_tree_and_params(dense_model):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    assert isinstance(dense_model, GPTModel)
    classes = _classes(dense_model)
    assert len(dense_model.decoder.layers) == L
    for i in range(L):
        p = f"decoder.layers.{i}"
        assert classes[p] == "TransformerLayer"
        assert classes[f"{p}.self_attention"] == "SelfAttention"
        assert classes[f"{p}.self_attention.core_attention"] == "DotProductAttention"
        assert classes[f"{p}.self_attention.linear_qkv"] == "ColumnParallelLinear"
        assert classes[f"{p}.self_attention.linear_proj"] == "RowParallelLinear"
        assert classes[f"{p}.mlp"] == "MLP"
        assert classes[f"{p}.mlp.linear_fc1"] == "ColumnParallelLinear"
        assert classes[f"{p}.mlp.linear_fc2"] == "RowParallelLinear"
        assert classes[f"{p}.input_layernorm"] == "LayerNorm"
        assert classes[f"{p}.pre_mlp_layernorm"] == "LayerNorm"
    assert classes["embedding.word_embeddings"] == "VocabParallelEmbedding"
    assert classes["decoder.final_layernorm"] == "LayerNorm"
    assert classes["output_layer"] == "ColumnParallelLinear"
    assert not any("transformer_engine" in type(m).__module__ for m in dense_model.modules())

    n = sum(p.numel() for p in dense_model.parameters())
    assert n > 0 and n == _expected_params(moe=False)
    qkv = dense_model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(qkv, ColumnParallelLinear)
    assert tuple(qkv.weight.shape) == ((HEADS + 2 * GROUPS) * (H // HEADS), H)
    assert isinstance(dense_model.decoder.layers[0].mlp.linear_fc2, RowParallelLinear)
    assert all(p.device.type == "cpu" for p in dense_model.parameters())


def test_moe_builds_with_router_and_experts(moe_model, dense_model):
    classes = _classes(moe_model)
    for i in range(L):
        p = f"decoder.layers.{i}.mlp"
        assert classes[p] == "MoELayer"
        assert classes[f"{p}.router"] == "TopKRouter"
        assert classes[f"{p}.experts"] == "SequentialMLP"
        for e in range(E):
            assert classes[f"{p}.experts.local_experts.{e}"] == "MLP"
            assert classes[f"{p}.experts.local_experts.{e}.linear_fc1"] == "ColumnParallelLinear"
            assert classes[f"{p}.experts.local_experts.{e}.linear_fc2"] == "RowParallelLinear"
    router = moe_model.decoder.layers[0].mlp.router
    assert tuple(router.weight.shape) == (E, H) and router.topk == 2

    n_moe = sum(p.numel() for p in moe_model.parameters())
    n_dense = sum(p.numel() for p in dense_model.parameters())
    assert n_moe == _expected_params(moe=True) > n_dense


def test_rebuild_after_teardown_and_overrides():
    """Several builds per session work, including after the model-parallel state is destroyed."""
    teardown_megatron()
    m = build_tiny_gpt_model(num_layers=2, add_bias_linear=False)
    assert len(m.decoder.layers) == 2
    assert m.decoder.layers[0].self_attention.linear_qkv.bias is None
    a = build_tiny_gpt_model(num_layers=1, seed=7)
    b = build_tiny_gpt_model(num_layers=1, seed=7)
    assert all((x == y).all() for x, y in zip(a.parameters(), b.parameters()))
