"""``Kubectl.get`` and ``events`` read through the API in-process (``real_reads``) and answer what the real
``kubectl get -o json`` answers, for every kind the real-cluster tests read, with no process.

The in-process side is a ``Kubectl`` whose binary does not exist: a read that started a process would fail. The
real ``kubectl`` of the same cluster is the oracle: each comparison polls until both agree (a controller may add
an object between two reads), so a kind resolved to another group, version or scope never passes.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import yaml

from .real_cluster import Namespace, kube, kube_namespace  # noqa: F401 - the fixtures
from .real_tools import MI, Kubectl, clients, established, example, until

#: What the tests name in their reads (tests/operator/test_real_*.py, real_*.py), beyond the fixture's own objects.
LISTED = ["pods", "pod", "statefulset", "statefulsets", "sts", "deployment", "pdb", "poddisruptionbudgets", "hpa",
          "service", "secret", "serviceaccount", "role", "pvc", "endpointslices", "events", "lease", "configmaps",
          MI, "pods,poddisruptionbudgets",
          "secrets,services,deployments,statefulsets,replicasets,controllerrevisions,networkpolicies,pods"]
#: The kinds that hold an object named "reads" here (an EndpointSlice is named by its controller).
NAMED = [kind for kind in LISTED if "," not in kind and kind not in ("endpointslices", "events", MI)]
#: Cluster-scoped kinds: read without the namespace.
CLUSTER_LISTED = ["nodes", "node", "crd", "clusterrole"]


def objects(namespace: str) -> list[dict[str, Any]]:
    """One object of each kind the tests read (replicas 0: nothing for kwok to run), and a resource of ours."""
    meta = {"name": "reads", "namespace": namespace}
    selector = {"matchLabels": {"app": "reads"}}
    template = {"metadata": {"labels": {"app": "reads"}},
                "spec": {"containers": [{"name": "c", "image": "registry.invalid/reads:1"}]}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"answer": "42"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "labels": {"app": "reads-pod"}},
         "spec": template["spec"]},
        {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"token": "t"}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": [{"port": 80}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
         "spec": {"minAvailable": 1, "selector": selector}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": 0, "selector": selector, "template": template}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
         "spec": {"replicas": 0, "selector": selector, "serviceName": "reads", "template": template}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "reads"},
                  "minReplicas": 1, "maxReplicas": 2}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta,
         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {"holderIdentity": "t"}},
        example("single-gpu.yaml", namespace),
    ]


def event(namespace: str, name: str, subject: str, when: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "ConfigMap", "name": subject, "namespace": namespace},
            "reason": name, "message": name, "type": "Normal", "source": {"component": "reads-test"},
            "firstTimestamp": when, "lastTimestamp": when, "count": 1}


def kubectl_json(kubectl: Kubectl, *args: str) -> Any:
    """What the real ``kubectl get ... -o json`` prints: the object (None: NotFound), or the list's items."""
    done = kubectl.run("get", *args, "-o", "json", check=False)
    if "NotFound" in done.stderr:
        return None
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout).get("items", json.loads(done.stdout))


def identities(answer: Any) -> Any:
    """What tells objects apart: kind, apiVersion, namespace, name and uid (of each item of a list)."""
    def one(o: dict[str, Any]) -> tuple[str, ...]:
        return (o["kind"], o["apiVersion"], o["metadata"].get("namespace", ""), o["metadata"]["name"],
                o["metadata"]["uid"])
    return sorted(map(one, answer)) if isinstance(answer, list) else answer and one(answer)


@pytest.fixture
def pair(kube_namespace: Namespace, tmp_path: pathlib.Path) -> tuple[Kubectl, Kubectl]:
    """The real ``kubectl`` (and the CRDs installed) and a ``Kubectl`` that cannot start one."""
    kubectl, _ = clients(kube_namespace)
    return kubectl, Kubectl(kube_namespace.kubeconfig, kube_namespace.name, str(tmp_path / "no-such-kubectl"))


def test_every_kind_the_tests_read_answers_as_kubectl_without_a_process(pair: tuple[Kubectl, Kubectl]):
    kubectl, ours = pair
    ns = kubectl.namespace
    kubectl.apply(objects(ns) + [event(ns, "first", "subject", "2026-01-01T00:00:01Z"),
                                 event(ns, "second", "subject", "2026-01-01T00:00:02Z"),
                                 event(ns, "other", "bystander", "2026-01-01T00:00:03Z")])
    for kind in LISTED + CLUSTER_LISTED:
        until(lambda: identities(ours.get(kind)) == identities(kubectl_json(kubectl, kind)), 30,
              f"{kind}: the same objects as kubectl get {kind}")
    for kind, name in [*((kind, "reads") for kind in NAMED), (MI, "llama-1b"), ("events", "first")]:
        assert ours.get(kind, name) is not None, kind
        assert identities(ours.get(kind, name)) == identities(kubectl_json(kubectl, kind, name)), kind
        assert ours.get(kind, "absent") is None and kubectl_json(kubectl, kind, "absent") is None, kind
    node = kubectl_json(kubectl, "nodes")[0]["metadata"]["name"]
    assert identities(ours.get("node", node)) == identities(kubectl_json(kubectl, "node", node))
    for stable in ("secret", "configmaps", "role", "serviceaccount"):  # nothing writes these: the whole answer
        assert ours.get(stable) == kubectl_json(kubectl, stable), stable
        assert ours.get(stable, "reads") == kubectl_json(kubectl, stable, "reads"), stable
    assert [e["reason"] for e in ours.events("subject")] == ["first", "second"]  # by time, not the other's
    assert identities(ours.events("subject")) == identities(
        kubectl_json(kubectl, "events", "--field-selector=involvedObject.name=subject"))


def test_selectors_are_the_api_servers(pair: tuple[Kubectl, Kubectl]):
    kubectl, ours = pair
    ns = kubectl.namespace
    labelled = [{"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": f"cm-{i}", "namespace": ns, "labels": {"tier": tier}}}
                for i, tier in enumerate(["a", "b", "a"])]
    kubectl.apply(labelled)
    for flags in (["-l=tier=a"], ["--selector=tier in (a,b)"], ["--field-selector=metadata.name=cm-1"],
                  ["-l=tier=a", "--field-selector=metadata.name!=cm-0"], ["-l=tier=c"]):
        assert identities(ours.get("configmaps", None, *flags)) == identities(
            kubectl_json(kubectl, "configmaps", *flags)), flags
    assert [c["metadata"]["name"] for c in ours.get("cm", None, "-l=tier=a")] == ["cm-0", "cm-2"]
    node = kubectl_json(kubectl, "nodes")[0]
    label, value = next(iter(node["metadata"]["labels"].items()))
    assert identities(ours.get("nodes", None, f"-l={label}={value}")) == identities(
        kubectl_json(kubectl, "nodes", f"-l={label}={value}"))


def test_a_kind_installed_after_the_first_read_resolves(pair: tuple[Kubectl, Kubectl]):
    """The kinds are discovered once per process: a CRD applied since is found by rediscovering on the miss, by
    every name kubectl takes, namespaced or cluster-scoped."""
    kubectl, ours = pair
    group = f"{kubectl.namespace}.reads.test"
    assert ours.get("pods") == []  # the table exists before the CRDs do
    crds = [{"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
             "metadata": {"name": f"{plural}.{group}"},
             "spec": {"group": group, "scope": scope,
                      "names": {"plural": plural, "singular": plural[:-1], "kind": kind, "shortNames": [short]},
                      "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                          "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
            for plural, kind, short, scope in (("widgets", "Widget", "wdg", "Namespaced"),
                                               ("gadgets", "Gadget", "gdg", "Cluster"))]
    kubectl.apply(crds)
    try:
        for crd in crds:
            established(kubectl, crd["metadata"]["name"])
        kubectl.apply([{"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w"}},
                       {"apiVersion": f"{group}/v1", "kind": "Gadget", "metadata": {"name": f"g-{group}"}}])
        for name in ("widgets", "widget", "wdg", "Widget", f"widgets.{group}", f"widget.v1.{group}"):
            assert [(w["kind"], w["apiVersion"], w["metadata"]["name"]) for w in ours.get(name)] == \
                [("Widget", f"{group}/v1", "w")], name
        (gadget,) = ours.get(f"gdg.{group}")
        assert "namespace" not in gadget["metadata"]
        assert ours.get("gadget", f"g-{group}")["metadata"]["uid"] == gadget["metadata"]["uid"]
    finally:
        for crd in crds:
            kubectl.run("delete", "crd", crd["metadata"]["name"], "--wait=false", check=False)


def test_a_kind_the_server_lacks_is_named(pair: tuple[Kubectl, Kubectl]):
    _, ours = pair
    with pytest.raises(AssertionError, match="doesn't have a resource type 'frobnicators'"):
        ours.get("frobnicators")
    with pytest.raises(AssertionError, match="'frobnicators'"):
        ours.get("pods,frobnicators")


@pytest.mark.parametrize(("args", "refusal"), [
    (("pods", None, "-o=json"), "'-o=json' is not a selector"),
    (("pods", None, "-l", "app=x"), "'-l' is not a selector"),
    (("pods", None, "--all-namespaces"), "'--all-namespaces' is not a selector"),
    (("pods", None, "-l=a=b", "--selector=c=d"), "repeats the labelSelector"),
    (("pods", "p", "-l=a=b"), "name 'p' goes with one kind and no selector"),
    (("pods,services", "p"), "name 'p' goes with one kind"),
    (("", None), "kind '' is not a resource type"),
])
def test_bad_reads_are_refused_before_any_request(tmp_path: pathlib.Path, args: tuple[Any, ...], refusal: str):
    """Refused by what they say, with no cluster at all behind the kubeconfig."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config"}))
    with pytest.raises(ValueError, match=re.escape(refusal)):
        Kubectl(kubeconfig, "ns", str(tmp_path / "no-such-kubectl")).get(*args)
