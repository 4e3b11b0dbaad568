"""What the coordinator's core asks its socket loop to do: the core decides, the loop performs.

Handlers never send re-entrantly: they append effects, and the loop performs them after the handler
returned. A send that cannot reach its peer comes back to the core as an event of its own
(``CoordinatorCore.on_peer_gone``), handled like any other input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from ..wire.handshake import Hello
from ..wire.protocol import Header, ProtocolError, encode
from ..wire.status import Heartbeat

logger = logging.getLogger("megatron_serve.coordinator")


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


class Outbox:
    """The effects one input leaves, in order, until the loop takes them: every part that answers a peer writes here,
    so that none of them holds a socket or calls back into the core."""

    def __init__(self) -> None:
        self._effects: list[Effect] = []

    def send(self, identity: bytes, header: Header, body: object, batch: bool = False) -> None:
        """Queue one message (a body the wire cannot encode is logged and dropped, not raised into a handler)."""
        try:
            frame = encode(header, body)
        except ProtocolError as exc:
            logger.error("cannot send %s: %s", header.name, exc)
            return
        self._effects.append(Send(identity, frame, batch))

    def probe(self, identity: bytes, heartbeat: Heartbeat, hello: tuple[bytes, Hello] | None = None) -> None:
        """Test whether a peer's connection is still there (a send to a gone one fails) with ``heartbeat``; ``hello``:
        an engine's HELLO that waits for the answer."""
        self._effects.append(Probe(identity, encode(Header.HEARTBEAT, heartbeat), hello))

    def add(self, effects: Iterable[Effect]) -> None:
        self._effects.extend(effects)

    def take(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out
