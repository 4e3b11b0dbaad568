"""SkyRL's ``POST /finish_session?session_id=`` (its router's data-plane call when a trajectory ends).

SkyRL's ``RemoteInferenceClient.finish_session`` tells the router that a session (``session_id``, which its
requests carry for sticky routing) is over, so that a session-aware policy stops keeping its engine. Here the
coordinator keeps a session on its engine while the session sends requests and forgets it after the session TTL
(``coordinator/placement.py``'s ``Sessions``); nothing is held that a finished session would free sooner, so the
call is answered 200 and changes nothing, as SkyRL's routers that do not track sessions answer it. A request with
no ``session_id`` is refused naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..errors import bad_request
from ..openapi_doc import error_responses
from .control import Query, query_doc

SESSION_PATHS = frozenset({"/finish_session"})


def add_session_routes(app: FastAPI, api_guard: Any) -> None:
    """``/finish_session`` on ``app``, behind the API key (a data-plane call, as generation)."""

    @app.post("/finish_session", tags=["skyrl"], dependencies=api_guard.dependencies,
              responses=error_responses([400, 401] if api_guard.on else [400]), summary="SkyRL: a session ended",
              description="Accepted for any `session_id`: sessions are forgotten after their TTL.",
              openapi_extra=query_doc(("session_id", {"type": "string"}, "the session that ended")))
    async def finish_session(request: Request) -> JSONResponse:
        query = Query(request)
        session = query.text("session_id")
        query.done()
        if not session:
            raise bad_request("finish_session needs ?session_id=", param="session_id")
        return JSONResponse({"status": "ok", "session_id": session})
