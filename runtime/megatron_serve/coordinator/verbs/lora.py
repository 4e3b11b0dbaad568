"""LOAD_LORA and UNLOAD_LORA, in any state but STOPPED.

LOAD_LORA runs like a directory REFIT: ``LORA_VERIFY`` on every engine (each reads and checks the adapter and keeps
it staged), then ``LORA_LOAD``; one refusal refuses the verb (``lora_refused``, naming the engine and the reason) and
no engine serves the adapter. UNLOAD_LORA is refused (``lora_not_found``) when no engine serves the name; otherwise
every engine drops the name, and requests already admitted under it finish under it (what vLLM does too: its unload
forgets the name and leaves running requests alone). Each acknowledgement carries the engine's adapters afterwards,
which the engine's record keeps (routing and STATUS read them) before the next heartbeat. The coordinator keeps the
adapters LOAD_LORA loaded (and UNLOAD_LORA did not drop) and tells every engine that registers later, in its
HELLO_ACK, to load them before it serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ...wire.controls import Control, LoadLora, UnloadLora
from ...wire.lifecycle import STEPS, Step
from ...wire.protocol import ErrorCode
from .handler import EngineFacts, Refusal, VerbContext, VerbHandler, named, verify_refused

if TYPE_CHECKING:
    from ..peers import EngineRecord


class LoraVerb(VerbHandler):
    """What both LoRA verbs share: the adapter's name, each engine's adapters afterwards, and who failed."""

    body: LoadLora | UnloadLora
    verb_name = ""

    def __init__(self, body: LoadLora | UnloadLora) -> None:
        super().__init__(body)
        self.failed: dict[str, str] = {}  # engine id -> why it could not carry it out

    def problem(self, context: VerbContext) -> str | None:
        return None if self.body.lora_name else f"{self.verb_name} needs a non-empty lora_name"

    def refusal_at_start(self, context: VerbContext) -> Refusal | None:
        if not context.members.engines:
            return Refusal(ErrorCode.LORA_NOT_FOUND,
                           f"{self.body.lora_name!r}: no engine is connected to serve LoRA adapters")
        return None

    def acked(self, context: VerbContext, step: Step, engine: EngineRecord, facts: dict[str, Any]) -> None:
        if isinstance(facts.get("loras"), dict):
            engine.stats = {**engine.stats, "loras": facts["loras"]}
        if facts.get("error") and step is not Step.LORA_VERIFY:
            self.failed[engine.engine_id] = str(facts["error"])

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        """Refused when an engine could not carry it out after the others agreed (its load failed after its verify,
        or its unload failed), naming it, with every engine's facts; else the adapters kept for later engines."""
        detail.update(noop=False, lora_name=self.body.lora_name)
        if self.failed:
            return Refusal(ErrorCode.LORA_REFUSED, f"{self.verb_name} {self.body.lora_name!r} failed on "
                                                   f"{named(self.failed)}", {**detail, "failed": dict(self.failed)})
        self.keep(context.weights.loaded_loras)
        return None

    def keep(self, loaded: dict[str, str]) -> None:
        """What engines that register later are told to load."""


class LoadLoraVerb(LoraVerb):
    """LOAD_LORA: verified by every engine, then loaded by every engine."""

    body: LoadLora
    verb_name = "LOAD_LORA"

    def problem(self, context: VerbContext) -> str | None:
        if not self.body.lora_name or not self.body.lora_path:
            return "LOAD_LORA needs a non-empty lora_name and lora_path"
        return None

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        return msgspec.structs.replace(self.body, control_id=control_id, phase=STEPS[step].phase)

    def refusal_after(self, context: VerbContext, step: Step, facts: EngineFacts) -> Refusal | None:
        who = verify_refused(step, Step.LORA_VERIFY, facts)
        return None if who is None else Refusal(ErrorCode.LORA_REFUSED,
                                                f"LOAD_LORA refused by {who}; no engine serves it")

    def keep(self, loaded: dict[str, str]) -> None:
        loaded[self.body.lora_name] = self.body.lora_path


class UnloadLoraVerb(LoraVerb):
    """UNLOAD_LORA: refused when no engine serves the name."""

    body: UnloadLora
    verb_name = "UNLOAD_LORA"

    def refusal_at_start(self, context: VerbContext) -> Refusal | None:
        engines = context.members.engines.values()
        if engines and not any(self.body.lora_name in (e.loras or {}) for e in engines):
            return Refusal(ErrorCode.LORA_NOT_FOUND,
                           f"the LoRA adapter {self.body.lora_name!r} cannot be found: no engine serves it")
        return super().refusal_at_start(context)

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        return msgspec.structs.replace(self.body, control_id=control_id)

    def keep(self, loaded: dict[str, str]) -> None:
        loaded.pop(self.body.lora_name, None)
