"""The engine process's loop (:class:`EngineProcess`) and its entry point (:func:`run_engine_process`); the package
docstring says how the shell is laid out."""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

import zmq

from ...errors import LeftGroup
from ...heap import freeze_startup_heap
from ...wire.lifecycle import FleetState
from ...wire.protocol import Role
from .drain import begin_drain, drain_finished
from .inbox import handle_inbox
from .link import CoordinatorLink
from .shell import Shell
from .verb import on_verb

if TYPE_CHECKING:
    from ..served import ServedEngine

logger = logging.getLogger("megatron_serve.engine_process")

DEFAULT_DRAIN_TIMEOUT = 30.0


class EngineProcess:
    """Drives one engine for the coordinator. ``run()`` returns the process exit code; ``shell`` is where the
    process stands and what its jobs act through (:class:`.shell.Shell`)."""

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
        engine_facts = engine.facts()
        facts = {"pid": os.getpid(), "host": socket.gethostname(), **engine_facts.hello_info(), **(info or {})}
        # what HELLO says of the weights (``model`` at first) and adapters: the engine's verbs keep it current
        engine.serving.attach(facts, urlparse(address).hostname or "", engine.epoch, engine.adapters.names())
        hello = {"role": Role.ENGINE.value, "engine_group": group, "capacity": engine_facts.capacity, "info": facts}
        self.link = CoordinatorLink(address, hello, token=token, heartbeat_interval=heartbeat_interval,
                                    coordinator_timeout=coordinator_timeout)
        self.shell = Shell(engine, self.link, float(drain_timeout))
        self.sigterm = False

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: Any) -> None:
            if self.sigterm:  # second signal: stop waiting
                self.shell.drain_deadline = 0.0
            self.sigterm = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def run(self) -> int:
        shell, engine = self.shell, self.shell.engine
        self.link.start()
        stepped = False
        try:
            while True:
                shell.iterations += 1
                busy = shell.state is FleetState.RUNNING and engine.has_unfinished_requests()
                handle_inbox(shell, timeout=0.0 if busy or stepped else 0.05)
                if shell.fatal:
                    logger.error("%s", shell.fatal)
                    return 1
                if self.sigterm and shell.drain_deadline is None:
                    begin_drain(shell, shell.drain_timeout, "SIGTERM")
                if shell.drain_deadline is not None and drain_finished(shell):
                    return 0
                # data-parallel attention ranks step together while any of them has work (engine.group.data_parallel):
                # an idle one steps too, and does not wait on its inbox meanwhile; a verb that joins them all
                # runs at the turn in which every one holds its copy
                try:
                    turn = engine.group_turn(shell.state is FleetState.RUNNING and engine.has_unfinished_requests(),
                                             shell.held is not None)
                except LeftGroup as left:  # scale-ep: its requests were handed back first
                    logger.warning("%s; exiting", left)
                    return 0
                if shell.held is not None and (turn.verb or shell.held.expired()):
                    verb, shell.held = shell.held, None
                    if turn.verb:
                        on_verb(shell, verb.header, verb.body)
                    else:
                        shell.ack(verb.body.control_id, verb.refusal(engine.epoch))
                stepped = turn.step
                if stepped:
                    shell.step()
                else:
                    engine.idle()
                shell.publish_stats()
        finally:
            self.link.close()


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
