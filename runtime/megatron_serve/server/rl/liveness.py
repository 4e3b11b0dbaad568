"""prime-rl's ``GET /liveness`` (``src/prime_rl/inference/vllm/server.py``): 200 ``{"status": "ok"}``, or 503
``{"status": "engine_unresponsive"}`` while an engine's step loop is wedged.

prime-rl asks each engine's loop for a no-op and calls it wedged when no answer comes in time. Here the coordinator
already watches every loop: an engine's heartbeats carry its loop's step counter, and one that holds requests while
the counter stands still is *stalled*; past the coordinator's ``--stall-timeout`` it is removed as unresponsive and
its requests go to the others. The fleet's status shows how long each engine has stood still (``stalled_s``) and
that timeout, so this probe answers 503 once an engine stood still for half of it: while the engine is still in the
fleet with requests it does not serve, before the coordinator acts. It never asks for a key (a probe carries none)
and answers while the server drains.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..context import ServerContext
from .control import Query

#: The part of the coordinator's stall timeout after which a standing loop is reported wedged.
WEDGED_FRACTION = 0.5


def wedged(ctx: ServerContext) -> list[str]:
    """The engines whose step loop has stood still with requests for :data:`WEDGED_FRACTION` of the stall timeout."""
    status = ctx.monitor.status or {}
    timeout = status.get("stall_timeout")
    if not timeout:
        return []
    return [str(e.get("id")) for e in ctx.monitor.engines if (e.get("stalled_s") or 0) >= timeout * WEDGED_FRACTION]


def add_liveness_route(app: FastAPI, ctx: ServerContext) -> None:
    """``/liveness`` on ``app``."""

    @app.get("/liveness", tags=["RL frameworks"], summary="prime-rl: whether every engine's step loop moves",
             responses={503: {"description": "`{\"status\": \"engine_unresponsive\", \"engines\": [...]}`: a step "
                                             "loop stood still with requests"}})
    async def liveness(request: Request) -> JSONResponse:
        Query(request).done()
        if ctx.monitor.reachable:
            await ctx.monitor.fresh()
        stuck = wedged(ctx)
        if stuck:
            return JSONResponse({"status": "engine_unresponsive", "engines": stuck}, status_code=503)
        return JSONResponse({"status": "ok"})
