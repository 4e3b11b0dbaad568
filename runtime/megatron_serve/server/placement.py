"""Where a generation request asks to run: ``X-Session-ID`` (or a body's ``session_id``) and ``X-data-parallel-rank``.

SkyRL tags every turn of a multi-turn rollout with ``X-Session-ID``; the coordinator keeps a session's turns on the
engine that holds its blocks (``coordinator.placement``). vLLM's ``X-data-parallel-rank`` pins a request to one
engine. Both are read here, once per HTTP request, checked (a 400 naming the header or field), and given to every
engine request the HTTP request makes (``EngineJob.placement``); the header wins over the body, as ``X-Request-Id``
over ``request_id``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..wire.placement import MAX_SESSION_ID_CHARS, Placement, PlacementError
from .errors import APIError, bad_request

if TYPE_CHECKING:  # annotations only: generation.py reads this module, and loads neither
    from fastapi import Request

    from .translate import EngineJob

SESSION_HEADER = "X-Session-ID"
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


def request_placement(request: "Request", body_session: str | None = None) -> Placement | None:
    """The placement ``request``'s headers (and its body's ``session_id``) ask for; None: none."""
    session = request.headers.get(SESSION_HEADER)
    where = SESSION_HEADER
    if session is None:
        session, where = body_session, "session_id"
    if session is not None and not 0 < len(session) <= MAX_SESSION_ID_CHARS:
        raise bad_request(f"{where} must be 1 to {MAX_SESSION_ID_CHARS} characters, got {len(session)}", param=where)
    rank = request.headers.get(DATA_PARALLEL_RANK_HEADER)
    if rank is not None:
        value = rank.strip()
        if not value.isdigit() or len(value) > 9:
            raise bad_request(f"{DATA_PARALLEL_RANK_HEADER} must be a non-negative integer, got {rank[:40]!r}",
                              param=DATA_PARALLEL_RANK_HEADER)
    if session is None and rank is None:
        return None
    return Placement(session_id=session, data_parallel_rank=None if rank is None else int(rank))


def place(jobs: Iterable["EngineJob"], placement: Placement | None) -> None:
    """Every engine request of the HTTP request runs where it asked."""
    for job in jobs:
        job.placement = placement


def placement_refused(exc: PlacementError) -> APIError:
    """A rank no engine holds: the caller's header is wrong (400, naming it)."""
    return bad_request(f"{DATA_PARALLEL_RANK_HEADER}: {exc}", param=DATA_PARALLEL_RANK_HEADER)
