"""Placement before routing: a session's requests go back to its engine, a data-parallel rank pins a request.

A multi-turn rollout (SkyRL's ``X-Session-ID``) sends each turn's prompt as the last turn's prompt and answer plus a
little more: the engine that ran the last turn holds all of it in its prefix cache. :class:`Sessions` remembers, per
session, the engine its last request was dispatched to, and sends the next one there while that engine may take work
(it is among the candidates: registered, serving the fleet's weights, with room) and is under the load bound that
``prefix_affinity`` and ``kv_aware`` apply (in flight at most ``m + max(4, 0.5 * m)``, ``m`` the least-loaded
candidate's count). Otherwise the routing policy chooses and the session follows the request to its new engine.
A session idle for ``ttl_s`` is forgotten (so is the least recently used one beyond ``max_sessions``), and an
engine that leaves takes its sessions with it: its registration's id is never a candidate again, so their next
requests are routed afresh (a restarted engine registers under a new id).

A data-parallel rank (vLLM's ``X-data-parallel-rank``) names the engine at that index of the fleet's (engine group,
data-parallel rank) order (:func:`~.routing.engine_slot`), resolved once, when the request arrives: a rank no engine
holds is refused then (:class:`~megatron_serve.wire.placement.PlacementError`). A pinned request goes to its engine
whatever that engine's load, once any engine has room for routed work (it waits in its engine's own queue, as in
vLLM, where each data-parallel engine has one), and
fails if that engine leaves before it finishes: vLLM never moves a pinned request either, and a caller that pins
wants that engine's cache or state, not an answer from elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Sequence

from ..wire.placement import Placement, PlacementError
from ..wire.protocol import ErrorCode
from .prefix_routing import LoadBound
from .routing import EngineView, engine_slot

if TYPE_CHECKING:
    from .requests import RequestRecord

DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 262_144  # a few tens of MB at most


def admit(record: "RequestRecord", placement: Placement | None, engines: Iterable[EngineView]) -> None:
    """Note an arriving request's session, and the engine its rank names (:class:`PlacementError`: none)."""
    if placement is not None:
        record.session_id = placement.session_id
        if placement.data_parallel_rank is not None:
            record.pinned = rank_engine(engines, placement.data_parallel_rank)


def refusal_code(exc: ValueError) -> str:
    """The ERROR code of a SUBMIT refused with ``exc``: a placement no engine can honour, or a request that can never
    run."""
    return (ErrorCode.INVALID_PLACEMENT if isinstance(exc, PlacementError) else ErrorCode.INVALID_REQUEST).value


def pinned_gone(reason: str) -> tuple[str, str, str, str]:
    """How a pinned request whose engine went ends (``CoordinatorCore.finish_here``'s arguments): failed, with the
    tokens it has, never moved."""
    message = f"its pinned engine is gone ({reason}): a request pinned to a data-parallel rank is not moved"
    return "FAILED", "abort", message, message


def rank_engine(engines: Iterable[EngineView], rank: int) -> str:
    """The id of the engine at data-parallel ``rank`` (its index in (group, data-parallel rank) order)."""
    ordered = sorted(engines, key=engine_slot)
    if rank >= len(ordered):
        held = f"ranks 0 to {len(ordered) - 1}" if ordered else "no rank: no engine is registered"
        raise PlacementError(f"data-parallel rank {rank} is out of range: {len(ordered)} engine(s) serve ({held})")
    return ordered[rank].engine_id


def under_load_bound(engine: EngineView, candidates: Sequence[EngineView]) -> bool:
    """Whether ``engine`` is within the load bound of ``prefix_affinity`` and ``kv_aware`` among ``candidates``."""
    return engine.load <= LoadBound().limit(min(e.load for e in candidates))


class Sessions:
    """Session id -> the engine of its last dispatch and when, least recently used first (module docstring)."""

    def __init__(self, ttl_s: float = DEFAULT_SESSION_TTL_S, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if ttl_s < 0 or max_sessions < 1:
            raise ValueError("the session TTL must be >= 0 seconds and max_sessions >= 1")
        self.ttl_s = float(ttl_s)
        self.max_sessions = int(max_sessions)
        self._bound: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.kept = 0  # requests sent back to their session's engine
        self.moved = 0  # requests of a known session sent elsewhere (its engine overloaded, full or gone)

    def __len__(self) -> int:
        return len(self._bound)

    def engine_of(self, session_id: str, now: float) -> str | None:
        """The engine the session last ran on, unless it expired."""
        bound = self._bound.get(session_id)
        if bound is None:
            return None
        if now - bound[1] > self.ttl_s:
            del self._bound[session_id]
            return None
        return bound[0]

    def choose(self, session_id: str, candidates: Sequence[EngineView], now: float) -> EngineView | None:
        """The session's engine when it is a candidate under the load bound, else None (the policy chooses)."""
        engine_id = self.engine_of(session_id, now)
        if engine_id is None:
            return None
        for engine in candidates:
            if engine.engine_id == engine_id and under_load_bound(engine, candidates):
                self.kept += 1
                return engine
        self.moved += 1
        return None

    def bind(self, session_id: str, engine_id: str, now: float) -> None:
        """The session's request was dispatched to ``engine_id``: its next ones go there."""
        self._bound.pop(session_id, None)
        self._bound[session_id] = (engine_id, now)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)

    def expire(self, now: float) -> None:
        """Forget the sessions idle for longer than the TTL (the oldest come first)."""
        while self._bound:
            session_id, (_, used) = next(iter(self._bound.items()))
            if now - used <= self.ttl_s:
                return
            del self._bound[session_id]

    def describe(self) -> dict[str, float | int]:
        return {"sessions": len(self._bound), "kept": self.kept, "moved": self.moved, "ttl_s": self.ttl_s}


__all__ = ["Sessions", "admit", "pinned_gone", "rank_engine", "refusal_code", "under_load_bound",
           "DEFAULT_SESSION_TTL_S"]
