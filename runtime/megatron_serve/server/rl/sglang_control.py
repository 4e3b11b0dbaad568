"""SGLang's native control API (``python/sglang/srt/entrypoints/http_server.py``) as slime, miles and AReaL call it,
onto the lifecycle verbs.

* ``GET /health_generate``: one token generated through the fleet (SGLang's ``input_ids [0]``, greedy), 200 with
  an empty body once it came back, 503 when it did not within SGLang's 20 s or the fleet does not step now (a paused
  fleet would hold it that long, then fail it: the answer comes at once instead); at a bounded cost, whatever the
  probes (:mod:`.health_generation`).
* ``POST /pause_generation {mode}``: PAUSE. SGLang's ``abort`` (its default) is ``abort``; ``in_place`` (requests
  stay, with their KV) and ``retract`` (they go back to the queue, their KV may go) are both ``keep``: here the
  requests stay in place and continue where they were. ``POST /continue_generation``: UNPAUSE. Both answer
  ``{"message": ..., "status": "ok"}``.
* ``POST /abort_request {rid, abort_all}``: the request ``rid`` names (or all, ``abort_all``) ends with
  ``finish_reason`` ``abort`` and its tokens so far; an empty 200, as SGLang's (also when neither is given: nothing
  to abort).
* ``GET|POST /flush_cache``: RESET_PREFIX_CACHE (:mod:`.control`), SGLang's text answer with 200; SGLang's
  ``Flush cache failed.`` with a 400 while running requests hold blocks (SGLang flushes only an idle scheduler).
* ``GET|POST /release_memory_occupation {tags}``: SUSPEND (pausing a running fleet first, in ``keep`` mode): level
  2 when ``tags`` is absent or names ``weights``, else level 1 (the KV cache; ``cuda_graph`` goes with it).
  ``GET|POST /resume_memory_occupation {tags}``: RESUME (memory comes back whole here, whatever the tags), then
  UNPAUSE when ``tags`` is absent or names ``kv_cache``: slime resumes the weights first, pushes new ones into the
  paused fleet, and resumes the KV cache last, after which SGLang serves again. Both answer JSON ``null``, as
  SGLang's routes that return nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from ...wire.lifecycle import PauseMode, Verb
from ..intake import request_body_doc
from .control import Control, Query
from .health_generation import HealthGeneration
from .responses import ACTING_RESPONSES
from .tokens import read_anchor

#: SGLang's text, with its 400, when the cache was not flushed (its scheduler refuses while requests run; so does
#: every engine here while running requests hold blocks).
_FLUSH_REFUSED = "Flush cache failed.\n"

SGLANG_CONTROL_PATHS = frozenset({"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
                                  "/release_memory_occupation", "/resume_memory_occupation"})

#: SGLang's pause modes -> this fleet's.
PAUSE_MODES: dict[str, PauseMode] = {"abort": PauseMode.ABORT, "in_place": PauseMode.KEEP, "retract": PauseMode.KEEP}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SglangAbortRequest(_Body):
    """SGLang's ``AbortReq``."""

    rid: str = ""
    abort_all: bool = False


class SglangPauseGeneration(_Body):
    """SGLang's ``PauseGenerationReqInput``."""

    mode: Literal["abort", "in_place", "retract"] = "abort"


class SglangMemoryOccupation(_Body):
    """SGLang's ``ReleaseMemoryOccupationReqInput`` and ``ResumeMemoryOccupationReqInput``."""

    tags: list[Literal["kv_cache", "weights", "cuda_graph"]] | None = None


class SglangContinueGeneration(_Body):
    """SGLang's ``ContinueGenerationReqInput``: nothing."""


#: The bodies these routes read themselves, for the OpenAPI document.
SGLANG_CONTROL_BODIES = (SglangPauseGeneration, SglangContinueGeneration, SglangAbortRequest, SglangMemoryOccupation)


def _read(model: type[_Body], raw: bytes, anchor: str) -> Any:
    """A body that may be empty (SGLang's inputs have defaults for every field)."""
    return read_anchor(model, raw, anchor) if raw.strip() else model()


def add_sglang_control_routes(app: FastAPI, control: Control, admin: list[Any]) -> None:
    """SGLang's control routes on ``app``: ``/health_generate`` is a probe (no key), the others need the admin key
    (``admin``: its dependencies)."""
    acting = ACTING_RESPONSES
    tags = ["RL frameworks"]
    health = HealthGeneration(control.ctx.backend, control.ctx.monitor)

    @app.get("/health_generate", tags=tags, summary="SGLang: health by one generated token", response_class=Response,
             responses={200: {"description": "a token came back (an empty body)"},
                        503: {"description": "no token within 20 s, or the fleet does not step now (an empty body)"}})
    async def health_generate_route(request: Request) -> Response:
        Query(request).done()
        return Response(status_code=await health.answer())

    @app.post("/pause_generation", tags=tags, dependencies=admin, responses=acting,
              summary="SGLang: pause generation", openapi_extra=request_body_doc(SglangPauseGeneration, required=False),
              description="PAUSE: `abort` (the default) in abort mode, `in_place` and `retract` in keep mode.")
    async def pause_generation(request: Request) -> JSONResponse:
        body = _read(SglangPauseGeneration, await request.body(), "SGLang's PauseGenerationReqInput")
        await control.run("/pause_generation", Verb.PAUSE, mode=PAUSE_MODES[body.mode].value)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation", tags=tags, dependencies=admin, responses=acting,
              summary="SGLang: continue generation", description="UNPAUSE.",
              openapi_extra=request_body_doc(SglangContinueGeneration, required=False))
    async def continue_generation(request: Request) -> JSONResponse:
        _read(SglangContinueGeneration, await request.body(), "SGLang's ContinueGenerationReqInput")
        await control.run("/continue_generation", Verb.UNPAUSE)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request", tags=tags, dependencies=admin, responses=acting, summary="SGLang: abort a request",
              response_class=Response, openapi_extra=request_body_doc(SglangAbortRequest, required=False),
              description="Ends the request `rid` names (the `rid` it was generated under, or the id of its "
                          "answer), or every request in flight with `abort_all`, with `finish_reason` `abort` and its "
                          "tokens so far.")
    async def abort_request(request: Request) -> Response:
        body = _read(SglangAbortRequest, await request.body(), "SGLang's AbortReq")
        if body.abort_all or body.rid:  # neither: nothing to abort, as SGLang answers it
            control.abort(None if body.abort_all else [body.rid])
        return Response(status_code=200)

    async def flush_cache() -> PlainTextResponse:
        if not await control.reset_prefix_cache("/flush_cache"):
            return PlainTextResponse(_FLUSH_REFUSED, status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def release_memory_occupation(request: Request) -> JSONResponse:
        body = _read(SglangMemoryOccupation, await request.body(), "SGLang's ReleaseMemoryOccupationReqInput")
        level = 2 if body.tags is None or "weights" in body.tags else 1
        await control.run("/release_memory_occupation", Verb.SUSPEND, level=level)
        return JSONResponse(None)

    async def resume_memory_occupation(request: Request) -> JSONResponse:
        body = _read(SglangMemoryOccupation, await request.body(), "SGLang's ResumeMemoryOccupationReqInput")
        await control.run("/resume_memory_occupation", Verb.RESUME)
        if body.tags is None or "kv_cache" in body.tags:
            await control.run("/resume_memory_occupation", Verb.UNPAUSE)
        return JSONResponse(None)

    memory = request_body_doc(SglangMemoryOccupation, required=False)
    text = {**acting, 200: {"description": "SGLang's text", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    for path, route, summary, extra, responses in (
            ("/flush_cache", flush_cache, "SGLang: flush the cache", None, text),
            ("/release_memory_occupation", release_memory_occupation, "SGLang: release device memory (SUSPEND)",
             memory, acting),
            ("/resume_memory_occupation", resume_memory_occupation, "SGLang: resume device memory (RESUME)", memory,
             acting)):
        for method in ("GET", "POST"):  # SGLang answers both; one operation each in the OpenAPI document
            app.api_route(path, methods=[method], tags=tags, dependencies=admin, responses=responses, summary=summary,
                          operation_id=f"{route.__name__}_{method.lower()}", openapi_extra=extra)(route)
