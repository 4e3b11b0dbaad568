"""AReaL's pause and continue routes on its vLLM server (``areal/engine/vllm_ext/areal_vllm_server.py``).

``POST /areal_pause_generation`` is PAUSE in ``abort`` mode (AReaL's server aborts every running and waiting request
and clears the cache); ``POST /areal_continue_generation`` is UNPAUSE. Both answer AReaL's ``{"success": true,
"message": ...}``. Its weight routes: :mod:`.weight_areal`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ...wire.lifecycle import PauseMode, Verb
from .control import Control
from .responses import ACTING_RESPONSES

AREAL_CONTROL_PATHS = frozenset({"/areal_pause_generation", "/areal_continue_generation"})


def add_areal_control_routes(app: FastAPI, control: Control, admin: list[Any]) -> None:
    """AReaL's pause and continue on ``app`` (``admin``: the admin key's dependencies)."""

    @app.post("/areal_pause_generation", tags=["areal"], dependencies=admin, responses=ACTING_RESPONSES,
              summary="AReaL: pause generation", description="PAUSE in `abort` mode.")
    async def areal_pause_generation() -> JSONResponse:
        await control.run("/areal_pause_generation", Verb.PAUSE, mode=PauseMode.ABORT.value)
        return JSONResponse({"success": True, "message": "Generation paused and all requests aborted"})

    @app.post("/areal_continue_generation", tags=["areal"], dependencies=admin, responses=ACTING_RESPONSES,
              summary="AReaL: continue generation", description="UNPAUSE.")
    async def areal_continue_generation() -> JSONResponse:
        await control.run("/areal_continue_generation", Verb.UNPAUSE)
        return JSONResponse({"success": True, "message": "Generation continued"})
