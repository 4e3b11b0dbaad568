"""Scoring equals generation, through the official ``openai`` client: a completion scored again (``/v1/completions``
with ``echo``, ``max_tokens`` 0 and ``logprobs``; ``prompt_logprobs``) gets the log probs its tokens were reported
with when they were generated; and ``--verify-logprobs-fraction`` makes the engine check that by itself, counted
on ``/metrics``.

A ``MegatronAsyncLLM`` in direct mode on the tiny random model behind the app (``conftest.surface``), one request
at a time. Bitwise (``==``) in the batch-invariant mode, in bfloat16 and float32. In float32 the default mode's
decode (one row) and prefill (all rows) reduce in another order, so the two agree to about 5e-7, not in every bit
(the engine tests show the check counting those differences); in bfloat16 the default mode attends as
``transformers`` does, with torch's fused kernel, whose sums depend on the key count (a prefill row sees the chunk's
keys, masked), so there too only the batch-invariant mode promises every bit.
"""

from __future__ import annotations

import openai
import pytest
import torch

from megatron_serve import InferenceConfig

from ..helpers import until
from .conftest import surface

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PROMPT = "Scoring a rollout again must give the log probs it was sampled with"


async def generate_then_score(client: openai.AsyncOpenAI, prompt_ids: list[int]
                              ) -> tuple[list[int], list[float], list[float], list[float]]:
    """(the tokens, log probs reported while generating them, the same tokens scored with echo + max_tokens 0,
    with prompt_logprobs) of one sampled completion of 16 tokens."""
    rollout = await client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=1.0,
                                              seed=7, logprobs=0, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True})
    completion = rollout.choices[0].token_ids
    reported = rollout.choices[0].logprobs.token_logprobs
    sequence = prompt_ids + completion
    echoed = await client.completions.create(model=MODEL, prompt=sequence, max_tokens=0, echo=True, logprobs=0,
                                             extra_body={"return_token_ids": True})
    choice = echoed.choices[0]
    assert choice.token_ids == [] and echoed.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.prompt_token_ids == sequence and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(sequence)
    by_echo = choice.logprobs.token_logprobs[len(prompt_ids):]
    scored = await client.completions.create(model=MODEL, prompt=sequence, max_tokens=0,
                                             extra_body={"prompt_logprobs": 0})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    by_prompt_logprobs = [entries[len(prompt_ids) + i][str(t)]["logprob"] for i, t in enumerate(completion)]
    assert scored.choices[0].text == "" and scored.choices[0].logprobs is None
    return completion, reported, by_echo, by_prompt_logprobs


async def test_scoring_a_completion_gives_its_reported_log_probs_bitwise_in_bfloat16(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer, dtype="bfloat16", batch_invariant=True) as (client, _):
        completion, reported, by_echo, by_prompt_logprobs = await generate_then_score(client, tokenizer.encode(PROMPT))
        assert reported == by_echo == by_prompt_logprobs
        # control: the same tokens after another prompt score otherwise (the comparison can fail)
        other = tokenizer.encode("Another start")
        elsewhere = await client.completions.create(model=MODEL, prompt=other + completion, max_tokens=0, echo=True,
                                                    logprobs=0)
        assert elsewhere.choices[0].logprobs.token_logprobs[len(other):] != reported


async def test_scoring_in_float32_agrees_to_the_last_bits_without_the_batch_invariant_mode(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer, dtype="float32") as (client, _):
        _, reported, by_echo, by_prompt_logprobs = await generate_then_score(client, tokenizer.encode(PROMPT))
    assert by_echo == by_prompt_logprobs  # the same scoring path, whatever the shape of the answer
    torch.testing.assert_close(torch.tensor(by_echo, dtype=torch.float64), torch.tensor(reported, dtype=torch.float64),
                               atol=1e-5, rtol=0)


@pytest.mark.skipif("batch_invariant" not in InferenceConfig.__dataclass_fields__,
                    reason="needs the batch-invariant mode (InferenceConfig.batch_invariant)")
async def test_scoring_and_the_runtime_check_are_bitwise_in_float32_in_the_batch_invariant_mode(tiny_model, tokenizer):
    """The control is the float32 test above and the engine's float32 check without the mode: they differ."""
    async with surface(tiny_model, tokenizer, dtype="float32", batch_invariant=True,
                       verify_logprobs_fraction=1.0) as (client, http):
        _, reported, by_echo, by_prompt_logprobs = await generate_then_score(client, tokenizer.encode(PROMPT))
        assert reported == by_echo == by_prompt_logprobs
        await checked_without_mismatch(http, 1)


async def test_max_tokens_zero_is_a_scoring_request_only(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer) as (client, _):
        for extra in ({}, {"stream": True, "echo": True}):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, **extra)
            assert refused.value.body["param"] == "max_tokens"
        echoed = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
        assert echoed.choices[0].text == PROMPT and echoed.usage.completion_tokens == 0


async def metric_sum(http, name: str) -> float:
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def checked_without_mismatch(http, count: int) -> float:
    """Waits until the engine's runtime check has taken ``count`` requests or more (each check runs after its
    answer was sent), asserts that none differed, and returns how many it checked."""
    async def checked() -> float:
        done = await metric_sum(http, "megatron_serve_logprob_parity_checked_total")
        return done if done >= count else 0

    checked_count = await until(checked, 60, f"the engine to check {count} request(s)", interval=0.05)
    assert await metric_sum(http, "megatron_serve_logprob_parity_mismatch_total") == 0
    return checked_count


async def test_verify_logprobs_fraction_checks_every_request_and_counts_on_metrics(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer, dtype="bfloat16", verify_logprobs_fraction=1.0) as (client, http):
        for seed in range(3):  # one at a time; each check runs after its answer was sent
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                                            logprobs=0, extra_body={"ignore_eos": True})
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)  # no log probs: nothing to check
        assert await checked_without_mismatch(http, 3) == 3
