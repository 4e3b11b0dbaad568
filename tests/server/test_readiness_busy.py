"""A late status answer on a connection that still hears the coordinator is "busy", never "unreachable".

The server's status poll shares the event loop with the token stream; under 400 streams it timed
out and the server refused new requests with ``503 coordinator_unreachable`` and reported not-ready
while every stream completed. Here the stand-in's status never answers in time while its
connection says it hears the coordinator (as ``InferenceClient.connected`` does from every frame);
the control is the same stand-in with a silent connection, which must be unreachable.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .conftest import serving
from .fakes import FakeBackend
from .test_app import MODEL, assert_error, make_app

pytestmark = pytest.mark.timeout(120)


class SlowStatusBackend(FakeBackend):
    """Answers STATUS until ``slow`` is set, then only after the monitor gave up; ``connected`` as told."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.slow = False
        self.connected = True

    async def status(self, timeout: float | None = 10.0):
        if self.slow:
            raise TimeoutError("no status within the timeout")
        return await super().status(timeout)


@pytest.mark.parametrize("connected", [True, False])
async def test_a_late_status_is_busy_while_the_connection_hears_the_coordinator(tokenizer, connected):
    backend = SlowStatusBackend(tokenizer)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/ready")).json()["busy"] is False
        backend.slow, backend.connected = True, connected
        deadline = time.monotonic() + 10
        while True:  # until the monitor's poll failed once: busy, or unreachable
            ready = await http.get("/ready")
            if ready.json()["busy"] or not ready.json()["coordinator_reachable"]:
                break
            assert time.monotonic() < deadline, ready.text
            await asyncio.sleep(0.02)
        answer = await http.post("/v1/completions", json=body)
        if connected:  # loaded, not lost: ready, and new requests are served
            assert ready.status_code == 200 and ready.json()["state"] == "RUNNING", ready.text
            assert answer.status_code == 200, answer.text
        else:
            assert ready.status_code == 503 and ready.json()["busy"] is False
            assert_error(answer, 503, None, "coordinator_unreachable")
