"""What the operator's tests on a real cluster drive it with: ``kubectl`` and ``helm`` as processes (the real
clients, as a user runs them), the operator as a process of its own that holds a ServiceAccount's token, and
polling.

The cluster comes from :mod:`tests.operator.real_cluster` (one per run; a namespace per test): :func:`clients`
gives a test's ``kubectl`` and ``helm`` in its namespace, so that a test reads like the commands a user would type.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import yaml

from .real_reads import TIMEOUT, Reader, Resource

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "megatron-operator"
CRD_PATH = ROOT / "manifests" / "crds" / "serving.megatron.dev_megatroninferences.yaml"
EXAMPLES = ROOT / "manifests" / "examples"
VENDORED = ROOT / "tests" / "operator" / "vendored_crds"

#: Our resource, fully qualified: a short name or plural alone may resolve to another group's kind.
MI = "megatroninferences.serving.megatron.dev"

#: The operator's key for coordinator tokens in these tests (the chart's Secret holds a random one).
TOKEN_KEY = "real-cluster-tests-key"


def until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


class Kubectl:
    """``kubectl`` against one cluster, in one namespace (``-n``), as the real client: what a user types (apply,
    patch, delete, drain, scale, rollout, ``--as``) runs the real ``kubectl``.

    Reads (:meth:`get`, :meth:`events`) go through the API in-process (:class:`~tests.operator.real_reads.Reader`),
    with the answers ``kubectl get -o json`` gives: they are the tests' polls, and a ``kubectl`` process for each
    (about 50 ms of CPU: a Go binary's start, its kubeconfig, discovery, printing) cost some 3,700 processes and
    190 CPU-seconds per suite run, a tenth of its CPU on two cores (docs/testing.md).
    """

    def __init__(self, kubeconfig: pathlib.Path, namespace: str, binary: str):
        self.kubeconfig = pathlib.Path(kubeconfig)
        self.namespace = namespace
        self.binary = binary
        self.reader = Reader(self.kubeconfig)

    def run(self, *args: str, input: str | None = None, check: bool = True,
            kubeconfig: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [self.binary, f"--kubeconfig={kubeconfig or self.kubeconfig}", "-n", self.namespace, *args]
        done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {done.returncode}: {done.stderr.strip() or done.stdout}")
        return done

    def apply(self, objects: list[dict[str, Any]] | str, *flags: str, check: bool = True) -> \
            subprocess.CompletedProcess[str]:
        text = objects if isinstance(objects, str) else yaml.safe_dump_all(objects, sort_keys=False)
        return self.run("apply", "-f", "-", *flags, input=text, check=check)

    def put(self, objects: list[dict[str, Any]] | str) -> None:
        """A server-side apply of each object through the API in-process (``kubectl apply --server-side``'s request,
        field manager ``tests``), for what a fixture makes in the user's stead: the nodes a cloud provider adds, the
        RBAC ``helm install`` would. :meth:`apply` stays the user's ``kubectl apply``."""
        docs = objects if isinstance(objects, list) else [d for d in yaml.safe_load_all(objects) if d]
        api = self.reader.api()
        for doc in docs:
            group, _, version = doc["apiVersion"].rpartition("/")
            resource = self.reader.kinds.resolve(api, f"{doc['kind']}.{group}" if group else doc["kind"])
            path = Resource(f"/apis/{group}/{version}" if group else f"/api/{version}", resource.plural, resource.kind,
                            doc["apiVersion"], resource.namespaced).path(
                doc["metadata"].get("namespace", self.namespace), doc["metadata"]["name"])
            request = api.param_serialize("PATCH", path, query_params=[("fieldManager", "tests"), ("force", "true")],
                                          header_params={"Content-Type": "application/apply-patch+yaml",
                                                         "Accept": "application/json"},
                                          body=doc, auth_settings=["BearerToken"])
            response = api.call_api(*request, _request_timeout=TIMEOUT)
            body = response.read()
            if not 200 <= response.status <= 299:
                raise AssertionError(f"apply {doc['kind']}/{doc['metadata']['name']} -> {response.status}: "
                                     f"{body.decode(errors='replace').strip()}")

    def get(self, kind: str, name: str | None = None, *selector: str) -> Any:
        """The object (``None`` when it does not exist), or the list's items without a name; ``kind`` as kubectl
        names it (``pdb``, ``nodes``, a comma-separated list), ``selector`` as ``-l=``, ``--selector=`` or
        ``--field-selector=``."""
        return self.reader.get(self.namespace, kind, name, selector)

    def events(self, name: str) -> list[dict[str, Any]]:
        """Events of the object named ``name``, oldest first (by ``eventTime``, to the microsecond, where the poster
        set it: ``lastTimestamp`` has whole seconds, and two Events of one second would come in any order)."""
        items = self.get("events", None, f"--field-selector=involvedObject.name={name}")
        return sorted(items, key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "")


def clients(namespace: Any) -> tuple["Kubectl", "Helm"]:
    """``kubectl`` and ``helm`` of the run's cluster in a test's namespace (a ``real_cluster.Namespace``), with
    the CRDs the tests need installed (:func:`install_crds`)."""
    cluster = namespace.cluster
    kubectl = Kubectl(cluster.kubeconfig, namespace.name, cluster.binary("kubectl"))
    install_crds(kubectl)
    return kubectl, Helm(cluster.kubeconfig, namespace.name, cluster.binary("helm"))


#: The clusters (kubeconfig paths) this process installed the CRDs into: once is enough for a run.
_INSTALLED: set[str] = set()


def install_crds(kubectl: "Kubectl") -> None:
    """Ours and the third-party kinds the examples use (not LeaderWorkerSet's: the cluster serves it where its
    controller runs, and only there), server-side as large CRDs are applied; once per cluster and process."""
    if str(kubectl.kubeconfig) in _INSTALLED:
        return
    paths = [CRD_PATH, *sorted(VENDORED.glob("*.yaml"))]
    for path in paths:
        kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for path in paths:
        (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
        established(kubectl, doc["metadata"]["name"])
    _INSTALLED.add(str(kubectl.kubeconfig))


def established(kubectl: "Kubectl", crd: str) -> None:
    """Until CRD ``crd`` is Established, read in-process: ``kubectl wait --for=condition=Established`` fails at once on
    a CRD whose status has no conditions yet, as right after it is made ("status.conditions accessor error: <nil>",
    once in a CI run here), and costs a process."""
    until(lambda: condition(kubectl.get("crd", crd), "Established").get("status") == "True", 60,
          f"CRD {crd} Established")


class Helm:
    """``helm`` against one cluster, in one namespace."""

    def __init__(self, kubeconfig: pathlib.Path, namespace: str, binary: str):
        self.kubeconfig = pathlib.Path(kubeconfig)
        self.namespace = namespace
        self.binary = binary
        self.home = self.kubeconfig.parent / f"helm-home-{namespace}"  # helm's caches, not the user's

    def run(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        cmd = [self.binary, f"--kubeconfig={self.kubeconfig}", "-n", self.namespace, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} -> {done.returncode}: {done.stderr.strip() or done.stdout}")
        return done


def service_account_kubeconfig(kubectl: Kubectl, account: str, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig that authenticates as ServiceAccount ``account`` of the namespace (a TokenRequest token, as the
    kubelet mounts into the operator's pod), with the admin kubeconfig's server and CA. The TokenRequest is the
    kubelet's part, so it goes in-process (what ``kubectl create token --duration=2h`` asks for), not as a process."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 7200}}
    token = kubernetes.client.CoreV1Api(kubectl.reader.api()).create_namespaced_service_account_token(
        account, kubectl.namespace, request).status.token
    admin = yaml.safe_load(kubectl.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    config = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster], "current-context": "operator",
              "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "operator",
                                                             "namespace": kubectl.namespace}}],
              "users": [{"name": "operator", "user": {"token": token}}]}
    path.write_text(yaml.safe_dump(config))
    return path


class OperatorProcess:
    """``python -m megatron_operator operator`` (kopf) as a process of its own, serving one namespace with the
    credentials of ``kubeconfig`` (a ServiceAccount's), its log in a file the test can read; ``--standalone`` unless
    ``peering`` gives kopf's peering options instead."""

    def __init__(self, kubeconfig: pathlib.Path, namespace: str, log: pathlib.Path, *, scanning: bool = True,
                 env: dict[str, str] | None = None, peering: tuple[str, ...] = ("--standalone",)):
        self.kubeconfig, self.namespace, self.log_path, self.peering = kubeconfig, namespace, log, peering
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "MEGATRON_OPERATOR_TOKEN_KEY": TOKEN_KEY,
                    "MEGATRON_OPERATOR_RECONCILE_INTERVAL": "1", "MEGATRON_OPERATOR_CONNECT_TIMEOUT": "1",
                    "MEGATRON_OPERATOR_COMMAND_TIMEOUT": "10",
                    "MEGATRON_OPERATOR_SCANNING": "true" if scanning else "false", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "OperatorProcess":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "megatron_operator", "operator", *self.peering, "--verbose",
                 f"--namespace={self.namespace}"], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (kopf stops its handlers) or SIGKILL (a crash mid-reconcile); waits for the exit."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> "OperatorProcess":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def example(name: str, namespace: str) -> dict[str, Any]:
    """``manifests/examples/<name>`` in ``namespace``."""
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    doc["metadata"]["namespace"] = namespace
    return doc


def release_pods(kubectl: Kubectl, release: str) -> list[dict[str, Any]]:
    """The pods of a helm release (the operator's) that are not on their way out."""
    return [p for p in kubectl.get("pods", None, f"-l=app.kubernetes.io/instance={release}")
            if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """The status condition ``kind`` of ``obj`` ({} when absent)."""
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})
