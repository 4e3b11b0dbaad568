"""SGLang's ``GET /v1/loads`` (``sglang/srt/entrypoints/v1_loads.py``, SGLang 0.5.23): the fleet's load per engine.

slime polls ``/v1/loads?include=core`` after aborting (``slime/backends/sglang_utils/server_control.py``:
``abort_server_until_idle``) and waits until ``num_running_reqs + num_waiting_reqs`` is 0. The answer is SGLang's
``{timestamp, version, accelerator, num_accelerators, loads}``, ``loads`` one entry per engine (its data-parallel
rank, in the fleet's order) with SGLang's core keys as this fleet knows them: requests running and waiting on it
(the coordinator's queue, not yet on any engine, counted as waiting on rank 0, so that an idle answer means the
whole fleet is idle), KV tokens used and total (blocks times their size), ``max_running_requests``. A fresh status
is asked for first: right after an abort, the answer says what the abort left. Other sections (``memory``,
``spec``, ``lora``, ``disagg``, ``queues``) are SGLang's scheduler's and have no counterpart here: refused by
name; ``format=prometheus`` likewise (``/metrics`` has the fleet's series).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...package import __version__
from ..context import ServerContext
from ..errors import bad_request
from ..openapi_doc import error_responses
from .control import Control, Query, query_doc

LOADS_PATHS = frozenset({"/v1/loads"})
SECTIONS = ("core", "all")


def engine_load(rank: int, engine: dict[str, Any], queued: int) -> dict[str, Any]:
    """SGLang's core load keys of one engine (``queued``: the coordinator's queue, added to rank 0's waiting)."""
    info = engine.get("info") or {}
    block = int(info.get("block_size") or 1)
    total, free = int(engine.get("kv_blocks_total") or 0), int(engine.get("kv_blocks_free") or 0)
    running, waiting = int(engine.get("running") or 0), int(engine.get("waiting") or 0) + queued
    used = (total - free) * block
    return {"dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": used, "num_total_tokens": total * block, "max_total_num_tokens": total * block,
            "max_running_requests": int(engine.get("capacity") or 0),
            "token_usage": used / (total * block) if total else 0.0}


def add_loads_route(app: FastAPI, ctx: ServerContext, control: Control, api_guard: Any) -> None:
    """``/v1/loads`` on ``app`` (the API key's: it describes the fleet, as ``/get_server_info``)."""

    @app.get("/v1/loads", tags=["sglang"], dependencies=api_guard.dependencies,
             responses=error_responses([400, 401, 503] if api_guard.on else [400, 503]),
             summary="SGLang: load per engine",
             description="SGLang's `{timestamp, version, accelerator, num_accelerators, loads}`, one core entry per "
                         "engine; the coordinator's queue counts as waiting on rank 0.",
             openapi_extra=query_doc(("include", {"type": "string"}, "`core` or `all` (the same here)"),
                                     ("dp_rank", {"type": "integer"}, "only this engine")))
    async def loads(request: Request) -> JSONResponse:
        query = Query(request)
        include = query.text("include")
        rank = query.text("dp_rank")
        form = query.text("format")
        query.done()
        sections = {part.strip() for part in include.split(",")} if include else {"all"}
        if not sections <= set(SECTIONS):
            raise bad_request(f"include {sorted(sections - set(SECTIONS))}: this fleet reports SGLang's core load "
                              "only (include=core or all)", param="include")
        if form not in (None, "json"):
            raise bad_request(f"format {form!r}: JSON only here (GET /metrics has the fleet's Prometheus series)",
                              param="format")
        await control.state("/v1/loads")  # a fresh status: what an abort a moment ago left
        engines = ctx.monitor.engines
        queued = int((ctx.monitor.status or {}).get("queued") or 0)
        entries = [engine_load(i, engine, queued if i == 0 else 0) for i, engine in enumerate(engines)]
        if rank is not None:
            if not rank.isdigit() or int(rank) >= len(entries):
                raise bad_request(f"dp_rank {rank!r}: this fleet has ranks 0 to {len(entries) - 1}", param="dp_rank")
            entries = [entries[int(rank)]]
        return JSONResponse({"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
                             "accelerator": None, "num_accelerators": len(engines), "loads": entries})
