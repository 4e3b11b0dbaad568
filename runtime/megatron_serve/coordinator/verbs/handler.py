"""One verb in progress as an object of its own: what it checks, sends, hears back and answers.

The runner (:mod:`.runner`) does what every verb shares: the queue, the lifecycle table's transition, one broadcast
per step, the acknowledgements each step waits for, the kept answers. Whatever belongs to one verb (PAUSE's mode,
REFIT's weights, a LoRA verb's adapter, SCALE_EP's size) is its handler's state and its handler's hooks, registered
in one table (:mod:`.table`), as the engine's :data:`~megatron_serve.engine.verbs.actions.ACTIONS`. A verb whose hooks are
all the defaults (UNPAUSE, RESUME) is this class itself: its steps go to every engine as a plain
:class:`~megatron_serve.wire.controls.Control`, and its answer is what every engine said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...wire.controls import Control

if TYPE_CHECKING:
    from ...wire.lifecycle import Step
    from ...wire.protocol import ErrorCode
    from ..deadlines import Deadlines
    from ..dispatch import Dispatcher
    from ..effects import Outbox
    from ..expert_group import WantedSizes
    from ..fleet_weights import FleetWeights
    from ..flow import RequestFlow
    from ..lifecycle import Lifecycle
    from ..membership import Membership, RemoveEngine
    from ..peers import EngineRecord

#: Each engine's facts in a verb's answer (engine id -> what its acknowledgements said, ``group``, ``state``).
EngineFacts = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class VerbContext:
    """What the verbs work on, each part named: the fleet's members, its lifecycle state and weights, the request flow
    (PAUSE's drain and abort), routing (what it knows of engines' caches), the deadlines of steps, the outbox the
    steps and answers go to, the core's removal of an engine, and what verbs keep from one to the next."""

    members: Membership
    lifecycle: Lifecycle
    weights: FleetWeights
    flow: RequestFlow
    routing: Dispatcher
    deadlines: Deadlines
    outbox: Outbox
    remove_engine: RemoveEngine
    wanted_sizes: WantedSizes  # SCALE_EP's sizes, per expert-parallel group (in STATUS)


@dataclass(frozen=True)
class Refusal:
    """A verb answered with ``ERROR`` instead of ``CONTROL_ACK``: its code, why, and the facts gathered so far."""

    code: ErrorCode
    message: str
    detail: dict[str, Any] | None = None


def engine_errors(facts: EngineFacts) -> dict[str, str]:
    """Engine id -> the error its acknowledgement carried, for the engines whose acknowledgement carried one."""
    return {engine_id: str(f["error"]) for engine_id, f in facts.items() if f.get("error")}


def named(failed: dict[str, str]) -> str:
    """``engine X: why`` for the first engine that failed (by id), `` and N more`` before the reason when others did."""
    engine_id, why = sorted(failed.items())[0]
    return f"engine {engine_id}" + (f" and {len(failed) - 1} more" if len(failed) > 1 else "") + f": {why}"


def verify_refused(step: Step, verify: Step, facts: EngineFacts) -> str | None:
    """:func:`named` for the engines that refused ``verify``, when ``step`` is it and any did; else None."""
    errors = engine_errors(facts)
    return named(errors) if step is verify and errors else None


class VerbHandler:
    """A verb with no state of its own; each verb with some subclasses it and overrides the hooks it needs.

    The hooks run in this order: :meth:`problem` (on arrival), :meth:`refusal_at_start` and :meth:`started` (when
    its turn comes), then per step :meth:`message`, :meth:`fan_out`, :meth:`acked` (per engine) and
    :meth:`refusal_after` (once every engine acknowledged), and last :meth:`answer`.
    """

    #: The suspend level the verb asks for when its transition ends in SUSPENDED (PAUSE or REFIT while suspended
    #: keep at least 1).
    level = 1
    #: Whether the verb's answer makes every engine's cached blocks unknown to routing (new weights).
    forgets_routing = False
    #: The verb's own message. A plain :class:`Control` (an older client's, that sent no optional field) is read as
    #: it with every optional field absent.
    message_type: type[Control] = Control

    def __init__(self, body: Control) -> None:
        self.body = body if isinstance(body, self.message_type) else self.message_type(control_id=body.control_id)

    def problem(self, context: VerbContext) -> str | None:
        """Why its arguments are refused on arrival (``invalid_request``), before it is queued."""
        return None

    def refusal_at_start(self, context: VerbContext) -> Refusal | None:
        """Why the fleet cannot run it now that its turn came (the table allowed it); what it takes from the fleet
        as it is then (REFIT's epoch) is taken here."""
        return None

    def started(self, context: VerbContext, previous_state: str, now: float) -> None:
        """What it does once the fleet's state moved to its target, before its first step."""

    @property
    def holding(self) -> bool:
        """True while it holds its step back for something other than the engines (PAUSE waiting for requests)."""
        return False

    def holds(self, context: VerbContext, now: float) -> bool:
        """Whether its step must still wait (asked before each step while :attr:`holding`)."""
        return False

    def drain_s(self) -> float:
        """Seconds a ``drain`` deadline adds to the verb timeout (STOP's drain)."""
        return 0.0

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        """The message of ``step`` that every engine gets (``control_id``: the step's own id)."""
        return Control(control_id=control_id)

    def fan_out(self, context: VerbContext, step: Step, engines: list[EngineRecord], body: Control,
                facts: EngineFacts) -> list[tuple[EngineRecord, Control]]:
        """Which engines get ``step`` and with which message (every connected engine, ``body``, unless a verb says
        otherwise); ``facts`` holds what engines said in earlier steps."""
        return [(engine, body) for engine in engines]

    def acked(self, context: VerbContext, step: Step, engine: EngineRecord, facts: dict[str, Any]) -> None:
        """What ``engine``'s acknowledgement of ``step`` changes (its ``facts``, as it said them)."""

    def refusal_after(self, context: VerbContext, step: Step, facts: EngineFacts) -> Refusal | None:
        """Why the verb stops after ``step``, every engine having acknowledged it (a refused verify)."""
        return None

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        """Add its own facts to the answer's ``detail`` and keep what it changed; a refusal instead, if it failed."""
        return None
