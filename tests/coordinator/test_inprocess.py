"""Coordinator, engine process and client against each other over real sockets, with fake engines.

Fast checks of the state machine, routing, streaming, aborts, tokens and reconnects; the same
paths with real engine processes and a real model are in ``test_fleet.py`` and ``test_faults.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve.client.coordinator_client import ControlError, InferenceClient, StreamPartial, Unauthorized
from megatron_serve.wire.security import make_secret
from megatron_serve.wire.request import FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .fakes import BLOCK_BYTES, expected_tokens
from ..helpers import stream_into, until

pytestmark = pytest.mark.timeout(120)


def prompts(n: int, offset: int = 0) -> list[list[int]]:
    return [[1 + ((i + offset) % 50), 2, 3 + i + offset] for i in range(n)]


async def wait_engines(client: InferenceClient, n: int, timeout: float = 20.0) -> dict:
    return await client.wait_for_engines(n, timeout=timeout, poll=0.02)


async def test_requests_routed_to_both_engines_and_complete(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine()
    fleet.add_engine()
    async with fleet.connected(2) as client:
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=5)
        ps = prompts(40)
        results = await asyncio.gather(*(client.add_request(p, params) for p in ps))
        for p, r in zip(ps, results):
            assert r.status is RequestStatus.COMPLETED
            assert r.generated_tokens == expected_tokens(p, 5)
        served = [fake.steps for _proc, fake, _t, _r in fleet.engines]
        assert all(s > 0 for s in served), served
        status = await client.status()
        assert status["completed"] == 40 and status["in_flight"] == 0 and status["queued"] == 0
        assert {e["group"] for e in status["engines"]} == {0, 1}


async def test_round_robin_alternates(fleet_factory):
    fleet = fleet_factory(routing="round_robin")
    fleet.add_engine()
    fleet.add_engine()
    async with fleet.connected(2) as client:
        await client.pause()  # queue everything, then release at once: dispatch order is the policy's
        futures = [client.add_request(p, SamplingParams(num_tokens_to_generate=50)) for p in prompts(10)]
        await until(lambda: _queued(client, 10), 10, "10 queued")
        await client.unpause()
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        status = await client.status()
        assert [e["completed"] for e in status["engines"]] == [5, 5]


async def _queued(client, n):
    return (await client.status())["queued"] == n


async def test_lifecycle_state_machine(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine(kv_blocks=16)
    fleet.add_engine(kv_blocks=32)
    async with fleet.connected(2) as client:
        ack = await client.pause()
        assert ack["state"] == "PAUSED" and not ack["detail"]["noop"]
        assert len(ack["detail"]["engines"]) == 2
        assert all(f["state"] == "PAUSED" for f in ack["detail"]["engines"].values())
        again = await client.pause()
        assert again["state"] == "PAUSED" and again["detail"]["noop"]

        ack = await client.suspend()
        assert ack["state"] == "SUSPENDED"
        released = sorted(f["released_bytes"] for f in ack["detail"]["engines"].values())
        assert released == [16 * BLOCK_BYTES, 32 * BLOCK_BYTES]
        assert ack["detail"]["released_bytes"] == 48 * BLOCK_BYTES
        again = await client.suspend()
        assert again["detail"]["noop"] and again["detail"]["released_bytes"] == 0
        with pytest.raises(ControlError, match="RESUME first"):
            await client.unpause()
        assert (await client.pause())["state"] == "SUSPENDED"  # already not stepping

        assert (await client.resume())["state"] == "PAUSED"
        assert (await client.resume())["detail"]["noop"]
        assert (await client.unpause())["state"] == "RUNNING"
        assert (await client.unpause())["detail"]["noop"]
        assert (await client.resume())["state"] == "RUNNING"  # memory already resident: no-op

        ack = await client.suspend()  # from RUNNING: pauses first
        assert ack["state"] == "SUSPENDED" and ack["detail"]["previous_state"] == "RUNNING"
        assert ack["detail"]["released_bytes"] == 48 * BLOCK_BYTES
        await client.resume()
        await client.unpause()
        status = await client.status()
        assert status["state"] == "RUNNING"
        assert [e["state"] for e in status["engines"]] == ["RUNNING", "RUNNING"]


async def test_requests_held_while_paused_or_suspended(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine()
    async with fleet.connected(1) as client:
        params = SamplingParams(num_tokens_to_generate=4)
        await client.pause()
        held = [client.add_request(p, params) for p in prompts(10)]
        await client.suspend()
        held += [client.add_request(p, params) for p in prompts(10, offset=10)]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in held)
        status = await client.status()
        assert status["queued"] == 20 and status["state"] == "SUSPENDED"
        await client.resume()
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in held)
        await client.unpause()
        results = await asyncio.wait_for(asyncio.gather(*held), 10)
        assert all(r.status is RequestStatus.COMPLETED for r in results)


async def test_running_requests_survive_suspend(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine(step_delay=0.01)
    async with fleet.connected(1) as client:
        ps = prompts(6)
        futures = [client.add_request(p, SamplingParams(num_tokens_to_generate=60)) for p in ps]
        await until(lambda: _in_flight(client, 6), 10, "in flight")
        await client.suspend()
        await client.resume()
        await client.unpause()
        results = await asyncio.wait_for(asyncio.gather(*futures), 20)
        assert [r.generated_tokens for r in results] == [expected_tokens(p, 60) for p in ps]


async def _in_flight(client, n):
    return (await client.status())["in_flight"] == n


async def test_new_engine_adopts_state_and_stopped_fleet_restarts(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine()
    async with fleet.connected(1) as client:
        await client.suspend()
        fleet.add_engine()
        status = await wait_engines(client, 2)
        await until(lambda: _engine_states(client, ["SUSPENDED", "SUSPENDED"]), 10, "adopted SUSPENDED")
        ack = await client.stop()
        assert ack["state"] == "STOPPED" and len(ack["detail"]["engines"]) == 2
        await until(lambda: _engine_count(client, 0), 10, "engines gone")
        # the coordinator sees a connection close before its engine's thread has returned (a loaded machine)
        await until(lambda: not any(t.is_alive() for _p, _f, t, _r in fleet.engines), 10, "engine threads ended")
        assert all(r["rc"] == 0 for _p, _f, _t, r in fleet.engines)
        with pytest.raises(ControlError):
            await client.pause()
        future = client.add_request(prompts(1)[0], SamplingParams(num_tokens_to_generate=3))
        fleet.add_engine()
        await wait_engines(client, 1)
        await until(lambda: _engine_states(client, ["PAUSED"]), 10, "waits paused")
        await asyncio.sleep(0.2)
        assert not future.done()
        assert (await client.unpause())["state"] == "RUNNING"
        result = await asyncio.wait_for(future, 10)
        assert result.status is RequestStatus.COMPLETED
        del status


async def _engine_states(client, states):
    return sorted(e["state"] for e in (await client.status())["engines"]) == states


async def _engine_count(client, n):
    return len((await client.status())["engines"]) == n


async def test_streaming_abort_and_invalid_requests(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine(step_delay=0.005)
    async with fleet.connected(1) as client:
        prompt = [5, 6, 7]
        items = [item async for item in client.add_request_streaming(prompt, SamplingParams(num_tokens_to_generate=12))]
        partials, final = items[:-1], items[-1]
        assert all(isinstance(p, StreamPartial) for p in partials)
        assert [t for p in partials for t in p.new_tokens] == final.generated_tokens == expected_tokens(prompt, 12)

        future = client.add_request(prompt, SamplingParams(num_tokens_to_generate=100_000), request_id="long")
        await until(lambda: _in_flight(client, 1), 10, "running")
        client.abort("long")
        aborted = await asyncio.wait_for(future, 10)
        assert aborted.finish_reason is FinishReason.ABORT and aborted.request_id == "long"

        with pytest.raises(ValueError, match="top_p"):
            await client.add_request(prompt, {"top_p": 7.0})
        with pytest.raises(ValueError, match="no tokenizer"):
            await client.add_request("text needs a tokenizer", SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await client.add_request([], SamplingParams())

        # leaving a stream early aborts the request
        async for _item in client.add_request_streaming(prompt, SamplingParams(num_tokens_to_generate=100_000)):
            break
        await until(lambda: _in_flight(client, 0), 10, "early-exit stream aborted")
        status = await client.status()  # aborts are counted as such, not as failures
        assert (status["completed"], status["aborted"], status["failed"]) == (1, 2, 0)


async def test_fleet_secret_required(fleet_factory):
    fleet = fleet_factory()
    # A refusal comes as fast as an acceptance; the timeout only bounds a hang (5 s failed under load ~15).
    with pytest.raises(Unauthorized, match="refused an unencrypted connection"):
        await InferenceClient(fleet.address).start(timeout=60)
    with pytest.raises(Unauthorized, match="refused the encrypted handshake"):
        await InferenceClient(fleet.address, token=make_secret()).start(timeout=60)
    with pytest.raises(ValueError, match="at least 32 random"):
        InferenceClient(fleet.address, token="s3cret")
    _proc, _fake, result = fleet.add_engine(token=make_secret())
    fleet.add_engine()
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        status = await wait_engines(client, 1)
        assert len(status["engines"]) == 1
        r = await client.add_request([1, 2], SamplingParams(num_tokens_to_generate=2))
        assert r.status is RequestStatus.COMPLETED
    fleet.engines[0][2].join(10)
    assert result["rc"] == 1


async def test_engine_silent_is_removed_and_work_moves(fleet_factory):
    fleet = fleet_factory(heartbeat_timeout=1.0)
    slow_proc, slow_fake, _ = fleet.add_engine(step_delay=0.02, max_requests=4)
    async with fleet.connected(1) as client:
        ps = prompts(8)
        futures = [client.add_request(p, SamplingParams(num_tokens_to_generate=40), request_id=f"r{i}")
                   for i, p in enumerate(ps)]
        await until(lambda: _in_flight(client, 8), 10, "in flight")
        # Freeze the engine: no steps, no heartbeats (as if the host hung), then add a healthy one.
        slow_proc.link.heartbeat_interval = 3600
        slow_fake.freeze()
        await asyncio.sleep(0.1)
        fleet.add_engine()
        results = await asyncio.wait_for(asyncio.gather(*futures), 20)
        assert [r.generated_tokens for r in results] == [expected_tokens(p, 40) for p in ps]
        assert any(e.type.value == "EVICT" for r in results for e in r.events)
        # Thawed, the old engine finds itself unknown, registers again and drops its stale work.
        slow_proc.link.heartbeat_interval = 1.0
        slow_fake.thaw()
        await until(lambda: _engine_count(client, 2), 10, "the thawed engine re-registered")
        await until(lambda: _fake_idle(slow_fake), 10, "stale work dropped")
        status = await client.status()
        assert status["completed"] == 8 and status["in_flight"] == 0


async def _fake_idle(fake):
    return not fake.requests


async def test_client_and_engine_rejoin_restarted_coordinator(fleet_factory):
    fleet = fleet_factory()
    fleet.add_engine(step_delay=0.01)
    client = InferenceClient(fleet.address, token=fleet.token, coordinator_timeout=2.0)
    await client.start()
    try:
        await wait_engines(client, 1)
        first = client.coordinator_id
        ps = prompts(5)
        streamed: list[list[int]] = [[] for _ in ps]

        params = SamplingParams(num_tokens_to_generate=80)
        tasks = [asyncio.create_task(stream_into(client, p, params, streamed[i])) for i, p in enumerate(ps)]
        await until(lambda: _in_flight(client, 5), 10, "in flight")
        await asyncio.sleep(0.1)
        fleet.stop_coordinator()
        await asyncio.sleep(0.5)
        fleet.start_coordinator()  # same port, new coordinator id, empty tables
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert client.coordinator_id != first
        for i, (p, r) in enumerate(zip(ps, results)):
            assert r.generated_tokens == expected_tokens(p, 80)
            assert streamed[i] == r.generated_tokens  # every token exactly once across the restart
        status = await client.status()
        assert len(status["engines"]) == 1
        more = await client.add_request([9, 9], SamplingParams(num_tokens_to_generate=3))
        assert more.status is RequestStatus.COMPLETED
    finally:
        client.close()


async def test_a_pause_mode_is_refused_before_sending_to_a_coordinator_without_pause_modes(fleet_factory, monkeypatch):
    from megatron_serve.coordinator import handshake

    monkeypatch.setattr(handshake, "PROTOCOL_VERSION", 2)  # a coordinator from before pause modes
    fleet = fleet_factory()
    fleet.add_engine()
    async with fleet.connected(1) as client:
        with pytest.raises(ControlError, match="protocol 2, which has no pause modes") as info:
            await client.pause("abort")
        assert info.value.code == "unsupported" and (await client.status())["state"] == "RUNNING"
        assert (await client.pause())["state"] == "PAUSED"  # keep needs no mode on the wire


async def test_a_control_id_used_for_a_pause_is_refused_for_an_unpause_and_the_fleet_does_not_stay_paused(
        fleet_factory, monkeypatch):
    """Over real sockets: the UNPAUSE that reused a PAUSE's control id is refused naming it (it was answered
    with the PAUSE's acknowledgement and never ran), and one with an id of its own runs."""
    import uuid

    from megatron_serve.client import coordinator_client as client_module

    fleet = fleet_factory()
    fleet.add_engine()
    async with fleet.connected(1) as client:
        reused = uuid.uuid4()
        monkeypatch.setattr(client_module.uuid, "uuid4", lambda: reused)
        assert (await client.pause())["state"] == "PAUSED"
        with pytest.raises(ControlError, match=f"control id '{reused.hex}' was already used for PAUSE") as info:
            await client.unpause()
        assert info.value.code == "control_id_reused" and (await client.status())["state"] == "PAUSED"
        monkeypatch.undo()
        assert (await client.unpause())["state"] == "RUNNING"
