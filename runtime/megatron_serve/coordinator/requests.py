"""The request table: every request from SUBMIT until its client acknowledged the RESULT.

Queued requests are dispatched in the fleet's queue policy's order (:mod:`megatron_serve.scheduling.queue_policy`:
bands, fair shares, priority, arrival): in arrival order, except that a request with a ``priority`` goes
ahead of every queued request with a larger value (lower first, as in the engines' schedulers), and
a request that lost its engine goes ahead of all. Requests without a priority (0) never pay for
the ordering: they wait in a plain deque, the others in a heap beside it. Requests of tenants
(``SamplingParams.tenant``) wait in the tenants' queue (:mod:`.fair_queue`: strict bands, fair shares),
whose head goes before an untenanted one unless that one counts in a better band or came first.

A request's life is a :class:`Phase`, changed only here: ``QUEUED``, ``DISPATCHED`` (to exactly one
engine), ``FINISHED`` (its final record kept until delivered and acknowledged). The coordinator mirrors every token an engine reports, so a
request whose engine disappears is queued again and continues elsewhere from those tokens; only the
engine a request is dispatched to may add to it, so each token and each result is delivered once.
What goes with the tokens (log probs, epochs, prompt scores) is mirrored too, for one reason only:
a client that reconnects gets the tokens it missed again, whole (a catch-up in ``STEP_TOKENS``).
A step's plain deltas are filed as the engine's bytes (:meth:`RequestRecord.file`) and read into the mirror
only when something reads it (a move, a catch-up, an abort): most requests finish without that, and an engine
step costs the coordinator a copy per request instead of a decode and an accumulation. A request whose engine builds its
client's share of each step (protocol 11) has its deltas in that engine's log (:mod:`.step_log`), read the same way.

The final record is the engine's msgpack bytes, forwarded to the client as they came: the
coordinator reads only how it ended (:func:`final_facts`; the client validates it where it enters its process).
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import msgspec

from ..limits import KeptIdsMeter
from ..wire.accumulator import DeltaAccumulator
from ..wire.expert_routing import RoutingRecord, routing_to_wire
from ..wire.body import ClientId, TokenId
from ..wire.deltas import RequestDelta, RoutingRows, TokenDelta, delta_array
from ..multimodal import PromptImage, cache_keys
from ..wire.prefix_hash import adapter_root, salted_root
from ..wire.request import EventType, RequestEvent
from ..wire.sampling_params import SamplingParams
from ..wire.tenancy import STANDARD_BAND
from ..scheduling.queue_policy import QueuePolicy
from .fair_queue import FairQueue
from .step_log import StepLog

logger = logging.getLogger("megatron_serve.coordinator")

#: Filed deltas a request holds as bytes at most (about 110 bytes each, twice what the mirror keeps of a one-token
#: delta): a longer request's are read into its mirror this many at a time, each read costing about what filing saved.
UNREAD_LIMIT = 4096


class Phase(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    FINISHED = "finished"

    # Members are singletons: identity hashing is exact, and C-level. Enum's own hashes the name in
    # Python, a dozen times per request in the table's counters: 1.2 of the coordinator's 20 us per
    # request (benchmarks/coordinator_core.py).
    __hash__ = object.__hash__


@dataclass(eq=False, slots=True)
class RequestRecord:
    """One request as the coordinator mirrors it (implements ``routing.RequestView``)."""

    request_id: str  # "<client_id>/<client_request_id>": unique, also the engine-side request id
    client_id: str
    client_request_id: ClientId
    prompt_tokens: list[int]
    params: SamplingParams
    params_wire: bytes  # the sampling parameters as the client sent them (forwarded to engines unchanged)
    stream: bool
    # What the engines' deltas carried (after the tokens a resubmission came with): the mirror a moved
    # request continues from, the same accumulation as the client's (wire.accumulator); read it as ``out``
    mirror: DeltaAccumulator = field(default_factory=DeltaAccumulator)
    unread: list[msgspec.Raw] = field(default_factory=list)  # deltas filed after the mirror's, as their bytes
    events: list[RequestEvent] = field(default_factory=list)  # what happened here (moves)
    arrival_time: float = field(default_factory=time.time)
    phase: Phase = Phase.QUEUED
    engine_id: str | None = None
    moves: int = 0
    final: bytes | None = None  # the finished record's msgpack (forwarded unparsed)
    images: list[PromptImage] = field(default_factory=list)  # placed in prompt_tokens by the caller's process
    queue_order: int = 0  # in the priority heap: when it was queued; in the deque: 0, or -1 moved (ahead of all)
    queued_at: float | None = None  # a tenant's request: when it was queued (its band improves as it waits)
    charged: int = 0  # a tenant's request: tokens charged to its tenant's share (fair_queue), settled at its finish
    session_id: str | None = None  # the multi-turn session it belongs to (coordinator.placement): its engine first
    pinned: str | None = None  # the engine its data-parallel rank named at arrival: it runs there or fails
    kept: KeptIdsMeter | None = None  # return_top_p_token_ids: its kept ids counted as produced (flow.on_step)
    # protocol 11: the log of its engine's client shares its deltas come in, from entry ``log_from`` on (.step_log)
    log: StepLog | None = None
    log_from: int = 0

    @property
    def prefix_keys(self) -> list[int]:
        """The prompt as the prefix cache keys it: an image's placeholder tokens stand for its content."""
        return cache_keys(self.prompt_tokens, self.images) if self.images else self.prompt_tokens

    @property
    def prefix_root(self) -> int:
        """Where the prompt's chain of block hashes starts (its cache salt's root), as the engines start it; under a
        LoRA adapter, a root of that adapter's own, so that ``prefix_affinity`` never expects a request to find the
        blocks of another adapter or of the base model (engines never share them)."""
        root = salted_root(self.params.cache_salt)
        return root if self.params.lora_name is None else adapter_root(root, self.params.lora_name)

    def add_event(self, event_type: str, detail: str) -> None:
        self.events.append(RequestEvent(EventType(event_type), time.time(), detail))

    @property
    def out(self) -> DeltaAccumulator:
        """The mirror, with every delta filed so far read into it, then those in its engine's log."""
        if self.unread:
            self._read_filed()
        for delta in _read(self._take_logged(), self.request_id):
            self.mirror.add(delta, self.request_id)
        return self.mirror

    def _take_logged(self) -> list[msgspec.Raw]:
        """Its deltas in its engine's log not taken yet (copies), in order; the mark moves past them."""
        log = self.log
        if log is None or log.position <= self.log_from:
            return []
        deltas = log.deltas_of(self.request_id, self.client_id, self.log_from)
        self.log_from = log.position
        return deltas

    def file(self, delta: msgspec.Raw) -> None:
        """Keep a step's delta as its bytes (copied: the frame it came in is not held), read when the mirror is, or
        once :data:`UNREAD_LIMIT` wait. Its deltas in the log come first (they are older)."""
        self.unread += self._take_logged()
        self.file_read(delta.copy())

    def file_read(self, delta: msgspec.Raw) -> None:
        """:meth:`file` a delta already copied, with nothing in the log before it (:meth:`StepLog.trim`)."""
        self.unread.append(delta)
        if len(self.unread) >= UNREAD_LIMIT:
            self._read_filed()

    def log_to(self, log: StepLog | None) -> None:
        """Its deltas come in ``log`` from now on (None: one by one); what the log before held is filed first."""
        old = self.log
        if old is not None:
            self.unread += self._take_logged()
            old.users.discard(self.request_id)
        self.log = log
        if log is not None:
            self.log_from = log.position
            log.users.add(self.request_id)

    def _read_filed(self) -> None:
        unread, self.unread = self.unread, []
        for delta in _read(unread, self.request_id):
            self.mirror.add(delta, self.request_id)

    @property
    def generated_tokens(self) -> list[int]:
        return self.out.tokens

    @property
    def cached_tokens(self) -> int | None:
        return self.out.cached_tokens

    @property
    def routing(self) -> RoutingRecord | None:
        """return_routing_indices: the expert rows mirrored with the tokens."""
        return self.out.routing

    def exhausted(self) -> bool:
        """Nothing left to compute: every token the request asked for is already generated."""
        return len(self.out.tokens) >= self.params.num_tokens_to_generate

    def keep(self, out: RequestDelta) -> None:
        """Keep what one engine step added."""
        self.out.add(out, self.request_id)

    def tokens_after(self, have: int) -> TokenDelta | None:
        """What a reconnected client that has ``have`` tokens lacks, whole (None: nothing); its first token is
        generated token ``have`` (the client has more by the time it arrives: the steps forwarded since it sent
        its count)."""
        out = self.out
        if len(out.tokens) <= have:
            return None
        skip = max(have - out.resumed, 0)  # into the lists mirrored since the resubmission
        delta = TokenDelta(new_tokens=out.tokens[have:], new_log_probs=out.log_probs[skip:] or None,
                           top_ids=out.top_ids[skip:] or None, top_log_probs=out.top_log_probs[skip:] or None,
                           top_p_token_ids=out.top_p_token_ids[skip:] or None,
                           cached_tokens=out.cached_tokens, prompt_scores=out.prompt_scores,
                           stop_token=out.stop_token)
        if have >= out.resumed:
            delta.epochs = [out.policy_epochs[skip:], out.kv_epochs[skip:], out.lora_epochs[skip:]]
        if out.routing is not None:  # every row: the client keeps those it has
            delta.routing = RoutingRows(start=0, **routing_to_wire(out.routing.array()))
        return delta


_DELTAS = msgspec.msgpack.Decoder(list[TokenDelta])
_DELTA = msgspec.msgpack.Decoder(TokenDelta)


def _read(unread: list[msgspec.Raw], request_id: str) -> list[TokenDelta]:
    """Filed deltas, decoded in one call; one by one when that fails, leaving out (and logging) each unreadable one."""
    try:
        return _DELTAS.decode(delta_array(unread))
    except (msgspec.ValidationError, msgspec.DecodeError):
        deltas = []
        for raw in unread:
            try:
                deltas.append(_DELTA.decode(raw))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                logger.warning("request %s: a delta not mirrored: %s", request_id, exc)
        return deltas


class DeltaFacts(msgspec.Struct):
    """What the coordinator reads of a ``RequestDelta`` as it passes (the rest is skipped, not parsed): whose, its
    ids, whether it ends the request, and whether it carries one of the rarer fields that are read whole (each a
    non-empty ``Raw`` when present)."""

    request_id: str
    new_tokens: list[TokenId]
    finished: bool = False
    routing: msgspec.Raw = msgspec.Raw()
    prompt_scores: msgspec.Raw = msgspec.Raw()
    top_p_token_ids: msgspec.Raw = msgspec.Raw()


class FinalFacts(msgspec.Struct):
    """What the coordinator reads of an engine's final record: how it ended (the rest is skipped, not parsed)."""

    status: str | None = None
    finish_reason: str | None = None


_FINAL_FACTS = msgspec.msgpack.Decoder(FinalFacts | None)


def final_facts(final: msgspec.Raw) -> FinalFacts | None:
    """How an engine's final record (its bytes) ended, None for nil; raises msgspec's errors for unreadable bytes."""
    return _FINAL_FACTS.decode(final)


class RequestTable:
    """Requests by key, the dispatch queue (arrival order; moved requests go first) and the counters."""

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}
        self.queue: collections.deque[str] = collections.deque()  # priority 0, and moved requests (first)
        self.ranked: list[tuple[int, int, str]] = []  # heap of (priority, order, key): priorities other than 0
        # requests of tenants (SamplingParams.tenant): bands, fair shares
        self.fair: FairQueue[RequestRecord] = FairQueue(self._live)
        self._order = itertools.count(1)
        self._head_ranked = False  # whether next_queued's answer came from the heap
        self._head_fair: RequestRecord | None = None  # next_queued's answer, when it came from the tenants' queue
        self.head_band: int | None = None  # the band next_queued's answer counts in (None: no tenant's)
        self.undelivered: set[str] = set()  # finished, but the client could not be reached
        self.counts = collections.Counter({phase: 0 for phase in Phase})
        self.completed = 0
        self.failed = 0
        self.aborted = 0  # by a client, or by the fleet (a pause in abort mode): neither is a failure

    def __len__(self) -> int:
        return len(self.records)

    def get(self, key: str) -> RequestRecord | None:
        return self.records.get(key)

    def add(self, record: RequestRecord, phase: Phase, now: float | None = None) -> None:
        record.phase = phase
        self.records[record.request_id] = record
        self.counts[phase] += 1
        if phase is Phase.QUEUED:
            self._queue(record, now)

    def _queue(self, record: RequestRecord, now: float | None) -> None:
        """Where a queued request waits: a tenant's in the tenants' queue, one with a priority in the heap (its order
        tells a live entry from a stale one), the others at the end of the deque."""
        if not (record.params.tenant is not None or record.params.priority):
            record.queue_order = 0
            self.queue.append(record.request_id)
            return
        order = next(self._order)
        record.queue_order = order
        if record.params.tenant is not None:
            self.fair.push(record, order, now)
        else:
            heapq.heappush(self.ranked, (record.params.priority, order, record.request_id))

    def _move(self, record: RequestRecord, phase: Phase) -> None:
        self.counts[record.phase] -= 1
        self.counts[phase] += 1
        record.phase = phase

    def enqueue(self, record: RequestRecord, first: bool = False) -> None:
        """Queue a request for dispatch (``first``: ahead of the others, for a request that lost its engine)."""
        self._move(record, Phase.QUEUED)
        record.engine_id = None
        if first:
            record.queue_order = -1
            self.queue.appendleft(record.request_id)
        else:
            self._queue(record, None)

    def dispatched(self, record: RequestRecord, engine_id: str) -> None:
        self._move(record, Phase.DISPATCHED)
        record.engine_id = engine_id

    def finish(self, record: RequestRecord, final: bytes, status: str | None, finish_reason: str | None) -> None:
        """``final`` is the record the client gets; ``status`` and ``finish_reason`` (its fields) count it."""
        if record.charged:
            self.fair.settle(record)
        self._move(record, Phase.FINISHED)
        record.engine_id = None
        record.final = final
        if finish_reason == "abort":
            self.aborted += 1
        elif status == "COMPLETED":
            self.completed += 1
        else:
            self.failed += 1

    def forget(self, record: RequestRecord) -> None:
        if record.charged:  # dropped without finishing (its client gone): its tenant gets back what it did not use
            self.fair.settle(record)
        if record.log is not None:
            record.log.users.discard(record.request_id)
            record.log = None
        if self.records.pop(record.request_id, None) is not None:
            self.counts[record.phase] -= 1
        self.undelivered.discard(record.request_id)

    def next_queued(self, now: float | None = None) -> RequestRecord | None:
        """The request at the head of the queue (entries of aborted or moved requests are skipped): a moved one, else
        the better of the untenanted queues' head (``standard``'s band) and the tenants' queue's (``now``: its
        requests' bands improve as they wait); :attr:`head_band` says which band it counts in."""
        legacy = self._next_untenanted()
        self._head_fair, self.head_band = None, None
        if not self.fair or (legacy is not None and legacy.queue_order == -1):
            return legacy
        found = self.fair.head(now)
        if found is None:
            return legacy
        record, band = found
        if legacy is None or QueuePolicy.before(band, record.arrival_time, STANDARD_BAND, legacy.arrival_time):
            self._head_fair, self.head_band = record, band
            return record
        return legacy

    def _next_untenanted(self) -> RequestRecord | None:
        queue = self.queue
        head = None
        while queue:
            record = self.records.get(queue[0])
            if record is not None and record.phase is Phase.QUEUED:
                head = record
                break
            queue.popleft()
        if not self.ranked:  # no priorities queued: the deque alone, as fast as ever
            return head
        ranked = None
        while self.ranked:
            _, order, key = self.ranked[0]
            ranked = self._live(key, order)
            if ranked is not None:
                break
            heapq.heappop(self.ranked)
        # the deque holds priority 0 (order 0) and moved requests (order -1, ahead of all); the heap the others
        self._head_ranked = ranked is not None and (head is None or (head.queue_order == 0
                                                                     and ranked.params.priority < 0))
        return ranked if self._head_ranked else head

    def _live(self, key: str, order: int) -> RequestRecord | None:
        """The queued record of a heap entry, unless the entry is stale (finished, or queued again since)."""
        record = self.records.get(key)
        return record if record is not None and record.phase is Phase.QUEUED and record.queue_order == order else None

    def pop_queued(self) -> None:
        """Remove the request :meth:`next_queued` returned."""
        if self._head_fair is not None:
            self.fair.pop(self._head_fair)
        elif self.ranked and self._head_ranked:
            heapq.heappop(self.ranked)
        else:
            self.queue.popleft()

    def count(self, phase: Phase) -> int:
        return self.counts[phase]

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(self.records.values())
