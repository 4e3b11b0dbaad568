"""The probe port's answers (``--health-port``): ``/health`` and ``/ready`` from facts the token stream cannot starve.

These pieces run in the probe process (:mod:`.probe_process`), beside the server process and not in it:

- the fleet's state comes from :class:`FleetWatch`: a :class:`~.fleet.FleetMonitor` over a
  *control* connection of its own to the coordinator (its own socket and heartbeats), on an event
  loop in a thread of its own, polling every ``--status-interval`` with ``--status-timeout``. A late
  status on a connection that still hears the coordinator is *busy* (200), never *unreachable*;
- whether the server drains, and whether its event loop still turns at all, come from the stamps
  the server sends (:class:`ProbeFacts`): ``/health`` is 503 once none came for
  ``--health-stall-timeout`` (a hung loop is restarted by the liveness probe; a loop seconds late
  under load is busy, and alive), and ``/ready`` once none came for
  :data:`~megatron_serve.limits.READY_STALL_TIMEOUT`: a stopped server process cannot answer the requests a
  load balancer would send it (before, ``/ready`` stayed 200 for the whole 60 s an API server was SIGSTOPped).

The HTTP side (:class:`ProbeServer`) is one thread with a ``selectors`` loop; each answer is a few
dictionary reads. The main port keeps its own ``/health`` and ``/ready``.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from typing import Any, Mapping

from ..client.loop_thread import EventLoopThread
from ..limits import (HEALTH_STALL_TIMEOUT, PROBE_BACKLOG, PROBE_MAX_OPEN, READY_STALL_TIMEOUT, STATUS_INTERVAL,
                      STATUS_TIMEOUT)
from .fleet import HELD, FleetMonitor

logger = logging.getLogger("megatron_serve.server")

#: A probe connection must deliver its request line and headers within this long, else it is closed (a kubelet
#: sends its GET at once, and waits 1 s for the answer by default).
REQUEST_TIMEOUT = 2.0
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
        async def stop() -> None:
            await self.monitor.stop()
            await self.client.aclose()  # its tasks end here, before their loop stops

        self._thread.close(stop())


class ProbeFacts:
    """What the probe port answers from: the fleet watch, and the drain flag and last stamp that the server
    process sends (:mod:`.probe_process`). ``ready_deadline``: seconds without a stamp after which the server process
    counts as not answering, and ``/ready`` is 503 (its main port cannot serve a request meanwhile)."""

    def __init__(self, watch: FleetWatch, stall_timeout: float = HEALTH_STALL_TIMEOUT,
                 ready_deadline: float = READY_STALL_TIMEOUT) -> None:
        self.watch = watch
        self.stall_timeout = stall_timeout
        self.ready_deadline = ready_deadline
        self.draining = False
        self.server_ready = False  # the main port's /ready verdict, from the server's last stamp
        self.holds = False  # the server would hold a request for a first engine (scale from zero on, queue has room)
        self.loop_seen = time.monotonic()

    def health(self) -> tuple[int, dict[str, Any]]:
        silent = time.monotonic() - self.loop_seen
        if silent > self.stall_timeout:
            return 503, {"status": "stalled", "missing": ["server"],
                         "detail": f"the server's event loop has not run for {silent:.0f}s "
                                   f"(--health-stall-timeout {self.stall_timeout:g})"}
        missing = self._missing(silent)
        return 200, {"status": "ok", **({"missing": missing} if missing else {})}  # as the main port's /health

    def ready(self) -> tuple[int, dict[str, Any]]:
        """The main port's ``/ready`` body (``ReadyResponse``), from the watch instead of the main loop; until the
        watch has had a first status, from the main port's verdict (the two ports agree from the start). 503 while
        the server process has sent no stamp for ``ready_deadline`` (stopped, or its loop hung): the facts it
        stamped last are no answer for now."""
        monitor = self.watch.monitor
        silent = time.monotonic() - self.loop_seen
        frozen = (f"the server process has not answered for {silent:.1f}s (its deadline is "
                  f"{self.ready_deadline:g}s): it is stopped or its event loop hangs") if silent > self.ready_deadline \
            else None
        if monitor.status is None and not self.draining:
            detail = frozen or (None if self.server_ready else "the server is not ready (this port's own connection "
                                                               "to the coordinator is not up yet)")
            return (200 if detail is None else 503), {"ready": detail is None, "state": None,
                                                      "coordinator_reachable": self.server_ready, "busy": False,
                                                      "engines": 0, "held": False, "detail": detail,
                                                      "missing": [] if detail is None else ["server"]}
        reachable = monitor.reachable
        detail = frozen or ("this server is shutting down (draining)" if self.draining else None)
        held = detail is None and self.holds and monitor.asleep()
        detail = detail or (HELD if held else monitor.not_ready_reason())
        ready = detail is None or held
        body = {"ready": ready, "state": monitor.state if reachable else None,
                "coordinator_reachable": reachable, "busy": monitor.busy, "engines": len(monitor.engines),
                "held": held, "detail": detail, "missing": self._missing(silent)}
        return (200 if ready else 503), body

    def _missing(self, silent: float) -> list[str]:
        """The parts missing, as the main port names them (``server``: draining, or silent past the deadline)."""
        server = ["server"] if self.draining or silent > self.ready_deadline else []
        return [*self.watch.monitor.missing(), *server] if self.watch.monitor.status is not None else server


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
#: Bytes of request line and headers a probe may send (a kubelet sends about 150).
MAX_REQUEST = 8192


class ProbeServer:
    """``/health`` and ``/ready`` on ``sock`` (bound), served by one thread of its own.

    One ``selectors`` loop, non-blocking sockets, no thread per request and no header parsing beyond
    the request line. Every wake-up accepts all that waits in the backlog; a connection that has not
    sent its request within ``idle_timeout`` is closed, and past ``max_open`` connections the oldest
    is, so idle connections can neither fill the backlog nor the process's files.
    """

    def __init__(self, sock: socket.socket, facts: ProbeFacts, *, idle_timeout: float = REQUEST_TIMEOUT,
                 max_open: int = PROBE_MAX_OPEN) -> None:
        self.socket = sock
        self.facts = facts
        self.idle_timeout = idle_timeout
        self.max_open = max_open
        sock.listen(PROBE_BACKLOG)
        sock.setblocking(False)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="megatron-serve-probe-port", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.socket.getsockname()[1])

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5.0)
        self.socket.close()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.socket, selectors.EVENT_READ)
        started: dict[socket.socket, tuple[float, bytearray]] = {}  # in the order accepted: the oldest first
        try:
            while not self._closing.is_set():
                for key, _events in selector.select(timeout=min(0.5, self.idle_timeout)):
                    if key.fileobj is self.socket:
                        self._accept(selector, started)
                    elif key.fileobj in started:  # not dropped by an accept of this same wake-up
                        self._read(selector, started, key.fileobj)  # type: ignore[arg-type]
                expired = time.monotonic() - self.idle_timeout
                for conn, (began, _) in list(started.items()):
                    if began > expired:
                        break
                    self._drop(selector, started, conn)
        finally:
            for conn in list(started):
                self._drop(selector, started, conn)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, started: dict[socket.socket, tuple[float, bytearray]]) -> None:
        """Every connection waiting in the backlog (the oldest open ones make room past ``max_open``)."""
        while True:
            try:
                conn, _peer = self.socket.accept()
            except OSError:  # none left, or out of files: the next wake-up tries again
                return
            while len(started) >= self.max_open:
                self._drop(selector, started, next(iter(started)))
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ)
            started[conn] = (time.monotonic(), bytearray())

    def _read(self, selector: selectors.BaseSelector, started: dict[socket.socket, tuple[float, bytearray]],
              conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buffer = started[conn][1]
        buffer += data
        if data and b"\r\n\r\n" not in buffer and len(buffer) < MAX_REQUEST:
            return  # more to come
        if data or buffer:
            try:
                conn.send(self._answer(bytes(buffer)))  # a few hundred bytes: the socket's buffer takes them whole
            except OSError:
                pass
        self._drop(selector, started, conn)

    @staticmethod
    def _drop(selector: selectors.BaseSelector, started: dict[socket.socket, tuple[float, bytearray]],
              conn: socket.socket) -> None:
        started.pop(conn, None)
        selector.unregister(conn)
        conn.close()

    def _answer(self, request: bytes) -> bytes:
        """The whole HTTP/1.1 response to ``request`` (request line and headers), closing the connection."""
        parts = request.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            status, body = 400, {"detail": "not an HTTP request"}
        elif parts[0] not in (b"GET", b"HEAD"):
            status, body = 405, {"detail": "the probe port answers GET only"}
        else:
            path = parts[1].split(b"?", 1)[0]
            if path == b"/health":
                status, body = self.facts.health()
            elif path == b"/ready":
                status, body = self.facts.ready()
            else:
                status, body = 404, {"detail": "the probe port answers /health and /ready only"}
        data = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        return head + (b"" if parts and parts[0] == b"HEAD" else data)


def bind_probe_socket(host: str, port: int | None, main_port: int,
                      avoid: Mapping[int, str] | None = None) -> socket.socket | None:
    """The probe port's socket, bound (``--health-port``): ``0`` = none; ``None`` (the default) = the main port
    + 1, or any free port when that one is taken, is one of ``avoid`` (a port another option asked for, by the
    option's name: it may not be bound yet) or the main port is 0; an explicit port that is taken fails."""
    from .runner import bind_socket  # noqa: PLC0415

    if port == 0:
        return None
    if port is not None:
        try:
            return bind_socket(host, port)
        except RuntimeError as exc:
            raise RuntimeError(str(exc).replace("--port", "--health-port")) from None
    wanted = main_port + 1 if 0 < main_port < 65535 else 0
    if wanted and avoid and wanted in avoid:
        logger.warning("the probe port %d (--port + 1) is %s: using a free port (set --health-port)", wanted,
                       avoid[wanted])
        return bind_socket(host, 0)
    try:
        return bind_socket(host, wanted)
    except RuntimeError:
        logger.warning("the probe port %d (--port + 1) is taken: using a free port (set --health-port)", wanted)
        return bind_socket(host, 0)
