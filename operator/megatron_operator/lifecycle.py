"""``spec.lifecycle`` <-> coordinator states, and the verbs that lead from one to the other.

The state machine itself is the runtime's one table (:mod:`megatron_serve.wire.lifecycle`); this module
only names its states the way the resource does and walks it: one acknowledged verb at a time,
over one-step edges, so Running -> Suspended is PAUSE then SUSPEND and Suspended -> Running is
RESUME then UNPAUSE (docs/kubernetes/lifecycle.md).
"""

from __future__ import annotations

from megatron_serve.wire.lifecycle import FleetState, next_state as _next_state, walk

RUNNING, PAUSED, SUSPENDED, STOPPED = (state.value for state in FleetState)
STATES = tuple(state.value for state in FleetState)

TO_STATE = {"Running": RUNNING, "Paused": PAUSED, "Suspended": SUSPENDED, "Shutdown": STOPPED}
TO_LIFECYCLE = {state: lifecycle for lifecycle, state in TO_STATE.items()}


def target_state(lifecycle: str) -> str:
    try:
        return TO_STATE[lifecycle]
    except KeyError:
        raise ValueError(f"unknown lifecycle {lifecycle!r}; expected one of {', '.join(TO_STATE)}") from None


def lifecycle_of(state: str | None) -> str | None:
    """The ``spec.lifecycle`` value a coordinator state corresponds to (None when unknown)."""
    return TO_LIFECYCLE.get((state or "").upper())


def next_state(state: str, verb: str) -> str:
    """Where ``verb`` leads from ``state``; ``ValueError`` when the table refuses it there."""
    return _next_state(state, verb).value


def plan(current: str, target: str) -> list[str]:
    """The verbs (names as the client's methods) that take the coordinator from ``current`` to ``target``.

    >>> plan("RUNNING", "SUSPENDED")
    ['pause', 'suspend']
    >>> plan("SUSPENDED", "RUNNING")
    ['resume', 'unpause']
    """
    return [verb.value for verb in walk(current, target)]
