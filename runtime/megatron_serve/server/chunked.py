"""Writing a streamed answer's events straight into uvicorn's connection, as HTTP/1.1 chunks.

Every event of a stream went through uvicorn's ASGI ``send``: a message dict per event, a coroutine
call, the checks of a response that has not started, and a list joined per chunk. That was the
largest Python cost per streamed token left in the HTTP server's profile after the middleware was
bypassed (``RequestResponseCycle.send``, 17% of the event loop's samples at 64 streams, the write
system call included). :class:`ChunkedWriter` keeps what that ``send`` does for a body chunk of a
started, chunked response (wait while the transport's buffer is full; nothing once the client left)
and writes the chunk's framing and bytes in one ``transport.write``.

Only uvicorn's httptools protocol is written this way, and only once the status line went through
``send`` with chunked transfer encoding; any other server, or a response uvicorn frames otherwise,
gets ``None`` and its events go through ``send`` as before. The end of the body still goes through
``send``, so uvicorn's own bookkeeping (response complete, keep-alive) is untouched.
"""

from __future__ import annotations

from typing import Any

#: The one ASGI server protocol whose connection state this module reads (uvicorn with httptools).
_HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl"


class ChunkedWriter:
    """Body chunks of one started, chunked uvicorn response (see the module docstring)."""

    __slots__ = ("_cycle", "_transport", "_flow")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    def ready(self) -> bool:
        """A chunk written now goes out as :meth:`write` would send it, without waiting: the transport's buffer
        has room and the client is still there."""
        cycle = self._cycle
        return not (self._flow.write_paused or cycle.disconnected or cycle.response_complete
                    or self._transport.is_closing())

    def write_now(self, body: bytes) -> None:
        """One chunk of ``body`` written at once; only when :meth:`ready` said so (the chunks of one
        stream's piece may go a little past the buffer's mark, as asyncio allows)."""
        if body:  # an empty chunk would end the body
            self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    async def write(self, body: bytes) -> None:
        """One chunk of ``body`` (not empty), as uvicorn's ``send`` writes ``{"body": body, "more_body": True}``."""
        cycle = self._cycle
        if not body:  # an empty chunk would end the body: uvicorn's send writes nothing for it either
            return
        if self._flow.write_paused and not cycle.disconnected:
            await self._flow.drain()
        if cycle.disconnected or cycle.response_complete:
            return
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))


def chunked_writer(send: Any) -> ChunkedWriter | None:
    """A :class:`ChunkedWriter` under ``send`` (uvicorn's httptools ``send`` of a response whose status line
    went with chunked transfer encoding), or None: then ``send`` itself writes each event."""
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ != _HTTPTOOLS_CYCLE:
        return None
    if not (getattr(cycle, "response_started", False) and getattr(cycle, "chunked_encoding", None) is True):
        return None
    if cycle.scope.get("method") == "HEAD" or getattr(cycle, "transport", None) is None:
        return None
    return ChunkedWriter(cycle)
