"""A RUNNING fleet notices an engine whose step loop hangs (``stall_timeout``), with fake engines over real sockets.

The engine's heartbeats come from its link thread and report its step loop's iteration counter
(``progress``); an engine with requests whose counter does not move is dropped like one that missed
a verb deadline. Busy-but-slow engines, idle engines and engines that do not report the counter stay.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_serve import cli
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.coordinator import Coordinator
from megatron_serve.engine.process.loop import EngineProcess
from megatron_serve.wire.request import EventType, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

from .fakes import FakeEngine, expected_tokens
from ..helpers import until
from .test_verb_timeout import MOVED_PROMPT, engine_ids, hang_after, hang_mid_request

pytestmark = pytest.mark.timeout(60)

HEARTBEAT = 0.1  # engines heartbeat often, so a small stall timeout has a wide margin


def republish(proc: EngineProcess, progress) -> None:
    """Make ``proc``'s heartbeats report ``progress(proc)`` instead of its loop count (None: leave it out)."""
    publish = proc.shell.publish_stats

    def publish_other(force: bool = False) -> None:
        publish(force)
        stats = {k: v for k, v in proc.link.stats.items() if k != "progress"}
        value = progress(proc)
        proc.link.stats = stats if value is None else {**stats, "progress": value}

    proc.shell.publish_stats = publish_other


async def engines_by_id(client: InferenceClient) -> dict[str, dict]:
    return {e["id"]: e for e in (await client.status())["engines"]}


async def stays(predicate, seconds: float, what: str) -> None:
    """``predicate`` holds at every poll for ``seconds`` (a bounded window: nothing may go wrong in it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert await predicate(), what
        await asyncio.sleep(0.05)


async def test_engine_that_hangs_while_running_is_dropped_and_its_request_moves(fleet_factory):
    fleet = fleet_factory(stall_timeout=1.0)
    hung_proc, hung_fake, _ = fleet.add_engine(heartbeat_interval=HEARTBEAT)
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        prompt, streamed = MOVED_PROMPT, []
        hung_id, task = await hang_mid_request(client, hung_fake, streamed)
        hung_at = time.monotonic()
        fleet.add_engine(heartbeat_interval=HEARTBEAT)

        final = await asyncio.wait_for(task, 20)
        assert time.monotonic() - hung_at >= 1.0  # not before the stall timeout
        assert final.status is RequestStatus.COMPLETED
        assert final.generated_tokens == expected_tokens(prompt, 20)
        assert streamed == final.generated_tokens  # every token exactly once across the move
        [evict] = [e for e in final.events if e.type is EventType.EVICT]
        assert hung_id in evict.detail and "made no progress" in evict.detail
        engines = await engines_by_id(client)
        assert hung_id not in engines and [e["completed"] for e in engines.values()] == [1]
        assert hung_proc.link.session == 1  # its heartbeats were answered, it was not let back in

        hung_fake.thaw()  # its step loop answers again: it registers anew and drops its stale work
        await until(lambda: _count_engines(client, 2), 10, "the recovered engine registered again")
        status = await client.status()
        assert status["completed"] == 1 and status["in_flight"] == 0 and status["queued"] == 0


async def _count_engines(client: InferenceClient, n: int) -> bool:
    return len(await engine_ids(client)) == n


async def test_slow_engine_is_kept(fleet_factory):
    fleet = fleet_factory(stall_timeout=2.0)
    fleet.add_engine(heartbeat_interval=HEARTBEAT, step_delay=1.0)  # each step takes half the stall timeout
    async with fleet.connected(1) as client:
        ids = await engine_ids(client)
        prompt = [1, 2, 3]
        result = await asyncio.wait_for(client.add_request(prompt, SamplingParams(num_tokens_to_generate=4)), 30)
        assert result.generated_tokens == expected_tokens(prompt, 4)
        assert not any(e.type is EventType.EVICT for e in result.events)
        assert await engine_ids(client) == ids


async def test_idle_engine_is_kept_and_its_clock_starts_with_work(fleet_factory):
    """An engine whose counter moves only when it steps (its loop may block while idle) is never dropped
    for idling, nor as soon as it gets work after a long idle time."""
    fleet = fleet_factory(stall_timeout=1.0)
    proc, _, _ = fleet.add_engine(heartbeat_interval=HEARTBEAT, step_delay=0.05)
    republish(proc, lambda p: p.shell.steps)
    async with fleet.connected(1) as client:
        [engine_id] = await engine_ids(client)

        async def reports_progress() -> bool:
            return (await engines_by_id(client)).get(engine_id, {}).get("progress") == 0

        await until(reports_progress, 10, "the coordinator sees the engine's (idle) step count")
        await stays(reports_progress, 3.0, "the idle engine stayed, its counter still")
        prompt = [3, 1, 4]
        result = await asyncio.wait_for(client.add_request(prompt, SamplingParams(num_tokens_to_generate=10)), 20)
        assert result.generated_tokens == expected_tokens(prompt, 10)
        assert not any(e.type is EventType.EVICT for e in result.events)
        assert await engine_ids(client) == [engine_id]


async def test_engine_without_progress_in_its_heartbeats_is_never_taken_for_stalled(fleet_factory):
    fleet = fleet_factory(stall_timeout=1.0)
    proc, fake, _ = fleet.add_engine(heartbeat_interval=HEARTBEAT)
    republish(proc, lambda p: None)  # an older engine
    hanging = hang_after(fake, 3)
    async with fleet.connected(1) as client:
        [engine_id] = await engine_ids(client)
        prompt = [2, 7, 1]
        future = client.add_request(prompt, SamplingParams(num_tokens_to_generate=10))
        assert await asyncio.to_thread(hanging.wait, 10), "the engine never reached its fourth step"

        async def kept() -> bool:
            engine = (await engines_by_id(client)).get(engine_id)
            return engine is not None and engine["progress"] is None and engine["assigned"] == 1

        await stays(kept, 3.0, "the engine that does not report progress kept its request")
        fake.thaw()
        result = await asyncio.wait_for(future, 20)
        assert result.generated_tokens == expected_tokens(prompt, 10)
        assert not any(e.type is EventType.EVICT for e in result.events)


class SlowLoadingEngine(FakeEngine):
    """Loads the fleet's weights when it registers, until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = threading.Event()
        self.release = threading.Event()

    def refit(self, source: str, epoch: int) -> dict:
        self.loading.set()
        self.release.wait(30)
        self.epoch = epoch
        return {"epoch": epoch, "verify_s": 0.0, "load_s": 0.0, "total_s": 0.0}


async def test_engine_loading_weights_while_registering_is_not_taken_for_stalled(fleet_factory):
    """A restarted coordinator makes a registering engine load the fleet's weights first (minutes, for a
    big model) while requests are already assigned to it: its heartbeats carry no progress meanwhile."""
    fleet = fleet_factory(stall_timeout=1.0)
    fake = SlowLoadingEngine()
    fleet.add_engine(heartbeat_interval=HEARTBEAT, fake=fake)
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        await until(lambda: _reports_progress(client), 10, "the engine's step loop counts")
    fleet.stop_coordinator()

    def with_refitted_weights(coordinator: Coordinator) -> None:
        coordinator.core.weights.epoch, coordinator.core.weights.source = 1, "/weights/epoch-1"

    fleet.start_coordinator(setup=with_refitted_weights)
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        prompt = [9, 9, 1]
        future = client.add_request(prompt, SamplingParams(num_tokens_to_generate=5))
        assert await asyncio.to_thread(fake.loading.wait, 10), "the engine never started loading"
        [engine_id] = [e["id"] for e in (await client.wait_for_engines(1, timeout=20, poll=0.02))["engines"]]

        async def loading_with_work() -> bool:
            engine = (await engines_by_id(client)).get(engine_id)
            return engine is not None and engine["assigned"] == 1

        await until(loading_with_work, 10, "the request was assigned to the loading engine")
        await stays(loading_with_work, 3.0, "the loading engine kept its request")
        fake.release.set()
        result = await asyncio.wait_for(future, 20)
        assert result.generated_tokens == expected_tokens(prompt, 5)
        assert not any(e.type is EventType.EVICT for e in result.events)
        assert await engine_ids(client) == [engine_id]


async def _reports_progress(client: InferenceClient) -> bool:
    return [e["progress"] is not None for e in (await client.status())["engines"]] == [True]


def test_stall_timeout_flag_must_be_positive(capsys):
    assert cli.main(["coordinator", "--model", "unused", "--stall-timeout", "0"]) == 1
    assert "--stall-timeout must be > 0" in capsys.readouterr().err
