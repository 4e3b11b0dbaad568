"""Running an app on uvicorn inside an existing event loop, on a socket bound beforehand.

Binding first (instead of letting uvicorn bind) turns "address in use" into one clear line before
anything else starts, makes ``--port 0`` usable (the caller learns the port), and lets the
caller print the endpoint only once it really listens. uvicorn's own signal handling is switched
off: the commands decide what SIGINT/SIGTERM stop, and in what order.

Two things uvicorn does not do are added here: a deadline for each request to arrive
(:class:`ReadTimeoutProtocol`), and, when the server stops, answering what it still holds (a 503,
or an error event and ``[DONE]`` mid-stream) before uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
from typing import Any, Callable

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

logger = logging.getLogger("megatron_serve.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); ``RuntimeError`` says what to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only then, and without it
    # every keep-alive response waits for the client's delayed ACK (~40 ms) between headers and body.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port or --host)") \
            from None
    return sock


def endpoint_url(sock: socket.socket) -> str:
    """``http://host:port`` a local user can open (``0.0.0.0`` shown as ``127.0.0.1``)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class _Server(uvicorn.Server):
    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for every request to arrive whole.

    uvicorn bounds the idle time between requests (keep-alive), but not the time one request
    takes to arrive: a client that sends its headers or its body a byte at a time holds a
    connection for as long as it likes. Here a request must be complete ``read_timeout`` seconds
    after its first byte; otherwise the client gets a 408 (when nothing was answered yet) and the
    connection is closed. This also bounds how long the rest of an upload that already got its
    413 is read and discarded. Malformed HTTP gets its 400 in the OpenAI error shape, like every
    other answer of the server.
    """

    def __init__(self, *args: Any, read_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None:  # the first byte of a request
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        super().data_received(data)
        if not self._request_arriving():
            self._cancel_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def _request_arriving(self) -> bool:
        """A request has begun but not fully arrived: its headers are partial, or its body is."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None  # None: headers still arriving
        logger.debug("closing a connection from %s: its request did not arrive within %.1fs (--read-timeout)",
                     self.client, self.read_timeout)
        if cycle is None or not cycle.response_started:
            error = APIError(408, f"the request did not arrive within {self.read_timeout:g}s (the server's read "
                                  "timeout)", code="request_timeout")
            self.transport.write(_raw_response(408, "Request Timeout", error))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app sees the client gone; whatever it sends is dropped
            cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_response(400, "Bad Request", APIError(400, f"invalid HTTP request: {msg}",
                                                                        code="invalid_http")))
        self.transport.close()


def _raw_response(status: int, reason: str, error: APIError) -> bytes:
    """A complete HTTP/1.1 response carrying ``error``, for answers written below the ASGI app."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def serve_app(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None,
                    log_level: str = "warning", on_started: Callable[[str], None] | None = None,
                    stop: asyncio.Event | None = None, graceful_timeout: float = 5.0,
                    read_timeout: float = 60.0) -> None:
    """Serve ``app`` (made by ``create_app``) until ``stop`` is set or this coroutine is cancelled, then
    shut down gracefully: what the app still holds is answered with a 503 (or, mid-stream, an error
    event and ``[DONE]``) before the connections close.

    ``on_started(url)`` runs once the socket accepts connections and the app's startup finished.
    uvicorn logs at ``log_level``, or the app's ``--uvicorn-log-level`` (``HTTPOptions``) when it has one.
    ``read_timeout``: see :class:`ReadTimeoutProtocol`.
    """
    if sock is None:
        sock = bind_socket(host, port)
    protocol = functools.partial(ReadTimeoutProtocol, read_timeout=read_timeout)
    options = app.state.ctx.options  # --uvicorn-log-level wins over log_level; an access log at its request
    level = (options.uvicorn_log_level or log_level).lower()
    access_log = options.access_log and (options.uvicorn_log_level is not None or level == "debug")
    config = uvicorn.Config(app, log_level=level, lifespan="on", access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout, http=protocol)  # type: ignore[arg-type]
    server = _Server(config)
    serving = asyncio.ensure_future(_run(server, sock))
    stop_wait = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        while not server.started:
            if serving.done():
                break
            await asyncio.sleep(0.02)
        if server.started and on_started is not None:
            on_started(endpoint_url(sock))
        waiters = {serving} | ({stop_wait} if stop_wait is not None else set())
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        app.state.ctx.stopping.set()  # held and running requests are answered now, new ones get 503
        server.should_exit = True
        if stop_wait is not None:
            stop_wait.cancel()
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            await serving
        finally:
            sock.close()
    serving.result()


async def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits the process on a failed startup; here it is an error instead
        raise RuntimeError(f"the HTTP server failed to start (exit code {exc.code}); see the log above") from None
