"""tools/kube-cluster's control plane does what a real cluster does, through the official ``kubernetes`` client.

Nothing here is mocked: the API server, controller-manager and scheduler are the upstream binaries; only the
kubelets are kwok's (pods become Running/Ready without containers), which is what a GPU-less machine can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.client import (AppsV1Api, AuthenticationV1TokenRequest, CoreV1Api, RbacAuthorizationV1Api,
                               VersionApi)
from kubernetes.client.exceptions import ApiException

from .real_tools import until
from .real_cluster import KUBERNETES_VERSION, KubeCluster, Namespace, kube, kube_namespace  # noqa: F401

GPU = "nvidia.com/gpu"


@pytest.fixture
def client(kube: KubeCluster) -> Iterator[kubernetes.client.ApiClient]:  # noqa: F811 - the fixture imported above
    with kube.api_client() as api:
        yield api


@pytest.fixture
def gpu_nodes(kube: KubeCluster, client: kubernetes.client.ApiClient) -> list[Any]:  # noqa: F811
    """The Ready nodes offering GPUs; another cluster than ours without two of them skips the GPU tests."""
    nodes = [n for n in CoreV1Api(client).list_node().items
             if int((n.status.allocatable or {}).get(GPU, "0")) > 0
             and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]
    if len(nodes) < 2 and not kube.ours:
        pytest.skip(f"{kube.kubeconfig} has {len(nodes)} Ready nodes offering {GPU}; these tests need two")
    return nodes


def gpu_pod_spec(gpus: int) -> dict[str, Any]:
    return {"containers": [{"name": "engine", "image": "registry.invalid/engine:1",
                            "resources": {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}}}]}


def test_the_server_reports_the_stamped_version(kube: KubeCluster, client: kubernetes.client.ApiClient):  # noqa: F811
    if not kube.ours:
        pytest.skip("the stamped version is tools/kube-cluster's; this cluster is another")
    assert VersionApi(client).get_code().git_version == KUBERNETES_VERSION
    assert f"Server Version: {KUBERNETES_VERSION}" in kube.kubectl("version").stdout


def test_at_least_two_ready_gpu_nodes(gpu_nodes: list[Any]):
    assert len(gpu_nodes) >= 2, [n.metadata.name for n in gpu_nodes]
    for node in gpu_nodes:
        assert node.metadata.labels["nvidia.com/gpu.product"]
        assert node.metadata.labels["topology.kubernetes.io/zone"]
        assert node.metadata.labels["kubernetes.io/hostname"] == node.metadata.name


def _pods(core: CoreV1Api, namespace: str, selector: str) -> list[Any]:
    return core.list_namespaced_pod(namespace, label_selector=selector).items


def test_statefulset_pods_are_scheduled_onto_gpu_nodes_and_collected(client: kubernetes.client.ApiClient,
                                                                      kube_namespace: Namespace,  # noqa: F811
                                                                      gpu_nodes: list[Any]):
    """The StatefulSet controller names the pods, the scheduler binds each to a node with a free GPU, kwok runs
    them; deleting the StatefulSet lets the garbage collector remove them."""
    apps, core, ns = AppsV1Api(client), CoreV1Api(client), kube_namespace.name
    labels = {"app": "engine"}
    apps.create_namespaced_stateful_set(ns, {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "engine"},
        "spec": {"replicas": 2, "serviceName": "engine", "selector": {"matchLabels": labels},
                 "podManagementPolicy": "Parallel",
                 "template": {"metadata": {"labels": labels}, "spec": gpu_pod_spec(1)}}})
    until(lambda: (apps.read_namespaced_stateful_set("engine", ns).status.ready_replicas or 0) == 2, 90,
          "2 ready replicas")
    pods = _pods(core, ns, "app=engine")
    assert sorted(p.metadata.name for p in pods) == ["engine-0", "engine-1"]
    for pod in pods:
        assert pod.status.phase == "Running"
        assert pod.spec.node_name in {n.metadata.name for n in gpu_nodes}, (pod.metadata.name, pod.spec.node_name)
        scheduled = next(c for c in pod.status.conditions if c.type == "PodScheduled")
        assert scheduled.status == "True"
    apps.delete_namespaced_stateful_set("engine", ns)
    until(lambda: not _pods(core, ns, "app=engine"), 90, "the garbage collector to remove the pods")


def test_deployment_pods_run_and_go_with_their_owner(client: kubernetes.client.ApiClient,
                                                     kube_namespace: Namespace,  # noqa: F811
                                                     gpu_nodes: list[Any]):
    apps, core, ns = AppsV1Api(client), CoreV1Api(client), kube_namespace.name
    labels = {"app": "router"}
    apps.create_namespaced_deployment(ns, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "router"},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": gpu_pod_spec(1)}}})
    until(lambda: (apps.read_namespaced_deployment("router", ns).status.ready_replicas or 0) == 2, 90,
          "2 ready replicas")
    assert all(p.status.phase == "Running" and p.spec.node_name for p in _pods(core, ns, "app=router"))
    apps.delete_namespaced_deployment("router", ns)
    until(lambda: not _pods(core, ns, "app=router") and not apps.list_namespaced_replica_set(ns).items, 90,
          "the ReplicaSet and its pods to be collected")


def test_a_pod_wanting_more_gpus_than_any_node_stays_pending_with_the_schedulers_reason(
        client: kubernetes.client.ApiClient, kube_namespace: Namespace, gpu_nodes: list[Any]):  # noqa: F811
    core, ns = CoreV1Api(client), kube_namespace.name
    most = max(int(n.status.allocatable[GPU]) for n in gpu_nodes)
    core.create_namespaced_pod(ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big"},
                                    "spec": gpu_pod_spec(most + 1)})

    def unschedulable() -> Any:
        pod = core.read_namespaced_pod("too-big", ns)
        return next((c for c in pod.status.conditions or [] if c.type == "PodScheduled" and c.status == "False"),
                    None)

    condition = until(unschedulable, 60, "the scheduler's verdict")
    assert condition.reason == "Unschedulable"
    assert f"Insufficient {GPU}" in condition.message
    pod = core.read_namespaced_pod("too-big", ns)
    assert pod.status.phase == "Pending" and not pod.spec.node_name


def _token_client(kube: KubeCluster, token: str) -> kubernetes.client.ApiClient:  # noqa: F811
    """A client that presents only a ServiceAccount token (the admin's certificate is left out)."""
    admin = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kube.kubeconfig), client_configuration=admin)
    configuration = kubernetes.client.Configuration()
    configuration.host = admin.host
    configuration.ssl_ca_cert = admin.ssl_ca_cert
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(configuration)


def test_a_service_account_token_is_refused_until_a_role_binding_allows_it(
        kube: KubeCluster, client: kubernetes.client.ApiClient, kube_namespace: Namespace):  # noqa: F811
    core, rbac, ns = CoreV1Api(client), RbacAuthorizationV1Api(client), kube_namespace.name
    core.create_namespaced_service_account(ns, {"metadata": {"name": "operator"}})
    token = core.create_namespaced_service_account_token(
        "operator", ns, AuthenticationV1TokenRequest(spec={"expirationSeconds": 600})).status.token
    with _token_client(kube, token) as as_operator:
        with pytest.raises(ApiException) as refused:
            CoreV1Api(as_operator).list_namespaced_pod(ns)
        assert refused.value.status == 403
        assert f"system:serviceaccount:{ns}:operator" in refused.value.body
        rbac.create_namespaced_role(ns, {"metadata": {"name": "pod-reader"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]})
        rbac.create_namespaced_role_binding(ns, {
            "metadata": {"name": "operator-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": ns}]})

        def allowed() -> bool:
            try:
                CoreV1Api(as_operator).list_namespaced_pod(ns)
            except ApiException as error:
                if error.status != 403:
                    raise
                return False
            return True

        until(allowed, 30, "the RoleBinding to take effect")
        with pytest.raises(ApiException) as still_refused:  # the Role grants reads only
            CoreV1Api(as_operator).delete_collection_namespaced_pod(ns)
        assert still_refused.value.status == 403


def test_the_default_service_account_and_root_ca_are_provisioned(client: kubernetes.client.ApiClient,
                                                                 kube_namespace: Namespace):  # noqa: F811
    """The ServiceAccount and root-CA publisher controllers fill every new namespace, as kubelets expect."""
    core, ns = CoreV1Api(client), kube_namespace.name
    until(lambda: core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items, 30,
          "the default ServiceAccount")
    ca = until(lambda: core.list_namespaced_config_map(ns, field_selector="metadata.name=kube-root-ca.crt").items,
               30, "kube-root-ca.crt")
    assert "BEGIN CERTIFICATE" in ca[0].data["ca.crt"]


def test_a_leaderworkerset_gang_runs_under_the_real_lws_controller(kube: KubeCluster,  # noqa: F811
                                                                   client: kubernetes.client.ApiClient,
                                                                   kube_namespace: Namespace,  # noqa: F811
                                                                   gpu_nodes: list[Any]):
    """LWS's controller makes the leader's and the workers' StatefulSets, its webhook labels each pod with its
    worker index and gives it the leader's address; a group of two 8-GPU pods lands on two GPU nodes."""
    extensions = kubernetes.client.ApiextensionsV1Api(client)
    if not extensions.list_custom_resource_definition(
            field_selector="metadata.name=leaderworkersets.leaderworkerset.x-k8s.io").items:
        pytest.skip("this cluster has no LeaderWorkerSet CRD (tools/kube-cluster installs it)")
    core, ns = CoreV1Api(client), kube_namespace.name
    kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", ns, "leaderworkersets", {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": "gang"},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": gpu_pod_spec(8)}}}})
    selector = "leaderworkerset.sigs.k8s.io/name=gang"

    def both_running() -> list[Any]:
        pods = _pods(core, ns, selector)
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else []

    pods = until(both_running, 90, "the leader and its worker Running")
    pods = sorted(pods, key=lambda p: p.metadata.name)
    assert [p.metadata.name for p in pods] == ["gang-0", "gang-0-1"]
    assert [p.metadata.labels["leaderworkerset.sigs.k8s.io/worker-index"] for p in pods] == ["0", "1"]
    assert pods[0].spec.node_name != pods[1].spec.node_name  # 8 GPUs each: one node apiece
    env = {e.name: e.value for e in pods[1].spec.containers[0].env}
    assert env["LWS_LEADER_ADDRESS"] == f"gang-0.gang.{ns}"
