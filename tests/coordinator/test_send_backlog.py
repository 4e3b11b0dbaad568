"""A peer whose queue is full gets the rest of its frames later, in order, and each one readable.

The coordinator sends without blocking; a frame that finds the peer's queue full (``EAGAIN``) waits
for the next pass of the loop. Those frames were already packed into BATCH frames: packed again with
the next pass's messages, a BATCH travelled inside a BATCH, which peers drop (results lost), and a
later frame could overtake an earlier one. Real sockets: a ROUTER with a tiny send queue, and a
DEALER that reads nothing until the coordinator's sends have backed up.
"""

from __future__ import annotations

import time

import pytest
import zmq

from megatron_serve.coordinator import Coordinator
from megatron_serve.coordinator.effects import Send
from megatron_serve.wire.messages import FROM_COORDINATOR
from megatron_serve.wire.protocol import Header, ProtocolError, decode, encode, unbatch

pytestmark = pytest.mark.timeout(60)

PEER = b"slow-peer"
TEXT = "x" * 100_000  # big messages fill the socket buffers quickly


def tokens(n: int) -> bytes:
    return encode(Header.STEP_TOKENS, {"client_request_ids": [f"r{n}"], "deltas": [{"new_tokens": [n], "new_text": TEXT}]})


def test_frames_a_full_queue_refused_arrive_later_in_order_and_unnested():
    coordinator = Coordinator(port=0, insecure=True)
    coordinator.bind()
    coordinator.sock.setsockopt(zmq.SNDHWM, 1)  # a listener copies the options it is bound with:
    port = coordinator.sock.bind_to_random_port("tcp://127.0.0.1")  # a second one, with the tiny queue
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.setsockopt(zmq.IDENTITY, PEER)
    try:
        peer.connect(f"tcp://127.0.0.1:{port}")
        peer.send(b"hi")
        assert coordinator.sock.poll(10_000)
        coordinator.sock.recv_multipart()  # the ROUTER knows the peer now
        sent = 0
        deadline = time.monotonic() + 30
        while not coordinator._backlog:  # until the peer's queue is full and frames wait
            assert time.monotonic() < deadline, "the send queue never filled"
            assert coordinator._perform([Send(PEER, tokens(sent + i), batch=True) for i in range(5)]) == []
            sent += 5
        for _ in range(3):  # more passes while frames wait: their messages must queue behind them
            assert coordinator._perform([Send(PEER, tokens(sent + i), batch=True) for i in range(5)]) == []
            sent += 5
        received: list[int] = []
        deadline = time.monotonic() + 30
        while len(received) < sent:
            assert time.monotonic() < deadline, f"{len(received)} of {sent} messages arrived"
            coordinator._perform([])  # the loop's next pass: retry what waits
            while peer.poll(10):
                message = decode(peer.recv(), FROM_COORDINATOR)
                items = list(unbatch(message.body, FROM_COORDINATOR)) if message.header is Header.BATCH else [message]
                for item in items:
                    assert not isinstance(item, ProtocolError), item
                    received.append(item.body.deltas[0].new_tokens[0])
        assert received == list(range(sent))
        assert not coordinator._backlog
    finally:
        peer.close(linger=0)
        coordinator.close()
