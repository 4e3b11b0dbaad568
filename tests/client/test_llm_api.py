"""``MegatronAsyncLLM`` in direct mode and in coordinator mode with a fleet it starts itself."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM, SamplingParams
from megatron_serve.client.coordinator_client import StreamPartial
from megatron_serve.wire.request import RequestStatus

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["Hello", "The quick brown fox", "1 2 3 4", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6)
CONFIG = InferenceConfig(num_kv_blocks=64)


@pytest.fixture(scope="module")
def direct_outputs(tiny_model):
    from megatron_serve.api.llm import MegatronLLM

    return [r.generated_tokens for r in MegatronLLM(tiny_model, CONFIG).generate(PROMPTS, GREEDY)]


async def test_direct_mode(tiny_model, direct_outputs):
    async with MegatronAsyncLLM(tiny_model, CONFIG) as llm:
        single = await llm.generate(PROMPTS[0], GREEDY)
        assert single.status is RequestStatus.COMPLETED and single.generated_tokens == direct_outputs[0]
        batch = await llm.generate(PROMPTS, GREEDY)
        assert isinstance(batch, list) and [r.generated_tokens for r in batch] == direct_outputs
        concurrent = await asyncio.gather(*(llm.generate(p, GREEDY) for p in PROMPTS))
        assert [r.generated_tokens for r in concurrent] == direct_outputs
        items = [item async for item in llm.generate_stream(PROMPTS[1], GREEDY)]
        assert all(isinstance(i, StreamPartial) for i in items[:-1])
        assert [t for i in items[:-1] for t in i.new_tokens] == items[-1].generated_tokens == direct_outputs[1]
        for verb in ("pause", "unpause", "suspend", "resume", "shutdown"):
            with pytest.raises(RuntimeError, match="coordinator mode"):
                await getattr(llm, verb)()


async def test_coordinator_mode_starts_and_stops_its_own_fleet(tiny_model, direct_outputs):
    llm = MegatronAsyncLLM(tiny_model, CONFIG, use_coordinator=True, num_engines=2)
    async with llm:
        fleet = llm.client.fleet
        assert fleet is not None and len(fleet.engines) == 2
        status = await llm.status()
        assert len(status["engines"]) == 2 and status["state"] == "RUNNING"
        batch = await llm.generate(PROMPTS, GREEDY)
        assert [r.generated_tokens for r in batch] == direct_outputs
        single = await llm.generate(PROMPTS[2], GREEDY)
        assert single.generated_tokens == direct_outputs[2]
        by_ids = await llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], GREEDY)  # token-id prompts
        assert [r.generated_tokens for r in by_ids] == direct_outputs
        assert [r.prompt_tokens for r in by_ids] == [llm.tokenizer.encode(p) for p in PROMPTS]
        pending = asyncio.ensure_future(llm.generate(PROMPTS, GREEDY))
        ack = await llm.suspend()  # from RUNNING: pauses first, never hangs
        assert ack["state"] == "SUSPENDED" and ack["detail"]["released_bytes"] > 0
        assert (await llm.resume())["state"] == "PAUSED"
        assert (await llm.unpause())["state"] == "RUNNING"
        assert [r.generated_tokens for r in await pending] == direct_outputs
        await llm.shutdown()
        assert all(p.poll() == 0 for p in fleet.engines), [p.poll() for p in fleet.engines]
        assert fleet.coordinator.poll() is not None
    with pytest.raises(RuntimeError):
        await llm.generate(PROMPTS[0], GREEDY)
