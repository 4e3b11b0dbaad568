"""The chart with the real ``helm`` on a real cluster: lint, install (waiting for the operator's pod to be Ready),
upgrade (a values change rolls the operator; the same values do not), uninstall, and ``helm template | kubectl
apply --dry-run=server`` of both RBAC scopes.

``test_operator_chart.py`` renders the chart through Helm's library and checks the objects against the published
OpenAPI schemas; only a real server runs what the chart asks of it at install time: the ``lookup`` that keeps the
token key across upgrades, admission of every object, and a Deployment that rolls out. The operator's pod runs
under kwok (no kubelet pulls the image): Running and Ready mean it was scheduled and admitted, not that the
operator inside it works (``test_real_operator.py`` runs the operator itself with this chart's ServiceAccount).
"""

from __future__ import annotations

import base64

import pytest
import yaml

from .real_tools import CHART, Helm, Kubectl, clients, pod_ready, release_pods, until
from .real_cluster import Namespace, kube, kube_namespace  # noqa: F401 - the fixtures


@pytest.fixture
def tools(kube_namespace: Namespace) -> tuple[Kubectl, Helm]:
    return clients(kube_namespace)


def release(kubectl: Kubectl) -> str:
    """A release name of this test's own (its ClusterRole is named after it)."""
    return f"mo-{kubectl.namespace}"[:40].rstrip("-")


def test_helm_lint_is_clean(tools: tuple[Kubectl, Helm]):
    _, helm = tools
    done = helm.run("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in done.stdout, done.stdout
    bad = helm.run("lint", "--strict", str(CHART), "--set", "rbac.scope=everywhere", check=False)
    assert bad.returncode != 0 and "/rbac/scope" in bad.stdout, bad.stdout  # the values schema names the key




def test_install_upgrade_and_uninstall(tools: tuple[Kubectl, Helm]):
    kubectl, helm = tools
    name = release(kubectl)
    helm.run("install", name, str(CHART), "--wait", "--timeout=120s")
    (pod,) = release_pods(kubectl, name)
    assert pod_ready(pod) and pod["spec"]["nodeName"], pod["status"]
    assert pod["spec"]["serviceAccountName"] == f"{name}-megatron-operator"
    secret = kubectl.get("secret", f"{name}-megatron-operator-token-key")
    key = secret["data"]["token-key"]
    assert len(base64.b64decode(key)) == 48

    # the same values: nothing rolls (the control of the next step)
    helm.run("upgrade", name, str(CHART), "--wait", "--timeout=120s", "--reuse-values")
    (same,) = release_pods(kubectl, name)
    assert same["metadata"]["uid"] == pod["metadata"]["uid"]

    # a values change rolls the operator: a new pod with the new setting, Ready
    helm.run("upgrade", name, str(CHART), "--wait", "--timeout=120s", "--set", "operator.reconcileIntervalSeconds=5")
    rolled = until(lambda: [p for p in release_pods(kubectl, name)
                            if p["metadata"]["uid"] != pod["metadata"]["uid"] and pod_ready(p)], 60, "the rolled pod")
    (container,) = rolled[0]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MEGATRON_OPERATOR_RECONCILE_INTERVAL"] == "5"
    # the chart's lookup kept the token key: coordinator tokens derived before the upgrade stay valid
    assert kubectl.get("secret", f"{name}-megatron-operator-token-key")["data"]["token-key"] == key

    helm.run("uninstall", name, "--wait", "--timeout=120s")
    until(lambda: not release_pods(kubectl, name), 60, "the operator's pods gone")
    assert kubectl.get("deployment", f"{name}-megatron-operator") is None
    assert kubectl.get("clusterrole", f"{name}-megatron-operator") is None
    assert kubectl.get("serviceaccount", f"{name}-megatron-operator") is None
    # kept by helm.sh/resource-policy: keep, as the chart promises
    assert kubectl.get("secret", f"{name}-megatron-operator-token-key")["data"]["token-key"] == key
    assert kubectl.get("crd", "megatroninferences.serving.megatron.dev") is not None


@pytest.mark.parametrize("values", [
    [],
    ["--set", "rbac.scope=namespace"],
    ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
     "--set", "grafana.dashboard.enabled=true", "--set", "operator.logLevel=debug",
     "--set", "priorityClassName=system-cluster-critical", "--set", "operator.leaderWorkerSet=never"],
], ids=["defaults", "namespace-scope", "monitoring-and-more"])
def test_helm_template_passes_server_dry_run(tools: tuple[Kubectl, Helm], values: list[str]):
    kubectl, helm = tools
    rendered = helm.run("template", release(kubectl), str(CHART), f"--namespace={kubectl.namespace}",
                        f"--set=watchNamespaces={{{kubectl.namespace}}}", *values).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert {"Deployment", "ServiceAccount", "Secret"} <= {d["kind"] for d in docs}
    done = kubectl.apply(rendered, "--dry-run=server", "--validate=strict", check=False)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
