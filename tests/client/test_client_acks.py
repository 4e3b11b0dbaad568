"""A RESULT's acknowledgement rides with the client's next message instead of costing a frame of its own.

Sent alone, each acknowledgement was a third frame the coordinator received per request at one request
in flight (SUBMIT, the engine's step, RESULT_ACK). Now it goes inside the next SUBMIT (protocol 10; beside it in one
BATCH frame to an older coordinator),
or alone once :data:`ACK_DELAY_S` passed without another message, so the coordinator still forgets
every delivered result. A raw ROUTER plays the coordinator, so the test sees the client's frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import pytest
import zmq

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.client.link import ACK_DELAY_S
from megatron_serve.wire.handshake import SUBMIT_ACKS_PROTOCOL
from megatron_serve.wire.messages import PROTOCOL_VERSION, TO_COORDINATOR
from megatron_serve.wire.protocol import Header, Message, decode, encode, unbatch
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import free_port

pytestmark = pytest.mark.timeout(60)


class RawCoordinator:
    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.address)
        self.identity = b""

    def frame(self, timeout: float = 10.0) -> list[Message]:
        """The messages of the next frame from the client (a BATCH opened), or [] after ``timeout``."""
        if not self.router.poll(int(timeout * 1000)):
            return []
        self.identity, frame = self.router.recv_multipart()
        message = decode(frame, TO_COORDINATOR)
        return list(unbatch(message.body, TO_COORDINATOR)) if message.header is Header.BATCH else [message]

    def send(self, header: Header, body: dict) -> None:
        self.router.send_multipart([self.identity, encode(header, body)])

    def result(self, crid: str) -> None:
        """The request's token, then its record (which does not repeat the tokens: the client has them)."""
        self.send(Header.STEP_TOKENS, {"client_request_ids": [crid], "deltas": [{"new_tokens": [7]}]})
        self.send(Header.RESULT, {"client_request_id": crid, "request": {
            "request_id": f"c/{crid}", "prompt_tokens": [1, 2, 3], "status": "COMPLETED", "finish_reason": "length"}})


PARAMS = SamplingParams(num_tokens_to_generate=1)


@contextlib.asynccontextmanager
async def answered_once(protocol: int = PROTOCOL_VERSION) -> AsyncIterator[tuple[RawCoordinator, InferenceClient]]:
    """A client registered with a raw coordinator of ``protocol``, whose request ``r1`` was submitted and answered."""
    coordinator = RawCoordinator()
    client = InferenceClient(coordinator.address)
    try:
        starting = asyncio.ensure_future(client.start(timeout=30))
        assert [m.header for m in await asyncio.to_thread(coordinator.frame)] == [Header.HELLO]
        coordinator.send(Header.HELLO_ACK, {"coordinator_id": "c", "state": "RUNNING", "protocol": protocol})
        await starting
        request = asyncio.ensure_future(client.add_request([1, 2, 3], PARAMS, request_id="r1"))
        assert [m.header for m in await asyncio.to_thread(coordinator.frame)] == [Header.SUBMIT]
        coordinator.result("r1")
        assert (await asyncio.wait_for(request, 10)).generated_tokens == [7]
        yield coordinator, client
    finally:
        client.close()
        coordinator.router.close(linger=0)


async def test_the_acknowledgement_rides_in_the_next_submit():
    """Protocol 10: inside the SUBMIT itself (``acks``), not a message beside it."""
    async with answered_once() as (coordinator, client):
        second = asyncio.ensure_future(client.add_request([1, 2, 3], PARAMS, request_id="r2"))
        together = await asyncio.to_thread(coordinator.frame)
        assert [m.header for m in together] == [Header.SUBMIT]
        assert (together[0].body.client_request_id, together[0].body.acks) == ("r2", ["r1"])
        second.cancel()


async def test_an_older_coordinator_gets_the_acknowledgement_beside_the_submit():
    """A coordinator below 10 does not read ``acks``: the client sends RESULT_ACK in the same frame."""
    async with answered_once(protocol=SUBMIT_ACKS_PROTOCOL - 1) as (coordinator, client):
        second = asyncio.ensure_future(client.add_request([1, 2, 3], PARAMS, request_id="r2"))
        together = await asyncio.to_thread(coordinator.frame)
        assert [m.header for m in together] == [Header.SUBMIT, Header.RESULT_ACK]
        assert (together[0].body.client_request_id, together[0].body.acks) == ("r2", None)
        assert together[1].body.client_request_ids == ["r1"]
        second.cancel()


async def test_an_acknowledgement_with_nothing_to_ride_with_goes_alone_soon():
    async with answered_once() as (coordinator, _client):
        delivered = time.monotonic()
        alone = await asyncio.to_thread(coordinator.frame, 10.0)
        while [m.header for m in alone] == [Header.HEARTBEAT]:  # the link's own, due meanwhile
            alone = await asyncio.to_thread(coordinator.frame, 10.0)
        waited = time.monotonic() - delivered
        assert [(m.header, m.body.client_request_ids) for m in alone] == [(Header.RESULT_ACK, ["r1"])]
        assert waited < ACK_DELAY_S + 2.0, waited  # a timer sends it, not the next heartbeat or nothing
