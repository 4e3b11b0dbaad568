"""Where the fleet stands in its lifecycle, as the coordinator keeps it: the state the verbs move it to (the rules are
:mod:`megatron_serve.wire.lifecycle`'s table, the verbs at work :mod:`.verbs`), how deep a suspend goes, and which
coordinator this is. Every peer learns it from a HEARTBEAT or HELLO_ACK; an engine that joins adopts it."""

from __future__ import annotations

import uuid

from ..wire.lifecycle import FleetState
from ..wire.status import Heartbeat


class Lifecycle:
    """The fleet's lifecycle state (see the module docstring)."""

    def __init__(self) -> None:
        self.coordinator_id = uuid.uuid4().hex[:12]  # a restarted coordinator is another one: peers register again
        self.state = FleetState.RUNNING
        self.suspend_level = 0

    def heartbeat(self) -> Heartbeat:
        """What a heartbeat (or a probe) tells a peer: this coordinator, and the fleet's state."""
        return Heartbeat(coordinator_id=self.coordinator_id, state=self.state.value)
