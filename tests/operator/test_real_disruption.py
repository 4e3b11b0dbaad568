"""``kubectl drain`` of a node holding every engine group, on a real control plane, with and without the fleet's
PodDisruptionBudgets (``spec.disruptionBudget``).

Real: kube-apiserver's Eviction API (which asks the budgets), the disruption controller (which keeps each budget's
``disruptionsAllowed`` from the pods' Ready conditions), the StatefulSet controller (which makes each evicted pod
again), the scheduler (which binds it to the pool's other node, the drained one being cordoned), ``kubectl drain``
itself (which retries an eviction the budget refuses), and the operator (which renders the budgets, holding the
chart's RBAC). Simulated: the pods run under kwok, which marks them Running and Ready without a kubelet or a
process, so nothing drains inside them here (the engines' own drain on SIGTERM is tested with real processes in
tests/fleet and tests/chaos).
"""

from __future__ import annotations

import pathlib
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .real_cluster import Namespace, kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, placement_problems
from .real_tools import clients, example, until

NAME = "llama-1b"
GROUPS = 3
REFUSED = "would violate the pod's disruption budget"


@pytest.fixture
def fleet(kube_namespace: Namespace, tmp_path: pathlib.Path) -> Iterator[Fleet]:
    f = Fleet(*clients(kube_namespace), tmp_path)
    f.install_chart_rbac()
    try:
        yield f
    finally:
        f.close()


def _ready(pod: dict[str, Any]) -> bool:
    return "deletionTimestamp" not in pod["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def _fleet_on_one_node(fleet: Fleet, budget: dict[str, Any]) -> str:
    """Three one-GPU engine groups on the pool's only node; then a second node for their replacements. Returns the
    first node's name."""
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
    fleet.gpu_pool(2)  # the replacements' node
    return node


class Drain:
    """``kubectl drain NODE`` as a process, and a watcher that samples how many engine pods are Ready meanwhile."""

    def __init__(self, fleet: Fleet, node: str):
        self.fleet = fleet
        kubectl = fleet.kubectl
        self.process = subprocess.Popen(
            [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
             "--delete-emptydir-data", "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started = time.monotonic()
        self.ready_counts: list[tuple[float, int]] = []
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        while self.process.poll() is None:
            pods = self.fleet.engine_pods(NAME)
            self.ready_counts.append((time.monotonic() - self.started, sum(_ready(p) for p in pods)))

    def finish(self) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=300)
        self.watcher.join(timeout=30)
        return self.process.returncode, output


def _drain_and_report(fleet: Fleet, node: str, label: str) -> tuple[int, str, int]:
    drain = Drain(fleet, node)
    code, output = drain.finish()
    fewest = min(count for _, count in drain.ready_counts)
    took = drain.ready_counts[-1][0] if drain.ready_counts else 0.0
    print(f"{label}: drain exit {code} in {took:.1f}s; fewest engine groups Ready at once {fewest}/{GROUPS} over "
          f"{len(drain.ready_counts)} samples; evictions refused by the budget: {output.count(REFUSED)}")
    return code, output, fewest


def test_a_node_drain_evicts_the_engine_groups_one_at_a_time(fleet: Fleet):
    """With the default budget (one group at a time) the drain evicts a group, and the next only once the evicted
    group's replacement is Ready on the other node (an eviction before that is refused, HTTP 429, and kubectl
    retries; kwok makes a replacement Ready within a fraction of a second, so the refusal is often not needed and is
    printed, not asserted): at least two of the three groups are Ready all along, and every group ends on the other
    node."""
    node = _fleet_on_one_node(fleet, {})  # the defaults: enabled, maxUnavailableGroups 1
    budget = until(lambda: (b := fleet.kubectl.get("pdb", f"{NAME}-engine")) and
                   (b.get("status") or {}).get("disruptionsAllowed") == 1 and b, 60,
                   "the engine budget allowing one disruption")
    assert budget["spec"]["maxUnavailable"] == 1
    code, output, fewest = _drain_and_report(fleet, node, "budget")
    assert code == 0, output
    assert fewest == GROUPS - 1
    pods = until(lambda: (p := fleet.engine_pods(NAME)) and len(p) == GROUPS and all(map(_ready, p)) and p, 60,
                 "every group Ready again")
    assert {p["spec"]["nodeName"] for p in pods} == {f"{fleet.kubectl.namespace}-gpu-1"}


def test_control_without_a_budget_the_drain_evicts_every_group_at_once(fleet: Fleet):
    """``disruptionBudget.enabled: false`` (no budget, as before): nothing refuses an eviction, and the drain takes
    every group away at once."""
    node = _fleet_on_one_node(fleet, {"enabled": False})
    assert fleet.kubectl.get("pdb") == []
    code, output, fewest = _drain_and_report(fleet, node, "no budget")
    assert code == 0, output
    assert REFUSED not in output
    assert fewest < GROUPS - 1, "more than one group should have been gone at once without a budget"
