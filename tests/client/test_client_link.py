"""The client's link reads frames from a callback on its socket's descriptor, and that descriptor signals an edge: a
send that takes in the socket's pending commands (a frame's arrival among them) consumes the edge a waiting frame
would have signalled. Here a frame reaches the client's socket while its event loop is held, the client then sends in
that same turn, and the frame must still be read (without the link's check after each send it waited for the next
frame, which this raw coordinator never sends)."""

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

pytestmark = pytest.mark.timeout(60)


async def test_a_frame_that_arrives_while_the_client_sends_is_read():
    address = f"tcp://127.0.0.1:{free_port()}"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)

    def answer_hello() -> bytes:
        identity, frame = router.recv_multipart()
        assert decode(frame, TO_COORDINATOR)[0] is Header.HELLO
        router.send_multipart([identity, encode(Header.HELLO_ACK, {"coordinator_id": "c", "state": "RUNNING",
                                                                      "protocol": PROTOCOL_VERSION})])
        return identity

    client = InferenceClient(address, heartbeat_interval=60.0)
    try:
        starting = asyncio.ensure_future(client.start(timeout=30))
        identity = await asyncio.to_thread(answer_hello)
        await starting
        stream = client.add_request_streaming([1, 2, 3], SamplingParams(num_tokens_to_generate=4), request_id="r")
        first = asyncio.ensure_future(stream.__anext__())  # sends SUBMIT and waits for a piece
        _, frame = await asyncio.to_thread(router.recv_multipart)
        assert decode(frame, TO_COORDINATOR)[0] is Header.SUBMIT

        router.send_multipart([identity, encode(Header.STEP_TOKENS, {"client_request_ids": ["r"],
                                                                    "deltas": [{"new_tokens": [7]}]})])
        time.sleep(0.5)  # the loop is held: the frame reaches the client's socket and signals its descriptor
        client._link.send(Header.STATUS, {"status_id": 1})
        client._link._flush()  # this send takes in the arrival (the loop has not looked at the descriptor yet)
        piece = await asyncio.wait_for(first, 10)
        assert isinstance(piece, StreamPartial) and piece.new_tokens == [7]
        await stream.aclose()
    finally:
        client.close()
        router.close()
