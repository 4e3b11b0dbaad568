"""Prompt log probs equal transformers' log-softmax of the prompt logits, however the prompt was computed."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams

from ..prompts import PROMPTS

TOP_N = 3
SCORED = SamplingParams(temperature=0.0, num_tokens_to_generate=4, return_prompt_log_probs=True, top_n_logprobs=TOP_N)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Per prompt: transformers' log probs of prompt tokens 1.. and the top-n at each of those positions."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = MegatronLLM(tiny_llama).engine.tokenizer
    results = []
    for prompt in PROMPTS:
        tokens = tokenizer.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
        log_probs = torch.log_softmax(logits, -1)[:-1]
        chosen = log_probs.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
        results.append((chosen, torch.topk(log_probs, TOP_N)))
    return results


def check(outs, reference) -> None:
    for out, (chosen, top) in zip(outs, reference):
        assert len(out.prompt_log_probs) == len(out.prompt_tokens) - 1
        torch.testing.assert_close(torch.tensor(out.prompt_log_probs), chosen, atol=1e-4, rtol=0)
        assert len(out.prompt_top_n_logprobs) == len(out.prompt_log_probs)
        for position, entry in enumerate(out.prompt_top_n_logprobs):
            assert list(entry) == top.indices[position].tolist()
            torch.testing.assert_close(torch.tensor(list(entry.values())), top.values[position], atol=1e-4, rtol=0)


def test_prompt_log_probs_match_transformers(tiny_llama, reference):
    check(MegatronLLM(tiny_llama).generate(PROMPTS, SCORED), reference)


def test_chunked_prefill_and_preemption_score_every_position_once(tiny_llama, reference):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, num_kv_blocks=24, max_batch_tokens=7))
    check(llm.generate(PROMPTS, SamplingParams(**{**SCORED.to_dict(), "num_tokens_to_generate": 30,
                                                  "ignore_eos": True})), reference)


def test_a_prefix_cache_hit_still_scores_the_whole_prompt(tiny_llama, reference):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, enable_prefix_caching=True))
    plain = SamplingParams(temperature=0.0, num_tokens_to_generate=4)
    llm.generate(PROMPTS, plain)
    assert all(o.cached_tokens > 0 for o in llm.generate(PROMPTS[1:3], plain))  # the cache holds these prompts
    outs = llm.generate(PROMPTS, SCORED)
    assert all(o.cached_tokens == 0 for o in outs)
    check(outs, reference)
    assert llm.generate(PROMPTS[1:3], plain)[0].cached_tokens > 0  # and scoring left the cache usable
