"""The shape of the server's own ASGI middlewares: HTTP requests only, every other scope passed through.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``): a streamed answer's messages go to the client as the route
sends them. Lifespan and websocket scopes reach the wrapped app untouched, so that a layer's :meth:`HTTPLayer.http`
may read ``scope["headers"]`` and ``scope["path"]`` without asking first.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPLayer:
    """An ASGI middleware whose work is :meth:`http`, on HTTP scopes only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request: call ``self.app`` (or answer it here)."""
        raise NotImplementedError
