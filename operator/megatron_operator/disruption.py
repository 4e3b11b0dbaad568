"""The fleet's PodDisruptionBudgets (``spec.disruptionBudget``), which a node drain's evictions obey.

Without them ``kubectl drain`` of a node (the Eviction API) evicts every engine pod on it at once: a fleet whose
groups share a node loses all of them together, and the requests they hand back have nowhere to go. With them:

- ``<name>-engine`` selects every engine pod and allows ``maxUnavailableGroups`` groups' worth of pods to be gone
  at once; the eviction of the next waits (HTTP 429) until the evicted group's replacement is Ready again. An
  engine pod counts as available once Ready, and it is Ready only once registered with the coordinator, so the
  next group goes only when the last one serves again. Each evicted pod drains first (SIGTERM, preStop,
  ``terminationGracePeriodSeconds``).

  The budget says so as ``minAvailable`` = (groups - maxUnavailableGroups) x pods per group, a count of Ready pods,
  and not as ``maxUnavailable``: for ``maxUnavailable`` the disruption controller takes the number of pods expected
  from the controllers of the pods that exist now, and each group is a StatefulSet of its own. Once an evicted
  group's last pod is gone and before its StatefulSet has made the replacement (or for as long as it cannot make
  one), that StatefulSet is not counted, the budget expects one group fewer and allows one more eviction: a drain,
  whose evictions run side by side, then takes two groups at once (docs/kubernetes/rollouts.md). ``minAvailable``
  counts only the pods Ready now, so nothing the StatefulSets have not made yet opens it. The operator renders it
  again whenever the number of groups changes (the scale subresource included).
- ``<name>-coordinator`` keeps the coordinator's only pod (a ``Recreate`` Deployment of one) from being evicted.

Both let a pod that is not Ready be evicted whatever the budget says (``unhealthyPodEvictionPolicy: AlwaysAllow``):
it serves nothing, and a crash-looping engine must not hold a drain up. Kubernetes refuses to evict a pod that
several budgets select, so each pod is selected by exactly one.
"""

from __future__ import annotations

from typing import Any

from .names import coordinator_name, object_meta, selector_labels
from .spec import InferenceSpec


def engine_budget_name(name: str) -> str:
    return f"{name}-engine"


def _budget(spec: InferenceSpec, name: str, component: str, limit: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(spec, name, component),
        "spec": {**limit, "selector": {"matchLabels": selector_labels(spec.name, component)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def render_budgets(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The budgets ``spec.disruptionBudget`` asks for (none when it is disabled)."""
    budget = spec.disruption_budget
    if not budget["enabled"]:
        return []
    available_groups = max(spec.data - int(budget["maxUnavailableGroups"]), 0)
    objects = [_budget(spec, engine_budget_name(spec.name), "engine",
                       {"minAvailable": available_groups * spec.pods_per_group})]
    if budget["protectCoordinator"]:
        objects.append(_budget(spec, coordinator_name(spec.name), "coordinator", {"minAvailable": 1}))
    return objects


def budget_names(name: str) -> tuple[str, ...]:
    """Every budget a resource called ``name`` may have (the reconciler deletes those the spec no longer asks for)."""
    return engine_budget_name(name), coordinator_name(name)
