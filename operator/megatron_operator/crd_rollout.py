"""The schema of the day-2 fields: ``spec.disruptionBudget`` (voluntary disruption) and ``spec.rollout`` (its deadline).

Part of the CRD of :mod:`megatron_operator.crd` (which imports this module, never the reverse).

A node drain (``kubectl drain``, the Eviction API) and a rolling update both take engine groups away; the first
asks the PodDisruptionBudgets rendered from ``disruptionBudget`` (:mod:`.disruption`), the second is paced by the
operator (one group at a time) and halted past ``rollout.progressDeadlineSeconds``.
"""

from __future__ import annotations

from typing import Any

from .crd_fields import int_field, obj_field

#: Deployments' own default (``spec.progressDeadlineSeconds``).
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600


def disruption_budget_schema() -> dict[str, Any]:
    """``spec.disruptionBudget``: the PodDisruptionBudgets of the fleet."""
    return obj_field(
        "PodDisruptionBudgets of the fleet, which a node drain (the Eviction API) obeys: the engine pods' "
        "budget lets at most maxUnavailableGroups engine groups be evicted at once (each drains first), and "
        "the coordinator's keeps its only pod from being evicted.",
        {
            "enabled": {"type": "boolean", "default": True,
                        "description": "Render the budgets (false: none; a drain may evict every engine at once)."},
            "maxUnavailableGroups": int_field(
                "Engine groups a voluntary disruption may take at once (the budget counts pods: this many "
                "groups' pods). 0 blocks every eviction of an engine pod.", minimum=0, maximum=1024, default=1),
            "protectCoordinator": {"type": "boolean", "default": True, "description": (
                "Keep the coordinator's pod from being evicted while it is the only one (a drain of its node "
                "waits until it is deleted by hand or this is false).")},
        },
        default={},
    )


def rollout_schema() -> dict[str, Any]:
    """``spec.rollout``: how a new engine template rolls out."""
    return obj_field(
        "Rolling updates of the engine groups (one group at a time).",
        {
            "progressDeadlineSeconds": int_field(
                "A group on a new template that is not Ready (registered and warmed up) within this many "
                "seconds halts the rollout: no further group is touched, the old groups keep serving, and "
                "the status says Progressing=False, reason ProgressDeadlineExceeded (as a Deployment's). "
                "Reverting the spec rolls the moved groups back one at a time.",
                minimum=1, maximum=86400, default=DEFAULT_PROGRESS_DEADLINE_SECONDS),
        },
        default={},
    )
