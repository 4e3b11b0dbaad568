"""Drive a ``CoordinatorCore`` without sockets: peers are identities, messages are structs, time is a number.

What the core sends comes back decoded, per peer, exactly as a peer would read it (BATCH frames
taken apart), so tests assert on the protocol, not on internals.
"""

from __future__ import annotations

from typing import Any

import msgspec

from megatron_serve.coordinator import CoordinatorCore
from megatron_serve.coordinator.effects import Effect, Probe, Send
from megatron_serve.client.pending_requests import PendingRequests
from megatron_serve.wire.messages import (FROM_COORDINATOR, PROTOCOL_VERSION, ClientId, Hello, Result, StepTokens,
                                          TokenDelta)
from megatron_serve.wire.protocol import Header, Message, decode, unbatch


class CoreHarness:
    def __init__(self, **options: Any) -> None:
        self.core = CoordinatorCore(**options)
        self.now = 1000.0
        self.inbox: dict[bytes, list[Message]] = {}
        self.gone: set[bytes] = set()  # peers whose sends fail (their connection closed)

    # -- time and inputs

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._perform(self.core.on_tick(self.now))

    def send(self, identity: bytes, header: Header, body: Any = None) -> None:
        self._perform(self.core.on_message(identity, Message(header, body), self.now))

    def _perform(self, effects: list[Effect]) -> None:
        """What the socket loop does: deliver sends, report peers that are gone, run probes."""
        while effects:
            more: list[Effect] = []
            for effect in effects:
                if effect.identity in self.gone:
                    more += self.core.on_peer_gone(effect.identity, "send failed", self.now)
                elif isinstance(effect, Send):
                    self.inbox.setdefault(effect.identity, []).append(decode(effect.frame, FROM_COORDINATOR))
                if isinstance(effect, Probe) and effect.hello is not None:
                    more += self.core.on_hello_after_probe(*effect.hello, self.now)
            effects = more

    # -- peers

    def engine(self, identity: bytes, group: int | None = None, capacity: int = 8, **info: Any) -> str:
        """Register an engine; returns its engine id."""
        self.send(identity, Header.HELLO, Hello(role="engine", engine_group=group, capacity=capacity,
                                                info={"kv_blocks_total": 64, **info}, protocol=PROTOCOL_VERSION))
        ack = self.take(identity, Header.HELLO_ACK)[-1]
        return ack.engine_id

    def client(self, identity: bytes, client_id: str = "c1") -> None:
        self.send(identity, Header.HELLO, Hello(role="client", client_id=client_id, acks=True, protocol=PROTOCOL_VERSION))
        self.take(identity, Header.HELLO_ACK)

    # -- outputs

    def take(self, identity: bytes, header: Header | None = None) -> list[Any]:
        """Bodies ``identity`` received since the last take (of ``header`` only, if given); BATCHes opened, a
        ``STEP_TOKENS`` read as one :class:`ClientDelta` per request (as the client reads it), and
        the records engines and clients decode on their own (``EngineSubmit.request``, ``Result.request``) as maps."""
        messages = []
        for message in self.inbox.pop(identity, []):
            for item in unbatch(message.body, FROM_COORDINATOR) if message.header is Header.BATCH else [message]:
                messages += tokens_of_step(item.body) if isinstance(item.body, StepTokens) else [item]
        kept = [m for m in messages if header is not None and m.header is not header]
        if kept:
            self.inbox[identity] = kept
        return [_opened(m.body) for m in messages if header is None or m.header is header]

    def deliver(self, identity: bytes, pending: PendingRequests) -> None:
        """What ``identity`` received, read by a client's table in order: each request's tokens (a catch-up's at
        its start), and its result."""
        for body in self.take(identity):
            if isinstance(body, ClientDelta):
                pending.on_delta(body.client_request_id, body, body.start)
            elif isinstance(body, Result):
                pending.on_final(body.client_request_id, msgspec.Raw(msgspec.msgpack.encode(body.request)))


class ClientDelta(TokenDelta, kw_only=True):
    """One request's share of a ``STEP_TOKENS``, as a client reads it: its id, its delta, and a catch-up's start."""

    client_request_id: ClientId
    start: int | None = None


def tokens_of_step(step: StepTokens) -> list[Message]:
    """The per-request deltas a ``STEP_TOKENS`` carries, each a message of its own."""
    starts = step.starts or [None] * len(step.deltas)
    return [Message(Header.STEP_TOKENS, ClientDelta(client_request_id=crid, start=start,
                                                    **msgspec.structs.asdict(delta)))
            for crid, delta, start in zip(step.client_request_ids, step.deltas, starts)]


def _opened(body: Any) -> Any:
    record = getattr(body, "request", None)
    if isinstance(record, msgspec.Raw):
        return msgspec.structs.replace(body, request=msgspec.msgpack.decode(record))
    return body
