"""The operator's own Kubernetes API calls (kopf makes the others: watch, patch of the resource).

A deliberately small surface, so that the RBAC rules can be read off it: every call goes
through :class:`Kube`, and :data:`PERMISSIONS` lists each (API group, resource, verb) the
operator needs, kopf's included. The chart's and kustomize base's RBAC rules are tested to
equal it, and the KMock tests check that every request the operator makes is covered.

Calls run the official ``kubernetes`` client in a worker thread, with the same credentials
kopf uses (in-cluster service account, else ``KUBECONFIG``). Patches are JSON merge patches.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote, urlencode

from . import __version__, crd, leader_worker_set as lws

# (apiVersion, kind) -> (URL prefix, plural)
KINDS: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "Secret"): ("/api/v1", "secrets"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("apps/v1", "StatefulSet"): ("/apis/apps/v1", "statefulsets"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets"),
    (lws.API_VERSION, lws.KIND): (f"/apis/{lws.API_VERSION}", lws.PLURAL),
    ("v1", "Pod"): ("/api/v1", "pods"),
}

# Every API call of the operator process: (apiGroup, resource, verbs). Kept in one place so the
# RBAC manifests can be generated from, and tested against, it.
PERMISSIONS: list[tuple[str, str, tuple[str, ...]]] = [
    # kopf: discovery of the CRD at runtime (cluster-wide mode only; scanning is off otherwise)
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
    # kopf: watching, finalizer + progress annotations, status
    (crd.GROUP, crd.PLURAL, ("list", "watch", "patch")),
    (crd.GROUP, f"{crd.PLURAL}/status", ("patch",)),
    # kopf.event(): Kubernetes Events for every transition
    ("", "events", ("create",)),
    # children (see Reconciler): read, create, patch what differs; engine groups are also
    # listed and deleted when data parallelism shrinks
    ("", "secrets", ("get", "create", "patch")),
    ("", "services", ("get", "list", "create", "patch", "delete")),
    ("apps", "deployments", ("get", "create", "patch")),
    ("apps", "statefulsets", ("get", "list", "create", "patch", "delete")),
    ("networking.k8s.io", "networkpolicies", ("get", "create", "patch")),
    # the fleet's disruption budgets (spec.disruptionBudget); deleted when it is disabled
    ("policy", "poddisruptionbudgets", ("get", "create", "patch", "delete")),
    # engine groups with spec.engine.parallelism, where the cluster has the LeaderWorkerSet CRD
    (lws.GROUP, lws.PLURAL, ("get", "list", "create", "patch", "delete")),
    # their ranks: listed for status.groups; a StatefulSet gang's other pods are deleted when one rank restarts
    ("", "pods", ("list", "delete")),
]

CLUSTER_ONLY = {"customresourcedefinitions"}

# kopf's peering (the chart's peering.enabled: two or more replicas, one acting): the keep-alives of an operator of
# every namespace go into a ClusterKopfPeering, those of a namespaced one into a KopfPeering in each namespace it serves
PEERING_PERMISSIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "cluster": ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch")),
    "namespace": ("kopf.dev", "kopfpeerings", ("list", "watch", "patch")),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


def _url(api_version: str, kind: str, namespace: str, name: str | None = None,
         query: dict[str, str] | None = None) -> str:
    try:
        prefix, plural = KINDS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {api_version} {kind}") from None
    url = f"{prefix}/namespaces/{quote(namespace, safe='')}/{plural}"
    if name is not None:
        url += f"/{quote(name, safe='')}"
    if query:
        url += "?" + urlencode(query)
    return url


def load_api_client() -> Any:
    """An ApiClient with the usual credentials: in-cluster first, then KUBECONFIG."""
    import os

    import kubernetes

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                           client_configuration=cfg)
    client = kubernetes.client.ApiClient(cfg)
    client.user_agent = f"megatron-operator/{__version__}"
    return client


class Kube:
    """Async get/list/create/patch/delete of the child kinds in :data:`KINDS`."""

    def __init__(self, api_client: Any | None = None):
        self._api = api_client

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = load_api_client()
        return self._api

    def _call(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        request = self.api.param_serialize(method=method, resource_path=url, header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(*request, _request_timeout=30)
            response.read()
        except ApiException as exc:
            raise KubeError(exc.status or 0, str(exc.reason or exc)) from exc
        except Exception as exc:  # connection-level errors (urllib3) have no HTTP status
            raise KubeError(0, f"{method} {url}: {exc}") from exc
        status = response.status
        data = response.data
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")
        if not 200 <= status <= 299:
            message = text
            try:
                message = json.loads(text).get("message") or text
            except (ValueError, AttributeError):
                pass
            raise KubeError(status, message)
        return json.loads(text) if text else None

    async def _run(self, *args: Any) -> Any:
        return await asyncio.to_thread(self._call, *args)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._run("GET", _url(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``api_version`` (discovery, which every client may read):
        how the operator finds the LeaderWorkerSet CRD installed."""
        try:
            data = await self._run("GET", f"/apis/{quote(api_version, safe='/')}")
        except KubeError as exc:
            if exc.status in (403, 404):
                return False
            raise
        return any(item.get("name") == plural for item in (data or {}).get("resources") or [])

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        data = await self._run("GET", _url(api_version, kind, namespace, query={"labelSelector": label_selector}))
        items = list((data or {}).get("items") or [])
        return [item for item in items if _matches(item, label_selector)]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._run("POST", _url(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str,
                    patch: dict[str, Any]) -> dict[str, Any]:
        return await self._run("PATCH", _url(api_version, kind, namespace, name), patch,
                               "application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str, name: str,
                     propagation: str = "Background") -> None:
        """Delete one object; ``propagation`` is the garbage collector's policy for what it owns (``Orphan`` keeps
        it)."""
        try:
            await self._run("DELETE", _url(api_version, kind, namespace, name),
                            {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation})
        except KubeError as exc:
            if exc.status != 404:
                raise


def _matches(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based label selector check (servers filter already; this is belt and braces)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True
