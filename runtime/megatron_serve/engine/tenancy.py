"""An engine's policy for requests of tenants (``SamplingParams.tenant``, docs/tenants.md): strict bands, fair
shares by tokens within a band, a better band displacing a worse one, and promotion after waiting.

The scheduler holds one :class:`TenantPolicy` from the first request of a tenant it is given; until then (and in a
fleet with no tenants, always) it schedules exactly as before. With it:

* the waiting queue is put in order before each step (:meth:`TenantPolicy.order`): band by band, and within a band
  the tenants' requests merged by their virtual tokens (the tokens this engine computed for each tenant, divided by
  its weight, as ``coordinator.fair_queue`` counts them at the fleet's level), each tenant's own in the order it
  had (vLLM's ``priority``, then arrival; a preempted request first);
* the running list is kept in band order, so that the scheduler's preemption when KV blocks run out (its newest
  running request) takes the worst band's newest first;
* when every request slot is taken and the head of the queue is of a better band than the worst running request,
  that one is preempted for it (:meth:`TenantPolicy.displace`), and the scheduler does the same when KV blocks run
  out for it (:meth:`TenantPolicy.victim`). A preempted request keeps its tokens and goes back to the queue ahead
  of its band: it is recomputed from its prompt and tokens (its blocks come back from the prefix cache or the host
  tier where they still are), so its stream goes on unchanged;
* the step in which a better band takes a slot computes that band and better only: the running requests of worse
  bands sit that one step out (:meth:`TenantPolicy.left_out`), so that the request that asked for latency waits for
  its own work alone, as it would on an idle engine (SGLang runs a new request's prefill in a batch of prefills),
  not for a whole batch of the flood's decodes besides. They sit out at most one step in two: a stream of better
  requests slows a worse band by half at most, and never stops it;
* a request waiting ``promote_after`` steps counts as one band better, and one more for each further
  ``promote_after`` steps: no request waits forever behind better ones.

With vLLM's ``--scheduling-policy priority`` (``by_priority``) a request's rank is its class's band and then its
``priority`` value (lower is more urgent), so the same queue order, displacement and preemption apply between
priorities within a class, tenants or none (a request without a tenant is of the ``standard`` class).

The rules (bands, promotion, fair shares, priority) are the fleet's one queue policy
(:mod:`megatron_serve.scheduling.queue_policy`), the coordinator's too; promotion here counts steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..scheduling.queue_policy import QueuePolicy, Rank
from ..wire.tenancy import band_of

if TYPE_CHECKING:
    from collections import deque

    from .sequence import Sequence

#: Steps a waiting request of a tenant waits before it counts as one band better.
DEFAULT_PROMOTE_AFTER = 512
#: Tenants whose counts an engine keeps beyond those it holds requests of.
MAX_COUNTED = 1024


def base_band(sequence: "Sequence") -> int:
    """Its class's band (the KV pool's eviction order reads it too: ``kv.blocks``)."""
    return band_of(sequence.sampling_params.tenant)


class TenantPolicy:
    """Bands, fair shares and displacement for one scheduler (module docstring)."""

    def __init__(self, promote_after: int = DEFAULT_PROMOTE_AFTER, by_priority: bool = False) -> None:
        self.policy = QueuePolicy(promote_after, by_priority=by_priority, max_counted=MAX_COUNTED)
        self.left_out_last = False  # the last step left worse bands out for a better one (:meth:`left_out`)

    def rank(self, sequence: "Sequence") -> Rank:
        """Its class's band and, with ``by_priority``, its priority value (else 0)."""
        return self.policy.rank(sequence.sampling_params)

    def band(self, sequence: "Sequence") -> Rank:
        """Where ``sequence`` stands now: its rank, its band better by one per ``promote_after`` steps waited."""
        return self.policy.rank(sequence.sampling_params, sequence.waited_steps)

    def added(self, sequence: "Sequence", held: Iterable["Sequence"]) -> None:
        """A new request: its tenant, if it had nothing here, starts at the least count of those that have."""
        tag = sequence.sampling_params.tenant
        if tag is None:
            return
        names = {s.sampling_params.tenant.name for s in held if s.sampling_params.tenant is not None}
        if tag.name not in names:
            self.policy.join(tag.name, names)

    def order(self, waiting: "deque[Sequence]") -> None:
        """Put ``waiting`` in order for this step: bands, then tenants merged by virtual tokens (each request counted
        at the tokens it has to compute), each tenant's requests in their order."""
        if len(waiting) < 2:
            return
        groups: dict[tuple[Rank, str], list["Sequence"]] = {}
        for sequence in waiting:
            tag = sequence.sampling_params.tenant
            groups.setdefault((self.band(sequence), "" if tag is None else tag.name), []).append(sequence)
        ordered: list["Sequence"] = []
        for band in sorted({band for band, _ in groups}):
            queues = {name: members for (b, name), members in groups.items() if b == band}
            counts = {name: self.policy.count(name) for name in queues}
            heads = dict.fromkeys(queues, 0)
            while queues:
                name = min(queues, key=lambda n: (counts[n], queues[n][heads[n]].arrival_time))
                sequence = queues[name][heads[name]]
                ordered.append(sequence)
                tag = sequence.sampling_params.tenant
                counts[name] += sequence.num_uncomputed / (1.0 if tag is None else tag.weight)
                heads[name] += 1
                if heads[name] == len(queues[name]):
                    del queues[name]
        waiting.clear()
        waiting.extend(ordered)

    def charge(self, entries: Iterable[tuple["Sequence", int]]) -> None:
        """The tokens a step computes, each for its request's tenant."""
        for sequence, count in entries:
            tag = sequence.sampling_params.tenant
            if tag is not None:
                self.policy.charge(tag.name, count, tag.weight)

    def waited(self, waiting: Iterable["Sequence"]) -> None:
        """One more step for every request still waiting."""
        for sequence in waiting:
            sequence.waited_steps += 1

    def admitted(self, running: list["Sequence"], sequence: "Sequence") -> None:
        """Run ``sequence``: after every running request of its band or better (the running list stays in band
        order, so that the newest of the worst band is the one preempted first)."""
        sequence.waited_steps = 0
        band = self.rank(sequence)
        index = len(running)
        while index and self.rank(running[index - 1]) > band:
            index -= 1
        running.insert(index, sequence)

    def requeue(self, waiting: "deque[Sequence]", sequence: "Sequence") -> None:
        """A preempted request back in the queue: ahead of its band, behind the better ones."""
        band = self.band(sequence)
        index = 0
        while index < len(waiting) and self.band(waiting[index]) < band:
            index += 1
        waiting.insert(index, sequence)

    def displace(self, running: list["Sequence"], waiting: Iterable["Sequence"], free: int
                 ) -> tuple[list["Sequence"], Rank | None]:
        """Every request slot is taken (but ``free``): the waiting heads of a better band than the worst running
        requests take theirs, the worst band's newest first. The running requests they displace, taken out of
        ``running``, and the band of the worst head that displaced one (None: none did)."""
        victims: list["Sequence"] = []
        displacer: Rank | None = None
        for head in waiting:
            if head.pending_tokens:
                break
            if free > 0:
                free -= 1
                continue
            if self.victim(running, head) is None:
                break
            victims.append(running.pop())
            displacer = self.band(head)
        return victims, displacer

    def left_out(self, running: list["Sequence"], displacer: Rank | None) -> set[int]:
        """The running requests (by ``id``) that a step in which a head of band ``displacer`` displaced a worse
        request leaves out: those of a band worse than ``displacer`` (module docstring), unless the step before
        left them out already. None: no head displaced one, nothing is left out."""
        left = set() if displacer is None or self.left_out_last else {
            id(s) for s in running if self.rank(s) > displacer}
        self.left_out_last = bool(left)
        return left

    def victim(self, running: list["Sequence"], head: "Sequence") -> "Sequence | None":
        """The running request ``head`` (waiting) may take the place of: the worst band's newest, if worse than
        ``head``'s band."""
        if not running:
            return None
        last = running[-1]
        return last if self.rank(last) > self.band(head) else None

