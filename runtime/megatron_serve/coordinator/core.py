"""The coordinator's core: all its state and decisions, and no sockets.

Every input is a method call with the time: a decoded message from a peer (:meth:`on_message`),
a peer the transport found gone (:meth:`on_peer_gone`), the clock (:meth:`on_tick`). Each returns
the effects to perform (messages to send, peers to probe; :mod:`.effects`). Nothing calls back into a handler: removing an engine re-queues
its requests and marks the lifecycle runner to advance, and one settling pass after the input
runs it and dispatches. This is how it is unit-tested without ZeroMQ (tests/coordinator/test_core.py);
:mod:`.loop` is the thin loop that owns the socket.

The jobs live beside it, one module each: :mod:`.handshake` (HELLO, registration),
:mod:`.requests` (the request table), :mod:`.dispatch` (routing queued requests to engines),
:mod:`.verbs` (the lifecycle state machine), :mod:`.liveness` (heartbeats, probes, stalls). They take this
core as a :class:`~.core_view.CoreView` (declared beneath them), so that none of them imports this module.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec

from ..limits import DEFAULT_MAX_REQUEST_LOGPROBS, engine_request_cost, over_budget
from ..wire.lifecycle import FleetState
from ..wire.deltas import EngineStep, RequestDelta
from ..wire.handshake import PROTOCOL_VERSION, SUBMIT_PROTOCOL, Error, Hello
from ..wire.messages import TO_COORDINATOR
from ..wire.rendezvous import RENDEZVOUS_SCHEME
from ..wire.status import Draining, Heartbeat, KVEvents, Status, StatusReply
from ..wire.submission import ClientAbort, EngineAbort, Handback, ResultAck, ResultOut, Submit
from ..wire.protocol import (HEADER_VERBS, ErrorCode, Header, Message, ProtocolError, Role, encode,
                             unbatch)
from .kv_index import KVIndex
from .placement import DEFAULT_SESSION_TTL_S, Sessions, admit, pinned_gone, refusal_code
from .routing import RoutingPolicy, make_routing_policy
from ..wire.accumulator import DeltaAccumulator
from ..wire.request import FinalRecord, FinishReason, RequestStatus
from ..wire.sampling_params import SharedParams
from ..wire.security import FleetSecret, fleet_secret
from . import dispatch, handshake, liveness, prompts
from .disaggregation import Handoffs
from .droplog import DropLog
from .effects import Effect, Probe, Send
from .peers import ClientRecord, EngineRecord
from .prompts import DEFAULT_MAX_IMAGE_BYTES
from .requests import Phase, RequestRecord, RequestTable, final_facts
from .step_tokens import StepShares, catch_up
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

_STEP_OUTPUT = msgspec.msgpack.Decoder(RequestDelta)
_FINAL_RECORD = msgspec.msgpack.Decoder(FinalRecord)
_ENCODE = msgspec.msgpack.Encoder()
_FINISHED = ("COMPLETED", "FAILED")


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
        self.max_image_bytes = int(max_image_bytes)
        self.max_request_logprobs = int(max_request_logprobs)
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
        # Weights generation: engines started from ``model`` that register with another epoch load
        # ``weights_source`` first (None: nothing was refitted, the model directory itself is current).
        self.model = model
        self.tokenizer_dir = tokenizer_dir  # announced to clients, which make the text (HELLO_ACK)
        self.epoch = 0
        self.weights_source: str | None = None
        self.refits = 0
        self.loaded_loras: dict[str, str] = {}  # LOAD_LORA's adapters (name -> path): engines that join load them

        self.state = FleetState.RUNNING
        self.suspend_level = 0
        self.peers: dict[bytes, tuple[Role, str]] = {}  # identity -> (role, engine_id | client_id)
        self.engines: dict[str, EngineRecord] = {}
        self.clients: dict[str, ClientRecord] = {}
        self.requests = RequestTable()
        self.handoffs = Handoffs()  # prefill/decode disaggregation: requests between their two engines
        self._params = SharedParams()
        self.verbs = VerbRunner(self)
        self.liveness = liveness.Liveness()
        self.registrations = 0
        self.dispatch_blocked: tuple[object, ...] | None = None  # dispatch found no room then (dispatch.room_key)
        self.freed: set[str] = set()  # engines a request left since (their Assigned reports them: dispatch)
        self.stale_outputs = 0
        self.drop = DropLog()
        self._out: list[Effect] = []
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
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ effects and helpers

    def send(self, identity: bytes, header: Header, body: Any, batch: bool = False) -> None:
        try:
            frame = encode(header, body)
        except ProtocolError as exc:
            logger.error("cannot send %s: %s", header.name, exc)
            return
        self._out.append(Send(identity, frame, batch))

    def probe(self, identity: bytes, hello: tuple[bytes, Hello] | None = None) -> None:
        """Test whether a registered peer's connection is still there (a send to a gone one fails).

        A connection that is no peer is told nothing: the loop probes every connection on the file
        descriptor of one that closed, and descriptors are reused, so that may be a refused insider's
        (a probe's heartbeat was the one frame such a connection received after its refusal).
        """
        if identity not in self.peers and hello is None:
            return
        self._out.append(Probe(identity, encode(Header.HEARTBEAT, self.heartbeat()), hello))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(coordinator_id=self.coordinator_id, state=self.state.value)

    def advance_verbs(self) -> None:
        """Have the lifecycle runner look at the verb in progress once this input is handled."""
        self._advance = True

    def incomplete_weights(self) -> list[str]:
        """Engines a failed refit left with a mix of two generations (epoch -1): UNPAUSE waits for a refit."""
        return sorted(e.engine_id for e in self.engines.values() if e.epoch == -1)

    def serves_fleet_weights(self, engine: EngineRecord) -> bool:
        """Whether requests may go to ``engine``: when the fleet's weights, or the engine's, came from a
        trainer, only if it holds the fleet's epoch (one that joined later, or that a failed transfer
        left on other weights, waits unrouted for the next refit to include it)."""
        sources = (self.weights_source, engine.weights)
        trainer = any((weights or "").startswith(RENDEZVOUS_SCHEME) for weights in sources)
        return not trainer or engine.epoch == self.epoch

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
            self._on_submit(client, identity, body, now)
        elif header is Header.ABORT:
            self._on_abort(client, body)
        elif header is Header.RESULT_ACK:
            self._on_result_ack(client, body)
        elif header is Header.STATUS:
            self.send(identity, Header.STATUS_REPLY, self.status(body, now))
        elif header is Header.HEARTBEAT:
            self.send(identity, Header.HEARTBEAT, self.heartbeat())
        else:
            self.verbs.request(client, identity, HEADER_VERBS[header], body)

    def _engine_message(self, engine: EngineRecord, header: Header, body: Any, now: float) -> None:
        if header is Header.ENGINE_STEP:
            self._on_step(engine, body, now)
        elif header is Header.HEARTBEAT:
            self._on_heartbeat(engine, body, now)
        elif header is Header.CONTROL_ACK:
            self.verbs.on_ack(engine, body)
        elif header is Header.DRAINING:
            self._on_draining(engine, body)
        elif header is Header.HANDBACK:
            self._on_handback(engine, body)
        elif header is Header.KV_BLOCKS:
            self.handoffs.on_blocks(self, engine, body)
        elif header is Header.KV_EVENTS:
            self._on_kv_events(engine, body, now)
        elif header is Header.STATUS:
            self.send(engine.identity, Header.STATUS_REPLY, self.status(Status(), now))

    # ------------------------------------------------------------------ requests

    def _on_submit(self, client: ClientRecord, identity: bytes, body: Submit, now: float) -> None:
        crid = body.client_request_id
        key = f"{client.client_id}/{crid}"
        record = self.requests.get(key)
        if record is not None:
            # Resubmission after a reconnect: the request is already ours. Send what the client missed.
            have = len(body.generated_tokens or ())
            missed = record.tokens_after(have)
            if missed is not None:
                self.send(identity, Header.STEP_TOKENS, catch_up(crid, missed, have))
            if record.phase is Phase.FINISHED:
                self.deliver(record)
            return
        if client.protocol < SUBMIT_PROTOCOL:
            self.send(identity, Header.ERROR, Error(
                code=ErrorCode.UNSUPPORTED.value, client_request_id=crid,
                message=f"this client speaks protocol {client.protocol}; this coordinator speaks {PROTOCOL_VERSION} "
                        f"and serves clients of {SUBMIT_PROTOCOL} or later (tokens travel only as STEP_TOKENS, "
                        f"and the client makes the text): upgrade the client"))
            return
        try:
            raw = body.sampling_params
            params, params_wire = self._params.read(b"" if raw is msgspec.UNSET else bytes(raw))
            record = RequestRecord(request_id=key, client_id=client.client_id, client_request_id=crid,
                                   prompt_tokens=prompts.prompt_ids(body.prompt), params=params,
                                   params_wire=params_wire, stream=bool(body.stream),
                                   out=DeltaAccumulator(body.generated_tokens),
                                   images=prompts.submitted_images(body.images, self.max_image_bytes))
            over = over_budget(engine_request_cost(len(record.prompt_tokens), params), self.max_request_logprobs)
            if over is not None:
                raise ValueError(over)
            admit(record, body.placement, self.engines.values())  # its session, its engine if pinned
        except ValueError as exc:
            self.send(identity, Header.ERROR, Error(code=refusal_code(exc), message=str(exc), client_request_id=crid))
            return
        client.requests.add(key)
        self.requests.add(record, Phase.QUEUED, now)
        if record.exhausted():
            self.finish_here(record, "COMPLETED", "length", "length reached before resubmission")

    def _on_abort(self, client: ClientRecord, body: ClientAbort) -> None:
        record = self.requests.get(f"{client.client_id}/{body.client_request_id}")
        if record is not None and record.phase is not Phase.FINISHED:
            self.abort(record, "aborted by the client")

    def _on_result_ack(self, client: ClientRecord, body: ResultAck) -> None:
        for crid in body.client_request_ids:
            record = self.requests.get(f"{client.client_id}/{crid}")
            if record is not None and record.phase is Phase.FINISHED:
                self.forget_request(record)

    def abort(self, record: RequestRecord, message: str, by_client: bool = True) -> None:
        """End an unfinished request now with the tokens mirrored so far (its engine is told to drop it).

        A client's abort is ``FAILED``; the fleet's (PAUSE in abort mode) is ``COMPLETED``: the
        partial output is a valid answer that the caller may resubmit to continue.
        """
        if record.phase is Phase.DISPATCHED:
            engine = self.engines.get(record.engine_id or "")
            if engine is not None:
                engine.assigned.discard(record.request_id)
                self.send(engine.identity, Header.ABORT, EngineAbort(request_id=record.request_id), engine.batches)
        if by_client:
            self.finish_here(record, "FAILED", "abort", message, error=message)
        else:
            self.finish_here(record, "COMPLETED", "abort", message)

    def abort_unfinished(self, message: str) -> int:
        """PAUSE in abort mode: end every unfinished request (queued, on an engine); how many."""
        unfinished = [r for r in self.requests if r.phase is not Phase.FINISHED]
        for record in unfinished:
            self.abort(record, message, by_client=False)
        return len(unfinished)

    def finish_here(self, record: RequestRecord, status: str, finish_reason: str, detail: str,
                    error: str | None = None) -> None:
        """Finish a request without an engine's record (aborted, or nothing left to compute): the record
        has what an engine's final one has (the client got the tokens in ``STEP_TOKENS``)."""
        record.add_event("FAIL" if status == "FAILED" else "FINISH", detail)
        self._finish(record, FinalRecord(
            request_id=record.request_id, status=RequestStatus(status), finish_reason=FinishReason(finish_reason),
            error=error, events=record.events, arrival_time=record.arrival_time, finish_time=time.time(),
            cached_tokens=record.cached_tokens or 0))

    def _finish(self, record: RequestRecord, final: FinalRecord) -> None:
        reason = None if final.finish_reason is None else final.finish_reason.value
        self.requests.finish(record, _ENCODE.encode(final), final.status.value, reason)
        self.deliver(record)

    def deliver(self, record: RequestRecord) -> None:
        """Send a finished request's RESULT; it stays in the table until acknowledged (or the client
        does not acknowledge at all)."""
        client = self.clients.get(record.client_id)
        if client is None or client.identity is None:
            return  # kept until the client comes back (or times out)
        self.send(client.identity, Header.RESULT,
                  ResultOut(client_request_id=record.client_request_id, request=msgspec.Raw(record.final)),
                  client.batches)
        if not client.acks:
            self.forget_request(record)

    def forget_request(self, record: RequestRecord) -> None:
        self.requests.forget(record)
        self.handoffs.forget(record.request_id)
        client = self.clients.get(record.client_id)
        if client is not None:
            client.requests.discard(record.request_id)
            if client.identity is None and not client.requests:
                del self.clients[client.client_id]

    def requeue(self, record: RequestRecord, reason: str) -> None:
        """Put a request that lost its engine back at the head of the queue, keeping its tokens; one pinned to that
        engine (a data-parallel rank: :mod:`.placement`) fails instead, with the tokens it has."""
        if record.pinned is not None:
            return self.finish_here(record, *pinned_gone(reason))
        record.moves += 1
        record.add_event("EVICT", reason)
        if record.exhausted():
            self.finish_here(record, "COMPLETED", "length", "length reached before the move")
        else:
            self.requests.enqueue(record, first=True)

    # ------------------------------------------------------------------ engines

    def _on_step(self, engine: EngineRecord, body: EngineStep, now: float) -> None:
        if body.engine_id != engine.engine_id:
            # Output of an earlier registration of this same socket: its requests were re-queued.
            self.drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        records, engine_id, decode = self.requests.records, engine.engine_id, _STEP_OUTPUT.decode
        steps = StepShares()  # what each client gets of this step, one message
        finished: list[tuple[RequestRecord, msgspec.Raw | None, bool]] = []
        for raw in body.outputs:
            try:
                out = decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.drop(engine.engine_id, f"ENGINE_STEP output: {exc}")
                continue
            record = records.get(out.request_id)
            if record is None or record.phase is not Phase.DISPATCHED or record.engine_id != engine_id:
                self.stale_outputs += 1  # aborted, or moved to another engine: never deliver twice
                continue
            if out.new_tokens or out.routing is not None or out.prompt_scores is not None:
                self._mirror(record, out, raw, steps)
            final = body.records.get(out.request_id) if out.finished else None
            handed_on = self.handoffs.active and self.handoffs.on_output(self, engine, record, out, final)
            if out.finished:
                finished.append((record, final, handed_on))
        self._out += steps.sends()
        for record, final, handed_on in finished:  # their RESULTs after their last tokens
            engine.assigned.discard(record.request_id)
            engine.completed += 1
            if not handed_on:  # a prefill engine's finish hands the request on to a decode engine
                self._finish_from_engine(engine, record, final)

    def _mirror(self, record: RequestRecord, out: RequestDelta, raw: msgspec.Raw, steps: StepShares) -> None:
        """Keep the step's share (a request that moves continues from its tokens) and file it for the client's
        ``STEP_TOKENS``, which makes the text (for every request: stop strings are its job): the delta as the engine
        encoded it (a finished request's record came apart from it, for ``RESULT``)."""
        record.keep(out)
        client = self.clients.get(record.client_id)
        if client is not None and client.identity is not None:
            steps.add(client.identity, client.batches, record.client_request_id, raw)

    def _finish_from_engine(self, engine: EngineRecord, record: RequestRecord, final: msgspec.Raw | None) -> None:
        """Finish with the engine's record ``final``, forwarded as its bytes when it is complete (the client
        parses it, once): only its status and reason are read here. A record without a final status is parsed
        here, and mended."""
        try:
            facts = None if final is None else final_facts(final)  # None when the engine sent nil
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.drop(engine.engine_id, f"unreadable final request {record.request_id}: {exc}")
            facts = None
        if facts is None or final is None:  # no record (or an unreadable one): the coordinator's mirror is the result
            self.finish_here(record, "COMPLETED", "length", "finished without a record")
            return
        if facts.status in _FINISHED:
            self.requests.finish(record, bytes(final), facts.status, facts.finish_reason)
            self.deliver(record)
            return
        try:
            whole = _FINAL_RECORD.decode(final)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.drop(engine.engine_id, f"unreadable final request {record.request_id}: {exc}")
            self.finish_here(record, "COMPLETED", "length", "finished without a readable record")
            return
        self._finish(record, msgspec.structs.replace(whole, status=RequestStatus.COMPLETED))

    def _on_heartbeat(self, engine: EngineRecord, body: Heartbeat, now: float) -> None:
        engine.last_heartbeat = time.time()
        for name in ("running", "waiting", "kv_blocks_free", "kv_blocks_total", "cached_tokens", "computed_tokens"):
            value = getattr(body, name)
            if value is not None:
                setattr(engine, name, value)
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
            record = self.requests.get(key)
            if record is not None and record.phase is Phase.DISPATCHED and record.engine_id == engine.engine_id:
                engine.assigned.discard(key)
                self.requeue(record, f"handed back by engine {engine.engine_id}")
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
        orphans = sorted((r for k in engine.assigned if (r := self.requests.get(k)) is not None),
                         key=lambda r: r.arrival_time, reverse=True)
        engine.assigned.clear()
        for record in orphans:  # newest first, so queueing each at the head keeps arrival order
            self.requeue(record, f"engine {engine.engine_id} {reason}")
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
            queued=self.requests.count(Phase.QUEUED),
            in_flight=self.requests.count(Phase.DISPATCHED), completed=self.requests.completed,
            failed=self.requests.failed, aborted=self.requests.aborted, status_id=ask.status_id, epoch=self.epoch,
            coordinator_id=self.coordinator_id, routing=self.routing_name, suspend_level=self.suspend_level,
            clients=sum(1 for c in self.clients.values() if c.identity is not None),
            pending_controls=[op.verb.name for op in self.verbs.queue], dropped_frames=self.drop.total,
            weights=self.weights_source, refits=self.refits,
            epoch_mismatch=sorted(e.engine_id for e in engines if e.epoch != self.epoch),
            incomplete_weights=self.incomplete_weights(), stall_timeout=self.stall_timeout,
            sessions=self.sessions.describe(), expert_groups=self.verbs.wanted_sizes.describe(engines))

