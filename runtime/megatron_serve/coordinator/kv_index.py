"""The coordinator's global KV index: which engine holds which block, in which medium, from the engines' KV events.

Every engine sends its KV events (:mod:`megatron_serve.wire.kv_events`) over its link as numbered batches
(``KV_EVENTS``); a registration's first batch is a snapshot (``AllBlocksCleared``, then every block it holds), so the
index never needs a replay. The index maps each chained block hash to the engines holding it and their media;
``prefix_affinity`` routing (:mod:`.prefix_routing`) asks it how many leading blocks of a prompt's chain an engine
holds. Hashes chain from the cache salt, the adapter's registration and the weights' epoch, so a prompt's chain
never matches blocks of other weights: a refit's ``AllBlocksCleared`` (and the coordinator forgetting the engine's
blocks at its refit) only frees the memory.

An engine's entries are trusted while its events keep up: a batch whose ``seq`` skips one (a lost frame) makes the
engine *stale* until its next clear; its heartbeat says its last ``seq`` (``kv_events_seq``), and an engine whose
batches stay behind that for longer than ``max_lag_s`` is *lagging*. A stale or lagging engine is matched as
holding nothing: it is routed by load alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec

from ..wire.kv_events import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST, AllBlocksCleared, BlockStored, decode_batch

logger = logging.getLogger("megatron_serve.coordinator")

DEFAULT_MAX_LAG_S = 2.0
#: What a block found in each medium is worth against one computed (a host or disk block is copied back first).
MEDIUM_WEIGHTS = {MEDIUM_DEVICE: 1.0, MEDIUM_HOST: 0.8, MEDIUM_DISK: 0.5}


@dataclass
class EngineEvents:
    """What the index knows of one engine's events."""

    seq: int = -1  # the last batch applied
    reported: int = -1  # the last seq its heartbeat named
    behind_since: float | None = None  # when its heartbeat first named a seq not applied yet
    stale: bool = False  # a batch was lost: nothing it holds is trusted until its next clear
    blocks: dict[int, set[str]] = field(default_factory=dict)  # hash -> media
    block_size: int | None = None


class KVIndex:
    """Block hash -> engines and media, fed by KV events (see the module docstring)."""

    def __init__(self, max_lag_s: float = DEFAULT_MAX_LAG_S) -> None:
        self.max_lag_s = float(max_lag_s)
        self.engines: dict[str, EngineEvents] = {}
        self.holders: dict[int, dict[str, set[str]]] = {}  # hash -> engine id -> media
        self.batches = 0
        self.lost = 0  # batches an engine's seq skipped
        self.now = 0.0  # the coordinator's clock at its last input that touched the index

    # ------------------------------------------------------------------ events in

    def apply(self, engine_id: str, seq: int, payload: bytes | memoryview, now: float = 0.0) -> str | None:
        """One batch of ``engine_id``'s events; returns why it was not applied (None: applied)."""
        self.now = max(self.now, now)
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"KV_EVENTS batch {seq}: {exc}"
        state = self.engines.setdefault(engine_id, EngineEvents())
        if seq <= state.seq:
            return f"KV_EVENTS batch {seq} after {state.seq}: already applied"
        starts_clear = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        if state.seq >= 0 and seq != state.seq + 1 and not starts_clear:
            self.lost += seq - state.seq - 1
            state.stale = True
            logger.warning("engine %s: KV events %d to %d lost; routed by load alone until its next clear",
                           engine_id, state.seq + 1, seq - 1)
        state.seq = seq
        self.batches += 1
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._clear(engine_id, state)
                state.stale = False
            elif isinstance(event, BlockStored):
                state.block_size = event.block_size
                for block_hash in event.block_hashes:
                    self._add(engine_id, state, block_hash, event.medium or MEDIUM_DEVICE)
            else:
                for block_hash in event.block_hashes:
                    self._remove(engine_id, state, block_hash, event.medium or MEDIUM_DEVICE)
        if state.reported <= state.seq:
            state.behind_since = None
        return None

    def reported(self, engine_id: str, seq: int, now: float) -> None:
        """An engine's heartbeat named ``seq`` as its last batch."""
        self.now = max(self.now, now)
        state = self.engines.setdefault(engine_id, EngineEvents())
        state.reported = max(state.reported, seq)
        if state.reported > state.seq:
            if state.behind_since is None:
                state.behind_since = now
        else:
            state.behind_since = None

    def _add(self, engine_id: str, state: EngineEvents, block_hash: int, medium: str) -> None:
        state.blocks.setdefault(block_hash, set()).add(medium)
        self.holders.setdefault(block_hash, {}).setdefault(engine_id, set()).add(medium)

    def _remove(self, engine_id: str, state: EngineEvents, block_hash: int, medium: str) -> None:
        media = state.blocks.get(block_hash)
        if media is None:
            return
        media.discard(medium)
        holders = self.holders[block_hash]
        if not media:
            del state.blocks[block_hash]
            del holders[engine_id]
            if not holders:
                del self.holders[block_hash]

    def _clear(self, engine_id: str, state: EngineEvents) -> None:
        for block_hash in state.blocks:
            holders = self.holders[block_hash]
            del holders[engine_id]
            if not holders:
                del self.holders[block_hash]
        state.blocks.clear()

    def forget_blocks(self, engine_id: str) -> None:
        """The engine's blocks can no longer be found (a refit, a drain): drop them, keep counting its batches."""
        state = self.engines.get(engine_id)
        if state is not None:
            self._clear(engine_id, state)

    def drop(self, engine_id: str) -> None:
        """The engine left the fleet."""
        self.forget_blocks(engine_id)
        self.engines.pop(engine_id, None)

    # ------------------------------------------------------------------ questions

    def trusted(self, engine_id: str, now: float) -> bool:
        """Whether the engine's entries may be routed by (its events known and keeping up)."""
        state = self.engines.get(engine_id)
        if state is None or state.seq < 0 or state.stale:
            return False
        return state.behind_since is None or now - state.behind_since <= self.max_lag_s

    def match(self, engine_id: str, hashes: list[int]) -> tuple[int, float]:
        """How many leading blocks of the chain ``hashes`` the engine holds, and their worth by medium."""
        state = self.engines.get(engine_id)
        if state is None:
            return 0, 0.0
        count, worth = 0, 0.0
        for block_hash in hashes:
            media = state.blocks.get(block_hash)
            if not media:
                break
            count += 1
            worth += max(MEDIUM_WEIGHTS.get(medium, 0.5) for medium in media)
        return count, worth

    def size(self, engine_id: str) -> int:
        state = self.engines.get(engine_id)
        return len(state.blocks) if state is not None else 0

    def describe(self) -> dict[str, object]:
        return {"blocks": len(self.holders), "batches": self.batches, "lost_batches": self.lost,
                "engines": {e: {"seq": s.seq, "blocks": len(s.blocks), "stale": s.stale}
                            for e, s in self.engines.items()}}
