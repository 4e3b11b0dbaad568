"""The lifecycle walk: take the coordinator from its state to the desired one, one acknowledged verb at a time.

The path comes from the runtime's lifecycle table (:func:`megatron_operator.lifecycle.plan`: only
one-step edges, so Running -> Suspended is PAUSE then SUSPEND and every state passed through is
acknowledged and reported). The walk stops at the first verb that is refused or not acknowledged;
the next reconcile pass starts again from whatever state the coordinator then reports (by level).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import lifecycle
from .coordinator_link import CoordinatorLink, CoordinatorRejected, CoordinatorUnavailable
from .reconcile import Event


@dataclass
class Walk:
    """Where a walk ended and what it has to report."""

    state: str | None  # the coordinator's state after the last acknowledged verb
    message: str = ""  # for status.lifecycle.message ("" when nothing was sent)
    error: bool = False  # a verb was refused, not acknowledged, or no path exists
    link_lost: bool = False  # the link failed: drop it, the next pass reconnects
    events: list[Event] = field(default_factory=list)


async def walk(link: CoordinatorLink, current: str | None, target: str, *, command_timeout: float,
               drain_timeout: float, pause_mode: str = "keep", keep_kv: bool = False) -> Walk:
    """Send the verbs from ``current`` to ``target``, each acknowledged before the next.

    STOP gets ``drain_timeout`` for the engines to finish their work, and that much more time for
    its acknowledgement. PAUSE goes in ``pause_mode`` (``spec.pauseMode``); in ``wait`` mode running
    requests get ``drain_timeout`` to finish, and the acknowledgement that much more time too. SUSPEND
    keeps the KV of the requests in flight with ``keep_kv`` (``spec.suspendKeepKV``).
    """
    result = Walk(current)
    if current is None:
        return result
    try:
        verbs = lifecycle.plan(current, target)
    except ValueError as exc:
        result.error, result.message = True, str(exc)
        return result
    for verb in verbs:
        if verb == "stop":
            call = link.command(verb, command_timeout + drain_timeout, drain_timeout=drain_timeout)
        elif verb == "pause":
            waits = pause_mode == "wait"
            call = link.command(verb, command_timeout + (drain_timeout if waits else 0.0),
                                drain_timeout=drain_timeout if waits else None, pause_mode=pause_mode)
        elif verb == "suspend":
            call = link.command(verb, command_timeout, keep_kv=keep_kv)
        else:
            call = link.command(verb, command_timeout)
        try:
            ack = await call
        except CoordinatorRejected as exc:
            result.error, result.message = True, str(exc)
            result.events.append(("Warning", "LifecycleRejected", str(exc)))
            return result
        except CoordinatorUnavailable as exc:
            result.error, result.link_lost, result.message = True, True, str(exc)
            result.events.append(("Warning", "LifecycleTimeout", str(exc)))
            return result
        state = str(ack.get("state") or lifecycle.next_state(result.state or current, verb)).upper()
        name = (f"PAUSE ({pause_mode})" if verb == "pause" else "SUSPEND (keep_kv)" if verb == "suspend" and keep_kv
                else verb.upper())
        message = f"{name} acknowledged: {result.state} -> {state}"
        detail = ack.get("detail")
        if detail:
            message += f" ({short(detail)})"
        result.events.append(("Normal", "Lifecycle", message))
        result.message, result.state = message, state
    return result


def short(detail: Any, limit: int = 200) -> str:
    """``detail`` as text of at most ``limit`` characters (for events)."""
    text = str(detail)
    return text if len(text) <= limit else text[: limit - 3] + "..."
