"""Who is connected: engine groups and clients, as the coordinator sees them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..wire.lifecycle import ENGINE_DRAINING, FleetState
from ..wire.protocol import Role
from .assigned import Assigned
from .routing import engine_slot, served_adapters
from .step_log import StepLog


@dataclass(eq=False)
class EngineRecord:
    """One registered engine group (implements ``routing.EngineView``)."""

    engine_id: str
    identity: bytes
    group: int
    capacity: int
    info: dict[str, Any]
    state: str = FleetState.RUNNING.value
    batches: bool = False  # it understands BATCH frames (protocol 2)
    draining: bool = False
    stopping: bool = False
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    last_heartbeat: float = field(default_factory=time.time)  # wall clock, for humans
    last_seen: float = field(default_factory=time.monotonic)  # for the heartbeat timeout
    assigned: Assigned = field(default_factory=Assigned)  # its requests, counted by the band each was sent in
    completed: int = 0  # requests this engine finished (for STATUS and balance checks)
    epoch: int = 0  # generation of the weights it serves (from its HELLO, then its REFIT acks)
    weights: str | None = None  # where those weights came from
    last_refit: dict[str, Any] = field(default_factory=dict)  # timings of its last REFIT
    cached_tokens: int = 0  # prompt tokens the engine skipped thanks to its prefix cache (its heartbeat)
    computed_tokens: int = 0  # tokens the engine ran through its model (its heartbeat)
    metrics: dict[str, Any] | None = None  # its cumulative engine metrics (last heartbeat's ``metrics``)
    progress: int | None = None  # its step loop's iteration counter (last heartbeat's ``progress``); None: unknown
    stall_clock: float = field(default_factory=time.monotonic)  # a stall of its step loop is measured from here
    shares: bool = False  # it builds its clients' shares of a step when told their clients (protocol 11)
    log: StepLog = field(default_factory=StepLog)  # those shares, for the mirrors (.step_log)

    @property
    def load(self) -> int:
        return len(self.assigned)

    @property
    def slot(self) -> tuple[int, int]:
        """What one live engine holds (:func:`~.routing.engine_slot`): its group, and its data-parallel rank there."""
        return engine_slot(self)

    @property
    def loras(self) -> dict[str, str] | None:
        """The LoRA adapters it serves (:func:`~.routing.served_adapters`)."""
        return served_adapters(self)

    @property
    def peer_store(self) -> str | None:
        """Where joiners of its layout pull its weights from it (weights.peer_pull): what its heartbeats (or its
        last REFIT's acknowledgement) say, else its HELLO; None while it serves no weights a trainer sent."""
        store = self.stats.get("peer_store", self.info.get("peer_store"))
        return store if isinstance(store, str) else None

    @property
    def ranks(self) -> int:
        """Its ranks (tensor-parallel ranks times pipeline stages, from its HELLO; absent: 1)."""
        return (max(1, int(self.info.get("tensor_parallel_size") or 1))
                * max(1, int(self.info.get("pipeline_parallel_size") or 1)))

    def same_model(self, model: str | None) -> bool:
        """Whether it was started from ``model`` (unknown on either side: yes).

        An engine of another model is part of a rolling replacement: it is neither synced to the
        refitted weights nor taken as the source of truth about them (STATUS flags its epoch).
        """
        theirs = self.info.get("model")
        if not model or not isinstance(theirs, str):
            return True
        return os.path.normpath(theirs) == os.path.normpath(model)

    def note_progress(self, progress: int | None, now: float) -> None:
        """Restart the stall clock when the step loop's counter moved (see liveness.stalled)."""
        if progress != self.progress:
            self.progress = progress
            self.stall_clock = now

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.engine_id,
            "group": self.group,
            "state": ENGINE_DRAINING if self.draining else self.state,
            "running": self.running,
            "waiting": self.waiting,
            "kv_blocks_free": self.kv_blocks_free,
            "kv_blocks_total": self.kv_blocks_total,
            "last_heartbeat": self.last_heartbeat,
            "assigned": self.load,
            "completed": self.completed,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "progress": self.progress,
            "capacity": self.capacity,
            "info": self.info,
            "epoch": self.epoch,
            "weights": self.weights,
            "last_refit": self.last_refit or None,
            "metrics": self.metrics,
            "loras": self.loras,
        }


@dataclass(eq=False)
class ClientRecord:
    """A client (or control peer) by its stable ``client_id``; it keeps its requests across reconnects."""

    client_id: str
    role: Role
    identity: bytes | None
    acks: bool
    key: bytes | None = None  # the CURVE key that registered it (None in an insecure fleet): only it may return
    batches: bool = False  # it understands BATCH frames (protocol 2)
    protocol: int = 1  # what its HELLO announced (SUBMIT needs 4: it makes the text)
    last_seen: float = field(default_factory=time.monotonic)
    offline_since: float | None = None
    requests: set[str] = field(default_factory=set)
