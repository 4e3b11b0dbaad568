"""Who is in the fleet: the connections that proved the fleet secret, the registered engines and clients.

The handshake (:mod:`.handshake`) adds to it, liveness and the core's removal of an engine take from it; dispatch,
the verbs and the request flow read it. It holds no decision of its own: only who is there, under which identity.
"""

from __future__ import annotations

from typing import Protocol

from ..wire.protocol import Role
from ..wire.security import FleetSecret
from .peers import ClientRecord, EngineRecord


class Membership:
    """The fleet's members (see the module docstring). ``secret``: the fleet secret (None: an insecure fleet)."""

    def __init__(self, secret: FleetSecret | None) -> None:
        self.secret = secret
        self.proven: dict[bytes, bytes | None] = {}  # connections that proved it (identity -> CURVE key), until gone
        self.peers: dict[bytes, tuple[Role, str]] = {}  # identity -> (role, engine_id | client_id)
        self.engines: dict[str, EngineRecord] = {}
        self.clients: dict[str, ClientRecord] = {}
        self.registrations = 0  # engines registered so far (each registration's id counts from it)

    def peer_name(self, identity: bytes) -> str:
        """How logs name a connection: its role and id when it is a member."""
        known = self.peers.get(identity)
        return f"{known[0].value} {known[1]}" if known else f"peer {identity.hex()}"


class RemoveEngine(Protocol):
    """The core's removal of an engine from the fleet (its requests re-queued, routing and a waiting verb told), which
    the parts that decide an engine is gone call."""

    def __call__(self, engine: EngineRecord, reason: str, expected: bool = False) -> None: ...
