"""A coordinator that goes away while requests are in flight, over real sockets with fake engines.

Back within the client's grace period (after the client found it silent), every request goes on
and finishes with all its tokens, each delivered once; gone for longer, each request in flight
ends with ``CoordinatorLost`` naming the cause, and so does new work, until a coordinator answers
again. Before, the requests waited for as long as their callers did: 41 of 43 HTTP streams got no
byte and no error for 90 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from megatron_serve.client.coordinator_client import CoordinatorLost, InferenceClient
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from ..coordinator.fakes import expected_tokens
from ..helpers import stream_into, until

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1 + i, 2, 3 + i] for i in range(6)]
LONG = SamplingParams(num_tokens_to_generate=400)


@contextlib.asynccontextmanager
async def work_in_flight(fleet, grace: float) -> AsyncIterator[tuple[InferenceClient, list[asyncio.Task],
                                                                     list[list[int]], asyncio.Future]]:
    """A client (0.5 s coordinator timeout) of a one-engine fleet with 6 streams under way and one whole request;
    the client closed after."""
    fleet.add_engine(step_delay=0.01)
    client = InferenceClient(fleet.address, fleet.token, coordinator_timeout=0.5, coordinator_grace=grace)
    try:
        await client.start()
        await client.wait_for_engines(1, timeout=20, poll=0.02)
        tasks, streamed = await start_streams(client)
        yield client, tasks, streamed, client.add_request([7, 7, 7], LONG)
    finally:
        client.close()


async def start_streams(client: InferenceClient) -> tuple[list[asyncio.Task], list[list[int]]]:
    streamed: list[list[int]] = [[] for _ in PROMPTS]

    tasks = [asyncio.create_task(stream_into(client, p, LONG, streamed[i])) for i, p in enumerate(PROMPTS)]
    await until(lambda: all(streamed), 20, "every stream under way")
    return tasks, streamed


async def test_a_coordinator_back_within_the_grace_period_gets_every_request_again(fleet_factory):
    fleet = fleet_factory()
    async with work_in_flight(fleet, grace=20.0) as (client, tasks, streamed, whole):
        fleet.stop_coordinator()
        await until(lambda: client._connection.lost_since is not None, 10, "the client to find it lost")
        fleet.start_coordinator()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for prompt, tokens, result in zip(PROMPTS, streamed, results):
            assert result.status is RequestStatus.COMPLETED
            assert result.generated_tokens == expected_tokens(prompt, 400) == tokens  # each token once
        assert (await asyncio.wait_for(whole, 60)).generated_tokens == expected_tokens([7, 7, 7], 400)


async def test_a_coordinator_gone_past_the_grace_period_ends_what_is_in_flight_with_its_cause(fleet_factory):
    fleet = fleet_factory()
    async with work_in_flight(fleet, grace=1.0) as (client, tasks, _, whole):
        fleet.stop_coordinator()
        began = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, whole, return_exceptions=True), 30)
        took = time.monotonic() - began
        assert all(isinstance(o, CoordinatorLost) for o in outcomes), outcomes
        assert outcomes[0].code == "coordinator_lost" and f"lost the coordinator at {fleet.address}" in str(outcomes[0])
        assert took < 15, took  # the timeout and the grace, not the callers' patience
        with pytest.raises(CoordinatorLost):
            client.add_request([1, 2], LONG)  # new work is refused at once while it is gone
        with pytest.raises(CoordinatorLost):
            await client.pause()
        fleet.start_coordinator()
        await client.wait_for_engines(1, timeout=30, poll=0.05)  # a coordinator answers: work is taken again
        again = await asyncio.wait_for(client.add_request([1, 2], SamplingParams(num_tokens_to_generate=3)), 30)
        assert again.generated_tokens == expected_tokens([1, 2], 3)
