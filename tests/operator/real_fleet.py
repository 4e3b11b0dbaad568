"""One test's MegatronInference fleet on the real cluster: the chart's ServiceAccount and RBAC, the claims and
Secrets an example needs, the operator as a process holding that ServiceAccount's token, and GPU nodes of the
test's own.

A test's own nodes (:meth:`Fleet.gpu_pool`) are kwok nodes like the cluster's, tainted and labelled for the test's
namespace: the layouts' pods go there and nowhere else, and no other test's pods take their GPUs, so a layout
that fits is placed whatever runs beside it. With ``kubelet=True`` they are nodes kwok does not play, kept Ready by
:class:`.real_node.NodeLeases`, whose pods the test's kubelet stand-in (:mod:`.real_kubelet`) runs.
"""

from __future__ import annotations

import base64
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from megatron_operator import names

from .real_cluster import Namespace
from .real_node import NodeLeases, ready_status
from .real_reads import TIMEOUT
from .real_tools import CHART, Helm, Kubectl, MI, OperatorProcess, clients, example, service_account_kubeconfig, until

#: What marks a node as kwok's to play (tools/kube-cluster starts kwok with this annotation selector).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
POOL_LABEL = "megatron.test/pool"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"  # the tp8 example's nodeSelector


class Fleet:
    """One test's namespace: the chart's ServiceAccount and RBAC, bound claims, API-key Secrets, its own GPU
    nodes, and the operator (started on demand) with that ServiceAccount's token."""

    def __init__(self, kubectl: Kubectl, helm: Helm, workdir: pathlib.Path):
        self.kubectl, self.helm, self.workdir = kubectl, helm, workdir
        self.release = f"mo-{kubectl.namespace}"[:40].rstrip("-")
        self.account = f"{self.release}-megatron-operator"
        self.operators: list[OperatorProcess] = []
        self.cluster_objects: list[str] = []  # kind/name of the cluster-scoped objects this test made
        self.own_nodes: set[str] = set()  # the nodes whose pods the test's kubelet stand-in runs (not kwok)
        self.leases: NodeLeases | None = None

    def install_chart_rbac(self) -> None:
        """The chart's ServiceAccount, Role and RoleBinding as ``helm template`` renders them for ``rbac.scope:
        namespace`` serving this namespace: the operator then runs as the chart runs it in that scope (one
        namespace, no CRD scanning), and sees no other test's resources (the cluster scope's ClusterRole holds the
        same rules and the CRDs' list and watch, test_operator_chart.py)."""
        rendered = self.helm.run("template", self.release, str(CHART), f"--namespace={self.kubectl.namespace}",
                                 "--set=rbac.scope=namespace", f"--set=watchNamespaces={{{self.kubectl.namespace}}}",
                                 "--show-only=templates/serviceaccount.yaml", "--show-only=templates/rbac.yaml").stdout
        self.kubectl.put(rendered)

    def claim(self, claim: str) -> None:
        """A PersistentVolume and the claim ``claim``, bound by the real PV controller."""
        volume = f"{self.kubectl.namespace}-{claim}"
        self.kubectl.apply([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany", "ReadWriteMany"],
                      "storageClassName": "", "hostPath": {"path": f"/tmp/{volume}"},
                      "claimRef": {"namespace": self.kubectl.namespace, "name": claim}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": volume,
                      "resources": {"requests": {"storage": "1Gi"}}}},
        ])
        self.cluster_objects.append(f"pv/{volume}")
        until(lambda: (self.kubectl.get("pvc", claim) or {}).get("status", {}).get("phase") == "Bound", 30,
              f"claim {claim} bound")

    def prerequisites(self, resource: dict[str, Any]) -> None:
        """What the example's comments tell a user to make first: its claims and its API-key Secret."""
        spec = resource["spec"]
        for source in (spec["model"].get("volume"), (spec.get("lora") or {}).get("volume")):
            if source and "persistentVolumeClaim" in source:
                self.claim(source["persistentVolumeClaim"]["claimName"])
        ref = spec.get("server", {}).get("apiKeySecretRef")
        if ref:
            self.kubectl.run("create", "secret", "generic", ref["name"], f"--from-literal={ref['key']}=test-key")

    def gpu_pool(self, count: int, gpus: int = 8, first: int = 0, kubelet: bool = False) -> dict[str, Any]:
        """``count`` kwok GPU nodes of this test's own, numbered from ``first`` (a later call adds nodes to the pool
        without touching those it has); returns what a resource's ``spec.engine`` needs to land there (a nodeSelector
        and a toleration of the pool's taint). ``kubelet``: nodes without kwok's annotation, created Ready and kept
        Ready by this fleet's Lease heartbeat, whose pods only the test's kubelet stand-in starts."""
        ns = self.kubectl.namespace
        nodes = []
        for i in range(first, first + count):
            name = f"{ns}-gpu-{i}"
            capacity = {"cpu": "224", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
            nodes.append({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {} if kubelet else {KWOK_ANNOTATION: "fake"},
                             "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        "type": "kwok", POOL_LABEL: ns, "nvidia.com/gpu.product": GPU_PRODUCT,
                                        "nvidia.com/gpu.count": str(gpus),
                                        "topology.kubernetes.io/zone": f"zone-{'ab'[i % 2]}"}},
                "spec": {"taints": [{"key": POOL_LABEL, "value": ns, "effect": "NoSchedule"}]},
                "status": ready_status(capacity) if kubelet else {"capacity": capacity, "allocatable": dict(capacity)},
            })
            self.cluster_objects.append(f"node/{name}")
        self.kubectl.put(nodes)
        if kubelet:
            self.leases = self.leases or NodeLeases(self.kubectl.kubeconfig)
            for node in nodes:
                self.leases.add(node["metadata"]["name"])
                self.own_nodes.add(node["metadata"]["name"])
        until(lambda: all(any(c["type"] == "Ready" and c["status"] == "True"
                              for c in ((self.kubectl.get("node", n["metadata"]["name"]) or {}).get("status") or {})
                              .get("conditions", [])) for n in nodes), 60, "the pool's nodes Ready")
        return {"nodeSelector": {POOL_LABEL: ns},
                "tolerations": [{"key": POOL_LABEL, "operator": "Equal", "value": ns, "effect": "NoSchedule"}]}

    def tiny_resource(self, name: str, model: str) -> dict[str, Any]:
        """The single-GPU example as resource ``name`` serving the tiny test model at ``model`` (a local path: its
        engines run as processes here), draining in 5 s; its API-key Secret is made by :meth:`prerequisites`."""
        resource = example("single-gpu.yaml", self.kubectl.namespace)
        resource["metadata"]["name"] = name
        resource["spec"]["model"] = {"path": model, "dtype": "float32"}
        resource["spec"]["server"]["apiKeySecretRef"]["name"] = f"{name}-api-key"
        resource["spec"]["drainTimeoutSeconds"] = 5
        return resource

    def coordinator_token(self, name: str) -> str:
        """The fleet token the operator made for resource ``name`` (its coordinator's and engines' secret)."""
        secret = until(lambda: self.kubectl.get("secret", f"{name}-coordinator-token"), 60,
                       f"the coordinator's Secret of {name}")
        return base64.b64decode(secret["data"]["token"]).decode()

    def operator(self, **env: str) -> OperatorProcess:
        kubeconfig = service_account_kubeconfig(self.kubectl, self.account, self.workdir / "operator.kubeconfig")
        process = OperatorProcess(kubeconfig, self.kubectl.namespace, self.workdir / "operator.log", scanning=False,
                                  env=env).start()
        self.operators.append(process)
        return process

    def mi(self, name: str) -> dict[str, Any] | None:
        return self.kubectl.get(MI, name)

    def engine_pods(self, name: str) -> list[dict[str, Any]]:
        return self.kubectl.get("pods", None, f"-l={names.engine_pod_selector(name)}")

    def images(self, name: str) -> set[str]:
        """The images the resource's engine StatefulSets and coordinator Deployment carry now (which operator wrote
        them, where each writes its own default image)."""
        workloads = [*(self.kubectl.get("statefulsets", None, f"-l=app.kubernetes.io/instance={name}")),
                     self.kubectl.get("deployment", f"{name}-coordinator") or {"spec": {"template": {"spec": {}}}}]
        return {c["image"] for w in workloads for c in w["spec"]["template"]["spec"].get("containers", [])}

    def watch_images(self, name: str, seconds: float, enough: frozenset[str] = frozenset()) -> set[str]:
        """Every image seen on the workloads during ``seconds`` (each operator passes every second), or until all of
        ``enough`` were seen (a test that looks for images need not wait out the span; one that rules them out must)."""
        seen: set[str] = set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (enough and seen >= enough):
            seen |= self.images(name)
            time.sleep(0.3)
        return seen

    def placed(self, name: str, count: int) -> bool:
        """``count`` engine pods of one GPU each, each on a node with room for it."""
        pods = self.engine_pods(name)
        return len(pods) == count and not placement_problems(self.kubectl, pods, 1)

    def owned(self, uid: str) -> list[str]:
        """Every object in the namespace whose ownerReferences lead to ``uid`` (directly or through a workload)."""
        kinds = "secrets,services,deployments,statefulsets,replicasets,controllerrevisions,networkpolicies,pods"
        items = self.kubectl.get(kinds)
        uids = {uid}
        changed = True
        while changed:
            changed = False
            for item in items:
                refs = {r["uid"] for r in item["metadata"].get("ownerReferences", [])}
                if refs & uids and item["metadata"]["uid"] not in uids:
                    uids.add(item["metadata"]["uid"])
                    changed = True
        return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in items if i["metadata"]["uid"] in uids - {uid})

    def close(self) -> None:
        """Stop the operators, let go of the resources' finalizers (no operator is left to remove them, and the
        namespace's deletion would wait), and delete the cluster-scoped objects the test made. A clean-up, not what
        a test tests: in-process with the admin's client (a ``kubectl`` process for each object was ~60 ms of CPU),
        not waiting for the objects to go, an object already gone no failure."""
        for process in self.operators:
            process.stop()
        if self.leases is not None:
            self.leases.stop()
        api = self.kubectl.reader.api()
        custom = kubernetes.client.CustomObjectsApi(api)
        # The workloads first: the namespace controller deletes pods before StatefulSets, whose controller made them
        # again into the terminating namespace, refused, an Event each, hundreds a run (the API server's audit log).
        apps = kubernetes.client.AppsV1Api(api)
        for workloads in (apps.delete_collection_namespaced_stateful_set, apps.delete_collection_namespaced_deployment):
            workloads(self.kubectl.namespace)
        plural, _, group = MI.partition(".")
        for item in self.kubectl.get(MI):
            _gone_is_fine(lambda: custom.patch_namespaced_custom_object(
                group, item["apiVersion"].split("/")[1], self.kubectl.namespace, plural, item["metadata"]["name"],
                {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"))
        for kind_name in self.cluster_objects:
            _delete(self.kubectl, kind_name)


def _delete(kubectl: Kubectl, kind_name: str) -> None:
    """DELETE one object named as ``kubectl delete`` names it (``node/x``, ``pv/y``), its kind resolved as
    ``kubectl`` resolves it; not waiting for it to go, and gone already no failure (``--ignore-not-found``)."""
    kind, _, name = kind_name.partition("/")
    api = kubectl.reader.api()
    path = kubectl.reader.kinds.resolve(api, kind).path(kubectl.namespace, name)
    request = api.param_serialize("DELETE", path, header_params={"Accept": "application/json"},
                                  auth_settings=["BearerToken"])
    response = api.call_api(*request, _request_timeout=TIMEOUT)
    body = response.read()
    if response.status != 404 and not 200 <= response.status <= 299:
        raise AssertionError(f"DELETE {path} -> {response.status}: {body.decode(errors='replace').strip()}")


def _gone_is_fine(call: Callable[[], object]) -> None:
    """``call()``, where a 404 (the object is gone already) is what was wanted."""
    try:
        call()
    except kubernetes.client.ApiException as error:
        if error.status != 404:
            raise


def placement_problems(kubectl: Kubectl, pods: list[dict[str, Any]], gpus: int) -> list[str]:
    """What is wrong with ``pods`` (empty: each Running and Ready, bound to a node with at least ``gpus`` GPUs,
    each asking for ``gpus``, and no node holding more GPUs than it has)."""
    problems = []
    used: dict[str, int] = {}
    for pod in pods:
        status = pod.get("status") or {}
        node = pod["spec"].get("nodeName")
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        if status.get("phase") != "Running" or not ready or not node:
            problems.append(f"{pod['metadata']['name']}: {status.get('phase')} on {node}")
            continue
        requested = int(pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"])
        used[node] = used.get(node, 0) + requested
        if requested != gpus:
            problems.append(f"{pod['metadata']['name']}: asks for {requested} GPUs, not {gpus}")
    for node, total in used.items():
        allocatable = int(kubectl.get("node", node)["status"]["allocatable"].get("nvidia.com/gpu", "0"))
        if total > allocatable:
            problems.append(f"{node}: {total} GPUs bound of {allocatable}")
    return problems


@pytest.fixture
def fleet(kube_namespace: Namespace, tmp_path: pathlib.Path) -> Iterator[Fleet]:
    """The test's fleet in its own namespace, with the chart's RBAC installed; its operator stopped at the end."""
    f = Fleet(*clients(kube_namespace), tmp_path)
    f.install_chart_rbac()
    try:
        yield f
    finally:
        f.close()
