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
    from .shell import Shell

logger = logging.getLogger("megatron_serve.engine_process")

HANDBACK_ACK_WAIT = 5.0


def begin_drain(shell: Shell, timeout: float, why: str) -> None:
    if shell.drain_deadline is None:
        shell.drain_deadline = time.monotonic() + max(0.0, timeout)
        load = shell.engine.load()
        logger.info("%s: draining (%d running, %d waiting; up to %.0fs)", why, load.running, load.waiting, timeout)
        shell.send(Header.DRAINING, {"engine_id": shell.engine_id})
        shell.publish_stats(force=True)


def drain_finished(shell: Shell) -> bool:
    """Hand back what is left once done, timed out, or unable to step; True when we may exit."""
    engine = shell.engine
    stepping = shell.state is FleetState.RUNNING
    if engine.has_unfinished_requests() and stepping and time.monotonic() < shell.drain_deadline:
        return False
    shell.step(settle=True)
    rest = engine.take_unfinished_requests()
    ids = [r.request_id for r in rest]
    for request_id in ids:  # handed back: no more deltas of theirs here
        shell.routes.pop(request_id, None)
    if not shell.session:
        logger.info("exiting without a coordinator (%d unfinished request(s) dropped)", len(ids))
        return True
    stopping = shell.stop_control_id is not None
    shell.handback_acked = False
    shell.send(Header.HANDBACK, {"engine_id": shell.engine_id, "request_ids": ids, "final": not stopping})
    deadline = time.monotonic() + HANDBACK_ACK_WAIT
    while not shell.handback_acked and time.monotonic() < deadline and not shell.fatal:
        try:
            event = shell.link.inbox.get(timeout=0.05)
        except queue.Empty:
            continue
        if event[0] == "message" and event[1] is Header.HANDBACK:
            shell.handback_acked = True
        elif event[0] == "registered":
            break  # a new coordinator: it never had these requests
    if stopping:
        shell.state = FleetState.STOPPED
        shell.ack(shell.stop_control_id, {"handed_back": len(ids)})
    logger.info("drained: %d request(s) handed back%s; exiting", len(ids),
                "" if shell.handback_acked else " (no acknowledgement from the coordinator)")
    return True
