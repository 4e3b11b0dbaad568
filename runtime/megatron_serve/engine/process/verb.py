"""A lifecycle verb from the coordinator at a step boundary (:func:`on_verb`): the lifecycle table says whether it
may run now and where it leads, the engine does the work (``engine.call``) and says what to acknowledge."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...wire.controls import Control, LoadLora, Refit
from ...wire.lifecycle import STEPS, Step, engine_state_after
from ...wire.protocol import Header, ProtocolError, step_of
from .drain import begin_drain

if TYPE_CHECKING:
    from .shell import Shell


def on_verb(shell: Shell, header: Header, body: Control) -> None:
    """Run one verb and acknowledge it; the step in flight settles first. STOP is the process's own: it drains, and
    acknowledges once drained (:func:`.drain.drain_finished`)."""
    control_id = body.control_id
    try:
        step = step_of(header, body.phase if isinstance(body, (Refit, LoadLora)) else None)
    except ProtocolError as exc:
        shell.ack(control_id, {"error": str(exc)})
        return
    spec = STEPS[step]
    shell.step(settle=True)
    if shell.state not in spec.requires:
        shell.ack(control_id, {"error": f"{step.value} needs an engine that is "
                                        f"{' or '.join(sorted(s.value for s in spec.requires))}; "
                                        f"this one is {shell.state.value}"})
        return
    if step is Step.STOP:
        shell.stop_control_id = control_id
        timeout = body.drain_timeout
        begin_drain(shell, shell.drain_timeout if timeout is None else float(timeout), "STOP")
        return
    detail = shell.engine.call(step, body)
    if "error" not in detail:
        shell.state = engine_state_after(step, shell.state)
    shell.ack(control_id, detail)
