"""vLLM's control routes (``vllm/entrypoints/serve/dev/{rlhf,sleep,cache}/api_router.py``) onto the lifecycle verbs.

* ``POST /pause?mode=abort|wait|keep&clear_cache=`` is PAUSE in that mode (vLLM's default ``abort``; its deprecated
  ``wait_for_inflight_requests=true`` is ``wait``): ``{"status": "paused"}``. ``POST /resume`` is UNPAUSE:
  ``{"status": "resumed"}``. ``GET /is_paused``: ``{"is_paused"}``, true while the fleet does not step.
* ``POST /sleep?level=&mode=`` is vLLM's sleep: PAUSE in ``mode`` (default ``abort``), then, for level 1 or 2,
  SUSPEND level 2 (vLLM's level 1 moves the weights to host memory and drops the KV cache, which is this fleet's
  level 2; vLLM's level 2 drops the weights too, which here stay in host memory: a weight update after it works
  either way). Level 0 only pauses, as in vLLM; ``tags`` (SkyRL sends them) are accepted. ``POST /wake_up?tags=``
  is RESUME, then UNPAUSE: vLLM's wake-up resumes scheduling whatever its tags (``weights``, ``kv_cache``,
  ``scheduling``), and memory comes back whole here, so the fleet serves again after any wake-up. Both answer an
  empty 200. ``GET /is_sleeping``: ``{"is_sleeping"}``,
  true while the fleet does not step, as vLLM's engine answers it (its sleep level 0 is a pause).
* ``POST /abort_requests {request_ids?}`` ends the named requests (the ids their answers carry, ``cmpl-...``, or
  the ``request_id`` the client gave) with ``finish_reason`` ``abort`` and their tokens so far, without pausing;
  none named: every request this server answers. ``{"status": "aborted", "aborted": n}``.
* ``POST /reset_prefix_cache?reset_running_requests=&reset_external=`` (or those flags as a JSON body, as SkyRL
  sends them) is RESET_PREFIX_CACHE (:mod:`.control`): ``{"success": true}`` once every engine forgot every cached
  block; a 409 ``prefix_cache_in_use`` (vLLM's 409) when running requests hold blocks and
  ``reset_running_requests`` was not given. ``reset_external`` (a KV connector's cache) is accepted: the host tier
  is reset either way, and there is no other.
* ``GET /get_world_size?include_dp=``: ``{"world_size"}``, tensor x pipeline ranks, times the data-parallel
  replicas unless ``include_dp=false``.

Where vLLM answers ``{"error": ...}`` this server answers its own error shape, with the same statuses (400 for a
bad value, which vLLM's FastAPI answers 422), and a lifecycle refusal is a 409 naming the fleet's state.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from ...wire.lifecycle import FleetState, PauseMode, Verb
from ..errors import APIError
from ..intake import request_body_doc
from ..openapi_doc import error_responses
from .control import FLAG, Control, Query, one_of, query_doc
from .responses import ACTING_RESPONSES
from .tokens import read_anchor

VLLM_CONTROL_PATHS = frozenset({"/pause", "/resume", "/abort_requests", "/sleep", "/wake_up",
                                "/reset_prefix_cache"})

#: vLLM's sleep levels -> this fleet's SUSPEND level (None: pause only).
SLEEP_LEVELS: dict[int, int | None] = {0: None, 1: 2, 2: 2}
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
_MODES = tuple(mode.value for mode in PauseMode)
_MODE_DOC = ("mode", one_of(*_MODES), "what happens to the requests held: `abort` (vLLM's default) ends them with "
             "their tokens so far, `wait` lets the running ones finish, `keep` keeps them in place")


class VllmAbortRequests(BaseModel):
    """vLLM's ``/abort_requests`` body: the ids to abort (none: every request in flight)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    request_ids: list[str] | None = None


class VllmResetPrefixCache(BaseModel):
    """``/reset_prefix_cache``'s flags as a body (SkyRL sends ``{"reset_running_requests": ...}`` there; vLLM reads
    them from the query)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reset_running_requests: bool = False
    reset_external: bool = False


def pause_mode(query: Query, default: str = PauseMode.ABORT.value) -> PauseMode:
    """``mode`` (vLLM's ``PauseMode``), or ``wait`` for the deprecated ``wait_for_inflight_requests=true``."""
    mode = query.choice("mode", _MODES, default)
    if query.flag("wait_for_inflight_requests", False):
        mode = PauseMode.WAIT.value
    return PauseMode(mode)


async def sleep(control: Control, route: str, level: int, mode: PauseMode) -> None:
    """vLLM's sleep at ``level`` (see the module docstring): PAUSE in ``mode``, then SUSPEND unless level 0."""
    await control.run(route, Verb.PAUSE, mode=mode.value)
    suspend = SLEEP_LEVELS[level]
    if suspend is not None:
        await control.run(route, Verb.SUSPEND, level=suspend)


async def wake_up(control: Control, route: str) -> None:
    """Memory back, then serving: RESUME and UNPAUSE (each a no-op where there is nothing to do)."""
    await control.run(route, Verb.RESUME)
    await control.run(route, Verb.UNPAUSE)


_TAGS = ["RL frameworks"]


def add_vllm_control_routes(app: FastAPI, control: Control, admin: list[Any], api_guard: Any) -> None:
    """vLLM's control routes on ``app``: the ones that act need the admin key (``admin``: its dependencies), the
    ones that only read (``/is_paused``, ``/is_sleeping``, ``/get_world_size``) the API key."""
    reading = error_responses([400, 401, 503] if api_guard.on else [400, 503])
    _add_lifecycle_routes(app, control, admin, api_guard.dependencies, reading)
    _add_request_routes(app, control, admin, api_guard.dependencies, reading)


def _add_lifecycle_routes(app: FastAPI, control: Control, admin: list[Any], api: list[Any],
                          reading: dict[int | str, dict[str, Any]]) -> None:
    """``/pause``, ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``."""
    acting, tags = ACTING_RESPONSES, _TAGS

    @app.post("/pause", tags=tags, dependencies=admin, responses=acting, summary="vLLM: pause generation",
              description="PAUSE in `mode` (`abort`, vLLM's default; `wait`; `keep`). `clear_cache` is accepted and "
                          "has nothing to do: see `/reset_prefix_cache`.",
              openapi_extra=query_doc(_MODE_DOC, ("clear_cache", FLAG, "accepted; nothing to clear"),
                                      ("wait_for_inflight_requests", FLAG, "deprecated: true is `mode=wait`")))
    async def pause(request: Request) -> JSONResponse:
        query = Query(request)
        mode = pause_mode(query)
        query.flag("clear_cache", True)
        query.done()
        await control.run("/pause", Verb.PAUSE, mode=mode.value)
        return JSONResponse({"status": "paused"})

    @app.post("/resume", tags=tags, dependencies=admin, responses=acting, summary="vLLM: resume generation",
              description="UNPAUSE. A sleeping fleet is refused (409): `/wake_up` brings its memory back and "
                          "resumes it.")
    async def resume(request: Request) -> JSONResponse:
        Query(request).done()
        if await control.state("/resume") == FleetState.SUSPENDED.value:
            raise _asleep("/resume")
        await control.run("/resume", Verb.UNPAUSE)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused", tags=tags, dependencies=api, responses=reading,
             summary="vLLM: whether generation is paused")
    async def is_paused(request: Request) -> JSONResponse:
        Query(request).done()
        return JSONResponse({"is_paused": await control.not_stepping("/is_paused")})



    @app.post("/sleep", tags=tags, dependencies=admin, responses=acting, summary="vLLM: sleep",
              description="PAUSE in `mode` (default `abort`), then SUSPEND level 2 for `level` 1 or 2 (weights to "
                          "host memory, KV cache released); `level` 0 only pauses.", response_class=Response,
              openapi_extra=query_doc(("level", one_of(*SLEEP_LEVELS), "vLLM's sleep level (default 1)"), _MODE_DOC,
                                      ("tags", {"type": "array", "items": one_of(*WAKE_TAGS)},
                                       "accepted (SkyRL sends them): memory is released whole")))
    async def sleep_route(request: Request) -> Response:
        query = Query(request)
        level = query.choice("level", tuple(SLEEP_LEVELS), 1)
        mode = pause_mode(query)
        query.choices("tags", WAKE_TAGS)  # SkyRL names them; memory is released whole here
        query.done()
        await sleep(control, "/sleep", level, mode)
        return Response(status_code=200)

    @app.post("/wake_up", tags=tags, dependencies=admin, responses=acting, summary="vLLM: wake up",
              description="RESUME (memory back, whole, whatever `tags` name), then UNPAUSE: serving again.",
              response_class=Response, openapi_extra=query_doc(
                  ("tags", {"type": "array", "items": one_of(*WAKE_TAGS)}, "vLLM's memory tags (any: all of it)")))
    async def wake_up_route(request: Request) -> Response:
        query = Query(request)
        query.choices("tags", WAKE_TAGS)
        query.done()
        await wake_up(control, "/wake_up")
        return Response(status_code=200)

    @app.get("/is_sleeping", tags=tags, dependencies=api, responses=reading,
             summary="vLLM: whether the engine sleeps")
    async def is_sleeping(request: Request) -> JSONResponse:
        Query(request).done()
        return JSONResponse({"is_sleeping": await control.not_stepping("/is_sleeping")})


def _add_request_routes(app: FastAPI, control: Control, admin: list[Any], api: list[Any],
                        reading: dict[int | str, dict[str, Any]]) -> None:
    """``/abort_requests``, ``/reset_prefix_cache``, ``/get_world_size``."""
    acting, tags = ACTING_RESPONSES, _TAGS

    @app.post("/abort_requests", tags=tags, dependencies=admin, responses=acting, summary="vLLM: abort requests",
              description="Ends the requests named by `request_ids` (the ids of their answers, or the `request_id` "
                          "their clients gave), or every request in flight, with `finish_reason` `abort` and their "
                          "tokens so far; the fleet goes on running.",
              openapi_extra=request_body_doc(VllmAbortRequests, required=False))
    async def abort_requests(request: Request) -> JSONResponse:
        raw = await request.body()
        body = read_anchor(VllmAbortRequests, raw, "vLLM's /abort_requests") if raw.strip() else VllmAbortRequests()
        return JSONResponse({"status": "aborted", "aborted": control.abort(body.request_ids)})

    @app.post("/reset_prefix_cache", tags=tags, dependencies=admin, responses=acting,
              summary="vLLM: reset the prefix cache",
              description="RESET_PREFIX_CACHE: every engine forgets every cached prefix block (device pool and host "
                          "tier). 409 when running requests hold blocks, unless `reset_running_requests` sends them "
                          "back to be recomputed.", openapi_extra={
                  **query_doc(("reset_running_requests", FLAG, "recompute the running requests so that the reset "
                                                               "happens (default false: refused while they run)"),
                              ("reset_external", FLAG, "accepted: the host tier is reset either way")),
                  **request_body_doc(VllmResetPrefixCache, required=False)})
    async def reset(request: Request) -> JSONResponse:
        query = Query(request)
        running = query.flag("reset_running_requests", False)
        query.flag("reset_external", False)
        query.done()
        raw = await request.body()
        if raw.strip():
            running = running or read_anchor(VllmResetPrefixCache, raw,
                                              "vLLM's /reset_prefix_cache").reset_running_requests
        if not await control.reset_prefix_cache("/reset_prefix_cache", running):
            raise APIError(409, "/reset_prefix_cache: running requests hold KV blocks, so the prefix cache was not "
                                "reset; reset_running_requests=true recomputes them and resets it",
                           code="prefix_cache_in_use", type="invalid_request_error", param="reset_running_requests")
        return JSONResponse({"success": True})

    @app.get("/get_world_size", tags=tags, dependencies=api, responses=reading,
             summary="vLLM: the ranks of the served model", openapi_extra=query_doc(
                 ("include_dp", FLAG, "count the data-parallel replicas (default true)")))
    async def get_world_size(request: Request) -> JSONResponse:
        query = Query(request)
        include_dp = query.flag("include_dp", True)
        query.done()
        shape = control.shape()
        return JSONResponse({"world_size": shape.world_size_across_dp if include_dp else shape.world_size})


def _asleep(route: str) -> APIError:
    return APIError(409, f"{route} refused: the fleet sleeps (its memory is released); POST /wake_up brings it "
                         "back and resumes it", code="illegal_transition", type="invalid_request_error")
