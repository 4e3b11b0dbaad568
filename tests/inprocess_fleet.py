"""An in-process fleet: a real Coordinator and EngineProcess objects over real sockets, with fake engines."""

from __future__ import annotations

import contextlib
import errno
import functools
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Callable

import zmq

from megatron_serve.coordinator import (
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_VERB_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
    Coordinator,
)
from megatron_serve.engine.process.loop import EngineProcess
from megatron_serve.wire.security import make_secret

from .coordinator.fakes import FakeEngine

if TYPE_CHECKING:
    from megatron_serve.client.coordinator_client import InferenceClient


class InProcessFleet:
    """A real Coordinator and EngineProcess objects over real sockets, in threads, with fake engines.

    Fast (no torch, no process start-up): for the state machine, routing and protocol edge cases.
    Secure like every fleet (a fresh secret, ``token``) unless ``insecure``.
    """

    def __init__(self, routing: str = "least_loaded", heartbeat_timeout: float = 10.0,
                 port: int = 0, verb_timeout: float = DEFAULT_VERB_TIMEOUT,
                 weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT, stall_timeout: float = DEFAULT_STALL_TIMEOUT,
                 insecure: bool = False) -> None:
        self.token = None if insecure else make_secret()
        # the coordinator's settings, kept for each (re)start on the same port
        self.new_coordinator: Callable[..., Coordinator] = functools.partial(
            Coordinator, token=self.token, insecure=insecure, routing=routing, heartbeat_timeout=heartbeat_timeout,
            verb_timeout=verb_timeout, weights_timeout=weights_timeout, stall_timeout=stall_timeout)
        self.engines: list[tuple[EngineProcess, FakeEngine, threading.Thread, dict]] = []
        self.coordinator: Coordinator | None = None
        self.thread: threading.Thread | None = None
        self.port = port
        self.start_coordinator()

    def start_coordinator(self, timeout: float = 10.0, setup: Callable[[Coordinator], None] | None = None) -> None:
        """Start a coordinator; on a restart, poll until the old socket has released the port.

        ZeroMQ closes sockets in its I/O thread, so the same port can stay bound for a moment after
        ``close()`` returns (a separate process would not see this: its port dies with it).
        ``setup`` adjusts it before it serves, when no peer can have reached it yet.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.coordinator = self.new_coordinator(port=self.port)
            try:
                self.address = self.coordinator.bind()
                break
            except zmq.ZMQError as exc:
                self.coordinator.close()
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.port = self.coordinator.port
        if setup is not None:
            setup(self.coordinator)
        self.thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self.thread.start()

    @contextlib.asynccontextmanager
    async def connected(self, engines: int) -> AsyncIterator[InferenceClient]:
        """A client of this fleet once ``engines`` engines have registered (20 s at most); closed after."""
        from megatron_serve.client.coordinator_client import InferenceClient  # noqa: PLC0415 - a quarter second

        async with InferenceClient(self.address, token=self.token) as client:
            await client.wait_for_engines(engines, timeout=20, poll=0.02)
            yield client

    def stop_coordinator(self) -> None:
        self.coordinator.shutdown()
        self.thread.join(10)

    def add_engine(self, token: str | None = "<fleet>", group: int | None = None, heartbeat_interval: float = 1.0,
                   fake: FakeEngine | None = None, info: dict | None = None, **fake_kwargs
                   ) -> tuple[EngineProcess, FakeEngine, dict]:
        fake = fake or FakeEngine(**fake_kwargs)
        proc = EngineProcess(fake, self.address, token=self.token if token == "<fleet>" else token, group=group,
                             drain_timeout=5.0, coordinator_timeout=3.0, heartbeat_interval=heartbeat_interval,
                             info=info)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.__setitem__("rc", proc.run()), daemon=True)
        thread.start()
        self.engines.append((proc, fake, thread, result))
        return proc, fake, result

    def stop(self) -> None:
        for proc, _fake, thread, _ in self.engines:
            proc.sigterm = True
        for proc, _fake, thread, _ in self.engines:
            thread.join(15)
        self.stop_coordinator()
