"""The requests dispatched to one engine, each with the band it was dispatched in, counted per band.

Dispatch asks of every candidate engine whether it has room for a request of some band, counting only the requests
it holds of that band or better (:meth:`~.dispatch.Dispatcher.band_room`). Counting them by scanning the engine's requests made
that question cost as much as the engine held, once per engine per queued request; and counting each by its tenant's
own class ignored that a request promoted after waiting (:mod:`.fair_queue`) was dispatched in a better band, so a
queue of promoted requests always found room and went out whole, past every engine's limit. Here each request keeps
the band it was sent in, and the counts per band are kept as requests come and go: the question costs the number of
bands.
"""

from __future__ import annotations

from typing import Iterator

from ..wire.tenancy import CLASSES, STANDARD_BAND


class Assigned:
    """Request keys of one engine, with the band each was dispatched in (a set's interface, plus :meth:`held`).

    Once dispatch has seen it, a request that leaves adds the engine's id to the set of engines whose load moved
    (:meth:`report_to`, :mod:`.candidates`): dispatch files those again, not every engine."""

    __slots__ = ("_bands", "_by_client", "_clients", "_counts", "_freed", "_owner")

    def __init__(self) -> None:
        self._bands: dict[str, int] = {}
        self._counts = [0] * len(CLASSES)
        self._freed: set[str] | None = None
        self._owner = ""
        self._clients: dict[str, str] = {}  # key -> client id, for the requests whose client the engine was told
        self._by_client: dict[str, set[str]] = {}  # client id -> those keys

    def name_client(self, key: str, client_id: str) -> None:
        """The engine was told ``key``'s client (protocol 11): its deltas may come in that client's share of a step
        (:meth:`of_client`). ``key`` is held."""
        self._clients[key] = client_id
        self._by_client.setdefault(client_id, set()).add(key)

    def of_client(self, client_id: str) -> set[str] | None:
        """The keys held here whose client (``client_id``) the engine was told: those a share of it may name."""
        return self._by_client.get(client_id)

    def report_to(self, freed: set[str], owner: str) -> None:
        """Add ``owner`` (its engine's id) to ``freed`` whenever a request leaves."""
        self._freed, self._owner = freed, owner

    def add(self, key: str, band: int = STANDARD_BAND) -> None:
        """Count ``key`` in ``band`` (again in its new band if it was held already)."""
        self.discard(key)
        self._bands[key] = band
        self._counts[band] += 1

    def discard(self, key: str) -> None:
        band = self._bands.pop(key, None)
        if band is not None:
            self._counts[band] -= 1
            if self._freed is not None:
                self._freed.add(self._owner)
            client_id = self._clients.pop(key, None)
            if client_id is not None:
                keys = self._by_client[client_id]
                keys.discard(key)
                if not keys:
                    del self._by_client[client_id]

    def clear(self) -> None:
        if self._bands and self._freed is not None:
            self._freed.add(self._owner)
        self._bands.clear()
        self._clients.clear()
        self._by_client.clear()
        self._counts = [0] * len(CLASSES)

    def held(self, band: int) -> int:
        """How many requests were dispatched here in ``band`` or a better one."""
        return sum(self._counts[: band + 1])

    def __len__(self) -> int:
        return len(self._bands)

    def __bool__(self) -> bool:
        return bool(self._bands)

    def __contains__(self, key: object) -> bool:
        return key in self._bands

    def __iter__(self) -> Iterator[str]:
        return iter(self._bands)
