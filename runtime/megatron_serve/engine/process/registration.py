"""A registration with a coordinator, the first or again after a reconnect (:func:`on_registered`): a new session,
the engine brought to what the fleet serves (``engine.call(REGISTER, ack)``), and the state the coordinator said."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...wire.lifecycle import FleetState
from ...wire.handshake import HelloAck
from ...wire.protocol import Header
from ..verbs.actions import REGISTER

if TYPE_CHECKING:
    from .shell import Shell

logger = logging.getLogger("megatron_serve.engine_process")


def on_registered(shell: Shell, ack: HelloAck, session: int) -> None:
    # Registering may take minutes (loading the fleet's weights, resuming): meanwhile the loop's count says nothing,
    # and heartbeats carry none (the coordinator reads that as "unknown") until ``link.registered(session)``.
    link, engine = shell.link, shell.engine
    if shell.session:
        dropped = engine.take_unfinished_requests(forget_transfers=True)
        logger.warning("registered again with coordinator %s: dropped %d in-flight request(s) "
                       "(the coordinator re-queued them)", ack.coordinator_id, len(dropped))
    shell.session = session
    shell.engine_id = ack.engine_id
    shell.routes.clear()  # its requests' clients, of the registration before (re-queued there)
    if ack.kv_events:  # the coordinator's routing reads them: its index starts from what the engine holds now
        engine.kv_events.attach(shell.send_kv_events)
    else:  # not gathered at all unless another sink (--kv-events-config) wants them
        engine.kv_events.detach(shell.send_kv_events)
    logger.info("registered with coordinator %s as %s (group %s), state %s", ack.coordinator_id,
                shell.engine_id, ack.engine_group, ack.state)
    problem = engine.call(REGISTER, ack).get("error")
    if problem is not None:
        shell.fatal = problem
        return
    target = ack.state
    if target == FleetState.SUSPENDED.value:
        shell.state = FleetState.SUSPENDED
    else:  # a STOPPED coordinator: wait paused until it is restarted with UNPAUSE
        shell.state = FleetState.RUNNING if target == FleetState.RUNNING.value else FleetState.PAUSED
    if shell.drain_deadline is not None:
        shell.send(Header.DRAINING, {"engine_id": shell.engine_id})
    shell.publish_stats(force=True)
    link.registered(session)
