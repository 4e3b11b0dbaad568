"""``ClientLink``: an :class:`~megatron_serve.client.coordinator_client.InferenceClient`'s ZeroMQ link to its
coordinator, on the event loop that started it.

One DEALER socket, opened again whenever the protocol's :class:`~megatron_serve.wire.connection.Connection` says
the coordinator went silent; a monitor on each socket that says HELLO as soon as a handshake completes; a loop that
sends what the connection says is due (HELLO with backoff, heartbeats); a receive loop that reads in bounded turns.
What the client sends in one turn of the event loop leaves as one frame, and RESULT acknowledgements ride along
with it. The link knows nothing of requests: each message goes to ``on_message``, a refusal to ``on_refused``, a
coordinator lost past its grace period to ``on_lost``.
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
from ..wire.protocol import Header, encode, pack_batches
from ..wire.security import FleetSecret, PeerKeys
from ..wire.transport import close_monitored, open_peer_socket

logger = logging.getLogger("megatron_serve.client")

#: Messages the receive loop takes at once before it lets the event loop run. ``await sock.recv()``
#: does not yield while messages are waiting, so a backlog (many streams, a busy host) was handled in
#: one go: measured 7.4 s during which the HTTP server in the same loop answered nothing, /health
#: included. The rest of a batch is read without a future per message: 1.4 us instead of 22.6 us.
_BATCH = 32
#: Messages handled in one turn of the event loop before it runs again. A frame may be a BATCH of one
#: message per request in flight (every request's tokens of one engine step), and each delta makes
#: text here: 32 such frames at 64 streams were 2,048 messages in one turn.
_MESSAGES_PER_TURN = 256

#: How long a RESULT's acknowledgement waits for another message to ride with. Sent alone, it cost the
#: coordinator a third receive per request at one request in flight (SUBMIT, the engine's step, the
#: ack); the coordinator keeps a result until it is acknowledged, so waiting a little loses nothing.
ACK_DELAY_S = 0.05


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
        """Queue a message for the end of this turn of the event loop (see :meth:`_flush`)."""
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
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._recv_loop(sock), name="inference-client-recv"))
        self._tasks.append(asyncio.create_task(self._monitor_loop(sock, monitor), name="inference-client-monitor"))

    def _close_socket(self) -> None:
        """Close the current socket, then its monitor (which ends the monitor's reading task)."""
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
        if self._sock is None:
            return False
        try:
            result = self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if isinstance(result, asyncio.Future) and result.done() and result.exception() is not None:
            return False  # not connected right now: resent after the next handshake
        return True

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        waiting = zmq.Socket.shadow(sock.underlying)  # the same socket, read without a future per message
        while not self.closed and sock is self._sock:
            try:
                frames = [await sock.recv()]
                while len(frames) < _BATCH:  # what else is waiting, up to a batch
                    frames.append(waiting.recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
            except asyncio.CancelledError:
                return
            except zmq.ZMQError:
                return
            handled = 0
            for frame in frames:
                if sock is not self._sock:  # replaced while this turn let the loop run
                    return
                try:
                    handled += self._receive(frame)
                except Unauthorized as exc:
                    self.on_refused(exc)
                    return
                if handled >= _MESSAGES_PER_TURN:
                    handled = 0
                    await asyncio.sleep(0)
            if len(frames) == _BATCH:
                await asyncio.sleep(0)  # more may be waiting: let the event loop run first (see _BATCH)

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
