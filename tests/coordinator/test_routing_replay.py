"""Routing replay across a move: a request that leaves a hung engine keeps the routing its tokens were made with.

Real engines on a tiny Qwen3-MoE model behind a real coordinator (in threads, over real sockets).
The first engine hangs mid-generation; the stall timeout moves the request to a second engine,
which must continue from the rows the coordinator mirrored: it receives them with the request,
computes only the positions after them, and the final ``routing_indices`` equal a run on one
engine, with no row missing or repeated.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from megatron_serve import InferenceConfig, MegatronLLM
from megatron_serve.client import InferenceClient, StreamPartial
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.request import EventType, RequestStatus
from megatron_serve.sampling_params import SamplingParams
from megatron_serve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = [12, 40, 7, 99, 250, 31, 8, 77, 64, 5, 18]
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True, return_routing_indices=True)
CONFIG = InferenceConfig(dtype="float32", block_size_tokens=8, num_kv_blocks=16)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), seed=2, arch="qwen3_moe"))


def hang_after(engine: DynamicInferenceEngine, steps: int) -> tuple[threading.Event, threading.Event]:
    """``engine`` blocks in its step after ``steps`` steps until released; (hanging, release) events."""
    hanging, release = threading.Event(), threading.Event()
    step, done = engine.step, [0]

    def step_then_hang():
        if done[0] >= steps:
            hanging.set()
            release.wait()
        done[0] += 1
        return step()

    engine.step = step_then_hang
    return hanging, release


def arrivals(engine: DynamicInferenceEngine) -> list:
    """Every request ``engine`` receives, as (generated tokens, routing rows) at arrival."""
    seen: list = []
    add = engine.add_request

    def record(request):
        seen.append((list(request.generated_tokens), None if request.routing_indices is None
                     else request.routing_indices.copy()))
        add(request)

    engine.add_request = record
    return seen


async def test_moved_request_keeps_its_mirrored_routing(fleet_factory, moe_model):
    expected = MegatronLLM(moe_model, CONFIG).generate([PROMPT], PARAMS)[0]
    fleet = fleet_factory(stall_timeout=1.0)
    first = DynamicInferenceEngine.from_model_dir(moe_model, CONFIG)
    hanging, release = hang_after(first, 8)  # the prompt's step, then seven decode steps
    fleet.add_engine(fake=first, heartbeat_interval=0.1)
    try:
        async with InferenceClient(fleet.address) as client:
            await client.wait_for_engines(1, timeout=20, poll=0.02)
            streamed: list[int] = []

            async def consume():
                async for item in client.add_request_streaming(PROMPT, PARAMS, request_id="moved"):
                    if isinstance(item, StreamPartial):
                        streamed.extend(item.new_tokens)
                    else:
                        return item

            task = asyncio.create_task(consume())
            assert await asyncio.to_thread(hanging.wait, 30), "the first engine never reached its ninth step"
            second = DynamicInferenceEngine.from_model_dir(moe_model, CONFIG)
            received = arrivals(second)
            fleet.add_engine(fake=second, heartbeat_interval=0.1)
            final = await asyncio.wait_for(task, 60)
    finally:
        release.set()

    assert final.status is RequestStatus.COMPLETED and any(e.type is EventType.EVICT for e in final.events)
    assert final.generated_tokens == expected.generated_tokens and streamed == final.generated_tokens
    np.testing.assert_array_equal(final.routing_indices, expected.routing_indices)
    assert final.routing_indices.shape[0] == len(PROMPT) + PARAMS.num_tokens_to_generate - 1
    [(generated_at_move, mirrored)] = received
    assert len(generated_at_move) == 8  # the tokens of the eight steps the first engine ran
    # the rows of every token the first engine processed came along, and the final record starts with them
    assert mirrored.shape[0] == len(PROMPT) + len(generated_at_move) - 1
    np.testing.assert_array_equal(final.routing_indices[: len(mirrored)], mirrored)
