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
from typing import TYPE_CHECKING

from ..wire.lifecycle import FleetState
from ..wire.handshake import Error
from ..wire.protocol import ErrorCode, Header
from .deadlines import Deadlines
from .effects import Outbox
from .flow import RequestFlow
from .lifecycle import Lifecycle
from .membership import Membership, RemoveEngine
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
    """Liveness over the fleet's members (see the module docstring): the deadlines, what it remembers between ticks,
    and the verb in flight (whose step has a deadline of its own, and which stops the stall clocks)."""

    def __init__(self, *, members: Membership, lifecycle: Lifecycle, deadlines: Deadlines, flow: RequestFlow,
                 verbs: VerbRunner, outbox: Outbox, remove_engine: RemoveEngine) -> None:
        self.members, self.lifecycle, self.deadlines, self.flow = members, lifecycle, deadlines, flow
        self.verbs, self.outbox, self.remove_engine = verbs, outbox, remove_engine
        # identity -> engine id of engines removed as unresponsive
        self.unresponsive: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.hello_required_sent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.last_sweep = 0.0

    def drop_unresponsive(self, engine: EngineRecord, why: str) -> None:
        """Remove an engine whose step loop does not answer, and keep it out until it does."""
        self.unresponsive[engine.identity] = engine.engine_id
        while len(self.unresponsive) > _UNRESPONSIVE_KEPT:
            self.unresponsive.popitem(last=False)
        self.remove_engine(engine, f"{why} (heartbeats alone do not count; kept out until it answers)")

    def unresponsive_frame(self, identity: bytes, header: Header) -> bool:
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
            self.outbox.send(identity, Header.HEARTBEAT, self.lifecycle.heartbeat())
            return True
        del self.unresponsive[identity]
        logger.info("engine %s, removed as unresponsive, answers again (%s): it may register again",
                    engine_id, header.name)
        return False

    def hello_required(self, identity: bytes, now: float) -> None:
        """Tell an unknown (but protocol-speaking) peer to HELLO again, at most once a second: in a secure
        fleet only a connection that proved the secret before (a stranger is told nothing)."""
        if self.members.secret is not None and identity not in self.members.proven:
            return
        last = self.hello_required_sent.get(identity)
        if last is not None and now - last < 1.0:
            return
        self.hello_required_sent[identity] = now
        self.hello_required_sent.move_to_end(identity)
        while len(self.hello_required_sent) > _HELLO_REQUIRED_KEPT:
            self.hello_required_sent.popitem(last=False)
        self.outbox.send(identity, Header.ERROR, Error(
            code=ErrorCode.HELLO_REQUIRED.value,
            message=f"coordinator {self.lifecycle.coordinator_id} does not know this peer: send HELLO"))

    def expire(self, now: float) -> None:
        """Everything that a deadline decides, once per tick."""
        for engine in list(self.members.engines.values()):
            if now - engine.last_seen > self.deadlines.heartbeat:
                self.remove_engine(engine, f"no heartbeat for {now - engine.last_seen:.1f}s")
        late = self.verbs.overdue(now)
        if late:
            op = self.verbs.queue[0]
            why = f"did not acknowledge {op.step.value} within {self.verbs.deadline(op):.1f}s"
            for engine in late:
                self.drop_unresponsive(engine, why)
        self._expire_stalled(now)
        if now - self.last_sweep > _SWEEP_INTERVAL:
            self.last_sweep = now
            self._sweep_clients(now)


    def _expire_stalled(self, now: float) -> None:
        """Remove the engines whose step loop made no progress for ``stall_timeout`` while they have requests.

        The clock runs only while the fleet is RUNNING with no verb in flight (engines do not step
        otherwise, and a verb has its own deadline) and restarts when the loop's counter moves or an
        idle engine gets work. An engine whose last heartbeat did not report the counter (an older
        engine, or one busy registering, e.g. loading the fleet's weights) is never taken for stalled.
        """
        if not self._clocks_run():
            for engine in self.members.engines.values():
                engine.stall_clock = now
            return
        for engine in list(self.members.engines.values()):
            stalled = self.stalled_for(engine, now)
            if stalled > self.deadlines.stall:
                self.drop_unresponsive(engine, f"its step loop made no progress for {stalled:.1f}s "
                                                              f"with {engine.load} request(s) assigned")


    def _clocks_run(self) -> bool:
        return self.lifecycle.state is FleetState.RUNNING and not self.verbs.queue


    def stalled_for(self, engine: EngineRecord, now: float) -> float:
        """How long ``engine``'s step loop has made no progress with requests assigned, as the stall clock counts it
        (0 while it does not count: see :func:`_expire_stalled`); ``STATUS_REPLY`` shows it, so that a server's
        liveness probe sees a wedged loop before the coordinator removes the engine at ``stall_timeout``."""
        if not self._clocks_run() or not engine.assigned or engine.progress is None:
            return 0.0
        return max(now - engine.stall_clock, 0.0)


    def _sweep_clients(self, now: float) -> None:
        for client in list(self.members.clients.values()):
            if client.identity is not None and now - client.last_seen > _CLIENT_SILENCE:
                self.outbox.probe(client.identity, self.lifecycle.heartbeat())
            elif client.identity is None and client.offline_since is not None and \
                    now - client.offline_since > self.deadlines.client:
                aborted = 0
                for key in list(client.requests):
                    record = self.flow.table.get(key)
                    if record is None:
                        continue
                    if record.phase is not Phase.FINISHED:
                        self.flow.abort(record, "client went away")
                        aborted += 1
                    self.flow.forget(record)
                self.members.clients.pop(client.client_id, None)
                logger.warning("client %s gone for more than %.0fs: %d unfinished request(s) aborted and its results "
                               "dropped", client.client_id[:8], self.deadlines.client, aborted)
