"""The fleet's one queue policy: which waiting request goes first, wherever requests wait (the coordinator's queue,
an engine's waiting list). Four rules, each applied among the requests the one before leaves equal:

1. **Bands.** A request's class (``SamplingParams.tenant``'s ``priority_class``; no tenant: ``standard``) is a strict
   band (``wire.tenancy``): a better band goes before every request of a worse one. A request that has waited
   ``promote_after`` counts one band better, and one more per further ``promote_after`` (seconds in the coordinator,
   steps in an engine), so that no request waits forever behind better ones.
2. **Fair shares.** Within a band, the tenant with the fewest virtual tokens goes first: the tokens it was given,
   divided by its weight (the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models",
   OSDI 2024). A tenant that had nothing waiting starts again at the least count of those that wait: it cannot bank
   the time it was away.
3. **Priority.** Within a tenant (and among untenanted requests), vLLM's ``priority``: lower first.
4. **Arrival.** Then first come, first served.

:class:`QueuePolicy` ranks and counts; it holds no queue. The coordinator keeps its queued requests in heaps keyed by
its ranks (``coordinator.requests``, ``coordinator.fair_queue``), the engine its waiting list in the order it gives
(``engine.scheduler``, ``engine.tenancy``): the same rules in both, so that a request's place is the same wherever
it waits.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, TypeVar

from ..wire.sampling_params import SamplingParams
from ..wire.tenancy import band_of

#: Where a request stands by the rules above the fair shares: its band, then its priority value; smaller first.
Rank = tuple[int, int]

T = TypeVar("T")


class QueuePolicy:
    """Bands, fair shares, priority and arrival (see the module docstring) for one queue's requests.

    ``promote_after``: what a request waits before it counts one band better (0 or None: never promoted);
    ``by_priority``: whether ``priority`` ranks requests of one band (an engine under vLLM's ``fcfs`` policy ranks
    priorities only within a tenant's own requests); ``max_counted``: tenants whose counts are kept beyond those
    waiting (the rest start again when they come back)."""

    def __init__(self, promote_after: float | None = None, *, by_priority: bool = True,
                 max_counted: int = 10_000) -> None:
        self.promote_after = promote_after
        self.by_priority = by_priority
        self.max_counted = max_counted
        self.counts: dict[str, float] = {}  # virtual tokens by tenant

    # ------------------------------------------------------------------ bands and priority

    def band(self, params: SamplingParams, waited: float = 0) -> int:
        """The band a request counts in after waiting ``waited``: its class's, one better per ``promote_after``."""
        band = band_of(params.tenant)
        if self.promote_after and waited >= self.promote_after:
            band = max(0, band - int(waited // self.promote_after))
        return band

    def rank(self, params: SamplingParams, waited: float = 0) -> Rank:
        """Its band (after ``waited``) and, with ``by_priority``, its priority value (else 0)."""
        return self.band(params, waited), params.priority if self.by_priority else 0

    @staticmethod
    def before(band: int, arrival: float, other_band: int, other_arrival: float) -> bool:
        """Whether a request of ``band`` that arrived at ``arrival`` goes before another (bands, then arrival: the
        rule between two queues' heads whose fair shares and priorities do not compare)."""
        return (band, arrival) <= (other_band, other_arrival)

    @staticmethod
    def place(queue: deque[T], item: T, priority: Callable[[T], int]) -> None:
        """Queue ``item`` behind every waiting one whose priority value is not larger (arrival order within a
        priority), looking from the back; without priorities, at the end."""
        key = priority(item)
        if not queue or priority(queue[-1]) <= key:
            queue.append(item)
            return
        index = len(queue) - 1
        while index and priority(queue[index - 1]) > key:
            index -= 1
        queue.insert(index, item)

    # ------------------------------------------------------------------ fair shares

    def count(self, tenant: str) -> float:
        """``tenant``'s virtual tokens."""
        return self.counts.get(tenant, 0.0)

    def join(self, tenant: str, waiting: Iterable[str]) -> None:
        """``tenant`` had nothing waiting and has now: it starts at least at the least count of the ``waiting``
        tenants (the others), and tenants gone beyond ``max_counted`` are forgotten."""
        others = set(waiting)
        others.discard(tenant)
        floor = min((self.count(other) for other in others), default=0.0)
        if self.count(tenant) < floor:
            self.counts[tenant] = floor
        if len(self.counts) > self.max_counted + len(others):
            self.counts = {name: count for name, count in self.counts.items() if name in others or name == tenant}

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """``tokens`` given to ``tenant`` (of ``weight``)."""
        self.counts[tenant] = self.count(tenant) + tokens / weight

    def refund(self, tenant: str, tokens: float, weight: float) -> None:
        """``tokens`` charged to ``tenant`` and not used (a request finished early): given back, if it is counted."""
        if tenant in self.counts:
            self.counts[tenant] -= tokens / weight
