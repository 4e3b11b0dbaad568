"""The coordinator's core: all its state and decisions, and no sockets.

Every input is a method call with the time: a decoded message from a peer (:meth:`on_message`),
a peer the transport found gone (:meth:`on_peer_gone`), the clock (:meth:`on_tick`). Each returns
the effects to perform (messages to send, peers to probe; :mod:`.effects`). Nothing calls back into a handler: removing an engine re-queues
its requests and marks the lifecycle runner to advance, and one settling pass after the input
runs it and dispatches. This is how it is unit-tested without ZeroMQ (tests/coordinator/test_core.py);
:mod:`.loop` is the thin loop that owns the socket.

The jobs live beside it, one module each: :mod:`.handshake` (HELLO, registration),
:mod:`.flow` (every request's way from SUBMIT to its acknowledged RESULT, over the request table),
:mod:`.fleet_weights` (the weights generation the fleet serves), :mod:`.dispatch` (routing queued requests to engines),
:mod:`.verbs` (the lifecycle state machine), :mod:`.liveness` (heartbeats, probes, stalls). They take this
core as a :class:`~.core_view.CoreView` (declared beneath them), so that none of them imports this module.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS
from ..wire.lifecycle import FleetState
from ..wire.handshake import Error, Hello
from ..wire.messages import TO_COORDINATOR
from ..wire.status import Draining, Heartbeat, KVEvents, Status, StatusReply
from ..wire.submission import Handback
from ..wire.protocol import HEADER_VERBS, ErrorCode, Header, Message, ProtocolError, Role, encode, unbatch
from .kv_index import KVIndex
from .placement import DEFAULT_SESSION_TTL_S, Sessions
from .routing import RoutingPolicy, make_routing_policy
from ..wire.security import FleetSecret, fleet_secret
from . import dispatch, handshake, liveness
from .candidates import Candidates
from .droplog import DropLog
from .effects import Effect, Outbox, Probe
from .flow import RequestFlow
from .fleet_weights import FleetWeights
from .peers import ClientRecord, EngineRecord
from .prompts import DEFAULT_MAX_IMAGE_BYTES
from .requests import Phase
from .verbs import VerbRunner

logger = logging.getLogger("megatron_serve.coordinator")

DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_CLIENT_TIMEOUT = 600.0
# Per verb step. Below the operator's default command timeout (120 s), so that its own call gets the
# acknowledgement even when an engine hangs.
DEFAULT_VERB_TIMEOUT = 60.0
# Steps that move weights (SUSPEND may offload them, RESUME brings them back and captures CUDA graphs,
# REFIT's load reads a checkpoint) take as long as reading a large checkpoint can.
DEFAULT_WEIGHTS_TIMEOUT = 900.0
# An engine's step loop may not move for this long while it has requests. Generous: one step may be a
# long prefill or JIT-compile kernels, and a false alarm moves all the engine's requests elsewhere.
DEFAULT_STALL_TIMEOUT = 120.0

# Which headers each role may send (after HELLO).
ALLOWED: dict[Role, frozenset[Header]] = {
    Role.ENGINE: frozenset({Header.HEARTBEAT, Header.DRAINING, Header.CONTROL_ACK, Header.ENGINE_STEP,
                            Header.HANDBACK, Header.STATUS, Header.KV_BLOCKS, Header.KV_EVENTS}),
    Role.CLIENT: frozenset({Header.SUBMIT, Header.ABORT, Header.RESULT_ACK, Header.STATUS, Header.HEARTBEAT,
                            *HEADER_VERBS}),
    Role.CONTROL: frozenset({Header.STATUS, Header.HEARTBEAT, *HEADER_VERBS}),
}


class CoordinatorCore:
    """State and decisions of one coordinator (see the module docstring)."""

    def __init__(
        self,
        *,
        token: str | FleetSecret | None = None,
        routing: str = "least_loaded",
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        client_timeout: float = DEFAULT_CLIENT_TIMEOUT,
        verb_timeout: float = DEFAULT_VERB_TIMEOUT,
        weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        dispatch_factor: float = 2.0,
        model: str | None = None,
        tokenizer_dir: str | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS,
        session_ttl: float = DEFAULT_SESSION_TTL_S,
    ) -> None:
        """``token``: the fleet secret (``None``: insecure). ``tokenizer_dir``: only announced to clients
        (HELLO_ACK), which tokenize and make the text; the coordinator loads no tokenizer.
        ``max_image_bytes``: image file bytes one request may carry, ``max_request_logprobs`` log-prob entries
        (prompt positions and tokens to generate, by the log probs of each: what its engine sends back over
        the links; :func:`~megatron_serve.limits.engine_request_cost`); more is refused with ERROR.
        ``session_ttl``: seconds a session's engine is remembered after its last request (:mod:`.placement`)."""
        self.secret = fleet_secret(token)
        self.proven: dict[bytes, bytes | None] = {}  # connections that proved it (identity -> CURVE key), until gone
        self.routing_name = routing
        self.kv_index = KVIndex()  # which engine holds which KV block, from their KV events (kv_aware reads it)
        self.policy: RoutingPolicy = make_routing_policy(routing, self.kv_index)
        self.sessions = Sessions(session_ttl)  # a session's engine, for its next request (placement)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.client_timeout = float(client_timeout)
        self.verb_timeout = float(verb_timeout)
        self.weights_timeout = float(weights_timeout)
        self.stall_timeout = float(stall_timeout)
        self.dispatch_factor = float(dispatch_factor)
        self.coordinator_id = uuid.uuid4().hex[:12]
        self.weights = FleetWeights(model, tokenizer_dir)  # the generation engines serve, LOAD_LORA's adapters

        self.state = FleetState.RUNNING
        self.suspend_level = 0
        self.peers: dict[bytes, tuple[Role, str]] = {}  # identity -> (role, engine_id | client_id)
        self.engines: dict[str, EngineRecord] = {}
        self.clients: dict[str, ClientRecord] = {}
        self.outbox = Outbox()
        self.drop = DropLog()
        self.flow = RequestFlow(engines=self.engines, clients=self.clients, outbox=self.outbox, drop=self.drop,
                                max_image_bytes=max_image_bytes, max_request_logprobs=max_request_logprobs)
        self.verbs = VerbRunner(self)
        self.liveness = liveness.Liveness()
        self.registrations = 0
        # the engines that may take a request now, in least-loaded order (dispatch files them)
        self.candidates = Candidates(lambda engine: max(1, int(engine.capacity * self.dispatch_factor)),
                                     lambda engine: not (engine.draining or engine.stopping)
                                     and self.weights.served_by(engine))
        self._advance = False

    # ------------------------------------------------------------------ inputs

    def on_message(self, identity: bytes, message: Message, now: float, key: bytes | None = None) -> list[Effect]:
        """One decoded message from ``identity``, a connection with CURVE key ``key`` (a BATCH is opened here)."""
        if message.header is Header.BATCH:
            for item in unbatch(message.body, TO_COORDINATOR):
                if isinstance(item, ProtocolError):
                    self.drop(self.peer_name(identity), str(item))
                else:
                    self._handle(identity, item, now, key)
        else:
            self._handle(identity, message, now, key)
        return self._settle(now)

    def on_peer_gone(self, identity: bytes, reason: str, now: float) -> list[Effect]:
        """A send to ``identity`` failed, or a probe found it gone."""
        self.proven.pop(identity, None)
        handshake.forget_peer(self, identity, f"unreachable ({reason})", now)
        return self._settle(now)

    def on_hello_after_probe(self, identity: bytes, hello: Hello, now: float) -> list[Effect]:
        """An engine's HELLO for a group whose holder was just probed (see handshake)."""
        handshake.on_hello(self, identity, hello, now, probed=True)
        return self._settle(now)

    def on_tick(self, now: float) -> list[Effect]:
        """Deadlines: heartbeats, verb steps, stalled step loops, silent and departed clients."""
        liveness.expire(self, now)
        return self._settle(now)

    def _settle(self, now: float) -> list[Effect]:
        """Run what the input left to do (advance the lifecycle, dispatch), then hand over the effects."""
        if self.verbs.draining:  # a PAUSE waits for running requests: this input may have ended the last
            self._advance = True
        while self._advance:
            self._advance = False
            self.verbs.advance(now)
        dispatch.dispatch(self, now)
        return self.outbox.take()

    # ------------------------------------------------------------------ effects and helpers

    def send(self, identity: bytes, header: Header, body: Any, batch: bool = False) -> None:
        self.outbox.send(identity, header, body, batch)

    def probe(self, identity: bytes, hello: tuple[bytes, Hello] | None = None) -> None:
        """Test whether a registered peer's connection is still there (a send to a gone one fails).

        A connection that is no peer is told nothing: the loop probes every connection on the file
        descriptor of one that closed, and descriptors are reused, so that may be a refused insider's
        (a probe's heartbeat was the one frame such a connection received after its refusal).
        """
        if identity not in self.peers and hello is None:
            return
        self.outbox.add([Probe(identity, encode(Header.HEARTBEAT, self.heartbeat()), hello)])

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(coordinator_id=self.coordinator_id, state=self.state.value)

    def advance_verbs(self) -> None:
        """Have the lifecycle runner look at the verb in progress once this input is handled."""
        self._advance = True

    def peer_name(self, identity: bytes) -> str:
        known = self.peers.get(identity)
        return f"{known[0].value} {known[1]}" if known else f"peer {identity.hex()}"

    # ------------------------------------------------------------------ messages

    def _handle(self, identity: bytes, message: Message, now: float, key: bytes | None) -> None:
        header, body = message
        if header is Header.HELLO:
            handshake.on_hello(self, identity, body, now, key)
            return
        known = self.peers.get(identity)
        if known is None:
            if self.liveness.unresponsive_frame(self, identity, header):
                return
            self.drop(self.peer_name(identity), f"{header.name} before a successful HELLO")
            self.liveness.hello_required(self, identity, now)
            return
        role, who = known
        if header not in ALLOWED[role]:
            reason = f"role {role.value} may not send {header.name}"
            self.drop(self.peer_name(identity), reason)
            self.send(identity, Header.ERROR, Error(code=ErrorCode.FORBIDDEN.value, message=reason))
            return
        if role is Role.ENGINE:
            engine = self.engines.get(who)
            if engine is None:  # removed (e.g. timed out) while frames were in flight
                self.peers.pop(identity, None)
                self.drop(self.peer_name(identity), f"{header.name} from an engine that was removed")
                self.liveness.hello_required(self, identity, now)
                return
            engine.last_seen = now
            self._engine_message(engine, header, body, now)
        else:
            client = self.clients[who]
            client.last_seen = now
            self._client_message(client, identity, header, body, now)

    def _client_message(self, client: ClientRecord, identity: bytes, header: Header, body: Any, now: float) -> None:
        if header is Header.SUBMIT:
            self.flow.on_submit(client, identity, body, now)
        elif header is Header.ABORT:
            self.flow.on_abort(client, body)
        elif header is Header.RESULT_ACK:
            self.flow.on_result_ack(client, body)
        elif header is Header.STATUS:
            self.send(identity, Header.STATUS_REPLY, self.status(body, now))
        elif header is Header.HEARTBEAT:
            self.send(identity, Header.HEARTBEAT, self.heartbeat())
        else:
            self.verbs.request(client, identity, HEADER_VERBS[header], body)

    def _engine_message(self, engine: EngineRecord, header: Header, body: Any, now: float) -> None:
        if header is Header.ENGINE_STEP:
            self.flow.on_step(engine, body)
        elif header is Header.HEARTBEAT:
            self._on_heartbeat(engine, body, now)
        elif header is Header.CONTROL_ACK:
            self.verbs.on_ack(engine, body)
        elif header is Header.DRAINING:
            self._on_draining(engine, body)
        elif header is Header.HANDBACK:
            self._on_handback(engine, body)
        elif header is Header.KV_BLOCKS:
            self.flow.handoffs.on_blocks(self.drop, engine, body)
        elif header is Header.KV_EVENTS:
            self._on_kv_events(engine, body, now)
        elif header is Header.STATUS:
            self.send(engine.identity, Header.STATUS_REPLY, self.status(Status(), now))

    # ------------------------------------------------------------------ engines

    def _on_heartbeat(self, engine: EngineRecord, body: Heartbeat, now: float) -> None:
        engine.last_heartbeat = time.time()
        blocks = engine.kv_blocks_free, engine.kv_blocks_total
        for name in ("running", "waiting", "kv_blocks_free", "kv_blocks_total", "cached_tokens", "computed_tokens"):
            value = getattr(body, name)
            if value is not None:
                setattr(engine, name, value)
        if (engine.kv_blocks_free, engine.kv_blocks_total) != blocks:
            self.candidates.blocks_changed(engine)
        if body.state:
            engine.state = body.state
        if body.stats is not None:
            engine.stats = body.stats
            seq = body.stats.get("kv_events_seq")
            if isinstance(seq, int) and not isinstance(seq, bool):
                self.kv_index.reported(engine.engine_id, seq, now)
        if body.metrics is not None:
            engine.metrics = body.metrics  # passed through to STATUS for the servers' /metrics
        engine.note_progress(body.progress, now)
        self.send(engine.identity, Header.HEARTBEAT, self.heartbeat())

    def _on_kv_events(self, engine: EngineRecord, body: KVEvents, now: float) -> None:
        if body.engine_id != engine.engine_id:
            self.drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        problem = self.kv_index.apply(engine.engine_id, body.seq, body.batch, now)
        if problem is not None:
            self.drop(engine.engine_id, problem)

    def _on_draining(self, engine: EngineRecord, _body: Draining) -> None:
        if not engine.draining:
            engine.draining = True
            self.policy.forget(engine.engine_id)  # its prefix cache leaves with it
            logger.info("engine %s is draining: no new requests routed to it (%d assigned)",
                        engine.engine_id, engine.load)

    def _on_handback(self, engine: EngineRecord, body: Handback) -> None:
        if body.engine_id != engine.engine_id:
            self.drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        ids = [i for i in body.request_ids if isinstance(i, str)]
        moved = 0
        for key in ids:
            record = self.flow.table.get(key)
            if record is not None and record.phase is Phase.DISPATCHED and record.engine_id == engine.engine_id:
                engine.assigned.discard(key)
                self.flow.requeue(record, f"handed back by engine {engine.engine_id}")
                moved += 1
        self.send(engine.identity, Header.HANDBACK, Handback(request_ids=ids), engine.batches)
        if body.final:
            self.remove_engine(engine, "left after draining", expected=True)
        elif moved:
            logger.info("engine %s handed back %d request(s)", engine.engine_id, moved)

    def remove_engine(self, engine: EngineRecord, reason: str, expected: bool = False) -> None:
        """Take an engine out of the fleet: its requests go back to the queue (in arrival order, ahead of
        newer ones), a verb waiting on it stops waiting."""
        if self.engines.pop(engine.engine_id, None) is None:
            return
        self.peers.pop(engine.identity, None)
        self.policy.forget(engine.engine_id)
        self.kv_index.drop(engine.engine_id)
        orphans = sorted((r for k in engine.assigned if (r := self.flow.table.get(k)) is not None),
                         key=lambda r: r.arrival_time, reverse=True)
        engine.assigned.clear()
        for record in orphans:  # newest first, so queueing each at the head keeps arrival order
            self.flow.requeue(record, f"engine {engine.engine_id} {reason}")
        (logger.info if expected else logger.warning)(
            "engine %s (group %d) removed: %s; %d request(s) re-queued", engine.engine_id, engine.group, reason,
            len(orphans))
        self.verbs.on_engine_removed(engine, reason)

    # ------------------------------------------------------------------ status

    def status(self, ask: Status, now: float) -> StatusReply:
        """The ``STATUS_REPLY`` body as of ``now`` (each engine's ``stalled_s`` is read off its stall clock)."""
        engines = sorted(self.engines.values(), key=lambda e: e.slot)
        return StatusReply(
            state=self.state.value,
            engines=[{**e.describe(), "stalled_s": round(liveness.stalled_for(self, e, now), 3)} for e in engines],
            queued=self.flow.table.count(Phase.QUEUED),
            in_flight=self.flow.table.count(Phase.DISPATCHED), completed=self.flow.table.completed,
            failed=self.flow.table.failed, aborted=self.flow.table.aborted, status_id=ask.status_id, epoch=self.weights.epoch,
            coordinator_id=self.coordinator_id, routing=self.routing_name, suspend_level=self.suspend_level,
            clients=sum(1 for c in self.clients.values() if c.identity is not None),
            pending_controls=[op.verb.name for op in self.verbs.queue], dropped_frames=self.drop.total,
            weights=self.weights.source, refits=self.weights.refits,
            epoch_mismatch=sorted(e.engine_id for e in engines if e.epoch != self.weights.epoch),
            incomplete_weights=self.weights.incomplete(engines), stall_timeout=self.stall_timeout,
            sessions=self.sessions.describe(), expert_groups=self.verbs.wanted_sizes.describe(engines))

