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

import subprocess
import threading
from typing import Any

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, placement_problems, fleet  # noqa: F401 - the fixture
from .real_tools import example, until

NAME = "llama-1b"
GROUPS = 3
REFUSED = "would violate the pod's disruption budget"


def _ready(pod: dict[str, Any]) -> bool:
    return "deletionTimestamp" not in pod["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


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


class Drain:
    """``kubectl drain NODE`` as a process whose output is read as it comes, and a watcher that samples how many
    engine pods are Ready meanwhile."""

    def __init__(self, fleet: Fleet, node: str):
        self.fleet = fleet
        kubectl = fleet.kubectl
        self.process = subprocess.Popen(
            [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
             "--delete-emptydir-data", "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready_counts: list[int] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.reader.start()
        self.watcher.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def _watch(self) -> None:
        while self.process.poll() is None:
            self.ready_counts.append(self.ready_now())

    def ready_now(self) -> int:
        return sum(_ready(p) for p in self.fleet.engine_pods(NAME))

    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, label: str) -> tuple[int, str]:
        self.process.wait(timeout=300)
        self.reader.join(timeout=30)
        self.watcher.join(timeout=30)
        print(f"{label}: drain exit {self.process.returncode}; fewest engine groups Ready at once "
              f"{min(self.ready_counts, default=GROUPS)}/{GROUPS} over {len(self.ready_counts)} samples; evictions "
              f"refused by the budget: {self.output().count(REFUSED)}")
        return self.process.returncode, self.output()


def test_a_node_drain_evicts_the_engine_groups_one_at_a_time(fleet: Fleet):
    """With the default budget (one group at a time) the drain evicts one group, and the budget refuses the next
    eviction (HTTP 429; kubectl retries) until the evicted group's replacement is Ready on another node: while no
    node can take it, two of the three groups stay Ready; once a node takes the replacements every group ends there."""
    node = _fleet_on_one_node(fleet, {})  # the defaults: enabled, maxUnavailableGroups 1
    budget = until(lambda: (b := fleet.kubectl.get("pdb", f"{NAME}-engine")) and
                   (b.get("status") or {}).get("disruptionsAllowed") == 1 and b, 60,
                   "the engine budget allowing one disruption")
    assert budget["spec"]["maxUnavailable"] == 1
    drain = Drain(fleet, node)
    until(lambda: REFUSED in drain.output(), 120, "the budget refusing the second eviction")
    assert drain.ready_now() == GROUPS - 1
    # Until a node takes the replacements, the budget alone holds the line. After that kwok marks a replacement
    # Ready before anything could run in it, which no kubelet does, so the rest of the drain is not held to it.
    assert min(list(drain.ready_counts)) == GROUPS - 1
    other = _replacements_node(fleet)
    code, output = drain.finish("budget")
    assert code == 0, output
    pods = until(lambda: (p := fleet.engine_pods(NAME)) and len(p) == GROUPS and all(map(_ready, p)) and p, 60,
                 "every group Ready again")
    assert {p["spec"]["nodeName"] for p in pods} == {other}


def test_control_without_a_budget_the_drain_evicts_every_group_at_once(fleet: Fleet):
    """``disruptionBudget.enabled: false`` (no budget, as before): nothing refuses an eviction, and the drain takes
    every group away at once."""
    node = _fleet_on_one_node(fleet, {"enabled": False})
    assert fleet.kubectl.get("pdb") == []
    drain = Drain(fleet, node)
    until(lambda: drain.ready_now() == 0, 120, "every engine group evicted at once")
    code, output = drain.finish("no budget")
    assert code == 0, output
    assert REFUSED not in output
