"""The engine's connection to the coordinator, in a thread of its own (see :mod:`.loop`).

The thread owns the DEALER socket (a CURVE client of the coordinator when the fleet has a secret:
:mod:`megatron_serve.wire.security`) and its monitor; what to send when (HELLO with backoff, a HEARTBEAT every second
*even while a long step, a weight offload or a suspend runs* -- otherwise the coordinator would
declare a busy engine dead) and when to reconnect is the shared :class:`~megatron_serve.wire.connection.Connection`.
Every registration is a new *session*; messages produced for an older session are dropped on the
way out, because the coordinator already re-queued that session's requests and would otherwise
see them twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ...wire.connection import Connection, Unauthorized
from ...wire.protocol import Header, ProtocolError, encode
from ...wire.security import FleetSecret, PeerKeys, fleet_secret, hello_credentials, refused_message
from ...wire.transport import close_monitored, open_peer_socket

if TYPE_CHECKING:
    from ...wire.body import Body

logger = logging.getLogger("megatron_serve.engine_process")


class CoordinatorLink:
    """The engine's connection to the coordinator, in its own thread (see the module docstring).

    Events for the main thread arrive on :attr:`inbox` as tuples:
    ``("registered", hello_ack_body, session)``, ``("message", header, body, session)`` and
    ``("fatal", reason)`` (e.g. the coordinator refused the handshake: retrying cannot help).
    ``token``: the fleet secret (``None``: an insecure fleet).
    """

    def __init__(
        self,
        address: str,
        hello: dict[str, Any],
        *,
        token: str | FleetSecret | None = None,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 10.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.secret = fleet_secret(token)
        self._keys = PeerKeys()  # this engine's identity, kept across its reconnects
        self.connection = Connection({**hello, **hello_credentials(self.secret, self._keys)},
                                     heartbeat_interval=heartbeat_interval, coordinator_timeout=coordinator_timeout,
                                     now=time.monotonic(), refusal=refused_message(address, self.secret is not None))
        self.ctx = context or zmq.Context.instance()
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.stats: dict[str, Any] = {}  # replaced wholesale by the main thread; sent with each heartbeat
        # The session whose registration the main thread finished (:meth:`registered`): until then the heartbeats
        # carry no ``progress``, whatever the stats say (see _heartbeat).
        self._serving_session = 0
        self._pipe_name = f"inproc://engine-link-{uuid.uuid4().hex}"
        self._tx = self.ctx.socket(zmq.PAIR)  # main thread's end
        self._tx.bind(self._pipe_name)
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    @property
    def hello(self) -> dict[str, Any]:
        """The HELLO body of the next registration (the engine updates its ``info``)."""
        return self.connection.hello

    @property
    def session(self) -> int:
        return self.connection.session

    def registered(self, session: int) -> None:
        """The main thread finished registering ``session`` (the engine holds what the fleet serves, its weights
        pulled included): its loop's count goes out with the heartbeats again."""
        self._serving_session = session

    def _heartbeat(self, engine_id: str | None) -> dict[str, Any]:
        """The next heartbeat's body. While the main thread registers (a pull of the fleet's weights may take
        minutes) its loop's count says nothing: the first heartbeat after a HELLO_ACK, sent at once by this thread,
        carried the count of the loop before the registration, and the coordinator took a joiner that was still
        pulling for one whose step loop served (its stall clock ran; a caller waiting for it to serve went on)."""
        body = {"engine_id": engine_id, **self.stats}
        if self._serving_session != self.connection.session:
            body.pop("progress", None)
        return body

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats once registered (the link thread reads it before each one)."""
        return self.connection.heartbeat_interval

    @heartbeat_interval.setter
    def heartbeat_interval(self, seconds: float) -> None:
        self.connection.heartbeat_interval = seconds

    # -- main-thread API

    def start(self) -> None:
        self._thread.start()

    def send(self, header: Header, body: "Body | dict[str, Any]", session: int) -> None:
        """Queue a message for the coordinator; dropped if ``session`` is no longer current."""
        try:
            frame = encode(header, body)
        except ProtocolError as exc:
            logger.error("not sending %s: %s", header.name, exc)
            return
        self._tx.send_multipart([session.to_bytes(8, "little"), frame])

    def close(self, timeout: float = 2.0) -> None:
        """Flush what was queued (up to ``timeout``) and stop the thread.

        The close request is sent without blocking: the thread may end between ``is_alive()``
        and the send (an engine refused for a bad token stops its link thread on its own), and a
        PAIR socket whose peer is gone blocks a plain send forever (seen as an engine that logged
        the refusal and never exited).
        """
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            try:
                self._tx.send_multipart([b"close", b""], flags=zmq.NOBLOCK)
            except zmq.Again:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
            self._thread.join(timeout + 1.0)
            break
        self._tx.close(linger=0)

    # -- link thread

    def _new_socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A connected DEALER and the monitor of its handshakes."""
        return open_peer_socket(self.ctx, self.address, self.secret, self._keys, hwm=100_000, linger=2000)

    def _run(self) -> None:
        conn = self.connection
        rx = self.ctx.socket(zmq.PAIR)
        rx.connect(self._pipe_name)
        sock, monitor = self._new_socket()
        announced_wait = False
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                now = time.monotonic()
                frames, reconnect = conn.due(now, self._heartbeat(conn.ack.engine_id if conn.ack else None))
                if reconnect:
                    poller.unregister(sock)
                    poller.unregister(monitor)
                    close_monitored(sock, monitor)
                    sock, monitor = self._new_socket()
                    poller.register(sock, zmq.POLLIN)
                    poller.register(monitor, zmq.POLLIN)
                    continue
                for frame in frames:
                    self._try_send(sock, frame)
                if not conn.registered and conn.silent_for(now) > 5.0 and not announced_wait:
                    logger.warning("waiting for the coordinator at %s ...", self.address)
                    announced_wait = True
                events = dict(poller.poll(100))
                if monitor in events:
                    try:
                        while monitor.poll(0):
                            conn.on_monitor_event(recv_monitor_message(monitor)["event"])
                    except Unauthorized as exc:
                        self.inbox.put(("fatal", str(exc)))
                        return
                    continue  # a connection came up: what is due (HELLO) goes at once
                if rx in events:
                    while True:
                        try:
                            tag, frame = rx.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if tag == b"close":
                            return
                        if conn.registered and int.from_bytes(tag, "little") == conn.session:
                            self._try_send(sock, frame)
                if sock in events:
                    while True:
                        try:
                            frame = sock.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            messages = conn.receive(frame.buffer, time.monotonic())
                        except Unauthorized as exc:
                            self.inbox.put(("fatal", str(exc)))
                            return
                        for header, body in messages:
                            if header is Header.HELLO_ACK:
                                announced_wait = False
                                self.inbox.put(("registered", body, conn.session))
                            elif header is Header.ERROR:
                                logger.warning("coordinator error %s: %s", body.code, body.message)
                            elif header is not Header.HEARTBEAT and conn.registered:
                                self.inbox.put(("message", header, body, conn.session))
        finally:
            close_monitored(sock, monitor, linger=2000)  # flush the last frames (handback, acks) before exiting
            rx.close(linger=0)

    @staticmethod
    def _try_send(sock: zmq.Socket, frame: bytes) -> bool:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected right now: the coordinator re-queues what it misses
            return False
