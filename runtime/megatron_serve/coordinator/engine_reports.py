"""What engines report of themselves between their steps: heartbeats (load, KV blocks, step-loop progress, stats and
metrics), the KV events of the blocks they store and evict, and that they are draining. Each report updates the
engine's record and what routing knows (its free blocks among the candidates, its blocks in the KV index, its
prefix cache forgotten when it drains); a heartbeat is answered with the fleet's."""

from __future__ import annotations

import logging
import time

from ..wire.protocol import Header
from ..wire.status import Heartbeat, KVEvents
from .dispatch import Dispatcher
from .droplog import DropLog
from .effects import Outbox
from .lifecycle import Lifecycle
from .peers import EngineRecord

logger = logging.getLogger("megatron_serve.coordinator")

#: The heartbeat's counts copied onto the engine's record when present.
_COUNTS = ("running", "waiting", "kv_blocks_free", "kv_blocks_total", "cached_tokens", "computed_tokens")


class EngineReports:
    """Engines' reports into their records and routing (see the module docstring)."""

    def __init__(self, *, routing: Dispatcher, lifecycle: Lifecycle, outbox: Outbox, drop: DropLog) -> None:
        self.routing, self.lifecycle, self.outbox, self.drop = routing, lifecycle, outbox, drop

    def on_heartbeat(self, engine: EngineRecord, body: Heartbeat, now: float) -> None:
        engine.last_heartbeat = time.time()
        blocks = engine.kv_blocks_free, engine.kv_blocks_total
        for name in _COUNTS:
            value = getattr(body, name)
            if value is not None:
                setattr(engine, name, value)
        if (engine.kv_blocks_free, engine.kv_blocks_total) != blocks:
            self.routing.candidates.blocks_changed(engine)
        if body.state:
            engine.state = body.state
        if body.stats is not None:
            engine.stats = body.stats
            seq = body.stats.get("kv_events_seq")
            if isinstance(seq, int) and not isinstance(seq, bool):
                self.routing.kv_index.reported(engine.engine_id, seq, now)
        if body.metrics is not None:
            engine.metrics = body.metrics  # passed through to STATUS for the servers' /metrics
        engine.note_progress(body.progress, now)
        self.outbox.send(engine.identity, Header.HEARTBEAT, self.lifecycle.heartbeat())

    def on_kv_events(self, engine: EngineRecord, body: KVEvents, now: float) -> None:
        if body.engine_id != engine.engine_id:
            self.drop(engine.engine_id, f"stale message for registration {body.engine_id!r}")
            return
        problem = self.routing.kv_index.apply(engine.engine_id, body.seq, body.batch, now)
        if problem is not None:
            self.drop(engine.engine_id, problem)

    def on_draining(self, engine: EngineRecord) -> None:
        if not engine.draining:
            engine.draining = True
            self.routing.policy.forget(engine.engine_id)  # its prefix cache leaves with it
            logger.info("engine %s is draining: no new requests routed to it (%d assigned)",
                        engine.engine_id, engine.load)
