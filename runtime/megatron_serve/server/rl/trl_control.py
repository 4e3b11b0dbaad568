"""TRL's ``trl vllm-serve`` control routes (TRL <= 1.10, ``trl/scripts/vllm_serve.py``), trailing slashes and all.

* ``GET /health/``: ``{"status": "ok"}`` while this server is up (TRL's client polls it before anything else; a
  probe, like ``/health``).
* ``GET /get_world_size/``: ``{"world_size"}``, tensor-parallel ranks times data-parallel replicas, as TRL counts
  its server's workers (pipeline stages are ranks too here: each joins a weight transfer).
* ``POST /reset_prefix_cache/``: RESET_PREFIX_CACHE (:mod:`.control`), answered as TRL does,
  ``{"message": "Request received, resetting prefix cache status: True"}`` (``False`` while running requests hold
  blocks: TRL's server resets without preempting them, so it answers False then too).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..openapi_doc import error_responses
from .control import Control, Query
from .responses import ACTING_RESPONSES

TRL_CONTROL_PATHS = frozenset({"/reset_prefix_cache/"})


def add_trl_control_routes(app: FastAPI, control: Control, admin: list[Any], api_guard: Any) -> None:
    """TRL's control routes on ``app``: ``/health/`` is a probe (no key), ``/get_world_size/`` reads (the API key),
    ``/reset_prefix_cache/`` acts (the admin key, ``admin``: its dependencies)."""
    tags = ["RL frameworks"]

    @app.get("/health/", tags=tags, summary="TRL: liveness")
    async def health(request: Request) -> JSONResponse:
        Query(request).done()
        return JSONResponse({"status": "ok"})

    @app.get("/get_world_size/", tags=tags, dependencies=api_guard.dependencies,
             responses=error_responses([400, 401] if api_guard.on else [400]), summary="TRL: the server's ranks")
    async def get_world_size(request: Request) -> JSONResponse:
        Query(request).done()
        return JSONResponse({"world_size": control.shape().world_size_across_dp})

    @app.post("/reset_prefix_cache/", tags=tags, dependencies=admin,
              responses=ACTING_RESPONSES, summary="TRL: reset the prefix cache")
    async def reset(request: Request) -> JSONResponse:
        Query(request).done()
        success = await control.reset_prefix_cache("/reset_prefix_cache/")
        return JSONResponse({"message": f"Request received, resetting prefix cache status: {success}"})
