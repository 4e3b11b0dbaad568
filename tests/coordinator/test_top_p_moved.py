"""A request that asks for its kept ids (``return_top_p_token_ids``, slime's top-p replay) and moves to another engine
mid-generation keeps the ids its first engine sent: the final record's ids, one list per token, equal a run on one
engine. Real engines on a tiny model behind a real coordinator (in threads, over real sockets); the first hangs and the
stall timeout moves the request, as in ``test_routing_replay``."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve import InferenceConfig, MegatronLLM
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.wire.request import EventType, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .test_routing_replay import hang_after

pytestmark = pytest.mark.timeout(300)

PROMPT = [12, 40, 7, 99, 250, 31, 8, 77, 64, 5, 18]
PARAMS = SamplingParams(temperature=0.8, top_p=0.7, seed=5, num_tokens_to_generate=16, ignore_eos=True,
                        return_top_p_token_ids=True, return_log_probs=True)
CONFIG = InferenceConfig(dtype="float32", block_size_tokens=8, num_kv_blocks=16)


async def test_a_moved_request_keeps_the_kept_ids_its_first_engine_sent(fleet_factory, tiny_model):
    with MegatronLLM(tiny_model, CONFIG) as llm:
        expected = llm.generate([PROMPT], PARAMS)[0]
    assert len(expected.generated_top_p_token_ids) == PARAMS.num_tokens_to_generate
    fleet = fleet_factory(stall_timeout=1.0)
    first = DynamicInferenceEngine.from_model_dir(tiny_model, CONFIG)
    hanging, release = hang_after(first, 8)
    fleet.add_engine(fake=first, heartbeat_interval=0.1)
    try:
        async with fleet.connected(1) as client:
            task = client.add_request(PROMPT, PARAMS, request_id="moved")
            assert await asyncio.to_thread(hanging.wait, 30), "the first engine never reached its ninth step"
            fleet.add_engine(fake=DynamicInferenceEngine.from_model_dir(tiny_model, CONFIG), heartbeat_interval=0.1)
            final = await asyncio.wait_for(task, 60)
    finally:
        release.set()
    assert final.status is RequestStatus.COMPLETED and any(e.type is EventType.EVICT for e in final.events)
    assert final.generated_tokens == expected.generated_tokens
    assert final.generated_top_p_token_ids == expected.generated_top_p_token_ids
    assert all(token in kept for token, kept in zip(final.generated_tokens, final.generated_top_p_token_ids))
