"""The lifecycle state machine at work: verbs queue, each runs its steps, every engine acknowledges each.

The rules (which verb is legal where, which steps it runs, each step's deadline) are the one table
in :mod:`megatron_serve.wire.lifecycle`; this module runs them. A verb is answered with ``CONTROL_ACK``
after every connected engine acknowledged its last step; an engine that does not acknowledge a
step within that step's deadline is removed (see :mod:`.liveness`) and the verb completes with the
others. REFIT runs ``REFIT_VERIFY`` on every engine before any ``REFIT_LOAD``: one refusal refuses
the whole verb and the fleet keeps its weights.

A REFIT whose weights come from a trainer (a ``rendezvous``) differs in three ways: its load step
goes to the engines that verified, each told its first rank in the transfer group (the sender is
rank 0; groups in order, each taking as many ranks as it has tensor-parallel ranks); the fleet's
epoch changes only once every engine loaded; and an engine whose load fails stays (there is no
directory it could reload from): its acknowledgement says which weights it holds, the verb is
refused with those facts, and while any engine holds incomplete weights UNPAUSE is refused
(:data:`~megatron_serve.wire.lifecycle.NEEDS_WHOLE_WEIGHTS`). A rendezvous with ``lora`` pushes an adapter
version, not base weights: the same steps and acknowledgements, but the fleet's epoch and weights stay.

LOAD_LORA runs like a directory REFIT in any state but STOPPED: ``LORA_VERIFY`` on every engine (each reads
and checks the adapter and keeps it staged), then ``LORA_LOAD``; one refusal refuses the verb
(``lora_refused``, naming the engine and the reason) and no engine serves the adapter. UNLOAD_LORA is
refused (``lora_not_found``) when no engine serves the name; otherwise every engine drops the name, and
requests already admitted under it finish under it (what vLLM does too: its unload forgets the name
and leaves running requests alone). Each acknowledgement carries the engine's adapters afterwards, which
the engine's record keeps (routing and STATUS read them) before the next heartbeat. The coordinator keeps the
adapters LOAD_LORA loaded (and UNLOAD_LORA did not drop) and tells every engine that registers later, in
its HELLO_ACK, to load them before it serves.

PAUSE's mode (:class:`~megatron_serve.wire.lifecycle.PauseMode`) is work done here before the step is
broadcast: ``abort`` ends every unfinished request at once (the engines are told to drop theirs,
ahead of the PAUSE step on the same socket); ``wait`` holds the step back until no request is on an
engine any more, or its ``drain_timeout`` passed. Dispatch stops as soon as the verb starts (the
fleet's state is already PAUSED), so nothing new reaches an engine meanwhile.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..wire.lifecycle import (
    DEFAULT_PAUSE_DRAIN_TIMEOUT,
    NEEDS_WHOLE_WEIGHTS,
    STEPS,
    WEIGHTS_INCOMPLETE,
    Deadline,
    FleetState,
    IllegalTransition,
    PauseMode,
    Step,
    Verb,
    drain_timeout_problem,
    parse_pause_mode,
    transition,
)
from ..wire.controls import (Control, ControlAck, LoadLora, Pause, Refit, ResetPrefixCache, ScaleEp, Stop, Suspend,
                             UnloadLora)
from ..wire.handshake import Error
from ..wire.rendezvous import Rendezvous
from ..wire.protocol import VERB_HEADERS, ErrorCode, Header
from .core_view import CoreView
from .expert_group import WantedSizes, leave, scale_problem, scale_refused
from .peers import ClientRecord, EngineRecord
from .requests import Phase

logger = logging.getLogger("megatron_serve.coordinator")

_COMPLETED_KEPT = 256  # answers kept for clients that retry a verb after a reconnect

#: What a control id stands for: the verb and its arguments, exactly as sent (msgpack of the body).
#: A retry after a reconnect repeats both and gets the kept answer again; the same id with another
#: verb or other arguments is refused. Keyed by the id alone, an UNPAUSE that reused a PAUSE's id
#: was answered with the PAUSE's acknowledgement and never ran: the fleet stayed paused.
RequestKey = tuple[Verb, bytes]


class RefitRefused(IllegalTransition):
    """A REFIT the table allows but the fleet cannot run (no engine to verify the weights)."""


class WeightsIncomplete(IllegalTransition):
    """A verb the table allows, refused while an engine holds incomplete weights."""


class LoraNotServed(IllegalTransition):
    """A LoRA verb the table allows but the fleet cannot run (no engine serves the adapter, or none is connected)."""


@dataclass
class ControlOp:
    """One verb in progress: its steps, each acknowledged by every engine."""

    control_id: Any
    verb: Verb
    client_id: str
    key: RequestKey  # what the control id asked for (see RequestKey)
    level: int = 1
    keep_kv: bool = False  # SUSPEND: live requests' KV kept in host memory
    drain_timeout: float | None = None  # STOP: the engines' drain; PAUSE (mode wait): the coordinator's
    mode: PauseMode = PauseMode.KEEP  # PAUSE
    drain_until: float | None = None  # PAUSE (mode wait): the step waits for running requests until then
    pause_facts: dict[str, Any] = field(default_factory=dict)  # PAUSE: what its mode did (in the answer)
    source: str | None = None  # REFIT: the new weights
    epoch: int | None = None  # REFIT: the generation they become
    rendezvous: Rendezvous | None = None  # REFIT: the weights come from a trainer
    steps: tuple[Step, ...] = ()
    step_index: int = -1
    waiting: set[str] = field(default_factory=set)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    previous_state: str = ""
    noop: bool = False
    step_started: float = 0.0  # when the current step was broadcast: its acknowledgement deadline starts there
    unresponsive: list[str] = field(default_factory=list)  # engines removed for missing a step's deadline
    failed: dict[str, str] = field(default_factory=dict)  # REFIT, LoRA: engine id -> why it could not load
    lora: LoadLora | UnloadLora | None = None  # LOAD_LORA, UNLOAD_LORA: the adapter
    reset_running: bool = False  # RESET_PREFIX_CACHE: running requests are recomputed so that every engine resets
    size: int = 0  # SCALE_EP: the data-parallel ranks the expert-parallel group is to have

    @property
    def step(self) -> Step:
        return self.steps[self.step_index]


class VerbRunner:
    """Queue and run the verbs of one coordinator (``core``: its state, sends and removals)."""

    def __init__(self, core: CoreView) -> None:
        self.core = core
        self.queue: collections.deque[ControlOp] = collections.deque()
        # control id -> (what it asked, the answer)
        self.completed: collections.OrderedDict[Any, tuple[RequestKey, Header, Any]] = collections.OrderedDict()
        self.wanted_sizes = WantedSizes()  # SCALE_EP's sizes, per expert-parallel group (in STATUS)

    def request(self, client: ClientRecord, identity: bytes, verb: Verb, body: Control) -> None:
        core = self.core
        control_id = body.control_id
        key: RequestKey = (verb, msgspec.msgpack.encode(body))
        answered = self.completed.get(control_id)
        running = next((op for op in self.queue if op.control_id == control_id), None)
        first = answered[0] if answered is not None else running.key if running is not None else None
        if first is not None and first != key:
            self._refuse_reuse(identity, control_id, verb, first[0])
            return
        if answered is not None:  # a retry after a reconnect: answer again
            core.send(identity, answered[1], answered[2])
            return
        if running is not None:
            return  # in progress; the answer goes to the client's current connection
        op = ControlOp(control_id=control_id, verb=verb, client_id=client.client_id, key=key)
        problem = None
        if isinstance(body, Refit):
            op.source, op.epoch, op.rendezvous = body.source, body.epoch, body.rendezvous
            if (body.epoch is not None and body.epoch < 0) or not body.source:
                problem = "REFIT needs a non-empty source and an epoch >= 0"
            elif body.rendezvous is not None:
                problem = body.rendezvous.problem()
        elif isinstance(body, Suspend):
            op.level, op.keep_kv = body.level or 1, bool(body.keep_kv)
            if op.level not in (1, 2):
                problem = f"suspend level must be 1 or 2, got {op.level}"
        elif isinstance(body, Stop):
            op.drain_timeout = body.drain_timeout
        elif isinstance(body, ResetPrefixCache):
            op.reset_running = bool(body.reset_running_requests)
        elif isinstance(body, ScaleEp):
            op.size = body.size or 0
            problem = scale_problem(core.engines.values(), body.size)
        elif isinstance(body, Pause):
            problem = self._pause_problem(op, body)
        elif isinstance(body, (LoadLora, UnloadLora)):
            op.lora = body
            if not body.lora_name or (isinstance(body, LoadLora) and not body.lora_path):
                problem = f"{verb.name} needs a non-empty lora_name" + (" and lora_path" if isinstance(body, LoadLora)
                                                                        else "")
        if problem is not None:
            core.send(identity, Header.ERROR, Error(code=ErrorCode.INVALID_REQUEST.value, message=problem,
                                                    control_id=control_id))
            return
        self.queue.append(op)
        logger.info("%s %s: %s requested (state %s)", client.role.value, client.client_id[:8], verb.name,
                    core.state.value)
        core.advance_verbs()

    def _refuse_reuse(self, identity: bytes, control_id: Any, verb: Verb, first: Verb) -> None:
        what = f"for {first.name}" if first is not verb else f"for a {verb.name} with other arguments"
        message = f"control id {control_id!r} was already used {what}: each {verb.name} needs a control id of its own"
        logger.warning("%s refused: %s", verb.name, message)
        self.core.send(identity, Header.ERROR, Error(code=ErrorCode.CONTROL_ID_REUSED.value, message=message,
                                                     control_id=control_id))

    @staticmethod
    def _pause_problem(op: ControlOp, body: Pause) -> str | None:
        """Read PAUSE's mode and drain time into ``op``; why they are refused, if they are."""
        try:
            op.mode = parse_pause_mode(body.mode)
        except ValueError as exc:
            return f"PAUSE: {exc}"
        problem = drain_timeout_problem(op.mode, body.drain_timeout)
        if problem is not None:
            return f"PAUSE: {problem}"
        if body.drain_timeout is not None:
            op.drain_timeout = float(body.drain_timeout)
        return None

    # ------------------------------------------------------------------ running

    def advance(self, now: float) -> None:
        """Drive the verb at the head of the queue: plan it, broadcast each step, complete it."""
        while self.queue:
            op = self.queue[0]
            if op.step_index < 0:
                if not self._start(op, now):
                    continue
            elif op.drain_until is None:
                if op.waiting:
                    return
                if self._verify_refused(op):
                    continue
                op.step_index += 1
            if self._draining(op, now):
                return
            while op.step_index < len(op.steps):
                self._broadcast(op, now)
                if op.waiting:
                    return
                op.step_index += 1
            self.queue.popleft()
            self._complete(op)

    @property
    def draining(self) -> bool:
        """A PAUSE in wait mode holds its step back for running requests (any input may end that)."""
        return bool(self.queue) and self.queue[0].drain_until is not None

    def _draining(self, op: ControlOp, now: float) -> bool:
        """True while ``op`` (PAUSE, mode wait) must still wait before its step; counts what it waited for."""
        if op.drain_until is None:
            return False
        running = self.core.requests.count(Phase.DISPATCHED)
        if running and now < op.drain_until:
            return True
        waited = now - op.step_started  # the verb started then; its step is broadcast only now
        op.pause_facts.update(waited_s=round(waited, 3), unfinished=running, timed_out=bool(running))
        if running:
            logger.warning("PAUSE (wait): %d request(s) still running after %.1fs; pausing them in place",
                           running, waited)
        op.drain_until = None
        return False

    def _start(self, op: ControlOp, now: float) -> bool:
        """Plan ``op`` from the table and move the fleet's state; False when it was refused."""
        core = self.core
        try:
            planned = transition(core.state, op.verb)
            incomplete = core.incomplete_weights()
            if op.verb in NEEDS_WHOLE_WEIGHTS and incomplete:
                raise WeightsIncomplete(WEIGHTS_INCOMPLETE.format(verb=op.verb.name, engines=", ".join(incomplete)))
            if op.verb is Verb.REFIT:
                if not core.engines:
                    raise RefitRefused("REFIT needs at least one connected engine to verify the new weights")
                if op.epoch is None and not _pushes_adapter(op):
                    op.epoch = core.epoch + 1
            if op.lora is not None:
                self._lora_problem(op.lora)
        except IllegalTransition as exc:
            self.queue.popleft()
            logger.info("%s refused: %s", op.verb.name, exc)
            code = (ErrorCode.REFIT_FAILED if isinstance(exc, RefitRefused) else ErrorCode.WEIGHTS_INCOMPLETE
                    if isinstance(exc, WeightsIncomplete) else ErrorCode.LORA_NOT_FOUND
                    if isinstance(exc, LoraNotServed) else ErrorCode.ILLEGAL_TRANSITION)
            self._answer(op, Header.ERROR, Error(code=code.value, message=str(exc), control_id=op.control_id))
            return False
        previous_level = core.suspend_level if core.state is FleetState.SUSPENDED else 0
        op.previous_state = core.state.value
        op.steps = planned.steps
        core.suspend_level = max(previous_level, op.level) if planned.target is FleetState.SUSPENDED else 0
        op.noop = planned.target is core.state and core.suspend_level == previous_level
        core.state = planned.target
        op.step_index = 0
        if op.verb is Verb.PAUSE:
            self._start_pause_mode(op, now)
        return True

    def _lora_problem(self, lora: LoadLora | UnloadLora) -> None:
        """Refuse a LoRA verb no engine can run: none connected, or (UNLOAD_LORA) none serving the name."""
        engines = self.core.engines.values()
        if not engines:
            raise LoraNotServed(f"{lora.lora_name!r}: no engine is connected to serve LoRA adapters")
        if isinstance(lora, UnloadLora) and not any(lora.lora_name in (e.loras or {}) for e in engines):
            raise LoraNotServed(f"the LoRA adapter {lora.lora_name!r} cannot be found: no engine serves it")

    def _start_pause_mode(self, op: ControlOp, now: float) -> None:
        """What PAUSE's mode does before its step (the fleet's state is already the target: no dispatch)."""
        op.pause_facts["mode"] = op.mode.value
        if op.mode is PauseMode.ABORT:
            why = f"aborted by PAUSE (mode abort) in {op.previous_state}"
            op.pause_facts["aborted"] = self.core.abort_unfinished(why)
        elif op.mode is PauseMode.WAIT:
            if op.drain_timeout is None:
                op.drain_timeout = DEFAULT_PAUSE_DRAIN_TIMEOUT
            if op.previous_state == FleetState.RUNNING.value:
                op.step_started, op.drain_until = now, now + op.drain_timeout
            else:  # paused engines do not step: what they hold cannot finish, there is nothing to wait for
                op.pause_facts.update(waited_s=0.0, unfinished=self.core.requests.count(Phase.DISPATCHED),
                                      timed_out=False)

    def _broadcast(self, op: ControlOp, now: float) -> None:
        """Send the current step to every connected engine; each one must acknowledge it."""
        core = self.core
        step = op.step
        spec = STEPS[step]
        op.step_started = now
        control_id = f"{op.control_id}#{op.step_index}"
        body: Control
        if step is Step.SUSPEND:
            body = Suspend(control_id=control_id, level=core.suspend_level, keep_kv=op.keep_kv or None)
        elif step is Step.STOP:
            body = Stop(control_id=control_id, drain_timeout=op.drain_timeout)
        elif spec.verb is Verb.REFIT:
            body = Refit(control_id=control_id, source=op.source or "", epoch=op.epoch, phase=spec.phase,
                         rendezvous=op.rendezvous)
            if step is Step.REFIT_LOAD and op.rendezvous is None:
                # Every engine verified the source: from now on it is the fleet's weights, also for
                # engines that register while (or after) the others load it.
                core.epoch, core.weights_source = int(op.epoch or 0), op.source
                core.refits += 1
        elif step is Step.RESET_PREFIX_CACHE:
            body = ResetPrefixCache(control_id=control_id, reset_running_requests=op.reset_running or None)
        elif step is Step.SCALE_EP:
            body = ScaleEp(control_id=control_id, size=op.size)
            self.wanted_sizes.asked(core.engines.values(), op.size)
        elif isinstance(op.lora, LoadLora):
            body = msgspec.structs.replace(op.lora, control_id=control_id, phase=spec.phase)
        elif op.lora is not None:
            body = msgspec.structs.replace(op.lora, control_id=control_id)
        else:
            body = Control(control_id=control_id)
        targets = list(core.engines.values())
        bodies: dict[str, Control] = {}
        if step is Step.REFIT_LOAD and op.rendezvous is not None:
            targets, bodies = self._transfer_ranks(op, op.rendezvous, targets, body)
        for engine in targets:
            if step is Step.STOP:
                engine.stopping = True
            core.send(engine.identity, VERB_HEADERS[spec.verb], bodies.get(engine.engine_id, body))
            op.waiting.add(engine.engine_id)
            op.engines.setdefault(engine.engine_id, {"group": engine.group})

    @staticmethod
    def _transfer_ranks(op: ControlOp, rendezvous: Rendezvous, engines: list[EngineRecord], body: Refit
                        ) -> tuple[list[EngineRecord], dict[str, Control]]:
        """The load step of a trainer's refit: to the engines that verified, each with its first rank.

        Ranks 0 .. ``senders`` - 1 are the trainer's; then each group in order takes one rank per rank of the group
        (tensor-parallel ranks times pipeline stages: an engine says both in its HELLO ``info``; absent means 1);
        each rank loads what it holds (its slices, experts and stage's layers). An adapter push takes one rank per
        group: the group's rank 0 keeps adapters and sends each rank its share when it writes a slot (engine.lora).
        """
        verified = sorted((e for e in engines if e.engine_id in op.engines), key=lambda e: e.group)
        sizes = {e.engine_id: e.ranks for e in verified}
        if rendezvous.lora is not None:
            sizes = dict.fromkeys(sizes, 1)
        world_size = rendezvous.senders + sum(sizes.values())
        bodies: dict[str, Control] = {}
        offset = rendezvous.senders
        for engine in verified:
            ranks = msgspec.structs.replace(rendezvous, world_size=world_size, rank_offset=offset)
            bodies[engine.engine_id] = msgspec.structs.replace(body, rendezvous=ranks)
            op.engines[engine.engine_id]["ranks"] = [offset, offset + sizes[engine.engine_id] - 1]
            offset += sizes[engine.engine_id]
        return verified, bodies

    def _verify_refused(self, op: ControlOp) -> bool:
        """After a verify step: refuse the whole REFIT or LOAD_LORA if any engine refused what it checked."""
        if op.step not in (Step.REFIT_VERIFY, Step.LORA_VERIFY):
            return False
        errors = {eid: f["error"] for eid, f in op.engines.items() if f.get("error")}
        if not errors:
            return False
        self.queue.popleft()
        eid, why = sorted(errors.items())[0]
        more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
        if op.step is Step.LORA_VERIFY:
            message, code = f"LOAD_LORA refused by engine {eid}{more}: {why}; no engine serves it", ErrorCode.LORA_REFUSED
        else:
            message = f"REFIT refused by engine {eid}{more}: {why}; the fleet keeps serving epoch {self.core.epoch}"
            code = ErrorCode.REFIT_FAILED
        logger.warning("%s", message)
        self._answer(op, Header.ERROR, Error(code=code.value, message=message, control_id=op.control_id))
        return True

    def deadline(self, op: ControlOp) -> float:
        """Seconds an engine may take to acknowledge the current step (its kind is in the lifecycle table)."""
        kind = STEPS[op.step].deadline
        core = self.core
        if kind is Deadline.DRAIN:
            return core.verb_timeout + (op.drain_timeout or 0.0)
        if kind is Deadline.WEIGHTS:
            return max(core.verb_timeout, core.weights_timeout)
        return core.verb_timeout

    def overdue(self, now: float) -> list[EngineRecord]:
        """Engines that missed the current step's deadline (noted as unresponsive in the verb's answer)."""
        if not self.queue or not self.queue[0].waiting:
            return []
        op = self.queue[0]
        if now - op.step_started <= self.deadline(op):
            return []
        late = [e for e in self.core.engines.values() if e.engine_id in op.waiting]
        op.unresponsive.extend(e.engine_id for e in late)
        return late

    # ------------------------------------------------------------------ acknowledgements

    def on_ack(self, engine: EngineRecord, body: ControlAck) -> None:
        core = self.core
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
        if op.step is Step.REFIT_LOAD:
            if facts.get("error") and op.rendezvous is not None:
                # No directory to reload from: it stays, saying which weights it holds (-1: a mix).
                op.failed[engine.engine_id] = str(facts["error"])
                epoch = facts.get("epoch")
                engine.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else -1
            elif facts.get("error"):
                # It verified the source but could not load it: its weights cannot be trusted. Removing it
                # re-queues its requests; it registers again and loads the fleet's weights, or exits.
                op.failed[engine.engine_id] = str(facts["error"])
                core.remove_engine(engine, f"REFIT load failed: {facts['error']}")
            elif not _pushes_adapter(op):
                engine.epoch, engine.weights = int(op.epoch or 0), op.source
                engine.stats = {**engine.stats, "peer_store": facts.get("peer_store")}  # before its next heartbeat
                engine.last_refit = {k: facts[k] for k in ("verify_s", "load_s", "total_s") if k in facts}
        elif op.step is Step.STOP:
            core.remove_engine(engine, "stopped", expected=True)  # it exits now; not a failure
        elif op.step is Step.SCALE_EP and facts.get("leaving"):
            leave(core, engine, facts.get("handed_back") or [])
        elif op.lora is not None:
            if isinstance(facts.get("loras"), dict):
                engine.stats = {**engine.stats, "loras": facts["loras"]}
            if facts.get("error") and op.step is not Step.LORA_VERIFY:
                op.failed[engine.engine_id] = str(facts["error"])
        core.advance_verbs()

    def on_engine_removed(self, engine: EngineRecord, reason: str) -> None:
        for op in self.queue:
            if engine.engine_id in op.waiting:
                op.waiting.discard(engine.engine_id)
                op.engines.setdefault(engine.engine_id, {"group": engine.group})["lost"] = reason
        self.core.advance_verbs()

    # ------------------------------------------------------------------ answers

    def _complete(self, op: ControlOp) -> None:
        core = self.core
        detail: dict[str, Any] = {"previous_state": op.previous_state, "noop": op.noop, "engines": op.engines}
        released = [f["released_bytes"] for f in op.engines.values() if isinstance(f.get("released_bytes"), int)]
        if released:
            detail["released_bytes"] = sum(released)
        if op.verb is Verb.SUSPEND:
            detail["level"] = core.suspend_level
        detail.update(op.pause_facts)
        if op.verb is Verb.REFIT and op.rendezvous is not None:
            if op.failed:
                self._transfer_failed(op, detail)
                return
            if not _pushes_adapter(op):
                core.epoch, core.weights_source = int(op.epoch or 0), op.source
                core.refits += 1
        if op.verb is Verb.REFIT:
            detail.update(noop=False, epoch=core.epoch, source=core.weights_source)
            if op.rendezvous is not None and op.rendezvous.lora is not None:
                detail["lora"] = {"name": op.rendezvous.lora.name, "version": op.rendezvous.lora.version}
                _keep_pushed(core, op, op.rendezvous.lora.name, {f.get("lora_path") for f in op.engines.values()})
            for push in (op.rendezvous.adapters or ()) if op.rendezvous is not None else ():
                detail.setdefault("adapters", {})[push.name] = push.version
                _keep_pushed(core, op, push.name, {(f.get("lora_paths") or {}).get(push.name)
                                                   for f in op.engines.values()})
            if op.failed:
                detail["failed"] = dict(op.failed)
        if op.lora is not None:
            detail.update(noop=False, lora_name=op.lora.lora_name)
            if op.failed:
                self._lora_failed(op, detail)
                return
            if isinstance(op.lora, LoadLora):
                core.loaded_loras[op.lora.lora_name] = op.lora.lora_path
            else:
                core.loaded_loras.pop(op.lora.lora_name, None)
        if op.verb is Verb.RESET_PREFIX_CACHE:  # what every engine did: each one's ``reset`` (see the lifecycle table)
            detail.update(noop=False, reset=all(f.get("reset") is True for f in op.engines.values()))
            for engine_id, facts in op.engines.items():
                if facts.get("reset") is True and engine_id in core.engines:
                    core.policy.forget(engine_id)  # nothing of it can be found again (its KV events say so too)
        if op.verb is Verb.SCALE_EP:
            leaving = sorted(engine_id for engine_id, facts in op.engines.items() if facts.get("leaving"))
            detail.update(noop=False, wanted=op.size, leaving=leaving)
            refused = scale_refused(op.engines)
            if refused is not None:
                self.wanted_sizes.refused()
                self._answer(op, Header.ERROR, Error(code=ErrorCode.INVALID_REQUEST.value, message=refused,
                                                     control_id=op.control_id, detail=detail))
                return
        if op.unresponsive:
            detail["unresponsive"] = list(op.unresponsive)
        logger.info("%s acknowledged: %s -> %s by %d engine(s)%s", op.verb.name, op.previous_state,
                    core.state.value, len(op.engines), f", released {detail['released_bytes']} bytes" if released else "")
        if op.verb is Verb.REFIT:  # no block of the old weights is found again, in any tier: routing starts over
            for engine_id in list(core.engines):
                core.policy.forget(engine_id)
        elif core.state is FleetState.SUSPENDED:  # device pools freed: what a host tier took stays
            for engine in list(core.engines.values()):
                core.policy.suspended(engine)
        self._answer(op, Header.CONTROL_ACK, ControlAck(control_id=op.control_id, state=core.state.value,
                                                        detail=detail))

    def _transfer_failed(self, op: ControlOp, detail: dict[str, Any]) -> None:
        """A trainer's refit that failed on some engine: refuse it, with what every engine holds now."""
        core = self.core
        eid, why = sorted(op.failed.items())[0]
        incomplete = core.incomplete_weights()
        message = (f"REFIT from {op.source} failed on engine {eid}"
                   + (f" and {len(op.failed) - 1} more" if len(op.failed) > 1 else "") + f": {why}; ")
        if incomplete:
            message += (f"engine(s) {', '.join(incomplete)} hold incomplete weights: the fleet stays "
                        f"{core.state.value} and UNPAUSE is refused until a refit completes")
        else:
            message += f"no weights were changed: the fleet keeps serving epoch {core.epoch}"
        detail.update(epoch=core.epoch, source=op.source, failed=dict(op.failed), incomplete_weights=incomplete)
        logger.warning("%s", message)
        for engine_id in list(core.engines):
            core.policy.forget(engine_id)
        self._answer(op, Header.ERROR, Error(code=ErrorCode.REFIT_FAILED.value, message=message,
                                             control_id=op.control_id, detail=detail))

    def _lora_failed(self, op: ControlOp, detail: dict[str, Any]) -> None:
        """A LoRA verb an engine could not carry out after the others agreed (its load failed after its verify, or
        its unload failed): refused, naming it, with every engine's facts."""
        eid, why = sorted(op.failed.items())[0]
        more = f" and {len(op.failed) - 1} more" if len(op.failed) > 1 else ""
        message = f"{op.verb.name} {op.lora.lora_name!r} failed on engine {eid}{more}: {why}"  # type: ignore[union-attr]
        logger.warning("%s", message)
        self._answer(op, Header.ERROR, Error(code=ErrorCode.LORA_REFUSED.value, message=message,
                                             control_id=op.control_id, detail={**detail, "failed": dict(op.failed)}))

    def _answer(self, op: ControlOp, header: Header, body: Any) -> None:
        self.completed[op.control_id] = (op.key, header, body)
        while len(self.completed) > _COMPLETED_KEPT:
            self.completed.popitem(last=False)
        client = self.core.clients.get(op.client_id)
        if client is not None and client.identity is not None:
            self.core.send(client.identity, header, body)



def _keep_pushed(core: CoreView, op: ControlOp, name: str, paths: set[str | None]) -> None:
    """After a push every engine took (alone, or in a policy refit): when they all stored it in one directory
    (``--lora-push-dir``; ``paths``: what each engine said), engines that register later load it from there, like a
    LOAD_LORA's adapter (engine.lora_store); otherwise a directory recorded for the name would serve an older
    version, so it is dropped."""
    if len(paths) == 1 and None not in paths and not op.failed:
        core.loaded_loras[name] = paths.pop()
    else:
        core.loaded_loras.pop(name, None)


def _pushes_adapter(op: ControlOp) -> bool:
    """A REFIT whose tensors are a LoRA adapter version: the base weights and the fleet's epoch stay."""
    return op.rendezvous is not None and op.rendezvous.lora is not None
