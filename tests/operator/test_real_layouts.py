"""Every example layout's pods on a real cluster: made by the real controllers (StatefulSet, or LeaderWorkerSet
where the cluster runs its controller), bound by the real scheduler to GPU nodes with room for them, Running under
kwok; and a layout that fits no node stays Pending, with the scheduler's reason in the resource's status.

Each test has GPU nodes of its own (:meth:`Fleet.gpu_pool`: three nodes of 8 GPUs, 224 CPUs and 2 TiB, as an
8xH100 node) so that what runs beside it cannot take the GPUs; the examples' groups are scaled down to
``spec.parallelism.data`` that fits 24 GPUs (one group of the 16-GPU layouts), their layout unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from megatron_operator.spec import parse

from .real_fleet import Fleet, placement_problems, fleet  # noqa: F401 - the fixture
from .real_tools import condition, example, until
from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures

#: example -> the data parallelism it runs with here (None: its own)
LAYOUTS = {
    "single-gpu.yaml": None,  # one GPU
    "tp8-one-node.yaml": None,  # tensor parallelism within a node: one pod of 8 GPUs
    "tp2-dp4.yaml": None,  # four groups of 2 GPUs
    "prefill-decode.yaml": None,  # P/D: three groups of 1 GPU
    "multi-node.yaml": 1,  # tensor parallelism across nodes: a group of two 8-GPU pods, one per node
    "moe-expert-parallel.yaml": 1,  # EP gang: one pod of 4 GPUs per attention rank, four pods
    "rl-rollout-paused.yaml": None,  # eight groups of one GPU, Paused
}


def _on_pool(resource: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    engine = resource["spec"].setdefault("engine", {})
    engine["nodeSelector"] = {**engine.get("nodeSelector", {}), **pool["nodeSelector"]}
    engine["tolerations"] = [*engine.get("tolerations", []), *pool["tolerations"]]
    return resource


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_example_layout_runs_on_nodes_with_room(fleet: Fleet, name: str):
    kubectl = fleet.kubectl
    resource = example(name, kubectl.namespace)
    if LAYOUTS[name] is not None:
        resource["spec"]["parallelism"]["data"] = LAYOUTS[name]
    _on_pool(resource, fleet.gpu_pool(3))
    fleet.prerequisites(resource)
    shape = parse(resource)
    want = shape.data * shape.pods_per_group
    fleet.operator()
    kubectl.apply([resource])
    mi_name = resource["metadata"]["name"]

    def placed() -> list[dict[str, Any]] | str:
        pods = fleet.engine_pods(mi_name)
        problems = placement_problems(kubectl, pods, shape.gpus_per_engine_pod)
        return pods if len(pods) == want and not problems else f"{len(pods)}/{want} pods; {problems}"

    pods = until(lambda: isinstance(p := placed(), list) and p, 120, f"{want} engine pods placed")
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert all(n.startswith(f"{kubectl.namespace}-gpu-") for n in nodes), nodes
    if shape.gpus_per_engine_pod == 8:  # a whole node per pod: the group spans as many nodes as it has pods
        assert len(nodes) == len(pods)
    kinds = {p["metadata"]["ownerReferences"][0]["kind"] for p in pods}
    assert kinds == {"StatefulSet"}, kinds  # the controllers' pods (LWS makes its pods through StatefulSets too)
    until(lambda: ((fleet.mi(mi_name) or {}).get("status") or {}).get("engines", {}).get("ready") == shape.data,
          60, f"status.engines.ready == {shape.data}")
    if shape.gang:  # a gang is a LeaderWorkerSet where the cluster runs that controller, made into pods by it
        served = "leaderworkersets" in kubectl.run("api-resources", "--api-group=leaderworkerset.x-k8s.io").stdout
        groups = until(lambda: ((fleet.mi(mi_name) or {}).get("status") or {}).get("groups"), 30, "status.groups")
        assert {g["workload"] for g in groups} == {"LeaderWorkerSet" if served else "StatefulSet"}, groups
        assert all(g["ready"] and len(g["ranks"]) == shape.pods_per_group for g in groups), groups


def test_a_layout_no_node_fits_stays_pending_and_the_status_says_why(fleet: Fleet):
    """A group of 16 GPUs in one pod (gpusPerPod 16) where nodes have 8: the scheduler leaves the pod Pending, and
    the resource's EnginesReady condition carries its reason (the control: every layout above is placed)."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["spec"]["parallelism"]["tensor"] = 16
    resource["spec"]["engine"]["gpusPerPod"] = 16
    _on_pool(resource, fleet.gpu_pool(2))
    fleet.prerequisites(resource)
    fleet.operator()
    kubectl.apply([resource])
    name = resource["metadata"]["name"]
    until(lambda: [c for p in fleet.engine_pods(name) for c in p["status"].get("conditions", [])
                   if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"], 60,
          "the scheduler's verdict on the pod")
    engines = until(lambda: (c := condition(fleet.mi(name), "EnginesReady")).get("reason") == "Unschedulable" and c,
                    60, "EnginesReady with reason Unschedulable")
    assert engines["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in engines["message"], engines["message"]
    assert f"{name}-engine-0-0" in engines["message"]
    assert all(p["status"].get("phase") == "Pending" for p in fleet.engine_pods(name))
