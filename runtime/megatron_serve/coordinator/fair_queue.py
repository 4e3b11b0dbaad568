"""The coordinator's queue for requests of tenants (``SamplingParams.tenant``), in the fleet's queue policy
(:mod:`megatron_serve.scheduling.queue_policy`: bands, fair shares, priority, arrival).

A queued request of a tenant waits in its band (its class: ``critical``, ``standard``, ``sheddable``), in its
tenant's own heap (vLLM's ``priority``, then arrival). The next request to dispatch is the head of the best band
that has one; within a band, the head of the tenant with the least virtual tokens. A tenant with twice the weight of
another is served twice the tokens while both wait. A request is charged when it is dispatched, for what it may cost
(its prompt and its ``max_tokens``), and what it did not use is given back when it finishes: the requests a tenant
has waiting in engines count as given to it.

Starvation is bounded: a request queued for ``promote_after`` seconds counts as one band better, and one more for
each further ``promote_after`` (the SGLang Model Gateway promotes the same way), so a flood of ``critical`` work
delays a ``sheddable`` request, never forever.

Requests without a tenant never come here (``coordinator.requests`` keeps them as before).
"""

from __future__ import annotations

import heapq
from typing import Callable, Generic, Protocol, TypeVar

from ..scheduling.queue_policy import QueuePolicy
from ..wire.sampling_params import SamplingParams
from ..wire.tenancy import CLASSES, band_of

#: Seconds a queued request waits before it counts as one band better.
DEFAULT_PROMOTE_AFTER = 30.0
#: Tenants whose counts are kept at most, beyond those with requests queued (the rest start again when they return).
MAX_COUNTED = 10_000

#: One queued request: (priority, order, key).
Entry = tuple[int, int, str]


class Tenanted(Protocol):
    """What the queue reads and writes of a request (the request table's record is one): said here, so that the
    queue sits beneath the table that holds it and knows nothing else of a record."""

    request_id: str
    params: SamplingParams
    prompt_tokens: list[int]
    queued_at: float | None  # when it was queued (its band improves as it waits)
    charged: int  # tokens charged to its tenant's share, settled at its finish

    @property
    def generated_tokens(self) -> list[int]: ...


R = TypeVar("R", bound=Tenanted)


class FairQueue(Generic[R]):
    """The queued requests of tenants (module docstring). ``live(key, order)``: the queued record an entry stands for,
    or None for a stale entry (finished, or queued again since)."""

    def __init__(self, live: Callable[[str, int], R | None],
                 promote_after: float | None = DEFAULT_PROMOTE_AFTER) -> None:
        self.live = live
        self.policy = QueuePolicy(promote_after, max_counted=MAX_COUNTED)  # bands (promoted by seconds), fair shares
        self.bands: list[dict[str, list[Entry]]] = [{} for _ in CLASSES]
        self.size = 0  # entries held, stale ones included

    def __bool__(self) -> bool:
        return self.size > 0

    def push(self, record: R, order: int, now: float | None) -> None:
        tag = record.params.tenant
        assert tag is not None, "only requests of tenants are queued here"
        tenants = self.bands[band_of(tag)]
        heap = tenants.get(tag.name)
        if heap is None:
            heap = tenants[tag.name] = []
            self.policy.join(tag.name, (other for band in self.bands for other in band))
        if now is not None:
            record.queued_at = now
        heapq.heappush(heap, (record.params.priority, order, record.request_id))
        self.size += 1

    def head(self, now: float | None) -> tuple[R, int] | None:
        """The next request and the band it counts in now (its own, or better after waiting), or None."""
        best: tuple[tuple[int, float, int], R, int] | None = None
        for tenants in self.bands:
            for name in list(tenants):
                heap = tenants[name]
                record = self._head_of(heap)
                if record is None:
                    del tenants[name]
                    continue
                waited = 0.0 if now is None or record.queued_at is None else now - record.queued_at
                effective = self.policy.band(record.params, waited)
                rank = (effective, self.policy.count(name), heap[0][1])
                if best is None or rank < best[0]:
                    best = (rank, record, effective)
        return None if best is None else (best[1], best[2])

    def _head_of(self, heap: list[Entry]) -> R | None:
        while heap:
            _, order, key = heap[0]
            record = self.live(key, order)
            if record is not None:
                return record
            heapq.heappop(heap)
            self.size -= 1
        return None

    def pop(self, record: R) -> None:
        """Remove ``record``, the head :meth:`head` returned."""
        tag = record.params.tenant
        assert tag is not None
        heapq.heappop(self.bands[band_of(tag)][tag.name])
        self.size -= 1

    def charge(self, record: R) -> None:
        """``record`` is dispatched: its tenant is charged what it may cost (its prompt and the tokens it may still
        generate), settled when it finishes (:meth:`settle`). Charged up front, a tenant's share counts the work it
        was given, not only the work done so far: the requests it has waiting in engines count too."""
        tag = record.params.tenant
        assert tag is not None
        cost = len(record.prompt_tokens) + max(record.params.num_tokens_to_generate - len(record.generated_tokens), 0)
        record.charged += cost
        self.policy.charge(tag.name, cost, tag.weight)

    def settle(self, record: R) -> None:
        """``record`` finished: what it was charged and did not use goes back to its tenant."""
        tag = record.params.tenant
        unused = record.charged - len(record.prompt_tokens) - len(record.generated_tokens)
        record.charged = 0
        if tag is not None and unused > 0:
            self.policy.refund(tag.name, unused, tag.weight)
