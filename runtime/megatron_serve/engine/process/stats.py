"""What the engine process's next heartbeat says (:func:`heartbeat`): the engine's load and facts, the loop's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...wire.lifecycle import ENGINE_DRAINING, FleetState

if TYPE_CHECKING:
    from ..served import ServedEngine


def heartbeat(engine: ServedEngine, info: dict[str, Any], *, state: FleetState, draining: bool, steps: int,
              iterations: int, kv_sink: Callable[[int, bytes], None]) -> dict[str, Any]:
    """The heartbeat's fields for ``engine`` in ``state`` (``draining``: as ENGINE_DRAINING), after ``steps`` steps
    and ``iterations`` turns of the loop (``progress``, by which the coordinator tells a hung loop from a live one).

    ``info``: the HELLO's facts (a ``peer_store`` there is announced again). ``kv_sink``: where the engine's KV
    events go, whose sequence number the coordinator's KV index checks. The engine's ``metrics_snapshot()``
    (cumulative counters and histogram buckets, :mod:`megatron_serve.wire.engine_stats`; None where it keeps none)
    travels as ``metrics``.
    """
    load = engine.load()
    stats: dict[str, Any] = {"steps": steps, "suspend_level": engine.serving.suspend_level, "epoch": engine.epoch,
                             "kv_events_seq": engine.kv_events.seq_of(kv_sink)}
    loras = engine.adapters.names()
    if loras is not None:  # the adapters it serves (name -> directory): the coordinator routes by them
        stats["loras"] = loras
    if "peer_store" in info:  # joiners of our layout pull our weights from there
        stats["peer_store"] = info["peer_store"]
    fields: dict[str, Any] = {
        "state": ENGINE_DRAINING if draining else state.value,
        "running": load.running, "waiting": load.waiting,
        "kv_blocks_free": load.kv_blocks_free, "kv_blocks_total": load.kv_blocks_total,
        # prefix-cache counters: prompt tokens skipped thanks to the cache, tokens run through the model
        "cached_tokens": load.cached_tokens,
        "computed_tokens": load.computed_tokens,
        "stats": stats,
        "progress": iterations,
    }
    snapshot = engine.metrics_snapshot()
    if snapshot is not None:
        fields["metrics"] = snapshot
    return fields
