"""The coordinator: one process per deployment that owns routing, the request table and the lifecycle.

Engines and clients connect DEALER sockets to the coordinator's ROUTER (DESIGN sections 3 and 5).
The coordinator

* authenticates peers (``HELLO`` with an optional shared token) and drops everything else a
  stranger sends, with a log line;
* tokenizes prompts once, queues requests and routes them to engine groups (``least_loaded`` by
  default; see :mod:`megatron_serve.routing`), forwarding streamed ``TOKENS`` and the final
  ``RESULT`` to the submitting client. The tokenizer may load in a background thread (importing
  ``transformers`` takes long): the coordinator serves at once, and text prompts that arrive
  before the tokenizer is ready wait for it;
* keeps every request in its table until the client acknowledged the final result
  (``RESULT_ACK``) — a client that reconnects gets undelivered results again;
* mirrors every token an engine generated, so that when an engine dies (connection lost, send
  failure, heartbeat timeout) or drains, its unfinished requests are re-queued and continue on
  another engine from the tokens already generated. Only the engine a request is currently
  assigned to may add tokens to it, so each token and each result is delivered exactly once;
* runs the lifecycle state machine RUNNING / PAUSED / SUSPENDED / STOPPED; a verb is answered
  with ``CONTROL_ACK`` only after every connected engine acknowledged it. An engine that does not
  acknowledge a verb step within ``verb_timeout`` (its step loop hangs while its heartbeat thread
  lives on) is removed like a dead engine and kept out of the fleet until its step loop answers
  again, so a lifecycle change never waits forever. While the fleet runs, an engine with requests
  whose step loop makes no progress for ``stall_timeout`` (its heartbeats report a loop counter) is
  treated the same way, so a hung engine never keeps requests forever.

It is a single-threaded event loop over one ROUTER socket plus a socket monitor: every handler is
short and nothing blocks, so no locks are needed (a tokenizer loading in the background hands over
its result through a future that the loop polls).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from .protocol import (
    CONTROL_VERBS,
    MAX_MESSAGE_BYTES,
    STEP_OUTPUT_SCHEMA,
    TO_COORDINATOR,
    ErrorCode,
    FleetState,
    Header,
    Message,
    ProtocolError,
    Role,
    check_fields,
    decode,
    encode,
    int_list,
)
from .multimodal import PromptImage, cache_keys
from .request import DynamicInferenceRequest, EventType, FinishReason, RequestStatus, top_logprobs_from_wire
from .routing import RoutingPolicy, make_routing_policy
from .sampling_params import SamplingParams

logger = logging.getLogger("megatron_serve.coordinator")

DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_CLIENT_TIMEOUT = 600.0
# Per verb step. Below the operator's default command timeout (120 s), so that its own call gets the
# acknowledgement even when an engine hangs.
DEFAULT_VERB_TIMEOUT = 60.0
# Steps that move weights (SUSPEND may offload them, RESUME brings them back and captures CUDA graphs,
# REFIT's second step loads a checkpoint) take as long as reading a large checkpoint can.
DEFAULT_WEIGHTS_TIMEOUT = 900.0
# An engine's step loop may not move for this long while it has requests. Generous: one step may be a
# long prefill or JIT-compile kernels, and a false alarm moves all the engine's requests elsewhere.
DEFAULT_STALL_TIMEOUT = 120.0
# Image bytes one request may carry: well inside the 16 MiB frame with its prompt, and above the
# server's 10 MiB per image, so that one large image always fits.
DEFAULT_MAX_IMAGE_BYTES = 12 * 1024 * 1024
_TICK_S = 0.05
_MAX_BURST = 512  # frames handled before the periodic work runs again
_PROBE_DELAYS = (0.02, 0.1, 0.5, 2.0)  # after a disconnect event: when to test who is gone
_COMPLETED_CONTROLS_KEPT = 256
_UNRESPONSIVE_KEPT = 1024  # connections of engines dropped as unresponsive (see _drop_unresponsive), remembered

# Which headers each role may send (after HELLO).
_ALLOWED: dict[Role, frozenset[Header]] = {
    Role.ENGINE: frozenset({Header.HEARTBEAT, Header.DRAINING, Header.CONTROL_ACK, Header.ENGINE_STEP,
                            Header.HANDBACK, Header.STATUS}),
    Role.CLIENT: frozenset({Header.SUBMIT, Header.ABORT, Header.RESULT_ACK, Header.STATUS, Header.HEARTBEAT,
                            *CONTROL_VERBS, Header.REFIT}),
    Role.CONTROL: frozenset({Header.STATUS, Header.HEARTBEAT, *CONTROL_VERBS, Header.REFIT}),
}


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# ----------------------------------------------------------------------------- records


@dataclass
class EngineRecord:
    """One registered engine group, as the coordinator sees it (implements ``routing.EngineView``)."""

    engine_id: str
    identity: bytes
    group: int
    capacity: int
    info: dict[str, Any]
    state: str = FleetState.RUNNING.value
    draining: bool = False
    stopping: bool = False
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    last_heartbeat: float = field(default_factory=time.time)  # wall clock, for humans
    last_seen: float = field(default_factory=time.monotonic)  # for the timeout
    assigned: set[str] = field(default_factory=set)
    completed: int = 0  # requests this engine finished (for STATUS and balance checks)
    epoch: int = 0  # generation of the weights it serves (from its HELLO, then its REFIT acks)
    weights: str | None = None  # where those weights came from
    last_refit: dict[str, Any] = field(default_factory=dict)  # timings of its last REFIT
    cached_tokens: int = 0  # prompt tokens the engine skipped thanks to its prefix cache (its heartbeat)
    computed_tokens: int = 0  # tokens the engine ran through its model (its heartbeat)
    metrics: dict[str, Any] | None = None  # its cumulative engine metrics (last heartbeat's ``metrics``)
    progress: int | None = None  # its step loop's iteration counter (last heartbeat's ``progress``); None: unknown
    stall_clock: float = field(default_factory=time.monotonic)  # a stall of its step loop is measured from here

    @property
    def load(self) -> int:
        return len(self.assigned)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.engine_id,
            "group": self.group,
            "state": FleetState.DRAINING.value if self.draining else self.state,
            "running": self.running,
            "waiting": self.waiting,
            "kv_blocks_free": self.kv_blocks_free,
            "kv_blocks_total": self.kv_blocks_total,
            "last_heartbeat": self.last_heartbeat,
            "assigned": self.load,
            "completed": self.completed,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "progress": self.progress,
            "capacity": self.capacity,
            "info": self.info,
            "epoch": self.epoch,
            "weights": self.weights,
            "last_refit": self.last_refit or None,
            "metrics": self.metrics,
        }


@dataclass
class ClientRecord:
    client_id: str
    role: Role
    identity: bytes | None
    acks: bool
    last_seen: float = field(default_factory=time.monotonic)
    offline_since: float | None = None
    requests: set[str] = field(default_factory=set)


@dataclass
class RequestRecord:
    """A request from SUBMIT until the client acknowledged its RESULT."""

    key: str  # "<client_id>/<client_request_id>": unique, also the engine-side request_id
    client_id: str
    client_request_id: Any
    request: DynamicInferenceRequest
    stream: bool
    phase: str = "queued"  # queued | dispatched | finished
    engine_id: str | None = None
    moves: int = 0
    final_data: dict[str, Any] | None = None  # the RESULT's request, once finished

    # routing.RequestView
    @property
    def request_id(self) -> str:
        return self.key

    @property
    def prompt_tokens(self) -> list[int]:
        """As the prefix cache keys them: an image's placeholder tokens stand for its content."""
        return cache_keys(self.request.prompt_tokens, self.request.images)


@dataclass
class ControlOp:
    """One lifecycle verb in progress: a list of engine steps, each acknowledged by every engine."""

    control_id: Any
    verb: Header
    client_id: str
    level: int = 1
    drain_timeout: float | None = None
    steps: list[Header] = field(default_factory=list)
    step_index: int = -1
    waiting: set[str] = field(default_factory=set)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    previous_state: str = ""
    target_state: str = ""
    noop: bool = False
    started: float = field(default_factory=time.monotonic)
    step_started: float = 0.0  # when the current step was broadcast: its acknowledgement deadline starts there
    unresponsive: list[str] = field(default_factory=list)  # engines removed for missing a step's deadline
    source: str | None = None  # REFIT: the new weights
    epoch: int | None = None  # REFIT: the generation they become
    failed: dict[str, str] = field(default_factory=dict)  # REFIT: engine id -> why it could not load


class IllegalTransition(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.ILLEGAL_TRANSITION) -> None:
        super().__init__(message)
        self.code = code


class _DropLog:
    """Logs dropped frames: at most ``per_second`` lines a second, plus the first of each kind.

    A flood of garbage must neither fill the disk nor hide what is happening: beyond the budget
    only a reason not yet seen in this second is logged (so an oversize frame is not hidden by ten
    thousand syntax errors), and the rest are counted in one summary line.
    """

    def __init__(self, per_second: int = 20, max_kinds: int = 50) -> None:
        self.per_second = per_second
        self.max_kinds = max_kinds
        self.window = 0
        self.logged = 0
        self.kinds: set[str] = set()
        self.suppressed = 0
        self.total = 0

    def __call__(self, peer: str, reason: str) -> None:
        self.total += 1
        now = int(time.monotonic())
        if now != self.window:
            self.flush()
            self.window = now
        kind = reason[:24]
        if self.logged < self.per_second or (kind not in self.kinds and len(self.kinds) < self.max_kinds):
            self.logged += 1
            self.kinds.add(kind)
            logger.warning("dropped frame from %s: %s", peer, reason)
        else:
            self.suppressed += 1

    def flush(self) -> None:
        if self.suppressed:
            logger.warning("dropped %d more frames in the last second (log lines suppressed)", self.suppressed)
        self.logged = 0
        self.suppressed = 0
        self.kinds.clear()


# ----------------------------------------------------------------------------- coordinator


class Coordinator:
    """The coordinator process's state and event loop. ``run()`` serves until ``shutdown()`` or a signal."""

    def __init__(
        self,
        tokenizer: TokenizerLike | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 5555,
        token: str | None = None,
        routing: str = "least_loaded",
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
        verb_timeout: float = DEFAULT_VERB_TIMEOUT,
        weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        dispatch_factor: float = 2.0,
        model: str | None = None,
        tokenizer_loader: Callable[[], TokenizerLike] | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    ) -> None:
        """``tokenizer_loader``: instead of ``tokenizer``, builds it in a background thread started by
        ``run()``, so that peers can connect meanwhile (see _release_held_prompts).
        ``max_image_bytes``: image file bytes one request may carry (more is refused with ERROR)."""
        if tokenizer is not None and tokenizer_loader is not None:
            raise ValueError("pass a tokenizer or a tokenizer_loader, not both")
        self.tokenizer = tokenizer
        self.max_image_bytes = max_image_bytes
        self._tokenizer_loader = tokenizer_loader
        # The loader thread's only output: (tokenizer, seconds) or its exception, taken by _tick.
        self._tokenizer_loading: concurrent.futures.Future[tuple[TokenizerLike, float]] | None = None
        self._tokenizer_error: str | None = None  # why text prompts cannot be tokenized (the load failed)
        self._held: list[str] = []  # keys of text prompts waiting for the tokenizer, in arrival order
        self.host = host
        self.port = port
        self.token = token or None
        self.routing_name = routing
        self.policy: RoutingPolicy = make_routing_policy(routing)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.client_timeout = float(client_timeout)
        self.verb_timeout = float(verb_timeout)
        self.weights_timeout = float(weights_timeout)
        self.stall_timeout = float(stall_timeout)
        self.max_message_bytes = int(max_message_bytes)
        self.dispatch_factor = float(dispatch_factor)
        self.coordinator_id = uuid.uuid4().hex[:12]
        # Weights generation: engines started from ``model`` that register with another epoch load
        # ``weights_source`` first (None: nothing was refitted, the model directory itself is current).
        self.model = model
        self.epoch = 0
        self.weights_source: str | None = None
        self.refits = 0

        self.state = FleetState.RUNNING
        self.suspend_level = 0
        self.peers: dict[bytes, tuple[Role, str]] = {}  # identity -> (role, engine_id | client_id)
        self.peer_fds: dict[bytes, int] = {}
        self.engines: dict[str, EngineRecord] = {}
        self.clients: dict[str, ClientRecord] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.queue: collections.deque[str] = collections.deque()
        self.completed = 0
        self.failed = 0
        self.aborted = 0  # by a client, or by the fleet (a pause in abort mode): neither is a failure
        self.stale_outputs = 0
        self.controls: collections.deque[ControlOp] = collections.deque()
        self.completed_controls: collections.OrderedDict[Any, tuple[Header, dict[str, Any]]] = collections.OrderedDict()
        self._registrations = 0
        self._probes: list[tuple[float, int]] = []  # (due, fd) after disconnect events
        self._undelivered: set[str] = set()  # finished, but the RESULT send failed: retried by _tick
        self._hello_required_sent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        # identity -> engine id of engines removed as unresponsive (see _drop_unresponsive)
        self._unresponsive: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._drop = _DropLog()
        self._stop = False
        self._advancing = False
        self._last_sweep = time.monotonic()
        self._last_retry = time.monotonic()

        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.address: str | None = None

    # ------------------------------------------------------------------ socket plumbing

    def bind(self) -> str:
        """Bind the ROUTER (port 0 = any free port) and return the address peers should connect to."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Transport-level guard against memory exhaustion; frames between the soft limit and this
        # are dropped (and logged) by decode().
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
        bind_host = "*" if self.host in ("0.0.0.0", "*") else self.host
        if self.port == 0:
            self.port = sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            sock.bind(f"tcp://{bind_host}:{self.port}")
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock = sock
        shown = "127.0.0.1" if bind_host == "*" else self.host
        self.address = f"tcp://{shown}:{self.port}"
        logger.info(
            "coordinator %s listening on %s (routing %s, token %s, heartbeat timeout %.1fs, verb timeout %.1fs, "
            "stall timeout %.1fs)", self.coordinator_id, self.address, self.routing_name,
            "required" if self.token else "not required", self.heartbeat_timeout, self.verb_timeout,
            self.stall_timeout,
        )
        return self.address

    def shutdown(self) -> None:
        """Ask ``run()`` to return after the current iteration (safe from a signal handler)."""
        self._stop = True

    def close(self) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
            self.monitor = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.shutdown())

    def run(self) -> None:
        """Serve until :meth:`shutdown`."""
        if self.sock is None:
            self.bind()
        if self._tokenizer_loader is not None and self.tokenizer is None and self._tokenizer_loading is None:
            self._start_tokenizer_load(self._tokenizer_loader)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self._stop:
                events = dict(poller.poll(int(_TICK_S * 1000)))
                if self.monitor in events:
                    self._drain_monitor()
                if self.sock in events:
                    for _ in range(_MAX_BURST):
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(parts)
                self._tick()
        finally:
            logger.info("coordinator %s stopping (%d queued, %d in flight)", self.coordinator_id,
                        self._count("queued"), self._count("dispatched"))
            self.close()

    def _start_tokenizer_load(self, loader: Callable[[], TokenizerLike]) -> None:
        """Run ``loader`` in a daemon thread; its result reaches the event loop through a future only."""
        future: concurrent.futures.Future[tuple[TokenizerLike, float]] = concurrent.futures.Future()

        def load() -> None:
            started = time.monotonic()
            try:
                tokenizer = loader()
            except BaseException as exc:  # noqa: BLE001 - whatever it is, the event loop reports it
                future.set_exception(exc)
            else:
                future.set_result((tokenizer, time.monotonic() - started))

        self._tokenizer_loading = future
        logger.info("loading the tokenizer in the background: token ids are served now, text prompts wait for it")
        threading.Thread(target=load, name="tokenizer-loader", daemon=True).start()

    def _send(self, identity: bytes | None, header: Header, body: dict[str, Any]) -> bool:
        """Send one message; False when the peer is gone (EHOSTUNREACH) or its queue is full."""
        if identity is None or self.sock is None:
            return False
        try:
            frame = encode(header, body)
        except ProtocolError as exc:
            logger.error("cannot send %s: %s", header.name, exc)
            return False
        try:
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                logger.warning("send %s failed: %s", header.name, exc)
            return False

    def _peer_name(self, identity: bytes) -> str:
        known = self.peers.get(identity)
        return f"{known[0].value} {known[1]}" if known else f"peer {identity.hex()}"

    # ------------------------------------------------------------------ frames in

    def _on_frames(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        if len(parts) != 2:
            self._drop(self._peer_name(identity), f"expected one frame per message, got {len(parts) - 1}")
            return
        frame = parts[1]
        try:
            msg = decode(frame.bytes, TO_COORDINATOR, self.max_message_bytes)
        except ProtocolError as exc:
            self._drop(self._peer_name(identity), str(exc))
            return
        if msg.header is Header.HELLO:
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            self._on_hello(identity, fd, msg.body)
            return
        known = self.peers.get(identity)
        if known is None:
            if self._on_unresponsive_frame(identity, msg.header):
                return
            self._drop(self._peer_name(identity), f"{msg.header.name} before a successful HELLO")
            self._hello_required(identity)
            return
        role, who = known
        if msg.header not in _ALLOWED[role]:
            self._drop(self._peer_name(identity), f"role {role.value} may not send {msg.header.name}")
            self._send(identity, Header.ERROR, {"code": ErrorCode.FORBIDDEN.value,
                                                "message": f"role {role.value} may not send {msg.header.name}"})
            return
        try:
            if role is Role.ENGINE:
                engine = self.engines.get(who)
                if engine is None:  # removed (e.g. timed out) while frames were in flight
                    self.peers.pop(identity, None)
                    self._drop(self._peer_name(identity), f"{msg.header.name} from an engine that was removed")
                    self._hello_required(identity)
                    return
                engine.last_seen = time.monotonic()
                self._on_engine_message(engine, msg)
            else:
                client = self.clients[who]
                client.last_seen = time.monotonic()
                self._on_client_message(client, identity, msg)
        except ProtocolError as exc:
            self._drop(self._peer_name(identity), str(exc))

    def _on_unresponsive_frame(self, identity: bytes, header: Header) -> bool:
        """A frame from an engine removed as unresponsive; True when handled (nothing else to do).

        Its heartbeats come from a thread of their own and say nothing about its step loop: they are
        answered, so that its link neither re-registers nor reconnects under a new identity, but the
        engine stays out of the fleet (it would swallow requests and stall the next verb). Any other
        frame (the late acknowledgement, step outputs) comes from the step loop: the engine works
        again and is told to HELLO again, like an engine presumed lost that comes back (its stale
        work was re-queued; it drops it on registering).
        """
        engine_id = self._unresponsive.get(identity)
        if engine_id is None:
            return False
        if header is Header.HEARTBEAT:
            self._send(identity, Header.HEARTBEAT, self._heartbeat_body())
            return True
        del self._unresponsive[identity]
        logger.info("engine %s, removed as unresponsive, answers again (%s): it may register again",
                    engine_id, header.name)
        return False

    def _hello_required(self, identity: bytes) -> None:
        """Tell an unknown (but protocol-speaking) peer to HELLO again, at most once a second."""
        now = time.monotonic()
        last = self._hello_required_sent.get(identity)
        if last is not None and now - last < 1.0:
            return
        self._hello_required_sent[identity] = now
        self._hello_required_sent.move_to_end(identity)
        while len(self._hello_required_sent) > 4096:
            self._hello_required_sent.popitem(last=False)
        self._send(identity, Header.ERROR, {"code": ErrorCode.HELLO_REQUIRED.value,
                                            "message": f"coordinator {self.coordinator_id} does not know this peer: send HELLO"})

    def _on_hello(self, identity: bytes, fd: int, body: dict[str, Any]) -> None:
        if self.token is not None:
            offered = body.get("token")
            if not isinstance(offered, str) or not hmac.compare_digest(offered.encode(), self.token.encode()):
                self._drop(self._peer_name(identity), "HELLO with a missing or wrong token")
                if identity in self.peers:
                    self._forget_peer(identity, "re-HELLO with a wrong token")
                self._send(identity, Header.ERROR, {"code": ErrorCode.UNAUTHORIZED.value,
                                                    "message": "missing or wrong token: pass --token-file or MEGATRON_SERVE_TOKEN"})
                return
        try:
            role = Role(body["role"])
        except ValueError:
            self._drop(self._peer_name(identity), f"HELLO with unknown role {body['role']!r}")
            self._send(identity, Header.ERROR, {"code": ErrorCode.INVALID_REQUEST.value,
                                                "message": f"unknown role {body['role']!r} (client, engine or control)"})
            return
        known = self.peers.get(identity)
        if known is not None:
            if known[0] is role:  # a retried HELLO on the same connection: answer it again
                self._ack_hello_again(identity, known)
                return
            self._forget_peer(identity, "re-registered with another role")
        self.peer_fds[identity] = fd
        if role is Role.ENGINE:
            self._register_engine(identity, body)
        else:
            self._register_client(identity, role, body)

    def _ack_hello_again(self, identity: bytes, known: tuple[Role, str]) -> None:
        body: dict[str, Any] = {"coordinator_id": self.coordinator_id, "state": self.state.value}
        engine = self.engines.get(known[1]) if known[0] is Role.ENGINE else None
        if engine is not None:
            body.update(engine_id=engine.engine_id, engine_group=engine.group, suspend_level=self.suspend_level,
                        heartbeat_interval=1.0)
        self._send(identity, Header.HELLO_ACK, body)

    def _register_engine(self, identity: bytes, body: dict[str, Any]) -> None:
        group = body.get("engine_group")
        in_use = {e.group: e for e in self.engines.values()}
        if group is not None:
            holder = in_use.get(group)
            if holder is not None and not self._send(holder.identity, Header.HEARTBEAT, self._heartbeat_body()):
                self._remove_engine(holder, "unreachable (its group re-registered)")
                holder = None
            if holder is not None:
                logger.warning("engine HELLO for group %d refused: held by live engine %s", group, holder.engine_id)
                self._send(identity, Header.ERROR, {"code": ErrorCode.GROUP_IN_USE.value,
                                                    "message": f"engine group {group} is held by live engine {holder.engine_id}"})
                self.peer_fds.pop(identity, None)
                return
        else:
            group = 0
            while group in in_use:
                group += 1
        capacity = body.get("capacity") or 16
        self._registrations += 1
        engine_id = f"e{self._registrations}-g{group}"
        info = dict(body.get("info") or {})
        engine = EngineRecord(engine_id=engine_id, identity=identity, group=group, capacity=max(1, int(capacity)),
                              info=info, kv_blocks_total=int(info.get("kv_blocks_total", 0) or 0),
                              kv_blocks_free=int(info.get("kv_blocks_total", 0) or 0))
        engine.state = self._engine_adopted_state()
        refit = self._weights_for(engine)
        self.engines[engine_id] = engine
        self.peers[identity] = (Role.ENGINE, engine_id)
        self._unresponsive.pop(identity, None)
        ack_body = {
            "coordinator_id": self.coordinator_id,
            "state": self.state.value,
            "engine_id": engine_id,
            "engine_group": group,
            "suspend_level": self.suspend_level,
            "heartbeat_interval": 1.0,
        }
        if refit is not None:
            ack_body["refit"] = refit
        ok = self._send(identity, Header.HELLO_ACK, ack_body)
        if not ok:
            self._remove_engine(engine, "HELLO_ACK could not be sent")
            return
        logger.info("engine %s registered: group %d, capacity %d, adopts state %s%s", engine_id, group,
                    engine.capacity, self.state.value,
                    "".join(f", {k} {info[k]}" for k in ("host", "pid") if k in info))
        self._dispatch()

    def _same_model(self, engine: EngineRecord) -> bool:
        """Whether the engine was started from this coordinator's model (unknown on either side: yes).

        An engine of another model is part of a rolling replacement: it is neither synced to the
        refitted weights nor taken as the source of truth about them (STATUS flags its epoch).
        """
        theirs = engine.info.get("model")
        if not self.model or not isinstance(theirs, str):
            return True
        return os.path.normpath(theirs) == os.path.normpath(self.model)

    def _weights_for(self, engine: EngineRecord) -> dict[str, Any] | None:
        """At registration: the ``refit`` an engine must load before serving, if any.

        A coordinator that never refitted (e.g. it restarted) adopts the weights of the first
        registering engine of its model that reports a refit, so the fleet's epoch survives a
        coordinator restart; engines that then register with other weights load them.
        """
        epoch = engine.info.get("epoch")
        engine.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
        weights = engine.info.get("weights")
        engine.weights = weights if isinstance(weights, str) else None
        if not self._same_model(engine):
            return None
        if self.weights_source is None:
            if engine.epoch > self.epoch and engine.weights is not None and \
                    all(e.epoch == self.epoch for e in self.engines.values() if self._same_model(e)):
                self.epoch, self.weights_source = engine.epoch, engine.weights
                logger.info("adopted weights epoch %d (%s) from engine %s", self.epoch, self.weights_source,
                            engine.engine_id)
            return None
        if engine.epoch == self.epoch and engine.weights == self.weights_source:
            return None
        logger.info("engine %s serves epoch %d: it loads the fleet's epoch %d (%s) before serving",
                    engine.engine_id, engine.epoch, self.epoch, self.weights_source)
        engine.epoch, engine.weights = self.epoch, self.weights_source  # it exits if it cannot
        return {"source": self.weights_source, "epoch": self.epoch}

    def _engine_adopted_state(self) -> str:
        return FleetState.PAUSED.value if self.state is FleetState.STOPPED else self.state.value

    def _register_client(self, identity: bytes, role: Role, body: dict[str, Any]) -> None:
        client_id = body.get("client_id") or uuid.uuid4().hex
        client = self.clients.get(client_id)
        if client is None:
            client = ClientRecord(client_id=client_id, role=role, identity=identity, acks=bool(body.get("acks")))
            self.clients[client_id] = client
        else:
            if client.identity is not None and client.identity != identity:
                self.peers.pop(client.identity, None)
            client.identity = identity
            client.acks = bool(body.get("acks"))
            client.offline_since = None
        client.last_seen = time.monotonic()
        self.peers[identity] = (role, client_id)
        self._send(identity, Header.HELLO_ACK, {"coordinator_id": self.coordinator_id, "state": self.state.value})
        logger.debug("%s %s connected", role.value, client_id)
        # Results that finished while the client was away.
        for key in list(client.requests):
            record = self.requests.get(key)
            if record is not None and record.phase == "finished":
                self._deliver(record)
        # A control verb that was in progress when the client lost its connection answers on the new one.

    def _forget_peer(self, identity: bytes, reason: str) -> None:
        known = self.peers.pop(identity, None)
        self.peer_fds.pop(identity, None)
        if known is None:
            return
        role, who = known
        if role is Role.ENGINE:
            engine = self.engines.get(who)
            if engine is not None:
                self._remove_engine(engine, reason)
        else:
            client = self.clients.get(who)
            if client is not None and client.identity == identity:
                client.identity = None
                client.offline_since = time.monotonic()
                if not client.requests:
                    del self.clients[who]

    # ------------------------------------------------------------------ clients

    def _on_client_message(self, client: ClientRecord, identity: bytes, msg: Message) -> None:
        header, body = msg
        if header is Header.SUBMIT:
            self._on_submit(client, identity, body)
        elif header is Header.ABORT:
            self._on_abort(client, body)
        elif header is Header.RESULT_ACK:
            for crid in body["client_request_ids"]:
                key = self._key(client.client_id, crid)
                record = self.requests.get(key)
                if record is not None and record.phase == "finished":
                    self._forget_request(record)
        elif header is Header.STATUS:
            reply = self.status()
            if body.get("status_id") is not None:
                reply["status_id"] = body["status_id"]
            self._send(identity, Header.STATUS_REPLY, reply)
        elif header is Header.HEARTBEAT:
            self._send(identity, Header.HEARTBEAT, self._heartbeat_body())
        elif header in CONTROL_VERBS or header is Header.REFIT:
            self._on_control(client, identity, header, body)

    @staticmethod
    def _key(client_id: str, client_request_id: Any) -> str:
        return f"{client_id}/{client_request_id}"

    def _on_submit(self, client: ClientRecord, identity: bytes, body: dict[str, Any]) -> None:
        crid = body["client_request_id"]
        key = self._key(client.client_id, crid)
        record = self.requests.get(key)
        if record is not None:
            # Resubmission after a reconnect: the request is already ours. Send what the client missed.
            have = len(body.get("generated_tokens") or [])
            tokens = record.request.generated_tokens
            if record.stream and record.phase != "finished" and len(tokens) > have:
                self._send(identity, Header.TOKENS, self._tokens_body(record, tokens[have:],
                                                                      record.request.generated_log_probs[have:], None))
            if record.phase == "finished":
                self._deliver(record)
            return
        held = False
        try:
            params = SamplingParams.from_dict(body.get("sampling_params"))
            prompt = body["prompt"]
            images = self._submitted_images(body.get("images") or [])
            if isinstance(prompt, str):
                prompt_text: str | None = prompt
                prompt_tokens = []
            else:
                prompt_text = None
                prompt_tokens = int_list(prompt, "prompt")
                if not prompt_tokens:
                    raise ValueError("prompt is empty")
            generated = int_list(list(body.get("generated_tokens") or []), "generated_tokens")
            request = DynamicInferenceRequest(request_id=key, prompt=prompt_text, prompt_tokens=prompt_tokens,
                                              sampling_params=params, generated_tokens=generated, images=images)
            # text, and images to place, need the tokenizer: such prompts wait while it loads
            held = self._tokenizer_loading is not None and (bool(prompt_text) or any(not i.placed for i in images))
            if not held:
                self._prepare_prompt(request)
        except (ValueError, TypeError) as exc:
            self._send(identity, Header.ERROR, {"code": ErrorCode.INVALID_REQUEST.value, "message": str(exc),
                                                "client_request_id": crid})
            return
        record = RequestRecord(key=key, client_id=client.client_id, client_request_id=crid, request=request,
                               stream=bool(body.get("stream")))
        self.requests[key] = record
        client.requests.add(key)
        if held:  # a record already, so that it can be aborted, resubmitted and counted as queued
            self._held.append(key)
            return
        self._enqueue(record)
        self._dispatch()

    def _submitted_images(self, raw: list) -> list[PromptImage]:
        """The SUBMIT's images, within this coordinator's limit on image bytes per request."""
        images = [PromptImage.from_wire(image, f"images[{index}]") for index, image in enumerate(raw)]
        total = sum(len(image.data) for image in images)
        if total > self.max_image_bytes:
            raise ValueError(f"the request's {len(images)} image(s) hold {total} bytes; this coordinator accepts at "
                             f"most {self.max_image_bytes} bytes of images per request (--max-request-image-bytes)")
        if any(image.placed for image in images) and not all(image.placed for image in images):
            raise ValueError("either every image of a request is placed (offset and length) or none is")
        return images

    def _prepare_prompt(self, request: DynamicInferenceRequest) -> None:
        """Tokenize a text prompt and place its images (expand their placeholders); ``ValueError`` says why not."""
        if request.prompt is not None:
            request.prompt_tokens = self._tokenize(request.prompt)
        if not request.images or request.images[0].placed:
            return  # placed images are checked by the engine, which reads them anyway
        processor = getattr(self.tokenizer, "images", None)
        if processor is None:
            raise ValueError(self._tokenizer_error or "the served model takes no images (it is not a "
                             "vision-language model, or this coordinator has no model directory)")
        request.prompt_tokens, request.images = processor.expand(request.prompt_tokens,
                                                                 [image.data for image in request.images])

    def _tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt; ``ValueError`` saying why when there are none."""
        if not text:
            raise ValueError("prompt is empty")
        if self.tokenizer is None:
            raise ValueError(self._tokenizer_error or "this coordinator has no tokenizer: send token ids")
        tokens = list(self.tokenizer.encode(text))
        if not tokens:
            raise ValueError("prompt is empty")
        return tokens

    def _enqueue(self, record: RequestRecord) -> None:
        """Queue a new (or resubmitted) request for dispatch."""
        if self._finish_if_exhausted(record, "length reached before resubmission"):
            return
        self.queue.append(record.key)

    def _release_held_prompts(self) -> None:
        """The tokenizer finished loading: adopt it (or its failure) and queue the held text prompts.

        They are tokenized in arrival order; when the load failed they are refused like any text
        prompt from now on (``ERROR`` naming the problem) while token ids keep being served.
        """
        future, self._tokenizer_loading = self._tokenizer_loading, None
        try:
            self.tokenizer, seconds = future.result()
            logger.info("tokenizer ready (loaded in %.1fs); %d waiting text prompt(s) released", seconds,
                        len(self._held))
        except BaseException as exc:  # noqa: BLE001 - the loader's own failure, whatever it is
            self._tokenizer_error = (f"this coordinator could not load its tokenizer ({type(exc).__name__}: {exc}): "
                                     "send token ids, or fix the model directory's tokenizer files and restart it")
            logger.error("%s; refusing %d waiting text prompt(s)", self._tokenizer_error, len(self._held))
        held, self._held = self._held, []
        for key in held:
            record = self.requests.get(key)
            if record is None or record.phase != "queued":
                continue  # aborted, or its client went away
            try:
                self._prepare_prompt(record.request)
            except (ValueError, TypeError) as exc:
                client = self.clients.get(record.client_id)
                self._send(client.identity if client else None, Header.ERROR,
                           {"code": ErrorCode.INVALID_REQUEST.value, "message": str(exc),
                            "client_request_id": record.client_request_id})
                self._forget_request(record)
                continue
            self._enqueue(record)

    def _on_abort(self, client: ClientRecord, body: dict[str, Any]) -> None:
        record = self.requests.get(self._key(client.client_id, body["client_request_id"]))
        if record is None or record.phase == "finished":
            return
        self._abort_record(record, "aborted by the client")

    def _abort_record(self, record: RequestRecord, message: str) -> None:
        if record.phase == "dispatched":
            engine = self.engines.get(record.engine_id or "")
            if engine is not None:
                engine.assigned.discard(record.key)
                self._send(engine.identity, Header.ABORT, {"request_id": record.key})
        record.request.fail(message, FinishReason.ABORT)
        self._finish(record, record.request)

    def _tokens_body(self, record: RequestRecord, tokens: list[int], logprobs: list[float],
                     text: str | None, top_logprobs: list | None = None) -> dict[str, Any]:
        if text is None:
            text = self._decode(tokens)
        body: dict[str, Any] = {"client_request_id": record.client_request_id, "new_tokens": list(tokens),
                                "new_text": text}
        if record.request.sampling_params.return_log_probs:
            body["logprobs"] = list(logprobs)
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
        return body

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None or not tokens:
            return ""
        try:
            return self.tokenizer.decode(list(tokens))
        except Exception:  # a foreign engine may report ids the tokenizer rejects
            return ""

    def _finish(self, record: RequestRecord, final: DynamicInferenceRequest,
                final_data: dict[str, Any] | None = None) -> None:
        """Record the final state of a request and deliver it.

        ``final_data``: the engine's serialized record that ``final`` was parsed (validated) from;
        it is forwarded as is instead of being serialized again (a fifth of the per-request cost).
        """
        record.phase = "finished"
        record.engine_id = None
        if final.generated_text is None:
            final.generated_text = self._decode(final.generated_tokens)
            if final_data is not None:
                final_data["generated_text"] = final.generated_text
        record.request = final
        record.final_data = final_data if final_data is not None else final.to_dict()
        if final.status is RequestStatus.COMPLETED:
            self.completed += 1
        elif final.finish_reason is FinishReason.ABORT:
            self.aborted += 1
        else:
            self.failed += 1
        self._deliver(record)

    def _deliver(self, record: RequestRecord) -> None:
        client = self.clients.get(record.client_id)
        if client is None or client.identity is None:
            return  # kept until the client comes back (or times out)
        data = dict(record.final_data or record.request.to_dict())
        data["request_id"] = record.client_request_id
        sent = self._send(client.identity, Header.RESULT, {"client_request_id": record.client_request_id,
                                                           "request": data})
        if not sent:
            self._undelivered.add(record.key)
            return
        self._undelivered.discard(record.key)
        if not client.acks:
            self._forget_request(record)

    def _forget_request(self, record: RequestRecord) -> None:
        self.requests.pop(record.key, None)
        self._undelivered.discard(record.key)
        client = self.clients.get(record.client_id)
        if client is not None:
            client.requests.discard(record.key)
            if client.identity is None and not client.requests:
                del self.clients[client.client_id]

    # ------------------------------------------------------------------ engines

    def _on_engine_message(self, engine: EngineRecord, msg: Message) -> None:
        header, body = msg
        if header is Header.HEARTBEAT:
            engine.last_heartbeat = time.time()
            for name in ("running", "waiting", "kv_blocks_free", "kv_blocks_total", "cached_tokens", "computed_tokens"):
                if body.get(name) is not None:
                    setattr(engine, name, int(body[name]))
            if body.get("state"):
                engine.state = str(body["state"])
            if body.get("stats") is not None:
                engine.stats = dict(body["stats"])
            if body.get("metrics") is not None:
                engine.metrics = body["metrics"]  # passed through to STATUS for the servers' /metrics
            self._note_progress(engine, body.get("progress"))
            self._send(engine.identity, Header.HEARTBEAT, self._heartbeat_body())
        elif header is Header.ENGINE_STEP:
            self._check_engine_id(engine, body)
            self._on_step(engine, body["outputs"])
        elif header is Header.CONTROL_ACK:
            self._on_engine_ack(engine, body)
        elif header is Header.DRAINING:
            if not engine.draining:
                engine.draining = True
                self.policy.forget(engine.engine_id)  # its prefix cache leaves with it
                logger.info("engine %s is draining: no new requests routed to it (%d assigned)",
                            engine.engine_id, engine.load)
        elif header is Header.HANDBACK:
            self._check_engine_id(engine, body)
            ids = [i for i in body["request_ids"] if isinstance(i, str)]
            moved = 0
            for key in ids:
                record = self.requests.get(key)
                if record is not None and record.phase == "dispatched" and record.engine_id == engine.engine_id:
                    engine.assigned.discard(key)
                    self._requeue(record, f"handed back by engine {engine.engine_id}")
                    moved += 1
            self._send(engine.identity, Header.HANDBACK, {"request_ids": ids})
            if body.get("final"):
                self._remove_engine(engine, "left after draining", expected=True)
            elif moved:
                logger.info("engine %s handed back %d request(s)", engine.engine_id, moved)
            self._dispatch()
        elif header is Header.STATUS:
            self._send(engine.identity, Header.STATUS_REPLY, self.status())

    @staticmethod
    def _note_progress(engine: EngineRecord, progress: int | None) -> None:
        """Restart the engine's stall clock when its step loop's counter changed (see _expire_stalled_engines)."""
        if progress != engine.progress:
            engine.progress = progress
            engine.stall_clock = time.monotonic()

    @staticmethod
    def _check_engine_id(engine: EngineRecord, body: dict[str, Any]) -> None:
        if body.get("engine_id") != engine.engine_id:
            # Output of an earlier registration of this same socket: its requests were re-queued.
            raise ProtocolError(f"stale message for registration {body.get('engine_id')!r} (now {engine.engine_id})")

    def _on_step(self, engine: EngineRecord, outputs: list[Any]) -> None:
        for out in outputs:
            if not isinstance(out, dict):
                self._drop(engine.engine_id, "ENGINE_STEP output is not a map")
                continue
            try:
                check_fields(out, STEP_OUTPUT_SCHEMA, "ENGINE_STEP output")
                new_tokens = int_list(out["new_tokens"], "new_tokens")
            except ProtocolError as exc:
                self._drop(engine.engine_id, str(exc))
                continue
            record = self.requests.get(out["request_id"])
            if record is None or record.phase != "dispatched" or record.engine_id != engine.engine_id:
                self.stale_outputs += 1  # aborted, or moved to another engine: never deliver twice
                continue
            request = record.request
            new_log_probs = list(out.get("new_log_probs") or [])
            new_top = out.get("new_top_logprobs") or []
            if new_tokens:
                request.generated_tokens.extend(new_tokens)
                request.generated_log_probs.extend(new_log_probs)
                request.generated_top_n_logprobs.extend(top_logprobs_from_wire(new_top))
                self._mirror_epochs(request, len(new_tokens), out.get("epochs"))
                request.status = RequestStatus.ACTIVE
                if record.stream:
                    client = self.clients.get(record.client_id)
                    if client is not None and client.identity is not None:
                        self._send(client.identity, Header.TOKENS,
                                   self._tokens_body(record, new_tokens, new_log_probs, out.get("new_text") or "",
                                                     new_top))
            if out["finished"]:
                engine.assigned.discard(record.key)
                engine.completed += 1
                final, final_data = request, None
                if out.get("request") is not None:
                    try:
                        final = DynamicInferenceRequest.from_dict(out["request"])  # validates the record
                        final.request_id = record.key
                        final_data = out["request"]
                    except (KeyError, ValueError, TypeError, AttributeError) as exc:
                        self._drop(engine.engine_id, f"unreadable final request {record.key}: {exc}")
                        final = request
                if not final.finished:
                    final.status = RequestStatus.COMPLETED
                    final_data = None
                self._finish(record, final, final_data)
        self._dispatch()

    @staticmethod
    def _mirror_epochs(request: DynamicInferenceRequest, n: int, epochs: Any) -> None:
        """Keep the per-token weight epochs with the mirrored tokens (-1: not reported)."""
        ok = isinstance(epochs, list) and len(epochs) == 2 and all(
            isinstance(e, list) and len(e) == n and all(isinstance(x, int) for x in e) for e in epochs)
        policy, kv = epochs if ok else ([-1] * n, [-1] * n)
        request.policy_epochs.extend(policy)
        request.kv_epochs.extend(kv)

    def _requeue(self, record: RequestRecord, reason: str) -> None:
        """Put a request that lost its engine back at the head of the queue, keeping its tokens."""
        record.phase = "queued"
        record.engine_id = None
        record.moves += 1
        request = record.request
        request.status = RequestStatus.WAITING_IN_QUEUE
        request.add_event(EventType.EVICT, reason)
        if self._finish_if_exhausted(record, "length reached before the move"):
            return
        self.queue.appendleft(record.key)

    def _finish_if_exhausted(self, record: RequestRecord, why: str) -> bool:
        """A request lost (or resubmitted) right after its last token has nothing left to compute."""
        request = record.request
        if len(request.generated_tokens) < request.sampling_params.num_tokens_to_generate:
            return False
        request.status = RequestStatus.COMPLETED
        request.finish_reason = FinishReason.LENGTH
        request.add_event(EventType.FINISH, why)
        self._finish(record, request)
        return True

    def _remove_engine(self, engine: EngineRecord, reason: str, expected: bool = False) -> None:
        if self.engines.pop(engine.engine_id, None) is None:
            return
        self.peers.pop(engine.identity, None)
        self.peer_fds.pop(engine.identity, None)
        self.policy.forget(engine.engine_id)
        orphans = sorted((self.requests[k] for k in engine.assigned if k in self.requests),
                         key=lambda r: r.request.arrival_time, reverse=True)
        engine.assigned.clear()
        for record in orphans:  # newest first, so appendleft keeps arrival order
            self._requeue(record, f"engine {engine.engine_id} {reason}")
        log = logger.info if expected else logger.warning
        log("engine %s (group %d) removed: %s; %d request(s) re-queued", engine.engine_id, engine.group, reason,
            len(orphans))
        for op in self.controls:
            if engine.engine_id in op.waiting:
                op.waiting.discard(engine.engine_id)
                op.engines.setdefault(engine.engine_id, {"group": engine.group})["lost"] = reason
        self._advance_controls()
        self._dispatch()

    def _dispatch(self) -> None:
        """Send queued requests to engines while the fleet runs and engines have room."""
        if self.state is not FleetState.RUNNING:
            return
        while self.queue:
            key = self.queue[0]
            record = self.requests.get(key)
            if record is None or record.phase != "queued":
                self.queue.popleft()
                continue
            candidates = [e for e in self.engines.values()
                          if not e.draining and not e.stopping and e.load < max(1, int(e.capacity * self.dispatch_factor))]
            if not candidates:
                return
            engine = self.policy.select(record, candidates)
            if engine is None:
                return
            engine = self.engines.get(engine.engine_id)
            if engine is None:
                return
            request = record.request.to_dict(include_images=True)
            if not self._send(engine.identity, Header.ENGINE_SUBMIT, {"request": request}):
                self._remove_engine(engine, "unreachable (send failed)")
                continue
            self.queue.popleft()
            record.phase = "dispatched"
            record.engine_id = engine.engine_id
            if not engine.assigned:  # an idle loop may wait without counting: its stall clock starts now
                engine.stall_clock = time.monotonic()
            engine.assigned.add(key)

    # ------------------------------------------------------------------ lifecycle

    def _on_control(self, client: ClientRecord, identity: bytes, header: Header, body: dict[str, Any]) -> None:
        control_id = body["control_id"]
        if control_id in self.completed_controls:  # retry after a reconnect: answer again
            reply_header, reply = self.completed_controls[control_id]
            self._send(identity, reply_header, reply)
            return
        if any(op.control_id == control_id for op in self.controls):
            return  # in progress; the answer goes to the client's current connection
        epoch = body.get("epoch")
        if header is Header.REFIT and ((epoch is not None and epoch < 0) or not body["source"]):
            self._send(identity, Header.ERROR, {"code": ErrorCode.INVALID_REQUEST.value, "control_id": control_id,
                                                "message": "REFIT needs a non-empty source and an epoch >= 0"})
            return
        level = body.get("level") or 1
        if header is Header.SUSPEND and level not in (1, 2):
            self._send(identity, Header.ERROR, {"code": ErrorCode.INVALID_REQUEST.value, "control_id": control_id,
                                                "message": f"suspend level must be 1 or 2, got {level}"})
            return
        op = ControlOp(control_id=control_id, verb=header, client_id=client.client_id, level=int(level),
                       drain_timeout=body.get("drain_timeout"))
        if header is Header.REFIT:
            op.source, op.epoch = body["source"], epoch
        self.controls.append(op)
        logger.info("%s %s: %s requested (state %s)", client.role.value, client.client_id[:8], header.name,
                    self.state.value)
        self._advance_controls()

    def _plan(self, op: ControlOp) -> tuple[list[Header], FleetState]:
        """Engine steps and target state of a verb in the current state (DESIGN section 5)."""
        state, verb = self.state, op.verb
        if verb is Header.STOP:
            return [Header.STOP], FleetState.STOPPED
        if verb is Header.REFIT:
            return self._plan_refit(op), state
        if state is FleetState.STOPPED and verb is not Header.UNPAUSE:
            raise IllegalTransition(f"{verb.name} is not allowed while STOPPED (UNPAUSE restarts the fleet)")
        if verb is Header.PAUSE:
            if state is FleetState.SUSPENDED:  # already not stepping, and memory stays released
                return [], FleetState.SUSPENDED
            return [Header.PAUSE], FleetState.PAUSED
        if verb is Header.UNPAUSE:
            if state is FleetState.SUSPENDED:
                raise IllegalTransition("UNPAUSE is not allowed while SUSPENDED: RESUME first")
            return [Header.UNPAUSE], FleetState.RUNNING
        if verb is Header.SUSPEND:
            if state is FleetState.RUNNING:
                return [Header.PAUSE, Header.SUSPEND], FleetState.SUSPENDED
            return [Header.SUSPEND], FleetState.SUSPENDED
        if verb is Header.RESUME:
            if state is FleetState.SUSPENDED:
                return [Header.RESUME], FleetState.PAUSED
            return [Header.RESUME], state  # memory already resident: a no-op that still acks
        raise IllegalTransition(f"unknown verb {verb.name}")

    def _plan_refit(self, op: ControlOp) -> list[Header]:
        """REFIT: verify on every engine, then load on every engine (two broadcasts of REFIT)."""
        if self.state not in (FleetState.PAUSED, FleetState.SUSPENDED):
            raise IllegalTransition(f"REFIT is only allowed while PAUSED or SUSPENDED; the fleet is "
                                    f"{self.state.value} (PAUSE first)")
        if not self.engines:
            raise IllegalTransition("REFIT needs at least one connected engine to verify the new weights",
                                    ErrorCode.REFIT_FAILED)
        if op.epoch is None:
            op.epoch = self.epoch + 1
        return [Header.REFIT, Header.REFIT]

    def _refit_verify_failed(self, op: ControlOp) -> bool:
        """After the verify broadcast: refuse the whole REFIT if any engine refused the source."""
        if op.verb is not Header.REFIT or op.step_index != 0:
            return False
        errors = {eid: f["error"] for eid, f in op.engines.items() if f.get("error")}
        if not errors:
            return False
        self.controls.popleft()
        eid, why = sorted(errors.items())[0]
        message = (f"REFIT refused by engine {eid}" + (f" and {len(errors) - 1} more" if len(errors) > 1 else "")
                   + f": {why}; the fleet keeps serving epoch {self.epoch}")
        logger.warning("%s", message)
        self._answer(op, Header.ERROR, {"code": ErrorCode.REFIT_FAILED.value, "message": message,
                                        "control_id": op.control_id})
        return True

    def _advance_controls(self) -> None:
        """Drive the verb at the head of the queue: plan it, broadcast each step, complete it.

        Re-entrant calls (an engine removed while broadcasting) return at once; the outer call
        sees the updated ``waiting`` set.
        """
        if self._advancing:
            return
        self._advancing = True
        try:
            while self.controls:
                op = self.controls[0]
                if op.step_index < 0:
                    try:
                        op.steps, target = self._plan(op)
                    except IllegalTransition as exc:
                        self.controls.popleft()
                        logger.info("%s refused: %s", op.verb.name, exc)
                        self._answer(op, Header.ERROR, {"code": exc.code.value,
                                                        "message": str(exc), "control_id": op.control_id})
                        continue
                    previous_level = self.suspend_level if self.state is FleetState.SUSPENDED else 0
                    op.previous_state = self.state.value
                    op.target_state = target.value
                    if target is FleetState.SUSPENDED:
                        self.suspend_level = max(previous_level, op.level)
                    else:
                        self.suspend_level = 0
                    op.noop = target is self.state and self.suspend_level == previous_level
                    self.state = target
                    op.step_index = 0
                elif op.waiting:
                    return
                elif self._refit_verify_failed(op):
                    continue
                else:
                    op.step_index += 1
                while op.step_index < len(op.steps):
                    self._broadcast_step(op)
                    if op.waiting:
                        return
                    op.step_index += 1
                self.controls.popleft()
                self._complete(op)
        finally:
            self._advancing = False

    def _broadcast_step(self, op: ControlOp) -> None:
        """Send the current step's verb to every connected engine; each one must ack (see _expire_verb_step)."""
        verb = op.steps[op.step_index]
        op.step_started = time.monotonic()
        body: dict[str, Any] = {"control_id": f"{op.control_id}#{op.step_index}"}
        if verb is Header.SUSPEND:
            body["level"] = self.suspend_level
        if verb is Header.STOP and op.drain_timeout is not None:
            body["drain_timeout"] = op.drain_timeout
        if verb is Header.REFIT:
            body.update(source=op.source, epoch=op.epoch, phase="verify" if op.step_index == 0 else "load")
            if op.step_index == 1:
                # Every engine verified the source: from now on it is the fleet's weights, also for
                # engines that register while (or after) the others load it.
                self.epoch, self.weights_source = int(op.epoch), op.source
                self.refits += 1
        unreachable = []
        for engine in list(self.engines.values()):
            if verb is Header.STOP:
                engine.stopping = True
            if self._send(engine.identity, verb, body):
                op.waiting.add(engine.engine_id)
                op.engines.setdefault(engine.engine_id, {"group": engine.group})
            else:
                unreachable.append(engine)
        for engine in unreachable:
            self._remove_engine(engine, "unreachable (send failed)")

    def _expire_verb_step(self, now: float) -> None:
        """Remove the engines that did not acknowledge the current verb step within ``verb_timeout``.

        Without a deadline an engine whose step loop hangs would hold the verb forever (see
        _drop_unresponsive); the verb completes with the other engines and the ``CONTROL_ACK`` lists
        it under ``unresponsive``. See ``_step_deadline`` for how long a step may take.
        """
        if not self.controls or not self.controls[0].waiting:
            return
        op = self.controls[0]
        verb = op.steps[op.step_index]
        limit = self._step_deadline(op, verb)
        if now - op.step_started <= limit:
            return
        for engine in [e for e in self.engines.values() if e.engine_id in op.waiting]:
            op.unresponsive.append(engine.engine_id)
            self._drop_unresponsive(engine, f"did not acknowledge {verb.name} within {limit:.1f}s")

    def _expire_stalled_engines(self, now: float) -> None:
        """Remove the engines whose step loop made no progress for ``stall_timeout`` while they have requests.

        Outside a verb nothing else would notice a hung step loop, and its requests would wait on it
        forever. The clock runs only while the fleet is RUNNING with no verb in flight (engines do
        not step otherwise, and a verb has its own deadline) and restarts when the loop's counter
        moves or an idle engine gets work. An engine whose last heartbeat did not report the counter
        (an older engine, or one busy registering, e.g. loading the fleet's weights) is never taken
        for stalled.
        """
        if self.state is not FleetState.RUNNING or self.controls:
            for engine in self.engines.values():
                engine.stall_clock = now
            return
        for engine in list(self.engines.values()):
            stalled = now - engine.stall_clock
            if engine.assigned and engine.progress is not None and stalled > self.stall_timeout:
                self._drop_unresponsive(engine, f"its step loop made no progress for {stalled:.1f}s "
                                                f"with {engine.load} request(s) assigned")

    def _drop_unresponsive(self, engine: EngineRecord, why: str) -> None:
        """Remove an engine whose step loop does not answer, and keep it out until it does.

        Heartbeats come from a thread of the engine's own, so an engine whose step loop hangs (a
        stuck kernel, a deadlock) is never timed out by them. It is removed like a dead engine (its
        requests re-queued) and its connection remembered, so that its heartbeats do not let it back
        into the fleet until its step loop answers (see _on_unresponsive_frame).
        """
        self._unresponsive[engine.identity] = engine.engine_id
        while len(self._unresponsive) > _UNRESPONSIVE_KEPT:
            self._unresponsive.popitem(last=False)
        self._remove_engine(engine, f"{why} (heartbeats alone do not count; kept out until it answers)")

    def _step_deadline(self, op: ControlOp, verb: Header) -> float:
        """Seconds an engine may take to acknowledge ``verb``: a STOP adds its drain time, and steps
        that move weights (SUSPEND, RESUME, REFIT's load) get ``weights_timeout``."""
        if verb is Header.STOP:
            return self.verb_timeout + (op.drain_timeout or 0.0)
        if verb in (Header.SUSPEND, Header.RESUME) or (verb is Header.REFIT and op.step_index == 1):
            return max(self.verb_timeout, self.weights_timeout)
        return self.verb_timeout

    def _on_engine_ack(self, engine: EngineRecord, body: dict[str, Any]) -> None:
        engine.state = str(body["state"])
        if not self.controls:
            return
        op = self.controls[0]
        if body["control_id"] != f"{op.control_id}#{op.step_index}" or engine.engine_id not in op.waiting:
            return  # late ack of an earlier step (the engine was presumed lost) — ignore
        op.waiting.discard(engine.engine_id)
        facts = op.engines.setdefault(engine.engine_id, {"group": engine.group})
        facts.update(body.get("detail") or {})
        facts["state"] = engine.state
        if op.verb is Header.REFIT and op.step_index == 1 and self._on_refit_loaded(op, engine, facts):
            return
        if op.steps[op.step_index] is Header.STOP:
            self._remove_engine(engine, "stopped", expected=True)  # it exits now; not a failure
        self._advance_controls()

    def _on_refit_loaded(self, op: ControlOp, engine: EngineRecord, facts: dict[str, Any]) -> bool:
        """An engine's answer to the load phase; True when it failed and was removed (advancing done)."""
        if not facts.get("error"):
            engine.epoch, engine.weights = int(op.epoch), op.source
            engine.last_refit = {k: facts[k] for k in ("verify_s", "load_s", "total_s") if k in facts}
            return False
        # It verified the source but could not load it: its weights cannot be trusted. Removing it
        # re-queues its requests; it registers again and loads the fleet's weights, or exits.
        op.failed[engine.engine_id] = str(facts["error"])
        self._remove_engine(engine, f"REFIT load failed: {facts['error']}")
        self._advance_controls()
        return True

    def _complete(self, op: ControlOp) -> None:
        detail: dict[str, Any] = {"previous_state": op.previous_state, "noop": op.noop, "engines": op.engines}
        released = [f["released_bytes"] for f in op.engines.values() if isinstance(f.get("released_bytes"), int)]
        if released:
            detail["released_bytes"] = sum(released)
        if op.verb is Header.SUSPEND:
            detail["level"] = self.suspend_level
        if op.verb is Header.REFIT:
            detail.update(noop=False, epoch=self.epoch, source=self.weights_source)
            if op.failed:
                detail["failed"] = dict(op.failed)
        if op.unresponsive:
            detail["unresponsive"] = list(op.unresponsive)
        body = {"control_id": op.control_id, "state": self.state.value, "detail": detail}
        logger.info("%s acknowledged: %s -> %s by %d engine(s)%s", op.verb.name, op.previous_state, self.state.value,
                    len(op.engines), f", released {detail['released_bytes']} bytes" if released else "")
        self._forget_routing_history_if_caches_may_be_gone(op)
        self._answer(op, Header.CONTROL_ACK, body)
        self._dispatch()

    def _forget_routing_history_if_caches_may_be_gone(self, op: ControlOp) -> None:
        """A suspended fleet may resume with empty prefix caches (and a refit drops them): routing starts over."""
        if self.state is FleetState.SUSPENDED or op.verb is Header.REFIT:
            for engine_id in list(self.engines):
                self.policy.forget(engine_id)

    def _answer(self, op: ControlOp, header: Header, body: dict[str, Any]) -> None:
        self.completed_controls[op.control_id] = (header, body)
        while len(self.completed_controls) > _COMPLETED_CONTROLS_KEPT:
            self.completed_controls.popitem(last=False)
        client = self.clients.get(op.client_id)
        if client is not None:
            self._send(client.identity, header, body)

    # ------------------------------------------------------------------ status and housekeeping

    def _heartbeat_body(self) -> dict[str, Any]:
        return {"coordinator_id": self.coordinator_id, "state": self.state.value}

    def _count(self, phase: str) -> int:
        return sum(1 for r in self.requests.values() if r.phase == phase)

    def status(self) -> dict[str, Any]:
        """The ``STATUS_REPLY`` body."""
        return {
            "state": self.state.value,
            "engines": [e.describe() for e in sorted(self.engines.values(), key=lambda e: e.group)],
            "queued": self._count("queued"),
            "in_flight": self._count("dispatched"),
            "completed": self.completed,
            "failed": self.failed,
            "aborted": self.aborted,
            "coordinator_id": self.coordinator_id,
            "routing": self.routing_name,
            "suspend_level": self.suspend_level,
            "clients": sum(1 for c in self.clients.values() if c.identity is not None),
            "pending_controls": [op.verb.name for op in self.controls],
            "dropped_frames": self._drop.total,
            "epoch": self.epoch,
            "weights": self.weights_source,
            "refits": self.refits,
            "epoch_mismatch": sorted(e.engine_id for e in self.engines.values() if e.epoch != self.epoch),
        }

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if event.get("event") == zmq.EVENT_DISCONNECTED:
                fd = int(event.get("value", -1))
                now = time.monotonic()
                self._probes.extend((now + d, fd) for d in _PROBE_DELAYS)

    def _tick(self) -> None:
        now = time.monotonic()
        self._drop.flush() if int(now) != self._drop.window and self._drop.suppressed else None
        # Peers whose connection closed: a send to a gone routing id fails with EHOSTUNREACH.
        if self._probes:
            due = [fd for t, fd in self._probes if t <= now]
            self._probes = [(t, fd) for t, fd in self._probes if t > now]
            for fd in set(due):
                for identity in [i for i, f in self.peer_fds.items() if f == fd]:
                    self._probe(identity, "connection closed")
        for engine in list(self.engines.values()):
            if now - engine.last_seen > self.heartbeat_timeout:
                self._remove_engine(engine, f"no heartbeat for {now - engine.last_seen:.1f}s")
        self._expire_verb_step(now)
        self._expire_stalled_engines(now)
        if self._tokenizer_loading is not None and self._tokenizer_loading.done():
            self._release_held_prompts()
        if self._undelivered and now - self._last_retry > 1.0:
            self._last_retry = now
            for key in list(self._undelivered):
                record = self.requests.get(key)
                if record is None or record.phase != "finished":
                    self._undelivered.discard(key)
                else:
                    self._deliver(record)
        if now - self._last_sweep > 5.0:
            self._last_sweep = now
            for client in list(self.clients.values()):
                if client.identity is not None and now - client.last_seen > 30.0:
                    self._probe(client.identity, "silent")
                if client.identity is None and client.offline_since is not None and \
                        now - client.offline_since > self.client_timeout:
                    self._drop_client(client)
        self._dispatch()

    def _probe(self, identity: bytes, why: str) -> None:
        if identity not in self.peers:
            return
        if not self._send(identity, Header.HEARTBEAT, self._heartbeat_body()):
            self._forget_peer(identity, f"unreachable ({why})")

    def _drop_client(self, client: ClientRecord) -> None:
        n = 0
        for key in list(client.requests):
            record = self.requests.get(key)
            if record is None:
                continue
            if record.phase != "finished":
                self._abort_record(record, "client went away")
                n += 1
            self._forget_request(record)
        self.clients.pop(client.client_id, None)
        logger.warning("client %s gone for more than %.0fs: %d unfinished request(s) aborted and its results dropped",
                       client.client_id[:8], self.client_timeout, n)


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
    coordinator.run()


__all__: Iterable[str] = ["Coordinator", "serve", "write_address_file", "DEFAULT_HEARTBEAT_TIMEOUT",
                          "DEFAULT_VERB_TIMEOUT", "DEFAULT_WEIGHTS_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "TokenizerLike"]
