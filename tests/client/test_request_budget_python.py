"""The request budget on the Python API's paths: ``MegatronLLM`` and ``MegatronAsyncLLM`` with an engine in this
process refuse a request over ``max_request_logprobs`` with a ``ValueError`` naming the budget and the request's
figure, as a coordinator does (vLLM raises ``ValueError`` for a request it cannot take); and ``megatron-serve run``
gives its ``--max-request-logprobs`` to the coordinator it starts, so that a client of that coordinator is held to
the server's figure, not the coordinator's default.
"""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve import MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.limits import DEFAULT_MAX_REQUEST_LOGPROBS

from ..run_stack import start_run

PROMPT = list(range(5, 25))  # 20 tokens: 19 scored positions
# 19 x (5 + 1) prompt entries + 4 tokens x (5 + 1): 138 log-prob entries
SCORED = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True,
                        return_prompt_log_probs=True, top_n_logprobs=5)
PLAIN = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)  # 0 entries
BUDGET = 100
REFUSAL = r"the request asks for 138 log probs .* budget is 100 per request \(max_request_logprobs\)"


def test_megatron_llm_refuses_a_request_over_its_budget_naming_the_figure(tiny_llama):
    llm = MegatronLLM(tiny_llama, max_request_logprobs=BUDGET)
    try:
        with pytest.raises(ValueError, match=REFUSAL):
            llm.generate([PROMPT], SCORED)
        (within,) = llm.generate([PROMPT], PLAIN)  # the engine goes on serving what is within
        assert len(within.generated_tokens) == 4
    finally:
        llm.close()
    control = MegatronLLM(tiny_llama)  # the default budget: the same request is served
    try:
        (scored,) = control.generate([PROMPT], SCORED)
        assert len(scored.prompt_log_probs) == 19 and 138 <= DEFAULT_MAX_REQUEST_LOGPROBS
    finally:
        control.close()


def test_megatron_async_llm_refuses_it_too_and_checks_the_keyword(tiny_llama):
    async def main() -> None:
        llm = MegatronAsyncLLM(tiny_llama, max_request_logprobs=BUDGET)
        try:
            with pytest.raises(ValueError, match=REFUSAL):
                await llm.generate([PROMPT], SCORED)
            (within,) = await llm.generate([PROMPT], PLAIN)
            assert len(within.generated_tokens) == 4
        finally:
            await llm.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_request_logprobs must be a positive integer, got 0"):
        MegatronAsyncLLM(tiny_llama, max_request_logprobs=0)


def test_run_gives_its_budget_to_the_coordinator_it_starts(tiny_llama, tmp_path):
    stack = start_run(tiny_llama, tmp_path / "run", "--max-request-logprobs", str(BUDGET), engines=1)

    async def main() -> None:
        async with InferenceClient(stack.coordinator(), stack.secret()) as client:
            with pytest.raises(ValueError, match=r"138 log probs .* budget is 100 per request"):
                await client.add_request(PROMPT, SCORED)  # the coordinator's default (1,048,576) would take it
            within = await client.add_request(PROMPT, PLAIN)
            assert len(within.generated_tokens) == 4

    try:
        asyncio.run(main())
    finally:
        stack.kill()
