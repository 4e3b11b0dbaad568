"""Who holds the server's weight updates now, and how long they may hold them without moving.

One weight operation runs at a time: a trainer's group being joined, a broadcast being received, a REFIT. A call
that finds one under way is answered at once, 409 naming it and the trainer it belongs to, instead of queueing
behind it (a queued call of a second trainer waited as long as the first trainer's transfer could last, 300 s a
step, and then ran against a group it did not make). What ends an operation early:

* a new trainer's init (``/init_weight_transfer_engine``, ``/init_weights_update_group``, ...), once the operation
  (or the update it belongs to, between ``start`` and ``finish``) has moved nothing for :data:`STALL_S` seconds:
  the old trainer is taken to be gone, its group left, what it staged dropped, and the newcomer joins;
* ``POST /abort_weight_update``, whatever the operation, at once.

An ended receive's thread goes on until its own trainer or the group's timeout ends it (a collective blocked in
gloo or NCCL cannot be interrupted from outside); its group is left when it does, and nothing it read is used. A
REFIT into the fleet is never ended from here: the fleet's transaction bounds it and loads all or nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..errors import APIError

logger = logging.getLogger("megatron_serve.server")

#: Seconds without progress (a call of the update's trainer, a broadcast received) after which a new trainer's init
#: ends the operation or started update in its way.
STALL_S = 20.0


@dataclass
class Operation:
    """One weight operation under way: what it does, for whom, since when; ``ended``: set (with the reason) when it
    was ended from outside; ``preemptible``: False while the fleet loads (the REFIT finishes on its own)."""

    what: str
    owner: str
    since: float = field(default_factory=time.monotonic)
    ended: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    preemptible: bool = True
    thread: asyncio.Future[Any] | None = None  # the blocking call it waits on, if any


class Slot:
    """The one weight operation at a time, the started update's owner, and the last sign of life of either."""

    def __init__(self, stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self.current: Operation | None = None
        self.started_by: str | None = None  # the owner of an update between its start and its finish
        self.moved_at = time.monotonic()

    def touch(self) -> None:
        """Progress: the owner called, or a broadcast arrived (called from the receiving thread too)."""
        self.moved_at = time.monotonic()

    def still_for(self) -> float:
        return time.monotonic() - self.moved_at

    @contextlib.asynccontextmanager
    async def hold(self, what: str, owner: str) -> AsyncIterator[Operation]:
        """Run one operation; 409 at once if another is under way."""
        if self.current is not None:
            raise self.busy()
        op = self.current = Operation(what, owner)
        self.touch()
        try:
            yield op
        finally:
            if self.current is op:
                self.current = None

    def busy(self, op: Operation | None = None) -> APIError:
        """The answer to a call that finds an operation (``op``: the one under way, by default) or a started update
        in its way."""
        op = op or self.current
        if op is not None:
            doing, owner, age = op.what, op.owner, time.monotonic() - op.since
        else:
            doing, owner, age = "an update started and not finished", self.started_by or "?", self.still_for()
        # whole seconds passed, never rounded up: "last progress 20 s ago" beside "takes over once it has made no
        # progress for 20 s" must mean the next init takes over (rounded, 19.5 s read as 20 and the init got a 409)
        return APIError(409, f"a weight update is in progress: {doing}, for {owner}, {int(age)} s so far, last progress "
                             f"{int(self.still_for())} s ago. A new trainer's init takes over once it has made no "
                             f"progress for {self.stall_s:.0f} s; POST /abort_weight_update ends it now",
                        code="weight_update_in_progress", type="invalid_request_error")

    def in_the_way(self, newcomer: str) -> str | None:
        """For a new trainer's init: None when nothing is in its way; the reason to end what is, once that has
        stalled for :attr:`stall_s` (logged); 409 while it still moves."""
        op = self.current
        if op is None and self.started_by is None:
            return None
        if (op is not None and not op.preemptible) or self.still_for() < self.stall_s:
            raise self.busy()
        stalled = f"{op.what} for {op.owner}" if op is not None else f"the update started by {self.started_by}"
        logger.warning("weight update stalled: %s made no progress for %.0f s; ended for %s", stalled,
                       self.still_for(), newcomer)
        return f"taken over by {newcomer} after {self.still_for():.0f} s without progress"

    def end(self, reason: str) -> bool:
        """End what is under way (``/abort_weight_update``, a take-over): its route answers 503 with ``reason``, the
        started update is forgotten. False when there was nothing to end."""
        op, self.current, started, self.started_by = self.current, None, self.started_by, None
        if op is not None and not op.ended.done():
            op.ended.set_result(reason)
        return op is not None or started is not None
