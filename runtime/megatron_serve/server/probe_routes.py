"""``/health``, ``/ready`` and ``/metrics``: what Kubernetes probes and Prometheus scrapers read.

They never ask for a key (probes and scrapers carry no credentials). ``/ready`` and ``/metrics`` look
at a fresh fleet status when the coordinator is reachable, so that a fleet paused a moment ago is not
ready, and the last one otherwise (:mod:`.fleet`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .fleet import HELD
from .service_models import HealthResponse, ReadyResponse


def add_probe_routes(app: FastAPI, ctx: ServerContext) -> None:
    """The three probe routes on ``app``."""
    monitor = ctx.monitor

    @app.get("/health", response_model=HealthResponse, response_model_exclude_none=True, tags=["probes"],
             description="200 while this process is up (liveness), whatever the fleet does: `{\"status\": \"ok\"}` "
                         "(vLLM's `/health` is an empty 200); while something keeps requests from being served, "
                         "`missing` names it, as `/ready` does.")
    async def health() -> HealthResponse:
        missing = [*monitor.missing(), *(["server"] if ctx.drain.draining.is_set() else [])]
        return HealthResponse(missing=missing or None)

    @app.get("/ready", response_model=ReadyResponse, tags=["probes"],
             responses={503: {"model": ReadyResponse, "description": "not serving now: the coordinator is "
                                                                    "unreachable, the fleet is not RUNNING, no engine "
                                                                    "can take a request, or this server is shutting "
                                                                    "down (`missing` names which)"}},
             description="200 while requests are served now: the coordinator answers, the fleet is RUNNING, an "
                         "engine can take a request and this server is not draining (readiness). A PAUSED or "
                         "SUSPENDED fleet, or one without engines, still accepts requests (they wait), but is not "
                         "ready. With `--scale-from-zero-timeout` above 0, a RUNNING fleet without engines is ready "
                         "(200, `held` true, `engines` 0) while the queue of held requests has room: the server takes "
                         "them and serves them once an engine registers. `/health` is the liveness answer.")
    async def ready() -> Response:
        await monitor.as_of_now()
        draining = "this server is shutting down (draining)" if ctx.drain.draining.is_set() else None
        held = draining is None and ctx.wake is not None and ctx.wake.holds()
        full = None if draining or ctx.wake is None else ctx.wake.full()
        detail = draining or (HELD if held else None) or (
            f"no engine is registered and the requests held for one fill the queue ({full})" if full else
            monitor.not_ready_reason())
        body = ReadyResponse(ready=detail is None or held, state=monitor.state if monitor.reachable else None,
                             coordinator_reachable=monitor.reachable, busy=monitor.busy, engines=len(monitor.engines),
                             held=held, detail=detail, missing=[*monitor.missing(), *(["server"] if draining else [])])
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get("/metrics", tags=["probes"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}},
             description="Prometheus metrics of the whole fleet: every engine group's vLLM-style series (running "
                         "and waiting requests, KV-cache usage, token counters, TTFT, inter-token, end-to-end and "
                         "queue-time histograms, preemptions, prefix-cache queries and hits), the coordinator's "
                         "queue depth, lifecycle state and refits, and this server's own requests.")
    async def prometheus_metrics() -> Response:
        await monitor.as_of_now()
        data, content_type = ctx.metrics.render()
        return Response(content=data, media_type=content_type)
