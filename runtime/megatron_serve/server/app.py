"""The FastAPI application: OpenAI routes, probes and metrics over an ``InferenceClient``.

:func:`create_app` is the only constructor. The same app serves ``megatron-serve server`` (a
client of a remote coordinator), ``megatron-serve run`` (a local fleet) and
``serve_async_llm`` (a ``MegatronAsyncLLM`` in-process), so that all three behave identically.

``/v1/*`` needs the API key when one is configured; ``/health``, ``/ready`` and ``/metrics`` never
do, because Kubernetes probes and Prometheus scrapers carry no credentials.

The routes live by concern in modules of their own (:mod:`.generation_routes`, :mod:`.model_routes`,
:mod:`.probe_routes`, :mod:`.tokenize`, :mod:`.admin`, :mod:`.lora_routes`); this module builds the
state they share (:class:`~.context.ServerContext`) and the middleware stack in front of them.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from ..tokenizer import Tokenizer
from ..package import __version__
from ..generation_config import GenerationDefaults
from ..grammar import warm_checker
from ..http_options import HTTPOptions
from ..limits import READY_TIMEOUT, STATUS_INTERVAL, STATUS_TIMEOUT, RequestLimits
from ..multimodal import ImageOptions
from .admin import ADMIN_BODIES, add_admin_routes
from .api_key import API_KEY_ENV, api_key_guard
from .context import ServerContext
from .drain import Admission
from .errors import install_error_handlers
from .fast_routes import Layer, ServerApp
from .backend import Backend
from .fleet import FleetMonitor
from .generation import PendingCounter
from .generation_routes import add_generation_routes
from .http_layer import HTTPLayer
from .intake import SELF_PARSED, BodySizeLimit, Workers
from .lora_routes import LORA_BODIES, LORA_PATHS, add_lora_routes, runtime_lora_allowed
from .metrics import ServerMetrics
from .model_routes import add_model_routes
from .openapi_doc import error_responses, openapi_builder
from .probe_routes import add_probe_routes
from .request_log import RequestLog
from .rl import RL_ADMIN_PATHS, add_rl_routes
from .rl.control_routes import CONTROL_BODIES
from .rl.token_routes import TOKEN_BODIES, add_token_routes
from .stats_log import log_stats
from .tenant_admission import Tenancy, TenantScope
from .tenants import TenancyOptions, tenant_table
from .tokenize import add_tokenize_routes
from .tool_calls import parser_for_template
from .vllm_metrics import VllmCollector
from .wake import WakeCollector, WakeGate

logger = logging.getLogger("megatron_serve.server")

__all__ = ["API_KEY_ENV", "create_app", "key_for"]

#: Routes that never ask for a key: the probes (the RL frameworks' too: TRL's ``/health/``, prime-rl's
#: ``/liveness``, SGLang's ``/health_generate``), the metrics and the API's own description. Every other
#: route uses the model (its tokenizer and chat template included: ``/tokenize``, ``/detokenize``) and
#: needs the API key when the server has one, except ``/v1/admin/*``, vLLM's runtime LoRA routes
#: (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) and the RL frameworks' control and weight routes
#: (:data:`.rl.RL_ADMIN_PATHS`), which need the admin key. The
#: HTTP reference is generated from :func:`key_for`; tests/server/test_api_keys.py holds every route to it.
OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
              "/health/", "/liveness", "/health_generate")
ADMIN_PREFIX = "/v1/admin/"
_SUMMARY = "OpenAI-compatible inference API of a megatron-serve fleet"


def key_for(path: str) -> str:
    """Which key the route at ``path`` asks for: ``"api"``, ``"admin"`` or ``"none"``."""
    if path in OPEN_PATHS:
        return "none"
    return "admin" if path.startswith(ADMIN_PREFIX) or path in LORA_PATHS or path in RL_ADMIN_PATHS else "api"


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
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
    tenancy: TenancyOptions | None = None,
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
    ``admin_key``: opens ``/v1/admin/*`` (:mod:`.admin`; else they answer 403); it must differ from ``api_key``.
    ``api_key`` may also be a document of several keys and their tenants (:mod:`.tenants`); ``tenancy``: the
    fairness header and when the fleet counts as saturated (:class:`~.tenants.TenancyOptions`; docs/tenants.md).
    ``options``: tool-call parser, CORS, request and stats logs, ``vllm:`` metrics, uvicorn's log
    (:class:`~megatron_serve.http_options.HTTPOptions`; vLLM's flags of the same names).
    The backend is started by the app (in the background) if it is not started yet, but never
    closed by it: whoever made the backend closes it.

    Long: the app's one assembly, a line or two per concern, read best whole.
    """
    if admin_key and admin_key == api_key:
        raise ValueError("the admin key must differ from the API key: the API key must not open the admin API")
    tenants = tenant_table(api_key, tenancy)
    if admin_key and tenants is not None and tenants.entry(admin_key.encode()) is not None:
        raise ValueError("the admin key must differ from every API key: an API key must not open the admin API")
    options = options or HTTPOptions()
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
    monitor = FleetMonitor(backend, interval=status_interval, timeout=status_timeout, ready_timeout=ready_timeout)
    metrics, pending = _metrics(monitor, model_name, options, max_concurrent_requests)
    limits = limits or RequestLimits()
    ctx = ServerContext(backend=backend, tokenizer=tokenizer, model_name=model_name, monitor=monitor, metrics=metrics,
                        pending=pending, limits=limits, workers=Workers(tokenizer_threads), vocab_size=vocab_size,
                        default_max_model_len=max_model_len, images=image_options or ImageOptions(),
                        tool_parser=options.tool_call_parser if options.auto_tool_choice else parser_for_template(
                            getattr(tokenizer, "chat_template", None)),
                        generation_defaults=generation_defaults or GenerationDefaults(), options=options,
                        request_log=RequestLog(options.log_requests, options.max_log_len),
                        stream_interval=stream_interval, configured_adapters=dict(lora_modules or {}))
    if tenants is not None:
        ctx.tenancy = Tenancy(tenants, tenancy or TenancyOptions(), monitor, metrics, lambda: pending.value)
    ctx.wake = WakeGate(monitor, options.wake)  # scale from zero: requests wait for a first engine
    metrics.add_collector(WakeCollector(ctx.wake))

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = ServerApp(title="megatron-serve", version=__version__, summary=_SUMMARY, lifespan=_lifespan(ctx), **docs)
    app.state.ctx = ctx
    install_error_handlers(app)
    layers = _layers(ctx)
    for cls, settings in layers:
        app.add_middleware(cls, **settings)

    guard = api_key_guard(api_key, tenants)
    add_generation_routes(app, ctx, guard, layers)
    add_model_routes(app, ctx, guard)
    add_probe_routes(app, ctx)
    add_tokenize_routes(app, ctx, guard.dependencies,
                        error_responses([400, 401, 404, 415] if guard.on else [400, 404, 415]))
    add_admin_routes(app, backend, monitor, admin_key)
    add_lora_routes(app, backend, monitor, admin_key, runtime_lora_allowed(), model_name)
    add_rl_routes(app, ctx, admin_key, guard)
    add_token_routes(app, ctx, guard)  # the RL frameworks' generation routes, on the OpenAI routes' handlers
    bodies = (*SELF_PARSED, *ADMIN_BODIES, *LORA_BODIES, *TOKEN_BODIES, *CONTROL_BODIES)
    app.openapi = openapi_builder(app, bodies)  # type: ignore[method-assign]
    return app


def _metrics(monitor: FleetMonitor, model_name: str, options: HTTPOptions,
             max_concurrent_requests: int | None) -> tuple[ServerMetrics, PendingCounter]:
    """The server's metrics (with vLLM's ``vllm:`` series when asked) and the pending-request counter they show."""
    metrics = ServerMetrics(monitor, lambda: pending.value, model_name)
    pending = PendingCounter(max_concurrent_requests, metrics.pending_gauge)
    if options.metrics_compat == "vllm":
        metrics.add_collector(VllmCollector(monitor, metrics, model_name))
    return metrics, pending


def _lifespan(ctx: ServerContext) -> Callable[[ServerApp], AbstractAsyncContextManager[None]]:
    """What runs around the app's life: the fleet monitor, the grammar checker's warm-up, the stats log."""

    @asynccontextmanager
    async def lifespan(app: ServerApp) -> AsyncIterator[None]:
        if app.telemetry_on():  # FastAPI's OpenTelemetry spans cover every route: no lean ones
            app.lean = {}
        grammar = asyncio.ensure_future(asyncio.to_thread(warm_checker))  # off the loop, before requests need it
        grammar.add_done_callback(lambda f: f.cancelled() or f.exception())  # a request would say what is wrong
        ctx.monitor.ensure_running()
        await ctx.monitor.wait_first_poll(timeout=5.0)
        options = ctx.options
        stats = asyncio.create_task(log_stats(ctx.monitor, options.stats_interval)) if options.log_stats else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await ctx.monitor.stop()
            ctx.workers.close()

    return lifespan


def _layers(ctx: ServerContext) -> list[Layer]:
    """The middleware, innermost first: the body limit, admission (drain), the HTTP metrics, then CORS (outermost:
    preflight requests are answered before any other check). The lean routes run behind the same layers."""
    layers: list[Layer] = [(BodySizeLimit, {"limit": ctx.limits.max_body_bytes}), (Admission, {"state": ctx.drain}),
                           (_HTTPMetricsMiddleware, {"metrics": ctx.metrics})]
    if ctx.tenancy is not None:  # the request's fairness header, and the key its check notes (tenant_admission)
        layers.insert(0, (TenantScope, {"header": ctx.tenancy.header}))
    cors = ctx.options.cors
    if cors is not None:
        layers.append((CORSMiddleware, {"allow_origins": list(cors.origins), "allow_methods": list(cors.methods),
                                        "allow_headers": list(cors.headers), "allow_credentials": cors.credentials}))
    return layers


class _HTTPMetricsMiddleware(HTTPLayer):
    """Counts answers by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
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
