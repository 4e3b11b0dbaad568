"""The one way tokens leave the coordinator: ``STEP_TOKENS``, one per engine step and client, and catch-ups.

The core mirrors each request's delta and files it here with the bytes the engine sent
(:meth:`StepShares.add`); at the end of the step each client gets its requests' deltas as those bytes,
spliced into one message beside their ids (``wire.deltas.StepTokens``): nothing built or encoded per
request. A step whose share for one client would pass the frame limit goes as several such messages.
A reconnected or resubmitting client's catch-up (:func:`catch_up`) is the same message with ``starts``, cut between
tokens by the rule that cuts an engine's step (:mod:`..wire.frame_cuts`) where its kept ids or scores are many.
"""

from __future__ import annotations

import logging

import msgspec

from ..wire.body import ClientId
from ..wire.deltas import StepTokens, StepTokensOut, TokenDelta
from ..wire.frame_cuts import delta_pieces
from ..wire.protocol import MAX_MESSAGE_BYTES, Header
from .effects import Send

logger = logging.getLogger(__name__)

_ENCODE = msgspec.msgpack.Encoder()
_STEP_TOKENS = int(Header.STEP_TOKENS)
#: Bytes of a STEP_TOKENS frame besides its deltas and ids (its header, keys and list headers, at most).
_FRAME_ROOM = 48


class _Share:
    """One client's part of a step: its requests' ids and their deltas' bytes."""

    __slots__ = ("batch", "ids", "raws")

    def __init__(self, batch: bool) -> None:
        self.batch = batch
        self.ids: list[ClientId] = []
        self.raws: list[msgspec.Raw] = []


class StepShares:
    """The clients' parts of one engine step, by connection."""

    __slots__ = ("_shares",)

    def __init__(self) -> None:
        self._shares: dict[bytes, _Share] = {}

    def add(self, identity: bytes, batch: bool, client_request_id: ClientId, raw: msgspec.Raw) -> None:
        """File a request's delta (``raw``: a ``TokenDelta`` as bytes, most often the engine's own) for the client
        at ``identity``."""
        share = self._shares.get(identity)
        if share is None:
            share = self._shares[identity] = _Share(batch)
        share.ids.append(client_request_id)
        share.raws.append(raw)

    def sends(self) -> list[Send]:
        """A ``STEP_TOKENS`` per client (several where one would pass the frame limit)."""
        sends = []
        for identity, share in self._shares.items():
            frame = _ENCODE.encode((_STEP_TOKENS, StepTokensOut(client_request_ids=share.ids, deltas=share.raws)))
            if len(frame) <= MAX_MESSAGE_BYTES:
                sends.append(Send(identity, frame, share.batch))
            else:
                sends += [Send(identity, part, share.batch) for part in _cut(share.ids, share.raws)]
        return sends


def _cut(ids: list[ClientId], raws: list[msgspec.Raw]) -> list[bytes]:
    """``STEP_TOKENS`` frames of at most :data:`MAX_MESSAGE_BYTES` holding these deltas, in order (a delta too
    large for a frame of its own is logged and left out: no client could read it)."""
    frames: list[bytes] = []
    part_ids: list[ClientId] = []
    part_raws: list[msgspec.Raw] = []
    size = _FRAME_ROOM

    def close() -> None:
        if part_ids:
            frames.append(_ENCODE.encode((_STEP_TOKENS, StepTokensOut(client_request_ids=list(part_ids),
                                                                      deltas=list(part_raws)))))
            part_ids.clear()
            part_raws.clear()

    for client_request_id, raw in zip(ids, raws):
        cost = len(raw) + len(_ENCODE.encode(client_request_id))
        if cost + _FRAME_ROOM > MAX_MESSAGE_BYTES:
            logger.error("cannot send request %s's tokens of this step: %d bytes exceed the %d-byte frame limit",
                         client_request_id, cost, MAX_MESSAGE_BYTES)
            continue
        if size + cost > MAX_MESSAGE_BYTES:
            close()
            size = _FRAME_ROOM
        part_ids.append(client_request_id)
        part_raws.append(raw)
        size += cost
    close()
    return frames


def catch_up(client_request_id: ClientId, delta: TokenDelta, start: int) -> list[StepTokens]:
    """The ``STEP_TOKENS`` messages that bring a client the tokens of its request from generated token ``start`` on:
    one, or one per piece of ``delta`` where its entries pass a message's (:func:`~..wire.frame_cuts.delta_pieces`),
    each starting where its piece does."""
    return [StepTokens(client_request_ids=[client_request_id], deltas=[piece], starts=[start + offset])
            for offset, piece in delta_pieces(delta)]
