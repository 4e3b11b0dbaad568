"""The ports a ``run`` / ``serve`` stack listens on, chosen and checked together before anything starts.

Three parties bind them at three moments: the HTTP server (``--port``) and the probe port
(``--health-port``, by default ``--port`` + 1) are bound here at once but listen only once the
model has loaded; the coordinator (``--coordinator-port``, by default 5555) binds in a child
process. A socket that is bound but not yet listening does not stop another from binding the same
port (both ask ``SO_REUSEADDR``), so a clash between two of them would only show when the second
one listens, after the model has loaded, as a bare ``Address already in use``. Hence each port is
checked against the others *by number* here: two explicit options that name the same port are
refused in one line that names both, and a default gives way to what an option asked for (the
probe port's ``--port`` + 1 and the coordinator's 5555 take a free port instead).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..wire.protocol import DEFAULT_PORT
from .inputs import check_port_free

#: What each option is for, in the error that refuses two options naming one port.
_ROLES = {"--port": "the HTTP server", "--health-port": "the probe port", "--coordinator-port": "the coordinator"}


@dataclass
class StackPorts:
    """The stack's ports: the HTTP and probe sockets (bound, not listening), the coordinator's port number."""

    http: socket.socket
    probe: socket.socket | None  # None: --health-port 0
    coordinator: int  # 0: any free port, chosen by the coordinator
    coordinator_note: str  # why the coordinator does not listen on 5555, for the start-up line

    def close(self) -> None:
        self.http.close()
        if self.probe is not None:
            self.probe.close()


def check_distinct(ports: dict[str, int | None]) -> None:
    """Refuse two options that name the same port (``None`` = not given, 0 = any free port: never a clash)."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise ValueError(f"{flag} {port} is also {seen[port]}: {_ROLES[flag]} and {_ROLES[seen[port]]} "
                             f"need a port each (choose another {flag})")
        seen[port] = flag


def reserve_ports(host: str, port: int, health_port: int | None, coordinator_port: int | None) -> StackPorts:
    """Bind the HTTP and probe sockets and choose the coordinator's port, each checked against the others.

    An explicit port that is taken, or that another option names too, fails here (``ValueError`` /
    ``RuntimeError`` naming the option); a default that is taken or that an option names takes a
    free port, and says so.
    """
    from ..server.probe_port import bind_probe_socket  # noqa: PLC0415 - keep --help fast
    from ..server.runner import bind_socket  # noqa: PLC0415

    check_distinct({"--port": port, "--health-port": health_port, "--coordinator-port": coordinator_port})
    if coordinator_port is not None:
        check_port_free(host, coordinator_port, "--coordinator-port")
    http = bind_socket(host, port)
    probe = None
    try:
        avoid = {coordinator_port: "--coordinator-port"} if coordinator_port else {}
        probe = bind_probe_socket(host, health_port, port, avoid=avoid)
        bound = {"--port": _port_of(http), **({"--health-port": _port_of(probe)} if probe is not None else {})}
        if coordinator_port is not None:
            # a port 0 above got a free port from the kernel: it may not be the one the coordinator asked for
            check_distinct({**bound, "--coordinator-port": coordinator_port})
            return StackPorts(http, probe, coordinator_port, "")
        taken = {number: flag for flag, number in bound.items()}
        if DEFAULT_PORT in taken:
            return StackPorts(http, probe, 0, f" ({DEFAULT_PORT} is {taken[DEFAULT_PORT]}: using a free port)")
        try:
            check_port_free(host, DEFAULT_PORT, "--coordinator-port")
        except ValueError:
            return StackPorts(http, probe, 0, f" ({DEFAULT_PORT} is taken: using a free port)")
        return StackPorts(http, probe, DEFAULT_PORT, "")
    except BaseException:
        http.close()
        if probe is not None:
            probe.close()
        raise


def _port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])
