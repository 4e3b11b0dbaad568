"""The fleet lifecycle as one table: states, verbs, transitions, and what each step does on an engine.

Every component that needs the lifecycle reads it from here and nowhere else: the coordinator
(which verb is legal in which state, which engine steps it broadcasts, each step's deadline), the
engine process (what a step does to its own state), the operator (the walk from the observed to
the desired state), the ``control`` command and the client (the verbs; how each is called, its
arguments, is :mod:`.verb_calls`), and the metrics (the states). Pure, standard library only: the
operator imports it without the runtime's dependencies.

A verb (what a client asks for) runs as a list of *steps* (what every engine is told, each
acknowledged by every engine before the next one is sent). Decisions this table makes (they used to
be encoded twice, and the two copies disagreed):

* ``SUSPEND`` from ``RUNNING`` is legal and runs two steps, ``PAUSE`` then ``SUSPEND`` (the Python
  API's ``suspend()`` from RUNNING pauses first, never hangs: docs/python-api.md). It is a
  *compound* edge: the operator's walk (:func:`walk`) uses only one-step edges, so it still sends
  PAUSE, then SUSPEND, each acknowledged (docs/kubernetes/lifecycle.md) -- the same table, read at
  a finer grain.
* ``RESUME`` means "device memory resident again". From ``SUSPENDED`` it leads to ``PAUSED``; from
  ``RUNNING`` or ``PAUSED`` memory already is resident, so it is a no-op that still acknowledges and
  leaves the state alone (it never pauses a running fleet). The operator's table used to call it
  illegal there, and ``CONTROL_VERBS[RESUME]`` said it aimed at PAUSED.
* ``PAUSE`` while ``SUSPENDED`` is a no-op with no engine step (not stepping already; memory stays
  released); ``UNPAUSE`` while ``SUSPENDED`` is refused (RESUME first).
* ``STOPPED`` accepts only ``UNPAUSE`` (restarts the fleet once engines joined again) and ``STOP``.
* ``REFIT`` is legal while ``PAUSED`` or ``SUSPENDED`` and keeps the state; it runs two named steps,
  ``REFIT_VERIFY`` (every engine checks the source, none loads) and ``REFIT_LOAD``, each with its
  own deadline. A refit whose source is a rendezvous instead of a directory, or pause modes, add
  arguments to these steps, not rows to this table.
* ``UNPAUSE`` is refused (whatever the state) while an engine holds *incomplete* weights: a refit
  that failed midway (a trainer that died mid-transfer) overwrote some of its tensors and not
  others, so no epoch describes them. The fleet stays paused until a refit completes; see
  :data:`NEEDS_WHOLE_WEIGHTS`. This is a guard on a verb, not a state: the table is unchanged.
* Repeating the current state (PAUSE while PAUSED, STOP while STOPPED ...) re-sends its step, so
  that engines that drifted are put right, and acknowledges with ``noop``.
* ``LOAD_LORA`` and ``UNLOAD_LORA`` (a LoRA adapter, by name) are legal in every state but STOPPED and
  keep it: serving the adapter is not a lifecycle change, but it is fleet-wide and acknowledged like
  one. LOAD_LORA runs ``LORA_VERIFY`` (every engine reads and checks the adapter, none serves it) then
  ``LORA_LOAD``, so that one engine's refusal (a missing path, a rank above ``--max-lora-rank``, a
  module the model lacks, a shape mismatch, a name already loaded) leaves every engine as it was.
* ``RESET_PREFIX_CACHE`` (vLLM's ``reset_prefix_cache``, SGLang's ``flush_cache``) is legal in every state but
  STOPPED and keeps it: every engine forgets every cached prefix block, in every KV tier, between two steps. An
  engine whose running requests hold blocks refuses it in its acknowledgement (``reset: false``) unless the verb
  says ``reset_running_requests``, which first sends them back to be recomputed (vLLM's rule); the verb itself
  is acknowledged either way, each engine saying whether it reset.
* ``SCALE_EP`` (issue 63's resizing) is legal in every state but STOPPED and keeps it: an expert-parallel group of
  data-parallel attention ranks goes to ``size`` ranks. Below its size, the coordinator routes nothing more to the
  ranks from ``size`` on, each hands its requests back (resubmitted to the others) and leaves at the group's next
  turn, and the others regroup without them; above it, the coordinator records the size wanted, and the missing
  ranks' engines, started for the group, join it (``docs/parallelism.md``).
* ``STATUS_DETAIL`` is legal in every state but STOPPED (no engine is left to ask) and keeps it: every engine says, between two of its steps, what it
  holds at that moment (its requests and KV blocks, its weights' epoch and source, its suspend level, its adapters),
  where STATUS reads the coordinator's copy of each engine's last heartbeat. The operator asks it before it acts
  on an engine (a rollout, a scale-down), so that it decides on what the engine holds now.
* PAUSE's :class:`PauseMode` (what happens to the requests the fleet holds) is an argument of the
  verb, not a state: every mode ends in the same PAUSED, with the same engine step, and the fleet
  behaves the same afterwards (it holds what is left and what arrives, until UNPAUSE). The modes
  differ only in what the coordinator does *before* it broadcasts the step (see :class:`PauseMode`),
  so they add no row or column here; the operator's walk, the metrics and the engines are unchanged.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping


class FleetState(str, enum.Enum):
    """Lifecycle state of the fleet (the coordinator's) and of each engine."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"


#: What STATUS shows for an engine that is shutting down (not a fleet state: no verb leads to it).
ENGINE_DRAINING = "DRAINING"


class Verb(str, enum.Enum):
    """What a client, the operator or a human asks of the fleet; the value is the verb's name in the
    ``control`` command, the client's method and the operator's events."""

    PAUSE = "pause"
    UNPAUSE = "unpause"
    SUSPEND = "suspend"
    RESUME = "resume"
    STOP = "stop"
    REFIT = "refit"
    LOAD_LORA = "load_lora"
    UNLOAD_LORA = "unload_lora"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    SCALE_EP = "scale_ep"
    STATUS_DETAIL = "status_detail"


class PauseMode(str, enum.Enum):
    """What PAUSE does with the requests the fleet holds when the verb starts (as vLLM's and SGLang's
    ``pause_generation``). In every mode the coordinator stops dispatching at once, and requests that
    arrive later are queued until UNPAUSE; nothing is dropped.

    * ``keep`` (the default, and what a PAUSE without a mode means): engines stop at the next step
      boundary; running requests keep their KV cache and continue after UNPAUSE.
    * ``wait``: running requests (every request on an engine) run to their end, then engines pause;
      requests still queued at the coordinator are held. The wait is bounded by the verb's
      ``drain_timeout`` (default :data:`DEFAULT_PAUSE_DRAIN_TIMEOUT`): what is still running then is
      paused in place as with ``keep``, and the acknowledgement counts it (``unfinished``).
    * ``abort``: every unfinished request (queued or running) ends at once with ``finish_reason``
      ``abort``, status ``COMPLETED``, and the tokens generated so far (epochs included), so that a
      trainer can resubmit it; then engines pause with nothing left to run.

    In PAUSED a repeated PAUSE applies its mode again (``abort`` ends what ``keep`` held; ``wait`` has
    nothing to wait for: paused engines do not step); in SUSPENDED only ``abort`` does anything.
    """

    KEEP = "keep"
    WAIT = "wait"
    ABORT = "abort"


#: What ``resume`` does with the KV that ``suspend(keep_kv=True)`` kept, when a refit came in between (the engine's
#: ``--kv-on-refit``): ``recompute`` (the default) recomputes every resumed request's context under the new weights;
#: ``keep`` continues on the old KV, which the tokens' ``kv_epochs`` then show.
KV_ON_REFIT = ("recompute", "keep")


#: How long PAUSE in ``wait`` mode lets running requests finish when the caller gives no deadline
#: (STOP's drain default, the engine's ``--drain-timeout``, is the same).
DEFAULT_PAUSE_DRAIN_TIMEOUT = 30.0


def parse_pause_mode(name: PauseMode | str | None, field: str = "mode") -> PauseMode:
    """The pause mode named ``name`` (None: ``keep``); ``ValueError`` naming ``field`` otherwise."""
    if name is None:
        return PauseMode.KEEP
    try:
        return PauseMode(name.lower() if isinstance(name, str) else name)
    except ValueError:
        raise ValueError(f"{field} must be one of {', '.join(m.value for m in PauseMode)}; got {name!r}") from None


def drain_timeout_problem(mode: PauseMode, drain_timeout: object) -> str | None:
    """Why PAUSE's ``drain_timeout`` is refused (None: absent, or fine): it applies to mode ``wait`` only,
    and is a number of seconds >= 0. The client checks before sending, the coordinator on arrival."""
    if drain_timeout is None:
        return None
    if mode is not PauseMode.WAIT:
        return f"drain_timeout applies to mode wait only, not {mode.value}"
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) \
            or not math.isfinite(drain_timeout) or drain_timeout < 0:
        return f"drain_timeout must be a number of seconds >= 0, got {drain_timeout!r}"
    return None


class Deadline(enum.Enum):
    """Which acknowledgement deadline a step gets (the coordinator's ``--*-timeout`` options)."""

    VERB = "verb"  # --verb-timeout: a step that only flips a flag between two engine steps
    WEIGHTS = "weights"  # --weights-timeout: a step that moves weights (checkpoint read, offload, graph capture)
    DRAIN = "drain"  # --verb-timeout plus the drain time the verb gave


class Step(str, enum.Enum):
    """One broadcast to every engine, acknowledged by each."""

    PAUSE = "PAUSE"
    UNPAUSE = "UNPAUSE"
    SUSPEND = "SUSPEND"
    RESUME = "RESUME"
    STOP = "STOP"
    REFIT_VERIFY = "REFIT_VERIFY"
    REFIT_LOAD = "REFIT_LOAD"
    LORA_VERIFY = "LORA_VERIFY"
    LORA_LOAD = "LORA_LOAD"
    LORA_UNLOAD = "LORA_UNLOAD"
    RESET_PREFIX_CACHE = "RESET_PREFIX_CACHE"
    SCALE_EP = "SCALE_EP"
    STATUS_DETAIL = "STATUS_DETAIL"


#: Verbs whose messages carry a ``phase`` saying which of their steps they are.
PHASED_VERBS = frozenset({Verb.REFIT, Verb.LOAD_LORA})


@dataclass(frozen=True)
class StepSpec:
    """What one step is on the wire and what it does to an engine."""

    verb: Verb  # the message it travels as (REFIT's two steps differ by ``phase``)
    deadline: Deadline
    does: str  # what the engine does, for humans (docs, logs)
    moves: Mapping[FleetState, FleetState] = field(default_factory=dict)  # engine state after it; absent: unchanged
    requires: frozenset[FleetState] = frozenset(FleetState)  # engine states it is legal in (else the engine refuses)
    phase: str | None = None  # the ``phase`` field of REFIT and LOAD_LORA


_ANY = tuple(FleetState)
_S = FleetState

STEPS: dict[Step, StepSpec] = {
    Step.PAUSE: StepSpec(Verb.PAUSE, Deadline.VERB, "stop stepping at a step boundary; keep all device memory",
                         {_S.RUNNING: _S.PAUSED}),
    Step.UNPAUSE: StepSpec(Verb.UNPAUSE, Deadline.VERB, "step again (restore device memory first if it was released)",
                           {_S.PAUSED: _S.RUNNING, _S.SUSPENDED: _S.RUNNING, _S.STOPPED: _S.RUNNING}),
    Step.SUSPEND: StepSpec(Verb.SUSPEND, Deadline.WEIGHTS,
                           "release the KV cache (level 2: also offload the weights to host memory)",
                           {_S.RUNNING: _S.SUSPENDED, _S.PAUSED: _S.SUSPENDED}),
    Step.RESUME: StepSpec(Verb.RESUME, Deadline.WEIGHTS,
                          "restore released device memory; running requests continue by recomputation",
                          {_S.SUSPENDED: _S.PAUSED}),
    Step.STOP: StepSpec(Verb.STOP, Deadline.DRAIN, "finish work until the drain time, hand the rest back, exit",
                        {state: _S.STOPPED for state in _ANY}),
    Step.REFIT_VERIFY: StepSpec(Verb.REFIT, Deadline.WEIGHTS,
                                "check that the source's tensors fit the model and are finite; load nothing",
                                requires=frozenset({_S.PAUSED, _S.SUSPENDED}), phase="verify"),
    Step.REFIT_LOAD: StepSpec(Verb.REFIT, Deadline.WEIGHTS, "load the verified source's weights in place",
                              requires=frozenset({_S.PAUSED, _S.SUSPENDED}), phase="load"),
    Step.LORA_VERIFY: StepSpec(Verb.LOAD_LORA, Deadline.VERB, "read and check a LoRA adapter; serve nothing new",
                               phase="verify"),
    Step.LORA_LOAD: StepSpec(Verb.LOAD_LORA, Deadline.VERB, "serve the verified LoRA adapter from the next request on",
                             phase="load"),
    Step.LORA_UNLOAD: StepSpec(Verb.UNLOAD_LORA, Deadline.VERB,
                               "stop serving a LoRA adapter to new requests (running ones finish under it)"),
    Step.RESET_PREFIX_CACHE: StepSpec(Verb.RESET_PREFIX_CACHE, Deadline.VERB,
                                      "forget every cached prefix block in every KV tier (refused while running "
                                      "requests hold blocks, unless they are sent back to be recomputed)"),
    Step.SCALE_EP: StepSpec(Verb.SCALE_EP, Deadline.VERB,
                            "an expert-parallel group of data-parallel attention ranks to N ranks: the ranks from N on "
                            "hand their requests back and leave at the next turn; the others regroup without them"),
    Step.STATUS_DETAIL: StepSpec(Verb.STATUS_DETAIL, Deadline.VERB,
                                 "say what it holds now: requests, KV blocks, weights, suspend level, adapters"),
}


@dataclass(frozen=True)
class Transition:
    """A legal verb in one state: the steps every engine runs, and the state the fleet ends in."""

    target: FleetState
    steps: tuple[Step, ...]


#: Why a verb is refused in a state (an ``ERROR illegal_transition`` with this text).
Refusal = str


def _refit(state: FleetState) -> Transition:
    return Transition(state, (Step.REFIT_VERIFY, Step.REFIT_LOAD))


def _keeping(state: FleetState) -> dict[Verb, Transition | str]:
    """The verbs that keep the fleet's state, legal in ``state``."""
    return {Verb.LOAD_LORA: Transition(state, (Step.LORA_VERIFY, Step.LORA_LOAD)),
            Verb.UNLOAD_LORA: Transition(state, (Step.LORA_UNLOAD,)),
            Verb.RESET_PREFIX_CACHE: Transition(state, (Step.RESET_PREFIX_CACHE,)),
            Verb.SCALE_EP: Transition(state, (Step.SCALE_EP,)),
            Verb.STATUS_DETAIL: Transition(state, (Step.STATUS_DETAIL,))}


_STOP = Transition(_S.STOPPED, (Step.STOP,))
_NOT_WHILE_STOPPED = "{verb} is not allowed while STOPPED (UNPAUSE restarts the fleet)"
_REFIT_NEEDS_PAUSE = "REFIT is only allowed while PAUSED or SUSPENDED; the fleet is {state} (PAUSE first)"

#: The table: state -> verb -> transition, or the reason it is refused.
TABLE: dict[FleetState, dict[Verb, Transition | Refusal]] = {
    _S.RUNNING: {
        Verb.PAUSE: Transition(_S.PAUSED, (Step.PAUSE,)),
        Verb.UNPAUSE: Transition(_S.RUNNING, (Step.UNPAUSE,)),
        Verb.SUSPEND: Transition(_S.SUSPENDED, (Step.PAUSE, Step.SUSPEND)),  # compound: pauses first
        Verb.RESUME: Transition(_S.RUNNING, (Step.RESUME,)),  # memory is resident: a no-op
        Verb.STOP: _STOP,
        Verb.REFIT: _REFIT_NEEDS_PAUSE,
        **_keeping(_S.RUNNING),
    },
    _S.PAUSED: {
        Verb.PAUSE: Transition(_S.PAUSED, (Step.PAUSE,)),
        Verb.UNPAUSE: Transition(_S.RUNNING, (Step.UNPAUSE,)),
        Verb.SUSPEND: Transition(_S.SUSPENDED, (Step.SUSPEND,)),
        Verb.RESUME: Transition(_S.PAUSED, (Step.RESUME,)),  # memory is resident: a no-op
        Verb.STOP: _STOP,
        Verb.REFIT: _refit(_S.PAUSED),
        **_keeping(_S.PAUSED),
    },
    _S.SUSPENDED: {
        Verb.PAUSE: Transition(_S.SUSPENDED, ()),  # not stepping already; memory stays released
        Verb.UNPAUSE: "UNPAUSE is not allowed while SUSPENDED: RESUME first",
        Verb.SUSPEND: Transition(_S.SUSPENDED, (Step.SUSPEND,)),  # maybe a deeper level
        Verb.RESUME: Transition(_S.PAUSED, (Step.RESUME,)),
        Verb.STOP: _STOP,
        Verb.REFIT: _refit(_S.SUSPENDED),
        **_keeping(_S.SUSPENDED),
    },
    _S.STOPPED: {
        Verb.PAUSE: _NOT_WHILE_STOPPED,
        Verb.UNPAUSE: Transition(_S.RUNNING, (Step.UNPAUSE,)),
        Verb.SUSPEND: _NOT_WHILE_STOPPED,
        Verb.RESUME: _NOT_WHILE_STOPPED,
        Verb.STOP: _STOP,
        Verb.REFIT: _REFIT_NEEDS_PAUSE,
        Verb.LOAD_LORA: _NOT_WHILE_STOPPED,
        Verb.UNLOAD_LORA: _NOT_WHILE_STOPPED,
        Verb.RESET_PREFIX_CACHE: _NOT_WHILE_STOPPED,
        Verb.SCALE_EP: _NOT_WHILE_STOPPED,
        Verb.STATUS_DETAIL: _NOT_WHILE_STOPPED,
    },
}


#: Verbs refused while any engine holds incomplete weights (a refit failed midway on it).
NEEDS_WHOLE_WEIGHTS = frozenset({Verb.UNPAUSE})
WEIGHTS_INCOMPLETE = ("{verb} refused: engine(s) {engines} hold incomplete weights (a refit failed midway, e.g. the "
                      "trainer died mid-transfer); REFIT first (a directory, or send the weights again)")


class IllegalTransition(ValueError):
    """A verb the table refuses in the current state; ``str(err)`` says why and what to do."""


def transition(state: FleetState, verb: Verb) -> Transition:
    """The transition of ``verb`` in ``state``; raises :class:`IllegalTransition` when it is refused."""
    entry = TABLE[state][verb]
    if isinstance(entry, str):
        raise IllegalTransition(entry.format(verb=verb.name, state=state.value))
    return entry


def next_state(state: FleetState | str, verb: Verb | str) -> FleetState:
    """Where ``verb`` leads from ``state`` (names accepted in any case, e.g. ``"RUNNING"``, ``"pause"``)."""
    return transition(parse_state(state), parse_verb(verb)).target


def engine_state_after(step: Step, state: FleetState) -> FleetState:
    """An engine's state after it ran ``step`` in ``state``."""
    return STEPS[step].moves.get(state, state)


def parse_state(name: FleetState | str) -> FleetState:
    try:
        return FleetState(name.upper() if isinstance(name, str) else name)
    except ValueError:
        raise ValueError(f"unknown lifecycle state {name!r}; expected one of "
                         f"{', '.join(s.value for s in FleetState)}") from None


def parse_verb(name: Verb | str) -> Verb:
    try:
        return Verb(name.lower() if isinstance(name, str) else name)
    except ValueError:
        raise ValueError(f"unknown verb {name!r}; expected one of {', '.join(v.value for v in Verb)}") from None


def walk(current: FleetState | str, target: FleetState | str) -> list[Verb]:
    """The shortest list of verbs from ``current`` to ``target`` over one-step edges.

    One step per verb means one acknowledgement per state change, so the operator can record and
    report every state the fleet passes through (``RUNNING -> SUSPENDED`` is PAUSE, then SUSPEND).
    """
    start, goal = parse_state(current), parse_state(target)
    frontier: deque[tuple[FleetState, list[Verb]]] = deque([(start, [])])
    seen = {start}
    while frontier:
        state, path = frontier.popleft()
        if state is goal:
            return path
        for verb, entry in TABLE[state].items():
            if isinstance(entry, str) or len(entry.steps) != 1 or entry.target in seen:
                continue
            seen.add(entry.target)
            frontier.append((entry.target, [*path, verb]))
    raise IllegalTransition(f"no path from {start.value} to {goal.value}")  # pragma: no cover - connected


def table_markdown() -> str:
    """The table as Markdown, one row per state (docs/kubernetes/lifecycle.md shows it; a test keeps the two equal)."""
    lines = ["| state | " + " | ".join(v.name for v in Verb) + " |", "|---" * (len(Verb) + 1) + "|"]
    for state, row in TABLE.items():
        cells = []
        for verb in Verb:
            entry = row[verb]
            if isinstance(entry, str):
                cells.append("refused")
            else:
                steps = " + ".join(step.value for step in entry.steps) or "no step"
                cells.append(f"{entry.target.value} ({steps})")
        lines.append(f"| {state.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
