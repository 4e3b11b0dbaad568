"""The names, labels and metadata of a resource's children (shared by rendering and its network policies), and the
Service around a component's pods, which is little more."""

from __future__ import annotations

from typing import Any

from . import crd
from .spec import InferenceSpec

COORDINATOR_PORT = crd.COORDINATOR_PORT
RENDEZVOUS_PORT = 29500
MANAGED_BY = "megatron-operator"
GROUP_LABEL = f"{crd.GROUP}/group"


def secret_name(name: str) -> str:
    return f"{name}-coordinator-token"


def coordinator_name(name: str) -> str:
    return f"{name}-coordinator"


def server_service_name(name: str) -> str:
    return name


def engine_name(name: str, group: int) -> str:
    return f"{name}-engine-{group}"


def endpoint(name: str, namespace: str, port: int) -> str:
    return f"http://{server_service_name(name)}.{namespace}.svc:{port}/v1"


def coordinator_service_address(name: str, namespace: str) -> str:
    """The coordinator address used inside the cluster (engines)."""
    return f"tcp://{coordinator_name(name)}.{namespace}.svc:{COORDINATOR_PORT}"


def selector_labels(name: str, component: str, group: int | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "megatron-serve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }
    if group is not None:
        labels[GROUP_LABEL] = str(group)
    return labels


def labels(name: str, component: str, group: int | None = None) -> dict[str, str]:
    return {**selector_labels(name, component, group), "app.kubernetes.io/managed-by": MANAGED_BY}


def engine_pod_selector(name: str) -> str:
    """Label selector of the engine pods (status.selector, for the scale subresource)."""
    return f"app.kubernetes.io/name=megatron-serve,app.kubernetes.io/instance={name},app.kubernetes.io/component=engine"


def object_meta(spec: InferenceSpec, name: str, component: str, group: int | None = None) -> dict[str, Any]:
    """A child's metadata: its name, namespace, labels and (once the resource has a uid) its owner."""
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": labels(spec.name, component, group)}
    if spec.uid:
        meta["ownerReferences"] = [{
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "name": spec.name,
            "uid": spec.uid,
            "controller": True,
        }]
    return meta


def service(spec: InferenceSpec, name: str, component: str, ports: list[dict[str, Any]], *, group: int | None = None,
            headless: bool = False, publish_not_ready: bool = False) -> dict[str, Any]:
    """A Service named ``name`` selecting the ``component`` pods (of engine group ``group``), TCP on ``ports``
    (each ``{name, port, targetPort}``). ``headless``: no cluster IP, its name resolves to each pod; with
    ``publish_not_ready`` also to pods not ready yet."""
    body: dict[str, Any] = ({"clusterIP": "None", "publishNotReadyAddresses": publish_not_ready} if headless
                            else {"type": "ClusterIP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(spec, name, component, group),
        "spec": {**body, "selector": selector_labels(spec.name, component, group),
                 "ports": [{**port, "protocol": "TCP"} for port in ports]},
    }
