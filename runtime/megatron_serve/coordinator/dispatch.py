"""Dispatch: queued requests go to engines while the fleet runs and engines have room.

The routing policy (:mod:`megatron_serve.coordinator.routing`) chooses among the engines that may take work
now (of those, the ones already serving the request's LoRA adapter, when any does:
:func:`~megatron_serve.coordinator.routing.adapter_candidates`): registered, not draining or stopping, serving the fleet's weights (see
``FleetWeights.served_by``), and below ``capacity * dispatch_factor`` requests (a
little more than an engine runs at once, so that its next step never waits for the coordinator). A request
of a tenant (:mod:`.fair_queue`) counts only the assigned requests of its band or better against that limit,
so that a better class reaches an engine that lower ones fill, where it preempts one of them. A request counts in
the band it was dispatched in (a promoted one in the band it was promoted to: :mod:`.assigned`), so an engine holds
at most that limit per band whatever waits.

Placement (:mod:`.placement`) comes first: a request pinned to a data-parallel rank goes to its engine whatever its
room (or fails when that engine is gone), and a session's request to its session's engine when the policy would
only be asked to choose among candidates that include it under the load bound.
"""

from __future__ import annotations

import msgspec

from ..wire.lifecycle import FleetState
from ..wire.submission import EngineSubmitOut, WireImage
from ..wire.protocol import Header
from ..wire.request import EngineRequestOut, RoutingArray
from ..wire.tenancy import WORST_BAND, band_of
from .candidates import Candidates
from .effects import Outbox
from .fleet_weights import FleetWeights
from .flow import RequestFlow
from .kv_index import KVIndex
from .lifecycle import Lifecycle
from .membership import Membership
from .peers import EngineRecord
from .placement import Sessions
from .requests import Phase, RequestRecord
from .routing import EngineView, RoutingPolicy, adapter_candidates, make_routing_policy


def shared(record: RequestRecord) -> bool:
    """Whether a request's deltas may pass the coordinator in its client's share of a step, unread (protocol 11):
    none of them carries what the coordinator reads as it passes (expert rows, prompt scores, kept ids counted against
    a budget), and no tenant's share is settled from its tokens at its finish."""
    params = record.params
    return (record.kept is None and not params.return_routing_indices and not params.return_prompt_log_probs
            and not params.return_top_p_token_ids and params.tenant is None)


def wire_record(record: RequestRecord) -> EngineRequestOut:
    """The request engines read (``wire.request.EngineRequest``), from the coordinator's mirror.

    The sampling parameters are the client's bytes, spliced in unparsed (they were validated once,
    on arrival). Image files go with every dispatch, so that a request moved to another engine keeps
    them, and so do the tokens and expert rows mirrored so far: a continuation generates and records
    only what comes after them.
    """
    return EngineRequestOut(
        request_id=record.request_id, prompt_tokens=record.prompt_tokens,
        sampling_params=msgspec.Raw(record.params_wire), generated_tokens=record.generated_tokens,
        events=record.events, arrival_time=record.arrival_time,
        images=[WireImage(data=image.data, offset=image.offset, length=image.length if image.offset is not None else 0)
                for image in record.images],
        routing_indices=None if record.routing is None else RoutingArray.of(record.routing.array()))


class Dispatcher:
    """Routing's state (the policy, the KV index it may read, the sessions' engines, the candidates) and the dispatch
    pass over the request table. It reads the fleet's members, its lifecycle state and weights, and writes the
    submissions to the outbox."""

    def __init__(self, *, members: Membership, lifecycle: Lifecycle, weights: FleetWeights, flow: RequestFlow,
                 outbox: Outbox, routing: str, dispatch_factor: float, sessions: Sessions) -> None:
        """``routing``: the policy's name (:data:`~.routing.ROUTING_POLICIES`); ``dispatch_factor``: an engine holds
        at most its capacity times this."""
        self.members, self.lifecycle, self.weights, self.flow, self.outbox = members, lifecycle, weights, flow, outbox
        self.routing_name = routing
        self.kv_index = KVIndex()  # which engine holds which KV block, from their KV events (kv_aware reads it)
        self.policy: RoutingPolicy = make_routing_policy(routing, self.kv_index)
        self.sessions = sessions  # a session's engine, for its next request (placement)
        self.dispatch_factor = float(dispatch_factor)
        self.candidates = Candidates(self.limit, self.usable)  # the engines that may take a request now

    def limit(self, engine: EngineRecord) -> int:
        """The requests ``engine`` may hold: a little more than it runs at once."""
        return max(1, int(engine.capacity * self.dispatch_factor))

    def usable(self, engine: EngineRecord) -> bool:
        """Whether requests may go to ``engine`` at all: not draining or stopping, serving the fleet's weights."""
        return not (engine.draining or engine.stopping) and self.weights.served_by(engine)

    def forget(self, engine_id: str) -> None:
        """``engine_id`` left the fleet: what routing knew of its caches goes with it."""
        self.policy.forget(engine_id)
        self.kv_index.drop(engine_id)

    def dispatch(self, now: float) -> None:
        """Send queued requests to engines, in queue order, until the queue or the engines' room runs out.

        The candidates are filed again only where something changed since the last pass (:mod:`.candidates`): a
        heartbeat, a SUBMIT into a full fleet or a step of one engine costs what changed, not a scan of every engine,
        and ``least_loaded`` takes the least loaded candidate off their heap. A request that needs the candidates
        listed (a session's, a LoRA adapter's, a disaggregated fleet's, another policy's) lists them. Tenants'
        requests of a better band look at every engine when no candidate is left (a better band finds room that a
        worse one does not).
        """
        engines = self.members.engines
        if self.lifecycle.state is not FleetState.RUNNING or not engines:
            return
        self.sessions.expire(now)
        table = self.flow.table
        if not table.count(Phase.QUEUED):
            return
        candidates = self.candidates
        candidates.refresh(engines, self.room_key())
        if not candidates and not table.fair:
            return
        colocated = self.flow.handoffs.colocated(engines, self.members.registrations)
        while (record := table.next_queued(now)) is not None:
            if record.pinned is not None:
                engine = engines.get(record.pinned)
                if engine is not None and not self.usable(engine):
                    return  # draining (it will leave: then it fails) or loading the fleet's weights: held
                band = table.head_band
                table.pop_queued()
                if engine is None:
                    self.flow.requeue(record, f"engine {record.pinned} left the fleet before it ran the request")
                else:
                    self.send(record, engine, now, band)
                continue
            chosen = self._choose(record, colocated, now)
            if chosen is None:
                return
            engine = engines[chosen.engine_id]
            if record.session_id is not None:
                self.sessions.bind(record.session_id, engine.engine_id, now)
            band = table.head_band
            table.pop_queued()
            self.send(record, engine, now, band)

    def _choose(self, record: RequestRecord, colocated: bool, now: float) -> EngineView | None:
        """The engine for ``record`` (None: hold it): the least loaded candidate straight off the heap when nothing
        but load decides, else what placement or the policy choose among the candidates listed."""
        candidates, table, members = self.candidates, self.flow.table, self.members
        if (self.policy.by_load_alone and colocated and record.session_id is None and record.params.lora_name is None
                and (chosen := candidates.least()) is not None):
            return chosen
        pool: list[EngineRecord] = candidates.listed(members.engines.values()) if candidates else []
        if not pool:  # a tenant's request of a better band than some assigned ones: room counted in its band
            band = table.head_band
            if not table.fair or band is None or band >= WORST_BAND:
                return None
            pool = [e for e in members.engines.values() if self.usable(e) and self.band_room(e, band)]
            if not pool:
                return None
        engines = self.flow.handoffs.candidates(members.engines, members.registrations, record, pool)
        session = record.session_id
        chosen = self.sessions.choose(session, engines, now) if session is not None and engines else None
        if chosen is None:
            chosen = self.policy.select(record, adapter_candidates(record, engines)) if engines else None
        return chosen

    def room_key(self) -> tuple[object, ...]:
        """What moves whenever an engine may have become usable other than by a request leaving it: an engine
        registered or left, the fleet's weights moved (a refit makes an engine that caught up eligible). Draining and
        stopping only take room away."""
        weights = self.weights
        return (self.members.registrations, len(self.members.engines), weights.epoch, weights.source,
                weights.refits)

    def send(self, record: RequestRecord, engine: EngineRecord, now: float, band: int | None) -> None:
        """Dispatch the queued request the table just popped to ``engine``, counted there in ``band`` (None: its own
        class's, ``standard`` for an untenanted request)."""
        table = self.flow.table
        if record.params.tenant is not None:
            table.fair.charge(record)
        table.dispatched(record, engine.engine_id)
        if not engine.assigned:  # an idle loop may wait without counting: its stall clock starts now
            engine.stall_clock = now
        engine.assigned.add(record.request_id, band_of(record.params.tenant) if band is None else band)
        blocks, body = self.flow.handoffs.submit(record, engine, EngineSubmitOut(request=wire_record(record)))
        if engine.shares and body.kv_transfer_params is None and shared(record) and not self.flow.handoffs.active:
            body.client_id, body.client_request_id = record.client_id, record.client_request_id
            engine.assigned.name_client(record.request_id, record.client_id)
            record.log_to(engine.log)
        else:
            record.log_to(None)
        for part in blocks:  # a decode engine's blocks arrive ahead of their request (coordinator.disaggregation)
            self.outbox.send(engine.identity, Header.KV_BLOCKS, part, engine.batches)
        self.outbox.send(engine.identity, Header.ENGINE_SUBMIT, body, engine.batches)
        self.candidates.file(engine)  # its load moved: filed under it, or out when it is full

    def band_room(self, engine: EngineRecord, band: int) -> bool:
        """Whether ``engine`` has room for a request of ``band``, counting only its requests of that band or better: a
        ``critical`` request is sent to an engine full of ``sheddable`` ones, which then preempts one for it."""
        return engine.assigned.held(band) < self.limit(engine)
