"""The per-step acknowledgement deadline of lifecycle verbs, with fake engines over real sockets.

An engine whose step loop hangs keeps heartbeating from its link thread, so the heartbeat timeout
never removes it; without a deadline a verb would wait for its acknowledgement forever.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_serve import cli
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.request import DynamicInferenceRequest, EventType, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .fakes import FakeEngine, expected_tokens
from ..helpers import stream_into, until

pytestmark = pytest.mark.timeout(60)


def hang_after(fake: FakeEngine, steps: int) -> threading.Event:
    """Make ``fake`` hang in the step after its ``steps``-th; the event is set just before it blocks."""
    hanging = threading.Event()
    step = fake.step

    def step_then_hang():
        if fake.steps >= steps and not hanging.is_set():
            fake.freeze()
            hanging.set()
        return step()

    fake.step = step_then_hang
    return hanging


async def consume(client: InferenceClient, prompt: list[int], request_id: str,
                  streamed: list[int]) -> DynamicInferenceRequest:
    """Stream a 20-token request, collecting its tokens in ``streamed``; the final request."""
    return await stream_into(client, prompt, SamplingParams(num_tokens_to_generate=20), streamed,
                             request_id=request_id)


#: The prompt of the request :func:`hang_mid_request` starts.
MOVED_PROMPT = [4, 5, 6]


async def hang_mid_request(client: InferenceClient, fake: FakeEngine,
                           streamed: list[int]) -> tuple[str, asyncio.Task[DynamicInferenceRequest]]:
    """Start request ``moved`` (:data:`MOVED_PROMPT`, 20 tokens, streamed into ``streamed``) on the fleet's one
    engine, ``fake``'s, and return once that engine hangs in its fourth step: the engine's id and the request's
    task (which completes once the request moved to a healthy engine)."""
    hanging = hang_after(fake, 3)
    [engine_id] = [e["id"] for e in (await client.wait_for_engines(1, timeout=20, poll=0.02))["engines"]]
    task = asyncio.create_task(consume(client, MOVED_PROMPT, "moved", streamed))
    assert await asyncio.to_thread(hanging.wait, 10), "the engine never reached its fourth step"
    return engine_id, task


async def engine_ids(client: InferenceClient) -> list[str]:
    return sorted(e["id"] for e in (await client.status())["engines"])


async def test_engine_that_never_acks_is_dropped_and_its_request_moves(fleet_factory):
    fleet = fleet_factory(verb_timeout=1.0)
    hung_proc, hung_fake, _ = fleet.add_engine()
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        prompt, streamed = MOVED_PROMPT, []
        hung_id, task = await hang_mid_request(client, hung_fake, streamed)
        hung_proc.link.heartbeat_interval = 0.05  # its link thread lives on: heartbeats keep coming, often
        fleet.add_engine()
        await client.wait_for_engines(2, timeout=20, poll=0.02)
        [healthy_id] = [i for i in await engine_ids(client) if i != hung_id]

        started = time.monotonic()
        ack = await client.pause(timeout=10)
        assert time.monotonic() - started >= 1.0
        assert ack["state"] == "PAUSED"
        assert ack["detail"]["unresponsive"] == [hung_id]
        assert "did not acknowledge PAUSE" in ack["detail"]["engines"][hung_id]["lost"]
        assert ack["detail"]["engines"][healthy_id]["state"] == "PAUSED"
        status = await client.status()
        assert [e["id"] for e in status["engines"]] == [healthy_id]
        assert status["queued"] == 1 and status["in_flight"] == 0  # re-queued, held while paused

        ack = await client.unpause(timeout=10)
        assert "unresponsive" not in ack["detail"] and list(ack["detail"]["engines"]) == [healthy_id]
        final = await asyncio.wait_for(task, 10)
        assert final.status is RequestStatus.COMPLETED
        assert final.generated_tokens == expected_tokens(prompt, 20)
        assert streamed == final.generated_tokens  # every token exactly once across the move
        assert any(e.type is EventType.EVICT for e in final.events)
        status = await client.status()
        assert [(e["id"], e["completed"]) for e in status["engines"]] == [(healthy_id, 1)]
        assert hung_proc.link.session == 1  # its heartbeats were answered, it was not let back in

        # Its step loop answers again: it is told to register anew and drops its stale work.
        hung_fake.thaw()
        await until(lambda: _count_engines(client, 2), 10, "the recovered engine registered again")
        await until(lambda: _idle(hung_fake), 10, "stale work dropped")
        status = await client.status()
        assert status["completed"] == 1 and status["in_flight"] == 0 and status["queued"] == 0
        assert hung_id not in [e["id"] for e in status["engines"]]


async def _count_engines(client: InferenceClient, n: int) -> bool:
    return len(await engine_ids(client)) == n


async def _idle(fake: FakeEngine) -> bool:
    return not fake.requests


async def test_engines_that_ack_in_time_are_kept(fleet_factory):
    fleet = fleet_factory(verb_timeout=2.0)
    fleet.add_engine(step_delay=0.01)
    fleet.add_engine(step_delay=0.01)
    async with fleet.connected(2) as client:
        ids = await engine_ids(client)
        prompts = [[1 + i, 2, 3] for i in range(6)]
        futures = [client.add_request(p, SamplingParams(num_tokens_to_generate=40)) for p in prompts]
        acks = [await client.suspend(), await client.resume(), await client.unpause(), await client.pause(),
                await client.unpause()]
        for ack in acks:
            assert "unresponsive" not in ack["detail"]
            assert not any("lost" in facts for facts in ack["detail"]["engines"].values())
        assert acks[0]["state"] == "SUSPENDED" and acks[-1]["state"] == "RUNNING"
        results = await asyncio.wait_for(asyncio.gather(*futures), 20)
        assert [r.generated_tokens for r in results] == [expected_tokens(p, 40) for p in prompts]
        assert not any(e.type is EventType.EVICT for r in results for e in r.events)
        assert await engine_ids(client) == ids


async def test_stop_deadline_includes_the_drain_time(fleet_factory):
    fleet = fleet_factory(verb_timeout=1.0)
    fleet.add_engine(step_delay=0.01)
    async with fleet.connected(1) as client:
        future = client.add_request([7, 8, 9], SamplingParams(num_tokens_to_generate=100_000))
        await until(lambda: _in_flight(client, 1), 10, "in flight")
        started = time.monotonic()
        ack = await client.stop(timeout=10, drain_timeout=2.0)  # the engine drains for 2 s, then acks
        assert time.monotonic() - started >= 2.0
        assert ack["state"] == "STOPPED" and "unresponsive" not in ack["detail"]
        [facts] = ack["detail"]["engines"].values()
        assert facts["handed_back"] == 1 and "lost" not in facts
        future.cancel()  # re-queued on a stopped fleet: it would wait for a restart


async def test_steps_that_move_weights_get_the_weights_deadline(fleet_factory):
    fleet = fleet_factory(verb_timeout=0.5, weights_timeout=10.0)
    _, fake, _ = fleet.add_engine()
    resume = fake.resume

    def slow_resume():  # weights coming back from host memory, graphs being captured
        time.sleep(1.5)
        resume()

    fake.resume = slow_resume
    async with fleet.connected(1) as client:
        engines = await engine_ids(client)
        await client.suspend(timeout=10)
        ack = await client.resume(timeout=10)
        assert ack["state"] == "PAUSED" and "unresponsive" not in ack["detail"]
        assert await engine_ids(client) == engines


async def _in_flight(client: InferenceClient, n: int) -> bool:
    return (await client.status())["in_flight"] == n


@pytest.mark.parametrize("flag", ["--verb-timeout", "--weights-timeout"])
def test_deadline_flags_must_be_positive(capsys, flag):
    assert cli.main(["coordinator", "--model", "unused", flag, "0"]) == 1
    assert f"{flag} must be > 0" in capsys.readouterr().err
