"""Requests waiting for an adapter slot: with every ``--max-loras`` slot used by running requests of other
adapters, a request of one more adapter waits here, outside the scheduler, instead of failing.

Before each schedule the engine calls :meth:`LoraQueue.release`: waiting requests take the slots their
adapters' last requests left, in arrival order, and join the scheduler's queue. A request whose adapter is
already in a slot never waits (it shares the slot), so a waiting request of another adapter gets a slot once
the requests of one slot's adapter have all finished, as in vLLM's scheduler, which skips requests of a new
adapter while ``max_loras`` adapters run. Waiting requests count among the engine's waiting ones and in
``vllm:lora_requests_info``'s ``waiting_lora_adapters``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterable

from .lora import EngineLoras, Registration, adapter_root

if TYPE_CHECKING:
    from .scheduler import Scheduler, Sequence


class LoraQueue:
    """Requests admitted under an adapter registration that wait for a slot; every other request passes through."""

    def __init__(self, loras: EngineLoras | None):
        self.loras = loras
        self._waiting: deque[tuple["Sequence", Registration]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def sequences(self) -> list["Sequence"]:
        return [sequence for sequence, _ in self._waiting]

    def add(self, sequence: "Sequence", registration: Registration | None, scheduler: "Scheduler",
            live: Iterable["Sequence"]) -> None:
        """Queue ``sequence`` in ``scheduler``, with its slot when it has an adapter; it waits here when none is free
        (``live``: the engine's sequences, whose slots are taken)."""
        if registration is not None and not self._place(sequence, registration, live):
            self._waiting.append((sequence, registration))
            return
        scheduler.add(sequence)

    def release(self, scheduler: "Scheduler", live: Iterable["Sequence"]) -> None:
        """Waiting requests that a slot is free for now join ``scheduler``'s queue, in arrival order."""
        still = deque()
        live = list(live)
        for sequence, registration in self._waiting:
            if self._place(sequence, registration, live):
                scheduler.add(sequence)
            else:
                still.append((sequence, registration))
        self._waiting = still

    def discard(self, sequence: "Sequence") -> None:
        """Forget ``sequence`` if it waits (aborted)."""
        self._waiting = deque(item for item in self._waiting if item[0] is not sequence)

    def take_all(self) -> list["Sequence"]:
        """Every waiting request, handed back (the engine drains)."""
        taken = self.sequences()
        self._waiting.clear()
        return taken

    def _place(self, sequence: "Sequence", registration: Registration, live: Iterable["Sequence"]) -> bool:
        assert self.loras is not None  # a registration exists only on an engine with adapters
        slot = self.loras.place(registration, {s.lora_slot for s in live})
        if slot is None:
            return False
        sequence.lora_slot, sequence.lora_version = slot, registration.version
        sequence.prefix_root = adapter_root(sequence.prefix_root, registration.key)
        return True
