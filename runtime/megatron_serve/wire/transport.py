"""The fleet's ZeroMQ sockets: a peer's DEALER to the coordinator, the coordinator's CURVE server, their monitors.

Every peer (engine link, client, control, operator, trainer) opens its connection with
:func:`open_peer_socket`, so its options, its encryption (:mod:`megatron_serve.wire.security`) and the
monitor of its handshakes are set in one place.
"""

from __future__ import annotations

import threading
import uuid
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .security import HANDSHAKE_EVENTS, FleetSecret, HandshakeWatch, PeerKeys, refused_message


#: ZMTP heartbeats (milliseconds): each side's I/O thread pings every connection and drops one that answered nothing
#: for the time-out, so a peer behind a link that went down (no FIN, no RST) is noticed by the transport itself, and
#: a DEALER reconnects, however busy the Python side is (the pings never wait for the GIL). As long as the
#: coordinator's own heartbeat time-out (10 s), so that a slow but alive peer is never dropped sooner by one than
#: the other.
ZMTP_HEARTBEAT_IVL_MS, ZMTP_HEARTBEAT_TIMEOUT_MS = 2_000, 10_000
#: TCP keepalive (seconds): the kernel's own probes, for a connection idle between heartbeats' reach (a closed one).
TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTVL_S, TCP_KEEPALIVE_CNT = 10, 5, 3
#: A peer's connect attempts (milliseconds): one not established within ``CONNECT_TIMEOUT_MS`` is abandoned and a new
#: one starts ``RECONNECT_IVL_MS`` later, backing off to ``RECONNECT_IVL_MAX_MS``. Without the time-out a connect
#: started while the link silently dropped packets sat in the kernel's SYN back-off (its SYN sent again 1, 3, 7, 15 s
#: ... after the first), and an engine registered again 13-16 s after the link was back (issue 86); now a new SYN
#: goes out within 2 s, whenever the link returns (2-4 s after a link-down, where the connect fails at once).
CONNECT_TIMEOUT_MS, RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 1_000, 100, 1_000


def keep_alive(sock: zmq.Socket) -> None:
    """ZMTP heartbeats and TCP keepalive on ``sock`` (every fleet socket, before it binds or connects)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMTP_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)


def open_peer_socket(ctx: zmq.Context, address: str, secret: FleetSecret | None, keys: PeerKeys, *, hwm: int,
                     linger: int) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to the coordinator at ``address`` and the monitor of its handshakes (read it; end both
    with :func:`close_monitored`). ``hwm``: its send and receive queues (0: unbounded)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue frames for a connection that is not up
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    keep_alive(sock)
    secure_client(sock, secret, keys)
    monitor = open_monitor(sock, HANDSHAKE_EVENTS)
    sock.connect(address)
    return sock, monitor


def secure_server(sock: zmq.Socket, secret: FleetSecret) -> None:
    """Make ``sock`` (before it binds) the fleet's CURVE server; a ZAP handler on its context must
    admit the clients, so that each connection carries its client's key as ``User-Id``."""
    sock.curve_secretkey = secret.server_secret
    sock.curve_publickey = secret.server_public
    sock.curve_server = True
    sock.zap_domain = b"megatron-serve"


def secure_client(sock: zmq.Socket, secret: FleetSecret | None, keys: PeerKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the fleet's coordinator (nothing when insecure)."""
    if secret is None:
        return
    sock.curve_serverkey = secret.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A monitor of ``sock`` (before it connects or binds) that can never stall the context: read it, and end
    it with :func:`close_monitored`.

    libzmq's I/O thread sends monitor events with a blocking send: a reader whose queue is full, or that
    is closed while the socket still reports, stalls every socket of the context (seen: after a
    coordinator restart, no new connection of the process completed its handshake). So the queue is
    unbounded, and the endpoint is unique (pyzmq's default names it after the socket's file descriptor,
    which a later socket may reuse).
    """
    address = f"inproc://megatron-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.rcvhwm = 0
    monitor.connect(address)
    return monitor


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket | None, linger: int = 0) -> None:
    """Stop ``sock``'s events, close it, then its monitor (in this order: see :func:`open_monitor`)."""
    if monitor is not None:
        try:
            sock.monitor(None, 0)
        except zmq.ZMQError:
            pass
    sock.close(linger=linger)
    if monitor is not None:
        monitor.close(linger=0)


class RefusalWatch:
    """One handshake with the coordinator at ``address``, in a thread of its own, while a slow start-up (an engine's
    torch import and model load) runs: a coordinator that refuses this process's secret is known within a fraction
    of a second, not only once the start-up is over. ``on_refused(reason)`` runs in the thread, with the line the
    peer's own link would report (:func:`refused_message`); a handshake that succeeds, or a coordinator not up yet,
    leaves it silent. :meth:`close` when the start-up is done (the peer's own link takes over)."""

    def __init__(self, address: str, secret: FleetSecret | None, on_refused: Callable[[str], None],
                 ctx: zmq.Context | None = None) -> None:
        self.address, self.secret, self.on_refused = address, secret, on_refused
        self.ctx = ctx or zmq.Context.instance()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handshake-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            sock, monitor = open_peer_socket(self.ctx, self.address, self.secret, PeerKeys(), hwm=1, linger=0)
        except zmq.ZMQError:  # an address the transport refuses: the peer's own link reports it
            return
        watch = HandshakeWatch()
        try:
            while not self._closed.is_set():
                if not monitor.poll(100):
                    continue
                outcome = watch.event(recv_monitor_message(monitor)["event"])
                if outcome == "connected":
                    return
                if outcome == "refused":
                    self.on_refused(refused_message(self.address, self.secret is not None))
                    return
        finally:
            close_monitored(sock, monitor)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
