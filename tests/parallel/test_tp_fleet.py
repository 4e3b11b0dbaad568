"""Two tensor-parallel engine groups (TP=2, gloo) behind one coordinator, with real processes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from megatron_serve.client.coordinator_client import InferenceClient, StreamPartial
from megatron_serve.config import InferenceConfig
from megatron_serve.api.llm import MegatronLLM
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..helpers import Children, free_port, rank_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# twice the two groups' 16 slots: a queue behind them, and most of every request's tokens still to come at the kill
PROMPTS = [f"Tensor parallel request {i}: the quick brown fox" for i in range(32)]
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tp-fleet"), seed=5))


async def test_two_tp2_groups_serve_and_survive_the_loss_of_a_rank(model, tmp_path):
    direct = {p: r.generated_tokens for p, r in
              zip(PROMPTS, MegatronLLM(model, InferenceConfig(num_kv_blocks=64)).generate(PROMPTS, PARAMS))}
    children = Children(tmp_path)
    port = free_port()
    try:
        children.coordinator(model, port, "--heartbeat-timeout", "5")
        engines = [children.engine(model, port, "--tensor-parallel", "2", "--max-requests", "8") for _ in range(2)]
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret)
        await client.start(timeout=60)
        await client.wait_for_engines(2, timeout=300)
        streamed = {p: [] for p in PROMPTS}

        async def one(prompt):
            async for item in client.add_request_streaming(prompt, PARAMS, request_id=prompt):
                if isinstance(item, StreamPartial):
                    streamed[prompt].extend(item.new_tokens)
                else:
                    return item

        tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
        deadline = asyncio.get_running_loop().time() + 120
        while sum(map(len, streamed.values())) < 100:  # both groups are busy generating
            assert asyncio.get_running_loop().time() < deadline, "no tokens flowed"
            await asyncio.sleep(0.05)
        followers = rank_processes(engines[0].pid)
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 400)
        assert all(r.status is RequestStatus.COMPLETED for r in results)
        for prompt, result in zip(PROMPTS, results):
            assert result.generated_tokens == direct[prompt], prompt
            assert streamed[prompt] == result.generated_tokens, prompt  # each token delivered exactly once
        assert any(e.type.value == "EVICT" for r in results for e in r.events), "the broken group's work moved"
        assert engines[0].wait(timeout=60) != 0  # the broken group left
        status = await client.status()
        assert len(status["engines"]) == 1 and status["in_flight"] == 0
        client.close()
    finally:
        children.kill_all()
