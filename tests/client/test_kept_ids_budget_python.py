"""``MegatronLLM`` with its engine in this process counts kept ids (``return_top_p_token_ids``) in its
``max_request_logprobs`` budget: up front where their most is known (top_k per new token), as the engine produces
them for top-p alone. Top-p alone on 8 tokens under a budget one short of 8 x the vocabulary (refused when the
vocabulary per token was counted up front) is served; the same request under a budget one short of the ids it really
keeps ends as a coordinator ends it (FAILED, ``finish_reason`` ``length``, its tokens so far, the error naming the
budget and the figures; a ``ValueError`` before, which a server answered as ``invalid_request``), and the next request
is served; top_k past the budget is refused before any work."""

from __future__ import annotations

import pytest

from megatron_serve import MegatronLLM, SamplingParams
from megatron_serve.model.config import ModelConfig
from megatron_serve.wire.request import FinishReason, RequestStatus

PROMPT = list(range(5, 25))
NUCLEUS = dict(temperature=1.5, top_p=0.99, seed=3, num_tokens_to_generate=8, ignore_eos=True,
               return_top_p_token_ids=True)


def test_megatron_llm_serves_top_p_alone_and_counts_its_kept_ids_as_produced(tiny_llama):
    vocab = ModelConfig.from_dir(tiny_llama).vocab_size
    llm = MegatronLLM(tiny_llama, max_request_logprobs=8 * vocab - 1)
    try:
        (served,) = llm.generate([PROMPT], SamplingParams(**NUCLEUS))
    finally:
        llm.close()
    kept = sum(map(len, served.generated_top_p_token_ids))
    assert len(served.generated_tokens) == 8 and kept > 8  # real sets, more than one id per token

    budget = kept - 1
    llm = MegatronLLM(tiny_llama, max_request_logprobs=budget)
    try:
        (ended,) = llm.generate([PROMPT], SamplingParams(**NUCLEUS))  # the same seed: the same sets, one id past
        (greedy,) = llm.generate([PROMPT], SamplingParams(**{**NUCLEUS, "temperature": 0.0}))
        with pytest.raises(ValueError, match=rf"budget of {budget:,} per request \(max_request_logprobs\)\. You "
                                             rf"requested up to {8 * vocab:,}: {8 * vocab:,} top-p token ids"):
            llm.generate([PROMPT], SamplingParams(**NUCLEUS, top_k=vocab))  # refused before any work
    finally:
        llm.close()
    assert [ids for ids in greedy.generated_top_p_token_ids] == [[t] for t in greedy.generated_tokens]
    assert (ended.status, ended.finish_reason) == (RequestStatus.FAILED, FinishReason.LENGTH)
    assert f"budget of {budget:,} per request (max_request_logprobs). The request produced {kept:,} top-p token ids " \
           "in 8 new tokens" in ended.error
    assert ended.generated_tokens == served.generated_tokens  # its tokens, up to the step that passed the budget
