"""Routing policies: which engine group gets the next queued request.

The coordinator calls ``policy.select(request, candidates)`` with the engines that may take work
now (registered, not draining, below their in-flight limit) and dispatches to the one returned.
A policy only chooses; it never mutates the engines or the request. Policies are looked up by
name in :data:`ROUTING_POLICIES`; a new policy (e.g. ``prefix_affinity``, which prefers the group
holding the longest chain of the prompt's block hashes) registers itself with
:func:`register_routing_policy` and can read whatever the engines report in their heartbeat
``stats`` (``EngineView.stats``) and the prompt tokens of the request.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol, Sequence

from ..wire.sampling_params import SamplingParams
from .kv_index import KVIndex


def adapter_candidates(request: RequestView, candidates: Sequence["EngineView"]) -> Sequence["EngineView"]:
    """The candidates already serving the request's LoRA adapter when any does, else all of them.

    Every policy chooses among these, so a request of an adapter goes where its weights are resident (a slot
    write instead of a read from disk, and that adapter's prefix cache). When no candidate serves it, any may
    take it: a ``LoRARequest`` with a path is loaded there on its first request; a request naming an adapter
    that only busy engines serve fails there with "not loaded" (a fleet whose engines serve the same adapters,
    as ``--lora-modules`` and LOAD_LORA make it, never meets this).
    """
    name = request.params.lora_name
    if name is None:
        return candidates
    holders = [engine for engine in candidates if name in (served_adapters(engine) or {})]
    return holders or candidates


def served_adapters(engine: "EngineView") -> dict[str, str] | None:
    """The LoRA adapters an engine serves (name -> directory), from its last heartbeat or LoRA acknowledgement,
    else its HELLO; None: an engine without ``enable_lora``."""
    loras = engine.stats.get("loras", engine.info.get("loras"))
    return loras if isinstance(loras, dict) else None


class EngineView(Protocol):
    """What a policy may read about an engine (implemented by the coordinator's engine record)."""

    engine_id: str
    group: int
    capacity: int  # requests the engine runs at once (its ``max_requests``)
    kv_blocks_free: int
    kv_blocks_total: int
    stats: dict[str, Any]  # extra facts from the engine's last heartbeat
    info: dict[str, Any]  # facts from its registration (pid, host, block_size, prefix_caching ...)
    epoch: int  # the weights' generation it serves (its KV blocks' hashes chain from it)

    @property
    def load(self) -> int:  # requests assigned and not finished
        ...


def engine_slot(engine: EngineView) -> tuple[int, int]:
    """What one live engine holds: its group and, under data-parallel attention (whose ranks are engines of their
    own sharing a group), its rank in it (0 for any other engine)."""
    return engine.group, engine.info.get("data_parallel_rank", 0)


class RequestView(Protocol):
    request_id: str
    params: SamplingParams  # its sampling parameters (``lora_name``: the adapter it runs under)
    #: the prompt's token ids as the prefix cache keys them (an image's placeholder tokens stand for
    #: its content: ``multimodal.cache_keys``)
    prefix_keys: list[int]
    #: where its chain of block hashes starts (``prefix_hash.salted_root`` of its cache_salt)
    prefix_root: int


class RoutingPolicy(Protocol):
    name: str
    #: Whether it always chooses the candidate of the least :func:`load_key`: dispatch then answers from the
    #: candidates' own load order (:mod:`.candidates`) without listing them.
    by_load_alone: bool
    #: Whether it reads the KV index: only then are engines asked for their KV events (``HelloAck.kv_events``), a
    #: frame per step that a policy reading none would have the coordinator receive, decode and file for nothing.
    reads_kv_events: bool

    def select(self, request: RequestView, candidates: Sequence[EngineView]) -> EngineView | None:
        """Return the engine to run ``request`` (``candidates`` is never empty), or ``None`` to hold it."""
        ...

    def forget(self, engine_id: str) -> None:
        """Drop per-engine state of an engine that left (or whose caches the weights' change emptied)."""
        ...

    def suspended(self, engine: EngineView) -> None:
        """``engine`` released its device memory (a suspend): drop what only its device pool held."""
        ...


def load_key(engine: EngineView) -> tuple[float, float, int]:
    """How loaded an engine is, least first: in-flight requests relative to capacity, then fewer free KV blocks
    (as a fraction), then the larger group id."""
    free_fraction = engine.kv_blocks_free / engine.kv_blocks_total if engine.kv_blocks_total else 0.0
    return engine.load / max(engine.capacity, 1), -free_fraction, engine.group


class LeastLoaded:
    """Fewest in-flight requests relative to capacity; ties go to more free KV blocks, then group id."""

    name = "least_loaded"
    by_load_alone = True
    reads_kv_events = False

    def select(self, request: RequestView, candidates: Sequence[EngineView]) -> EngineView | None:
        return min(candidates, key=load_key)

    def forget(self, engine_id: str) -> None:
        pass

    def suspended(self, engine: EngineView) -> None:
        pass


class RoundRobin:
    """Cycle through engines in (group, data-parallel rank) order, skipping those that cannot take work now."""

    name = "round_robin"
    by_load_alone = False
    reads_kv_events = False

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def select(self, request: RequestView, candidates: Sequence[EngineView]) -> EngineView | None:
        ordered = sorted(candidates, key=engine_slot)
        chosen = ordered[0]
        if self._last is not None:
            for engine in ordered:
                if engine_slot(engine) > self._last:
                    chosen = engine
                    break
        self._last = engine_slot(chosen)
        return chosen

    def forget(self, engine_id: str) -> None:
        pass

    def suspended(self, engine: EngineView) -> None:
        pass


#: name -> the policy, made with the coordinator's KV index (:mod:`.kv_index`), which only ``kv_aware`` reads.
ROUTING_POLICIES: dict[str, Callable[[KVIndex], RoutingPolicy]] = {
    "least_loaded": lambda _index: LeastLoaded(),
    "round_robin": lambda _index: RoundRobin(),
}

#: Policies named by the design that live in their own module and register on import.
_PLUGIN_MODULES = {"prefix_affinity": "megatron_serve.coordinator.prefix_routing",
                   "kv_aware": "megatron_serve.coordinator.kv_aware"}

#: Every name the CLI offers (``--routing``), available or not yet.
KNOWN_POLICIES = ("least_loaded", "round_robin", "prefix_affinity", "kv_aware")


def register_routing_policy(name: str, factory: Callable[[KVIndex], RoutingPolicy]) -> None:
    ROUTING_POLICIES[name] = factory


def make_routing_policy(name: str, kv_index: KVIndex | None = None) -> RoutingPolicy:
    """Instantiate a policy by name, over the coordinator's ``kv_index`` (a new empty one when None); a clear
    ``ValueError`` when it does not exist (yet)."""
    if name not in ROUTING_POLICIES and name in _PLUGIN_MODULES:
        try:
            importlib.import_module(_PLUGIN_MODULES[name])
        except ImportError:
            pass
    if name not in ROUTING_POLICIES:
        available = ", ".join(sorted(ROUTING_POLICIES))
        raise ValueError(f"routing policy {name!r} is not available in this build (available: {available})")
    return ROUTING_POLICIES[name](kv_index if kv_index is not None else KVIndex())
