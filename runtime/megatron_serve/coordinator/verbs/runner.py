"""The lifecycle state machine at work: verbs queue, each runs its steps, every engine acknowledges each.

The rules (which verb is legal where, which steps it runs, each step's deadline) are the one table in
:mod:`megatron_serve.wire.lifecycle`; this module runs them, and each verb's own part is its handler's
(:mod:`.handler`, registered in :mod:`.table`). A verb is answered with ``CONTROL_ACK`` after every connected engine
acknowledged its last step; an engine that does not acknowledge a step within that step's deadline is removed (see
:mod:`..liveness`) and the verb completes with the others.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ...wire.controls import Control, ControlAck
from ...wire.handshake import Error
from ...wire.lifecycle import (NEEDS_WHOLE_WEIGHTS, STEPS, WEIGHTS_INCOMPLETE, Deadline, FleetState,
                               IllegalTransition, Step, Verb, transition)
from ...wire.protocol import VERB_HEADERS, ErrorCode, Header
from .handler import EngineFacts, Refusal, VerbContext, VerbHandler
from .table import HANDLERS

if TYPE_CHECKING:
    from ..peers import ClientRecord, EngineRecord

logger = logging.getLogger("megatron_serve.coordinator")

_COMPLETED_KEPT = 256  # answers kept for clients that retry a verb after a reconnect

#: What a control id stands for: the verb and its arguments, exactly as sent (msgpack of the body).
#: A retry after a reconnect repeats both and gets the kept answer again; the same id with another
#: verb or other arguments is refused. Keyed by the id alone, an UNPAUSE that reused a PAUSE's id
#: was answered with the PAUSE's acknowledgement and never ran: the fleet stayed paused.
RequestKey = tuple[Verb, bytes]


@dataclass
class ControlOp:
    """One verb in the queue: who asked, its steps, and which engines still owe the current one."""

    control_id: Any
    verb: Verb
    client_id: str
    key: RequestKey  # what the control id asked for (see RequestKey)
    handler: VerbHandler
    steps: tuple[Step, ...] = ()
    step_index: int = -1
    waiting: set[str] = field(default_factory=set)
    engines: EngineFacts = field(default_factory=dict)
    previous_state: str = ""
    noop: bool = False
    step_started: float = 0.0  # when the current step was broadcast: its acknowledgement deadline starts there
    unresponsive: list[str] = field(default_factory=list)  # engines removed for missing a step's deadline

    @property
    def step(self) -> Step:
        return self.steps[self.step_index]


class VerbRunner:
    """Queue and run the verbs of one coordinator, over the parts of it that ``context`` names."""

    def __init__(self, context: VerbContext) -> None:
        self.context = context
        self._due = False  # an input left the verb at the head something to look at (see settle)
        self.queue: collections.deque[ControlOp] = collections.deque()
        # control id -> (what it asked, the answer)
        self.completed: collections.OrderedDict[Any, tuple[RequestKey, Header, Any]] = collections.OrderedDict()

    def request(self, client: ClientRecord, identity: bytes, verb: Verb, body: Control) -> None:
        context = self.context
        control_id = body.control_id
        key: RequestKey = (verb, msgspec.msgpack.encode(body))
        answered = self.completed.get(control_id)
        running = next((op for op in self.queue if op.control_id == control_id), None)
        first = answered[0] if answered is not None else running.key if running is not None else None
        if first is not None and first != key:
            self._refuse_reuse(identity, control_id, verb, first[0])
            return
        if answered is not None:  # a retry after a reconnect: answer again
            context.outbox.send(identity, answered[1], answered[2])
            return
        if running is not None:
            return  # in progress; the answer goes to the client's current connection
        handler = HANDLERS[verb](body)
        problem = handler.problem(self.context)
        if problem is not None:
            context.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.INVALID_REQUEST.value, message=problem,
                                                    control_id=control_id))
            return
        self.queue.append(ControlOp(control_id=control_id, verb=verb, client_id=client.client_id, key=key,
                                    handler=handler))
        logger.info("%s %s: %s requested (state %s)", client.role.value, client.client_id[:8], verb.name,
                    context.lifecycle.state.value)
        self._due = True

    def _refuse_reuse(self, identity: bytes, control_id: Any, verb: Verb, first: Verb) -> None:
        what = f"for {first.name}" if first is not verb else f"for a {verb.name} with other arguments"
        message = f"control id {control_id!r} was already used {what}: each {verb.name} needs a control id of its own"
        logger.warning("%s refused: %s", verb.name, message)
        self.context.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.CONTROL_ID_REUSED.value, message=message,
                                                               control_id=control_id))

    # ------------------------------------------------------------------ running

    def advance(self, now: float) -> None:
        """Drive the verb at the head of the queue: plan it, broadcast each step, complete it."""
        while self.queue:
            op = self.queue[0]
            if op.step_index < 0:
                if not self._start(op, now):
                    continue
            elif not op.handler.holding:
                if op.waiting:
                    return
                refusal = op.handler.refusal_after(self.context, op.step, op.engines)
                if refusal is not None:
                    self.queue.popleft()
                    logger.warning("%s", refusal.message)
                    self._refuse(op, refusal)
                    continue
                op.step_index += 1
            if op.handler.holding and op.handler.holds(self.context, now):
                return
            while op.step_index < len(op.steps):
                self._broadcast(op, now)
                if op.waiting:
                    return
                op.step_index += 1
            self.queue.popleft()
            self._complete(op)

    def settle(self, now: float) -> None:
        """Run what the input left the verbs to do: a verb arrived or an engine acknowledged or left (each marks the
        runner due), or a PAUSE waits for running requests (any input may have ended the last)."""
        if self.draining:
            self._due = True
        while self._due:
            self._due = False
            self.advance(now)

    @property
    def draining(self) -> bool:
        """The verb at the head holds its step back for running requests (any input may end that)."""
        return bool(self.queue) and self.queue[0].handler.holding

    def _start(self, op: ControlOp, now: float) -> bool:
        """Plan ``op`` from the table and move the fleet's state; False when it was refused."""
        context = self.context
        try:
            planned = transition(context.lifecycle.state, op.verb)
        except IllegalTransition as exc:
            refusal: Refusal | None = Refusal(ErrorCode.ILLEGAL_TRANSITION, str(exc))
        else:
            incomplete = context.weights.incomplete(context.members.engines.values())
            refusal = (Refusal(ErrorCode.WEIGHTS_INCOMPLETE,
                               WEIGHTS_INCOMPLETE.format(verb=op.verb.name, engines=", ".join(incomplete)))
                       if op.verb in NEEDS_WHOLE_WEIGHTS and incomplete else op.handler.refusal_at_start(self.context))
        if refusal is not None:
            self.queue.popleft()
            logger.info("%s refused: %s", op.verb.name, refusal.message)
            self._refuse(op, refusal)
            return False
        lifecycle = context.lifecycle
        previous_level = lifecycle.suspend_level if lifecycle.state is FleetState.SUSPENDED else 0
        op.previous_state = lifecycle.state.value
        op.steps = planned.steps
        lifecycle.suspend_level = (max(previous_level, op.handler.level) if planned.target is FleetState.SUSPENDED
                                   else 0)
        op.noop = planned.target is lifecycle.state and lifecycle.suspend_level == previous_level
        lifecycle.state = planned.target
        op.step_index = 0
        op.handler.started(self.context, op.previous_state, now)
        return True

    def _broadcast(self, op: ControlOp, now: float) -> None:
        """Send the current step to the engines the verb names (every connected one, unless it says otherwise);
        each one must acknowledge it."""
        context = self.context
        op.step_started = now
        body = op.handler.message(self.context, op.step, f"{op.control_id}#{op.step_index}")
        header = VERB_HEADERS[STEPS[op.step].verb]
        for engine, message in op.handler.fan_out(self.context, op.step, list(context.members.engines.values()), body,
                                                  op.engines):
            context.outbox.send(engine.identity, header, message)
            op.waiting.add(engine.engine_id)
            op.engines.setdefault(engine.engine_id, {"group": engine.group})

    def deadline(self, op: ControlOp) -> float:
        """Seconds an engine may take to acknowledge the current step (its kind is in the lifecycle table)."""
        kind = STEPS[op.step].deadline
        context = self.context
        if kind is Deadline.DRAIN:
            return context.deadlines.verb + op.handler.drain_s()
        if kind is Deadline.WEIGHTS:
            return max(context.deadlines.verb, context.deadlines.weights)
        return context.deadlines.verb

    def overdue(self, now: float) -> list[EngineRecord]:
        """Engines that missed the current step's deadline (noted as unresponsive in the verb's answer)."""
        if not self.queue or not self.queue[0].waiting:
            return []
        op = self.queue[0]
        if now - op.step_started <= self.deadline(op):
            return []
        late = [e for e in self.context.members.engines.values() if e.engine_id in op.waiting]
        op.unresponsive.extend(e.engine_id for e in late)
        return late

    # ------------------------------------------------------------------ acknowledgements

    def on_ack(self, engine: EngineRecord, body: ControlAck) -> None:
        engine.state = body.state
        if not self.queue:
            return
        op = self.queue[0]
        if body.control_id != f"{op.control_id}#{op.step_index}" or engine.engine_id not in op.waiting:
            return  # late ack of an earlier step (the engine was presumed lost): ignore
        op.waiting.discard(engine.engine_id)
        facts = op.engines.setdefault(engine.engine_id, {"group": engine.group})
        facts.update(body.detail or {})
        facts["state"] = engine.state
        op.handler.acked(self.context, op.step, engine, facts)
        self._due = True

    def on_engine_removed(self, engine: EngineRecord, reason: str) -> None:
        for op in self.queue:
            if engine.engine_id in op.waiting:
                op.waiting.discard(engine.engine_id)
                op.engines.setdefault(engine.engine_id, {"group": engine.group})["lost"] = reason
        self._due = True

    # ------------------------------------------------------------------ answers

    def _complete(self, op: ControlOp) -> None:
        context = self.context
        detail: dict[str, Any] = {"previous_state": op.previous_state, "noop": op.noop, "engines": op.engines}
        released = [f["released_bytes"] for f in op.engines.values() if isinstance(f.get("released_bytes"), int)]
        if released:
            detail["released_bytes"] = sum(released)
        refusal = op.handler.answer(self.context, detail)
        if refusal is not None:
            logger.warning("%s", refusal.message)
            self._refuse(op, refusal)
            return
        if op.unresponsive:
            detail["unresponsive"] = list(op.unresponsive)
        logger.info("%s acknowledged: %s -> %s by %d engine(s)%s", op.verb.name, op.previous_state,
                    context.lifecycle.state.value, len(op.engines), f", released {detail['released_bytes']} bytes" if released else "")
        if op.handler.forgets_routing:  # no block of the old weights is found again, in any tier: routing starts over
            for engine_id in list(context.members.engines):
                context.routing.policy.forget(engine_id)
        elif context.lifecycle.state is FleetState.SUSPENDED:  # device pools freed: what a host tier took stays
            for engine in list(context.members.engines.values()):
                context.routing.policy.suspended(engine)
        self._answer(op, Header.CONTROL_ACK, ControlAck(control_id=op.control_id, state=context.lifecycle.state.value,
                                                        detail=detail))

    def _refuse(self, op: ControlOp, refusal: Refusal) -> None:
        self._answer(op, Header.ERROR, Error(code=refusal.code.value, message=refusal.message,
                                             control_id=op.control_id, detail=refusal.detail))

    def _answer(self, op: ControlOp, header: Header, body: Any) -> None:
        self.completed[op.control_id] = (op.key, header, body)
        while len(self.completed) > _COMPLETED_KEPT:
            self.completed.popitem(last=False)
        client = self.context.members.clients.get(op.client_id)
        if client is not None and client.identity is not None:
            self.context.outbox.send(client.identity, header, body)
