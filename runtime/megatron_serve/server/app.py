"""The FastAPI application: OpenAI routes, probes and metrics over an ``InferenceClient``.

:func:`create_app` is the only constructor. The same app serves ``megatron-serve server`` (a
client of a remote coordinator), ``megatron-serve run`` (a local fleet) and
``MegatronAsyncLLM.serve()`` (in-process), so that all three behave identically.

``/v1/*`` needs the API key when one is configured; ``/health``, ``/ready`` and ``/metrics`` never
do, because Kubernetes probes and Prometheus scrapers carry no credentials.

The generation routes read their body themselves (``intake.py``): the key is checked before the
body is parsed, the body limit applies, and parsing, the limits, tokenization and chat-template
rendering run as one job on the app's worker threads, never on the event loop that the probes need.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic.json_schema import models_json_schema

from ..limits import READY_TIMEOUT, STATUS_INTERVAL, STATUS_TIMEOUT, RequestLimits
from ..multimodal import ImageOptions

from .. import __version__
from ..generation_config import GenerationDefaults
from ..grammar import warm_checker
from ..http_options import HTTPOptions
from .chat import ChatHandler
from .completions import CompletionHandler
from .admin import ADMIN_BODIES, add_admin_routes
from .lora_routes import LORA_BODIES, LORA_PATHS, add_lora_routes, runtime_lora_allowed
from .context import ServerContext
from .drain import Admission
from .errors import APIError, install_error_handlers
from .fast_routes import Layer, ServerApp, lean_route
from .fleet import FleetMonitor, InferenceBackend
from .generation import PendingCounter
from .images import load_images
from .intake import (SELF_PARSED, BodySizeLimit, Workers, check_limits, parse_body, request_body_doc, small_body,
                     unconstrained)
from .metrics import ServerMetrics
from .request_log import RequestLog, request_id_header
from .stats_log import log_stats
from .models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
)
from .streaming import cancel_on_disconnect, client_closed, read_body
from .tokenize import add_tokenize_routes
from .tool_calls import parser_for_template
from .vllm_metrics import VllmCollector

logger = logging.getLogger("megatron_serve.server")

API_KEY_ENV = "MEGATRON_SERVE_API_KEY"

#: Routes that never ask for a key: the probes, the metrics and the API's own description. Every other
#: route uses the model (its tokenizer and chat template included: ``/tokenize``, ``/detokenize``) and
#: needs the API key when the server has one, except ``/v1/admin/*`` and vLLM's runtime LoRA routes
#: (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), which need the admin key. The
#: HTTP reference is generated from :func:`key_for`; tests/server/test_api_keys.py holds every route to it.
OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
ADMIN_PREFIX = "/v1/admin/"


def key_for(path: str) -> str:
    """Which key the route at ``path`` asks for: ``"api"``, ``"admin"`` or ``"none"``."""
    if path in OPEN_PATHS:
        return "none"
    return "admin" if path.startswith(ADMIN_PREFIX) or path in LORA_PATHS else "api"

_SSE_DOC = ("With `stream: true` the answer is `text/event-stream`: one `data: {chunk JSON}` event per piece "
            "of text (OpenAI chunk objects), an optional usage chunk (`stream_options.include_usage`), then "
            "`data: [DONE]`.")


# One server-sent event, as OpenAPI tools read a stream: each event's fields, the data a chunk's JSON or [DONE].
_SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "one chunk object as JSON, or the literal [DONE]"},
        "event": {"type": "string"},
        "id": {"type": "string"},
    },
}


def _error_responses(codes: list[int]) -> dict[int | str, dict[str, Any]]:
    meaning = {400: "invalid request (bad parameter, unknown parameter, prompt longer than the context, over a "
                    "request limit or budget)",
               401: "missing or wrong API key", 404: "no such model", 429: "the server's queue is full",
               413: "the request body is larger than the server accepts (--max-request-bytes)",
               415: "the request body is not declared 'Content-Type: application/json'",
               500: "the engine failed", 503: "the fleet is stopped, the coordinator is unreachable or lost, or the "
                                              "server is shutting down (Retry-After says when to retry)"}
    return {code: {"model": ErrorResponse, "description": meaning[code]} for code in codes}


def create_app(
    backend: InferenceBackend,
    tokenizer: Any,
    model_name: str,
    api_key: str | None = None,
    *,
    admin_key: str | None = None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    max_concurrent_requests: int | None = None,
    generation_defaults: GenerationDefaults | None = None,
    status_interval: float = STATUS_INTERVAL,
    status_timeout: float = STATUS_TIMEOUT,
    ready_timeout: float = READY_TIMEOUT,
    limits: RequestLimits | None = None,
    tokenizer_threads: int | None = None,
    image_options: ImageOptions | None = None,
    options: HTTPOptions | None = None,
    stream_interval: int = 1,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app in front of ``backend`` (an ``InferenceClient`` or the same interface).

    ``vocab_size`` / ``max_model_len``: the model's, used to refuse bad prompts with a 400 (engines
    report a tighter ``max_sequence_length`` once connected, which then wins).
    ``max_concurrent_requests``: engine requests this server holds at once; beyond it, 429.
    ``limits``: what one request may carry (default :class:`~megatron_serve.limits.RequestLimits()`);
    ``tokenizer_threads``: worker threads for tokenization and chat templates (default up to 4);
    ``image_options``: how the ``image_url`` parts of chats are fetched (vision-language models).
    ``generation_defaults``: sampling values for fields a request leaves out (the model's
    ``generation_config.json``; see :mod:`megatron_serve.generation_config`).
    ``stream_interval``: streamed tokens per chunk (vLLM's ``--stream-interval``; a choice's first token
    goes at once). ``lora_modules``: the LoRA adapters the engines serve (name -> directory), listed in
    ``/v1/models`` and picked by a request's ``model`` until the engines report theirs (which then win:
    ``/v1/load_lora_adapter`` changes them; :mod:`.lora_routes`, open with ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    ``status_interval``, ``status_timeout``, ``ready_timeout``: how often the fleet's status is polled, how
    long a poll may take before the fleet counts as busy (or unreachable, without heartbeats), and how
    long ``/ready`` and ``/metrics`` wait for a fresh one (:mod:`.fleet`).
    ``admin_key``: opens ``/v1/admin/*`` (the lifecycle over HTTP; :mod:`.admin`); it must differ from
    ``api_key``. Without it those routes answer 403.
    ``options``: tool-call parser, CORS, request and stats logs, ``vllm:`` metrics, uvicorn's log
    (:class:`~megatron_serve.http_options.HTTPOptions`; vLLM's flags of the same names).
    The backend is started by the app (in the background) if it is not started yet, but never
    closed by it: whoever made the backend closes it.

    Long: the routes are closures over one app's state (backend, tokenizer pool, limits, metrics), declared
    where FastAPI reads their shapes for the OpenAPI document; each route's body is a call into its module.
    """
    if admin_key and admin_key == api_key:
        raise ValueError("the admin key must differ from the API key: the API key must not open the admin API")
    options = options or HTTPOptions()
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
    monitor = FleetMonitor(backend, interval=status_interval, timeout=status_timeout, ready_timeout=ready_timeout)
    metrics = ServerMetrics(monitor, lambda: pending.value, model_name)
    pending = PendingCounter(max_concurrent_requests, metrics.pending_gauge)
    if options.metrics_compat == "vllm":
        metrics.add_collector(VllmCollector(monitor, metrics, model_name))
    limits = limits or RequestLimits()
    ctx = ServerContext(backend=backend, tokenizer=tokenizer, model_name=model_name, monitor=monitor, metrics=metrics,
                        pending=pending, limits=limits, workers=Workers(tokenizer_threads), vocab_size=vocab_size,
                        default_max_model_len=max_model_len, images=image_options or ImageOptions(),
                        tool_parser=options.tool_call_parser if options.auto_tool_choice else parser_for_template(
                            getattr(tokenizer, "chat_template", None)),
                        generation_defaults=generation_defaults or GenerationDefaults(), options=options,
                        request_log=RequestLog(options.log_requests, options.max_log_len),
                        stream_interval=stream_interval, configured_adapters=dict(lora_modules or {}))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if app.telemetry_on():  # FastAPI's OpenTelemetry spans cover every route: no lean ones
            app.lean = {}
        grammar = asyncio.ensure_future(asyncio.to_thread(warm_checker))  # off the loop, before requests need it
        grammar.add_done_callback(lambda f: f.cancelled() or f.exception())  # a request would say what is wrong
        monitor.ensure_running()
        await monitor.wait_first_poll(timeout=5.0)
        stats = asyncio.create_task(log_stats(monitor, options.stats_interval)) if options.log_stats else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await monitor.stop()
            ctx.workers.close()

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = ServerApp(
        title="megatron-serve",
        version=__version__,
        summary="OpenAI-compatible inference API of a megatron-serve fleet",
        lifespan=lifespan,
        **docs,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    layers: list[Layer] = [(BodySizeLimit, {"limit": limits.max_body_bytes}), (Admission, {"state": ctx.drain}),
                           (_HTTPMetricsMiddleware, {"metrics": metrics})]
    if options.cors is not None:  # outermost: preflight requests are answered before any other check
        layers.append((CORSMiddleware, {"allow_origins": list(options.cors.origins),
                                        "allow_methods": list(options.cors.methods),
                                        "allow_headers": list(options.cors.headers),
                                        "allow_credentials": options.cors.credentials}))
    for cls, settings in layers:
        app.add_middleware(cls, **settings)

    api_dependencies = []
    error_codes = [400, 404, 413, 415, 429, 500, 503]
    authorize: Callable[[Request], Awaitable[None]] | None = None
    if api_key:
        bearer = HTTPBearer(auto_error=False, description="the server's API key, as `Authorization: Bearer KEY`")
        expected = api_key.encode()

        async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
            offered = credentials.credentials.encode() if credentials is not None else b""
            if not offered or not hmac.compare_digest(offered, expected):
                raise APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

        api_dependencies.append(Depends(require_api_key))
        error_codes.insert(1, 401)

        async def check_key(request: Request) -> None:  # the dependency above, for the lean routes
            await require_api_key(await bearer(request))

        authorize = check_key

    def parse(handler_type: type[CompletionHandler] | type[ChatHandler], body: bytes) -> Any:
        """On a worker thread: parse and check the limits."""
        req = parse_body(handler_type.request_model, body)
        check_limits(req, limits, ctx.max_model_len())
        return req

    async def answer(handler_type: type[CompletionHandler] | type[ChatHandler], request: Request) -> Any:
        """Either endpoint's answer, whole or streamed, given up (its engine requests aborted) if the client leaves."""
        body = await read_body(request)  # whole, before anything watches the connection for a disconnect
        if body is None:
            return client_closed()

        header_id = request_id_header(request)  # checked before any work: a bad one is a 400

        async def work() -> Any:
            await monitor.wait_first_poll()
            small = small_body(body)  # parsed and, a completion without constraint, tokenized here (intake)
            req = parse(handler_type, body) if small else await ctx.workers.run(parse, handler_type, body)
            if header_id is not None:  # vLLM: the X-Request-Id header wins over the body's request_id
                req.request_id = header_id
            await load_images(req, ctx)  # a chat's image parts, fetched and checked (none: nothing to do)
            if small and handler_type is CompletionHandler and unconstrained(req):
                handler = handler_type(ctx, req)
            else:
                handler = await ctx.workers.run(handler_type, ctx, req)  # tokenize or render
            ctx.request_log.received(handler)
            return await (handler.stream() if handler.req.stream else handler.complete())

        return await cancel_on_disconnect(request, work, ctx.stopping)

    stream_200 = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
                        "description": "the completion (JSON), or its stream of server-sent events"}}

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=api_dependencies,
              responses={**stream_200, **_error_responses(error_codes)}, tags=["OpenAI"],
              openapi_extra=request_body_doc(CompletionRequest), description="Complete one or more prompts. " + _SSE_DOC)
    async def completions(request: Request) -> Any:
        return await answer(CompletionHandler, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=api_dependencies,
              responses={**stream_200, **_error_responses(error_codes)}, tags=["OpenAI"],
              openapi_extra=request_body_doc(ChatCompletionRequest),
              description="Answer a conversation rendered with the model's chat template. " + _SSE_DOC)
    async def chat_completions(request: Request) -> Any:
        return await answer(ChatHandler, request)

    for route in app.routes:  # the same endpoints, without Starlette's and FastAPI's layers (fast_routes)
        if isinstance(route, APIRoute) and route.endpoint in (completions, chat_completions):
            app.lean[route.path] = lean_route(route, route.endpoint, layers, authorize)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=ctx.created, max_model_len=ctx.max_model_len(),
                         input_modalities=["text", "image"] if ctx.accepts_images else ["text"])

    def adapter_card(name: str, adapters: dict[str, str]) -> ModelCard:
        return model_card().model_copy(update={"id": name, "root": adapters[name], "parent": model_name})

    @app.get("/v1/models", response_model=ModelList, dependencies=api_dependencies, tags=["OpenAI"],
             responses=_error_responses([401] if api_key else []))
    async def list_models() -> ModelList:
        served = ctx.adapters
        return ModelList(data=[model_card(), *(adapter_card(name, served) for name in served)])

    @app.get("/v1/models/{model}", response_model=ModelCard, dependencies=api_dependencies, tags=["OpenAI"],
             responses=_error_responses([401, 404] if api_key else [404]))
    async def retrieve_model(model: str) -> ModelCard:
        if model not in ctx.served_names:
            raise APIError(404, f"the model '{model}' does not exist here", param="model", code="model_not_found")
        return model_card() if model == model_name else adapter_card(model, ctx.adapters)

    @app.get("/health", response_model=HealthResponse, tags=["probes"],
             description="200 while this process is up (liveness).")
    async def health() -> HealthResponse:
        return HealthResponse()

    @app.get("/ready", response_model=ReadyResponse, tags=["probes"],
             responses={503: {"model": ReadyResponse, "description": "not serving now: the coordinator is "
                                                                    "unreachable, the fleet is not RUNNING, or this "
                                                                    "server is shutting down"}},
             description="200 while requests are served now: the coordinator answers, the fleet is RUNNING and "
                         "this server is not draining (readiness). A PAUSED or SUSPENDED fleet still accepts requests "
                         "(they wait), but is not ready. `/health` is the liveness answer.")
    async def ready() -> Response:
        await monitor.wait_first_poll()
        if monitor.reachable:
            await monitor.fresh()  # the state as of now (a fleet paused a moment ago is not ready), or the last
        draining = "this server is shutting down (draining)" if ctx.drain.draining.is_set() else None
        detail = draining or monitor.not_ready_reason()
        body = ReadyResponse(ready=detail is None, state=monitor.state if monitor.reachable else None,
                             coordinator_reachable=monitor.reachable, busy=monitor.busy, engines=len(monitor.engines),
                             detail=detail)
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get("/metrics", tags=["probes"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}},
             description="Prometheus metrics of the whole fleet: every engine group's vLLM-style series (running "
                         "and waiting requests, KV-cache usage, token counters, TTFT, inter-token, end-to-end and "
                         "queue-time histograms, preemptions, prefix-cache queries and hits), the coordinator's "
                         "queue depth, lifecycle state and refits, and this server's own requests.")
    async def prometheus_metrics() -> Response:
        await monitor.wait_first_poll()
        if monitor.reachable:
            await monitor.fresh()
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    add_tokenize_routes(app, ctx, api_dependencies,
                        _error_responses([400, 401, 404, 415] if api_key else [400, 404, 415]))
    add_admin_routes(app, backend, monitor, admin_key)  # type: ignore[arg-type]  # the clients have the verbs
    add_lora_routes(app, backend, monitor, admin_key, runtime_lora_allowed(), model_name)  # type: ignore[arg-type]

    def openapi() -> dict[str, Any]:
        """FastAPI's document, minus the 422 answers it assumes (validation errors are 400 here), plus the
        request bodies that the generation routes parse themselves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                                 description="OpenAI-compatible API. Every error is an OpenAI error object.")
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _, request_schemas = models_json_schema([(model, "validation") for model in (*SELF_PARSED, *ADMIN_BODIES,
                                                                                       *LORA_BODIES)],
                                                    ref_template="#/components/schemas/{model}")
            components.update(request_schemas.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class _HTTPMetricsMiddleware:
    """Counts answers by route template and status (a pure ASGI middleware: streaming stays untouched)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, int] = {}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            self.metrics.observe_http(getattr(route, "path", None) or "unmatched", status.get("code", 500))
