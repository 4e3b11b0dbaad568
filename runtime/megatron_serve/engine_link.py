"""The engine's connection to the coordinator, in a thread of its own (see :mod:`.engine_process`).

HELLO with the token, group and capacity; a HEARTBEAT every second *even while a long step, a
weight offload or a suspend runs* (otherwise the coordinator would declare a busy engine dead);
noticing a lost or restarted coordinator and registering again with backoff. Every registration is
a new *session*; messages produced for an older session are dropped on the way out, because the
coordinator already re-queued that session's requests and would otherwise see them twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Iterator

import zmq

from .messages import FROM_COORDINATOR
from .protocol import ErrorCode, Header, ProtocolError, decode, encode, unbatch

logger = logging.getLogger("megatron_serve.engine_process")


def backoff_delays(initial: float = 0.1, maximum: float = 2.0) -> Iterator[float]:
    """0.1, 0.2, 0.4 ... capped at ``maximum``: reconnect attempts that neither hammer nor dawdle."""
    delay = initial
    while True:
        yield delay
        delay = min(delay * 2, maximum)


class CoordinatorLink:
    """The engine's connection to the coordinator, in its own thread (see the module docstring).

    Events for the main thread arrive on :attr:`inbox` as tuples:
    ``("registered", hello_ack_body, session)``, ``("message", header, body, session)`` and
    ``("fatal", reason)`` (e.g. the token was refused: retrying cannot help).
    """

    def __init__(
        self,
        address: str,
        hello: dict[str, Any],
        *,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 10.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.hello = hello
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.ctx = context or zmq.Context.instance()
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.stats: dict[str, Any] = {}  # replaced wholesale by the main thread; sent with each heartbeat
        self.engine_id: str | None = None
        self.session = 0
        self._pipe_name = f"inproc://engine-link-{uuid.uuid4().hex}"
        self._tx = self.ctx.socket(zmq.PAIR)  # main thread's end
        self._tx.bind(self._pipe_name)
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    # -- main-thread API

    def start(self) -> None:
        self._thread.start()

    def send(self, header: Header, body: dict[str, Any], session: int) -> None:
        """Queue a message for the coordinator; dropped if ``session`` is no longer current."""
        try:
            frame = encode(header, body)
        except ProtocolError as exc:
            logger.error("not sending %s: %s", header.name, exc)
            return
        self._tx.send_multipart([session.to_bytes(8, "little"), frame])

    def close(self, timeout: float = 2.0) -> None:
        """Flush what was queued (up to ``timeout``) and stop the thread."""
        if self._thread.is_alive():
            self._tx.send_multipart([b"close", b""])
            self._thread.join(timeout + 1.0)
        self._tx.close(linger=0)

    # -- link thread

    def _new_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue frames for a connection that is not up
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.connect(self.address)
        return sock

    def _run(self) -> None:
        rx = self.ctx.socket(zmq.PAIR)
        rx.connect(self._pipe_name)
        sock = self._new_socket()
        self._reset_registration()
        last_rx = time.monotonic()
        last_heartbeat = 0.0
        announced_wait = False
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        try:
            while True:
                now = time.monotonic()
                if not self._registered and now >= self._next_hello:
                    self._try_send(sock, encode(Header.HELLO, self.hello))
                    self._next_hello = now + next(self._delays)
                    if now - last_rx > 5.0 and not announced_wait:
                        logger.warning("waiting for the coordinator at %s ...", self.address)
                        announced_wait = True
                if self._registered and now - last_heartbeat >= self.heartbeat_interval:
                    body = {"engine_id": self.engine_id, **self.stats}
                    self._try_send(sock, encode(Header.HEARTBEAT, body))
                    last_heartbeat = now
                if self._registered and now - last_rx > self.coordinator_timeout:
                    logger.warning("coordinator silent for %.1fs: reconnecting", now - last_rx)
                    poller.unregister(sock)
                    sock.close(linger=0)
                    sock = self._new_socket()
                    poller.register(sock, zmq.POLLIN)
                    self._reset_registration()
                    last_rx = now
                    continue
                events = dict(poller.poll(100))
                if rx in events:
                    while True:
                        try:
                            tag, frame = rx.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if tag == b"close":
                            return
                        if self._registered and int.from_bytes(tag, "little") == self.session:
                            self._try_send(sock, frame)
                if sock in events:
                    while True:
                        try:
                            frame = sock.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            message = decode(frame.buffer, FROM_COORDINATOR)
                        except ProtocolError as exc:
                            logger.warning("dropped frame from the coordinator: %s", exc)
                            continue
                        last_rx = time.monotonic()
                        items = unbatch(message.body, FROM_COORDINATOR) if message.header is Header.BATCH \
                            else (message,)
                        for item in items:
                            if isinstance(item, ProtocolError):
                                logger.warning("dropped message from the coordinator: %s", item)
                            elif not self._on_message(*item):
                                return
                            elif self._registered:
                                announced_wait = False
        finally:
            sock.close(linger=2000)  # flush the last frames (handback, acks) before exiting
            rx.close(linger=0)

    def _reset_registration(self) -> None:
        self._registered = False
        self._delays = backoff_delays()
        self._next_hello = 0.0

    def _on_message(self, header: Header, body: Any) -> bool:
        """One message from the coordinator (link thread); False when retrying cannot help (stop)."""
        if header is Header.HELLO_ACK:
            if self._registered:
                return True  # duplicate answer to a retried HELLO
            self._registered = True
            self.session += 1
            self.engine_id = body.engine_id
            self._delays = backoff_delays()
            self.inbox.put(("registered", body, self.session))
        elif header is Header.ERROR:
            if body.code == ErrorCode.UNAUTHORIZED.value:
                self.inbox.put(("fatal", f"coordinator refused the token: {body.message}"))
                return False
            if body.code == ErrorCode.HELLO_REQUIRED.value:
                if self._registered:
                    logger.warning("coordinator does not know this engine (restarted?): registering again")
                    self._registered, self._next_hello = False, 0.0
            elif body.code == ErrorCode.GROUP_IN_USE.value:
                logger.warning("%s; retrying", body.message)
            else:
                logger.warning("coordinator error %s: %s", body.code, body.message)
        elif header is not Header.HEARTBEAT and self._registered:
            self.inbox.put(("message", header, body, self.session))
        return True

    @staticmethod
    def _try_send(sock: zmq.Socket, frame: bytes) -> bool:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:  # not connected right now: the coordinator re-queues what it misses
            return False
