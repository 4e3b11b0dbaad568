"""The kubelet's node part for a test's own nodes: nodes that kwok does not play, kept Ready by a heartbeat.

kwok plays only the nodes that carry its annotation (tools/kube-cluster starts it with
``--manage-nodes-with-annotation-selector``), and with a node it plays every pod bound there: each pod Running and
Ready the moment it is bound, before anything could run in it. A test whose pods must be Ready only once their own
process serves (:mod:`.real_kubelet`) gets nodes without that annotation instead: the node is created Ready (its status
in the manifest, as a kubelet's registration writes it) and :class:`NodeLeases` renews its Lease in
``kube-node-lease``, the heartbeat that the node lifecycle controller reads; without it the controller marks the node
``Unknown`` after its grace period and takes every pod's Ready away. The pods on these nodes are the kubelet stand-in's
to start, to mark Ready and to delete once their process has ended.
"""

from __future__ import annotations

import datetime
import pathlib
import threading
import time
from typing import Any

import kubernetes

#: How often a Lease is renewed (the kubelet's default: a quarter of the lease's 40 s).
RENEW_EVERY = 10.0
LEASE_SECONDS = 40
LEASE_NAMESPACE = "kube-node-lease"
API_TIMEOUT = 15.0


def now_micro() -> str:
    """The API's MicroTime for now (a Lease's renewTime)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ready_status(capacity: dict[str, str]) -> dict[str, Any]:
    """What a kubelet's registration writes into a new node's status: its capacity, and Ready."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"capacity": capacity, "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "the test's kubelet stand-in is posting ready status",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}


class NodeLeases:
    """One thread renewing the Lease of each node :meth:`add` named, as each node's kubelet would."""

    def __init__(self, kubeconfig: pathlib.Path, *, patience: float = 30.0):
        self.api = kubernetes.client.CoordinationV1Api(kubernetes.config.new_client_from_config(
            config_file=str(kubeconfig)))
        self.core = kubernetes.client.CoreV1Api(self.api.api_client)
        self.patience = patience
        self.nodes: list[str] = []
        self.failure: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="node-leases", daemon=True)

    def add(self, name: str) -> None:
        """Heartbeat node ``name`` from now on (its first Lease is written before this returns)."""
        self._renew(name)
        self.nodes.append(name)
        if not self.thread.is_alive():
            self.thread.start()

    def check(self) -> None:
        if self.failure is not None:
            raise AssertionError(f"the node heartbeat failed: {self.failure}")

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=API_TIMEOUT + 5)
        self.api.api_client.close()

    def _loop(self) -> None:
        ok = time.monotonic()
        while not self.stopping.wait(RENEW_EVERY):
            try:
                for name in list(self.nodes):
                    self._renew(name)
                ok = time.monotonic()
            except (kubernetes.client.ApiException, OSError) as exc:  # a loaded API server: again next period
                if time.monotonic() - ok > self.patience:
                    self.failure = f"no renewal succeeded for {self.patience:g}s: {type(exc).__name__}: {exc}"
                    return

    def _renew(self, name: str) -> None:
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()}
        try:
            self.api.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": spec}, _request_timeout=API_TIMEOUT)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(name, _request_timeout=API_TIMEOUT)
            # owned by its node, as a kubelet's Lease is: deleting the node collects it
            owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}
            self.api.create_namespaced_lease(LEASE_NAMESPACE, {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                "spec": spec}, _request_timeout=API_TIMEOUT)
