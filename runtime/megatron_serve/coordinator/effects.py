"""What the coordinator's core asks its socket loop to do: the core decides, the loop performs.

Handlers never send re-entrantly: they append effects, and the loop performs them after the handler
returned. A send that cannot reach its peer comes back to the core as an event of its own
(``CoordinatorCore.on_peer_gone``), handled like any other input.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.handshake import Hello


@dataclass(frozen=True, slots=True)
class Send:
    """Send one encoded message to a peer; ``batch``: the peer reads BATCH frames (protocol 2)."""

    identity: bytes
    frame: bytes
    batch: bool = False


@dataclass(frozen=True, slots=True)
class Probe:
    """Test at once whether a peer is still connected (a heartbeat it may ignore); then hand ``hello``,
    an engine's HELLO that waited on the answer, back to the core (``on_hello_after_probe``)."""

    identity: bytes
    frame: bytes
    hello: tuple[bytes, Hello] | None = None


Effect = Send | Probe
