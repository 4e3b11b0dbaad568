"""``--api-server-count N``: N HTTP server processes on one port, each with its own coordinator client.

vLLM's answer to a front end that one process cannot keep up with: the HTTP server's CPU per
streamed token (parsing, JSON, server-sent events, detokenizing) is paid by N processes instead of
one. The process that ``run`` or ``server`` started binds and listens, then starts N-1 siblings
that inherit the *listening socket* (its descriptor, not its port): every process accepts from the
same queue, a busy one simply accepts less, and ``--port 0`` works. Each sibling is the ``server``
code path with the same options (API keys, request limits, drain timeout, ...), its own
``InferenceClient`` and its own fleet-status poll; ``--max-concurrent-requests`` is divided among
the N processes (rounded up), so the whole server holds about the limit it was given; the tenants' limits are
kept in one store the N processes share (:mod:`~megatron_serve.server.tenant_budgets`), so each holds exactly.

``/metrics`` stays fleet-wide from any process: with N > 1 the server's own series (requests, HTTP
answers, time per output token, pending requests) are kept in Prometheus' multiprocess files and
summed over the N processes at each scrape (``PROMETHEUS_MULTIPROC_DIR``, a private directory of
the parent); the fleet and engine series come from the coordinator, which every process polls.

Siblings run under the local fleet's :class:`~megatron_serve.fleet.supervisor.Supervisor` (they die
with the parent, a crashed one is restarted) and get the parent's signals, as SIGTERM: the first drains them
with the parent, a second stops them at once, and one still starting ends quietly (SIGTERM's default; a
SIGINT raised ``KeyboardInterrupt`` in whatever it was importing, a traceback). Their log lines go to the
parent's standard error. Each says when it serves, one line on a pipe, and the parent announces the
endpoint only once every sibling has (:meth:`Siblings.wait_ready`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..processes.lifeline import Lifeline
from ..fleet.supervisor import Child, Supervisor
from ..limits import MAIN_BACKLOG

logger = logging.getLogger("megatron_serve.server")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TOKEN_ENV = "MEGATRON_SERVE_TOKEN"


def check_option(args: argparse.Namespace) -> None:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")


def per_process_limit(args: argparse.Namespace) -> int | None:
    """``--max-concurrent-requests`` of one of the ``--api-server-count`` processes (None: no limit)."""
    limit = args.max_concurrent_requests
    return None if limit is None else math.ceil(limit / args.api_server_count)


def share_metrics(count: int) -> Path | None:
    """With more than one API server, a private directory for Prometheus' multiprocess files, set in this
    process's environment (so the siblings inherit it) before any server metric exists; None for one."""
    if count <= 1:
        return None
    directory = Path(tempfile.mkdtemp(prefix="megatron-serve-metrics-"))
    os.environ[MULTIPROC_ENV] = str(directory)
    import prometheus_client.values as values  # noqa: PLC0415 - chosen at import: choose again if imported already

    values.ValueClass = values.get_value_class()
    return directory


#: How long the first process waits for its siblings to serve before it gives up the start.
SIBLINGS_START_TIMEOUT_S = 300.0


class Siblings:
    """The N-1 sibling API servers of this process (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, sock: socket.socket, coordinator: str, token: str | None,
                 metrics_dir: Path) -> None:
        self.args = args
        self.sock = sock
        self.metrics_dir = metrics_dir
        self.directory = Path(tempfile.mkdtemp(prefix="megatron-serve-api-"))
        # Each sibling writes its index and a newline here once it serves (inherited write end; kept open for restarts).
        self._ready_read, self._ready_write = os.pipe()
        os.set_blocking(self._ready_read, False)
        self._ready: set[int] = set()
        self._pending = b""
        spec = self.directory / "spec.pickle"  # the options, read by each sibling once; private to this user
        with open(os.open(spec, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
            pickle.dump({"args": args, "coordinator": coordinator, "fd": sock.fileno(),
                         "ready_fd": self._ready_write}, fh)
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        if token is not None:
            env[TOKEN_ENV] = token
        self.signalled = False  # a stop signal was forwarded: stop() sends none of its own
        self._lifeline = Lifeline()
        self._supervisor = Supervisor(self._lifeline)
        self.spec = spec
        self.children = [Child(f"API server {i}", [sys.executable, "-m", "megatron_serve.commands.api_sibling",
                                                   str(spec), str(i)], None, env,
                               pass_fds=(sock.fileno(), self._ready_write))
                         for i in range(1, args.api_server_count)]

    def start(self) -> None:
        sock = self.sock
        sock.set_inheritable(True)
        sock.listen(MAIN_BACKLOG)  # before any sibling accepts from it
        for child in self.children:
            self._supervisor.start_child(child)
        self._supervisor.restart_dead(True)

    async def wait_ready(self, stop: asyncio.Event) -> bool:
        """Wait until every sibling serves (True), or ``stop`` is set first (False); ``RuntimeError`` after
        ``SIBLINGS_START_TIMEOUT_S``, naming those that do not serve."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def read() -> None:
            try:
                self._pending += os.read(self._ready_read, 4096)
            except BlockingIOError:
                return
            *lines, self._pending = self._pending.split(b"\n")
            self._ready.update(int(line) for line in lines)
            if len(self._ready) == len(self.children):
                ready.set()

        read()
        loop.add_reader(self._ready_read, read)
        waits = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, timeout=SIBLINGS_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(self._ready_read)
            for wait in waits:
                wait.cancel()
        if ready.is_set() or stop.is_set():
            return ready.is_set()
        missing = [child.name for index, child in enumerate(self.children, 1) if index not in self._ready]
        raise RuntimeError(f"{', '.join(missing)} not serving after {SIBLINGS_START_TIMEOUT_S:.0f}s (their errors are "
                           "above)")

    def signal(self, signum: int) -> None:
        """Forward a stop signal as SIGTERM (the first drains, a second stops at once, as in this process; a sibling
        still starting ends quietly, see the module docstring). Restarts end first: a sibling that the signal ends
        is not started again."""
        self._supervisor.restart_dead(False)
        self.signalled = True
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Drain the siblings (SIGTERM, unless a signal was forwarded already), wait up to ``timeout`` seconds for
        them to end, then kill the rest."""
        self._supervisor.restart_dead(False)
        if not self.signalled:
            self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - TimeoutExpired: it had its time
                child.proc.kill()
                child.proc.wait()
        self._supervisor.close()
        self._lifeline.close()
        for fd in (self._ready_read, self._ready_write):
            os.close(fd)
        shutil.rmtree(self.directory, ignore_errors=True)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
