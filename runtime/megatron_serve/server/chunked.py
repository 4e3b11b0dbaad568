"""A streamed response's body chunks written straight into the connection: an ASGI extension of the server's own
HTTP protocol (:class:`~.connections.ServerProtocol`).

Every event of a stream went through uvicorn's ASGI ``send`` (a message dict, a coroutine call, the checks of a
response that has not started, a list joined per chunk) and, before it, the app's middleware: the largest Python
cost per streamed token in the HTTP server's profiles. The protocol that owns the connection offers, in each
request's scope (``scope["extensions"][EXTENSION]``), a :class:`ChunkedBody`: once the response's status line went
through ``send`` with chunked transfer encoding, a chunk is its framing and bytes in one ``transport.write``, with
what ``send`` does for a body chunk of a started chunked response (wait while the transport's buffer is full;
nothing once the client left). The status line and the end of the body still go through ``send``, so the
middleware sees every response start and end and uvicorn's bookkeeping (response complete, keep-alive) is its own.
Another server, or a response uvicorn frames otherwise, has no usable extension: its chunks go through ``send``.

The extension holds its request-response cycle by a weak reference: the cycle holds the scope, which holds the
extension, and a strong reference made every request's objects (its connection, transport, scope, submission,
renderer) a reference cycle that only the garbage collector freed. Under an abort storm they piled up by the
thousand and a full collection over them stopped the event loop for seconds on a loaded host; with the weak
reference they go when the request and its connection are done with them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from starlette.types import Scope

#: The scope extension's key.
EXTENSION = "megatron_serve.chunked_body"
#: One chunk of chunked transfer encoding: its size in hex, its bytes (``FRAME % (len(body), body)``).
FRAME = b"%x\r\n%b\r\n"


class ChunkedBody:
    """Body chunks of one response on one connection (uvicorn's httptools request-response cycle), and the call that
    tells the request its client left (:attr:`on_leave`)."""

    __slots__ = ("_cycle", "_transport", "_flow", "on_leave")

    def __init__(self, cycle: Any) -> None:
        self._cycle = weakref.ref(cycle)  # (see the module docstring) alive while its response is being sent
        self._transport = cycle.transport
        self._flow = cycle.flow
        # Called once, by the protocol, when the client leaves before the response ended (the request's
        # ``streaming.Departure`` sets it: no task per request waiting on ``receive`` for ``http.disconnect``)
        self.on_leave: Callable[[], None] | None = None

    def left(self) -> bool:
        """The client left (or the response's cycle is gone)."""
        cycle = self._cycle()
        return cycle is None or cycle.disconnected

    def usable(self) -> bool:
        """The response started with chunked transfer encoding (a streamed answer's does), not for a HEAD."""
        cycle = self._cycle()
        return (cycle is not None and cycle.response_started and cycle.chunked_encoding is True
                and cycle.scope["method"] != "HEAD")

    def write_now(self, body: bytes) -> bool:
        """One chunk of ``body`` written at once when the transport takes it at once (nothing waits in its buffer,
        the client is still there); False, and nothing written, when not: then :meth:`write`, in the response's
        task, sends it when the connection drains.

        Only for a response that is being sent (its writer stops before the response completes), so the transport
        alone says it all: a client that left closed it (``connection_lost``, the read timeout). The cycle and the
        flow control, two more objects to fetch from memory per token, are not read."""
        return write_chunk(self._transport, body)

    @property
    def transport(self) -> Any:
        """The connection's transport (what :func:`write_chunk` writes into)."""
        return self._transport

    async def write(self, body: bytes) -> None:
        """One chunk of ``body``, as uvicorn's ``send`` writes ``{"body": body, "more_body": True}``."""
        cycle = self._cycle()
        if not body or cycle is None:
            return
        if self._flow.write_paused and not cycle.disconnected:
            await self._flow.drain()
        if cycle.disconnected or cycle.response_complete:
            return
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))


def write_chunk(transport: Any, body: bytes) -> bool:
    """:meth:`ChunkedBody.write_now` on the response's transport itself: for what holds the transport while nothing
    written before waits (a ``streaming.Lane``), so that a plain stream's token reads neither the body nor the
    writer."""
    if transport.get_write_buffer_size() or transport.is_closing():
        return False
    if body:  # an empty chunk would end the body
        transport.write(FRAME % (len(body), body))
    return True


def offer(scope: Scope, cycle: Any) -> None:
    """Put ``cycle``'s :class:`ChunkedBody` in ``scope``'s extensions (the protocol calls it per request)."""
    extensions = scope.get("extensions")
    if extensions is None:
        extensions = scope["extensions"] = {}
    extensions[EXTENSION] = ChunkedBody(cycle)


def told_left(cycle: Any) -> None:
    """Call the ``on_leave`` of ``cycle``'s request (the protocol calls it once the cycle knows its client left)."""
    body = (cycle.scope.get("extensions") or {}).get(EXTENSION)
    if body is not None and body.on_leave is not None:
        leave, body.on_leave = body.on_leave, None
        leave()


def offered(scope: Scope) -> ChunkedBody | None:
    """The extension the server's protocol offered ``scope``'s request (None: another server)."""
    return (scope.get("extensions") or {}).get(EXTENSION)


def chunked_body(scope: Scope) -> ChunkedBody | None:
    """The response's :class:`ChunkedBody` once its status line went with chunked encoding, else None (another
    server, or a response framed otherwise: its chunks go through ``send``)."""
    body = offered(scope)
    return body if body is not None and body.usable() else None
