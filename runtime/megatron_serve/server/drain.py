"""Draining: a server that is asked to stop finishes what it admitted before it answers the rest with 503.

vLLM and KServe stop the same way: on the first SIGINT/SIGTERM (a pod's stop, after its
``preStop``), admission stops: new requests get a 503 with ``Retry-After`` and ``/ready`` turns 503,
so that load balancers send them elsewhere. Requests already admitted, streams included, run to
their end for up to ``--drain-timeout`` seconds; whatever still runs then ends with a 503 (or, in a
stream, an error event and ``[DONE]``), as does everything at once on a second signal. Before, the
first signal ended every request within 2 s, whatever the drain timeout said.

:class:`Admission` is the ASGI middleware that counts the admitted requests (until their last byte
is sent, streams included) and refuses new ones while draining; probes and metrics always pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import shutting_down

logger = logging.getLogger("megatron_serve.server")

#: Paths that are never refused nor waited for: probes (the RL frameworks' liveness probes too: TRL's and
#: prime-rl's) and the metrics scrape.
ALWAYS_ANSWERED = frozenset({"/health", "/ready", "/metrics", "/health/", "/liveness"})


class Stopping(asyncio.Event):
    """Set when the server stops (what it holds is answered with 503 at once); a request that must learn it
    registers a callback (:meth:`on_set`) instead of a task that waits on the event: two such tasks per request
    (the wait for the answer, the stream) were two task creations, wake-ups and cancellations each time."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: set[Callable[[], None]] = set()

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        for callback in self._callbacks:  # on the loop's next turn, as a task waiting on the event would wake
            asyncio.get_running_loop().call_soon(self._fire, callback)

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once, soon after the event is set (soon, when it is set already), unless the returned
        function was called first."""
        self._callbacks.add(callback)
        if self.is_set():
            asyncio.get_running_loop().call_soon(self._fire, callback)
        return lambda: self._callbacks.discard(callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.discard(callback)
            callback()


class DrainState:
    """Whether the server drains, and how many admitted requests are still being answered."""

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def finish(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Stop admission and wait up to ``timeout`` seconds for the admitted requests; returns how many remain."""
        self.draining.set()
        if not self.in_flight or timeout <= 0:
            return self.in_flight
        began = time.monotonic()
        logger.warning("draining: new requests are refused; waiting up to %gs for %d request(s) in flight "
                       "(--drain-timeout; a second signal stops at once)", timeout, self.in_flight)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d request(s) still in flight after %.1fs end with an error",
                           self.in_flight, time.monotonic() - began)
        else:
            logger.warning("drained: every request finished within %.1fs", time.monotonic() - began)
        return self.in_flight


class Admission:
    """ASGI middleware: counts admitted requests, and refuses new ones (503, ``Retry-After``) while draining."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self.state.draining.is_set():
            await shutting_down().response()(scope, receive, send)
            return
        self.state.admit()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.finish()

