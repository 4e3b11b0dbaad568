"""Whether the local fleet's coordinator still answers: a hung one is restarted as a dead one is.

A coordinator stopped (SIGSTOP) or spinning in its loop keeps its process and its port, so a supervisor that only
waits for exits never replaces it: a 60-s SIGSTOP under ``run`` cost 1,813 new requests (503) and every stream in
flight, while a killed coordinator was back in 1.7 s (issue 86). The supervisor here asks the coordinator with a
deadline instead: a control connection of its own (its own socket, heartbeats every second and event loop, on a
thread) that the coordinator answers from the same loop that serves requests. Silent for
:data:`COORDINATOR_LIVENESS_TIMEOUT`, it is hung: the supervisor kills it and starts it again, on the same port, as
after a crash; engines register again and clients send their unfinished requests again, well within their
``--coordinator-grace`` (30 s).
"""

from __future__ import annotations

import asyncio
import time

from ..client.loop_thread import EventLoopThread


#: Seconds without a word from the coordinator after which it counts as hung. Above its longest legitimate pause
#: (its loop runs only short handlers: a STATUS of 1,000 engines is milliseconds) and below the clients' 30 s grace.
COORDINATOR_LIVENESS_TIMEOUT = 10.0


class CoordinatorWatch:
    """A control connection to the coordinator at ``address`` and how long it has been silent (:meth:`hung`)."""

    def __init__(self, address: str, token: str | None, deadline: float = COORDINATOR_LIVENESS_TIMEOUT) -> None:
        from ..client.coordinator_client import InferenceClient  # noqa: PLC0415 - zmq: only when supervising

        self.deadline = deadline
        self._since = time.monotonic()  # a watch made after the coordinator's start gives it the deadline from now
        self._heard = float("-inf")  # when the coordinator last said anything (monotonic)
        self.client = InferenceClient(address, token=token, role="control")
        self._thread = EventLoopThread("megatron-serve-coordinator-watch")
        self._thread.loop.call_soon_threadsafe(self._connect)

    def _connect(self) -> None:
        asyncio.ensure_future(self.client.start(timeout=float("inf")))  # it reconnects on its own from then on

    def hung(self, started: float, now: float) -> str | None:
        """Why a coordinator started at ``started`` (monotonic) counts as hung at ``now``, or None: no word from it for
        the deadline, counted from its start when it said nothing since (a restarted one has the deadline to answer), or
        from this watch's making when that came later (``supervise()`` after a start that took long)."""
        silent = self.client.silent_for()
        if silent is not None:
            self._heard = max(self._heard, now - silent)
        # the connection drops after 5 s of silence: the last word counts
        quiet = now - max(self._heard, started, self._since)
        if quiet <= self.deadline:
            return None
        return f"it answered nothing for {quiet:.0f}s (liveness deadline {self.deadline:g}s)"

    def close(self) -> None:
        """Close the connection and stop the thread (idempotent)."""
        self._thread.close(self.client.aclose())
