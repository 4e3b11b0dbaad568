"""``spec.lifecycle`` <-> coordinator states, and the verbs that lead from one to the other.

Pure functions (DESIGN sections 5 and 8). The coordinator's state machine:
RUNNING <-> PAUSED (PAUSE / UNPAUSE); PAUSED -> SUSPENDED (SUSPEND); SUSPENDED -> PAUSED (RESUME);
any -> STOPPED (STOP); STOPPED -> RUNNING (UNPAUSE). The operator always walks it explicitly,
one acknowledged verb at a time: Running -> Suspended is PAUSE then SUSPEND, Suspended -> Running
is RESUME then UNPAUSE.
"""

from __future__ import annotations

RUNNING, PAUSED, SUSPENDED, STOPPED = "RUNNING", "PAUSED", "SUSPENDED", "STOPPED"
STATES = (RUNNING, PAUSED, SUSPENDED, STOPPED)

TO_STATE = {"Running": RUNNING, "Paused": PAUSED, "Suspended": SUSPENDED, "Shutdown": STOPPED}
TO_LIFECYCLE = {state: lifecycle for lifecycle, state in TO_STATE.items()}

VERBS = ("pause", "unpause", "suspend", "resume", "stop")

# verb -> state it leads to (when legal)
_EDGES: dict[str, dict[str, str]] = {
    RUNNING: {"pause": PAUSED, "stop": STOPPED},
    PAUSED: {"unpause": RUNNING, "suspend": SUSPENDED, "stop": STOPPED},
    SUSPENDED: {"resume": PAUSED, "stop": STOPPED},
    STOPPED: {"unpause": RUNNING},
}


def target_state(lifecycle: str) -> str:
    try:
        return TO_STATE[lifecycle]
    except KeyError:
        raise ValueError(f"unknown lifecycle {lifecycle!r}; expected one of {', '.join(TO_STATE)}") from None


def lifecycle_of(state: str | None) -> str | None:
    """The ``spec.lifecycle`` value a coordinator state corresponds to (None when unknown)."""
    return TO_LIFECYCLE.get((state or "").upper())


def next_state(state: str, verb: str) -> str:
    try:
        return _EDGES[state][verb]
    except KeyError:
        raise ValueError(f"{verb.upper()} is not a legal transition from {state}") from None


def plan(current: str, target: str) -> list[str]:
    """The shortest list of verbs that takes the coordinator from ``current`` to ``target``.

    >>> plan("RUNNING", "SUSPENDED")
    ['pause', 'suspend']
    >>> plan("SUSPENDED", "RUNNING")
    ['resume', 'unpause']
    """
    current, target = current.upper(), target.upper()
    if current not in STATES or target not in STATES:
        raise ValueError(f"unknown coordinator state: {current if current not in STATES else target}")
    # breadth-first search over the (tiny) state machine gives the shortest legal path
    frontier: list[tuple[str, list[str]]] = [(current, [])]
    seen = {current}
    while frontier:
        state, path = frontier.pop(0)
        if state == target:
            return path
        for verb, nxt in _EDGES[state].items():
            if nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, path + [verb]))
    raise ValueError(f"no path from {current} to {target}")  # pragma: no cover - the graph is connected
