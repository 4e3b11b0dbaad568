"""``prefix_affinity`` routing: send a prompt to the engine group that already holds its longest prefix.

Engines reuse the KV blocks of a prompt's longest cached chain of block hashes
(:mod:`megatron_serve.wire.prefix_hash`); this policy computes the same hashes of the tokenized prompt
with each engine's block size (reported at registration in ``info["block_size"]``) and remembers,
per engine group, which chain hashes it routed there. A new prompt goes to the group whose routed
history holds the longest matching chain (counted in tokens, so groups with different block sizes
compare), as long as that group is not overloaded; otherwise, and when no group holds any of its
blocks, it goes to the least-loaded group, exactly as ``least_loaded`` would choose.

Load bound
    Let ``m`` be the smallest in-flight count (``EngineView.load``: requests assigned and not
    finished) among the groups that may take work now. A group whose load exceeds
    ``m + max(max_load_gap, (max_load_ratio - 1) * m)`` is skipped, whatever it holds. With the
    defaults (``max_load_gap=4``, ``max_load_ratio=1.5``) a request is never sent to a group that
    already has more than ``max(m + 4, 1.5 * m)`` requests in flight, so a hot prefix fills its
    group only up to that bound and then spills to the least-loaded group, which from then on
    holds the prefix as well and shares the traffic.

Memory bound
    Each group's history is an LRU set of at most ``min(kv_blocks_total + kv_offload_blocks,
    max_hashes_per_group)`` hashes (the most its prefix cache can hold, the host tier's blocks
    included: an engine with ``--kv-offloading-size`` still finds a prefix that left its device pool;
    65,536 by default, a few MB), and at most
    ``max_prompt_blocks`` blocks of a prompt are hashed. A routed prompt refreshes its chain
    children first, so the parent of a chain is the last to be evicted, as in the engines' cache.

Forgetting
    The history is a guess of what an engine caches, so it is dropped whenever that cache may be
    gone: :meth:`PrefixAffinity.forget` is called by the coordinator when an engine group leaves,
    starts draining, or the weights change (a refit: no block of the old weights is found again).
    A suspend frees the device pool: an engine without a host tier comes back with an empty cache and
    is forgotten; one with a tier finds what the tier took from the pool, so it keeps its most recent
    prefixes, as many blocks as its tier holds (:meth:`PrefixAffinity.suspended`).
    Engines that report ``prefix_caching: false`` or no block size get no affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from ..wire.prefix_hash import block_hashes
from .routing import EngineView, RequestView, register_routing_policy

DEFAULT_MAX_LOAD_GAP = 4
DEFAULT_MAX_LOAD_RATIO = 1.5
DEFAULT_MAX_HASHES_PER_GROUP = 65_536
DEFAULT_MAX_PROMPT_BLOCKS = 2_048


@dataclass(frozen=True)
class LoadBound:
    """How far above the least-loaded candidate an engine group may be and still be chosen for what it caches (a
    prefix, a session): the module docstring's load bound, held by ``prefix_affinity``, ``kv_aware`` and session
    affinity alike."""

    max_gap: int = DEFAULT_MAX_LOAD_GAP
    max_ratio: float = DEFAULT_MAX_LOAD_RATIO

    def __post_init__(self) -> None:
        if self.max_gap < 0 or self.max_ratio < 1.0:
            raise ValueError("max_load_gap must be >= 0 and max_load_ratio >= 1")

    def limit(self, min_load: float) -> float:
        """The most requests in flight a group may have to be chosen, given the least-loaded candidate's count."""
        return min_load + max(self.max_gap, (self.max_ratio - 1.0) * min_load)


def engine_block_size(engine: EngineView) -> int | None:
    """The engine's KV block size when it caches prefixes (from its registration facts or heartbeat stats)."""
    for source in (getattr(engine, "info", None), getattr(engine, "stats", None)):
        if not isinstance(source, dict):
            continue
        if source.get("prefix_caching") is False:
            return None
        size = source.get("block_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def host_tier_blocks(engine: EngineView) -> int:
    """The blocks ``engine``'s host KV tier holds (``--kv-offloading-size``, from its registration); 0: none."""
    info = getattr(engine, "info", None)
    host = info.get("kv_offload_blocks") if isinstance(info, dict) else None
    return host if isinstance(host, int) and not isinstance(host, bool) and host > 0 else 0


class PrefixAffinity:
    """Longest routed prefix chain wins, within a load bound (see the module docstring)."""

    name = "prefix_affinity"
    by_load_alone = False
    reads_kv_events = False  # it keeps the chains it routed itself

    def __init__(
        self,
        *,
        max_load_gap: int = DEFAULT_MAX_LOAD_GAP,
        max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO,
        max_hashes_per_group: int = DEFAULT_MAX_HASHES_PER_GROUP,
        max_prompt_blocks: int = DEFAULT_MAX_PROMPT_BLOCKS,
    ) -> None:
        if max_hashes_per_group < 1 or max_prompt_blocks < 1:
            raise ValueError("max_hashes_per_group and max_prompt_blocks must be >= 1")
        self.bound = LoadBound(int(max_load_gap), float(max_load_ratio))
        self.max_hashes_per_group = int(max_hashes_per_group)
        self.max_prompt_blocks = int(max_prompt_blocks)
        self._history: dict[str, OrderedDict[int, None]] = {}  # engine_id -> routed chain hashes (LRU order)
        # Counters, for logs and tests: requests sent to a group for its prefix, and groups skipped for load.
        self.affinity_hits = 0
        self.load_skips = 0

    # ------------------------------------------------------------------ RoutingPolicy

    def select(self, request: RequestView, candidates: Sequence[EngineView]) -> EngineView | None:
        tokens = list(request.prefix_keys)
        limit = self.bound.limit(min(e.load for e in candidates))
        hashes_by_size: dict[int, list[int]] = {}
        matched: dict[str, int] = {}
        eligible = []
        for engine in candidates:
            size = engine_block_size(engine)
            tokens_matched = 0
            if size is not None:
                hashes = self._hashes(tokens, size, hashes_by_size, request.prefix_root)
                usable = (len(tokens) - 1) // size  # the last prompt token is always computed by the engine
                tokens_matched = self.match(engine.engine_id, hashes[:usable]) * size
            if engine.load > limit:
                if tokens_matched:
                    self.load_skips += 1
                continue
            matched[engine.engine_id] = tokens_matched
            eligible.append(engine)

        def key(engine: EngineView) -> tuple[int, float, float, int]:
            free_fraction = engine.kv_blocks_free / engine.kv_blocks_total if engine.kv_blocks_total else 0.0
            return (-matched[engine.engine_id], engine.load / max(engine.capacity, 1), -free_fraction, engine.group)

        chosen = min(eligible, key=key)  # never empty: the least-loaded candidate is always within the limit
        if matched[chosen.engine_id]:
            self.affinity_hits += 1
        size = engine_block_size(chosen)
        if size is not None:
            self._remember(chosen, self._hashes(tokens, size, hashes_by_size, request.prefix_root))
        return chosen

    def forget(self, engine_id: str) -> None:
        self._history.pop(engine_id, None)

    # ------------------------------------------------------------------ history

    def match(self, engine_id: str, hashes: list[int]) -> int:
        """How many leading blocks of the chain ``hashes`` were routed to ``engine_id`` (still remembered)."""
        history = self._history.get(engine_id)
        if not history:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in history:
                break
            count += 1
        return count

    def history_size(self, engine_id: str) -> int:
        return len(self._history.get(engine_id, ()))

    def suspended(self, engine: EngineView) -> None:
        """``engine`` released its device pool (a suspend): the blocks it cached there went to its host tier first,
        so its most recently routed prefixes, as many as the tier holds, are still found there; without a tier it
        caches nothing now."""
        host = host_tier_blocks(engine)
        history = self._history.get(engine.engine_id)
        if not host:
            self.forget(engine.engine_id)
            return
        while history and len(history) > min(host, self.max_hashes_per_group):
            history.popitem(last=False)

    def capacity_for(self, engine: EngineView) -> int:
        """The blocks ``engine``'s prefix cache can hold: its device pool's and its host tier's."""
        total = int(getattr(engine, "kv_blocks_total", 0) or 0)
        if total > 0:
            total += host_tier_blocks(engine)
        return min(total, self.max_hashes_per_group) if total > 0 else self.max_hashes_per_group

    def _hashes(self, tokens: list[int], size: int, cache: dict[int, list[int]], root: int) -> list[int]:
        """The prompt's chain of block hashes for ``size``, from ``root`` (its cache salt's: engines start there)."""
        hashes = cache.get(size)
        if hashes is None:
            hashes = block_hashes(tokens[: size * self.max_prompt_blocks], size, root)
            cache[size] = hashes
        return hashes

    def _remember(self, engine: EngineView, hashes: list[int]) -> None:
        if not hashes:
            return
        history = self._history.setdefault(engine.engine_id, OrderedDict())
        for block_hash in reversed(hashes):  # children first: the chain's root ends up most recent
            history[block_hash] = None
            history.move_to_end(block_hash)
        capacity = self.capacity_for(engine)
        while len(history) > capacity:
            history.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        """Facts for logs and tests (no hashes)."""
        return {"groups": {engine_id: len(h) for engine_id, h in self._history.items()},
                "affinity_hits": self.affinity_hits, "load_skips": self.load_skips,
                "max_load_gap": self.bound.max_gap, "max_load_ratio": self.bound.max_ratio}


register_routing_policy(PrefixAffinity.name, lambda _index: PrefixAffinity())

__all__ = ["LoadBound", "PrefixAffinity", "engine_block_size", "host_tier_blocks", "DEFAULT_MAX_LOAD_GAP",
           "DEFAULT_MAX_LOAD_RATIO"]
