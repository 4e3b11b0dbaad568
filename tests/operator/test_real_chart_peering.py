"""The chart's peering mode with the real ``helm`` on a real cluster: ``helm install`` with ``replicaCount: 2`` and
``peering.enabled``; one replica acts and the other stands by; the acting one is killed and the other takes over;
the pod the Deployment makes in place of the killed one stands by behind the survivor.

Real: helm, the API server (the chart's CRDs, its ``KopfPeering``, its Role with the peering rule), the Deployment
and ReplicaSet controllers, the scheduler, the operators (kopf's peering) holding the chart ServiceAccount's token.
Simulated: the kubelet of the operator's pods, which run under kwok (no process in them). The test runs, for each
of the Deployment's pods, the process its container would run: the container's rendered arguments (``operator
--peering=...``, with the liveness endpoint on a free port, since the pods share this host) and its rendered
environment (``POD_ID`` from the pod's name through the downward API, the token key from the chart's Secret). One
variable differs per pod, the default runtime image (``MEGATRON_OPERATOR_DEFAULT_IMAGE``), so that the workloads of
a resource tell which replica wrote them. The control (two replicas without peering refused) is in
``test_operator_chart.py``; ``test_real_peering.py`` shows two ``--standalone`` operators both acting. A second
test installs one replica with a fixed ``peering.priority`` and finds it in the peering object, after ``helm install``
refused the same priority as kopf's ``--priority`` in ``operator.extraArgs``; a third installs two peered releases
side by side over kopf's CRDs from the chart's ``crds/``.
"""

from __future__ import annotations

import base64
import pathlib
from typing import Any

import pytest

from tests.helpers import Children, free_port

from .real_cluster import Namespace, kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet
from .real_tools import (CHART, MI, Kubectl, clients, example, pod_ready, release_pods, service_account_kubeconfig,
                         until)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "llama-1b"
LIFETIME = 10  # peering.lifetimeSeconds: a killed replica's keep-alive counts this long (the chart's default 60)
RESUMED = "Resuming operations after the pause"  # kopf's word, at info, when a peer starts acting


def _image(pod: str) -> str:
    return f"example.com/megatron-serve:{pod}"







def run_pod(children: Children, kubectl: Kubectl, pod: dict[str, Any], kubeconfig: pathlib.Path) -> Any:
    """The process of the operator pod ``pod``'s container, as a kubelet would start it (see the module)."""
    (container,) = pod["spec"]["containers"]
    env = {"KUBECONFIG": str(kubeconfig)}
    for item in container["env"]:
        source = item.get("valueFrom") or {}
        if "value" in item:
            env[item["name"]] = item["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod["metadata"]["name"]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = base64.b64decode(kubectl.get("secret", ref["name"])["data"][ref["key"]]).decode()
        else:
            raise AssertionError(f"the chart's container env {item} has a source this stand-in does not resolve")
    env["MEGATRON_OPERATOR_DEFAULT_IMAGE"] = _image(pod["metadata"]["name"])
    args = [f"--liveness=http://127.0.0.1:{free_port()}/healthz" if a.startswith("--liveness=") else a
            for a in container["args"]]
    return children.spawn(args, f"operator-{pod['metadata']['name']}", env)


def test_the_chart_with_two_peered_replicas_one_acts_and_the_other_takes_over(kube_namespace: Namespace,
                                                                             tmp_path: pathlib.Path):
    kubectl, helm = clients(kube_namespace)
    fleet = Fleet(kubectl, helm, tmp_path)  # the release's name and ServiceAccount; no RBAC of its own: the chart's
    children = Children(tmp_path)
    release = fleet.release
    try:
        helm.run("install", release, str(CHART), "--wait", "--timeout=120s", "--set=replicaCount=2",
                 "--set=peering.enabled=true", f"--set=peering.lifetimeSeconds={LIFETIME}",
                 "--set=rbac.scope=namespace", f"--set=watchNamespaces={{{kubectl.namespace}}}",
                 "--set=operator.reconcileIntervalSeconds=1", "--set=operator.connectTimeoutSeconds=1",
                 "--set=operator.commandTimeoutSeconds=10")
        pods = until(lambda: (p := release_pods(kubectl, release)) and len(p) == 2 and all(map(pod_ready, p)) and p,
                     60, "the chart's two operator pods Ready")
        peering = fleet.account  # the chart's default peering name: its full name
        assert kubectl.get("kopfpeerings", peering) is not None  # the chart made it
        assert pods[0]["spec"]["containers"][0]["args"][:2] == ["operator", f"--peering={peering}"]
        kubeconfig = service_account_kubeconfig(kubectl, fleet.account, tmp_path / "operator.kubeconfig")

        def peers() -> dict[str, Any]:
            return (kubectl.get("kopfpeerings", peering) or {}).get("status") or {}

        first, second = (p["metadata"]["name"] for p in pods)
        processes = {first: run_pod(children, kubectl, pods[0], kubeconfig)}
        until(lambda: first in peers(), 60, f"{first} keeping itself alive in the chart's KopfPeering")
        processes[second] = run_pod(children, kubectl, pods[1], kubeconfig)
        until(lambda: second in peers(), 60, f"{second} keeping itself alive too")
        assert peers()[first]["priority"] > peers()[second]["priority"]  # oldest-first: the first started acts

        resource = example("single-gpu.yaml", kubectl.namespace)
        fleet.prerequisites(resource)
        kubectl.apply([resource])
        until(lambda: fleet.placed(NAME, 1) and fleet.images(NAME) == {_image(first)}, 90,
              f"the engine pod Running, every workload written by {first}")
        # kopf starts paused and says so when it resumes (at the chart's log level, info): the standby never does
        assert RESUMED in children.log_of(processes[first])
        assert fleet.watch_images(NAME, 5) == {_image(first)}  # the standby writes nothing
        assert RESUMED not in children.log_of(processes[second])
        assert f"[{kubectl.namespace}/{NAME}]" not in children.log_of(processes[second])

        # the acting replica dies without a goodbye, and its pod goes: the Deployment makes another
        processes[first].kill()
        processes[first].wait(timeout=30)
        kubectl.run("delete", "pod", first, "--wait=false")
        kubectl.run("scale", f"{MI}/{NAME}", "--replicas=2")
        until(lambda: RESUMED in children.log_of(processes[second]), LIFETIME + 30,
              f"{second} resuming once {first}'s keep-alive expired")
        until(lambda: fleet.placed(NAME, 2) and fleet.images(NAME) == {_image(second)}, 90,
              f"two engine pods Running, every workload written by {second}")
        # the status the survivor writes after the pods it placed (a CI run here read it a moment before: desired 1)
        until(lambda: ((fleet.mi(NAME).get("status") or {}).get("engines") or {}).get("desired") == 2, 30,
              f"the resource's status saying 2 engines desired, written by {second}")

        # the new pod's replica starts later, so it ranks below the survivor: it stands by and the survivor acts on
        (pod,) = until(lambda: [p for p in release_pods(kubectl, release)
                                if p["metadata"]["name"] not in (first, second) and pod_ready(p)], 60,
                       "the Deployment's pod in place of the killed one")
        third = pod["metadata"]["name"]
        processes[third] = run_pod(children, kubectl, pod, kubeconfig)
        until(lambda: third in peers(), 60, f"the new replica {third} keeping itself alive")
        assert peers()[second]["priority"] > peers()[third]["priority"]
        kubectl.run("scale", f"{MI}/{NAME}", "--replicas=1")
        until(lambda: fleet.placed(NAME, 1), 90, f"the scale-down done by {second}")
        assert fleet.watch_images(NAME, 5) == {_image(second)}
        assert RESUMED not in children.log_of(processes[third])
        assert f"[{kubectl.namespace}/{NAME}]" not in children.log_of(processes[third])
    finally:
        children.kill_all()
        fleet.close()


def test_the_charts_fixed_priority_reaches_kopfs_peering_object(kube_namespace: Namespace, tmp_path: pathlib.Path):
    """``peering.priority`` as an integer: the single replica's operator keeps itself alive in the chart's
    KopfPeering with that priority and acts, and its Deployment recreates. The control: the same priority as kopf's
    ``--priority`` in ``operator.extraArgs``, which the chart's environment used to replace without a word, is
    refused by ``helm install``, naming the value, and nothing is installed."""
    kubectl, helm = clients(kube_namespace)
    fleet = Fleet(kubectl, helm, tmp_path)
    children = Children(tmp_path)
    release = fleet.release
    values = ["--set=peering.enabled=true", "--set=rbac.scope=namespace",
              f"--set=watchNamespaces={{{kubectl.namespace}}}"]
    try:
        refused = helm.run("install", release, str(CHART), *values, "--set=operator.extraArgs={--priority=200}",
                           check=False)
        assert refused.returncode != 0 and "set peering.priority instead" in refused.stderr, refused.stderr
        assert kubectl.get("deployment", fleet.account) is None

        helm.run("install", release, str(CHART), "--wait", "--timeout=120s", *values, "--set=peering.priority=200")
        (pod,) = until(lambda: (p := release_pods(kubectl, release)) and all(map(pod_ready, p)) and p, 60,
                       "the chart's operator pod Ready")
        assert kubectl.get("deployment", fleet.account)["spec"]["strategy"]["type"] == "Recreate"
        kubeconfig = service_account_kubeconfig(kubectl, fleet.account, tmp_path / "operator.kubeconfig")
        process = run_pod(children, kubectl, pod, kubeconfig)
        name = pod["metadata"]["name"]
        until(lambda: ((kubectl.get("kopfpeerings", fleet.account) or {}).get("status") or {}).get(name), 60,
              f"{name} keeping itself alive in the chart's KopfPeering")
        assert kubectl.get("kopfpeerings", fleet.account)["status"][name]["priority"] == 200
        until(lambda: RESUMED in children.log_of(process), 60, f"{name}, the only peer, acting")
    finally:
        children.kill_all()
        fleet.close()


def test_peered_releases_share_kopfs_crds_from_the_charts_crds_folder(kube_namespace: Namespace,
                                                                     tmp_path: pathlib.Path):
    """kopf's peering CRDs stay in the chart's ``crds/``: helm creates them where absent, before any template, and
    leaves them to every release and every other kopf operator of the cluster. Two releases with peering on (one
    cluster-wide with its ClusterKopfPeering, one namespaced with its KopfPeering) install side by side; the CRDs are
    the same objects before and after, owned by no release; uninstalling one removes its peering object only. The
    control, the CRDs under templates/ behind peering.enabled, failed the first install here both ways: on a cluster
    without them helm cannot build the release's peering object before its CRD exists ("ensure CRDs are installed
    first"), and where they exist (this chart's earlier install, another release, another kopf operator) helm
    refuses to adopt them ("invalid ownership metadata")."""
    kubectl, helm = clients(kube_namespace)
    cluster_wide, namespaced = (f"mo-{kubectl.namespace}"[:36] + suffix for suffix in ("-c", "-n"))
    crds = ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
    try:
        helm.run("install", cluster_wide, str(CHART), "--set=peering.enabled=true")
        uids = {crd: kubectl.get("crd", crd)["metadata"]["uid"] for crd in crds}
        helm.run("install", namespaced, str(CHART), "--set=peering.enabled=true", "--set=rbac.scope=namespace",
                 f"--set=watchNamespaces={{{kubectl.namespace}}}")
        assert kubectl.get("clusterkopfpeerings", f"{cluster_wide}-megatron-operator") is not None
        assert kubectl.get("kopfpeerings", f"{namespaced}-megatron-operator") is not None
        for crd in crds:
            found = kubectl.get("crd", crd)
            assert found["metadata"]["uid"] == uids[crd]
            assert "meta.helm.sh/release-name" not in (found["metadata"].get("annotations") or {})

        helm.run("uninstall", cluster_wide, "--wait", "--timeout=120s")
        assert kubectl.get("clusterkopfpeerings", f"{cluster_wide}-megatron-operator") is None
        assert kubectl.get("kopfpeerings", f"{namespaced}-megatron-operator") is not None
        assert {crd: (kubectl.get("crd", crd) or {}).get("metadata", {}).get("uid") for crd in crds} == uids
    finally:
        for release in (cluster_wide, namespaced):
            helm.run("uninstall", release, "--ignore-not-found", check=False)
