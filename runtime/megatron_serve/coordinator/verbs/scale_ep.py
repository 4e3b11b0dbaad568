"""SCALE_EP: an expert-parallel group of data-parallel attention ranks to N ranks. The sizes and a leaving rank's
hand-back are :mod:`..expert_group`'s; this is the verb around them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...wire.controls import Control, ScaleEp
from ...wire.lifecycle import Step
from ...wire.protocol import ErrorCode
from ..expert_group import leave, scale_problem, scale_refused
from .handler import EngineFacts, Refusal, VerbContext, VerbHandler

if TYPE_CHECKING:
    from ..peers import EngineRecord


class ScaleEpVerb(VerbHandler):
    """SCALE_EP: the size asked for; the ranks from it on leave, handing their requests back."""

    body: ScaleEp
    message_type = ScaleEp

    def problem(self, context: VerbContext) -> str | None:
        return scale_problem(context.members.engines.values(), self.body.size)

    @property
    def size(self) -> int:
        return self.body.size or 0

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        context.wanted_sizes.asked(context.members.engines.values(), self.size)
        return ScaleEp(control_id=control_id, size=self.size)

    def acked(self, context: VerbContext, step: Step, engine: EngineRecord, facts: dict[str, Any]) -> None:
        if facts.get("leaving"):
            leave(context.routing.policy, context.flow, engine, facts.get("handed_back") or [])

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        engines: EngineFacts = detail["engines"]
        leaving = sorted(engine_id for engine_id, facts in engines.items() if facts.get("leaving"))
        detail.update(noop=False, wanted=self.size, leaving=leaving)
        refused = scale_refused(engines)
        if refused is None:
            return None
        context.wanted_sizes.refused()
        return Refusal(ErrorCode.INVALID_REQUEST, refused, detail)
