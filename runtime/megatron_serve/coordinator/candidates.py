"""The engines that may take a request now, kept in least-loaded order, so that dispatch neither lists nor scans them.

An engine is a candidate while it is usable (registered, not draining or stopping, serving the fleet's weights) and
below its in-flight limit. Dispatch used to rebuild that list on every pass and have ``least_loaded`` take its
minimum for every request: a request dispatched into an idle fleet of 1,000 engines cost a pass over all of them.
Here the candidates sit in a heap by :func:`~.routing.load_key`, and an engine is filed again only when something
in its key or its room changed: a request sent to it (dispatch says so), a request leaving it (its
:class:`~.assigned.Assigned` reports it), a heartbeat that moved its free KV blocks. Choosing the least loaded
costs O(log n), and a fleet with no room costs nothing until room appears. When what makes an engine usable may
have moved for all of them at once (an engine registered or left, the fleet's weights moved: :attr:`key`), every
engine is filed again.

Each engine has one valid entry at a time (its version); older entries are skipped when they reach the top, and the
heap is rebuilt when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Mapping

from .peers import EngineRecord
from .routing import load_key

#: One heap entry: the engine's load key, its registration order (the tie-break a scan in that order made), the
#: entry's version, the engine's id.
Entry = tuple[tuple[float, float, int], int, int, str]


class Candidates:
    """Usable engines with room, in least-loaded order (module docstring). ``limit(engine)``: the requests it may
    hold; ``usable(engine)``: whether requests may go to it at all."""

    def __init__(self, limit: Callable[[EngineRecord], int], usable: Callable[[EngineRecord], bool]) -> None:
        self.limit = limit
        self.usable = usable
        self.changed: set[str] = set()  # engines whose load or free blocks moved since the last refresh
        self.key: tuple[object, ...] | None = None  # what the last full filing was made under (see refresh)
        self._heap: list[Entry] = []
        self._members: dict[str, EngineRecord] = {}  # engine id -> the engine, for those with a valid entry
        self._versions: dict[str, int] = {}
        self._order: dict[str, int] = {}  # engine id -> when it was first filed (registration order)
        self._counter = itertools.count()

    def room(self, engine: EngineRecord) -> bool:
        return engine.load < self.limit(engine)

    def refresh(self, engines: Mapping[str, EngineRecord], key: tuple[object, ...]) -> None:
        """File again the engines that changed since the last call; every engine when ``key`` moved (each engine's
        requests then report their leaving to :attr:`changed`)."""
        if key != self.key:
            self.key = key
            self._heap, self._members, self._versions = [], {}, {}
            self._order = {engine_id: order for engine_id, order in self._order.items() if engine_id in engines}
            for engine in engines.values():
                engine.assigned.report_to(self.changed, engine.engine_id)
                self.file(engine)
        else:
            for engine_id in self.changed:
                engine = engines.get(engine_id)
                if engine is not None:
                    self.file(engine)
        self.changed.clear()

    def file(self, engine: EngineRecord) -> None:
        """File ``engine`` under its load now (out, when it has no room or is not usable)."""
        engine_id = engine.engine_id
        versions = self._versions
        version = versions[engine_id] = versions.get(engine_id, 0) + 1
        if not (self.room(engine) and self.usable(engine)):
            self._members.pop(engine_id, None)
            return
        order = self._order.get(engine_id)
        if order is None:
            order = self._order[engine_id] = next(self._counter)
        self._members[engine_id] = engine
        heapq.heappush(self._heap, (load_key(engine), order, version, engine_id))
        if len(self._heap) > 2 * len(self._members) + 64:
            self._compact()

    def blocks_changed(self, engine: EngineRecord) -> None:
        """A heartbeat moved ``engine``'s free KV blocks (the load key's tie-break): filed again if it is a
        candidate (an engine without room stays unlooked at)."""
        if engine.engine_id in self._members:
            self.changed.add(engine.engine_id)

    def least(self) -> EngineRecord | None:
        """The least loaded candidate (ties: more free KV blocks, then the smaller group, then the earlier
        registered), or None; one that became unusable since it was filed (draining, stopping) leaves on the way."""
        heap, members, versions = self._heap, self._members, self._versions
        while heap:
            _, _, version, engine_id = heap[0]
            engine = members.get(engine_id)
            if engine is not None and versions.get(engine_id) == version:
                if self.usable(engine):
                    return engine
                del members[engine_id]
            heapq.heappop(heap)
        return None

    def listed(self, engines: Iterable[EngineRecord]) -> list[EngineRecord]:
        """The candidates among ``engines``, in their order (for a policy or a placement that reads them all)."""
        members = self._members
        return [e for e in engines if e.engine_id in members and self.usable(e)]

    def __bool__(self) -> bool:
        return self.least() is not None

    def _compact(self) -> None:
        versions, members = self._versions, self._members
        self._heap = [entry for entry in self._heap if entry[3] in members and versions.get(entry[3]) == entry[2]]
        heapq.heapify(self._heap)
