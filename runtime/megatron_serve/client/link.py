"""``ClientLink``: an :class:`~megatron_serve.client.coordinator_client.InferenceClient`'s ZeroMQ link to its
coordinator, on the event loop that started it.

One DEALER socket, opened again whenever the protocol's :class:`~megatron_serve.wire.connection.Connection` says
the coordinator went silent; a monitor on each socket that says HELLO as soon as a handshake completes; a loop that
sends what the connection says is due (HELLO with backoff, heartbeats); frames read in bounded turns by a callback of
the event loop on the socket's descriptor (:meth:`ClientLink._readable`). What the client sends in one turn of the
event loop leaves as one frame, and RESULT acknowledgements ride along with it (inside the next SUBMIT, protocol 10).
The link knows nothing of requests: each message goes to ``on_message``, a refusal to ``on_refused``, a coordinator
lost past its grace period to ``on_lost``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..wire.connection import Connection, CoordinatorLost, Unauthorized
from ..wire.handshake import SUBMIT_ACKS_PROTOCOL
from ..wire.protocol import Header, encode, pack_batches
from ..wire.security import FleetSecret, PeerKeys
from ..wire.transport import close_monitored, open_peer_socket

logger = logging.getLogger("megatron_serve.client")

#: Frames read in one turn of the event loop before it runs again: a backlog (many streams, a busy host)
#: read in one go once kept the HTTP server in the same loop from answering anything, /health included,
#: for 7.4 s.
_BATCH = 32
#: Messages handled in one turn of the event loop before it runs again. A frame may be a BATCH of one
#: message per request in flight (every request's tokens of one engine step), and each delta makes
#: text here: 32 such frames at 64 streams were 2,048 messages in one turn.
_MESSAGES_PER_TURN = 256

#: How long a RESULT's acknowledgement waits for another message to ride with. Sent alone, it cost the
#: coordinator a third receive per request at one request in flight (SUBMIT, the engine's step, the
#: ack); the coordinator keeps a result until it is acknowledged, so waiting a little loses nothing. At 50 ms, 28 of
#: 256 requests' acknowledgements still went alone at c 64 (the next SUBMIT waits on the HTTP side); at 250 ms, 8.
ACK_DELAY_S = 0.25


class ClientLink:
    """The socket side of a client: ``start()`` on the client's event loop, ``send()`` and ``acknowledge()`` from
    it, ``close()`` (then ``wait_closed()``) once. ``connection`` is the client's protocol state (it outlives
    sockets)."""

    def __init__(self, secret: FleetSecret | None, keys: PeerKeys, connection: Connection, *,
                 on_message: Callable[[Header, Any], None], on_refused: Callable[[Unauthorized], None],
                 on_lost: Callable[[CoordinatorLost], None]) -> None:
        self.address = ""
        self.closed = False
        self._secret, self._keys, self._connection = secret, keys, connection
        self.on_message, self.on_refused, self.on_lost = on_message, on_refused, on_lost  # the client's handlers
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        # The same socket as a plain one: frames are sent and read through it, read by a callback on its descriptor
        # (no future, task wakeup and pyzmq event bookkeeping per frame; the asyncio socket is never polled)
        self._plain: zmq.Socket | None = None
        self._fd: int | None = None
        self._read_scheduled = False
        self._monitor: zmq.asyncio.Socket | None = None  # the current socket's handshake events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # the connection has something due sooner than planned
        self._tasks: list[asyncio.Task] = []
        self._outbox: list[bytes] = []  # messages of this turn of the event loop, in order
        self._acks: list[Any] = []  # RESULTs not yet acknowledged: they ride with the next message
        self._flush_scheduled = False
        self._ack_timer: asyncio.TimerHandle | None = None  # sends them alone when nothing else goes

    def start(self, address: str) -> None:
        """Connect to ``address`` and begin saying HELLO (on the running event loop, which every later call
        shares)."""
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._open_socket()
        self._tasks.append(asyncio.create_task(self._connection_loop(), name="inference-client-connection"))

    def send(self, header: Header, body: dict[str, Any]) -> None:
        """Queue a message for the end of this turn of the event loop (see :meth:`_flush`). A ``SUBMIT`` to a
        coordinator of protocol 10 carries the acknowledgements waiting (``acks``): no message of their own."""
        if header is Header.SUBMIT and self._acks:
            ack = self._connection.ack
            if ack is not None and ack.protocol >= SUBMIT_ACKS_PROTOCOL:
                body, self._acks = {**body, "acks": self._acks}, []
        self._outbox.append(encode(header, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def acknowledge(self, client_request_id: str) -> None:
        """Acknowledge a RESULT with the next message, or alone after :data:`ACK_DELAY_S`."""
        self._acks.append(client_request_id)
        if self._ack_timer is None:
            self._ack_timer = self._loop.call_later(ACK_DELAY_S, self._flush_acks)

    def close(self) -> None:
        """Stop every task and close the socket; what this turn queued (an abort, acknowledgements) still goes,
        best effort."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        if self._ack_timer is not None:
            self._ack_timer.cancel()
        self._flush()
        self._close_socket()

    async def wait_closed(self) -> None:
        """Until every task of the link has ended (after :meth:`close`)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _open_socket(self) -> None:
        sock, monitor = open_peer_socket(self._ctx, self.address, self._secret, self._keys, hwm=0, linger=0)
        self._close_socket()
        self._sock, self._monitor = sock, monitor
        self._plain = zmq.Socket.shadow(sock.underlying)
        self._fd = self._plain.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._readable)
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._monitor_loop(sock, monitor), name="inference-client-monitor"))

    def _close_socket(self) -> None:
        """Close the current socket, then its monitor (which ends the monitor's reading task)."""
        self._stop_reading()
        if self._sock is not None:
            close_monitored(self._sock, self._monitor)
            self._sock = self._monitor = None

    async def _monitor_loop(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """HELLO as soon as a connection is up; give up when handshakes keep failing. It reads until the socket
        is closed (an unread monitor would stall the context: :func:`~megatron_serve.wire.transport.open_monitor`)."""
        try:
            while sock is self._sock:
                self._connection.on_monitor_event(parse_monitor_message(await monitor.recv_multipart())["event"])
                self._wake.set()
        except Unauthorized as exc:
            self.on_refused(exc)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    async def _connection_loop(self) -> None:
        """Send what the connection says is due (HELLO with backoff, heartbeats); replace a silent socket."""
        connection, wake = self._connection, self._wake
        assert wake is not None
        while not self.closed:
            now = time.monotonic()
            frames, reconnect = connection.due(now)
            if reconnect:
                self._open_socket()
                continue
            for frame in frames:
                self._send_frame(frame)
            lost = connection.lost(now, self.address)
            if lost is not None:
                self.on_lost(lost)
            wake.clear()
            delay = min(max(0.0, connection.next_due() - time.monotonic()), connection.coordinator_timeout)
            try:
                await asyncio.wait_for(wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def _flush(self) -> None:
        """Send what this turn queued, in order: one BATCH frame to a coordinator that speaks protocol 2.

        A caller that submits 64 requests in one turn costs the coordinator one receive instead of
        64, and their dispatch leaves it as one frame per engine.
        """
        self._flush_scheduled = False
        if self._acks:
            acks, self._acks = self._acks, []
            self._outbox.append(encode(Header.RESULT_ACK, {"client_request_ids": acks}))
        frames, self._outbox = self._outbox, []
        ack = self._connection.ack
        if len(frames) > 1 and ack is not None and ack.protocol >= 2:
            frames = pack_batches(frames)
        for frame in frames:
            self._send_frame(frame)

    def _flush_acks(self) -> None:
        """The acknowledgements no other message carried within :data:`ACK_DELAY_S`. The timer is not
        cancelled when they ride with something else (a timer per request at one in flight): it finds
        nothing to send, or acknowledgements younger than itself."""
        self._ack_timer = None
        if self._acks and not self.closed:
            self._flush()

    def _send_frame(self, frame: bytes) -> bool:
        plain = self._plain
        if plain is None:
            return False
        try:
            plain.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again: not connected right now (resent after the next handshake)
            return False
        # A send may take in the socket's pending commands, the arrival of frames among them, and with them the edge
        # its descriptor would have signalled: read what came, on the next turn
        if plain.get(zmq.EVENTS) & zmq.POLLIN:
            self._read_soon()
        return True

    def _read_soon(self) -> None:
        if not self._read_scheduled:
            self._read_scheduled = True
            self._loop.call_soon(self._readable)

    def _stop_reading(self) -> None:
        """No more frames are read from the current socket (it closes, or the coordinator refused this client)."""
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._plain = self._fd = None

    def _readable(self) -> None:
        """Read and handle what waits, up to :data:`_BATCH` frames and :data:`_MESSAGES_PER_TURN` messages a turn of
        the event loop (the rest on the next turn). The descriptor signals an edge, not a level: it signals again
        only once ``EVENTS`` was read with no frame waiting, so a turn ends either so or with another turn due."""
        self._read_scheduled = False
        plain = self._plain
        if plain is None or self.closed:
            return
        handled = frames = 0
        try:
            while plain.get(zmq.EVENTS) & zmq.POLLIN:
                if frames == _BATCH or handled >= _MESSAGES_PER_TURN:
                    self._read_soon()
                    return
                frame = plain.recv(zmq.NOBLOCK)
                frames += 1
                handled += self._receive(frame)
                if plain is not self._plain:  # replaced or closed by what the frame led to
                    return
        except zmq.ZMQError:  # (closed under it: a new socket has a reader of its own)
            return
        except Unauthorized as exc:
            self._stop_reading()
            self.on_refused(exc)

    def _receive(self, frame: bytes) -> int:
        """Handle one frame from the coordinator; how many messages it held. Raises :class:`Unauthorized`."""
        connection = self._connection
        registered = connection.registered
        messages = connection.receive(frame, time.monotonic())
        if registered and not connection.registered:
            self._wake.set()  # the coordinator forgot us (it restarted): HELLO at once
        for header, body in messages:
            try:
                self.on_message(header, body)
            except Exception:  # a handler bug must not kill the receive loop
                logger.exception("error handling %s", header.name)
        return len(messages)
