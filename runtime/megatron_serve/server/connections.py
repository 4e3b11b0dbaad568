"""What one HTTP connection may hold, and how many the server keeps open: the limits below the ASGI app.

uvicorn bounds the idle time between two requests of a connection (``timeout_keep_alive``), but not
the time before the first one, nor how many connections are open, nor how long one request takes
to arrive. Each let a client hold the server's resources for free: 1,000 idle TCP connections were
never closed, and 20,400 exhausted the process's 20,000 open files: ``/health`` timed out and
asyncio logged a traceback per failed ``accept()`` (577,535 of them, 256 MB, in 45 s), until the
client closed them. :class:`ServerProtocol` adds, per connection:

* an idle deadline from the moment it opens (``FIRST_REQUEST_IDLE``, 30 s, or ``timeout_keep_alive`` when
  shorter): a connection that sends nothing is closed; between two requests the deadline is
  ``timeout_keep_alive`` (130 s by default, longer than clients and proxies keep idle connections:
  see :data:`~megatron_serve.limits.DEFAULT_KEEP_ALIVE`);
* a read deadline (``read_timeout``): a request must arrive whole within it of its first byte,
  else a 408 (a client sending a byte at a time cannot hold a connection for as long as it likes);
* a cap (``max_connections``) below the open-file limit: past it a new connection gets a 503 with
  ``Retry-After`` and is closed at once, so ``accept()`` never runs out of file descriptors.

:class:`BurstLog` makes what still goes wrong in bursts one log line per burst, not one per event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..limits import FIRST_REQUEST_IDLE
from .chunked import offer, told_left
from .errors import APIError

logger = logging.getLogger("megatron_serve.server")

#: Open files kept for everything but client connections (coordinator sockets, tokenizer files, logs, threads).
RESERVED_FILES = 128


def raise_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (as vLLM does); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # not allowed here: the soft limit stays what it was
            pass
    return soft


def default_max_connections(file_limit: int) -> int:
    """The connection cap for a process with ``file_limit`` open files: all but a reserve (at least 16)."""
    return max(16, file_limit - max(RESERVED_FILES, file_limit // 10))


class ServerProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the idle deadline from the first moment, the read deadline and the cap.

    httptools (llhttp, in C) rather than h11 (pure Python): parsing requests and framing each
    streamed chunk was the largest share of the server's CPU per token in the profile of issue 38.
    """

    def __init__(self, *args: Any, read_timeout: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arriving: str | None = None  # "headers" or "body" while a request arrives, else None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            error = APIError(503, f"the server has {self.max_connections} connections open, its limit; retry shortly",
                             code="too_many_connections")
            transport.write(raw_response(503, "Service Unavailable", error, {"retry-after": "1"}))
            transport.close()
            _refused.record("connection refused: the server is at its limit of open connections (--max-connections)")
            return
        # Idle from the start: uvicorn's keep-alive timer only starts after a first response.
        self.timeout_keep_alive_task = self.loop.call_later(min(self.timeout_keep_alive, FIRST_REQUEST_IDLE),
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None:  # the first byte of a request
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        super().data_received(data)
        if not self._request_arriving():
            self._cancel_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        self._unset_keepalive_if_required()
        super().connection_lost(exc)
        self._tell_left()

    def _tell_left(self) -> None:
        """The current request's client left: its :class:`~.chunked.ChunkedBody` tells it (``on_leave``)."""
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            told_left(cycle)

    def on_message_begin(self) -> None:
        self._arriving = "headers"
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._arriving = "body"
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # a request (not an upgrade): its streamed body's writer
            offer(self.scope, cycle)

    def on_message_complete(self) -> None:
        self._arriving = None
        super().on_message_complete()

    def _request_arriving(self) -> bool:
        """A request has begun but not fully arrived: its headers are partial, or its body is."""
        return self._arriving is not None

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._arriving == "body" else None  # None: headers still arriving
        logger.debug("closing a connection from %s: its request did not arrive within %.1fs (--read-timeout)",
                     self.client, self.read_timeout)
        if cycle is None or not cycle.response_started:
            error = APIError(408, f"the request did not arrive within {self.read_timeout:g}s (the server's read "
                                  "timeout)", code="request_timeout")
            self.transport.write(raw_response(408, "Request Timeout", error))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app sees the client gone; whatever it sends is dropped
            cycle.message_event.set()
            told_left(cycle)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(raw_response(400, "Bad Request", APIError(400, f"invalid HTTP request: {msg}",
                                                                       code="invalid_http")))
        self.transport.close()


def raw_response(status: int, reason: str, error: APIError, headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 response carrying ``error``, for answers written below the ASGI app."""
    body = json.dumps(error.body()).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class BurstLog:
    """One warning when a kind of event starts, one line with the count when its burst ends.

    A burst ends after ``quiet`` seconds without that kind of event. Used for refused connections
    and as the event loop's exception handler, where a failing ``accept()`` (the process out of
    file descriptors) used to log a traceback per attempt, thousands per second.
    """

    def __init__(self, quiet: float = 10.0) -> None:
        self.quiet = quiet
        self._bursts: dict[str, list[float]] = {}  # kind -> [events since its first line, time of the last]
        self._timer: asyncio.TimerHandle | None = None

    def record(self, kind: str, exc: BaseException | None = None) -> None:
        """One event of ``kind``; the first of a burst is logged (with ``exc``'s traceback, if given)."""
        now = time.monotonic()
        burst = self._bursts.get(kind)
        if burst is None:
            self._bursts[kind] = [0, now]
            logger.warning("%s (more of the same are counted, not logged, until %gs pass without one)", kind,
                           self.quiet, exc_info=exc)
        else:
            burst[0] += 1
            burst[1] = now
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is None and self._bursts:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.quiet, self._close_bursts)
            except RuntimeError:  # no loop running (a test): the next record() closes what ended
                pass

    def _close_bursts(self) -> None:
        self._timer = None
        now = time.monotonic()
        for kind, (count, last) in list(self._bursts.items()):
            if now - last >= self.quiet:
                del self._bursts[kind]
                if count:
                    logger.warning("%s: %d more in the burst that ended %gs ago", kind, count, self.quiet)
        self._schedule()

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """For ``loop.set_exception_handler``: errors of the loop's own machinery, one line per burst each."""
        exc = context.get("exception")
        kind = str(context.get("message") or "event loop error")
        if exc is not None:
            kind += f": {type(exc).__name__}{f' errno {exc.errno}' if isinstance(exc, OSError) else ''}"
        self.record(kind, exc)


#: Refused connections of this process (every server shares it: the limit is the process's).
_refused = BurstLog()
