"""``kubectl drain`` of a node holding every engine group, on a real control plane, with and without the fleet's
PodDisruptionBudgets (``spec.disruptionBudget``).

Real: kube-apiserver's Eviction API (which asks the budgets), the disruption controller (which keeps each budget's
``disruptionsAllowed`` from the pods' Ready conditions), the StatefulSet controller (which makes each evicted pod
again), the scheduler (which binds it to the pool's other node, the drained one being cordoned), ``kubectl drain``
itself (which evicts the node's pods side by side and retries an eviction the budget refuses), a
ValidatingAdmissionPolicy (which keeps the StatefulSets from making any replacement, where a test says so), and the
operator (which renders the budgets, holding the chart's RBAC). Simulated: the pods run under kwok, which marks them
Running and Ready without a kubelet or a process, so nothing drains inside them here (the engines' own drain on
SIGTERM is tested with real processes in tests/fleet and tests/chaos). Every assertion on the drain prints, when it
fails, the Ready pods and the budget's counts over time, the pods' and nodes' conditions and the events
(:meth:`.real_drain.Drain.explain`).
"""

from __future__ import annotations

import time
from typing import Any

from megatron_operator.names import selector_labels

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_drain import REFUSED, Drain, ready
from .real_fleet import Fleet, placement_problems, fleet  # noqa: F401 - the fixture
from .real_tools import example, until

NAME = "llama-1b"
GROUPS = 3
BUDGET = f"{NAME}-engine"


def _fleet_on_one_node(fleet: Fleet, budget: dict[str, Any]) -> str:
    """Three one-GPU engine groups on the pool's only node. Returns its name. No other node takes their replacements
    until the test adds one (:func:`_replacements_node`), so a group the drain evicts stays gone meanwhile and what
    the budget allows is seen whatever the machine's load (kwok makes a replacement Ready within a fraction of a
    second, faster than a sampler on a loaded host can see the gap)."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["engine"].update(fleet.gpu_pool(1))
    resource["spec"]["disruptionBudget"] = budget
    fleet.prerequisites(resource)
    fleet.operator()
    kubectl.apply([resource])

    def placed() -> list[dict[str, Any]] | None:
        pods = fleet.engine_pods(NAME)
        return pods if len(pods) == GROUPS and not placement_problems(kubectl, pods, 1) else None

    pods = until(placed, 120, f"{GROUPS} engine pods Ready on the pool's node")
    (node,) = {p["spec"]["nodeName"] for p in pods}
    return node


def _replacements_node(fleet: Fleet) -> str:
    fleet.gpu_pool(1, first=1)  # the pool's second node
    return f"{fleet.kubectl.namespace}-gpu-1"


def _allowing_one(fleet: Fleet, budget: str) -> dict[str, Any]:
    return until(lambda: (b := fleet.kubectl.get("pdb", budget)) and
                 (b.get("status") or {}).get("disruptionsAllowed") == 1 and b, 60, f"budget {budget} allowing one")


def _no_new_pods(fleet: Fleet) -> None:
    """From now on the API server refuses every new pod in the test's namespace, as an exhausted quota or a failing
    admission webhook would: an evicted group's StatefulSet cannot make its replacement, and has no pod at all."""
    kubectl = fleet.kubectl
    name = f"{kubectl.namespace}-no-new-pods"
    kubectl.apply([
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                          "operations": ["CREATE"], "resources": ["pods"]}]},
                  "validations": [{"expression": "false", "message": "the test makes no new pod here"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": kubectl.namespace}}}}},
    ])
    fleet.cluster_objects += [f"validatingadmissionpolicybinding/{name}", f"validatingadmissionpolicy/{name}"]
    until(lambda: "the test makes no new pod here" in kubectl.run(
        "run", "probe", "--image=example.com/none", "--restart=Never", "--dry-run=server", check=False).stderr,
        60, "the API server refusing new pods in the namespace")


def test_a_node_drain_evicts_the_engine_groups_one_at_a_time(fleet: Fleet):
    """With the default budget (one group at a time) the drain evicts one group, and the budget refuses the next
    eviction (HTTP 429; kubectl retries) until the evicted group's replacement is Ready on another node: while no
    node can take it, two of the three groups stay Ready; once a node takes the replacements every group ends there."""
    node = _fleet_on_one_node(fleet, {})  # the defaults: enabled, maxUnavailableGroups 1
    budget = _allowing_one(fleet, BUDGET)
    assert budget["spec"]["minAvailable"] == GROUPS - 1
    drain = Drain(fleet, node, NAME, BUDGET)
    until(lambda: REFUSED in drain.output(), 120, "the budget refusing the second eviction")
    refused = time.monotonic()
    assert drain.ready_now() == GROUPS - 1, drain.explain()
    # Until a node takes the replacements, the budget alone holds the line. After that kwok marks a replacement
    # Ready before anything could run in it, which no kubelet does, so the rest of the drain is not held to it.
    until(lambda: drain.sampled_since(refused), 60, "a sample of the Ready pods after the refusal")
    assert min(drain.ready_counts) == GROUPS - 1, drain.explain()
    other = _replacements_node(fleet)
    code, output = drain.finish("budget")
    assert code == 0, drain.explain()
    pods = until(lambda: (p := fleet.engine_pods(NAME)) and len(p) == GROUPS and all(map(ready, p)) and p, 60,
                 "every group Ready again")
    assert {p["spec"]["nodeName"] for p in pods} == {other}


def test_the_budget_holds_while_an_evicted_group_has_no_pod_at_all(fleet: Fleet):
    """The window the budget must not open: the evicted group's pod is gone and its StatefulSet has made no
    replacement (here it cannot; on any cluster it has not yet, for an instant after each eviction). The engine
    budget counts Ready pods (``minAvailable``), so the drain's retries are refused for as long as that lasts."""
    node = _fleet_on_one_node(fleet, {})
    _allowing_one(fleet, BUDGET)
    _no_new_pods(fleet)
    drain = Drain(fleet, node, NAME, BUDGET)
    try:
        until(lambda: len(fleet.engine_pods(NAME)) < GROUPS, 120, "the first evicted group without a pod")
        gone = time.monotonic()
        # the first round of evictions refuses both groups left, printed by now or soon
        refused = max(drain.refusals(), GROUPS - 1)
        # kubectl retries each refused eviction every 5 s: two more rounds for both groups (or a second group gone,
        # or the drain over, which the assertions below explain)
        until(lambda: drain.refusals() >= refused + 2 * (GROUPS - 1) or drain.ready_now() < GROUPS - 1
              or drain.process.poll() is not None, 120, "two rounds of retried evictions")
        assert drain.ready_now() == GROUPS - 1, drain.explain()
        assert len(fleet.engine_pods(NAME)) == GROUPS - 1, drain.explain()  # the StatefulSet made none
        until(lambda: drain.sampled_since(gone), 60, "a sample of the Ready pods after the first group went")
        assert min(drain.ready_counts) == GROUPS - 1, drain.explain()
        print(f"budget, no replacement: {GROUPS - 1} of {GROUPS} groups Ready for {time.monotonic() - gone:.1f} s "
              f"after the first one's pod was gone; evictions refused {drain.refusals()}")
    finally:
        drain.stop()


def test_control_a_max_unavailable_budget_lets_every_group_go_while_none_can_be_replaced(fleet: Fleet):
    """The control: the same drain with the budget written as ``maxUnavailable: 1`` (the operator's own disabled).
    The disruption controller expects as many pods as the StatefulSets of the pods that exist want, so a group
    without a pod drops out of the count and each retry takes one more group: the form the operator must not use."""
    node = _fleet_on_one_node(fleet, {"enabled": False})
    fleet.kubectl.apply([{
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "by-max-unavailable"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(NAME, "engine")},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"}}])
    _allowing_one(fleet, "by-max-unavailable")
    _no_new_pods(fleet)
    drain = Drain(fleet, node, NAME, "by-max-unavailable")
    try:
        until(lambda: drain.ready_now() == 0, 120, "every engine group evicted, one per round of retries")
        print(f"maxUnavailable control: every group gone {time.monotonic() - drain.started:.1f} s after the drain "
              f"began; evictions refused {drain.refusals()}")
    finally:
        drain.stop()


def test_control_without_a_budget_the_drain_evicts_every_group_at_once(fleet: Fleet):
    """``disruptionBudget.enabled: false`` (no budget, as before): nothing refuses an eviction, and the drain takes
    every group away at once."""
    node = _fleet_on_one_node(fleet, {"enabled": False})
    assert fleet.kubectl.get("pdb") == []
    drain = Drain(fleet, node, NAME, BUDGET)
    until(lambda: drain.ready_now() == 0, 120, "every engine group evicted at once")
    code, output = drain.finish("no budget")
    assert code == 0, output
    assert REFUSED not in output


def test_an_engine_budget_written_as_max_unavailable_is_replaced(fleet: Fleet):
    """A fleet whose engine budget an earlier operator wrote as ``maxUnavailable``: the API server refuses a budget
    with both fields (422), so the operator deletes it and creates it as ``minAvailable``."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["engine"].update(fleet.gpu_pool(1))
    fleet.prerequisites(resource)
    kubectl.apply([{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": BUDGET},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(NAME, "engine")},
                             "unhealthyPodEvictionPolicy": "AlwaysAllow"}}])
    fleet.operator()
    kubectl.apply([resource])
    budget = until(lambda: (b := kubectl.get("pdb", BUDGET)) and "minAvailable" in b["spec"] and b, 60,
                   "the engine budget written again as minAvailable")
    assert budget["spec"]["minAvailable"] == GROUPS - 1 and "maxUnavailable" not in budget["spec"], budget["spec"]
    assert _allowing_one(fleet, BUDGET)["spec"] == budget["spec"]
