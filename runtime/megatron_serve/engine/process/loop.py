"""The engine process's loop (:class:`EngineProcess`) and its entry point (:func:`run_engine_process`); the package
docstring says how the shell is laid out."""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlparse

import msgspec
import zmq

from ...errors import EngineGroupLost
from ...heap import freeze_startup_heap
from ...wire.lifecycle import STEPS, FleetState, Step, engine_state_after
from ...wire.body import Body
from ...wire.controls import Control, LoadLora, Refit
from ...wire.deltas import EngineStepOut, RequestDeltaOut
from ...wire.status import KVEvents
from ...wire.protocol import Header, ProtocolError, Role, step_of
from ..output import step_delta, step_messages
from .drain import begin_drain, drain_finished
from .inbox import handle_inbox
from .link import CoordinatorLink
from .stats import publish_stats

if TYPE_CHECKING:
    from ..group.turns import HeldVerb
    from ..served import EngineStepResult, ServedEngine

logger = logging.getLogger("megatron_serve.engine_process")

DEFAULT_DRAIN_TIMEOUT = 30.0


class EngineProcess:
    """Drives one engine for the coordinator. ``run()`` returns the process exit code."""

    def __init__(
        self,
        engine: ServedEngine,
        address: str,
        *,
        token: str | None = None,
        group: int | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 10.0,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.drain_timeout = float(drain_timeout)
        engine_facts = engine.facts()
        facts = {"pid": os.getpid(), "host": socket.gethostname(), **engine_facts.hello_info(), **(info or {})}
        # what HELLO says of the weights (``model`` at first) and adapters: the engine's verbs keep it current
        engine.serving.attach(facts, urlparse(address).hostname or "", engine.epoch, engine.adapters.names())
        hello = {"role": Role.ENGINE.value, "engine_group": group, "capacity": engine_facts.capacity, "info": facts}
        self.link = CoordinatorLink(address, hello, token=token, heartbeat_interval=heartbeat_interval,
                                    coordinator_timeout=coordinator_timeout)
        self.state = FleetState.PAUSED  # until the coordinator says otherwise
        self.session = 0
        self.engine_id: str | None = None
        self.drain_deadline: float | None = None
        self.stop_control_id: Any = None
        self.handback_acked = False
        self.sigterm = False
        self.fatal: str | None = None
        self.steps = 0
        self.iterations = 0  # of the loop in run(): the heartbeat's ``progress``
        self.held: HeldVerb | None = None  # a trainer's refit, until every data-parallel rank holds its copy
        self.stats_at = 0.0  # when the heartbeat's stats were last refreshed

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: Any) -> None:
            if self.sigterm:  # second signal: stop waiting
                self.drain_deadline = 0.0
            self.sigterm = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def run(self) -> int:
        self.link.start()
        stepped = False
        try:
            while True:
                self.iterations += 1
                busy = self.state is FleetState.RUNNING and self.engine.has_unfinished_requests()
                handle_inbox(self, timeout=0.0 if busy or stepped else 0.05)
                if self.fatal:
                    logger.error("%s", self.fatal)
                    return 1
                if self.sigterm and self.drain_deadline is None:
                    begin_drain(self, self.drain_timeout, "SIGTERM")
                if self.drain_deadline is not None and drain_finished(self):
                    return 0
                # data-parallel attention ranks step together while any of them has work (engine.group.data_parallel):
                # an idle one steps too, and does not wait on its inbox meanwhile; a verb that joins them all
                # runs at the turn in which every one holds its copy
                turn = self.engine.group_turn(self.state is FleetState.RUNNING
                                              and self.engine.has_unfinished_requests(), self.held is not None)
                if self.held is not None and (turn.verb or self.held.expired()):
                    verb, self.held = self.held, None
                    if turn.verb:
                        self.on_step(verb.header, verb.body)
                    else:
                        self.ack(verb.body.control_id, verb.refusal(self.engine.epoch))
                stepped = turn.step
                if stepped:
                    self.step()
                else:
                    self.engine.idle()
                self.publish_stats()
        finally:
            self.link.close()

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
        """Refresh what the next heartbeat reports (:func:`.stats.publish_stats`)."""
        publish_stats(self, force)

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
            payload = [RequestDeltaOut(request_id=r.request_id, new_tokens=[], finished=True, request=r.failed(why))
                       for r in self.engine.take_unfinished_requests()]
            self.send(Header.ENGINE_STEP, EngineStepOut(engine_id=self.engine_id, outputs=payload))
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
            for deltas in step_messages([step_delta(out) for out in outputs]):
                self.send(Header.ENGINE_STEP, EngineStepOut(engine_id=self.engine_id, outputs=deltas))

    def on_step(self, header: Header, body: Control) -> None:
        """One lifecycle step at a step boundary: the table says whether it may run now and where it leads, the
        engine does the work (``engine.call``) and says what to acknowledge. STOP is the process's: it drains, and
        acknowledges once drained (:func:`.drain.drain_finished`)."""
        control_id = body.control_id
        try:
            step = step_of(header, body.phase if isinstance(body, (Refit, LoadLora)) else None)
        except ProtocolError as exc:
            self.ack(control_id, {"error": str(exc)})
            return
        spec = STEPS[step]
        self.step(settle=True)
        if self.state not in spec.requires:
            self.ack(control_id, {"error": f"{step.value} needs an engine that is "
                                           f"{' or '.join(sorted(s.value for s in spec.requires))}; "
                                           f"this one is {self.state.value}"})
            return
        if step is Step.STOP:
            self.stop_control_id = control_id
            timeout = body.drain_timeout
            begin_drain(self, self.drain_timeout if timeout is None else float(timeout), "STOP")
            return
        detail = self.engine.call(step, body)
        if "error" not in detail:
            self.state = engine_state_after(step, self.state)
        self.ack(control_id, detail)


def run_engine_process(
    make_engine: Callable[[], ServedEngine],
    address: str,
    **kwargs: Any,
) -> int:
    """Build the engine (slow: model load) and serve; the CLI entry point's body."""
    engine = make_engine()
    freeze_startup_heap()  # torch and the model: out of every later collection's walk (see heap)
    proc = EngineProcess(engine, address, **kwargs)
    proc.install_signal_handlers()
    try:
        return proc.run()
    finally:
        zmq.Context.instance().destroy(linger=2000)  # deliver queued frames before the process ends
