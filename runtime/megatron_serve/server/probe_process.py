"""The probe port's process: ``/health`` and ``/ready`` answered beside the server process, not inside it.

Under many streams, the main port's probes wait for the event loop, and their tail for the GIL.
Threads in the server process did not fix the tail: a probe needs the GIL, which the server's full
garbage collections hold for hundreds of milliseconds, beside the switch interval that each socket
call may wait for. A process of its own has its own GIL, and answers within milliseconds at the
tail (the figures: docs/design-measurements.md).

:class:`ProbePort` (in the server process) listens on the probe socket, then starts ``python -m
megatron_serve.server.probe_process`` with that socket and the read end of a pipe. Every
``STAMP_INTERVAL`` the server's event loop writes one byte to the pipe: ``r`` (serving, and the main
port's ``/ready`` says ready), ``s`` (serving, not ready or not said) or ``d`` (draining); ``R`` and ``S`` say the
same while the server would hold a request for a first engine (scale from zero is on and its queue has room), so that
the probe port too is ready while its own watch sees a fleet without engines. The probe
process answers ``/ready`` from its own control connection to the coordinator
(:class:`~.probe_port.FleetWatch`) and the last byte; until that connection has had its first status
(the process starts, imports and connects for a second or more after the main port is up), from the
main port's verdict in the last byte, so that the two ports agree from the start. ``/health`` is
answered from when the last byte came (``--health-stall-timeout``). It ignores SIGINT and SIGTERM (the server drains meanwhile, and its
``/ready`` says so) and ends when the pipe does: when the server closes it after its drain, or
dies, whatever kills it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from ..limits import HEALTH_STALL_TIMEOUT, PROBE_BACKLOG, PROBE_MAX_OPEN, STATUS_INTERVAL, STATUS_TIMEOUT

if TYPE_CHECKING:
    from .probe_port import ProbeFacts

logger = logging.getLogger("megatron_serve.server")

TOKEN_ENV = "MEGATRON_SERVE_TOKEN"
#: Seconds between two stamps: a drain shows on ``/ready`` within this long (the probes come every 5-10 s).
STAMP_INTERVAL = 0.5


class ProbePort:
    """The probe port of one server process: its probe process, and the stamps this process's loop sends it.

    Made on the server's running event loop (it stamps from there); ``draining()`` says whether the server
    drains, ``ready()`` (when given) whether the main port's ``/ready`` says ready (both read at each stamp)."""

    def __init__(self, sock: socket.socket, address: str, token: str | None, draining: Callable[[], bool], *,
                 ready: Callable[[], bool] | None = None, holds: Callable[[], bool] | None = None,
                 interval: float = STATUS_INTERVAL,
                 timeout: float = STATUS_TIMEOUT, stall_timeout: float = HEALTH_STALL_TIMEOUT,
                 log_level: str = "WARNING") -> None:
        self.sock = sock
        self._draining = draining
        self._ready = ready
        self._holds = holds
        sock.listen(PROBE_BACKLOG)  # probes queue from now; the probe process answers them once it runs
        read_end, self._stamps = os.pipe()
        os.set_blocking(self._stamps, False)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if token is not None:
            env[TOKEN_ENV] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.server.probe_process", "--socket-fd", str(sock.fileno()),
             "--stamps-fd", str(read_end), "--coordinator", address, "--status-interval", str(interval),
             "--status-timeout", str(timeout), "--health-stall-timeout", str(stall_timeout),
             "--log-level", log_level, *(["--insecure"] if token is None else [])],
            # its own session: a Ctrl-C or a signal to the server's process group would reach it while it still
            # imports (before it ignores them) and print a KeyboardInterrupt; it ends with the pipe either way
            pass_fds=(sock.fileno(), read_end), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)
        self._timer: asyncio.TimerHandle | None = None
        self._stamp()

    def _stamp(self) -> None:
        try:
            os.write(self._stamps, stamp_byte(self._draining(), self._ready, self._holds))
        except BlockingIOError:
            pass  # the probe process is behind: the stamps it has not read yet say as much
        except OSError:  # it ended: say so once, and stop stamping (the probes fail, the kubelet restarts the pod)
            logger.error("the probe process ended (exit code %s): /health and /ready on the probe port do not "
                         "answer", self.proc.poll())
            return
        self._timer = asyncio.get_running_loop().call_later(STAMP_INTERVAL, self._stamp)

    def url(self) -> str:
        from .runner import endpoint_url  # noqa: PLC0415

        return endpoint_url(self.sock)

    async def aclose(self) -> None:
        """Stop stamping and end the probe process (the pipe's end is its signal); idempotent."""
        if self.sock.fileno() == -1:
            return
        if self._timer is not None:
            self._timer.cancel()
        os.close(self._stamps)
        try:
            await asyncio.to_thread(self.proc.wait, 10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.sock.close()


def stamp_byte(draining: bool, ready: Callable[[], bool] | None, holds: Callable[[], bool] | None = None) -> bytes:
    """The byte a stamp carries (see the module docstring)."""
    if draining:
        return b"d"
    byte = b"r" if ready is not None and ready() else b"s"
    return byte.upper() if holds is not None and holds() else byte


def read_stamps(data: bytes, facts: "ProbeFacts") -> None:
    """What the last of the stamps in ``data`` says, into ``facts``."""
    facts.loop_seen = time.monotonic()
    last = data[-1:]
    facts.draining = last == b"d"
    facts.server_ready = last.lower() == b"r"
    facts.holds = last.isupper()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_serve.server.probe_process")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--stamps-fd", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--status-interval", type=float, default=STATUS_INTERVAL)
    parser.add_argument("--status-timeout", type=float, default=STATUS_TIMEOUT)
    parser.add_argument("--health-stall-timeout", type=float, default=HEALTH_STALL_TIMEOUT)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s probe port: %(message)s")
    _files_for_probes()
    from .probe_port import FleetWatch, ProbeFacts, ProbeServer  # noqa: PLC0415

    watch = FleetWatch(args.coordinator, None if args.insecure else os.environ.get(TOKEN_ENV),
                       interval=args.status_interval, timeout=args.status_timeout)
    facts = ProbeFacts(watch, args.health_stall_timeout)
    server = None
    try:
        with os.fdopen(args.stamps_fd, "rb", buffering=0) as stamps:
            # The first stamp (written when the server made this process) is read before the first probe, queued
            # meanwhile, is answered: it carries the main port's verdict that /ready gives until the watch is up.
            while data := stamps.read(64):
                read_stamps(data, facts)
                if server is None:
                    server = ProbeServer(socket.socket(fileno=args.socket_fd), facts)
    finally:
        if server is not None:
            server.close()
        watch.close()
    return 0


def _files_for_probes() -> None:
    """Raise this process's open-file limit so that ``PROBE_MAX_OPEN`` probe connections fit beside its own files (a
    soft limit of 1,024 is common; the hard limit is the most an unprivileged process may take)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = PROBE_MAX_OPEN + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard),
                                                    hard))


if __name__ == "__main__":
    sys.exit(main())
