"""Where an engine process stands with its coordinator, and the acts every job of its loop shares (:class:`Shell`).

The loop (:class:`~.loop.EngineProcess`) calls its jobs (:mod:`.inbox`, :mod:`.registration`, :mod:`.verb`,
:mod:`.drain`), and each job reads and moves the same few facts (the session, the lifecycle state, a drain under
way) and does the same few things (send, acknowledge, finish a step and report it, refresh the heartbeat). Those
live here, beneath all of them, so that every import in the shell runs one way: the loop imports its jobs, the jobs
import the shell, and the shell imports none of them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import msgspec

from ...errors import EngineGroupLost
from ...wire.lifecycle import FleetState
from ...wire.protocol import Header
from ...wire.status import KVEvents
from ..output import ended_body, step_bodies
from .stats import heartbeat

if TYPE_CHECKING:
    from ...wire.body import Body
    from ..group.turns import HeldVerb
    from ..served import EngineStepResult, ServedEngine
    from .link import CoordinatorLink

logger = logging.getLogger("megatron_serve.engine_process")

STATS_INTERVAL = 0.2  # the heartbeat's figures are refreshed at most this often (heartbeats go once a second)


class Shell:
    """One engine and its link to the coordinator, where the process stands (session, lifecycle state, a drain, a
    held verb, a fatal reason), and what every job of the loop does through them."""

    def __init__(self, engine: ServedEngine, link: CoordinatorLink, drain_timeout: float) -> None:
        self.engine, self.link = engine, link
        self.drain_timeout = drain_timeout  # a drain's length where SIGTERM or a STOP without one starts it
        self.state = FleetState.PAUSED  # until the coordinator says otherwise
        self.session = 0  # the link's registration this process serves (0: none yet)
        self.engine_id: str | None = None
        self.drain_deadline: float | None = None
        self.stop_control_id: Any = None  # the STOP that a drain acknowledges once drained
        self.handback_acked = False
        self.fatal: str | None = None  # why the process must exit, once something says so
        self.held: HeldVerb | None = None  # a trainer's refit, until every data-parallel rank holds its copy
        self.steps = 0
        self.iterations = 0  # of the loop: the heartbeat's ``progress``
        self.stats_at = 0.0  # when the heartbeat's figures were last refreshed
        # protocol 11: each request's client and client request id, where the coordinator named them (its deltas
        # travel in that client's share of a step: engine.output.step_bodies); dropped as the request ends here
        self.routes: dict[str, tuple[str, Any]] = {}

    def send(self, header: Header, body: Body | dict[str, Any]) -> None:
        if self.session:
            self.link.send(header, body, self.session)

    def ack(self, control_id: Any, detail: dict[str, Any]) -> None:
        self.publish_stats(force=True)  # no heartbeat after the ack may carry the old state
        self.send(Header.CONTROL_ACK, {"control_id": control_id, "state": self.state.value, "detail": detail,
                                       "engine_id": self.engine_id})

    def send_kv_events(self, seq: int, payload: bytes) -> None:
        """A batch of the engine's KV events, numbered for this process (the coordinator's KV index reads them)."""
        self.send(Header.KV_EVENTS, KVEvents(engine_id=self.engine_id or "", seq=seq, batch=msgspec.Raw(payload)))

    def publish_stats(self, force: bool = False) -> None:
        """Refresh what the next heartbeat reports (:func:`.stats.heartbeat`), at most every STATS_INTERVAL."""
        self.engine.kv_events.flush()  # what a verb or a step changed in the KV tiers, before the heartbeat says so
        now = time.monotonic()
        if not force and now - self.stats_at < STATS_INTERVAL:
            return
        self.stats_at = now
        self.link.stats = heartbeat(self.engine, self.link.hello["info"], state=self.state,
                                    draining=self.drain_deadline is not None, steps=self.steps,
                                    iterations=self.iterations, kv_sink=self.send_kv_events)

    def step(self, settle: bool = False) -> None:
        """One engine step, or with ``settle`` only the finishing of the step in flight (overlapped scheduling:
        called before a verb or a hand-back acts, so the tokens the device already sampled are delivered)."""
        try:
            outputs = self.engine.sync() if settle else self.engine.step()
        except EngineGroupLost:
            # Stepping again is impossible: exit, so the coordinator re-queues this group's requests.
            logger.exception("engine group lost a rank; exiting so its requests move to other groups")
            raise SystemExit(1) from None
        except Exception as exc:  # an engine bug or device failure: fail what ran, keep serving
            logger.exception("engine step failed")
            why = f"engine step failed: {type(exc).__name__}: {exc}"
            failed = [r.failed(why) for r in self.engine.take_unfinished_requests()]
            self.routes.clear()  # every request it held ended
            self.send(Header.ENGINE_STEP, ended_body(self.engine_id, failed))
            return
        self.steps += 0 if settle else 1
        self._report(outputs)

    def _report(self, outputs: Sequence[EngineStepResult]) -> None:
        """Send one step's outputs to the coordinator: a delta per request, in one message (several when prompt
        scores would make it large: :func:`~..output.step_messages`). A prefilled request's blocks go first, so
        that the coordinator holds them when it reads that the request left this engine."""
        for blocks in self.engine.kv_out(self.engine_id or ""):
            self.send(Header.KV_BLOCKS, blocks)
        if outputs:
            routes = self.routes
            for body in step_bodies(self.engine_id, outputs, routes):
                self.send(Header.ENGINE_STEP, body)
            if routes:
                for out in outputs:
                    if out.finished:
                        routes.pop(out.request_id, None)
