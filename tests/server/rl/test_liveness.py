"""prime-rl's ``GET /liveness`` (``src/prime_rl/inference/vllm/server.py``): 200 ``{"status": "ok"}``, 503
``{"status": "engine_unresponsive"}`` while an engine's step loop is wedged, as the coordinator's stall clock sees it:
within the stall timeout, before the coordinator removes the engine.

Three levels: the coordinator's status (a pure core: ``stalled_s`` and ``stall_timeout``), the route over a
stand-in backend whose loop is wedged, and a real coordinator with a stand-in engine whose step loop hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.server import create_app
from megatron_serve.wire.messages import Heartbeat
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.sampling_params import SamplingParams

from ...coordinator.test_core import C, E1, CoreHarness, status, submit
from ...coordinator.test_verb_timeout import hang_after
from ..conftest import serving
from .control_app import controlled
from .control_fakes import STALL_TIMEOUT

pytestmark = pytest.mark.timeout(60)


def test_the_status_shows_how_long_a_loop_with_requests_stood_still_and_the_stall_timeout():
    h = CoreHarness(stall_timeout=30.0)
    h.client(C)
    e1 = h.engine(E1, group=0)

    def beat(progress: int, seconds: float) -> None:  # heartbeats every 5 s, the loop's counter at ``progress``
        for _ in range(int(seconds // 5)):
            h.advance(5.0)
            h.send(E1, Header.HEARTBEAT, Heartbeat(engine_id=e1, progress=progress))

    beat(1, 50.0)
    assert status(h).engines[0]["stalled_s"] == 0.0 and status(h).stall_timeout == 30.0  # idle: no clock
    submit(h, "r")
    beat(1, 15.0)
    assert status(h).engines[0]["stalled_s"] == pytest.approx(15.0)
    beat(2, 5.0)  # it moved: the clock starts again
    assert status(h).engines[0]["stalled_s"] == 0.0


async def test_liveness_is_503_for_a_wedged_loop_within_the_stall_timeout_and_200_otherwise(tokenizer):
    async with controlled(tokenizer) as s:
        answer = await s.http.get("/liveness")  # no key: a probe
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        s.fleet.wedge()
        wedged_at = time.monotonic()
        while (answer := await s.http.get("/liveness")).status_code == 200:
            assert time.monotonic() - wedged_at < STALL_TIMEOUT, "no 503 within the stall timeout"
            await asyncio.sleep(0.05)
        assert answer.status_code == 503
        assert answer.json() == {"status": "engine_unresponsive", "engines": ["e0-g0"]}
        s.fleet.wedged_since = None
        assert (await s.http.get("/liveness")).status_code == 200


async def test_liveness_sees_a_real_coordinators_stalled_engine_before_it_is_removed(fleet_factory, tokenizer):
    stall_timeout = 4.0
    fleet = fleet_factory(stall_timeout=stall_timeout)
    _, fake, _ = fleet.add_engine(heartbeat_interval=0.1)
    hanging = hang_after(fake, 3)
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        [engine_id] = [e["id"] for e in (await client.wait_for_engines(1, timeout=20, poll=0.02))["engines"]]
        app = create_app(client, tokenizer, "tiny-llama", vocab_size=512, max_model_len=1024, status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/liveness")).json() == {"status": "ok"}
            future = client.add_request([2, 7, 1], SamplingParams(num_tokens_to_generate=50))
            assert await asyncio.to_thread(hanging.wait, 10), "the engine never reached its fourth step"
            hung_at = time.monotonic()
            while (answer := await http.get("/liveness")).status_code == 200:
                await asyncio.sleep(0.05)
            assert time.monotonic() - hung_at < stall_timeout  # said before the coordinator acts
            assert answer.json() == {"status": "engine_unresponsive", "engines": [engine_id]}
            assert engine_id in [e["id"] for e in (await client.status())["engines"]]
            fake.thaw()
            while (await http.get("/liveness")).status_code == 503:
                await asyncio.sleep(0.05)
            assert (await asyncio.wait_for(future, 30)).generated_tokens
