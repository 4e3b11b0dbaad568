"""What the server knows about the fleet behind it: one ``STATUS`` poll, shared by every route.

Readiness, the 503 decision, the context length that prompts are checked against and the fleet
gauges of ``/metrics`` all come from the coordinator's ``STATUS_REPLY``. Polling it in one
background task (instead of per request) keeps the coordinator's load independent of the HTTP
request rate, and lets a request be refused at once, without a round trip, when the fleet is
stopped or the coordinator cannot be reached.

Whether the coordinator can be reached is a fact the token stream cannot starve: the client's
connection hears from the coordinator with every frame it reads (tokens, results, the answers to
its heartbeats), so a backend that says it is ``connected`` (:class:`.backend.Backend`) is reachable, however
late a ``STATUS_REPLY`` comes. A poll that times out on such a connection makes the fleet *busy*
(the last status stays, requests are accepted, ``/ready`` stays 200), never *unreachable*: under
heavy streaming most polls time out while every stream completes, and new completions were refused
with ``503 coordinator_unreachable`` when a late poll meant unreachable. Only a connection silent for its
``coordinator_timeout`` (5 s), or a backend without that fact whose poll fails, is unreachable.

``/ready`` and ``/metrics`` ask for a fresh status but wait for it at most ``ready_timeout``
(:meth:`FleetMonitor.fresh`, 0.05 s by default): idle, they see a pause at once; under load they
answer from the last status instead of waiting for the loop that the tokens keep busy.

Two answers differ on purpose: a PAUSED or SUSPENDED fleet, or one with no engine that can take a request (none
registered, or all draining), *accepts* requests (they wait for it to run again) but is not *ready* (``/ready`` 503), so that a load balancer sends new traffic to a
replica that serves now, and a pod's readiness says what its clients will see. Before, ``/ready``
was 200 while every chat hung on a paused fleet, and with ``"engines": 0`` while both engine links were cut.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..limits import READY_TIMEOUT, STATUS_INTERVAL, STATUS_TIMEOUT
from ..wire.lifecycle import ENGINE_DRAINING, FleetState
from .backend import Backend

logger = logging.getLogger("megatron_serve.server")

STOPPED = FleetState.STOPPED.value
RUNNING = FleetState.RUNNING.value
#: ``/ready``'s detail on its 200 while a fleet without engines holds requests for the first (server/wake.py).
HELD = ("no engine is registered: requests are held until one registers (scale from zero, "
        "--scale-from-zero-timeout), and the fleet asks for an engine group")


class FleetMonitor:
    """Polls ``backend.status()`` every ``interval`` seconds and keeps the last answer.

    The backend is started here too (``start(timeout)``), in the background and
    without a deadline: a server may come up before its coordinator, and must then answer 503
    and report not-ready until the coordinator appears, instead of failing to start.
    """

    def __init__(self, backend: Backend, interval: float = STATUS_INTERVAL, timeout: float = STATUS_TIMEOUT,
                 connect_grace: float = 2.0, ready_timeout: float = READY_TIMEOUT) -> None:
        for name, value in (("interval", interval), ("timeout", timeout), ("ready_timeout", ready_timeout)):
            if not value > 0:
                raise ValueError(f"the fleet monitor's {name} must be > 0 seconds, got {value!r}")
        self.backend = backend
        self.interval = interval
        self.timeout = timeout
        self.ready_timeout = ready_timeout
        self.connect_grace = connect_grace
        self.status: dict[str, Any] | None = None
        # What every generation request reads of the status (its engines' smallest context limit, their adapters),
        # read once per status, with the status it was read from (see _facts)
        self._read: tuple[dict[str, Any] | None, int | None, dict[str, str] | None] | None = None
        self.reachable = False
        self.busy = False  # the last poll timed out on a connection that still hears the coordinator
        self._refreshing: asyncio.Task | None = None
        self.problem: str | None = "not connected to the coordinator yet"
        self.updated = 0.0
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    def ensure_running(self) -> None:
        """Start polling on the running loop (idempotent; restarts on a new loop)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._first = asyncio.Event()
        self._task = loop.create_task(self._run(), name="megatron-serve-fleet-monitor")

    async def stop(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def wait_first_poll(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until the first poll answered or failed: startup and first requests are then exact."""
        self.ensure_running()
        if self._first.is_set():
            return
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        starting = asyncio.ensure_future(self.backend.start(timeout=float("inf")))
        began = time.monotonic()
        try:
            while not starting.done():
                if time.monotonic() - began > self.connect_grace:
                    self._first.set()  # stop holding the first requests: they get 503 until connected
                await asyncio.wait({starting}, timeout=self.interval)
        finally:
            if not starting.done():
                starting.cancel()
        if starting.exception() is not None:  # e.g. a refused token: retrying cannot help, say what to fix
            self.problem = f"cannot connect to the coordinator: {starting.exception()}"
            self.reachable = False
            self._first.set()
            logger.error("%s", self.problem)
            return
        while True:
            await self.refresh()
            self._first.set()
            await asyncio.sleep(self.interval)

    async def fresh(self) -> None:
        """Refresh, waiting at most ``ready_timeout`` (the probes' path): past it the last status stands, and the
        refresh goes on in the background (one at a time, whoever asked)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh())
        await asyncio.wait({self._refreshing}, timeout=self.ready_timeout)

    async def as_of_now(self) -> None:
        """The probes' wait (``/ready``, ``/metrics``): the first poll, then, while the coordinator answers, a fresh
        status (a fleet paused a moment ago is not ready), or the last one past ``ready_timeout``."""
        await self.wait_first_poll()
        if self.reachable:
            await self.fresh()

    async def refresh(self) -> dict[str, Any] | None:
        """Ask for a fresh status now; on failure the fleet counts as unreachable, or busy (see the module)."""
        try:
            status = await self.backend.status(timeout=self.timeout)
        except asyncio.CancelledError:
            raise
        except (TimeoutError, asyncio.TimeoutError):
            if self.status is not None and self.backend.connected:
                if not self.busy:
                    logger.info("coordinator busy: no status within %gs while it streams; the last one stands "
                                "(--status-timeout)", self.timeout)
                self.busy = True
                return None
            self._unreachable(TimeoutError(f"no status within {self.timeout:g}s"))
            return None
        except Exception as exc:  # closed client, coordinator error, lost coordinator: all mean "cannot serve now"
            self._unreachable(exc)
            return None
        if not self.reachable:
            logger.info("coordinator reachable: fleet %s with %d engine(s)", status.get("state"),
                        len(status.get("engines") or []))
        self.status = status
        self.reachable = True
        self.busy = False
        self.problem = None
        self.updated = time.monotonic()
        return status

    def _unreachable(self, exc: BaseException) -> None:
        if self.reachable:
                logger.warning("coordinator unreachable: %s", str(exc) or type(exc).__name__)
        self.reachable = False
        self.busy = False
        self.problem = f"the coordinator does not answer ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})"

    # ------------------------------------------------------------------ views

    @property
    def state(self) -> str | None:
        return None if self.status is None else str(self.status.get("state"))

    @property
    def engines(self) -> list[dict[str, Any]]:
        return list((self.status or {}).get("engines") or [])

    def asleep(self) -> bool:
        """RUNNING with no engine registered at all (a fleet scaled to zero, not one whose engines drain)."""
        return self.reachable and self.state == RUNNING and not self.engines

    def age(self) -> float:
        """Seconds since the last status answered (infinite before the first): how stale what the views say is."""
        return float("inf") if self.status is None else time.monotonic() - self.updated

    def refusal_reason(self) -> str | None:
        """Why new requests cannot even wait for the fleet (unreachable or stopped), or None."""
        if not self.reachable:
            return self.problem or "the coordinator does not answer"
        if self.state == STOPPED:
            return "the fleet is stopped (megatron-serve control unpause restarts it)"
        return None

    def takers(self) -> int:
        """Engines that can take a request now: registered and not draining (a silent one stays listed until the
        coordinator's heartbeat timeout removes it)."""
        return sum(1 for engine in self.engines if engine.get("state") != ENGINE_DRAINING)

    def not_ready_reason(self) -> str | None:
        """Why requests are not served now (including a fleet that holds them: paused, suspended, or with no engine
        that can take one), or None."""
        reason = self.refusal_reason()
        if reason is None and self.state != RUNNING:
            reason = (f"the fleet is {self.state}: requests wait until it runs again (megatron-serve control "
                      f"{'resume, then unpause' if self.state == FleetState.SUSPENDED.value else 'unpause'})")
        if reason is None and not self.takers():
            listed = len(self.engines)
            reason = ("no engine can take a request: " + (f"all {listed} registered are draining" if listed else
                                                          "none is registered with the coordinator"))
        return reason

    def missing(self) -> list[str]:
        """The parts of the fleet that keep requests from being served now, by name: ``coordinator`` (unreachable),
        ``fleet`` (not RUNNING), ``engines`` (none can take a request)."""
        if not self.reachable:
            return ["coordinator"]
        parts = [] if self.state == RUNNING else ["fleet"]
        return parts if self.takers() else [*parts, "engines"]

    def check_accepting(self) -> None:
        """Raise 503 unless new requests can be accepted (PAUSED and SUSPENDED fleets accept and hold them)."""
        reason = self.refusal_reason()
        if reason is not None:
            from .errors import APIError  # noqa: PLC0415 - FastAPI: not imported by the probe process

            code = "coordinator_unreachable" if not self.reachable else "fleet_stopped"
            raise APIError(503, f"service unavailable: {reason}", code=code, headers={"Retry-After": "5"})

    def adapters(self) -> dict[str, str] | None:
        """The LoRA adapters the engines serve (name -> directory, all engines together); None when no engine
        reports any (none started with LoRA, or none connected yet). Not to be changed: it is kept (see _facts)."""
        return self._facts()[2]

    def max_sequence_length(self) -> int | None:
        """The smallest context limit any engine reported (prompt + generation), if any did."""
        return self._facts()[1]

    def _facts(self) -> tuple[dict[str, Any] | None, int | None, dict[str, str] | None]:
        """The status, its engines' smallest context limit and their adapters, read from the status once: a
        generation request asks for them three to five times (its limits, its model's name, its adapter), each a
        pass over every engine, while the status changes a few times a second at most (each poll is a new one)."""
        status, read = self.status, self._read
        if read is None or read[0] is not status:
            engines = self.engines
            limits = [e.get("info", {}).get("max_sequence_length") for e in engines]
            limits = [int(x) for x in limits if isinstance(x, int) and not isinstance(x, bool) and x > 0]
            reports = [e["loras"] for e in engines if isinstance(e.get("loras"), dict)]
            adapters = None if not reports else {name: path for loras in reports for name, path in loras.items()}
            read = self._read = (status, min(limits) if limits else None, adapters)
        return read

    def totals(self) -> dict[str, int]:
        """Fleet-wide sums for the gauges of ``/metrics``."""
        engines = self.engines
        total = sum(int(e.get("kv_blocks_total") or 0) for e in engines)
        free = sum(int(e.get("kv_blocks_free") or 0) for e in engines)
        status = self.status or {}
        return {
            "engines": len(engines),
            "queued": int(status.get("queued") or 0),
            "in_flight": int(status.get("in_flight") or 0),
            "kv_blocks_total": total,
            "kv_blocks_used": max(total - free, 0),
            "computed_tokens": sum(int(e.get("computed_tokens") or 0) for e in engines),
        }
