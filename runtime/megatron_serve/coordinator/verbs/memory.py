"""The verbs on the engines' device memory: SUSPEND (release the KV cache, at level 2 the weights too) and
RESET_PREFIX_CACHE (forget every cached prefix block), and STOP (each engine drains and exits)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...wire.controls import Control, ResetPrefixCache, Stop, Suspend
from ...wire.lifecycle import Step
from .handler import EngineFacts, Refusal, VerbContext, VerbHandler

if TYPE_CHECKING:
    from ..peers import EngineRecord


class SuspendVerb(VerbHandler):
    """SUSPEND: its level, and whether live requests' KV is kept in host memory."""

    body: Suspend
    message_type = Suspend

    def __init__(self, body: Control) -> None:
        super().__init__(body)
        self.level, self.keep_kv = self.body.level or 1, bool(self.body.keep_kv)

    def problem(self, context: VerbContext) -> str | None:
        return None if self.level in (1, 2) else f"suspend level must be 1 or 2, got {self.level}"

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        if step is not Step.SUSPEND:  # from RUNNING it pauses first
            return Control(control_id=control_id)
        return Suspend(control_id=control_id, level=context.lifecycle.suspend_level, keep_kv=self.keep_kv or None)

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        detail["level"] = context.lifecycle.suspend_level
        return None


class ResetPrefixCacheVerb(VerbHandler):
    """RESET_PREFIX_CACHE: each engine says whether it reset (``reset``, in the lifecycle table's words)."""

    body: ResetPrefixCache
    message_type = ResetPrefixCache

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        return ResetPrefixCache(control_id=control_id, reset_running_requests=self.body.reset_running_requests or None)

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        engines: EngineFacts = detail["engines"]
        detail.update(noop=False, reset=all(f.get("reset") is True for f in engines.values()))
        for engine_id, facts in engines.items():
            if facts.get("reset") is True and engine_id in context.members.engines:
                context.routing.policy.forget(engine_id)  # nothing of it can be found again (its KV events say so too)
        return None


class StopVerb(VerbHandler):
    """STOP: every engine drains for ``drain_timeout`` (its deadline grows by as much) and leaves the fleet."""

    body: Stop
    message_type = Stop

    def drain_s(self) -> float:
        return self.body.drain_timeout or 0.0

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        return Stop(control_id=control_id, drain_timeout=self.body.drain_timeout)

    def fan_out(self, context: VerbContext, step: Step, engines: list[EngineRecord], body: Control,
                facts: EngineFacts) -> list[tuple[EngineRecord, Control]]:
        for engine in engines:
            engine.stopping = True
        return [(engine, body) for engine in engines]

    def acked(self, context: VerbContext, step: Step, engine: EngineRecord, facts: dict[str, Any]) -> None:
        context.remove_engine(engine, "stopped", expected=True)  # it exits now; not a failure
