"""``kv_aware`` routing: send a prompt where the KV blocks it needs are, by the engines' own KV events, against load.

``prefix_affinity`` (:mod:`.prefix_routing`) remembers which prefixes it *sent* where; after an eviction storm, a
suspend or a spill to the host tier it sends requests to engines that no longer hold their prefixes. This policy
asks the coordinator's index (:mod:`.kv_index`), built from what each engine *says* it holds, medium by medium.

Each candidate's cost is Dynamo's KV router's, in blocks: ``overlap_weight`` times the blocks of the prompt it would
have to compute (a block held on the device counts as found, one in the host tier as 0.8 of one, on disk 0.5),
plus the KV blocks it has in use. With ``temperature`` 0 the cheapest wins (ties: fewer requests in flight, then the
group); above 0 an engine is drawn with probability ``softmax(-cost / (temperature * max cost))``, which spreads a
hot prefix. An engine whose events lag or were lost (:meth:`~.kv_index.KVIndex.trusted`) is matched as holding
nothing: load alone decides for it. ``prefix_affinity``'s load bound applies: a group far above the least loaded
one is skipped whatever it holds.

Blocks on their way: an engine tells a block stored only after the step that computed it, so a burst of one prefix
would otherwise be spread over every engine before the first of them says it holds it (each computing it once).
As Dynamo's router counts the blocks of the requests it sent, the chain of each routed prompt counts as held on its
engine's device for ``pending_s`` seconds of the index's clock, until its own events take over.
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

from ..wire.prefix_hash import block_hashes, epoch_root
from .kv_index import MEDIUM_WEIGHTS, KVIndex
from .prefix_routing import DEFAULT_MAX_LOAD_GAP, DEFAULT_MAX_LOAD_RATIO, LoadBound, engine_block_size
from .routing import EngineView, RequestView, register_routing_policy

DEFAULT_OVERLAP_WEIGHT = 1.0
DEFAULT_TEMPERATURE = 0.0
DEFAULT_PENDING_S = 2.0
MAX_PENDING_BLOCKS = 65_536  # per engine: a few MB at most
MAX_PROMPT_BLOCKS = 2_048


class KVAware:
    """Cheapest engine by KV blocks to compute plus blocks in use, from the KV index (see the module docstring)."""

    name = "kv_aware"
    by_load_alone = False
    reads_kv_events = True

    def __init__(self, index: KVIndex, *, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
                 temperature: float = DEFAULT_TEMPERATURE, max_load_gap: int = DEFAULT_MAX_LOAD_GAP,
                 max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO, seed: int | None = None,
                 pending_s: float = DEFAULT_PENDING_S) -> None:
        if overlap_weight < 0 or temperature < 0 or pending_s < 0:
            raise ValueError("overlap_weight, temperature and pending_s must be >= 0")
        self.index = index
        self.overlap_weight = float(overlap_weight)
        self.temperature = float(temperature)
        self.bound = LoadBound(int(max_load_gap), float(max_load_ratio))
        self._random = random.Random(seed)
        self.pending_s = float(pending_s)
        self._pending: dict[str, dict[int, float]] = {}  # engine -> block hash routed there -> until when it counts
        self.hit_blocks = 0  # blocks the chosen engines held, for logs and the benchmark
        self.untrusted = 0  # candidates routed by load alone because their events lag

    def select(self, request: RequestView, candidates: Sequence[EngineView]) -> EngineView | None:
        tokens = list(request.prefix_keys)
        limit = self.bound.limit(min(e.load for e in candidates))
        now = self.index.now  # the coordinator's clock, as the index's lag was measured
        chains: dict[tuple[int, int], list[int]] = {}
        scored: list[tuple[float, int, int, EngineView]] = []
        for engine in candidates:
            if engine.load > limit:
                continue
            size = engine_block_size(engine) or 16
            prompt_blocks = -(-len(tokens) // size)
            found, worth = 0, 0.0
            if engine_block_size(engine) is not None:
                if self.index.trusted(engine.engine_id, now):
                    key = (size, engine.epoch)
                    if key not in chains:
                        usable = min((len(tokens) - 1) // size, MAX_PROMPT_BLOCKS)  # the last token is computed
                        chains[key] = block_hashes(tokens[: usable * size], size,
                                                   epoch_root(request.prefix_root, engine.epoch))
                    found, worth = self.match(engine.engine_id, chains[key], now)
                else:
                    self.untrusted += 1
            in_use = max(engine.kv_blocks_total - engine.kv_blocks_free, 0)
            cost = self.overlap_weight * (prompt_blocks - worth) + in_use
            scored.append((cost, engine.load, found, engine))
        chosen = self._choose(scored)
        self.hit_blocks += next(found for _, _, found, engine in scored if engine is chosen)
        chain = chains.get((engine_block_size(chosen) or 16, chosen.epoch))
        if chain:
            self._sent(chosen.engine_id, chain, now)
        return chosen

    def match(self, engine_id: str, hashes: list[int], now: float) -> tuple[int, float]:
        """Leading blocks of ``hashes`` the engine holds by its events, or was sent less than ``pending_s`` ago, and
        their worth by medium (a block on its way counts as on the device)."""
        state = self.index.engines.get(engine_id)
        held = state.blocks if state is not None else {}
        pending = self._pending.get(engine_id, {})
        count, worth = 0, 0.0
        for block_hash in hashes:
            media = held.get(block_hash)
            if media:
                worth += max(MEDIUM_WEIGHTS.get(medium, 0.5) for medium in media)
            elif pending.get(block_hash, -1.0) >= now:
                worth += 1.0
            else:
                break
            count += 1
        return count, worth

    def _sent(self, engine_id: str, chain: list[int], now: float) -> None:
        """The chain of a prompt routed to ``engine_id``: held there until its events say what it keeps."""
        pending = self._pending.setdefault(engine_id, {})
        if len(pending) + len(chain) > MAX_PENDING_BLOCKS:
            for block_hash in [h for h, until in pending.items() if until < now]:
                del pending[block_hash]
            while len(pending) + len(chain) > MAX_PENDING_BLOCKS and pending:
                del pending[next(iter(pending))]
        until = now + self.pending_s
        for block_hash in chain:
            pending.pop(block_hash, None)  # re-inserted: the oldest stay first
            pending[block_hash] = until

    def _choose(self, scored: list[tuple[float, int, int, EngineView]]) -> EngineView:
        """The cheapest (ties: load, then group), or with a temperature a draw favouring the cheap."""
        if self.temperature == 0 or len(scored) == 1:
            return min(scored, key=lambda s: (s[0], s[1], s[3].group))[3]
        top = max(s[0] for s in scored) or 1.0
        weights = [math.exp(-s[0] / (self.temperature * top)) for s in scored]
        return self._random.choices([s[3] for s in scored], weights)[0]

    def forget(self, engine_id: str) -> None:
        """The engine left, drains or changed weights: what it held is found no more."""
        self.index.forget_blocks(engine_id)
        self._pending.pop(engine_id, None)

    def suspended(self, engine: EngineView) -> None:
        """Nothing to guess: the engine's own events say what its suspend let go."""

    def describe(self) -> dict[str, Any]:
        return {"index": self.index.describe(), "hit_blocks": self.hit_blocks, "untrusted": self.untrusted,
                "overlap_weight": self.overlap_weight, "temperature": self.temperature}


register_routing_policy(KVAware.name, KVAware)

__all__ = ["KVAware", "DEFAULT_OVERLAP_WEIGHT", "DEFAULT_PENDING_S", "DEFAULT_TEMPERATURE"]
