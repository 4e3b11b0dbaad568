"""A peer's connection to the coordinator, without sockets: HELLO, backoff, heartbeats, reconnects.

Engines (:mod:`megatron_serve.engine.process.link`, a thread with a blocking socket) and clients
(:mod:`megatron_serve.client.coordinator_client`, asyncio) keep a coordinator connection the same way, written here
once; each owns its socket and asks a :class:`Connection` what to do:

* :meth:`Connection.due` says which frames are due now (HELLO until it is answered, once a connection
  is up, retried with backoff 0.1, 0.2, 0.4 ... 2 s; a HEARTBEAT every ``heartbeat_interval`` once
  registered) and
  whether the coordinator has been silent for ``coordinator_timeout`` (it answers every heartbeat):
  then the owner replaces its socket and the connection registers again;
* :meth:`Connection.receive` takes one frame apart (a bad one is logged and dropped; ``BATCH``
  frames are opened) and handles the handshake: a ``HELLO_ACK`` starts a new *session* (the owner
  resubmits, re-registers its state), ``ERROR hello_required`` (a restarted coordinator) makes it
  say HELLO again, ``ERROR unauthorized`` (a client id that belongs to another peer) raises
  :class:`Unauthorized` (retrying cannot help).
  Everything else goes to the owner;
* :meth:`Connection.on_monitor_event` reads the socket's handshake events
  (:class:`~megatron_serve.wire.security.HandshakeWatch`): a connection that comes up says HELLO at once
  (a new transport connection is a new peer to the coordinator: it registers again), and a
  coordinator that keeps refusing the handshake (another fleet secret, or none) raises
  :class:`Unauthorized`.

A session number counts registrations: what an owner produced for an older session belongs to a
coordinator (or a registration) that already gave up on it.

A coordinator found silent is *lost* from then on until a coordinator registers this peer again;
past the owner's ``grace`` seconds, :meth:`Connection.lost` returns the :class:`CoordinatorLost`
error that what is pending on it should end with (a client's requests and verbs).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from .handshake import PROTOCOL_VERSION, HelloAck
from .messages import FROM_COORDINATOR
from .protocol import ErrorCode, Header, Message, ProtocolError, decode_all, encode
from .security import HandshakeWatch

logger = logging.getLogger("megatron_serve.connection")


class CoordinatorError(RuntimeError):
    """The coordinator answered ERROR; ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Unauthorized(CoordinatorError, PermissionError):
    """The coordinator refused this peer: its handshake (another fleet secret, or none) or its identity."""


class ControlError(CoordinatorError):
    """A lifecycle verb was refused (e.g. an illegal transition); ``detail`` holds the facts the
    coordinator gave with it (a failed REFIT: each engine's weights now), or ``{}``."""

    def __init__(self, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(code, message)
        self.detail = detail or {}


class CoordinatorLost(CoordinatorError, ConnectionError):
    """No coordinator answered for longer than the peer's grace period: what was pending on it failed."""

    def __init__(self, message: str) -> None:
        super().__init__("coordinator_lost", message)


def backoff_delays(initial: float = 0.1, maximum: float = 2.0) -> Iterator[float]:
    """0.1, 0.2, 0.4 ... capped at ``maximum``: reconnect attempts that neither hammer nor dawdle."""
    delay = initial
    while True:
        yield delay
        delay = min(delay * 2, maximum)


class Connection:
    """One peer's connection state (see the module docstring); ``hello`` is the HELLO body, which the
    owner may update between registrations (an engine's weights, for example); ``refusal``: what
    :class:`Unauthorized` says when the coordinator keeps refusing the handshake."""

    def __init__(self, hello: dict[str, Any], *, heartbeat_interval: float = 1.0,
                 coordinator_timeout: float = 10.0, grace: float = float("inf"), now: float = 0.0,
                 refusal: str = "") -> None:
        if not grace >= 0:
            raise ValueError(f"the coordinator grace period must be a number of seconds >= 0, got {grace!r}")
        self.hello = {**hello, "protocol": PROTOCOL_VERSION}
        self.refusal = refusal
        self.watch = HandshakeWatch()  # the current socket's handshakes
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.grace = grace
        self.lost_since: float | None = None  # when the coordinator was found silent; None while it answers
        self._grace_ends: float | None = None  # when lost() first has an error to give (None: given, or not lost)
        self.registered = False
        self.session = 0  # registrations so far; the current one's number
        self.ack: HelloAck | None = None  # the current registration's HELLO_ACK
        self.last_rx = now
        self._delays = backoff_delays()
        self._next_hello = 0.0
        self._last_heartbeat = float("-inf")  # never: the first one goes at once

    # ------------------------------------------------------------------ time

    def due(self, now: float, heartbeat: dict[str, Any] | None = None) -> tuple[list[bytes], bool]:
        """The frames to send now, and whether the owner must replace its socket (the coordinator is silent).

        ``heartbeat``: the body of this peer's heartbeats (an engine's load); empty by default.
        """
        if self.registered and now - self.last_rx > self.coordinator_timeout:
            logger.warning("coordinator silent for %.1fs: reconnecting%s", now - self.last_rx,
                           f" (what is pending waits up to {self.grace:g}s for it)" if self.grace < float("inf") else "")
            self.restart(now)
            if self.lost_since is None:
                self.lost_since, self._grace_ends = now, now + self.grace
            return [], True
        frames = []
        if not self.registered and self.watch.handshakes and now >= self._next_hello:
            frames.append(encode(Header.HELLO, self.hello))
            self._next_hello = now + next(self._delays)
        if self.registered and now - self._last_heartbeat >= self.heartbeat_interval:
            frames.append(encode(Header.HEARTBEAT, heartbeat or {}))
            self._last_heartbeat = now
        return frames, False

    def next_due(self) -> float:
        """When :meth:`due` (or :meth:`lost`) has something to do next (monotonic seconds). A HELLO waits for a
        connection (:meth:`on_monitor_event` says when one is up); the end of a grace period does not."""
        if not self.registered:
            hello = self._next_hello if self.watch.handshakes else float("inf")
            return hello if self._grace_ends is None else min(hello, self._grace_ends)
        return min(self._last_heartbeat + self.heartbeat_interval, self.last_rx + self.coordinator_timeout)

    def lost(self, now: float, address: str) -> CoordinatorLost | None:
        """The error for what is pending, once the coordinator at ``address`` has been lost past the grace period."""
        if self.lost_since is None or now - self.lost_since < self.grace:
            return None
        self._grace_ends = None  # the owner has been told: no need to wake for it again
        return CoordinatorLost(f"lost the coordinator at {address}: no answer for "
                               f"{now - self.lost_since + self.coordinator_timeout:.0f}s (a grace period of "
                               f"{self.grace:g}s after {self.coordinator_timeout:g}s of silence); the request did "
                               "not finish")

    def restart(self, now: float) -> None:
        """A new socket: register again (HELLO at once, then with backoff)."""
        self.registered = False
        self._delays = backoff_delays()
        self._next_hello = 0.0
        self.last_rx = now
        self.watch = HandshakeWatch()

    def on_monitor_event(self, event: int) -> None:
        """One monitor event of the owner's socket; raises :class:`Unauthorized` when the coordinator
        keeps refusing the handshake (retrying cannot help)."""
        outcome = self.watch.event(event)
        if outcome == "refused":
            raise Unauthorized(ErrorCode.UNAUTHORIZED.value, self.refusal)
        if outcome != "connected":
            return
        if self.registered and self.watch.handshakes > 1:
            # The coordinator knows this peer by its connection; a new one has not proven anything yet.
            logger.info("the connection to the coordinator was re-established: registering again")
            self.registered = False
        if not self.registered:
            self._delays = backoff_delays()
            self._next_hello = 0.0  # at once

    def silent_for(self, now: float) -> float:
        return now - self.last_rx

    # ------------------------------------------------------------------ frames

    def receive(self, frame: bytes | memoryview, now: float) -> list[Message]:
        """The messages in one frame from the coordinator that are for the owner (whether it is
        registered or not: :attr:`registered` says).

        A ``HELLO_ACK`` is among them only when it starts a new session (a retried HELLO may be
        answered twice). Raises :class:`Unauthorized` when the token is refused.
        """
        try:
            messages = decode_all(frame, FROM_COORDINATOR)
        except ProtocolError as exc:
            logger.warning("dropped frame from the coordinator: %s", exc)
            return []
        self.last_rx = now
        out = []
        for item in messages:
            if isinstance(item, ProtocolError):
                logger.warning("dropped message from the coordinator: %s", item)
            elif self._handshake(item):
                out.append(item)
        return out

    def _handshake(self, message: Message) -> bool:
        """Handle the handshake's part of ``message``; True when the owner should see it."""
        header, body = message
        if header is Header.HELLO_ACK:
            if self.registered:
                return False  # a duplicate answer to a retried HELLO
            self.registered, self.ack = True, body
            self.lost_since = self._grace_ends = None
            self.session += 1
            self._delays = backoff_delays()
            self._last_heartbeat = float("-inf")  # never: the first one goes at once
            return True
        if header is Header.ERROR:
            if body.code == ErrorCode.UNAUTHORIZED.value:
                raise Unauthorized(body.code, f"the coordinator refused this peer: {body.message}")
            if body.code == ErrorCode.HELLO_REQUIRED.value:
                if self.registered:
                    logger.warning("the coordinator does not know this peer (restarted?): registering again")
                    self.registered, self._next_hello = False, 0.0
                return False
            if body.code == ErrorCode.GROUP_IN_USE.value:
                logger.warning("%s; retrying", body.message)
                return False
        return True
