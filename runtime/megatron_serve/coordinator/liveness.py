"""Liveness: who is gone, who hangs, and who must say HELLO again.

* An engine silent for ``heartbeat_timeout`` is removed (its requests re-queued).
* Heartbeats come from a thread of the engine's own, so an engine whose step loop hangs (a stuck
  kernel, a deadlock) keeps heartbeating. It is caught two ways: it misses a verb step's deadline
  (:meth:`VerbRunner.overdue`), or, while the fleet runs with no verb in flight, it has requests and
  its step loop's counter (``progress`` in its heartbeats) has not moved for ``stall_timeout``. Either
  way it is removed and remembered as *unresponsive*: its heartbeats are answered but do not let it
  back in; the first frame from its step loop lets it register again.
* A client silent for 30 s is probed; one gone for ``client_timeout`` is forgotten (its unfinished
  requests aborted, its results dropped).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Protocol

from ..wire.lifecycle import FleetState
from ..wire.handshake import Error
from ..wire.protocol import ErrorCode, Header
from .core_view import CoreView
from .peers import EngineRecord
from .requests import Phase

if TYPE_CHECKING:
    from .verbs.runner import VerbRunner

logger = logging.getLogger("megatron_serve.coordinator")

_UNRESPONSIVE_KEPT = 1024  # connections of engines dropped as unresponsive, remembered
_HELLO_REQUIRED_KEPT = 4096
_CLIENT_SILENCE = 30.0  # probe a client that sent nothing for this long
_SWEEP_INTERVAL = 5.0


class Liveness:
    """What liveness remembers between ticks."""

    def __init__(self) -> None:
        # identity -> engine id of engines removed as unresponsive
        self.unresponsive: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.hello_required_sent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.last_sweep = 0.0

    def drop_unresponsive(self, core: CoreView, engine: EngineRecord, why: str) -> None:
        """Remove an engine whose step loop does not answer, and keep it out until it does."""
        self.unresponsive[engine.identity] = engine.engine_id
        while len(self.unresponsive) > _UNRESPONSIVE_KEPT:
            self.unresponsive.popitem(last=False)
        core.remove_engine(engine, f"{why} (heartbeats alone do not count; kept out until it answers)")

    def unresponsive_frame(self, core: CoreView, identity: bytes, header: Header) -> bool:
        """A frame from an engine removed as unresponsive; True when handled (nothing else to do).

        Its heartbeats are answered, so that its link neither re-registers nor reconnects under a
        new identity, but the engine stays out of the fleet. Any other frame (the late
        acknowledgement, step outputs) comes from its step loop: it works again and is told to HELLO
        again, like an engine presumed lost that comes back (its stale work was re-queued).
        """
        engine_id = self.unresponsive.get(identity)
        if engine_id is None:
            return False
        if header is Header.HEARTBEAT:
            core.send(identity, Header.HEARTBEAT, core.heartbeat())
            return True
        del self.unresponsive[identity]
        logger.info("engine %s, removed as unresponsive, answers again (%s): it may register again",
                    engine_id, header.name)
        return False

    def hello_required(self, core: CoreView, identity: bytes, now: float) -> None:
        """Tell an unknown (but protocol-speaking) peer to HELLO again, at most once a second: in a secure
        fleet only a connection that proved the secret before (a stranger is told nothing)."""
        if core.secret is not None and identity not in core.proven:
            return
        last = self.hello_required_sent.get(identity)
        if last is not None and now - last < 1.0:
            return
        self.hello_required_sent[identity] = now
        self.hello_required_sent.move_to_end(identity)
        while len(self.hello_required_sent) > _HELLO_REQUIRED_KEPT:
            self.hello_required_sent.popitem(last=False)
        core.send(identity, Header.ERROR, Error(code=ErrorCode.HELLO_REQUIRED.value,
                                                message=f"coordinator {core.coordinator_id} does not know this "
                                                        "peer: send HELLO"))


class Watching(CoreView, Protocol):
    """The core as liveness sees it: its view, what liveness remembers, and the verb in flight (whose step has a
    deadline of its own, and which stops the stall clocks)."""

    liveness: Liveness
    verbs: VerbRunner


def expire(core: Watching, now: float) -> None:
    """Everything that a deadline decides, once per tick."""
    for engine in list(core.engines.values()):
        if now - engine.last_seen > core.heartbeat_timeout:
            core.remove_engine(engine, f"no heartbeat for {now - engine.last_seen:.1f}s")
    late = core.verbs.overdue(now)
    if late:
        op = core.verbs.queue[0]
        why = f"did not acknowledge {op.step.value} within {core.verbs.deadline(op):.1f}s"
        for engine in late:
            core.liveness.drop_unresponsive(core, engine, why)
    _expire_stalled(core, now)
    if now - core.liveness.last_sweep > _SWEEP_INTERVAL:
        core.liveness.last_sweep = now
        _sweep_clients(core, now)


def _expire_stalled(core: Watching, now: float) -> None:
    """Remove the engines whose step loop made no progress for ``stall_timeout`` while they have requests.

    The clock runs only while the fleet is RUNNING with no verb in flight (engines do not step
    otherwise, and a verb has its own deadline) and restarts when the loop's counter moves or an
    idle engine gets work. An engine whose last heartbeat did not report the counter (an older
    engine, or one busy registering, e.g. loading the fleet's weights) is never taken for stalled.
    """
    if not _clocks_run(core):
        for engine in core.engines.values():
            engine.stall_clock = now
        return
    for engine in list(core.engines.values()):
        stalled = stalled_for(core, engine, now)
        if stalled > core.stall_timeout:
            core.liveness.drop_unresponsive(core, engine, f"its step loop made no progress for {stalled:.1f}s "
                                                          f"with {engine.load} request(s) assigned")


def _clocks_run(core: Watching) -> bool:
    return core.state is FleetState.RUNNING and not core.verbs.queue


def stalled_for(core: Watching, engine: EngineRecord, now: float) -> float:
    """How long ``engine``'s step loop has made no progress with requests assigned, as the stall clock counts it
    (0 while it does not count: see :func:`_expire_stalled`); ``STATUS_REPLY`` shows it, so that a server's
    liveness probe sees a wedged loop before the coordinator removes the engine at ``stall_timeout``."""
    if not _clocks_run(core) or not engine.assigned or engine.progress is None:
        return 0.0
    return max(now - engine.stall_clock, 0.0)


def _sweep_clients(core: CoreView, now: float) -> None:
    for client in list(core.clients.values()):
        if client.identity is not None and now - client.last_seen > _CLIENT_SILENCE:
            core.probe(client.identity)
        elif client.identity is None and client.offline_since is not None and \
                now - client.offline_since > core.client_timeout:
            aborted = 0
            for key in list(client.requests):
                record = core.flow.table.get(key)
                if record is None:
                    continue
                if record.phase is not Phase.FINISHED:
                    core.flow.abort(record, "client went away")
                    aborted += 1
                core.flow.forget(record)
            core.clients.pop(client.client_id, None)
            logger.warning("client %s gone for more than %.0fs: %d unfinished request(s) aborted and its results "
                           "dropped", client.client_id[:8], core.client_timeout, aborted)
