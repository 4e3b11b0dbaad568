"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the routes that run the model.

Each route reads its body itself (:mod:`.intake`): the key is checked before the body is parsed, the
body limit applies, and parsing, the limits, tokenization and chat-template rendering run as one job
on the app's worker threads, never on the event loop that the probes need. The same endpoints are
also registered as lean routes (:mod:`.fast_routes`), which skip Starlette's and FastAPI's layers.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

from .api_key import APIKeyGuard
from .chat import ChatHandler
from .completions import CompletionHandler
from .context import ServerContext
from .fast_routes import Layer, ServerApp, lean_route
from .images import load_images
from .intake import check_limits, parse_body, request_body_doc, small_body, unconstrained
from .models import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from .openapi_doc import error_responses
from .placement import place, request_placement
from .request_log import request_id_header
from .streaming import cancel_on_disconnect, client_closed, read_body

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

Handler = type[CompletionHandler] | type[ChatHandler]


def _parse(ctx: ServerContext, handler_type: Handler, body: bytes) -> Any:
    """On a worker thread: parse and check the limits."""
    req = parse_body(handler_type.request_model, body)
    check_limits(req, ctx.limits, ctx.max_model_len())
    return req


async def _answer(ctx: ServerContext, handler_type: Handler, request: Request) -> Any:
    """Either endpoint's answer, whole or streamed, given up (its engine requests aborted) if the client leaves."""
    body = await read_body(request)  # whole, before anything watches the connection for a disconnect
    if body is None:
        return client_closed()

    header_id = request_id_header(request)  # checked before any work: a bad one is a 400
    if ctx.tenancy is not None:  # a sheddable request into a saturated fleet: its 503 before its body is parsed
        await ctx.tenancy.shed_at_door()

    async def work() -> Any:
        await ctx.monitor.wait_first_poll()
        small = small_body(body)  # parsed and, a completion without constraint, tokenized here (intake)
        req = _parse(ctx, handler_type, body) if small else await ctx.workers.run(_parse, ctx, handler_type, body)
        if header_id is not None:  # vLLM: the X-Request-Id header wins over the body's request_id
            req.request_id = header_id
        placement = request_placement(request, req.session_id)  # X-Session-ID, X-data-parallel-rank: 400s first
        await load_images(req, ctx)  # a chat's image parts, fetched and checked (none: nothing to do)
        if small and handler_type is CompletionHandler and unconstrained(req):
            handler = handler_type(ctx, req)
        else:
            handler = await ctx.workers.run(handler_type, ctx, req)  # tokenize or render
        place(handler.jobs, placement)
        if ctx.wake is not None:  # no engine registered (scaled to zero): wait for one, bounded (:mod:`.wake`)
            await ctx.wake.hold()
        ctx.request_log.received(handler)
        return await (handler.stream() if handler.req.stream else handler.complete())

    return await cancel_on_disconnect(request, work, ctx.stopping)


def add_generation_routes(app: ServerApp, ctx: ServerContext, guard: APIKeyGuard, layers: list[Layer]) -> None:
    """The two generation routes on ``app``, and their lean twins behind the same ``layers`` and key."""
    codes = [400, 401, 404, 413, 415, 429, 500, 503] if guard.on else [400, 404, 413, 415, 429, 500, 503]
    responses = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
                       "description": "the completion (JSON), or its stream of server-sent events"},
                 **error_responses(codes)}

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=guard.dependencies,
              responses=responses, tags=["OpenAI"], openapi_extra=request_body_doc(CompletionRequest),
              description="Complete one or more prompts. " + _SSE_DOC)
    async def completions(request: Request) -> Any:
        return await _answer(ctx, CompletionHandler, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=guard.dependencies,
              responses=responses, tags=["OpenAI"], openapi_extra=request_body_doc(ChatCompletionRequest),
              description="Answer a conversation rendered with the model's chat template. " + _SSE_DOC)
    async def chat_completions(request: Request) -> Any:
        return await _answer(ctx, ChatHandler, request)

    _add_lean_twins(app, (completions, chat_completions), layers, guard)


def _add_lean_twins(app: ServerApp, endpoints: tuple[Any, ...], layers: list[Layer], guard: APIKeyGuard) -> None:
    for route in app.routes:  # the same endpoints, without Starlette's and FastAPI's layers (fast_routes)
        if isinstance(route, APIRoute) and route.endpoint in endpoints:
            app.lean[route.path] = lean_route(route, route.endpoint, layers, guard.authorize)
