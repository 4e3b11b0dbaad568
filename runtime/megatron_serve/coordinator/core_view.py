"""The coordinator's core as its job modules see it: the state they read and write, and the actions they call.

:class:`~.core.CoordinatorCore` is the one object of this shape. The job modules (:mod:`.handshake`,
:mod:`.dispatch`, :mod:`.verbs`, :mod:`.liveness`, :mod:`.disaggregation`, :mod:`.expert_group`) take it as a
:class:`CoreView`, declared here beneath them, so that the core imports its jobs and no job imports the core. A job
that also reads another job's object (the lifecycle runner, the handoffs, liveness's memory) names it in a Protocol
of its own that extends this one, beside the code that reads it.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..wire.handshake import Hello
from ..wire.lifecycle import FleetState
from ..wire.protocol import Header, Role
from ..wire.security import FleetSecret
from ..wire.status import Heartbeat
from .droplog import DropLog
from .flow import RequestFlow
from .fleet_weights import FleetWeights
from .peers import ClientRecord, EngineRecord
from .placement import Sessions
from .routing import RoutingPolicy


class CoreView(Protocol):
    """What the job modules use of the core (its docstrings, in :mod:`.core`, say what each does)."""

    # The fleet and its peers.
    state: FleetState
    suspend_level: int
    peers: dict[bytes, tuple[Role, str]]  # identity -> (role, engine_id | client_id)
    engines: dict[str, EngineRecord]
    clients: dict[str, ClientRecord]
    flow: RequestFlow  # the request table and every request's way through the coordinator
    registrations: int
    coordinator_id: str
    secret: FleetSecret | None
    proven: dict[bytes, bytes | None]  # connections that proved the secret (identity -> CURVE key)
    drop: DropLog
    # Routing.
    policy: RoutingPolicy
    sessions: Sessions
    dispatch_factor: float
    weights: FleetWeights  # the generation engines serve and LOAD_LORA's adapters (the refit's record)
    # Deadlines (seconds).
    heartbeat_timeout: float
    client_timeout: float
    verb_timeout: float
    weights_timeout: float
    stall_timeout: float

    def send(self, identity: bytes, header: Header, body: Any, batch: bool = False) -> None: ...

    def probe(self, identity: bytes, hello: tuple[bytes, Hello] | None = None) -> None: ...

    def heartbeat(self) -> Heartbeat: ...

    def peer_name(self, identity: bytes) -> str: ...

    def advance_verbs(self) -> None: ...

    def remove_engine(self, engine: EngineRecord, reason: str, expected: bool = False) -> None: ...
