"""Who may reach a resource's pods: its NetworkPolicies, and the check that no port is left open unauthenticated.

Two policies cover every container port of every child (``docs/security.md``):

* ``<name>-coordinator`` (the coordinator pod): the coordinator port only from the fleet's pods, the
  operator and ``spec.network.trainers`` (and the connection must still prove the fleet secret);
  the OpenAI port from everyone, the product's front door, which takes the API key;
* ``<name>-engine`` (every engine pod): every port only from the resource's engine pods (tensor-
  parallel rendezvous on 29500 and the ranks' own connections, the weight transfer's collective
  between groups) and ``spec.network.trainers`` (a trainer's collective connects to the engines).
  Those connections carry no credentials of their own (torch.distributed), which is why the
  network must keep everybody else away.

:func:`unauthenticated_ports` reads rendered objects as the API server would apply them and names
every container port that anyone in the cluster could reach without credentials: a port of a pod no
policy selects, or one a policy opens to all while nothing authenticates it (the OpenAI port without
an API key). ``megatron-serve render`` refuses such a resource unless ``--no-strict-security``.
"""

from __future__ import annotations

import json

from typing import Any

from .kv_node import events_ingress
from .names import COORDINATOR_PORT, coordinator_name, object_meta, selector_labels
from .spec import InferenceSpec

API_KEY_ENV = "MEGATRON_SERVE_API_KEY"  # megatron_serve.server.API_KEY_ENV (the operator does not import it)


def _engine_pods(spec: InferenceSpec) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector_labels(spec.name, "engine")}}


def coordinator_policy(spec: InferenceSpec, operator_pod_labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(spec, coordinator_name(spec.name), "coordinator"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec.name, "coordinator")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    # The coordinator port: engines, OpenAI servers, the operator and the trainers only.
                    "from": [
                        _engine_pods(spec),
                        {"podSelector": {"matchLabels": selector_labels(spec.name, "coordinator")}},
                        {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(operator_pod_labels)}},
                        *spec.trainers,
                    ],
                    "ports": [{"protocol": "TCP", "port": COORDINATOR_PORT}],
                },
                {
                    # The OpenAI port is the product's front door: open to every client.
                    "ports": [{"protocol": "TCP", "port": spec.server_port}],
                },
            ],
        },
    }


def engine_policy(spec: InferenceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(spec, f"{spec.name}-engine", "engine"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec.name, "engine")},
            "policyTypes": ["Ingress"],
            # Every port (the ranks' collectives listen on ports of their choosing): the fleet's engines
            # and its trainers only. Probes are exec probes; the coordinator never connects to an engine.
            # spec.engine.kvEvents.subscribers: the events ports also from a gateway's indexer.
            "ingress": [{"from": [_engine_pods(spec), *spec.trainers]}, *events_ingress(spec)],
        },
    }


# ----------------------------------------------------------------------------- the check


def _selects(policy: dict[str, Any], pod_labels: dict[str, str], namespace: str) -> bool:
    spec = policy["spec"]
    if policy["metadata"].get("namespace") != namespace or "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return False
    selector = spec.get("podSelector") or {}
    if set(selector) - {"matchLabels"}:
        return False  # matchExpressions: not rendered here; do not guess
    return all(pod_labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _admits(rule: dict[str, Any], port: dict[str, Any]) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p.get("port") in (port["containerPort"], port.get("name")) and p.get("protocol", "TCP") ==
               port.get("protocol", "TCP") for p in ports)


def _authenticated(container: dict[str, Any], port: dict[str, Any]) -> bool:
    """Whether what listens on ``port`` asks for credentials: the OpenAI server's port, given an API key."""
    keyed = any(e.get("name") == API_KEY_ENV and ("valueFrom" in e or _names_keys(e.get("value", "")))
                for e in container.get("env", []))
    return container.get("args", [""])[0] == "server" and port.get("name") == "http" and keyed


def _names_keys(document: str) -> bool:
    """Whether a key document (spec.tenants: crd_tenants) lists any key."""
    try:
        return bool(json.loads(document).get("keys"))
    except (ValueError, AttributeError):
        return False


def _pod_template(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template of a workload (a LeaderWorkerSet's leader and workers share one), else None."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return obj["spec"]["template"]
    if obj["kind"] == "LeaderWorkerSet":
        return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return None


def unauthenticated_ports(objects: list[dict[str, Any]]) -> list[str]:
    """Every container port of ``objects`` that any pod or client could reach without credentials (see the
    module docstring), as lines naming the port and what would close it."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    problems = []
    for obj in objects:
        template = _pod_template(obj)
        if template is None:
            continue
        pod_labels = template["metadata"].get("labels", {})
        covering = [p for p in policies if _selects(p, pod_labels, obj["metadata"]["namespace"])]
        for container in template["spec"]["containers"]:
            for port in container.get("ports", []):
                where = (f"{obj['kind']}/{obj['metadata']['name']} container {container['name']} port "
                         f"{port.get('name', '')} ({port['containerPort']})")
                if not covering:
                    problems.append(f"{where}: no NetworkPolicy selects this pod, so every pod in the cluster "
                                    "reaches it")
                    continue
                rules = [r for p in covering for r in p["spec"].get("ingress", []) if _admits(r, port)]
                if any(not r.get("from") for r in rules) and not _authenticated(container, port):
                    problems.append(f"{where}: open to every pod and client, and nothing asks for credentials: set "
                                    "spec.server.apiKeySecretRef (a Secret key holding the API key)")
    return problems
