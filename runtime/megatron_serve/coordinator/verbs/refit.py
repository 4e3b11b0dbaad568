"""REFIT: ``REFIT_VERIFY`` on every engine before any ``REFIT_LOAD``; one refusal refuses the whole verb and the fleet
keeps its weights.

A REFIT whose weights come from a trainer (a ``rendezvous``) differs in three ways: its load step goes to the engines
that verified, each told its first rank in the transfer group (the sender is rank 0; groups in order, each taking as
many ranks as it has tensor-parallel ranks); the fleet's epoch changes only once every engine loaded; and an engine
whose load fails stays (there is no directory it could reload from): its acknowledgement says which weights it
holds, the verb is refused with those facts, and while any engine holds incomplete weights UNPAUSE is refused
(:data:`~megatron_serve.wire.lifecycle.NEEDS_WHOLE_WEIGHTS`). A rendezvous with ``lora`` pushes an adapter version,
not base weights: the same steps and acknowledgements, but the fleet's epoch and weights stay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ...wire.controls import Control, Refit
from ...wire.lifecycle import STEPS, Step
from ...wire.protocol import ErrorCode
from .handler import EngineFacts, Refusal, VerbContext, VerbHandler, named, verify_refused

if TYPE_CHECKING:
    from ..peers import EngineRecord


class RefitVerb(VerbHandler):
    """REFIT: the new weights (a directory, or a trainer's rendezvous), the epoch they become, and who failed."""

    body: Refit
    forgets_routing = True  # no block of the old weights is found again, in any tier

    def __init__(self, body: Refit) -> None:
        super().__init__(body)
        self.source, self.epoch, self.rendezvous = body.source, body.epoch, body.rendezvous
        self.failed: dict[str, str] = {}  # engine id -> why it could not load

    @property
    def pushes_adapter(self) -> bool:
        """Its tensors are a LoRA adapter version: the base weights and the fleet's epoch stay."""
        return self.rendezvous is not None and self.rendezvous.lora is not None

    def problem(self, context: VerbContext) -> str | None:
        if (self.epoch is not None and self.epoch < 0) or not self.source:
            return "REFIT needs a non-empty source and an epoch >= 0"
        return None if self.rendezvous is None else self.rendezvous.problem()

    def refusal_at_start(self, context: VerbContext) -> Refusal | None:
        if not context.members.engines:
            return Refusal(ErrorCode.REFIT_FAILED,
                           "REFIT needs at least one connected engine to verify the new weights")
        if self.epoch is None and not self.pushes_adapter:
            self.epoch = context.weights.epoch + 1
        return None

    def message(self, context: VerbContext, step: Step, control_id: str) -> Control:
        if step is Step.REFIT_LOAD and self.rendezvous is None:
            # Every engine verified the source: from now on it is the fleet's weights, also for engines that
            # register while (or after) the others load it.
            self._commit(context)
        return Refit(control_id=control_id, source=self.source or "", epoch=self.epoch, phase=STEPS[step].phase,
                     rendezvous=self.rendezvous)

    def _commit(self, context: VerbContext) -> None:
        context.weights.epoch, context.weights.source = int(self.epoch or 0), self.source
        context.weights.refits += 1

    def fan_out(self, context: VerbContext, step: Step, engines: list[EngineRecord], body: Control,
                facts: EngineFacts) -> list[tuple[EngineRecord, Control]]:
        """A trainer's load step goes to the engines that verified, each with its first rank.

        Ranks 0 .. ``senders`` - 1 are the trainer's; then each group in order takes one rank per rank of the group
        (tensor-parallel ranks times pipeline stages: an engine says both in its HELLO ``info``; absent means 1);
        each rank loads what it holds (its slices, experts and stage's layers). An adapter push takes one rank per
        group: the group's rank 0 keeps adapters and sends each rank its share when it writes a slot (engine.lora).
        """
        rendezvous = self.rendezvous
        if step is not Step.REFIT_LOAD or rendezvous is None:
            return super().fan_out(context, step, engines, body, facts)
        verified = sorted((e for e in engines if e.engine_id in facts), key=lambda e: e.group)
        sizes = {e.engine_id: 1 if rendezvous.lora is not None else e.ranks for e in verified}
        world_size = rendezvous.senders + sum(sizes.values())
        sends: list[tuple[EngineRecord, Control]] = []
        offset = rendezvous.senders
        for engine in verified:
            ranks = msgspec.structs.replace(rendezvous, world_size=world_size, rank_offset=offset)
            sends.append((engine, msgspec.structs.replace(body, rendezvous=ranks)))
            facts[engine.engine_id]["ranks"] = [offset, offset + sizes[engine.engine_id] - 1]
            offset += sizes[engine.engine_id]
        return sends

    def acked(self, context: VerbContext, step: Step, engine: EngineRecord, facts: dict[str, Any]) -> None:
        if step is not Step.REFIT_LOAD:
            return
        if facts.get("error") and self.rendezvous is not None:
            # No directory to reload from: it stays, saying which weights it holds (-1: a mix).
            self.failed[engine.engine_id] = str(facts["error"])
            epoch = facts.get("epoch")
            engine.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else -1
        elif facts.get("error"):
            # It verified the source but could not load it: its weights cannot be trusted. Removing it
            # re-queues its requests; it registers again and loads the fleet's weights, or exits.
            self.failed[engine.engine_id] = str(facts["error"])
            context.remove_engine(engine, f"REFIT load failed: {facts['error']}")
        elif not self.pushes_adapter:
            engine.epoch, engine.weights = int(self.epoch or 0), self.source
            engine.stats = {**engine.stats, "peer_store": facts.get("peer_store")}  # before its next heartbeat
            engine.last_refit = {k: facts[k] for k in ("verify_s", "load_s", "total_s") if k in facts}

    def refusal_after(self, context: VerbContext, step: Step, facts: EngineFacts) -> Refusal | None:
        who = verify_refused(step, Step.REFIT_VERIFY, facts)
        return None if who is None else Refusal(
            ErrorCode.REFIT_FAILED, f"REFIT refused by {who}; the fleet keeps serving epoch {context.weights.epoch}")

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        rendezvous = self.rendezvous
        if rendezvous is not None:
            if self.failed:
                return self._transfer_failed(context, detail)
            if not self.pushes_adapter:
                self._commit(context)
        detail.update(noop=False, epoch=context.weights.epoch, source=context.weights.source)
        engines: EngineFacts = detail["engines"]
        if rendezvous is not None and rendezvous.lora is not None:
            detail["lora"] = {"name": rendezvous.lora.name, "version": rendezvous.lora.version}
            self._keep_pushed(context, rendezvous.lora.name, {f.get("lora_path") for f in engines.values()})
        for push in (rendezvous.adapters or ()) if rendezvous is not None else ():
            detail.setdefault("adapters", {})[push.name] = push.version
            self._keep_pushed(context, push.name,
                              {(f.get("lora_paths") or {}).get(push.name) for f in engines.values()})
        if self.failed:
            detail["failed"] = dict(self.failed)
        return None

    def _transfer_failed(self, context: VerbContext, detail: dict[str, Any]) -> Refusal:
        """A trainer's refit that failed on some engine: refused, with what every engine holds now."""
        incomplete = context.weights.incomplete(context.members.engines.values())
        message = f"REFIT from {self.source} failed on {named(self.failed)}; "
        if incomplete:
            message += (f"engine(s) {', '.join(incomplete)} hold incomplete weights: the fleet stays "
                        f"{context.lifecycle.state.value} and UNPAUSE is refused until a refit completes")
        else:
            message += f"no weights were changed: the fleet keeps serving epoch {context.weights.epoch}"
        detail.update(epoch=context.weights.epoch, source=self.source, failed=dict(self.failed),
                      incomplete_weights=incomplete)
        for engine_id in list(context.members.engines):
            context.routing.policy.forget(engine_id)
        return Refusal(ErrorCode.REFIT_FAILED, message, detail)

    def _keep_pushed(self, context: VerbContext, name: str, paths: set[str | None]) -> None:
        """After a push every engine took (alone, or in a policy refit): when they all stored it in one directory
        (``--lora-push-dir``; ``paths``: what each engine said), engines that register later load it from there, like
        a LOAD_LORA's adapter (engine.lora_store); otherwise a directory recorded for the name would serve an older
        version, so it is dropped."""
        if len(paths) == 1 and None not in paths and not self.failed:
            context.weights.loaded_loras[name] = paths.pop()
        else:
            context.weights.loaded_loras.pop(name, None)
