"""The connection every peer keeps to the coordinator (HELLO, backoff, heartbeats, reconnects), without sockets."""

from __future__ import annotations

import pytest
import zmq

from megatron_serve.wire.connection import Connection, Unauthorized
from megatron_serve.wire.messages import PROTOCOL_VERSION, Error, Heartbeat, HelloAck, StepTokens, TokenDelta
from megatron_serve.wire.protocol import Header, decode, encode, encode_batch

HELLO = {"role": "client", "client_id": "c", "acks": True}


def headers(frames: list[bytes]) -> list[Header]:
    return [decode(f, {Header.HELLO: dict, Header.HEARTBEAT: dict}).header for f in frames]


def ack(coordinator_id: str = "k1") -> bytes:
    return encode(Header.HELLO_ACK, HelloAck(coordinator_id=coordinator_id, state="RUNNING"))


UP, FAILED = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def connected(hello: dict = HELLO, **options) -> Connection:
    c = Connection(hello, **options)
    c.on_monitor_event(UP)
    return c


def test_hello_waits_for_a_connection_then_is_retried_with_backoff_until_answered():
    c = Connection(HELLO, heartbeat_interval=1.0, coordinator_timeout=5.0)
    assert c.due(0.0) == ([], False) and c.next_due() == float("inf")  # a HELLO now would go nowhere
    c.on_monitor_event(UP)
    sent = [t for t in (0.0, 0.05, 0.1, 0.2, 0.31, 0.7, 0.72, 1.6) if c.due(t)[0]]
    assert sent == [0.0, 0.1, 0.31, 0.72, 1.6]  # 0.1, 0.2, 0.4, 0.8 ... apart
    hello = decode(encode(Header.HELLO, c.hello), {Header.HELLO: dict}).body
    assert hello["protocol"] == PROTOCOL_VERSION == 11 and hello["client_id"] == "c"
    first = c.receive(ack(), 2.0)
    assert [m.header for m in first] == [Header.HELLO_ACK] and c.registered and c.session == 1
    assert c.receive(ack(), 2.1) == []  # the answer to a retried HELLO
    assert c.session == 1


def test_heartbeats_once_registered_and_a_silent_coordinator_means_a_new_socket():
    c = connected(heartbeat_interval=1.0, coordinator_timeout=5.0)
    c.due(0.0)
    c.receive(ack(), 0.1)
    frames, _ = c.due(0.2, {"engine_id": "e1"})
    assert headers(frames) == [Header.HEARTBEAT]
    assert c.due(0.5)[0] == [] and headers(c.due(1.3)[0]) == [Header.HEARTBEAT]
    c.receive(encode(Header.HEARTBEAT, Heartbeat(state="RUNNING")), 1.4)  # the coordinator answers
    assert c.due(6.0) == ([encode(Header.HEARTBEAT, {})], False)
    assert c.due(6.5) == ([], True)  # nothing heard for more than 5 s: replace the socket
    assert not c.registered and c.due(6.5)[0] == []  # and say HELLO again once the new one is up
    c.on_monitor_event(UP)
    assert headers(c.due(6.5)[0]) == [Header.HELLO]
    c.receive(ack("k2"), 6.6)
    assert c.session == 2 and c.ack.coordinator_id == "k2"


def test_a_silent_coordinator_is_lost_until_one_registers_this_peer_and_past_the_grace_the_error_says_so():
    c = connected(heartbeat_interval=1.0, coordinator_timeout=5.0, grace=10.0)
    c.due(0.0)
    c.receive(ack(), 0.1)
    assert c.due(5.2) == ([], True) and c.lost_since == 5.2  # found silent: lost from now on
    assert c.lost(15.1, "tcp://h:1") is None  # within the grace: what is pending waits
    assert c.next_due() == 15.2  # the owner looks again when the grace ends, connection or not
    error = c.lost(15.2, "tcp://h:1")
    assert error is not None and error.code == "coordinator_lost" and isinstance(error, ConnectionError)
    assert "lost the coordinator at tcp://h:1: no answer for 15s" in str(error)
    assert c.next_due() == float("inf")  # told once: no waking for it again (no new socket is up)
    c.receive(ack("k2"), 16.0)  # a coordinator (the same, or its replacement) registers us again
    assert c.lost_since is None and c.lost(30.0, "tcp://h:1") is None
    with pytest.raises(ValueError, match="grace period"):
        Connection(HELLO, grace=-1.0)


def test_a_restarted_coordinator_is_greeted_again_and_a_refusal_is_final():
    c = connected()
    c.due(0.0)
    c.receive(ack(), 0.1)
    forgot = encode(Header.ERROR, Error(code="hello_required", message="does not know this peer"))
    assert c.receive(forgot, 1.0) == [] and not c.registered
    assert headers(c.due(1.0)[0]) == [Header.HELLO]
    refused = encode(Header.ERROR, Error(code="unauthorized", message="this client id belongs to another peer"))
    with pytest.raises(Unauthorized, match="refused this peer: this client id belongs to another peer"):
        c.receive(refused, 1.1)


def test_a_new_connection_registers_again_and_handshakes_that_keep_failing_are_final():
    c = connected(refusal="wrong secret")
    c.due(0.0)
    c.receive(ack(), 0.1)
    c.on_monitor_event(FAILED)  # one failure (a coordinator dying mid-handshake) is not a verdict
    assert c.registered
    c.on_monitor_event(UP)  # the transport reconnected: the coordinator sees a new, unproven connection
    assert not c.registered and headers(c.due(0.2)[0]) == [Header.HELLO]
    for _ in range(2):
        c.on_monitor_event(FAILED)
    c.on_monitor_event(UP)  # a success in between starts the count again
    c.on_monitor_event(FAILED)
    c.on_monitor_event(FAILED)
    with pytest.raises(Unauthorized, match="wrong secret"):
        c.on_monitor_event(FAILED)
    with pytest.raises(Unauthorized, match="wrong secret"):  # one encrypts, the other does not: at once
        connected(refusal="wrong secret").on_monitor_event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


def test_batches_are_opened_and_bad_frames_dropped():
    c = Connection(HELLO)
    tokens = [encode(Header.STEP_TOKENS, StepTokens(client_request_ids=[str(i)], deltas=[TokenDelta(new_tokens=[i])]))
              for i in range(3)]
    messages = c.receive(encode_batch([ack(), *tokens]), 0.0)
    assert [m.header for m in messages] == [Header.HELLO_ACK, *[Header.STEP_TOKENS] * 3]
    assert [m.body.deltas[0].new_tokens for m in messages[1:]] == [[0], [1], [2]]
    assert c.receive(b"\x93not msgpack", 0.1) == []
