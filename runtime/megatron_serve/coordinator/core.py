"""The coordinator's core: all its state and decisions, and no sockets.

Every input is a method call with the time: a decoded message from a peer (:meth:`on_message`),
a peer the transport found gone (:meth:`on_peer_gone`), the clock (:meth:`on_tick`). Each returns
the effects to perform (messages to send, peers to probe; :mod:`.effects`). Nothing calls back into a handler: removing
an engine re-queues its requests and marks the lifecycle runner due, and one settling pass after the input runs it
and dispatches. This is how it is unit-tested without ZeroMQ (tests/coordinator/test_core.py); :mod:`.loop` is the
thin loop that owns the socket.

The state is in named parts, each with its own job, and each job module is handed the parts it works on when the
core builds it: :class:`~.membership.Membership` (who is connected and registered), :class:`~.lifecycle.Lifecycle`
(the fleet's state), :class:`~.fleet_weights.FleetWeights` (the weights generation the fleet serves),
:class:`~.flow.RequestFlow` (every request's way from SUBMIT to its acknowledged RESULT, over the request table and
its queue policy), :class:`~.dispatch.Dispatcher` (routing and dispatch), :class:`~.handshake.Handshake`,
:class:`~.verbs.VerbRunner` (the lifecycle state machine at work), :class:`~.liveness.Liveness` (heartbeats,
probes, stalls). The core routes each message to its part and removes engines; no part imports the core.
"""

from __future__ import annotations

import logging
from typing import Any

from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS
from ..wire.handshake import Error, Hello
from ..wire.messages import TO_COORDINATOR
from ..wire.protocol import HEADER_VERBS, ErrorCode, Header, Message, ProtocolError, Role, unbatch
from ..wire.security import FleetSecret, fleet_secret
from ..wire.status import Status, StatusReply
from ..wire.submission import Handback
from .deadlines import (DEFAULT_CLIENT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_STALL_TIMEOUT, DEFAULT_VERB_TIMEOUT,
                        DEFAULT_WEIGHTS_TIMEOUT, Deadlines)
from .dispatch import Dispatcher
from .droplog import DropLog
from .effects import Effect, Outbox
from .engine_reports import EngineReports
from .expert_group import WantedSizes
from .fleet_weights import FleetWeights
from .flow import RequestFlow
from .handshake import Handshake
from .lifecycle import Lifecycle
from .liveness import Liveness
from .membership import Membership
from .peers import ClientRecord, EngineRecord
from .placement import DEFAULT_SESSION_TTL_S, Sessions
from .prompts import DEFAULT_MAX_IMAGE_BYTES
from .requests import Phase
from .verbs import VerbRunner
from .verbs.handler import VerbContext

logger = logging.getLogger("megatron_serve.coordinator")

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
        self.members = Membership(fleet_secret(token))
        self.lifecycle = Lifecycle()
        self.deadlines = Deadlines(heartbeat=float(heartbeat_timeout), client=float(client_timeout),
                                   verb=float(verb_timeout), weights=float(weights_timeout), stall=float(stall_timeout))
        self.weights = FleetWeights(model, tokenizer_dir)  # the generation engines serve, LOAD_LORA's adapters
        self.outbox = Outbox()
        self.drop = DropLog()
        members = self.members
        self.flow = RequestFlow(engines=members.engines, clients=members.clients, outbox=self.outbox, drop=self.drop,
                                max_image_bytes=max_image_bytes, max_request_logprobs=max_request_logprobs)
        self.dispatcher = Dispatcher(members=members, lifecycle=self.lifecycle, weights=self.weights, flow=self.flow,
                                     outbox=self.outbox, routing=routing, dispatch_factor=dispatch_factor,
                                     sessions=Sessions(session_ttl))
        self.reports = EngineReports(routing=self.dispatcher, lifecycle=self.lifecycle, outbox=self.outbox,
                                     drop=self.drop)
        self.verbs = VerbRunner(VerbContext(
            members=members, lifecycle=self.lifecycle, weights=self.weights, flow=self.flow, routing=self.dispatcher,
            deadlines=self.deadlines, outbox=self.outbox, remove_engine=self.remove_engine,
            wanted_sizes=WantedSizes()))
        self.liveness = Liveness(members=members, lifecycle=self.lifecycle, deadlines=self.deadlines, flow=self.flow,
                                 verbs=self.verbs, outbox=self.outbox, remove_engine=self.remove_engine)
        self.handshake = Handshake(members=members, lifecycle=self.lifecycle, weights=self.weights, flow=self.flow,
                                   liveness=self.liveness, deadlines=self.deadlines, outbox=self.outbox,
                                   drop=self.drop, remove_engine=self.remove_engine,
                                   kv_events=self.dispatcher.policy.reads_kv_events)

    # ------------------------------------------------------------------ inputs

    def on_message(self, identity: bytes, message: Message, now: float, key: bytes | None = None) -> list[Effect]:
        """One decoded message from ``identity``, a connection with CURVE key ``key`` (a BATCH is opened here)."""
        if message.header is Header.BATCH:
            for item in unbatch(message.body, TO_COORDINATOR):
                if isinstance(item, ProtocolError):
                    self.drop(self.members.peer_name(identity), str(item))
                else:
                    self._handle(identity, item, now, key)
        else:
            self._handle(identity, message, now, key)
        return self._settle(now)

    def on_peer_gone(self, identity: bytes, reason: str, now: float) -> list[Effect]:
        """A send to ``identity`` failed, or a probe found it gone."""
        self.members.proven.pop(identity, None)
        self.handshake.forget_peer(identity, f"unreachable ({reason})", now)
        return self._settle(now)

    def on_hello_after_probe(self, identity: bytes, hello: Hello, now: float) -> list[Effect]:
        """An engine's HELLO for a group whose holder was just probed (see handshake)."""
        self.handshake.on_hello(identity, hello, now, probed=True)
        return self._settle(now)

    def on_tick(self, now: float) -> list[Effect]:
        """Deadlines: heartbeats, verb steps, stalled step loops, silent and departed clients."""
        self.liveness.expire(now)
        return self._settle(now)

    def quiet(self) -> bool:
        """Nothing under way that the clock decides soon: no request in the table (queued, on an engine, or finished
        and not yet acknowledged: a tenant's band improves as it waits, a stalled engine's requests move), no verb (its
        step's deadline, a drain's), no dropped frames waiting to be logged. The loop ticks less often then
        (:func:`~.loop.quiet_tick`); the deadlines left (heartbeats, stalls, absent clients) are seconds long."""
        return not self.flow.table and not self.verbs.queue and not self.drop.suppressed

    def _settle(self, now: float) -> list[Effect]:
        """Run what the input left to do (advance the lifecycle, dispatch), then hand over the effects."""
        self.verbs.settle(now)
        self.dispatcher.dispatch(now)
        return self.outbox.take()

    # ------------------------------------------------------------------ effects and helpers

    def probe(self, identity: bytes) -> None:
        """Test whether a registered peer's connection is still there (a send to a gone one fails).

        A connection that is no peer is told nothing: the loop probes every connection on the file
        descriptor of one that closed, and descriptors are reused, so that may be a refused insider's
        (a probe's heartbeat was the one frame such a connection received after its refusal).
        """
        if identity in self.members.peers:
            self.outbox.probe(identity, self.lifecycle.heartbeat())

    # ------------------------------------------------------------------ messages

    def _handle(self, identity: bytes, message: Message, now: float, key: bytes | None) -> None:
        header, body = message
        if header is Header.HELLO:
            self.handshake.on_hello(identity, body, now, key)
            return
        known = self.members.peers.get(identity)
        if known is None:
            if self.liveness.unresponsive_frame(identity, header):
                return
            self.drop(self.members.peer_name(identity), f"{header.name} before a successful HELLO")
            self.liveness.hello_required(identity, now)
            return
        role, who = known
        if header not in ALLOWED[role]:
            reason = f"role {role.value} may not send {header.name}"
            self.drop(self.members.peer_name(identity), reason)
            self.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.FORBIDDEN.value, message=reason))
            return
        if role is Role.ENGINE:
            engine = self.members.engines.get(who)
            if engine is None:  # removed (e.g. timed out) while frames were in flight
                self.members.peers.pop(identity, None)
                self.drop(self.members.peer_name(identity), f"{header.name} from an engine that was removed")
                self.liveness.hello_required(identity, now)
                return
            engine.last_seen = now
            self._engine_message(engine, header, body, now)
        else:
            client = self.members.clients[who]
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
            self.outbox.send(identity, Header.STATUS_REPLY, self.status(body, now))
        elif header is Header.HEARTBEAT:
            self.outbox.send(identity, Header.HEARTBEAT, self.lifecycle.heartbeat())
        else:
            self.verbs.request(client, identity, HEADER_VERBS[header], body)

    def _engine_message(self, engine: EngineRecord, header: Header, body: Any, now: float) -> None:
        if header is Header.ENGINE_STEP:
            self.flow.on_step(engine, body)
        elif header is Header.HEARTBEAT:
            self.reports.on_heartbeat(engine, body, now)
        elif header is Header.CONTROL_ACK:
            self.verbs.on_ack(engine, body)
        elif header is Header.DRAINING:
            self.reports.on_draining(engine)
        elif header is Header.HANDBACK:
            self._on_handback(engine, body)
        elif header is Header.KV_BLOCKS:
            self.flow.handoffs.on_blocks(self.drop, engine, body)
        elif header is Header.KV_EVENTS:
            self.reports.on_kv_events(engine, body, now)
        elif header is Header.STATUS:
            self.outbox.send(engine.identity, Header.STATUS_REPLY, self.status(Status(), now))

    # ------------------------------------------------------------------ engines

    def _on_handback(self, engine: EngineRecord, body: Handback) -> None:
        if body.engine_id != engine.engine_id:
            self.drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        ids = [i for i in body.request_ids if isinstance(i, str)]
        moved = self.flow.hand_back(engine, ids, "")
        self.outbox.send(engine.identity, Header.HANDBACK, Handback(request_ids=ids), engine.batches)
        if body.final:
            self.remove_engine(engine, "left after draining", expected=True)
        elif moved:
            logger.info("engine %s handed back %d request(s)", engine.engine_id, moved)

    def remove_engine(self, engine: EngineRecord, reason: str, expected: bool = False) -> None:
        """Take an engine out of the fleet: its requests go back to the queue (in arrival order, ahead of
        newer ones), a verb waiting on it stops waiting."""
        if self.members.engines.pop(engine.engine_id, None) is None:
            return
        self.members.peers.pop(engine.identity, None)
        self.dispatcher.forget(engine.engine_id)
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
        engines = sorted(self.members.engines.values(), key=lambda e: e.slot)
        table, weights, lifecycle = self.flow.table, self.weights, self.lifecycle
        return StatusReply(
            state=lifecycle.state.value,
            engines=[{**e.describe(), "stalled_s": round(self.liveness.stalled_for(e, now), 3)} for e in engines],
            queued=table.count(Phase.QUEUED), in_flight=table.count(Phase.DISPATCHED), completed=table.completed,
            failed=table.failed, aborted=table.aborted, status_id=ask.status_id, epoch=weights.epoch,
            coordinator_id=lifecycle.coordinator_id, routing=self.dispatcher.routing_name,
            suspend_level=lifecycle.suspend_level,
            clients=sum(1 for c in self.members.clients.values() if c.identity is not None),
            pending_controls=[op.verb.name for op in self.verbs.queue], dropped_frames=self.drop.total,
            weights=weights.source, refits=weights.refits,
            epoch_mismatch=sorted(e.engine_id for e in engines if e.epoch != weights.epoch),
            incomplete_weights=weights.incomplete(engines), stall_timeout=self.deadlines.stall,
            sessions=self.dispatcher.sessions.describe(),
            expert_groups=self.verbs.context.wanted_sizes.describe(engines))

