"""The operator through faults of the control plane itself: kube-apiserver restarted (etcd's data kept), and a watch
whose resourceVersion etcd has compacted away (410 Gone).

Both restart the API server, which would stall every other test on the run's shared cluster: the tests here start a
cluster of their own (``tools/kube-cluster up`` in a temporary folder, without the LeaderWorkerSet controller, about
15 s warm). On a foreign cluster (``MEGATRON_KUBECONFIG``) they skip: nothing here may restart its API server or
compact its etcd.

That cluster's API server runs with ``--watch-cache=false`` and ``--etcd-compaction-interval=0`` (``tools/kube-cluster
up --apiserver-arg``, which ``restart`` keeps): watches are served by etcd itself, and etcd's history is compacted
only when a test says so. With the watch cache (the default), a restart
alone answers every reconnecting watch with 410, whatever etcd keeps: the new cache starts at etcd's current
revision (measured on this cluster: kopf's "Restarting the watch-stream" after each restart). Without it, which
resourceVersion etcd still holds decides, so the two tests are each other's control:

- the restart: ``tools/kube-cluster restart DIR kube-apiserver`` stops the process and starts it again; every open
  connection, the operator's watch streams included, breaks. kopf reconnects from the resourceVersion it last saw,
  etcd still holds it, and the watch goes on where it was: no 410.
- the 410: two writes elsewhere move etcd's revision past what the operator's watch last saw, then etcd is compacted
  at its current revision (etcd's v3 HTTP gateway, ``POST /v3/kv/compaction``, with the API server's own client
  certificate), then the API server is restarted so that kopf must continue its watch from that resourceVersion:
  etcd answers that it is compacted, the API server sends a 410 Gone ERROR event, and kopf lists afresh.

In both, a spec change made after the fault must converge: the operator's timer reads the resource from kopf's
watch-fed cache, so a stalled watch would keep reconciling the old spec.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from .real_cluster import TOOL, KubeCluster, Namespace
from .real_fleet import Fleet, placement_problems
from .real_tools import MI, clients, example, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "llama-1b"
#: The API server's flags for these tests (see the module)
FLAGS = ("--watch-cache=false", "--etcd-compaction-interval=0")


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """A cluster of this module's own (see the module's docstring)."""
    if os.environ.get("MEGATRON_KUBECONFIG") and not os.environ.get("MEGATRON_KUBE_CLUSTER_DIR"):
        pytest.skip("restarts kube-apiserver and compacts etcd: only on a tools/kube-cluster cluster of its own, "
                    "not on the foreign cluster MEGATRON_KUBECONFIG names")
    folder = tmp_path_factory.mktemp("faults") / "cluster"
    done = subprocess.run([str(TOOL), "up", str(folder), "--without-lws", *(f"--apiserver-arg={a}" for a in FLAGS)],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"tools/kube-cluster up failed:\n{done.stderr[-4000:]}"
    try:
        yield KubeCluster(folder / "kubeconfig", folder)
    finally:
        subprocess.run([str(TOOL), "down", str(folder)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fault_fleet(own_cluster: KubeCluster, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Fleet]:
    """A namespace on the module's cluster, with the chart's RBAC, and the single-GPU example's prerequisites."""
    namespace = request.node.name.replace("_", "-")[:50].rstrip("-")
    own_cluster.kubectl("create", "namespace", namespace)
    fleet = Fleet(*clients(Namespace(namespace, own_cluster)), tmp_path)
    fleet.install_chart_rbac()
    try:
        yield fleet
    finally:
        fleet.close()


def _engines_placed(fleet: Fleet, count: int) -> bool:
    pods = fleet.engine_pods(NAME)
    status = (fleet.mi(NAME) or {}).get("status") or {}
    return len(pods) == count and not placement_problems(fleet.kubectl, pods, 1) \
        and status.get("engines", {}).get("ready") == count


def _start(fleet: Fleet) -> Any:
    """The single-GPU example under an operator (the chart's ServiceAccount), Ready with one engine group."""
    resource = example("single-gpu.yaml", fleet.kubectl.namespace)
    fleet.prerequisites(resource)
    operator = fleet.operator()
    fleet.kubectl.apply([resource])
    until(lambda: _engines_placed(fleet, 1), 90, "one engine pod Running and counted ready")
    return operator


def _etcd(cluster: KubeCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call of etcd's v3 HTTP gateway, with the client certificate kube-apiserver uses."""
    assert cluster.directory is not None
    pki = cluster.directory / "pki"
    port = json.loads((cluster.directory / "ports.json").read_text())["etcd-client"]
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "apiserver-etcd-client.crt"), str(pki / "apiserver-etcd-client.key"))
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, context=context, timeout=30) as answer:
        return json.loads(answer.read())


def _compact_etcd(cluster: KubeCluster) -> int:
    """Compact etcd at its current revision (physically: the history before it is gone); returns the revision."""
    revision = int(_etcd(cluster, "/v3/kv/range", {"key": "AA==", "count_only": True})["header"]["revision"])
    _etcd(cluster, "/v3/kv/compaction", {"revision": str(revision), "physical": True})
    return revision


def _scale_converges(fleet: Fleet, replicas: int) -> None:
    fleet.kubectl.run("scale", f"{MI}/{NAME}", f"--replicas={replicas}")
    until(lambda: _engines_placed(fleet, replicas), 120,
          f"{replicas} engine pods Running and counted ready after the change")


#: kopf's line (--verbose) when a watch ends with 410 Gone and it lists the resources again
RELISTS = "Restarting the watch-stream for megatroninferences"
#: kopf's line for a watch request that reached the server, with the resourceVersion it continues from
RESUMED = re.compile(r"succeeded: GET \S+/megatroninferences\?watch=true\S*&resourceVersion=(\d+)")


def _resumed_from(log: str) -> list[int]:
    """The resourceVersions the operator's MegatronInference watch was resumed from, in ``log``'s order."""
    return [int(m.group(1)) for m in RESUMED.finditer(log)]


def test_a_spec_change_after_an_api_server_restart_converges(fault_fleet: Fleet, own_cluster: KubeCluster):
    operator = _start(fault_fleet)
    before = len(operator.log())
    own_cluster.restart("kube-apiserver")
    until(lambda: _resumed_from(operator.log()[before:]), 60, "the watch resumed through the new server")
    _scale_converges(fault_fleet, 2)
    assert RELISTS not in operator.log()  # the control of the 410 below: etcd still held the watch's revision
    assert operator.process is not None and operator.process.poll() is None, operator.log()[-3000:]
    # and the status the operator writes is of the new spec, through the new server
    mi = fault_fleet.mi(NAME)
    assert mi["status"]["observedGeneration"] == mi["metadata"]["generation"]


def test_a_watch_compacted_away_gets_410_and_the_operator_lists_again(fault_fleet: Fleet, own_cluster: KubeCluster):
    operator = _start(fault_fleet)
    assert RELISTS not in operator.log()
    # etcd's revision moves on by two writes: compacted at the second, the first revision a watch resumed from the
    # operator's would start at (its own + 1) is gone
    fault_fleet.kubectl.run("create", "configmap", "past-the-watch", "--from-literal=a=b")
    fault_fleet.kubectl.run("label", "configmap", "past-the-watch", "moved=on")
    compacted = _compact_etcd(own_cluster)
    before = len(operator.log())
    own_cluster.restart("kube-apiserver")
    # the reconnecting watch's resourceVersion is older than the compaction: 410, and kopf relists
    until(lambda: RELISTS in operator.log()[before:], 60, "kopf's restart of the MegatronInference watch after a 410")
    (resumed, *_) = _resumed_from(operator.log()[before:])
    assert resumed + 1 < compacted, (resumed, compacted)
    _scale_converges(fault_fleet, 2)
    assert operator.process is not None and operator.process.poll() is None, operator.log()[-3000:]
