"""A backlog of coordinator messages never holds the client's event loop.

``await sock.recv()`` returns at once while messages wait, so the receive loop used to handle a
whole backlog in one step: with many streams on a busy host the HTTP server sharing that loop
answered nothing, ``/health`` included, for seconds (7.4 s measured). Here a raw coordinator
socket queues thousands of TOKENS while the client's loop is blocked; once it runs again, other
tasks must get turns every few messages. Deterministic: it counts messages between turns.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from megatron_serve.client.coordinator_client import InferenceClient, StreamPartial
from megatron_serve.wire.messages import PROTOCOL_VERSION, TO_COORDINATOR
from megatron_serve.wire.protocol import Header, decode, encode
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import free_port

pytestmark = pytest.mark.timeout(120)

BACKLOG = 3000


async def test_a_backlog_of_tokens_lets_other_tasks_run(monkeypatch):
    address = f"tcp://127.0.0.1:{free_port()}"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(address)

    def answer_hello() -> bytes:
        identity, frame = router.recv_multipart()
        header, _ = decode(frame, TO_COORDINATOR)
        assert header is Header.HELLO
        router.send_multipart([identity, encode(Header.HELLO_ACK, {"coordinator_id": "c", "state": "RUNNING",
                                                                      "protocol": PROTOCOL_VERSION})])
        return identity

    client = InferenceClient(address)
    try:
        starting = asyncio.ensure_future(client.start(timeout=30))
        identity = await asyncio.to_thread(answer_hello)
        await starting
        stream = client.add_request_streaming([1, 2, 3], SamplingParams(num_tokens_to_generate=BACKLOG),
                                              request_id="r")
        first = asyncio.ensure_future(stream.__anext__())  # sends SUBMIT and waits for a partial
        _, frame = await asyncio.to_thread(router.recv_multipart)
        assert decode(frame, TO_COORDINATOR)[0] is Header.SUBMIT

        tokens = encode(Header.STEP_TOKENS, {"client_request_ids": ["r"], "deltas": [{"new_tokens": [7]}]})
        for _ in range(BACKLOG):
            router.send_multipart([identity, tokens])
        time.sleep(1.0)  # the loop is blocked: the whole backlog reaches the client's socket meanwhile

        received: list[int] = []

        async def ticker() -> None:  # one turn per loop iteration: how many partials arrived since the last
            seen = 0
            while True:
                received.append(stream_queue_length() - seen)
                seen = stream_queue_length()
                await asyncio.sleep(0)

        def stream_queue_length() -> int:
            return len(client._pending.get("r").collector.tokens)

        ticking = asyncio.create_task(ticker())
        assert isinstance(await asyncio.wait_for(first, 30), StreamPartial)
        deadline = time.monotonic() + 60
        while stream_queue_length() < BACKLOG:
            assert time.monotonic() < deadline, stream_queue_length()
            await asyncio.sleep(0.01)
        ticking.cancel()
        assert max(received) <= 64, max(received)  # handled in small slices, not all at once
        await stream.aclose()
    finally:
        client.close()
        router.close()
