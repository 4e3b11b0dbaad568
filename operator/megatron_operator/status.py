"""``status`` of a MegatronInference: phase, lifecycle, engines, endpoint, conditions (pure).

:func:`compute` builds the whole desired status from what one reconcile pass observed;
:func:`changes` reduces it to the keys that differ from the stored status, so that a pass
that observes nothing new writes nothing. Condition ``lastTransitionTime`` and
``lifecycle.since`` only move when the corresponding status actually changes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from .crd import CONDITION_TYPES

STEADY_PHASES = {"Ready", "Paused", "Suspended", "Degraded"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Observation:
    """What one reconcile pass saw."""

    generation: int | None
    desired_lifecycle: str | None = None
    spec_error: str | None = None
    coordinator_ok: bool = False
    coordinator_message: str = ""
    observed_lifecycle: str | None = None  # from the coordinator's state (None when unknown)
    lifecycle_message: str = ""
    lifecycle_error: bool = False
    engines_desired: int = 0
    engines_ready: int = 0
    engines_connected: int = 0
    engines_unschedulable: str = ""  # why engine pods wait (the scheduler's reason; :mod:`.scheduling`)
    endpoint: str | None = None
    selector: str | None = None
    model: dict[str, Any] | None = None  # status.model: the weights served (kept as it was when None)
    groups: list[dict[str, Any]] | None = None  # status.groups: the gangs' ranks (None: no gangs)
    roles: list[dict[str, Any]] | None = None  # status.roles: each group's prefill/decode part (None: colocated)
    kv_events: dict[str, Any] | None = None  # status.kvEvents: where the engines' KV events are (None: not published)
    rolling: str = ""  # the engine groups on their current template and not Ready yet ("": none)
    rollout_halted: str = ""  # why the rollout is halted (spec.rollout.progressDeadlineSeconds; "": it is not)


def _condition(previous: dict[str, dict[str, Any]], ctype: str, ok: bool, reason: str, message: str,
               generation: int | None, now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(ctype) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status and old.get("lastTransitionTime") else now
    cond: dict[str, Any] = {"type": ctype, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _engines_condition(previous: dict[str, dict[str, Any]], obs: Observation, ok: bool, generation: int | None,
                       now: str) -> dict[str, Any]:
    message = (f"{obs.engines_ready}/{obs.engines_desired} engine groups ready, "
               f"{obs.engines_connected} connected to the coordinator")
    reason = "AllReady" if ok else "NotReady"
    if not ok and obs.engines_unschedulable:
        reason, message = "Unschedulable", f"{message}; {obs.engines_unschedulable}"
    return _condition(previous, "EnginesReady", ok, reason, message, generation, now)


def _phase(obs: Observation, previous_phase: str | None, previous_generation: int | None,
           synced: bool, engines_ok: bool) -> str:
    if obs.spec_error:
        return "Failed"
    if obs.desired_lifecycle == "Shutdown":
        stopped = obs.observed_lifecycle == "Shutdown" or not obs.coordinator_ok
        return "Shutdown" if stopped and obs.engines_ready == 0 else "Progressing"
    if obs.coordinator_ok and synced and engines_ok:
        return {"Running": "Ready", "Paused": "Paused", "Suspended": "Suspended"}.get(obs.observed_lifecycle or "",
                                                                                     "Progressing")
    was_steady = previous_phase in STEADY_PHASES and previous_generation == obs.generation
    if was_steady:
        return "Degraded"
    if not obs.coordinator_ok and obs.engines_ready == 0 and previous_phase in (None, "Pending"):
        return "Pending"
    return "Progressing"


def compute(previous: dict[str, Any] | None, obs: Observation, now: str | None = None) -> dict[str, Any]:
    previous = previous or {}
    now = now or now_iso()
    prev_conditions = {c.get("type"): c for c in previous.get("conditions") or [] if isinstance(c, dict)}
    prev_lifecycle = previous.get("lifecycle") or {}
    gen = obs.generation

    if obs.spec_error:
        # Leave what we knew about the fleet as it was; only validity and readiness change.
        status = {k: v for k, v in previous.items() if k not in ("conditions", "phase", "observedGeneration")}
        conditions = dict(prev_conditions)
        conditions["SpecValid"] = _condition(prev_conditions, "SpecValid", False, "InvalidSpec", obs.spec_error, gen, now)
        conditions["Ready"] = _condition(prev_conditions, "Ready", False, "InvalidSpec",
                                         "the spec is invalid; running children are left untouched", gen, now)
        status["phase"] = "Failed"
        if gen is not None:
            status["observedGeneration"] = gen
        status["conditions"] = [conditions[t] for t in CONDITION_TYPES if t in conditions]
        return status

    observed = obs.observed_lifecycle or prev_lifecycle.get("observed")
    synced = obs.coordinator_ok and not obs.lifecycle_error and observed == obs.desired_lifecycle
    if obs.coordinator_ok:
        engines_ok = obs.engines_ready >= obs.engines_desired and obs.engines_connected >= obs.engines_desired
    else:
        engines_ok = obs.engines_ready >= obs.engines_desired
    lifecycle: dict[str, Any] = {"desired": obs.desired_lifecycle}
    if observed:
        lifecycle["observed"] = observed
        lifecycle["since"] = prev_lifecycle.get("since") if prev_lifecycle.get("observed") == observed \
            and prev_lifecycle.get("since") else now
    lifecycle["message"] = obs.lifecycle_message

    c = {
        "SpecValid": _condition(prev_conditions, "SpecValid", True, "Valid", "the spec is valid", gen, now),
        "CoordinatorReady": _condition(prev_conditions, "CoordinatorReady", obs.coordinator_ok,
                                       "Reachable" if obs.coordinator_ok else "Unreachable",
                                       obs.coordinator_message, gen, now),
        "EnginesReady": _engines_condition(prev_conditions, obs, engines_ok, gen, now),
        "LifecycleSynced": _condition(
            prev_conditions, "LifecycleSynced", synced,
            "Synced" if synced else ("Failed" if obs.lifecycle_error else "Pending"),
            obs.lifecycle_message, gen, now),
    }
    if obs.rollout_halted:
        c["Progressing"] = _condition(prev_conditions, "Progressing", False, "ProgressDeadlineExceeded",
                                      obs.rollout_halted, gen, now)
    elif obs.rolling:
        c["Progressing"] = _condition(prev_conditions, "Progressing", True, "GroupsUpdating",
                                      f"not Ready yet on their current template: {obs.rolling}", gen, now)
    else:
        c["Progressing"] = _condition(prev_conditions, "Progressing", True, "Complete",
                                      "every engine group is on its current template", gen, now)
    not_ready = [t for t in ("CoordinatorReady", "EnginesReady", "LifecycleSynced", "Progressing")
                 if c[t]["status"] != "True"]
    c["Ready"] = _condition(prev_conditions, "Ready", not not_ready,
                            "AllReady" if not not_ready else f"{not_ready[0]}False",
                            "all conditions are met" if not not_ready else c[not_ready[0]]["message"], gen, now)
    status = {
        "phase": _phase(obs, previous.get("phase"), previous.get("observedGeneration"), synced, engines_ok),
        "lifecycle": lifecycle,
        "engines": {"desired": obs.engines_desired, "ready": obs.engines_ready,
                    "connected": obs.engines_connected},
        "endpoint": obs.endpoint,
        "selector": obs.selector,
        "model": obs.model,
        "groups": obs.groups,
        "roles": obs.roles,
        "kvEvents": obs.kv_events,
        "conditions": [c[t] for t in CONDITION_TYPES],
    }
    if gen is not None:
        status["observedGeneration"] = gen
    return {k: v for k, v in status.items() if v is not None}


def changes(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The top-level status keys of ``new`` that differ from ``previous`` (a merge patch)."""
    previous = previous or {}
    delta = {key: value for key, value in new.items() if previous.get(key) != value}
    for key in ("groups", "roles", "kvEvents"):  # no gangs, roles or events any more (the spec's field removed)
        if key in previous and key not in new:
            delta[key] = None
    if isinstance(delta.get("model"), dict) and isinstance(previous.get("model"), dict):
        # a merge patch keeps nested keys it does not name: drop the ones the new status.model lacks
        delta["model"] = {**{k: None for k in previous["model"] if k not in delta["model"]}, **delta["model"]}
    return delta
