"""vLLM's streaming ``AsyncLLM.generate`` on ``MegatronAsyncLLM``, and ``sleep``/``wake_up`` on a fleet.

``generate`` stays awaitable (the records, as every existing caller reads them) and is also
async-iterable (vLLM's ``RequestOutput`` stream). ``LLM.sleep(level)`` / ``wake_up(tags)`` are
the fleet's SUSPEND and RESUME (then UNPAUSE), under vLLM's names (issue 41).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_serve import LLM, InferenceConfig, MegatronAsyncLLM, MegatronLLM, RequestOutput, SamplingParams
from megatron_serve.errors import NoFleet

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
CONFIG = InferenceConfig(num_kv_blocks=64)


async def test_generate_iterated_yields_growing_request_outputs(tiny_model):
    async with MegatronAsyncLLM(tiny_model, CONFIG) as llm:
        awaited = await llm.generate("Hello", GREEDY)
        outs = [out async for out in llm.generate("Hello", GREEDY, "req-1")]
        assert all(isinstance(out, RequestOutput) and out.request_id == "req-1" for out in outs)
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True] and len(outs) > 1
        final = outs[-1].outputs[0]
        assert final.token_ids == awaited.generated_tokens and final.text == awaited.generated_text
        assert final.finish_reason == "length" and outs[0].outputs[0].finish_reason is None
        for out in outs:  # cumulative, as vLLM's default output kind
            assert out.outputs[0].token_ids == final.token_ids[: len(out.outputs[0].token_ids)]
            assert out.prompt_token_ids == awaited.prompt_tokens and out.prompt == "Hello"

        scored = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
        steps = [out.outputs[0] async for out in llm.generate("Hello", scored, "req-lp")]
        whole = steps[-1]
        assert whole.cumulative_logprob == sum(whole.request.generated_log_probs) and len(whole.logprobs) == 6
        for step in steps[:-1]:  # each piece's entries made once, the same as the final record's
            count = len(step.token_ids)
            assert step.logprobs == whole.logprobs[:count]
            assert step.cumulative_logprob == sum(whole.request.generated_log_probs[:count])

        sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5)
        flat = await llm.generate("Hello", sampled)
        grouped = [out async for out in llm.generate({"prompt_token_ids": awaited.prompt_tokens}, sampled, "req-2")]
        last = grouped[-1]
        assert last.finished and [o.index for o in last.outputs] == [0, 1]
        assert [o.token_ids for o in last.outputs] == [r.generated_tokens for r in flat]
        assert [o.request.request_id for o in last.outputs] == ["0_req-2", "1_req-2"]  # vLLM's child ids

        with pytest.raises(ValueError, match="runs one prompt"):
            [out async for out in llm.generate(["Hello", "Hi"], GREEDY)]
        with pytest.raises(ValueError, match="request_id names the request of an iterated generate"):
            await llm.generate("Hello", GREEDY, "req-3")

        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async for _ in llm.generate("Hello", long, "req-4"):
            break  # leaving early aborts the request
        deadline = time.monotonic() + 30
        while (await llm.status())["aborted"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = await llm.status()
        assert status["aborted"] == 1 and status["engines"][0]["running"] == 0


def test_sleep_and_wake_up_are_the_fleets_suspend_and_resume(tiny_model):
    with LLM(tiny_model, enable_sleep_mode=True, num_gpu_blocks_override=64) as llm:
        assert llm.engine is None  # a local fleet: coordinator mode
        before = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        slept = llm.sleep(level=1)
        assert slept["state"] == "SUSPENDED" and slept["detail"]["released_bytes"] > 0
        assert llm.wake_up(tags=["weights"])["state"] == "PAUSED"  # room for a refit before anything runs
        assert llm.wake_up(tags=["kv_cache"])["state"] == "RUNNING"
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
        assert llm.sleep(2)["state"] == "SUSPENDED"
        assert llm.wake_up()["state"] == "RUNNING"
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
        with pytest.raises(ValueError, match="unknown tag.*'gpu'"):
            llm.wake_up(tags=["gpu"])


def test_sleep_and_wake_up_without_a_fleet_say_what_is_needed(tiny_model):
    """Each names the method the user called and, on ``LLM``, vLLM's keyword (wake_up() named resume(), which the
    user did not call, and coordinator mode, which ``LLM`` does not take)."""
    with LLM(tiny_model, num_gpu_blocks_override=64) as llm:
        with pytest.raises(NoFleet, match="^sleep\\(\\) needs a fleet.*build the LLM with enable_sleep_mode=True"):
            llm.sleep()
        with pytest.raises(NoFleet, match="^wake_up\\(\\) needs a fleet.*build the LLM with enable_sleep_mode=True"):
            llm.wake_up()
    with MegatronLLM(tiny_model, inference_config=InferenceConfig(num_kv_blocks=64)) as llm:
        with pytest.raises(NoFleet, match="^wake_up\\(\\) needs coordinator mode \\(use_coordinator=True\\)"):
            llm.wake_up()
