"""Every fleet connection carries ZMTP heartbeats and TCP keepalive, so a link that goes down without a FIN or an
RST (a vanished node, a cut cable) is noticed by the transport as well as by the fleet's own heartbeats (the
partition tests in tests/chaos/test_partitions.py cut such links)."""

from __future__ import annotations

import zmq

from megatron_serve.wire import transport
from megatron_serve.wire.security import PeerKeys


def test_a_peer_socket_pings_its_connection_and_keeps_it_alive():
    ctx = zmq.Context()
    sock, monitor = transport.open_peer_socket(ctx, "tcp://127.0.0.1:9", None, PeerKeys(), hwm=0, linger=0)
    try:
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == transport.ZMTP_HEARTBEAT_IVL_MS
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == transport.ZMTP_HEARTBEAT_TIMEOUT_MS
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == transport.ZMTP_HEARTBEAT_TIMEOUT_MS
        assert (sock.getsockopt(zmq.TCP_KEEPALIVE), sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE)) == (
            1, transport.TCP_KEEPALIVE_IDLE_S)
    finally:
        transport.close_monitored(sock, monitor)
        ctx.term()
