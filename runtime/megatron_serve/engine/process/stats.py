"""What the engine process's next heartbeat says (:func:`publish_stats`): the engine's load and facts, the loop's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...wire.lifecycle import ENGINE_DRAINING

if TYPE_CHECKING:
    from .loop import EngineProcess


def publish_stats(proc: EngineProcess, force: bool = False) -> None:
    """Refresh what the next heartbeat reports (at most every 0.2 s: heartbeats go once a second).

    The engine's ``metrics_snapshot()`` (cumulative counters and histogram buckets,
    :mod:`megatron_serve.wire.engine_stats`; None where it keeps none) travels as the heartbeat's ``metrics``.
    """
    proc.engine.kv_events.flush()  # what a verb or a step changed in the KV tiers, before the heartbeat says so
    now = time.monotonic()
    if not force and now - proc.stats_at < 0.2:
        return
    proc.stats_at = now
    e, link = proc.engine, proc.link
    load = e.load()
    stats: dict[str, Any] = {"steps": proc.steps, "suspend_level": e.serving.suspend_level, "epoch": e.epoch,
                             "kv_events_seq": e.kv_events.seq_of(proc.send_kv_events)}
    loras = e.adapters.names()
    if loras is not None:  # the adapters it serves (name -> directory): the coordinator routes by them
        stats["loras"] = loras
    if "peer_store" in link.hello["info"]:  # joiners of our layout pull our weights from there
        stats["peer_store"] = link.hello["info"]["peer_store"]
    link.stats = {
        "state": ENGINE_DRAINING if proc.drain_deadline is not None else proc.state.value,
        "running": load.running, "waiting": load.waiting,
        "kv_blocks_free": load.kv_blocks_free, "kv_blocks_total": load.kv_blocks_total,
        # prefix-cache counters: prompt tokens skipped thanks to the cache, tokens run through the model
        "cached_tokens": load.cached_tokens,
        "computed_tokens": load.computed_tokens,
        "stats": stats,
        "progress": proc.iterations,
    }
    snapshot = e.metrics_snapshot()
    if snapshot is not None:
        link.stats["metrics"] = snapshot
