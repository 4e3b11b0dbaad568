"""The probe port (``--health-port``): ``/health`` and ``/ready`` answered by threads of their own.

Under 400 streams on a 2-core host, the main port's probes answered 200 but took 1.1-2.1 s (p50-p99,
docs/benchmarks.md): a probe waits for the event loop that the token flood keeps busy, and a
Kubernetes probe with a 1 s timeout then fails a pod that serves well. Here the probes are answered
off that loop, from facts it cannot starve:

- the fleet's state comes from :class:`FleetWatch`: a :class:`~.fleet.FleetMonitor` over a
  *control* connection of its own to the coordinator (its own socket and heartbeats), on an event
  loop in a thread of its own, polling every ``--status-interval`` with ``--status-timeout``. A late
  status on a connection that still hears the coordinator is *busy* (200), never *unreachable*;
- whether this server drains is read from the app's drain state (a flag, set on the first signal);
- whether the main loop still turns at all: it stamps :attr:`ProbeFacts.loop_seen` every second, and
  ``/health`` is 503 once it has been silent for ``--health-stall-timeout`` (a hung loop is restarted
  by the liveness probe; a loop seconds late under load is busy, and alive).

The HTTP side is the standard library's ``ThreadingHTTPServer``: one thread accepts, one short-lived
thread answers each probe, and each answer is a few dictionary reads, so it needs the GIL only for
a few slices however busy the main thread is. The main port keeps its own ``/health`` and ``/ready``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from ..client.loop_thread import EventLoopThread
from ..limits import HEALTH_STALL_TIMEOUT, STATUS_INTERVAL, STATUS_TIMEOUT
from .fleet import FleetMonitor

logger = logging.getLogger("megatron_serve.server")

#: A probe connection must deliver its request line and headers within this long (a slow client cannot hold a
#: thread longer; a kubelet sends its GET at once).
REQUEST_TIMEOUT = 5.0
LOOP_STAMP_INTERVAL = 1.0


class FleetWatch:
    """The fleet's state as a control connection of its own sees it, kept current by a thread of its own."""

    def __init__(self, address: str, token: str | None, *, interval: float = STATUS_INTERVAL,
                 timeout: float = STATUS_TIMEOUT) -> None:
        from ..client.coordinator_client import InferenceClient  # noqa: PLC0415 - zmq: only when serving

        self.client = InferenceClient(address, token=token, role="control")
        self.monitor = FleetMonitor(self.client, interval=interval, timeout=timeout)
        self._thread = EventLoopThread("megatron-serve-fleet-watch")
        self._thread.loop.call_soon_threadsafe(self.monitor.ensure_running)

    def close(self) -> None:
        """Stop polling, close the connection and the thread (idempotent)."""
        if self._thread.loop.is_closed():
            return

        async def stop() -> None:
            await self.monitor.stop()
            self.client.close()

        try:
            self._thread.run(stop(), timeout=5.0)
        finally:
            self._thread.stop()


class ProbeFacts:
    """What the probe threads read: the fleet watch, the drain flag and the main loop's last stamp."""

    def __init__(self, watch: FleetWatch, draining: Callable[[], bool],
                 stall_timeout: float = HEALTH_STALL_TIMEOUT) -> None:
        self.watch = watch
        self.draining = draining
        self.stall_timeout = stall_timeout
        self.loop_seen = time.monotonic()
        self._stamp: asyncio.TimerHandle | None = None

    def stamp_loop(self) -> None:
        """On the main loop: stamp now and again every second until :meth:`stop_stamping`."""
        self.loop_seen = time.monotonic()
        self._stamp = asyncio.get_running_loop().call_later(LOOP_STAMP_INTERVAL, self.stamp_loop)

    def stop_stamping(self) -> None:
        if self._stamp is not None:
            self._stamp.cancel()

    def health(self) -> tuple[int, dict[str, Any]]:
        silent = time.monotonic() - self.loop_seen
        if silent > self.stall_timeout:
            return 503, {"status": "stalled", "detail": f"the server's event loop has not run for {silent:.0f}s "
                                                        f"(--health-stall-timeout {self.stall_timeout:g})"}
        return 200, {"status": "ok"}

    def ready(self) -> tuple[int, dict[str, Any]]:
        """The main port's ``/ready`` body (``ReadyResponse``), from the watch instead of the main loop."""
        monitor = self.watch.monitor
        reachable = monitor.reachable
        detail = "this server is shutting down (draining)" if self.draining() else monitor.not_ready_reason()
        body = {"ready": detail is None, "state": monitor.state if reachable else None,
                "coordinator_reachable": reachable, "busy": monitor.busy, "engines": len(monitor.engines),
                "detail": detail}
        return (200 if detail is None else 503), body


class _Handler(BaseHTTPRequestHandler):
    server: "ProbeServer"
    timeout = REQUEST_TIMEOUT
    server_version = "megatron-serve-probes"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        facts = self.server.facts
        if path == "/health":
            status, body = facts.health()
        elif path == "/ready":
            status, body = facts.ready()
        else:
            status, body = 404, {"detail": "the probe port answers /health and /ready only"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: probes come every few seconds
        logger.debug("probe port: " + format, *args)


class ProbeServer(ThreadingHTTPServer):
    """``/health`` and ``/ready`` on ``sock`` (bound, not listening), served from a thread of its own."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, sock: socket.socket, facts: ProbeFacts) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.facts = facts
        self.server_activate()  # listen
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="megatron-serve-probe-port", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.socket.getsockname()[1])

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(5.0)


def bind_probe_socket(host: str, port: int | None, main_port: int) -> socket.socket | None:
    """The probe port's socket, bound (``--health-port``): ``0`` = none; ``None`` (the default) = the main port
    + 1, or any free port when that one is taken or the main port is 0; an explicit port that is taken fails."""
    from .runner import bind_socket  # noqa: PLC0415

    if port == 0:
        return None
    if port is not None:
        try:
            return bind_socket(host, port)
        except RuntimeError as exc:
            raise RuntimeError(str(exc).replace("--port", "--health-port")) from None
    wanted = main_port + 1 if 0 < main_port < 65535 else 0
    try:
        return bind_socket(host, wanted)
    except RuntimeError:
        logger.warning("the probe port %d (--port + 1) is taken: using a free port (set --health-port)", wanted)
        return bind_socket(host, 0)


class ProbePort:
    """The probe port of one server process: its fleet watch, its facts and its HTTP server."""

    def __init__(self, sock: socket.socket, address: str, token: str | None, draining: Callable[[], bool], *,
                 interval: float = STATUS_INTERVAL, timeout: float = STATUS_TIMEOUT,
                 stall_timeout: float = HEALTH_STALL_TIMEOUT) -> None:
        self.watch = FleetWatch(address, token, interval=interval, timeout=timeout)
        self.facts = ProbeFacts(self.watch, draining, stall_timeout)
        self.facts.stamp_loop()
        self.server = ProbeServer(sock, self.facts)

    def url(self) -> str:
        from .runner import endpoint_url  # noqa: PLC0415

        return endpoint_url(self.server.socket)

    def close(self) -> None:
        self.facts.stop_stamping()
        self.server.close()
        self.watch.close()
