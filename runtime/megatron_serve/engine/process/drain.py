"""Draining (SIGTERM, or STOP from the coordinator): stop being routed to, step until the work is done or the time
is up (:func:`begin_drain`), then hand the rest back and say whether the process may exit (:func:`drain_finished`)."""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from ...wire.lifecycle import FleetState
from ...wire.protocol import Header

if TYPE_CHECKING:
    from .loop import EngineProcess

logger = logging.getLogger("megatron_serve.engine_process")

HANDBACK_ACK_WAIT = 5.0


def begin_drain(proc: EngineProcess, timeout: float, why: str) -> None:
    if proc.drain_deadline is None:
        proc.drain_deadline = time.monotonic() + max(0.0, timeout)
        load = proc.engine.load()
        logger.info("%s: draining (%d running, %d waiting; up to %.0fs)", why, load.running, load.waiting, timeout)
        proc.send(Header.DRAINING, {"engine_id": proc.engine_id})
        proc.publish_stats(force=True)


def drain_finished(proc: EngineProcess) -> bool:
    """Hand back what is left once done, timed out, or unable to step; True when we may exit."""
    engine = proc.engine
    stepping = proc.state is FleetState.RUNNING
    if engine.has_unfinished_requests() and stepping and time.monotonic() < proc.drain_deadline:
        return False
    proc.step(settle=True)
    rest = engine.take_unfinished_requests()
    ids = [r.request_id for r in rest]
    if not proc.session:
        logger.info("exiting without a coordinator (%d unfinished request(s) dropped)", len(ids))
        return True
    stopping = proc.stop_control_id is not None
    proc.handback_acked = False
    proc.send(Header.HANDBACK, {"engine_id": proc.engine_id, "request_ids": ids, "final": not stopping})
    deadline = time.monotonic() + HANDBACK_ACK_WAIT
    while not proc.handback_acked and time.monotonic() < deadline and not proc.fatal:
        try:
            event = proc.link.inbox.get(timeout=0.05)
        except queue.Empty:
            continue
        if event[0] == "message" and event[1] is Header.HANDBACK:
            proc.handback_acked = True
        elif event[0] == "registered":
            break  # a new coordinator: it never had these requests
    if stopping:
        proc.state = FleetState.STOPPED
        proc.ack(proc.stop_control_id, {"handed_back": len(ids)})
    logger.info("drained: %d request(s) handed back%s; exiting", len(ids),
                "" if proc.handback_acked else " (no acknowledgement from the coordinator)")
    return True
