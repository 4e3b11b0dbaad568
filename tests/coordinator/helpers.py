"""Process and polling helpers for the coordinator tests: free ports, children that always die, deadlines."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` (plain or async) until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Children:
    """Every process a test starts; ``kill_all()`` in teardown, whatever happened."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.log_dir / f"{name}-{len(self.procs)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([PY, "-m", "megatron_serve.cli", *args], stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        self.procs.append((proc, log))
        return proc

    def log_of(self, proc: subprocess.Popen) -> str:
        for p, log in self.procs:
            if p is proc:
                return log.read_text(errors="replace")
        return ""

    def coordinator(self, model: str, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn(["coordinator", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra],
                          "coordinator", env)

    def engine(self, model: str, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn(["engine", "--model", model, "--coordinator", f"tcp://127.0.0.1:{port}",
                           "--num-kv-blocks", "64", *extra], "engine", env)

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
