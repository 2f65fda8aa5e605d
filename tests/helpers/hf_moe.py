"""Tiny Hugging Face MoE models built offline from their configs (no download), and a few training
steps: a Mixtral (top-2 of 4 experts in both layers) and a DeepSeek-V3 (a dense first layer, then
shared + routed experts under its grouped top-k router, multi-latent attention). Every GEMM dim is
a multiple of 128, so every recipe puts every projection in FP8. The same builders run under
transformers 5 (experts as one module with 3-D weights) and 4.x (experts as ``nn.Linear``)."""

import torch

VOCAB, EXPERTS, TOP_K = 256, 4, 2


def transformers_major() -> int:
    """The major version of the installed transformers."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def tiny_mixtral(seed: int = 0):
    """A two-layer ``MixtralForCausalLM``, both layers MoE (``EXPERTS`` experts, top-``TOP_K``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
    )
    return MixtralForCausalLM(cfg)


def tiny_deepseek_v3(seed: int = 0):
    """A two-layer ``DeepseekV3ForCausalLM``: layer 0 dense, layer 1 MoE with one shared expert
    and 8 routed experts (top-2 from 1 of 2 expert groups, sigmoid scores with the correction
    bias: DeepSeek-V3's router), multi-latent attention with low-rank q and kv."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=TOP_K,
        n_group=2,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=128,
        v_head_dim=64,
        max_position_embeddings=64,
    )
    return DeepseekV3ForCausalLM(cfg)


HF_MOE_MODELS = {"mixtral": tiny_mixtral, "deepseek_v3": tiny_deepseek_v3}


def train_hf(model, steps: int):
    """``steps`` AdamW steps of causal-LM loss on one fixed random batch (2 x 32 tokens); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
