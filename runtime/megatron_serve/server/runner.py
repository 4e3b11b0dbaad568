"""Running an app on uvicorn inside an existing event loop, on a socket bound beforehand.

Binding first (instead of letting uvicorn bind) turns "address in use" into one clear line before
anything else starts, makes ``--port 0`` usable (the caller learns the port), and lets the
caller print the endpoint only once it really listens. uvicorn's own signal handling is switched
off: the commands decide what SIGINT/SIGTERM stop, and in what order.

Added to what uvicorn does: the limits of each connection (:mod:`.connections`), a drain before
the server stops (:mod:`.drain`), then answering what it still holds (a 503, or an error event and
``[DONE]`` mid-stream) before uvicorn closes the connections, and loop errors logged once per burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from typing import Any, Callable, Coroutine, TypeVar

import uvicorn
from fastapi import FastAPI

from ..limits import DEFAULT_KEEP_ALIVE
from .connections import BurstLog, ServerProtocol, default_max_connections, raise_file_limit

logger = logging.getLogger("megatron_serve.server")

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a uvloop event loop (libuv, in C): what ``asyncio.run`` does, with a loop that
    costs less per callback, socket write and timer, as uvicorn and vLLM run their servers."""
    import uvloop  # noqa: PLC0415 - the serving commands only

    return uvloop.run(main)


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


async def serve_app(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None,
                    log_level: str = "warning", on_started: Callable[[str], None] | None = None,
                    stop: asyncio.Event | None = None, graceful_timeout: float = 5.0,
                    read_timeout: float = 60.0, timeout_keep_alive: float = DEFAULT_KEEP_ALIVE,
                    max_connections: int | None = None, drain_timeout: float = 0.0) -> None:
    """Serve ``app`` (made by ``create_app``) until ``stop`` is set or this coroutine is cancelled.

    When ``stop`` is set the server drains for up to ``drain_timeout`` seconds (new requests get
    503, admitted ones finish; see :mod:`.drain`); then, or at once when cancelled, what the app
    still holds is answered with a 503 (or, mid-stream, an error event and ``[DONE]``) before the
    connections close. ``on_started(url)`` runs once the socket accepts connections and the app's
    startup finished. uvicorn logs at ``log_level``, or the app's ``--uvicorn-log-level``
    (``HTTPOptions``) when it has one. ``read_timeout``, ``timeout_keep_alive`` and ``max_connections``
    (default: the open-file limit, raised to its maximum, less a reserve): see :mod:`.connections`.
    """
    if sock is None:
        sock = bind_socket(host, port)
    if max_connections is None:
        max_connections = default_max_connections(raise_file_limit())
    ctx = app.state.ctx
    protocol = functools.partial(ServerProtocol, read_timeout=read_timeout, max_connections=max_connections)
    options = ctx.options  # --uvicorn-log-level wins over log_level; an access log at its request
    level = (options.uvicorn_log_level or log_level).lower()
    access_log = options.access_log and (options.uvicorn_log_level is not None or level == "debug")
    config = uvicorn.Config(app, log_level=level, lifespan="on", access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout, timeout_keep_alive=timeout_keep_alive,
                            http=protocol)  # type: ignore[arg-type]
    server = _Server(config)
    loop = asyncio.get_running_loop()
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(BurstLog().exception_handler)
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
        if not serving.done():
            await ctx.drain.drain(drain_timeout)
    finally:
        ctx.stopping.set()  # held and running requests are answered now, new ones get 503
        server.should_exit = True
        if stop_wait is not None:
            stop_wait.cancel()
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            await serving
        finally:
            sock.close()
            loop.set_exception_handler(previous_handler)
    serving.result()


async def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits the process on a failed startup; here it is an error instead
        raise RuntimeError(f"the HTTP server failed to start (exit code {exc.code}); see the log above") from None
