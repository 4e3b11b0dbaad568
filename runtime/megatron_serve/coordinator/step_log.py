"""The clients' shares of one engine's steps (protocol 11), kept as the engine sent them, for the mirrors to read.

An engine told a request's client at dispatch sends that request's deltas in its client's share of each step: a whole
``STEP_TOKENS`` message (``wire.deltas.ClientShare``), forwarded unread. The coordinator still mirrors every request
(a request that moves goes on from its tokens; a client that reconnects gets what it missed), but reads a share only
when a mirror is read: a move, a catch-up, an abort. Until then the step is one entry here, and the request's record
says from which entry on its deltas are in this log (:class:`~.requests.RequestRecord`). Most requests finish and are
forgotten without that, so a step costs the coordinator an append per client instead of work per request.

The log keeps :data:`LOG_LIMIT` entries at most: then the older half is read, once, into the records of the requests
still using it (filed as bytes, as a delta that came alone is) and dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Mapping

import msgspec

from ..wire.deltas import ClientShare

if TYPE_CHECKING:
    from .requests import RequestRecord

logger = logging.getLogger("megatron_serve.coordinator")

#: Entries a log holds at most (a step's share of 64 one-token deltas is about 5 kB): past it, the older half is read
#: into the records still using it and dropped.
LOG_LIMIT = 1024


class _ShareBody(msgspec.Struct):
    deltas: list[msgspec.Raw]


class _ShareFrame(msgspec.Struct, array_like=True):
    header: int
    body: _ShareBody


_FRAME = msgspec.msgpack.Decoder(_ShareFrame)


def share_deltas(frame: bytes) -> list[msgspec.Raw]:
    """The deltas of a share's ``STEP_TOKENS`` frame, each as its bytes (views of ``frame``); raises msgspec's
    errors for a frame that is not one."""
    return _FRAME.decode(frame).body.deltas


class StepLog:
    """One engine's shares as entries ``(client id, request ids, frame)``, numbered from :attr:`base` on; ``users``:
    the requests whose records read from here."""

    __slots__ = ("base", "entries", "users")

    def __init__(self) -> None:
        self.base = 0
        self.entries: list[tuple[str, list[str], bytes]] = []
        self.users: set[str] = set()

    @property
    def position(self) -> int:
        """The number the next entry gets."""
        return self.base + len(self.entries)

    def append(self, share: ClientShare) -> bool:
        """Keep a share; True when the log is full (:meth:`trim` it)."""
        self.entries.append((share.client_id, share.request_ids, share.frame))
        return len(self.entries) >= LOG_LIMIT

    def deltas_of(self, request_id: str, client_id: str, start: int) -> list[msgspec.Raw]:
        """The deltas of ``request_id`` (of ``client_id``) in the entries from number ``start`` on, in order, as bytes
        (copies: the frames are not held)."""
        found = []
        for entry_client, ids, frame in self.entries[max(start - self.base, 0):]:
            if entry_client == client_id and request_id in ids:
                delta = _delta(frame, ids.index(request_id), request_id)
                if delta is not None:
                    found.append(delta)
        return found

    def trim(self, records: Mapping[str, "RequestRecord"]) -> None:
        """Read the older half of the entries into the records of the requests still using them (each filed as
        bytes), then drop them."""
        self.users.intersection_update(records)  # forgotten without leaving (their client went away)
        cut = len(self.entries) // 2
        for number, (_client, ids, frame) in enumerate(self.entries[:cut], self.base):
            hits = self.users.intersection(ids)
            if not hits:
                continue
            try:
                deltas = share_deltas(frame)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                logger.warning("a step's share not mirrored: %s", exc)
                continue
            for request_id in hits:
                record = records[request_id]
                index = ids.index(request_id)
                if record.log is self and record.log_from <= number and index < len(deltas):
                    record.file_read(deltas[index].copy())
        del self.entries[:cut]
        self.base += cut


def _delta(frame: bytes, index: int, request_id: str) -> msgspec.Raw | None:
    try:
        deltas = share_deltas(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        logger.warning("request %s: a step's share not mirrored: %s", request_id, exc)
        return None
    return deltas[index].copy() if index < len(deltas) else None
