"""The coordinator process's socket loop: the only code here that touches ZeroMQ.

One ROUTER socket, one thread; a monitor of disconnects is read every tick. Each frame is decoded
(a bad one is logged and dropped) and handed to the core, whose effects are performed after it
returns. Sends are gathered over a burst of received frames and flushed together: a peer that speaks
protocol 2 gets what is due to it as one ``BATCH`` frame (a result per request costs one ZeroMQ send
per client and burst instead of one per request). A send to a peer that is gone (``EHOSTUNREACH``,
the socket is ``ROUTER_MANDATORY``) goes back to the core as ``on_peer_gone``; one that finds the
peer's queue full waits here and is retried on the next pass. The loop loads no tokenizer: requests
arrive as token ids, tokenized in the caller's process.

With a fleet secret the ROUTER is a CURVE server (:mod:`megatron_serve.wire.security`): pyzmq's ZAP
authenticator admits every client key and stamps it on the connection's frames (``User-Id``), which
the core checks HELLO's proof against. A routing id whose key changes belongs to a new connection
(a peer may choose its routing id, and take a departed one's): the old peer is gone, and the new
connection has proven nothing yet. Without a secret the coordinator refuses to start unless
``insecure=True``, and then says in the log what that exposes.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import zmq
from zmq.auth import CURVE_ALLOW_ANY
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ..heap import freeze_startup_heap
from ..wire.messages import TO_COORDINATOR
from ..wire.protocol import MAX_MESSAGE_BYTES, ProtocolError, decode, pack_batches
from ..wire.security import SECRET_HINT
from ..wire.transport import close_monitored, keep_alive, open_monitor, secure_server
from .core import CoordinatorCore
from .effects import Effect, Probe, Send

logger = logging.getLogger("megatron_serve.coordinator")

_TICK_S = 0.05  # the clock's period while anything is under way
_QUIET_TICK_S = 0.5  # its longest period while the fleet is quiet (CoordinatorCore.quiet), see quiet_tick
_MAX_BURST = 512  # frames handled before the gathered sends are flushed and the clock looked at
_PROBE_DELAYS = (0.02, 0.1, 0.5, 2.0)  # after a disconnect event: when to test who is gone


class InsecureRefused(ValueError):
    """A coordinator without a fleet secret, not told that it may run insecure."""


def check_secret(secret: object | None, insecure: bool) -> None:
    """A coordinator has a fleet secret, or is told to run without one (never both)."""
    if secret is None and not insecure:
        raise InsecureRefused(f"a coordinator needs the fleet secret: {SECRET_HINT}, or pass --insecure to serve "
                              "without authentication or encryption (benchmarks only)")
    if secret is not None and insecure:
        raise ValueError("--insecure turns the fleet secret off: drop --insecure, or the secret "
                         "(--token-file / $MEGATRON_SERVE_TOKEN)")


class Coordinator:
    """The coordinator process: a :class:`CoordinatorCore` behind one ROUTER. ``run()`` serves until
    ``shutdown()`` or a signal. Keyword arguments other than the transport's go to the core (``token``:
    the fleet secret)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 5555, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 insecure: bool = False, **core_options: object) -> None:
        """``insecure``: serve without a fleet secret (no authentication, no encryption: benchmarks only);
        without it, a coordinator given no secret raises :class:`InsecureRefused`."""
        self.core = CoordinatorCore(**core_options)  # type: ignore[arg-type]
        check_secret(self.core.members.secret, insecure)
        self.host = host
        self.port = port
        self.max_message_bytes = int(max_message_bytes)
        self._stop = False
        self._fds: dict[bytes, int] = {}  # identity -> fd of its connection (for disconnect probes)
        self._probes: list[tuple[float, int]] = []  # (due, fd) after disconnect events
        self._backlog: dict[bytes, list[bytes]] = {}  # frames a full queue refused (EAGAIN), in order
        # A context of its own: its ZAP handler answers for this coordinator's sockets only.
        self.ctx = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.address: str | None = None

    # ------------------------------------------------------------------ socket

    def bind(self) -> str:
        """Bind the ROUTER (port 0 = any free port) and return the address peers should connect to."""
        sock = self.ctx.socket(zmq.ROUTER)
        if self.core.members.secret is not None:
            if self._authenticator is None:
                self._authenticator = ThreadAuthenticator(self.ctx)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=CURVE_ALLOW_ANY)  # HELLO proves the rest
            secure_server(sock, self.core.members.secret)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        keep_alive(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RCVTIMEO, int(_TICK_S * 1000))  # the loop's idle wait (see run)
        # Transport-level guard against memory exhaustion; frames between the soft limit and this
        # are dropped (and logged) by decode().
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
        bind_host = "*" if self.host in ("0.0.0.0", "*") else self.host
        try:
            if self.port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                sock.bind(f"tcp://{bind_host}:{self.port}")
        except zmq.ZMQError:
            sock.close(linger=0)  # else close() would wait for it forever (the context ends with its sockets)
            raise
        self.monitor = open_monitor(sock, zmq.EVENT_DISCONNECTED)
        self.sock = sock
        shown = "127.0.0.1" if bind_host == "*" else self.host
        self.address = f"tcp://{shown}:{self.port}"
        core = self.core
        logger.info("coordinator %s listening on %s (routing %s, %s, heartbeat timeout %.1fs, verb timeout "
                    "%.1fs, stall timeout %.1fs)", core.lifecycle.coordinator_id, self.address,
                    core.dispatcher.routing_name,
                    "encrypted, fleet secret required" if core.members.secret else "INSECURE", core.deadlines.heartbeat,
                    core.deadlines.verb, core.deadlines.stall)
        if core.members.secret is None:
            logger.warning("INSECURE (--insecure): no authentication and no encryption on %s: anyone who can reach it "
                           "can register as an engine, read every prompt and answer, and pause, stop or refit the "
                           "fleet. For benchmarks only; give the fleet a secret instead (%s)", self.address,
                           SECRET_HINT)
        return self.address

    def shutdown(self) -> None:
        """Ask ``run()`` to return after the current iteration (safe from a signal handler)."""
        self._stop = True

    def close(self) -> None:
        if self.sock is not None:
            close_monitored(self.sock, self.monitor)
            self.sock = self.monitor = None
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if not self.ctx.closed:
            self.ctx.term()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.shutdown())

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        """Serve until :meth:`shutdown`."""
        if self.sock is None:
            self.bind()
        sock, core = self.sock, self.core
        outbox: list[Effect] = []
        last_tick = -_QUIET_TICK_S
        interval, quiet_interval = _TICK_S, quiet_tick(core)
        try:
            while not self._stop:
                # The first receive of a pass blocks (up to a tick: RCVTIMEO) unless a frame is waiting;
                # the rest of the burst is read without blocking. A blocking receive on the one socket,
                # instead of a poll over it and the monitor, cut the coordinator's CPU per request at one
                # in flight from 432 to 340 us (benchmarks/coordinator_peer.py, medians of 3 A/B runs).
                # The burst ends when the socket's EVENTS say nothing more is waiting, not at a receive that
                # raises zmq.Again: just after a wake-up that costs 8-10 us of CPU against 27-34 here
                # (docs/benchmarks.md, issue 84: the coordinator's wake-ups), and most passes read one frame.
                flags = 0
                for _ in range(_MAX_BURST):
                    try:
                        identity, frame = sock.recv_multipart(flags, copy=False)
                    except zmq.Again:
                        break
                    except ValueError:  # not two frames
                        core.drop("a peer", "expected one frame per message")
                        continue
                    finally:
                        flags = zmq.NOBLOCK
                    outbox += self._on_frame(identity, frame)
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                now = time.monotonic()
                if now - last_tick >= interval:
                    last_tick = now
                    self._drain_monitor()
                    outbox += self._tick(now)
                while outbox or self._backlog:
                    outbox = self._perform(outbox)
                    if self._backlog and not outbox:
                        break  # full queues: retried on the next pass
                # The clock's period for the next pass, and the idle wait with it: a quiet fleet is woken and
                # ticked a few times a second, not 20 (docs/benchmarks.md, issue 84: the idle coordinator's CPU).
                period = quiet_interval if not (self._probes or self._backlog) and core.quiet() else _TICK_S
                if period != interval:
                    interval = period
                    sock.setsockopt(zmq.RCVTIMEO, int(period * 1000))
        finally:
            logger.info("coordinator %s stopping (%d requests in its table)", core.lifecycle.coordinator_id,
                        len(core.flow.table))
            self.close()

    def _on_frame(self, identity_frame: zmq.Frame, frame: zmq.Frame) -> list[Effect]:
        identity = identity_frame.bytes
        effects: list[Effect] = []
        key = None
        if self.core.members.secret is not None:  # the connection's key, from the handshake (0.6 us a frame)
            key = frame.get("User-Id").encode()
            proven = self.core.members.proven.get(identity)
            if proven is not None and proven != key:  # another connection took this routing id: the old one left
                effects = self._gone(identity, "its routing id now belongs to another connection")
        try:
            message = decode(frame.buffer, TO_COORDINATOR, self.max_message_bytes)
        except ProtocolError as exc:
            self.core.drop(self.core.members.peer_name(identity), str(exc))
            return effects
        effects += self.core.on_message(identity, message, time.monotonic(), key)
        # only peers are probed (CoordinatorCore.probe)
        if identity not in self._fds and identity in self.core.members.peers:
            try:
                self._fds[identity] = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                pass
        return effects

    def _gone(self, identity: bytes, reason: str) -> list[Effect]:
        """The transport lost ``identity``'s connection: forget what belonged to it, tell the core."""
        self._fds.pop(identity, None)
        return self.core.on_peer_gone(identity, reason, time.monotonic())

    def _tick(self, now: float) -> list[Effect]:
        core = self.core
        if core.drop.suppressed and int(now) != core.drop.window:
            core.drop.flush()
        if self._probes:  # peers whose connection closed: a send to a gone routing id fails
            due = {fd for t, fd in self._probes if t <= now}
            self._probes = [(t, fd) for t, fd in self._probes if t > now]
            for identity in [i for i, fd in self._fds.items() if fd in due]:
                core.probe(identity)
        return core.on_tick(now)

    def _perform(self, effects: list[Effect]) -> list[Effect]:
        """Send what the core asked for (gathered per peer); returns the core's answers to failures."""
        sock, core = self.sock, self.core
        more: list[Effect] = []
        sends: list[Send] = []
        for effect in effects:
            if isinstance(effect, Probe):
                if not self._send(sock, effect.identity, effect.frame):
                    more += self._gone(effect.identity, "probe failed")
                if effect.hello is not None:
                    more += core.on_hello_after_probe(*effect.hello, time.monotonic())
            else:
                sends.append(effect)
        # Frames a full queue left over go first and as they are: packed again, a BATCH would travel
        # inside a BATCH, which peers drop.
        outgoing, self._backlog = self._backlog, {}
        for identity, frames in frames_by_peer(sends).items():
            outgoing.setdefault(identity, []).extend(frames)
        for identity, frames in outgoing.items():
            for i, frame in enumerate(frames):
                sent = self._send(sock, identity, frame)
                if sent is None:  # its queue is full: the rest waits, in order, for the next pass
                    self._backlog[identity] = frames[i:]
                    break
                if not sent:
                    more += self._gone(identity, "send failed")
                    break
        return more

    @staticmethod
    def _send(sock: zmq.Socket, identity: bytes, frame: bytes) -> bool | None:
        """True when sent; False when the peer is gone; None when its queue is full."""
        try:
            sock.send_multipart((identity, frame), zmq.NOBLOCK, copy=len(frame) < 65536)
            return True
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                logger.warning("send failed: %s", exc)
            return False

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again included
                return
            if event.get("event") == zmq.EVENT_DISCONNECTED:
                fd, now = int(event.get("value", -1)), time.monotonic()
                self._probes.extend((now + d, fd) for d in _PROBE_DELAYS)


def quiet_tick(core: CoordinatorCore) -> float:
    """The clock's period while the fleet is quiet: a twentieth of the shortest deadline that a tick decides (an
    engine's heartbeat, its stall, a client's absence), between 50 ms and :data:`_QUIET_TICK_S`; so a deadline is
    passed by at most 5% of itself, as at the busy period, and a fleet given short deadlines (tests) ticks as often
    as a busy one."""
    deadlines = core.deadlines
    return min(_QUIET_TICK_S, max(_TICK_S, min(deadlines.heartbeat, deadlines.stall, deadlines.client) / 20))


def frames_by_peer(sends: list[Send]) -> dict[bytes, list[bytes]]:
    """Each peer's frames, in order; a peer that reads BATCH frames gets its messages in as few as fit."""
    gathered: dict[bytes, list[bytes]] = {}
    batching: set[bytes] = set()
    for send in sends:
        gathered.setdefault(send.identity, []).append(send.frame)
        if send.batch:
            batching.add(send.identity)
    return {identity: pack_batches(frames) if identity in batching and len(frames) > 1 else frames
            for identity, frames in gathered.items()}


def write_address_file(path: str, address: str) -> None:
    """Atomically publish the bound address (for parents that started us with ``--port 0``)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(address + "\n")
    os.replace(tmp, path)


def serve(coordinator: Coordinator, address_file: str | None = None, install_signals: bool = True) -> None:
    """Bind, publish the address, serve until SIGTERM/SIGINT."""
    address = coordinator.address or coordinator.bind()
    if address_file:
        write_address_file(address_file, address)
    if install_signals:
        coordinator.install_signal_handlers()
    freeze_startup_heap()
    coordinator.run()
