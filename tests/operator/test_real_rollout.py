"""A bad rollout on a real control plane: halted at ``spec.rollout.progressDeadlineSeconds``, then reverted.

Real: kube-apiserver, the StatefulSet controller (which replaces a group's pod when the operator gives it a new
template, and again when the spec is reverted), the scheduler (whose refusal is the new version's failure here: the
new template asks for a GPU no node has, so its pod stays Pending), and the operator holding the chart's RBAC.
Simulated: the pods run under kwok (Ready once bound, no process), so the failure is a placement one; an engine that
refuses its model fails the same way to the operator (a pod not Ready), with its own exit message as the reason.

kwok's early Ready (a pod Ready the moment it runs) cannot change what this test asserts: the halted group's new pod
is never bound, and kwok plays only pods bound to its nodes, so it is not Ready under kwok as under any kubelet; the
operator moves a second group only once the first is Ready on its new template, which never happens; and groups 1 and
2 never get a new template (not before the halt, and the revert gives back the one they have), so their pods stay
the same whatever marks group 0's reverted pod Ready, and how soon. Nothing runs in the pods and no request is sent:
the same halt and revert under streamed requests, with engines whose pods are Ready only once they serve, is
test_real_under_load.py's.
"""

from __future__ import annotations

import json
from typing import Any

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_tools import Kubectl, condition, example, until

NAME = "llama-1b"
GROUPS = 3
DEADLINE = 15


def _ready(pod: dict[str, Any]) -> bool:
    return "deletionTimestamp" not in pod["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def _uids(fleet: Fleet) -> dict[str, str]:
    """Ready engine pods: name -> uid."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in fleet.engine_pods(NAME) if _ready(p)}


def _halted_events(kubectl: Kubectl) -> list[dict[str, Any]]:
    return [e for e in kubectl.events(NAME) if e.get("reason") == "RolloutHalted"]


def test_a_rollout_that_misses_its_deadline_halts_and_a_revert_rolls_it_back(fleet: Fleet):
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["engine"].update(fleet.gpu_pool(1))
    resource["spec"]["rollout"] = {"progressDeadlineSeconds": DEADLINE}
    fleet.prerequisites(resource)
    fleet.operator()
    kubectl.apply([resource])
    before = until(lambda: len(u := _uids(fleet)) == GROUPS and u, 120, f"{GROUPS} engine pods Ready")
    until(lambda: condition(fleet.mi(NAME), "Progressing").get("reason") == "Complete", 60, "Progressing Complete")

    # The new version: a GPU model no node has. Group 0 takes it first; its pod can never be placed.
    bad = {"spec": {"engine": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}}}
    kubectl.run("patch", "mi", NAME, "--type=merge", "-p", json.dumps(bad))
    halted = until(lambda: (c := condition(fleet.mi(NAME), "Progressing")).get("status") == "False" and c,
                   DEADLINE + 60, "Progressing=False")
    print(f"halted: {halted['reason']}: {halted['message']}")
    assert halted["reason"] == "ProgressDeadlineExceeded"
    assert f"{NAME}-engine-0 is not Ready" in halted["message"]
    assert "cannot be scheduled" in halted["message"] and "node(s) didn't match" in halted["message"]
    # The Event is posted after the status that says halted (a CI run here read the events in between), and once:
    # still one after three more passes.
    until(lambda: _halted_events(kubectl), 30, "a RolloutHalted event")
    # No other group was touched: groups 1 and 2 run the same pods, on the old template, a few passes later.
    until(lambda: fleet.operators[0].log().count("waiting for their turn to roll") >= 3, 30, "three more passes")
    events = _halted_events(kubectl)
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    now = _uids(fleet)
    assert {k: v for k, v in now.items() if not k.startswith(f"{NAME}-engine-0")} == \
        {k: v for k, v in before.items() if not k.startswith(f"{NAME}-engine-0")}
    for group in (1, 2):
        sts = kubectl.get("statefulset", f"{NAME}-engine-{group}")
        assert "nvidia.com/gpu.product" not in sts["spec"]["template"]["spec"]["nodeSelector"], group

    # Revert: group 0 gets its old template back and serves again; the others are still never touched.
    revert = {"spec": {"engine": {"nodeSelector": {"nvidia.com/gpu.product": None}}}}
    kubectl.run("patch", "mi", NAME, "--type=merge", "-p", json.dumps(revert))
    after = until(lambda: len(u := _uids(fleet)) == GROUPS and u, 120, "every group Ready again")
    assert after[f"{NAME}-engine-1-0"] == before[f"{NAME}-engine-1-0"]
    assert after[f"{NAME}-engine-2-0"] == before[f"{NAME}-engine-2-0"]
    until(lambda: condition(fleet.mi(NAME), "Progressing").get("reason") == "Complete", 60,
          "Progressing Complete after the revert")
