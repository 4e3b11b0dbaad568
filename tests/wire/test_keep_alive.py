"""Every fleet connection carries ZMTP heartbeats and TCP keepalive, so a link that goes down without a FIN or an
RST (a vanished node, a cut cable) is noticed by the transport as well as by the fleet's own heartbeats (the
partition tests in tests/chaos/test_partitions.py cut such links)."""

from __future__ import annotations

import socket
import time

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


def _connect_after_silent_drop(ctx: zmq.Context, silent_for: float) -> float:
    """A peer socket connects to a listener that silently drops SYNs (its accept queue full: the kernel drops them,
    as a link that loses packets does) for ``silent_for`` seconds, then takes connections again: seconds from then
    until the peer's connection arrives."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # a queue of one, filled at once
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))
    sock, monitor = transport.open_peer_socket(ctx, f"tcp://127.0.0.1:{port}", None, PeerKeys(), hwm=0, linger=0)
    try:
        time.sleep(silent_for)  # the link silently drops: every SYN vanishes
        listener.settimeout(60)
        healed = time.monotonic()
        while True:
            conn, peer = listener.accept()  # the filler first, then the peer's connection once its SYN comes
            conn.close()
            if peer[1] != filler.getsockname()[1]:
                return time.monotonic() - healed
    finally:
        transport.close_monitored(sock, monitor)
        filler.close()
        listener.close()


def test_a_connect_started_during_a_silent_drop_is_retried_within_two_seconds_of_the_link_coming_back(monkeypatch):
    """Issue 86: an engine registered again 13-16 s after a silent-drop partition healed (2-4 s after a link-down):
    its connect sat in the kernel's SYN back-off. Bounded connect attempts start a new SYN within ~2 s."""
    ctx = zmq.Context()
    try:
        bounded = _connect_after_silent_drop(ctx, 12.0)
        monkeypatch.setattr(transport, "CONNECT_TIMEOUT_MS", 0)  # the control: the kernel's SYN back-off alone
        control = _connect_after_silent_drop(ctx, 12.0)
    finally:
        ctx.term()
    print(f"\nconnected {bounded:.1f}s after the link came back (kernel back-off alone: {control:.1f}s)")
    assert bounded < 2.5
    assert control > bounded + 2  # the control: the SYN back-off alone waits longer
