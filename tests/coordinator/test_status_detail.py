"""STATUS_DETAIL through a real coordinator and engine processes over sockets (fake engines, fast): every engine says
what it holds at that moment, through the lifecycle's one verb path (``control("status_detail")``), and the fleet's
state stays whatever it was."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve.client.coordinator_client import ControlError
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import until
from .fakes import FakeEngine
from .test_lora_verbs import add

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0.0, num_tokens_to_generate=10_000, ignore_eos=True)


async def test_every_engine_says_what_it_holds_now_and_the_fleet_keeps_its_state(fleet_factory):
    fleet = fleet_factory()
    fakes = [add(fleet, FakeEngine(max_requests=2, step_delay=0.01)) for _ in range(2)]
    async with fleet.connected(2) as client:
        flights = [asyncio.ensure_future(client.add_request([7, i, 3], LONG)) for i in range(5)]
        await until(lambda: sum(len(f.requests) for f in fakes) == 5, timeout=20, what="five requests on engines")
        await client.pause()  # engines hold them between two steps: what each holds stays put

        ack = await client.control("status_detail")
        assert ack["state"] == "PAUSED" and ack["detail"]["noop"] and ack["detail"]["previous_state"] == "PAUSED"
        engines = ack["detail"]["engines"]
        assert len(engines) == 2
        held = sorted((facts["running"], facts["waiting"]) for facts in engines.values())
        assert held == sorted((f.num_running, f.num_waiting) for f in fakes)  # each fake's own count, read now
        assert sum(r + w for r, w in held) == 5
        assert all(facts["epoch"] == 0 and facts["suspend_level"] == 0 and facts["kv_blocks_total"] == 32
                   for facts in engines.values())

        await client.suspend(level=2)
        ack = await client.control("status_detail")
        assert ack["state"] == "SUSPENDED" and (await client.status())["state"] == "SUSPENDED"
        assert [facts["suspend_level"] for facts in ack["detail"]["engines"].values()] == [2, 2]
        assert [facts["kv_blocks_free"] for facts in ack["detail"]["engines"].values()] == [0, 0]  # pools released

        await client.stop()
        with pytest.raises(ControlError, match="STATUS_DETAIL is not allowed while STOPPED") as err:
            await client.control("status_detail")  # no engine is left to ask
        assert err.value.code == "illegal_transition"
        for flight in flights:
            flight.cancel()


async def test_an_argument_it_does_not_take_is_refused_by_name_before_anything_is_sent(fleet_factory):
    fleet = fleet_factory()
    add(fleet, FakeEngine())
    async with fleet.connected(1) as client:
        with pytest.raises(ValueError, match="level"):
            await client.control("status_detail", level=2)
