"""``MegatronLLM`` with its engine in this process counts kept ids (``return_top_p_token_ids``) in its
``max_request_logprobs`` budget at their most, bounded by its engine's vocabulary: top-p alone on 8 tokens of the tiny
model's vocabulary is refused with a ``ValueError`` naming the budget; with top_k 4, or greedy, the same request is
served, and its kept ids stay within the bound."""

from __future__ import annotations

import pytest

from megatron_serve import MegatronLLM, SamplingParams
from megatron_serve.model.config import ModelConfig

PROMPT = list(range(5, 25))
NUCLEUS = dict(temperature=0.8, top_p=0.9, seed=3, num_tokens_to_generate=8, ignore_eos=True,
               return_top_p_token_ids=True)


def test_megatron_llm_counts_kept_ids_at_its_engines_vocabulary(tiny_llama):
    vocab = ModelConfig.from_dir(tiny_llama).vocab_size
    budget = 8 * vocab - 1  # one short of top-p's bound: 8 tokens x the vocabulary
    llm = MegatronLLM(tiny_llama, max_request_logprobs=budget)
    try:
        with pytest.raises(ValueError, match=rf"budget of {budget:,} per request \(max_request_logprobs\)\. You "
                                             rf"requested up to {8 * vocab:,}: {8 * vocab:,} top-p token ids"):
            llm.generate([PROMPT], SamplingParams(**NUCLEUS))
        (top_k,) = llm.generate([PROMPT], SamplingParams(**NUCLEUS, top_k=4))
        (greedy,) = llm.generate([PROMPT], SamplingParams(**{**NUCLEUS, "temperature": 0.0}))
    finally:
        llm.close()
    kept = top_k.generated_top_p_token_ids
    assert len(kept) == 8 and all(1 <= len(ids) <= 4 for ids in kept)
    assert [ids for ids in greedy.generated_top_p_token_ids] == [[t] for t in greedy.generated_tokens]
