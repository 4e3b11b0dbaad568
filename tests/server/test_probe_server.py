"""The probe port's HTTP side under idle connections: a probe is answered however many connections sit idle on
the port, and idle ones are closed.

Before, the listen backlog was 64 (a connection past it had its SYN dropped and waited 1 s for the retry, a
kubelet's whole timeout), idle connections were held 5 s, and nothing bounded how many the probe process held.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Any

import pytest

from megatron_serve.server.probe_port import ProbeServer

pytestmark = pytest.mark.timeout(120)


class Facts:
    """What the probe server answers from; ``hold`` (while set) keeps its one thread inside ``/health``."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.released = threading.Event()
        self.inside = threading.Event()

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.hold.is_set():
            self.inside.set()
            self.released.wait(60)
        return 200, {"status": "ok"}

    def ready(self) -> tuple[int, dict[str, Any]]:
        return 200, {"ready": True}


def serve(facts: Facts, **options: Any) -> ProbeServer:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return ProbeServer(sock, facts, **options)  # type: ignore[arg-type]


def probe(port: int, path: str = "/health") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    return answer


def idle_connections(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]


def test_a_probe_is_answered_past_any_number_of_idle_connections():
    """Idle connections past ``max_open`` make room (the oldest go) instead of keeping the probe out until they
    time out: with a 60 s idle timeout, the probe is answered while they are all still there to be closed."""
    server = serve(Facts(), idle_timeout=60.0, max_open=32)
    idle = idle_connections(server.port, 200)
    try:
        assert probe(server.port).startswith(b"HTTP/1.1 200 OK")
        closed = 0
        for conn in idle[:100]:  # the oldest were closed by the server to make room
            conn.settimeout(10)
            closed += conn.recv(1) == b""
        assert closed == 100
    finally:
        for conn in idle:
            conn.close()
        server.close()


def test_idle_connections_are_closed_after_the_idle_timeout():
    server = serve(Facts(), idle_timeout=0.2)
    try:
        conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        started = time.monotonic()
        assert conn.recv(1) == b""  # closed by the server, long before the client's own 30 s
        assert time.monotonic() - started < 25
        conn.close()
        assert probe(server.port).startswith(b"HTTP/1.1 200 OK")  # and the port still answers
    finally:
        server.close()


def test_connections_wait_in_a_deep_backlog_while_the_probe_thread_is_busy():
    """While the probe thread is inside an answer, new connections complete their handshake in the listen backlog
    (past a backlog of 64 their SYNs were dropped: the client retried after 1 s, 3 s, ...) and are answered after."""
    facts = Facts()
    server = serve(facts)
    facts.hold.set()
    first = threading.Thread(target=probe, args=(server.port,), daemon=True)
    first.start()
    assert facts.inside.wait(30)
    waiting = []
    try:
        for _ in range(300):
            conn = socket.socket()
            conn.setblocking(False)
            assert conn.connect_ex(("127.0.0.1", server.port)) in (0, errno.EINPROGRESS)
            waiting.append(conn)
        deadline = time.monotonic() + 10
        pending = list(waiting)
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
                       or not _connected(c)]
            time.sleep(0.05)
        assert not pending, f"{len(pending)} of 300 connections were not taken into the backlog"
    finally:
        facts.released.set()
        first.join(30)
        for conn in waiting:
            conn.close()
        server.close()


def _connected(conn: socket.socket) -> bool:
    try:
        conn.getpeername()
    except OSError:
        return False
    return True
