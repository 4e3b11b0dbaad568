"""Reading the experts of ``config.json``: which layers are sparse, and what is refused."""

from __future__ import annotations

import pytest

from megatron_serve.model.config import ModelConfig, UnsupportedModelError

BASE = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def config(architecture: str, **raw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [architecture], **raw})


def test_qwen_sparse_layers_follow_step_and_dense_list():
    moe = config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 decoder_sparse_step=2, mlp_only_layers=[3]).moe
    assert moe.sparse_layers == (1, 5)  # (i + 1) % 2 == 0, minus layer 3
    assert not moe.norm_topk_prob and moe.shared_expert_intermediate_size == 0


def test_transformers_5_name_of_the_expert_count_and_the_shared_expert():
    moe = config("Qwen2MoeForCausalLM", num_local_experts=6, num_experts_per_tok=1, moe_intermediate_size=16,
                 shared_expert_intermediate_size=48, norm_topk_prob=True).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.shared_expert_intermediate_size) == (6, 1, True, 48)
    assert config("Qwen2MoeForCausalLM", num_experts=6, moe_intermediate_size=16).qkv_bias


def test_mixtral_experts_are_every_layer_and_its_mlp_width():
    moe = config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2).moe
    assert moe.sparse_layers == tuple(range(6)) and moe.expert_intermediate_size == 64 and moe.norm_topk_prob


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5 must be between 1 and the number of "
                                                    "experts \\(4\\)"):
        config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=5)


def test_dense_families_have_no_experts():
    assert config("LlamaForCausalLM").moe is None
