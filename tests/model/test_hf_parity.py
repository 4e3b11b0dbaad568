"""Token-for-token equality with ``transformers`` greedy generation on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..hf_greedy import greedy_choices
from ..prompts import PROMPTS

NEW_TOKENS = 32

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", tie_word_embeddings=True, num_kv_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
}


def hf_greedy(model_dir, token_lists, generated_lists):
    """Reference: transformers' greedy choice and its log prob at each generated position
    (:func:`tests.hf_greedy.greedy_choices`: one forward pass per prompt, not 32 ``generate`` steps)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return greedy_choices(model, token_lists, generated_lists)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, tmp_path):
    model_dir = make_tiny_model(tmp_path / variant, seed=1, **VARIANTS[variant])
    llm = MegatronLLM(str(model_dir), InferenceConfig(dtype="float32", block_size_tokens=16))
    token_lists = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(t) for t in token_lists}) > 4, "prompts must differ in length"
    outs = llm.generate(token_lists, SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS,
                                                    ignore_eos=True, return_log_probs=True))
    expected = hf_greedy(model_dir, token_lists, [out.generated_tokens for out in outs])
    for out, (expected_tokens, expected_log_probs) in zip(outs, expected):
        assert out.generated_tokens == expected_tokens
        assert out.finish_reason.value == "length"
        assert out.generated_log_probs == pytest.approx(expected_log_probs, abs=1e-4)
