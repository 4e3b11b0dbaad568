"""The operator on a real cluster, holding the chart's ServiceAccount token (not the admin's).

The operator runs as a process of its own (``python -m megatron_operator operator``, kopf), serving the test's
namespace with the RBAC the chart renders; everything else is the cluster's: the real StatefulSet and Deployment
controllers make the pods, the real scheduler binds them to kwok's GPU nodes (where they run and turn Ready without
a kubelet), the garbage collector deletes what the resource owns. No coordinator runs (the pods are kwok's): the
resource's coordinator conditions say so, and the lifecycle verbs are not exercised here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from megatron_operator import names

from .real_fleet import Fleet, placement_problems, fleet  # noqa: F401 - the fixture
from .real_tools import MI, condition, example, until
from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures

NAME = "llama-1b"


def _placed(fleet: Fleet, count: int) -> list[dict[str, Any]] | None:
    """The engine pods once ``count`` of them run on GPU nodes (one GPU each)."""
    pods = fleet.engine_pods(NAME)
    return pods if len(pods) == count and not placement_problems(fleet.kubectl, pods, 1) else None


def test_single_gpu_example_reconciles_scales_and_is_collected(fleet: Fleet):
    """The issue's acceptance path: the single-GPU example, its Secret and a bound claim; the operator as the
    chart's ServiceAccount makes the children, the StatefulSet controller the pod, the scheduler binds it to a GPU
    node, kwok runs it; the status is written; ``kubectl scale`` goes through the scale subresource; ``kubectl
    delete`` collects everything the resource owned."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    fleet.prerequisites(resource)
    operator = fleet.operator()
    kubectl.apply([resource])

    pods = until(lambda: _placed(fleet, 1), 90, "the engine pod Running on a GPU node")
    assert [p["metadata"]["name"] for p in pods] == [f"{NAME}-engine-0-0"]
    assert pods[0]["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"  # the controller's, not ours
    coordinator = until(lambda: [p for p in kubectl.get("pods", None, f"-l=app.kubernetes.io/instance={NAME},"
                                                                      "app.kubernetes.io/component=coordinator")
                                 if p["status"].get("phase") == "Running"], 60, "the coordinator pod Running")
    assert coordinator[0]["spec"]["nodeName"]

    mi = until(lambda: (m := fleet.mi(NAME)) and (m.get("status") or {}).get("engines", {}).get("ready") == 1 and m,
               60, "status.engines.ready == 1")
    status = mi["status"]
    assert status["observedGeneration"] == mi["metadata"]["generation"]
    assert status["selector"] == names.engine_pod_selector(NAME)
    assert condition(mi, "SpecValid")["status"] == "True"
    assert condition(mi, "CoordinatorReady")["status"] == "False"  # no coordinator runs in kwok's pods

    # kubectl scale: the scale subresource maps --replicas onto spec.parallelism.data
    kubectl.run("scale", f"{MI}/{NAME}", "--replicas=2")
    assert fleet.mi(NAME)["spec"]["parallelism"]["data"] == 2
    until(lambda: _placed(fleet, 2), 90, "two engine pods Running")
    scale = json.loads(kubectl.run("get", f"{MI}/{NAME}", "--subresource=scale", "-o=json").stdout)
    until(lambda: json.loads(kubectl.run("get", f"{MI}/{NAME}", "--subresource=scale",
                                         "-o=json").stdout)["status"].get("replicas") == 2, 30, "scale status 2")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == names.engine_pod_selector(NAME)
    # and down again: the operator deletes group 1's StatefulSet and Service, the collector its pod
    kubectl.run("scale", f"{MI}/{NAME}", "--replicas=1")
    until(lambda: _placed(fleet, 1) and kubectl.get("statefulset", f"{NAME}-engine-1") is None
          and kubectl.get("service", f"{NAME}-engine-1") is None, 60, "group 1 gone")
    kubectl.run("scale", f"{MI}/{NAME}", "--replicas=2")
    until(lambda: _placed(fleet, 2), 90, "two engine pods Running again")

    # kubectl delete: the finalizer lets go, and the garbage collector takes every child and their pods
    uid = mi["metadata"]["uid"]
    owned = fleet.owned(uid)
    assert {f"StatefulSet/{NAME}-engine-0", f"StatefulSet/{NAME}-engine-1", f"Deployment/{NAME}-coordinator",
            f"Secret/{NAME}-coordinator-token", f"Pod/{NAME}-engine-0-0"} <= set(owned), owned
    kubectl.run("delete", f"{MI}/{NAME}", "--timeout=60s")
    until(lambda: not fleet.owned(uid) and not [i for i in kubectl.get("pods")
                                                if i["metadata"]["name"].startswith(NAME)], 90,
          "every owned object collected")
    assert "Traceback" not in operator.log(), operator.log()[-3000:]


def test_a_missing_rbac_rule_is_named_in_the_operators_error(fleet: Fleet):
    """The chart's Role without ``create`` on StatefulSets: the operator's error names the verb and the resource
    the API server refused (the control: the chart's whole Role creates them in the test above)."""
    kubectl = fleet.kubectl
    role = kubectl.get("role", fleet.account)
    for rule in role["rules"]:
        if "statefulsets" in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    kubectl.apply([{k: v for k, v in role.items() if k != "status"}])
    resource = example("single-gpu.yaml", kubectl.namespace)
    fleet.prerequisites(resource)
    operator = fleet.operator()
    kubectl.apply([resource])
    refused = re.compile(r'cannot create resource \\?"statefulsets\\?" in API group \\?"apps\\?"')
    until(lambda: refused.search(operator.log()), 60, "the operator's error naming the refused verb and resource")
    until(lambda: any(e.get("reason") == "KubernetesAPIError" and refused.search(e.get("message", ""))
                      for e in kubectl.events(NAME)), 30, "a Warning Event on the resource naming it")
    # everything the role still allows was made
    assert kubectl.get("deployment", f"{NAME}-coordinator") is not None
    assert kubectl.get("statefulset", f"{NAME}-engine-0") is None


def test_an_immutable_statefulset_field_is_recreated(fleet: Fleet):
    """A StatefulSet whose immutable fields differ from what the operator renders (as an older operator made it):
    the real API server answers the patch with 422, which the emulator never did, and the operator deletes it with
    its pod orphaned and creates it again; the new StatefulSet's controller adopts the same pod (streams through such
    a recreate: test_real_recreate_in_flight.py)."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    fleet.prerequisites(resource)
    kubectl.apply([resource])
    mi = fleet.mi(NAME)
    engine = f"{NAME}-engine-0"
    from megatron_operator.config import OperatorConfig
    from megatron_operator.render import render

    (rendered,) = [o for o in render(mi, OperatorConfig()) if o["kind"] == "StatefulSet"]
    old = yaml.safe_load(yaml.safe_dump(rendered))
    old["spec"]["podManagementPolicy"] = "OrderedReady"  # immutable
    old["metadata"]["ownerReferences"] = [{"apiVersion": mi["apiVersion"], "kind": mi["kind"], "name": NAME,
                                           "uid": mi["metadata"]["uid"], "controller": True,
                                           "blockOwnerDeletion": True}]
    kubectl.apply([old])
    first = kubectl.get("statefulset", engine)["metadata"]["uid"]
    (pod,) = until(lambda: _placed(fleet, 1), 90, "the older StatefulSet's pod on a GPU node")

    patch = kubectl.run("patch", "statefulset", engine, "--type=merge", "-p",
                        '{"spec":{"podManagementPolicy":"Parallel"}}', check=False)
    assert patch.returncode != 0 and "field is immutable" in patch.stderr  # the real server's 422 Invalid

    operator = fleet.operator()
    recreated = until(lambda: (s := kubectl.get("statefulset", engine)) and s["metadata"]["uid"] != first and s,
                      60, "the StatefulSet recreated")
    assert recreated["spec"]["podManagementPolicy"] == "Parallel"
    until(lambda: any(e.get("reason") == "Recreating" for e in kubectl.events(NAME)), 30, "the Recreating Event")
    (adopted,) = until(lambda: (p := _placed(fleet, 1)) and (p[0]["metadata"].get("ownerReferences") or [{}])[0]
                       .get("uid") == recreated["metadata"]["uid"] and p, 90, "the pod adopted by the new StatefulSet")
    assert adopted["metadata"]["uid"] == pod["metadata"]["uid"]  # never deleted
    assert "Traceback" not in operator.log(), operator.log()[-3000:]


def test_operator_killed_mid_reconcile_converges_when_restarted(fleet: Fleet):
    """SIGKILL once the first child exists, before the rest: a new operator process finishes the job. A Service
    of a child's name that nothing owns (made by hand beforehand) is adopted, not refused as a conflict."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    fleet.prerequisites(resource)
    kubectl.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME},
                    "spec": {"ports": [{"name": "http", "port": 8000}]}}])
    first = fleet.operator()
    kubectl.apply([resource])
    until(lambda: kubectl.get("secret", f"{NAME}-coordinator-token"), 60, "the first child")
    first.stop(kill=True)
    # The first process may have adopted the Service already (then killed before or after its Event): the Event is
    # asked of the new process only where the adoption was left to it.
    adopted_before = bool(kubectl.get("service", NAME)["metadata"].get("ownerReferences"))
    second = fleet.operator()
    until(lambda: _placed(fleet, 1), 90, "the engine pod Running after the restart")
    until(lambda: ((fleet.mi(NAME) or {}).get("status") or {}).get("engines", {}).get("ready") == 1, 60,
          "the status written by the new process")
    (owner,) = kubectl.get("service", NAME)["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("MegatronInference", fleet.mi(NAME)["metadata"]["uid"])
    assert adopted_before or any(e.get("reason") == "Adopted" for e in kubectl.events(NAME)), kubectl.events(NAME)
    assert "Traceback" not in second.log(), second.log()[-3000:]


def test_quantities_the_server_rewrites_cause_no_writes_after_ready(fleet: Fleet):
    """Resources spelled otherwise than the API server stores them ("0.5" CPU as "500m", "2048Mi" as "2Gi"): once
    the fleet is up, further passes patch nothing and post no Updated Event (they did, every pass, when the
    operator compared quantities as text)."""
    kubectl = fleet.kubectl
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["spec"]["engine"]["resources"] = {"requests": {"cpu": "0.5", "memory": "1.5Gi"},
                                               "limits": {"memory": "2048Mi"}}
    resource["spec"]["coordinator"] = {"resources": {"requests": {"cpu": "1000m"}}}
    fleet.prerequisites(resource)
    operator = fleet.operator()
    kubectl.apply([resource])
    until(lambda: _placed(fleet, 1), 90, "the engine pod Running on a GPU node")
    live = kubectl.get("statefulset", f"{NAME}-engine-0")
    assert live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    passes = operator.log().count("Timer 'on_timer' succeeded")
    until(lambda: operator.log().count("Timer 'on_timer' succeeded") >= passes + 5, 60, "five more passes")
    updated = [e["message"] for e in kubectl.events(NAME) if e.get("reason") == "Updated"]
    assert updated == []
    assert kubectl.get("statefulset", f"{NAME}-engine-0")["metadata"]["generation"] == live["metadata"]["generation"]
