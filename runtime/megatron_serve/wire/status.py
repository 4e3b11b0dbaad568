"""What a fleet says about itself: STATUS and its reply, the HEARTBEAT both ways, an engine's DRAINING and its
KV_EVENTS (docs/wire-protocol.md).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .body import Body, ClientId


class Status(Body):
    status_id: ClientId | None = None


class StatusReply(Body):
    state: str
    engines: list[dict[str, Any]]
    queued: int
    in_flight: int
    completed: int
    failed: int
    aborted: int | None = None  # not counted in failed; absent from older coordinators
    status_id: ClientId | None = None
    epoch: int | None = None  # generation of the weights the fleet serves (bumped by REFIT)
    coordinator_id: str | None = None
    routing: str | None = None
    suspend_level: int | None = None
    clients: int | None = None
    pending_controls: list[str] | None = None
    dropped_frames: int | None = None
    weights: str | None = None
    refits: int | None = None
    epoch_mismatch: list[str] | None = None
    incomplete_weights: list[str] | None = None  # engines left with a mix by a failed refit (UNPAUSE refused)
    stall_timeout: float | None = None  # an engine whose ``stalled_s`` passes it is removed as unresponsive
    sessions: dict[str, Any] | None = None  # session affinity: sessions known, requests kept and moved, the TTL
    # expert-parallel groups of data-parallel attention ranks: each one's size wanted (SCALE_EP), full size, ranks
    expert_groups: list[dict[str, Any]] | None = None


class Heartbeat(Body):
    """Both ways: a peer's liveness (engines add their load), the coordinator's answer (its state)."""

    engine_id: str | None = None
    state: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_blocks_free: int | None = None
    kv_blocks_total: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    stats: dict[str, Any] | None = None
    # iterations of the engine's step loop; absent from older engines (unknown, never "stalled")
    progress: int | None = None
    # cumulative engine counters and histogram buckets (engine_stats.EngineStats.to_wire); optional
    metrics: dict[str, Any] | None = None
    coordinator_id: str | None = None


class Draining(Body):
    engine_id: str | None = None


class KVEvents(Body):
    """``KV_EVENTS``: batch ``seq`` of an engine's KV events (:mod:`megatron_serve.wire.kv_events`), its bytes as the
    engine's ZeroMQ publisher sends them; a registration's first batch starts with ``AllBlocksCleared`` and holds
    every block the engine holds then (the coordinator's index starts whole)."""

    engine_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    batch: msgspec.Raw
