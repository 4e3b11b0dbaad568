"""The generation routes' way in without Starlette's router and FastAPI's request handling.

Every ``POST /v1/completions`` and ``POST /v1/chat/completions`` went through about a dozen ASGI layers
before its route ran: FastAPI's telemetry check and body-limit wrapper, Starlette's error middleware, the
app's own middleware, Starlette's exception middleware, FastAPI's exit-stack middleware, the router's
match over every route, FastAPI's request handler (two more exception wrappers, exit stacks, dependency
solving with a parse of the query string and cookies) and only then the endpoint. None of it does
anything for these two routes that the route does not do itself: they read their body themselves
(:mod:`.intake`) and take no path, query or form parameters. In the HTTP server's profile at 64 streams
of 2 tokens, Starlette and FastAPI were about 15% of the process's Python time per request.

:class:`ServerApp` answers the two routes through :func:`lean_route`: the app's own middleware (the same
classes with the same settings: CORS when configured, the HTTP metrics, admission while draining, the body
limit), the API key check (the same ``HTTPBearer`` reading of the header), the endpoint, and the error
handling of Starlette's two exception middlewares (an :class:`~.errors.APIError` or an HTTP exception
answered in the OpenAI error shape; anything else logged, answered 500 and raised again, so that uvicorn
closes the connection as before). A non-streamed answer is serialized by FastAPI's own
``serialize_response`` against the route's response model, as the route would. Everything else (other
methods on these paths, every other path, the lifespan) goes the whole way, and so does every request
when FastAPI's OpenTelemetry instrumentation is on (a tracer, meter or logger provider set before the
app starts), so that its spans still cover these routes.

Measured with the HTTP server alone over a backend that makes a token per stream every 2 ms (``benchmarks/
serving.py``'s client, 64 streams of 2 tokens, 12 rounds alternated with ``main`` on a loaded 2-core machine):
server CPU per request, median, 693 -> 566 us (docs/benchmarks.md, "Fourth round").
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute, serialize_response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, http_error, unexpected_error

#: An endpoint of a lean route: the request in, a response or a model to serialize out.
Endpoint = Callable[[Request], Awaitable[Any]]
#: A middleware class and its settings, applied to the whole app and to the lean routes alike.
Layer = tuple[type, dict[str, Any]]


class ServerApp(FastAPI):
    """The FastAPI app, with its lean routes (path -> ASGI app) answered before Starlette's stack."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lean: dict[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.lean.get(scope["path"])
            if route is not None:
                scope["app"] = self
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def telemetry_on(self) -> bool:
        """Whether FastAPI's OpenTelemetry instrumentation has a provider to report to (then no lean routes)."""
        telemetry = getattr(self, "_native_telemetry", None)
        return telemetry is not None and bool(telemetry.enabled())


def lean_route(route: APIRoute, endpoint: Endpoint, layers: list[Layer],
               authorize: Callable[[Request], Awaitable[None]] | None) -> ASGIApp:
    """``route``'s ASGI app for :class:`ServerApp`: ``endpoint`` behind ``authorize`` (the API key check) and
    ``layers`` (outermost last, as ``FastAPI.add_middleware`` stacks them), with the app's error handling."""

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route  # what the router sets once it matched: the metrics name the route by it (a request
        scope["endpoint"] = route.endpoint  # refused before, by admission or the body limit, stays "unmatched")
        scope["path_params"] = {}
        request = Request(scope, receive, send)
        try:
            if authorize is not None:
                await authorize(request)
            response = await endpoint(request)
            if not isinstance(response, Response):
                response = Response(await serialize_response(field=route.response_field, response_content=response,
                                                             dump_json=True), media_type="application/json")
        except APIError as exc:
            response = exc.response()
        except StarletteHTTPException as exc:
            response = http_error(exc).response()
        await response(scope, receive, send)

    app: ASGIApp = answer
    for cls, settings in layers:
        app = cls(app, **settings)
    inner = app

    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await inner(scope, receive, sending)
        except Exception as exc:  # Starlette's ServerErrorMiddleware: answered if it can be, then raised again
            response = unexpected_error(Request(scope), exc).response()
            if not started:
                await response(scope, receive, send)
            raise

    return routed
