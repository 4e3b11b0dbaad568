"""Who a connection is: its CURVE key, proven with the fleet secret in HELLO, and nothing it merely claims.

A real coordinator over real (encrypted) sockets. Where the order of events matters, the test drives
the coordinator's loop itself, one received frame at a time, so that a frame is handled exactly when
the attack needs it (a frame from a connection that took over a departed peer's routing id, before
the coordinator noticed the departure).
"""

from __future__ import annotations

import time

import pytest
import zmq

from megatron_serve.coordinator import Coordinator
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.security import PeerKeys, make_secret

from ..helpers import RawPeer

pytestmark = pytest.mark.timeout(60)

SUBMIT = {"client_request_id": "r1", "prompt": [1, 2, 3], "sampling_params": {"num_tokens_to_generate": 2}}


class Driven:
    """A coordinator whose loop the test runs by hand: :meth:`pump` handles one frame and sends the answers."""

    def __init__(self) -> None:
        self.secret = make_secret()
        self.coordinator = Coordinator(port=0, token=self.secret)
        self.address = self.coordinator.bind()

    def pump(self, timeout: float = 10.0) -> bytes:
        """Handle the next frame that arrives; returns the routing id it came from."""
        sock = self.coordinator.sock
        assert sock.poll(int(timeout * 1000)), "no frame reached the coordinator"
        identity, frame = sock.recv_multipart(copy=False)
        effects = self.coordinator._on_frame(identity, frame)
        effects += self.coordinator.core._settle(time.monotonic())
        while effects:
            effects = self.coordinator._perform(effects)
        return identity.bytes

    def connect_as(self, routing_id: bytes, header: Header, body: dict, timeout: float = 30.0, **peer) -> RawPeer:
        """A new connection the ROUTER knows by ``routing_id`` (a departed peer's), whose first message
        (``header``, ``body``) has been handled. Retried: until the departed connection's pipe is gone
        from the ROUTER, a newcomer with its routing id has its first frame taken for a routing id."""
        deadline = time.monotonic() + timeout
        while True:
            newcomer = RawPeer(self.address, routing_id=routing_id, **peer)
            newcomer.send(header, body)
            if self.coordinator.sock.poll(500) and self.pump() == routing_id:
                return newcomer
            newcomer.close()
            assert time.monotonic() < deadline, f"no connection came through as {routing_id!r}"

    def close(self) -> None:
        self.coordinator.close()


@pytest.fixture
def driven():
    d = Driven()
    yield d
    d.close()


def test_a_routing_id_taken_over_by_another_connection_inherits_nothing(driven):
    routing_id = b"\x00\x00\x00\x00\x2a"  # what the ROUTER would name a peer: a peer may choose it itself
    legit = RawPeer(driven.address, driven.secret, routing_id=routing_id)
    legit.send(Header.HELLO, {"role": "client", "client_id": "legit"})
    assert driven.pump() == routing_id
    assert legit.recv().header is Header.HELLO_ACK
    legit.close()  # it leaves; the coordinator's core has not noticed (nothing probes it here)
    # Same routing id, its own key: it knows the coordinator's public key but not the secret.
    thief = driven.connect_as(routing_id, Header.SUBMIT, SUBMIT, secret=None,
                              server_key=driven.coordinator.core.members.secret.server_public)
    try:
        core = driven.coordinator.core
        assert routing_id not in core.members.peers and len(core.flow.table) == 0  # not legit's: nothing was accepted
        thief.send(Header.STATUS, {})
        assert driven.pump() == routing_id
        assert not thief.sock.poll(200) and thief.received() == []  # and it is told nothing
    finally:
        thief.close()


def test_a_hello_counts_only_on_the_connection_whose_key_it_proves(driven):
    legit_keys = PeerKeys()
    recorded = {"role": "engine", "capacity": 1000, "protocol": PROTOCOL_VERSION,
                "proof": driven.coordinator.core.members.secret.proof(legit_keys.public)}  # a HELLO seen on the wire
    thief = RawPeer(driven.address, driven.secret)  # even with the secret: another connection, another key
    try:
        thief.send(Header.HELLO, recorded)
        driven.pump()
        thief.send(Header.HEARTBEAT, {})
        driven.pump()
        assert not thief.sock.poll(200) and thief.received() == []
        assert driven.coordinator.core.members.engines == {}
    finally:
        thief.close()
    legit = RawPeer(driven.address, driven.secret, keys=legit_keys)  # its owner, holding the private key
    try:
        legit.send(Header.HELLO, recorded)
        driven.pump()
        assert legit.recv().header is Header.HELLO_ACK and len(driven.coordinator.core.members.engines) == 1
    finally:
        legit.close()


def test_a_client_id_stays_with_the_key_that_registered_it(driven):
    victim_keys = PeerKeys()
    victim = RawPeer(driven.address, driven.secret, keys=victim_keys)
    insider = RawPeer(driven.address, driven.secret)  # holds the secret, and learned the victim's client id
    try:
        victim.send(Header.HELLO, {"role": "client", "client_id": "victim", "acks": True})
        driven.pump()
        assert victim.recv().header is Header.HELLO_ACK
        insider.send(Header.HELLO, {"role": "client", "client_id": "victim", "acks": True})
        driven.pump()
        refusal = insider.recv()
        assert refusal.header is Header.ERROR and refusal.body.code == "unauthorized"
        assert "belongs to another peer" in refusal.body.message
        victim.send(Header.SUBMIT, SUBMIT)
        driven.pump()
        (record,) = driven.coordinator.core.flow.table
        assert record.client_id == "victim" and insider.received() == []
        # The victim itself, back on a new connection with its own key, is the victim again.
        victim.close()
        victim = RawPeer(driven.address, driven.secret, keys=victim_keys)
        victim.send(Header.HELLO, {"role": "client", "client_id": "victim", "acks": True})
        driven.pump()
        assert victim.recv().header is Header.HELLO_ACK
    finally:
        victim.close()
        insider.close()


def test_a_coordinator_without_a_secret_refuses_to_start_unless_insecure():
    from megatron_serve.coordinator import InsecureRefused

    with pytest.raises(InsecureRefused, match="needs the fleet secret: pass --token-file FILE or set "
                                              "\\$MEGATRON_SERVE_TOKEN, or pass --insecure"):
        Coordinator(port=0)
    with pytest.raises(ValueError, match="--insecure turns the fleet secret off"):
        Coordinator(port=0, token=make_secret(), insecure=True)
    with pytest.raises(ValueError, match="at least 32 random"):
        Coordinator(port=0, token="hunter2")
    insecure = Coordinator(port=0, insecure=True)
    try:
        assert insecure.bind().startswith("tcp://127.0.0.1:")
        assert insecure.sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        insecure.close()
