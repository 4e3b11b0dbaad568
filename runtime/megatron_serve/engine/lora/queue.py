"""Requests waiting for an adapter slot: with every ``--max-loras`` slot used by running requests of other
adapters, a request of one more adapter waits here, outside the scheduler, instead of failing.

Before each schedule the engine calls :meth:`LoraQueue.release`: waiting requests take the slots their
adapters' last requests left, in arrival order, and join the scheduler's queue. Waiting requests count among
the engine's waiting ones and in ``vllm:lora_requests_info``'s ``waiting_lora_adapters``.

A request whose adapter is already in a slot shares it and does not wait, as in vLLM's scheduler (which skips
requests of a new adapter while ``max_loras`` adapters run) -- except the requests of one slot while others
wait. vLLM lets every request of an adapter in a slot pass a waiting one, so a steady stream of them keeps
the slots busy and the waiting adapter waits without bound. Here, once a request waits, one slot *drains*:
the one whose adapter has the fewest running requests (the least recently admitted among equals). New requests
of its adapter queue behind the waiting ones instead of sharing it, its running requests finish as they would,
and the slot goes to the first waiting request once they have: a wait is bounded by those requests' lengths.
The other slots' adapters keep sharing their slots. Nothing running is preempted: no work is lost or redone,
and every request keeps the weights it was admitted under. Requests take freed slots in arrival order; a
request that arrives while others wait takes no free slot ahead of them.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Iterable, Protocol

from .adapters import EngineLoras, Registration, adapter_root

if TYPE_CHECKING:
    from ..sequence import Sequence


class Queues(Protocol):
    """Where a request that may run goes: the scheduler's queue (:class:`~..scheduler.Scheduler`, which holds this
    one)."""

    def add(self, sequence: Sequence) -> None: ...


class LoraQueue:
    """Requests admitted under an adapter registration that wait for a slot; every other request passes through."""

    def __init__(self, loras: EngineLoras | None):
        self.loras = loras
        self._waiting: deque[tuple["Sequence", Registration]] = deque()
        self._draining: tuple[int, str | None] | None = None  # (slot, the registration in it) while requests wait

    def __len__(self) -> int:
        return len(self._waiting)

    def sequences(self) -> list["Sequence"]:
        return [sequence for sequence, _ in self._waiting]

    @property
    def draining(self) -> int | None:
        """The slot that takes no new request of its adapter until the waiting ones have a slot; None when none
        waits, or once a waiting request took that slot."""
        if self._draining is None or self.loras is None or self.loras.holder(self._draining[0]) != self._draining[1]:
            return None
        return self._draining[0]

    def add(self, sequence: "Sequence", registration: Registration | None, scheduler: Queues,
            live: Iterable["Sequence"]) -> None:
        """Queue ``sequence`` in ``scheduler``, with its slot when it has an adapter; it waits here when none is free
        or others wait ahead of it (``live``: the engine's sequences, whose slots are taken)."""
        if registration is None:
            scheduler.add(sequence)
            return
        live = list(live)
        if self._place(sequence, registration, live, share_only=bool(self._waiting)):
            scheduler.add(sequence)
            return
        self._waiting.append((sequence, registration))
        self._choose_drain(live)

    def release(self, scheduler: Queues, live: Iterable["Sequence"]) -> None:
        """Waiting requests that a slot is free for now join ``scheduler``'s queue, in arrival order; behind one that
        still waits, only requests sharing a slot their adapter holds (not the draining one) pass."""
        still: deque[tuple["Sequence", Registration]] = deque()
        live = list(live)
        for sequence, registration in self._waiting:
            if self._place(sequence, registration, live, share_only=bool(still)):
                scheduler.add(sequence)
            else:
                still.append((sequence, registration))
        self._waiting = still
        self._choose_drain(live)

    def discard(self, sequence: "Sequence") -> None:
        """Forget ``sequence`` if it waits (aborted)."""
        self._waiting = deque(item for item in self._waiting if item[0] is not sequence)

    def take_all(self) -> list["Sequence"]:
        """Every waiting request, handed back (the engine drains)."""
        taken = self.sequences()
        self._waiting.clear()
        self._draining = None
        return taken

    def _choose_drain(self, live: list["Sequence"]) -> None:
        """Keep draining the slot chosen while it holds the same registration; choose another once a waiting request
        took it; none once nothing waits."""
        if not self._waiting or self.loras is None:
            self._draining = None
            return
        if self.draining is not None:
            return
        counts = Counter(s.lora_slot for s in live if s.lora_slot >= 0)
        slot = self.loras.drain_choice(counts) if counts else None
        self._draining = None if slot is None else (slot, self.loras.holder(slot))

    def _place(self, sequence: "Sequence", registration: Registration, live: Iterable["Sequence"],
               share_only: bool) -> bool:
        assert self.loras is not None  # a registration exists only on an engine with adapters
        slot = self.loras.place(registration, {s.lora_slot for s in live}, share_only, self.draining)
        if slot is None:
            return False
        sequence.lora_slot, sequence.lora_version = slot, registration.version
        sequence.prefix_root = adapter_root(sequence.prefix_root, registration.key)
        return True
