"""PAUSE's mode (:class:`~megatron_serve.wire.lifecycle.PauseMode`): work done here before the step is broadcast.

``abort`` ends every unfinished request at once (the engines are told to drop theirs, ahead of the PAUSE step on
the same socket); ``wait`` holds the step back until no request is on an engine any more, or its ``drain_timeout``
passed. Dispatch stops as soon as the verb starts (the fleet's state is already PAUSED), so nothing new reaches an
engine meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from ...wire.lifecycle import (DEFAULT_PAUSE_DRAIN_TIMEOUT, FleetState, PauseMode, drain_timeout_problem,
                               parse_pause_mode)
from ...wire.controls import Control, Pause
from ..requests import Phase
from .handler import Refusal, VerbContext, VerbHandler

logger = logging.getLogger("megatron_serve.coordinator")


class PauseVerb(VerbHandler):
    """PAUSE: its mode, its drain time, and what the mode did (in the answer)."""

    body: Pause
    message_type = Pause

    def __init__(self, body: Control) -> None:
        super().__init__(body)
        self.mode = PauseMode.KEEP
        self.drain_timeout: float | None = None
        self.drain_until: float | None = None  # mode wait: the step waits for running requests until then
        self.started_at = 0.0
        self.facts: dict[str, Any] = {}

    def problem(self, context: VerbContext) -> str | None:
        try:
            self.mode = parse_pause_mode(self.body.mode)
        except ValueError as exc:
            return f"PAUSE: {exc}"
        problem = drain_timeout_problem(self.mode, self.body.drain_timeout)
        if problem is not None:
            return f"PAUSE: {problem}"
        if self.body.drain_timeout is not None:
            self.drain_timeout = float(self.body.drain_timeout)
        return None

    def started(self, context: VerbContext, previous_state: str, now: float) -> None:
        """What the mode does before the step (the fleet's state is already the target: no dispatch)."""
        self.facts["mode"] = self.mode.value
        if self.mode is PauseMode.ABORT:
            self.facts["aborted"] = context.flow.abort_unfinished(f"aborted by PAUSE (mode abort) in {previous_state}")
        elif self.mode is PauseMode.WAIT:
            drain = DEFAULT_PAUSE_DRAIN_TIMEOUT if self.drain_timeout is None else self.drain_timeout
            if previous_state == FleetState.RUNNING.value:
                self.started_at, self.drain_until = now, now + drain
            else:  # paused engines do not step: what they hold cannot finish, there is nothing to wait for
                self.facts.update(waited_s=0.0, unfinished=context.flow.table.count(Phase.DISPATCHED), timed_out=False)

    @property
    def holding(self) -> bool:
        return self.drain_until is not None

    def holds(self, context: VerbContext, now: float) -> bool:
        """True while requests still run and the drain time has not passed; counts what it waited for."""
        if self.drain_until is None:
            return False
        running = context.flow.table.count(Phase.DISPATCHED)
        if running and now < self.drain_until:
            return True
        waited = now - self.started_at  # the verb started then; its step is broadcast only now
        self.facts.update(waited_s=round(waited, 3), unfinished=running, timed_out=bool(running))
        if running:
            logger.warning("PAUSE (wait): %d request(s) still running after %.1fs; pausing them in place",
                           running, waited)
        self.drain_until = None
        return False

    def answer(self, context: VerbContext, detail: dict[str, Any]) -> Refusal | None:
        detail.update(self.facts)
        return None
